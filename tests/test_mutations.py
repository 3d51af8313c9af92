"""The tests see every cut: each mutant below, applied alone, makes at least one of its tests fail.

Two kinds of mutant, neither tied to the wording of the code:
- a named constant (mhla_cli.numerics and the other modules' named tolerances) times 1e4 and 1e-4, set
  on its module (`setattr`) in a fresh interpreter before any other module of the package is imported,
  so that every `from ..numerics import X` binds the mutant; after the run, any module still holding the
  old value is reported (a copy the mutation did not reach);
- a structural mutant: one AST node of one function (by its qualified name), found by its shape and
  replaced; the module is compiled from the mutated tree in that fresh interpreter (an import hook).
A target that is missing, or found more than once, fails loudly: the test never passes by skipping.
A mutant whose tests need an optional extra names it (`requires`): the main run sets it aside when the extra
is missing and `test_every_mutation_needing_extras_fails_its_tests` (.ci/run's torch phase, every extra
installed) runs those; a selection in which no test runs (every one skipped) is an error, not a pass.

Each mutant runs its tests (`pytest -x`) in a subprocess: killed when pytest exits 1. The same tests
first pass on the unmutated code (so a mutant applied to the code by hand fails this test too). The cut
tests (tests/test_numerics.py `test_cut_*`) place cases at 1e-2 x and 1e2 x of each constant's value
as docs/formats.md states it, against plain numpy (tests/_reference.py), so a changed constant moves
its cut past one of them. A cross-cutting test: slow, run by .ci/run (`python -m pytest -q -m slow
tests/test_mutations.py`); `python tests/test_mutations.py [NAME ...]` prints the table.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BOUNDARY = ("tests/test_numerics.py", "tests/test_factorization.py", "-k", "cut_ or spectral_ridge")


# ---------------------------------------------------------------------------------------------
# the mutants

@dataclass(frozen=True)
class Constant:
    """`module.name` times `factor`."""
    module: str
    name: str
    factor: float
    tests: tuple[str, ...] = BOUNDARY

    @property
    def label(self) -> str:
        return f"{self.name} x{self.factor:g}"


@dataclass(frozen=True)
class Structural:
    """In `module`, inside the function `function` (qualified: Class.method), the one node for which
    `match(node)` holds is replaced by `change(node)` (a node, or None to delete a statement)."""
    label: str
    module: str
    function: str
    match: Callable[[ast.AST], bool] = field(compare=False)
    change: Callable[[ast.AST], ast.AST | None] = field(compare=False)
    tests: tuple[str, ...] = BOUNDARY
    requires: tuple[str, ...] = ()  # the optional modules its tests need (torch, transformers, ...)


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _assigns(node: ast.AST, target: str) -> bool:
    """`target = ...` (a name) or `self.target = ...` (an attribute)."""
    if not isinstance(node, ast.Assign) or len(node.targets) != 1:
        return False
    t = node.targets[0]
    return _is_name(t, target) or isinstance(t, ast.Attribute) and t.attr == target


def _calls(node: ast.AST, func: str) -> bool:
    """A call of `func` (a name or an attribute, e.g. argmin of np.argmin)."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return _is_name(f, func) or isinstance(f, ast.Attribute) and f.attr == func


def _times(factor: float, node: ast.expr) -> ast.expr:
    return ast.BinOp(ast.Constant(factor), ast.Mult(), node)


def _replace_arg(node: ast.Call, i: int, new: ast.expr) -> ast.Call:
    node.args[i] = new
    return node


def _expr(source: str) -> ast.expr:
    return ast.parse(source, mode="eval").body


def _returns_first(source: str) -> Callable[[ast.AST], ast.AST]:
    """The function's body made `source; <the old body>` (an early return)."""
    def change(fn: ast.AST) -> ast.AST:
        fn.body = ast.parse(source).body + fn.body
        return fn
    return change


DISPATCH_TESTS = ("tests/test_learn.py", "-k", "storage or affine_block or in_memory")

STRUCTURAL = [
    Structural("structure cut x1e6", "mhla_cli.statistics.structure", "from_traces",
               lambda n: _assigns(n, "cut"), lambda n: ast.Assign(n.targets, _times(1e6, n.value))),
    Structural("change_basis keeps basis_last_token_gram", "mhla_cli.statistics.algebra", "FeaturesAlgebra.change_basis",
               lambda n: _assigns(n, "basis_last_token_gram"), lambda n: None),
    Structural("null weight without its P_Z term", "mhla_cli.solve.certificate", "_null_weights",
               lambda n: isinstance(n, ast.AugAssign) and _is_name(n.target, "weight"), lambda n: ast.Pass()),
    Structural("observed-span rule 1e-6", "mhla_cli.numerics", "observed_span_tol",
               lambda n: isinstance(n, ast.Return), lambda n: ast.Return(ast.Constant(1e-6))),
    Structural("certify's tolerance with the block's n", "mhla_cli.solve.certificate", "certify_features",
               lambda n: _calls(n, "numerical_tolerance") and len(n.args) == 2,
               lambda n: _replace_arg(n, 1, _expr("fac.n"))),
    Structural("the verdict from either proof string", "mhla_cli.solve.certificate", "certify_features",
               lambda n: _assigns(n, "identifiable"), lambda n: ast.Assign(n.targets, _expr("proof.startswith('cholesky')"))),
    Structural("train MSE without tr(target_gram)", "mhla_cli.solve.lstsq", "_train_mse_b",
               lambda n: _assigns(n, "sse") and isinstance(n.value, ast.BinOp) and isinstance(n.value.op, ast.Add),
               lambda n: ast.Assign(n.targets, n.value.left)),
    Structural("ridge in the wrong units", "mhla_cli.linalg.factorization", "Factorization.ridge_solve",
               lambda n: _calls(n, "shifted_solve"), lambda n: _replace_arg(n, 1, _expr("ridge * self.scale"))),
    Structural("ridge: a Cholesky for every r > 0", "mhla_cli.linalg.factorization", "Factorization.ridge_solve",
               lambda n: isinstance(n, ast.Compare) and _is_name(n.left, "ridge") and _is_name(n.comparators[0], "tol"),
               lambda n: ast.Compare(n.left, n.ops, [ast.Constant(0)])),
    Structural("ridge: the range solve keeps the null part", "mhla_cli.linalg.backends", "HostMatrix.range_solve",
               lambda n: isinstance(n, ast.Return) and isinstance(n.value, ast.BinOp) and isinstance(n.value.op, ast.Sub),
               lambda n: ast.Return(n.value.left)),
    Structural("CV without its rounding floor", "mhla_cli.solve.ridge_cv", "cv_ridge",
               lambda n: _calls(n, "argmin") and n.args and _calls(n.args[0], "maximum"),
               lambda n: _replace_arg(n, 0, n.args[0].args[0]), tests=("tests/test_ridge_cv.py",)),
    Structural("the certificate on the raw Gram (no whitening)", "mhla_cli.statistics.basis", "whitening",
               lambda n: isinstance(n, ast.FunctionDef), _returns_first("return np.eye(token_gram.shape[0])"),
               tests=("tests/test_certificate.py", "-k", "token_scale")),
    Structural("the observed domain's map off by 2", "mhla_cli.solve.domains", "Observed._factorize",
               lambda n: _calls(n, "orth_pair_map"), lambda n: _times(2.0, n),
               tests=("tests/test_certificate.py", "-k", "domain_object")),
    Structural("--affine-from without the window fingerprint check", "mhla_cli.statistics.affine_sums",
               "WideSource.chunks", lambda n: isinstance(n, ast.Expr) and _calls(n.value, "_check_windows"),
               lambda n: ast.Pass(), tests=("tests/test_affine_sums.py", "-k", "every_window")),
    Structural("--affine-from takes a sampled fingerprint without window digests", "mhla_cli.statistics.affine_sums",
               "WideSource.open", lambda n: isinstance(n, ast.If) and "COMPLETE_SCOPES" in ast.unparse(n.test),
               lambda n: None, tests=("tests/test_affine_sums.py", "-k", "without_window")),
    Structural("heads of bias terms written uncentred", "mhla_cli.api.learn", "export_heads",
               lambda n: _assigns(n, "centre"), lambda n: ast.Pass(),
               tests=("tests/test_bias_terms.py", "-k", "far_from")),
    Structural("fit's R^2 without the scoring pass", "mhla_cli.cli.fit", "_fit",
               lambda n: isinstance(n, ast.If) and "targets_underflow" in ast.unparse(n.test),
               lambda n: None, tests=("tests/test_scores.py", "-k", "any_target_scale")),
    # issue 43, items 4 and 5: the cluster reports what one machine reports; compare and probes at every position
    Structural("cluster train MSE per d, not per output", "mhla_cli.solve.cluster", "_train_mse",
               lambda n: isinstance(n, ast.Attribute) and n.attr == "n_outputs",
               lambda n: ast.Attribute(n.value, "d", ast.Load()),
               tests=("tests/test_cluster.py", "-k", "bias_terms_train")),
    Structural("a Zarr store read as an HDF5 file", "mhla_cli.statistics.stream", "data_kind",
               lambda n: isinstance(n, ast.Return), lambda n: ast.Return(_expr("formats.kind_of(path)")),
               tests=("tests/test_cluster.py", "-k", "bias_terms_train")),
    Structural("lambda_min reported against the verdict", "mhla_cli.numerics", "lambda_min_of_verdict",
               lambda n: isinstance(n, ast.FunctionDef), _returns_first("return float(estimate), None"),
               tests=("tests/test_numerics.py", "-k", "verdict or contradict")),
    Structural("compare --on scores the last tokens only", "mhla_cli.model.compare", "scored_layouts",
               lambda n: isinstance(n, ast.FunctionDef), _returns_first("return (LAST,)"),
               tests=("tests/test_compare.py", "-k", "every_position")),
    Structural("compare's verdict ignores its function change", "mhla_cli.model.compare", "compare",
               lambda n: isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Subscript)
               and isinstance(n.targets[0].slice, ast.Constant) and n.targets[0].slice.value == "same",
               lambda n: ast.Assign(n.targets, _expr("bool(rel <= tol)")),
               tests=("tests/test_compare.py", "-k", "never_contradicts")),
    Structural("probes' unresolved directions counted in own units", "mhla_cli.solve.probes", "null_space",
               lambda n: _calls(n, "unresolved_canonical"), lambda n: _expr("basis_mod.unresolved(feats.token_gram)"),
               tests=("tests/test_probes.py", "-k", "never_move or unit_free_over")),
    Structural("a probe's unresolved component cut by the own-unit rounding of z A", "mhla_cli.solve.probes",
               "unresolved_tokens", lambda n: _calls(n, "abs") and _is_name(n.args[0], "AU"),
               lambda n: _expr("np.abs(ns.token_basis)"), tests=("tests/test_probes.py", "-k", "never_move or unit_free_over")),
    # the manifest (mhla_cli.io.formats.manifest): each comparison removed, a damaged file must be refused anyway
    Structural("an HDF5 dataset read without its checksum", "mhla_cli.io.formats.reading", "_check_data",
               lambda n: isinstance(n, ast.Expr) and _calls(n.value, "check_array"), lambda n: None,
               tests=("tests/test_corruption.py", "-k", "damaged_file and edit")),
    Structural("a header read without its checksum", "mhla_cli.io.formats.manifest", "load",
               lambda n: isinstance(n, ast.If) and isinstance(n.test, ast.Compare) and _calls(n.test.left, "attrs_digest"),
               lambda n: None, tests=("tests/test_corruption.py", "-k", "edit-attr")),
    Structural("a store's tile read without its checksum", "mhla_cli.io.formats.manifest", "check_tile",
               lambda n: isinstance(n, ast.If), lambda n: None, tests=("tests/test_corruption.py", "-k", "chunk")),
    Structural("a deleted manifest taken for an old file", "mhla_cli.io.formats.manifest", "load",
               lambda n: isinstance(n, ast.If) and isinstance(n.test, ast.BoolOp)
               and any(_is_name(getattr(v, "comparators", [None])[0], "MANIFEST_FORMAT") for v in n.test.values),
               lambda n: None, tests=("tests/test_corruption.py", "-k", "merge_check_every_tile")),
    # issue 43, items 2 and 3: nothing lost (outputs), no hang and no internal error on a cluster
    Structural("an output replaces any file", "mhla_cli.io.formats.writing", "check_output_path",
               lambda n: isinstance(n, ast.Expr) and _calls(n.value, "check_replaceable"), lambda n: ast.Pass(),
               tests=("tests/test_bad_inputs.py", "-k", "users_file or another_kind")),
    Structural("an output around an input", "mhla_cli.io.formats.writing", "check_output_path",
               lambda n: _calls(n, "overlaps"), lambda n: ast.Constant(False),
               tests=("tests/test_formats.py", "-k", "replaces_only")),
    Structural("a store output replaces any directory", "mhla_cli.statistics.files.store_location", "check_output",
               lambda n: isinstance(n, ast.Expr) and _calls(n.value, "check_replaceable"), lambda n: ast.Pass(),
               tests=("tests/test_bad_inputs.py", "-k", "stores_never")),
    Structural("a store output at, in or around an input", "mhla_cli.statistics.files.store_location", "check_output",
               lambda n: _calls(n, "inside"), lambda n: ast.Constant(False),
               tests=("tests/test_bad_inputs.py", "-k", "stores_never")),
    Structural("commit without putting the old store back", "mhla_cli.statistics.files.store_location", "commit",
               lambda n: isinstance(n, ast.ExceptHandler), lambda n: ast.ExceptHandler(n.type, n.name, [ast.Raise()]),
               tests=("tests/test_store_location.py",)),
    Structural("no bound on the wait for a worker", "mhla_cli.statistics.distributed.scheduler", "wait_for_workers",
               lambda n: isinstance(n, ast.Compare) and "deadline" in ast.unparse(n), lambda n: ast.Constant(False),
               tests=("tests/test_cluster.py", "-k", "without_workers")),
    Structural("no bound on the scheduler's answer", "mhla_cli.statistics.distributed.scheduler", "probe",
               lambda n: _calls(n, "wait_for"), lambda n: _replace_arg(n, 1, ast.Constant(None)),
               tests=("tests/test_cluster.py", "-k", "never_answers")),
    Structural("no check of the workers' memory", "mhla_cli.statistics.distributed.scheduler", "check_worker_memory",
               lambda n: isinstance(n, ast.FunctionDef), _returns_first("return None"),
               tests=("tests/test_scheduler.py", "-k", "memory_cut")),
    Structural("no watch of the running workers", "mhla_cli.statistics.distributed.scheduler", "Watch._run",
               lambda n: isinstance(n, ast.Compare) and "self.timeout" in ast.unparse(n),
               lambda n: ast.Constant(False), tests=("tests/test_scheduler.py", "-k", "stop_running")),
    # issue 44, item 4: the tiled factorization as a task graph whose keys are a function of its inputs (on a
    # cluster, equal keys are equal results: a key that misses an input hands back another graph's result)
    Structural("tiled graph keys without the shift or the vectors", "mhla_cli.linalg.tiled_matrix", "TiledMatrix.graph",
               lambda n: _calls(n, "tokenize") and any(isinstance(a, ast.Starred) for a in n.args),
               lambda n: (setattr(n, "args", n.args[:2]), n)[1], tests=("tests/test_task_graph.py", "-k", "keys")),
    Structural("tiled graph keys without the tiles' contents", "mhla_cli.linalg.task_graph", "handle_token",
               lambda n: isinstance(n, ast.Return) and _calls(n.value, "tokenize"),
               lambda n: ast.Return(ast.Constant(0)), tests=("tests/test_task_graph.py", "-k", "keys")),
    # issue 46, item 1: a TransformerLens 4 bridge cache records whether compatibility mode was on (hook_z differ)
    Structural("bridge cache without a compatibility record not refused", "mhla_cli.io.convert._roles",
               "compat_record", lambda n: isinstance(n, ast.Compare) and ast.unparse(n) == "bridge is not None",
               lambda n: ast.Constant(False), tests=("tests/test_convert_activations.py", "-k", "compatibility"), requires=("torch",)),
    Structural("compatibility records that disagree not refused", "mhla_cli.io.convert._roles", "compat_record",
               lambda n: isinstance(n, ast.Compare) and ast.unparse(n) == "len(values) > 1",
               lambda n: ast.Constant(False), tests=("tests/test_convert_activations.py", "-k", "compatibility"), requires=("torch",)),
    Structural("compatibility record not written", "mhla_cli.io.convert._writer", "_write",
               lambda n: isinstance(n, ast.For) and "attrs or {}" in ast.unparse(n.iter), lambda n: ast.Pass(),
               tests=("tests/test_convert_activations.py", "-k", "compatibility"), requires=("torch",)),
    Structural("a model applied to activations of the other compatibility mode", "mhla_cli.model.forward.stream",
               "function_and_data", lambda n: isinstance(n, ast.Expr) and _calls(n.value, "_check_capture"),
               lambda n: ast.Pass(), tests=("tests/test_convert_activations.py", "-k", "where_a_model"), requires=("torch",)),
    Structural("exported heads drop the compatibility record", "mhla_cli.api.learn", "export_heads",
               lambda n: isinstance(n, ast.If) and "compatibility_mode" in ast.unparse(n.test), lambda n: ast.Pass(),
               tests=("tests/test_convert_activations.py", "-k", "where_a_model"), requires=("torch",)),
    Structural("heads read without their compatibility record", "mhla_cli.model.heads", "Heads.load",
               lambda n: isinstance(n, ast.Compare) and ast.unparse(n) == "compat is not None",
               lambda n: ast.Constant(False), tests=("tests/test_convert_activations.py", "-k", "where_a_model"), requires=("torch",)),
    Structural("reduce drops the compatibility record", "mhla_cli.model.reduce", "apply_reduction",
               lambda n: isinstance(n, ast.If) and "COMPAT_ATTR" in ast.unparse(n.test), lambda n: ast.Pass(),
               tests=("tests/test_convert_activations.py", "-k", "where_a_model"), requires=("torch",)),
    # issue 44, item 3: a storage writes and reads its own datasets of a features file (the file asks the storage)
    Structural("storage dispatch: a form's datasets written but claimed by no storage on load",
               "mhla_cli.statistics.storage.gram_storage", "file_storages", lambda n: _calls(n, "any"),
               lambda n: ast.Constant(False), tests=("tests/test_gram_storage.py",)),
    Structural("storage dispatch: the Gram written in the full form whatever the form asked",
               "mhla_cli.statistics.files.features_file", "FeaturesFile.datasets", lambda n: _calls(n, "file_form"),
               lambda n: _replace_arg(n, 0, _expr("FULL_FORM")), tests=("tests/test_gram_storage.py",)),
    Structural("storage dispatch: the own gram written by every form", "mhla_cli.statistics.files.features_file",
               "FeaturesFile.datasets", lambda n: isinstance(n, ast.Attribute) and n.attr == "own_gram_in_file",
               lambda n: ast.Constant(True), tests=("tests/test_gram_storage.py",)),
    Structural("storage dispatch: a form's datasets not counted before a load", "mhla_cli.statistics.files.features_file",
               "expect_features", lambda n: _calls(n, "load_bytes"), lambda n: ast.Constant(0),
               tests=("tests/test_gram_storage.py",)),
    Structural("storage dispatch: the full form's Gram not written", "mhla_cli.statistics.storage.gram_dense",
               "DenseGram.file_data", lambda n: isinstance(n, ast.Return), lambda n: ast.Return(_expr("{}")),
               tests=("tests/test_gram_storage.py",)),
    # issue 46, items 2-3: fitted heads spliced into a Hugging Face model (mhla_cli/model/splice.py) and judged there
    # (mhla_cli/model/judge.py)
    Structural("splice: the padding mask not passed on", "mhla_cli.model.splice", "Splice.outputs",
               lambda n: isinstance(n, ast.Return) and ast.unparse(n) == "return self.replacement(X, mask)",
               lambda n: ast.Return(_expr("self.replacement(X, None)")),
               tests=("tests/test_splice.py", "-k", "spliced_equals_numpy and bert"), requires=("torch", "transformers")),
    Structural("splice: the context manager keeps its hooks", "mhla_cli.model.splice", "Splice.__exit__",
               lambda n: isinstance(n, ast.Expr) and ast.unparse(n) == "self.remove()", lambda n: None,
               tests=("tests/test_splice.py", "-k", "restores"), requires=("torch", "transformers")),
    Structural("splice of a layer: the projection's bias not added", "mhla_cli.model.splice", "Splice._layer_hook",
               lambda n: isinstance(n, ast.Return) and "bias" in ast.unparse(n), lambda n: ast.Return(_expr("y")),
               tests=("tests/test_splice.py", "-k", "layer_spliced"), requires=("torch", "transformers")),
    Structural("judge: the embeddings pooled over the padding too", "mhla_cli.model.judge", "run_model",
               lambda n: _assigns(n, "w"), lambda n: ast.Assign(n.targets, _expr(
                   "torch.ones_like(mask).to(torch.float64).unsqueeze(-1)")),
               tests=("tests/test_judge.py", "-k", "cosines"), requires=("torch", "transformers")),
    # issue 44: one certify and one fit (mhla_cli.api.learn) for every storage, with or without the affine block
    Structural("the one certify ignores the affine block", "mhla_cli.api.learn", "certify",
               lambda n: isinstance(n, ast.If) and ast.unparse(n.test) == "feats.affine is None",
               lambda n: ast.If(ast.Constant(True), n.body, n.orelse), tests=DISPATCH_TESTS),
    Structural("the one fit ignores the affine block", "mhla_cli.api.learn", "_fit_in_memory",
               lambda n: isinstance(n, ast.If) and ast.unparse(n.test) == "feats.affine is not None",
               lambda n: ast.If(ast.Constant(False), n.body, n.orelse), tests=DISPATCH_TESTS),
    Structural("the one certify takes tiled statistics for statistics in memory", "mhla_cli.api.learn", "certify",
               lambda n: isinstance(n, ast.BoolOp) and "TiledStatistics" in ast.unparse(n),
               lambda n: n.values[0], tests=DISPATCH_TESTS),
    Structural("the one fit takes tiled statistics for statistics in memory", "mhla_cli.api.learn", "fit",
               lambda n: isinstance(n, ast.BoolOp) and "TiledStatistics" in ast.unparse(n),
               lambda n: n.values[0], tests=DISPATCH_TESTS),
    Structural("statistics in memory sent to a cluster", "mhla_cli.api.learn", "_check_tiled",
               lambda n: isinstance(n, ast.If) and ast.unparse(n.test) == "isinstance(data, Features)",
               lambda n: None, tests=DISPATCH_TESTS),
    # targets of any width D_out (tests/test_output_width.py)
    Structural("the accumulator's targets d wide", "mhla_cli.statistics.accumulate", "Accumulator.__init__",
               lambda n: _assigns(n, "d_out"), lambda n: ast.Assign(n.targets, _expr("d")),
               tests=("tests/test_output_width.py", "-k", "numpys_lstsq")),
    Structural("statistics of different output widths added", "mhla_cli.statistics.algebra", "_check_addable",
               lambda n: isinstance(n, ast.If) and ast.unparse(n.test) == "part.d_out != acc.d_out",
               lambda n: None, tests=("tests/test_output_width.py", "-k", "do_not_add")),
    Structural("low-rank fits of another output width not refused", "mhla_cli.api.learn", "_fit_in_memory",
               lambda n: isinstance(n, ast.If) and ast.unparse(n.test) == "feats.d_out != feats.d",
               lambda n: None, tests=("tests/test_output_width.py", "-k", "low_rank")),
    Structural("fewest heads of another output width not refused", "mhla_cli.api.learn", "export_heads",
               lambda n: isinstance(n, ast.If) and ast.unparse(n.test) == "fn.coef.shape[0] != fn.d",
               lambda n: None, tests=("tests/test_output_width.py", "-k", "low_rank")),
    Structural("a model beside heads of another width compared as heads", "mhla_cli.model.compare",
               "function_distance", lambda n: _assigns(n, "with_model"),
               lambda n: ast.Assign(n.targets, ast.Constant(False)),
               tests=("tests/test_output_width.py", "-k", "compares_with_its_heads")),
    Structural("a rollout of a model of another width", "mhla_cli.model.forward.rollout", "rollout_file",
               lambda n: isinstance(n, ast.If) and ast.unparse(n.test) == "d != d_of_coef(coef)",
               lambda n: None, tests=("tests/test_output_width.py", "-k", "rollout")),
    Structural("kept targets mapped by U", "mhla_cli.model.reduce", "_reduce_chunks",
               lambda n: isinstance(n, ast.If) and ast.unparse(n.test) == "not red.keep_targets",
               lambda n: ast.If(ast.Constant(True), n.body, n.orelse),
               tests=("tests/test_output_width.py", "-k", "keep_targets")),
    # issue 45, item 3: a sum of blocks through the one dispatcher of each verb and on the command line
    Structural("blocks: certify not sent to certify_blocks", "mhla_cli.api.learn", "certify",
               lambda n: isinstance(n, ast.If) and ast.unparse(n.test) == "isinstance(data, BlockStatistics)",
               lambda n: None, tests=("tests/test_learn.py", "-k", "sum_of_blocks")),
    Structural("blocks: fit not sent to fit_blocks", "mhla_cli.api.learn", "fit",
               lambda n: isinstance(n, ast.If) and ast.unparse(n.test) == "isinstance(data, BlockStatistics)",
               lambda n: None, tests=("tests/test_cli_blocks.py", "-k", "fit_writes")),
    Structural("blocks: the options of another storage accepted", "mhla_cli.api.learn", "_check_blocks_request",
               lambda n: isinstance(n, ast.If) and "in_memory.values()" in ast.unparse(n.test),
               lambda n: None, tests=("tests/test_learn.py", "-k", "sum_of_blocks")),
    Structural("blocks: a map of another width not named", "mhla_cli.api.learn", "block_maps",
               lambda n: isinstance(n, ast.If) and ast.unparse(n.test) == "P.shape[0] != D",
               lambda n: None, tests=("tests/test_cli_blocks.py", "-k", "cannot_be_blocks")),
    Structural("blocks CLI: an option that does not apply accepted", "mhla_cli.cli.blocks", "check_given",
               lambda n: isinstance(n, ast.If) and "allowed" in ast.unparse(n.test),
               lambda n: None, tests=("tests/test_cli_blocks.py", "-k", "do_not_apply")),
    Structural("blocks predict: no outputs at every position", "mhla_cli.model.forward.stream", "_predict_sum_file",
               lambda n: _assigns(n, "samples"), lambda n: ast.Assign(n.targets, ast.Constant(None)),
               tests=("tests/test_cli_blocks.py", "-k", "every_position")),
]

# Every check of export-heads, spectrum and compare evaluated in the tokens' own coordinates (or on the
# coefficients instead of the outputs on the data): tests/test_canonical.py or test_compare.py must see each.
CANONICAL = ("tests/test_canonical.py", "tests/test_compare.py")


def _sub_key(node: ast.AST, key: str) -> bool:
    """`x["key"]`."""
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == key


def _rekey(node: ast.Subscript, key: str) -> ast.Subscript:
    node.slice = ast.Constant(key)
    return node


def _verdict(what: str) -> Callable[[ast.AST], bool]:
    """`out["judged_by"], rel = what, out[...]` in compare."""
    return lambda n: (isinstance(n, ast.Assign) and isinstance(n.value, ast.Tuple)
                      and isinstance(n.value.elts[0], ast.Constant) and n.value.elts[0].value == what)


def _verdict_on(key: str) -> Callable[[ast.AST], ast.AST]:
    def change(n: ast.Assign) -> ast.Assign:
        n.value.elts[1] = _rekey(n.value.elts[1], key)
        return n
    return change


OWN_COORDINATES = [
    Structural("heads, spectrum and --fewest in the tokens' own coordinates", "mhla_cli.model.canonical",
               "canonical_function",
               lambda n: isinstance(n, ast.If) and isinstance(n.test, ast.BoolOp) and _calls(n.test.values[0], "isinstance")
               and "coef_b" in ast.unparse(n.test),
               lambda n: ast.If(ast.BoolOp(ast.And(), [n.test, ast.Constant(False)]), n.body, n.orelse),
               tests=CANONICAL),
    Structural("the spectrum of the own coefficients", "mhla_cli.solve.spectrum", "spectrum",
               lambda n: _assigns(n, "cf") and _calls(n.value, "_scaled"),
               lambda n: ast.Assign(n.targets, _expr("canonical_function(fn.coef if isinstance(fn, Model) else fn)")),
               tests=CANONICAL),
    Structural("the reported change on the coefficients", "mhla_cli.model.canonical", "CanonicalFunction.record",
               lambda n: _calls(n, "function_change"),
               lambda n: ast.Call(ast.Attribute(n.func.value, "coef_change", ast.Load()), n.args, n.keywords),
               tests=CANONICAL),
    Structural("--fewest cut on the coefficients", "mhla_cli.model.canonical", "CanonicalFunction.change",
               lambda n: isinstance(n, ast.FunctionDef), _returns_first("return self.coef_change(c_new)"),
               tests=CANONICAL),
    Structural("--fewest's lower bound without the data", "mhla_cli.solve.lowrank.fewest", "fewest_heads",
               lambda n: isinstance(n, ast.keyword) and n.arg == "radius",
               lambda n: ast.keyword("radius", ast.Constant(None)), tests=CANONICAL),
    Structural("--max-heads auto polished in the coefficients of H(Z)", "mhla_cli.solve.spectrum", "outlier_heads",
               lambda n: isinstance(n, ast.keyword) and n.arg == "metric",
               lambda n: ast.keyword("metric", _expr("np.eye(cf.coef.shape[1])")), tests=CANONICAL),
    Structural("compare --on judged by the own-coordinate distance", "mhla_cli.model.compare", "compare",
               _verdict("data"), _verdict_on("relative_distance"), tests=CANONICAL),
    Structural("compare judged by the own-coordinate distance on the training data", "mhla_cli.model.compare",
               "compare", _verdict("training data"), _verdict_on("relative_distance"), tests=CANONICAL),
    Structural("compare --on evaluates a model's own coefficients", "mhla_cli.model.compare", "prediction_difference",
               lambda n: isinstance(n, ast.Assign) and isinstance(n.value, ast.Tuple)
               and all(_calls(e, "evaluated") for e in n.value.elts),
               lambda n: ast.Assign(n.targets, _expr("(coef_of(a), None), (coef_of(b), None)")), tests=CANONICAL),
    Structural("unreduced heads on the reduced file not refused", "mhla_cli.model.forward.stream", "_check_not_reduced",
               lambda n: isinstance(n, ast.FunctionDef), _returns_first("return None"),
               tests=("tests/test_affine_block.py", "-k", "unreduce_and_torch"), requires=("torch",)),
    Structural("convert holds every input file open", "mhla_cli.io.convert._driver", "_OneAtATime._sources",
               lambda n: isinstance(n, ast.While), lambda n: ast.Pass(),
               tests=("tests/test_convert.py", "-k", "one_or_two_at_a_time")),
    Structural("too wide tokens: reduce to the largest d memory allows", "mhla_cli.linalg.memory", "check_floor",
               lambda n: _calls(n, "min"), lambda n: _expr("fits"), tests=("tests/test_memory.py", "-k", "floor")),
    Structural("causal beside all_positions not refused", "mhla_cli.model.forward.stream", "_output_layout",
               lambda n: isinstance(n, ast.If) and ast.unparse(n.test) == "all_positions and causal",
               lambda n: None, tests=("tests/test_forward.py", "-k", "contradicting_output_layouts")),
    Structural("per-position targets of a decoder scored against the whole window", "mhla_cli.model.forward.stream",
               "_scored_info", lambda n: isinstance(n, ast.Return) and "has_targets=False" in ast.unparse(n),
               lambda n: ast.parse("return (info, None)").body[0],
               tests=("tests/test_forward.py", "-k", "all_positions_scores_per_position_targets")),
    Structural("--affine-from accumulated on a torch device", "mhla_cli.statistics.stream", "_wide_source",
               lambda n: isinstance(n, ast.If) and ast.unparse(n.test) == "not isinstance(backend, NumpyBackend)",
               lambda n: None, tests=("tests/test_stream.py", "-k", "affine_from_on_a_device"), requires=("torch",)),
]

# ---------------------------------------------------------------------------------------------
# issue 44: nets over the new code
# The sample layouts, the kernels, the bias terms, the accumulator, every Gram storage, the tiled Cholesky, the
# affine block and the forward pass: a sign, an index, a transposition, a dropped term or check, an off-by-one,
# each against the narrowest tests that compare with plain numpy (tests/_reference.py or a loop written out).

def _src(text: str, statement: bool) -> Callable[[ast.AST], bool]:
    """The statement (or expression) whose source (ast.unparse: its shape, not its layout) is `text`."""
    kind = ast.stmt if statement else ast.expr
    return lambda n: isinstance(n, kind) and ast.unparse(n) == text


def _to(text: str) -> Callable[[ast.AST], ast.AST]:
    """Replace the node by `text`: a statement for a statement, an expression for an expression."""
    return lambda n: ast.parse(text).body[0] if isinstance(n, ast.stmt) else _expr(text)


def _drop(n: ast.AST) -> ast.AST:
    return ast.Pass()


def _net(label: str, module: str, function: str, old: str, new: str | None, tests: tuple[str, ...]) -> Structural:
    """A mutant of the new code: in `module.function`, the one node `old` (its source) made `new` (None: the
    statement dropped)."""
    statement = new is None or not isinstance(ast.parse(old).body[0], ast.Expr)
    return Structural(label, f"mhla_cli.{module}", function, _src(old, statement), _drop if new is None else _to(new),
                      tests)


SAMPLES_TESTS = ("tests/test_samples.py",)
BLOCKS_TESTS = ("tests/test_blocks.py",)
HEADS_SUM_TESTS = ("tests/test_heads_sum.py",)
KERNELS_TESTS = ("tests/test_kernels.py", "tests/test_samples.py")
BIAS_TESTS = ("tests/test_bias_terms.py", "-k", "heads_and_their or unreduced or far_from or names_of")
ACCUMULATE_TESTS = ("tests/test_accumulate.py", "tests/test_stream.py", "tests/test_bidirectional.py",
                    "tests/test_causal.py", "-k", "materialised or reference or in_memory or equals_featurize")
GRAM_TESTS = ("tests/test_gram_storage.py", "tests/test_gram_dense.py", "tests/test_gram_pairs.py")
TILED_TESTS = ("tests/test_tiled_matrix.py", "-k", "blocked_cholesky or fails_exactly")
GRAM_TILED_TESTS = ("tests/test_gram_tiled.py", "-k", "sum_copy or factorization_over or what_would")
AFFINE_TESTS = ("tests/test_affine_sums.py", "tests/test_affine_block.py", "-k",
                "match_numpy or take_the_query or another_basis or fitted_exactly or hold_the_reduced or predict_files")
HULL_TESTS = ("tests/test_affine_block.py", "-k", "hull or hyperplane or layer_normed or ridge_auto")
FORWARD_TESTS = ("tests/test_forward.py", "-k", "reproduces or matches_reference or layouts_and or every_prefix or "
                 "rectangular_heads or wide_square or rollout_equals")

NEW_CODE = [
    # mhla_cli/samples.py: each layout's queries, token weights and rows
    _net("causal token weights: a prefix sum for the suffix sum", "samples", "_Causal.token_weights",
         "tail = np.cumsum(w[::-1])[::-1]", "tail = np.cumsum(w)", SAMPLES_TESTS),
    _net("last-token query rows: the first token for the last", "samples", "_Last.token_weights",
         "np.asarray(offsets[1:]) - 1", "np.asarray(offsets[:-1])", SAMPLES_TESTS),
    _net("bidirectional queries read the previous token", "samples", "_Bidirectional.queries",
         "np.asarray(X, dtype=np.float64)", "np.roll(np.asarray(X, dtype=np.float64), 1, axis=0)", SAMPLES_TESTS),
    _net("bidirectional token weights ignore the weights", "samples", "_Bidirectional.rows",
         "total = lengths if weights is None else np.add.reduceat(np.asarray(weights, dtype=np.float64), offsets[:-1])",
         "total = lengths", SAMPLES_TESTS),
    _net("bidirectional window moments X^T X for X^T W X", "samples", "_Bidirectional.rows",
         "window_products(Xw, X, offsets)", "window_products(X, X, offsets)", SAMPLES_TESTS),
    _net("rows keep the samples of weight 0", "samples", "Samples.rows",
         "np.flatnonzero(w > 0)", "np.flatnonzero(w >= 0)", SAMPLES_TESTS),
    _net("last-token and bidirectional S not divided by the length", "samples", "_windows",
         "upper /= np.diff(np.asarray(offsets, dtype=np.int64)).astype(np.float64)[:, None]", None, SAMPLES_TESTS),
    # mhla_cli/kernels.py
    _net("sequence moments: padding rows not zeroed", "kernels", "_sequence_moments", "X[~valid] = 0.0", None,
         KERNELS_TESTS),
    _net("sequence moments of equal lengths: the first token for the last", "kernels", "_sequence_moments",
         "X[:, -1, :]", "X[:, 0, :]", KERNELS_TESTS),
    _net("prefix moments of ragged chunks without the running sum", "kernels", "prefix_moments",
         "np.cumsum(block, axis=1, out=block)", None, KERNELS_TESTS),
    _net("position numbers 0-based", "kernels", "position_numbers",
         "np.arange(T) - np.repeat(offsets[:-1] - offsets[0], lengths) + 1",
         "np.arange(T) - np.repeat(offsets[:-1] - offsets[0], lengths)", KERNELS_TESTS),
    _net("length groups padded to their shortest sequence", "kernels", "length_groups",
         "L = int(sorted_len[stop - 1])", "L = int(sorted_len[start])", KERNELS_TESTS),
    _net("window products: padding rows not zeroed", "kernels", "window_products", "Xg[~valid] = 0.0", None,
         KERNELS_TESTS),
    # mhla_cli/bias_terms.py
    _net("split heads: score_key read from Q's last row", "bias_terms", "split_heads",
         "np.ascontiguousarray(Q[:, :d, d])", "np.ascontiguousarray(Q[:, d, :d])", BIAS_TESTS),
    _net("augmented heads: score_key and score_query transposed", "bias_terms", "augmented_heads",
         "Qt[:, :d, :d], Qt[:, :d, d], Qt[:, d, :d], Qt[:, d, d] = (Q, score_key, score_query, score_bias)",
         "Qt[:, :d, :d], Qt[:, d, :d], Qt[:, :d, d], Qt[:, d, d] = (Q, score_key, score_query, score_bias)",
         BIAS_TESTS),
    _net("centring: + c for - c", "bias_terms", "centring", "T[D, :d], T[D, d] = (-c, 1.0)",
         "T[D, :d], T[D, d] = (c, 1.0)", BIAS_TESTS),
    _net("centred basis: - c for + c", "bias_terms", "centred_basis",
         "out[-1] = np.asarray(c, dtype=np.float64) @ A[:-1] + A[-1]",
         "out[-1] = A[-1] - np.asarray(c, dtype=np.float64) @ A[:-1]", BIAS_TESTS),
    # mhla_cli/statistics/accumulate.py
    _net("accumulate: the query tokens' Gram unweighted", "statistics.accumulate", "Accumulator._tokens",
         "L.T @ (L if last_weights is None else L * last_weights[:, None])", "L.T @ L", ACCUMULATE_TESTS),
    _net("accumulate: rows not divided by their length", "statistics.accumulate", "Accumulator._add_rows",
         "upper /= rows.lengths[:, None]", None, ACCUMULATE_TESTS),
    _net("accumulate: rows without sqrt(w) on the query", "statistics.accumulate", "Accumulator._transposed_rows",
         "last_t *= sw", None, ACCUMULATE_TESTS),
    _net("accumulate: equal lengths without the basis", "statistics.accumulate", "Accumulator._equal_moments",
         "np.matmul(w, self.basis, out=wb)", "np.copyto(wb, w)", ACCUMULATE_TESTS),
    _net("accumulate: the derived token Gram dropped", "statistics.accumulate", "Accumulator.result",
         "token_gram = self.token_gram + self._from_basis(self._derived_token_gram)",
         "token_gram = self.token_gram", ACCUMULATE_TESTS),
    _net("accumulate: a window's query Gram not in the basis sums", "statistics.accumulate",
         "Accumulator._derived_grams", "self.basis_last_token_gram += query_b", None, ACCUMULATE_TESTS),
    _net("accumulate: weight total by count", "statistics.accumulate", "Accumulator._add_rows",
         "self.weight_sum += float(np.sum(weights)) if weights is not None else float(self.samples.count(B, T))",
         "self.weight_sum += float(self.samples.count(B, T))", ACCUMULATE_TESTS),
    # the Gram storages: mhla_cli/statistics/storage/gram_storage.py, gram_dense.py, gram_pairs.py, gram_tiled.py
    _net("dense Gram: a sum subtracts", "statistics.storage.gram_dense", "DenseGram.add",
         "self.held += other.expand()", "self.held -= other.expand()", GRAM_TESTS),
    _net("dense Gram: overwrites a read-only array", "statistics.storage.gram_dense", "DenseGram.congruence",
         "overwrite and _writeable(self.held)", "overwrite", GRAM_TESTS),
    _net("symmetry check: a tile against itself, not its mirror", "statistics.storage.gram_dense", "is_symmetric",
         "upper - lower.T", "upper - lower", GRAM_TESTS),
    _net("symmetry check skips the diagonal tiles", "statistics.storage.gram_dense", "is_symmetric",
         "range(i0, n, tile)", "range(i0 + tile, n, tile)", GRAM_TESTS),
    _net("pairs Gram: a sum keeps only the other's entries", "statistics.storage.gram_pairs", "PairsGram.add",
         "self.held.K += other.held.K", "self.held.K = other.held.K", GRAM_TESTS),
    _net("pairs Gram: the dataset's shape not checked", "statistics.storage.gram_pairs", "PairsGram.from_file",
         "K.shape != symgram.pairs_shape(q, r)", "False", GRAM_TESTS),
    _net("own Gram: overflow not refused", "statistics.storage.gram_storage", "own_of", "not own.all_finite()", "False",
         GRAM_TESTS),
    _net("tiled Gram: a sum subtracts", "statistics.storage.gram_tiled", "TiledGram.add",
         "self._map('add', np.add, other)", "self._map('add', np.subtract, other)", GRAM_TILED_TESTS),
    _net("tiled Gram: Grams tiled differently added", "statistics.storage.gram_tiled", "TiledGram._map",
         "o.held.sizes != m.sizes", "False", GRAM_TILED_TESTS),
    _net("wrap: a storage wrapped again", "statistics.storage.gram_storage", "wrap",
         "obj is None or isinstance(obj, GramStorage)", "obj is None", GRAM_TESTS),
    # the tiled Cholesky: mhla_cli/linalg/tiled_matrix.py (its tasks and the blocked loop)
    _net("tiled Cholesky: the shift at potrf again on an updated tile", "linalg.tiled_matrix", "TiledMatrix.cholesky_graph",
         "s = shift if (k, k) in fresh else 0.0", "s = shift", TILED_TESTS),
    _net("tiled Cholesky: the update adds L_i L_j^T on the diagonal", "linalg.tiled_matrix", "_update",
         "blas.dsyrk(-1.0, li, beta=1.0, c=out, lower=1, overwrite_c=1)",
         "blas.dsyrk(1.0, li, beta=1.0, c=out, lower=1, overwrite_c=1)", TILED_TESTS),
    _net("tiled Cholesky: trsm with L_kk for L_kk^T", "linalg.tiled_matrix", "_trsm",
         "blas.dtrsm(1.0, lkk, np.array(a, dtype=np.float64, order='F'), side=1, lower=1, trans_a=1)",
         "blas.dtrsm(1.0, lkk, np.array(a, dtype=np.float64, order='F'), side=1, lower=1, trans_a=0)",
         TILED_TESTS),
    _net("tiled Cholesky: the failing column off by one", "linalg.tiled_matrix", "_potrf",
         "column0 + max(int(info), 1) - 1", "column0 + max(int(info), 1)", TILED_TESTS),
    _net("tiled Cholesky: the diagonal tiles never updated", "linalg.tiled_matrix", "TiledMatrix.cholesky_graph",
         "range(j, nb)", "range(j + 1, nb)", TILED_TESTS),
    _net("tiled solve: the backward sweep with L for L^T", "linalg.tiled_matrix", "TiledFactor._backward",
         "m.submit('solve', _gemm_sub, acc, F[j, i], X[j], True)",
         "m.submit('solve', _gemm_sub, acc, F[j, i], X[j], False)",
         TILED_TESTS),
    _net("tiled product without the upper tiles", "linalg.tiled_matrix", "TiledMatrix.matmat",
         "parts[j].append((p, 1))", None, TILED_TESTS),
    # the affine block: mhla_cli/solve/affine_block.py, mhla_cli/statistics/affine_sums.py
    _net("affine block: cross sums not divided by the weight", "solve.affine_block", "extended",
         "aff.cross @ B / W", "aff.cross @ B", AFFINE_TESTS),
    _net("affine block: its moments not divided by the weight", "solve.affine_block", "_rhs",
         "ext.B.T @ feats.affine.moments / W", "ext.B.T @ feats.affine.moments", AFFINE_TESTS),
    _net("affine block: the map without the wide basis", "solve.affine_block", "fit_extended",
         "feats.affine.f_basis @ ext.B @ sol[n:]", "ext.B @ sol[n:]", AFFINE_TESTS),
    _net("affine block: what the MHLA holds counted twice", "solve.affine_block", "block_map", "Af @ Q", "Af",
         AFFINE_TESTS),
    # the wide tokens' hyperplanes and the CV of the extended features (issue 46, item 4)
    _net("affine block: the wide tokens' hyperplanes not left out", "solve.affine_block", "block_map",
         "basis_mod.whitening(aff.gram, W, round32=False) if R is None else R",
         "basis_mod.whitening(aff.gram, W, round32=False)", HULL_TESTS),
    _net("affine hull: the hyperplane's offset of the wrong sign", "solve.affine_block", "affine_hull",
         "-float(v[-1])", "float(v[-1])", HULL_TESTS),
    _net("affine hull: the held functions without the pseudo-inverse", "solve.affine_block", "block_map",
         "np.linalg.pinv(Af) @ Lb", "Af.T @ Lb", HULL_TESTS),
    _net("affine hull: the certificate names no hyperplane", "solve.affine_block", "certify_extended",
         "cert.hyperplanes = [h.to_dict() for h in ext.hull]", None, HULL_TESTS),
    _net("affine CV: the MHLA's fold path for the extended features", "solve.ridge_cv", "cv_ridge",
         "extended_path if extended else fold_path", "fold_path", HULL_TESTS),
    _net("affine CV: the held-out cross sums left out", "solve.affine_block", "held_out_sums",
         "aff.cross @ B", "0.0 * aff.cross @ B", HULL_TESTS),
    _net("affine CV: the held-out moments of the block left out", "solve.affine_block", "held_out_sums",
         "B.T @ aff.moments", "0.0 * (B.T @ aff.moments)", HULL_TESTS),
    _net("affine folds: a stored fold without its block", "statistics.folds", "load_folds",
         "folds[-1].affine = affine[k]", None, HULL_TESTS),
    _net("affine rows of last-token samples: the first token for the last", "statistics.affine_sums", "affine_rows",
         "np.asarray(offsets[1:], dtype=np.int64) - 1", "np.asarray(offsets[:-1], dtype=np.int64)", AFFINE_TESTS),
    _net("affine sums: the total not changed with the basis", "statistics.affine_sums", "AffineSums.to_f_basis",
         "self.total = C.T @ self.total", None, AFFINE_TESTS),
    _net("affine sums: the cross sums subtracted", "statistics.affine_sums", "AffineSums.add",
         "self.cross += sign * other.cross", "self.cross -= sign * other.cross", AFFINE_TESTS),
    # the forward pass: mhla_cli/model/forward/*.py
    _net("heads evaluated with Q transposed", "model.forward.evaluate", "heads_chunk",
         "np.einsum('hcl,bl->bhc', Q, last, optimize=True)", "np.einsum('hlc,bl->bhc', Q, last, optimize=True)",
         FORWARD_TESTS),
    _net("coef outputs: the output and token axes transposed", "model.forward.evaluate", "sample_outputs",
         "np.asarray(coef, dtype=np.float64).reshape(d_out, npairs, d).transpose(1, 0, 2)",
         "np.asarray(coef, dtype=np.float64).reshape(d_out, npairs, d).transpose(1, 2, 0)", FORWARD_TESTS),
    _net("last-token outputs not divided by the length", "model.forward.evaluate", "_chunk_moments",
         "S /= np.diff(np.asarray(offsets, dtype=np.int64)).astype(np.float64)[:, None, None]", None, FORWARD_TESTS),
    _net("the affine map of the wide tokens subtracted", "model.forward.evaluate", "_with_affine",
         "out + affine_rows(wide, offsets, CAUSAL if per_position else LAST) @ affine.T",
         "out - affine_rows(wide, offsets, CAUSAL if per_position else LAST) @ affine.T", AFFINE_TESTS),
    _net("rollout: the length not counting the generated tokens", "model.forward.rollout", "rollout_chunk",
         "n += 1.0", None, FORWARD_TESTS),
    _net("rollout: the running S without the generated token", "model.forward.rollout", "rollout_chunk",
         "S += y[:, :, None] * y[:, None, :]", None, FORWARD_TESTS),
    _net("predict on a file: the wide tokens' map not added", "model.forward.stream", "positions_range",
         "outputs = outputs + _affine_range(affine, a, offsets)", None, AFFINE_TESTS),
    # issue 44, item 2: the library's refusals keep their remedies for the CLI to word in its options
    _net("a pickled refusal loses its remedies", "errors", "Refused.__reduce__",
         "return (_refused, (self.template, self.path, self.remedies))", "return (InputError, (str(self),))",
         ("tests/test_errors.py", "-k", "pickling")),
    _net("a convert refusal relabelled without its remedies", "io.convert._writer", "_relabel",
         "if isinstance(exc, Refused):\n    return Refused(exc.template, where, **exc.remedies)", None,
         ("tests/test_convert.py", "-k", "relabelled")),
    _net("fit warnings in fixed words", "api.learn", "fit_warnings", "words['certify_observed']",
         "REMEDY_WORDS['certify_observed']", ("tests/test_learn.py", "-k", "fit_warnings_word")),
    # issue 45, item 3: a layer as a sum of blocks
    _net("blocks: the features not in orthonormal pair coordinates", "solve.blocks", "sample_features",
         "q.sample_upper() * basis_mod.pair_scale(M.shape[1])", "q.sample_upper()", BLOCKS_TESTS),
    _net("blocks: the heads from the orthonormal coefficients", "solve.blocks", "_block_heads",
         "coef_orth * basis_mod.feature_scale(d)[None, :]", "coef_orth", BLOCKS_TESTS),
    _net("blocks: the metric of every token alike", "solve.blocks", "_token_pass",
         "(X if c is None else X * c[:, None]).T @ X", "X.T @ X", BLOCKS_TESTS),
    _net("blocks: the affine block whitened by its sum, not its mean", "solve.blocks", "_token_pass",
         "Gf / (query_weight if query_weight > 0 else 1.0)", "Gf", BLOCKS_TESTS),
    _net("blocks: the samples' weights left out", "solve.blocks", "_fold_sums", "F * w[:, None]", "F",
         BLOCKS_TESTS),
    _net("blocks: overlapping blocks not named", "solve.blocks", "_reasons",
         "len(stats.maps) > 1 and overlap(stats.maps) < OVERLAP_TOL", "False", BLOCKS_TESTS),
    _net("blocks: the memory not checked", "solve.blocks", "block_statistics",
         "_check_memory(m, info.out_dim, int(folds), data)", None, BLOCKS_TESTS),
    _net("blocks: the bias terms read as none", "solve.blocks", "block_statistics", "read.bias_terms", "False",
         BLOCKS_TESTS),
    _net("blocks CV: the held-out targets' energy left out", "solve.blocks", "cv_ridge_blocks",
         "float(np.trace(YYv))", "0.0", BLOCKS_TESTS),
    _net("blocks: the affine map left out of the sum", "model.heads_sum", "HeadsSum.predict",
         "out = out + q @ self.affine_weight.T + self.affine_bias", None, HEADS_SUM_TESTS),
    _net("blocks: the output maps not applied", "model.heads_sum", "sum_of_blocks", "O @ h.U", "h.U",
         HEADS_SUM_TESTS),
    _net("blocks: blocks of other widths summed", "model.heads_sum", "HeadsSum.__post_init__",
         "(h.d, h.d_out) != (D, e)", "False", HEADS_SUM_TESTS),
    replace(_net("blocks: the padding gains the affine map", "model.splice", "BlocksReplacement.forward",
                             "add = add * mask.unsqueeze(-1)", None, HEADS_SUM_TESTS), requires=("torch",)),
]


def _quoted_constants() -> list[str]:
    """EPS and every constant numerics.QUOTED lists (read from the source: a constant added there is a
    mutant here without another edit)."""
    tree = ast.parse((ROOT / "mhla_cli" / "numerics.py").read_text(encoding="utf-8"))
    table = next(n.value for n in tree.body if isinstance(n, ast.Assign) and _is_name(n.targets[0], "QUOTED"))
    return ["EPS", *(k.value for k in table.keys)]


# the constants whose cut tests live beside their module rather than in tests/test_numerics.py
CUT_TESTS = {"OWN_FOLDS_COND": ("tests/test_folds.py", "-k", "cut_"),
             "AFFINE_HULL_FACTOR": ("tests/test_affine_block.py", "-k", "hull_cut")}
# named tolerances outside numerics, each with the tests of its module
OTHER_CONSTANTS = [("mhla_cli.solve.ridge_cv", "CV_FLOOR", ("tests/test_ridge_cv.py",)),
                   ("mhla_cli.io.tokens", "MIN_WEIGHT", ("tests/test_tokens.py", "-k", "cut_")),
                   ("mhla_cli.solve.blocks", "MAP_COND_MAX", BLOCKS_TESTS + ("-k", "cut")),
                   ("mhla_cli.solve.blocks", "OVERLAP_TOL", BLOCKS_TESTS + ("-k", "cut"))]

CONSTANTS = [Constant("mhla_cli.numerics", name, f, CUT_TESTS.get(name, BOUNDARY))
             for name in _quoted_constants() for f in (1e4, 1e-4)] + \
            [Constant(mod, name, f, tests) for mod, name, tests in OTHER_CONSTANTS for f in (1e4, 1e-4)]
MUTANTS = CONSTANTS + STRUCTURAL + OWN_COORDINATES + NEW_CODE

# Changes that no test can see because they change no answer (they are reported, not asserted):
EQUIVALENT = {
    "LANCZOS_TOL x0.0001": "a tighter Lanczos residual only costs iterations (lambda is already ~1e-14 relative)",
    "REFINE_MAX_RHO x0.0001": "the fit then factors Lambda~ itself instead of refining with the proof's factor: "
                              "the same answer, one more Cholesky",
    "ORTHOGONAL_TOL x0.0001": "a change of coordinates orthogonal to 1e-16 is then factorized again rather than "
                              "shared: the same spectrum",
    "ORTHOGONAL_TOL x10000": "the shared block's change of coordinates R is orthogonal to rounding or far from it",
    "ridge: a Cholesky for every r > 0": "on exact nulls the Cholesky of Lambda~ + r I fails for r below rounding "
                                         "and the range solve answers; the guard r > tol is defence for "
                                         "eigenvalues within rounding of the tolerance",
    "ridge: the range solve keeps the null part": "the null part of the solve is rounding / lambda_max (the "
                                                  "review's pinv-keeps-null-part, killed by test_structure)",
}


# ---------------------------------------------------------------------------------------------
# finding and applying a mutant

class MutantMissing(AssertionError):
    """The code no longer has the mutant's target (or has it more than once): update the mutant."""


def _module_path(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def _function(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    found = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                stub = any(_is_name(d, "overload") for d in getattr(child, "decorator_list", ()))  # no code
                if name == qualname and not isinstance(child, ast.ClassDef) and not stub:
                    found.append(child)
                walk(child, name + ".")
    walk(tree, "")
    if len(found) != 1:
        raise MutantMissing(f"{len(found)} functions named {qualname}")
    return found[0]


def mutated_tree(m: Structural) -> ast.Module:
    """The module's tree with the mutant applied; MutantMissing unless exactly one node matches."""
    tree = ast.parse(_module_path(m.module).read_text(encoding="utf-8"))
    fn = _function(tree, m.function)
    hits = [(parent, fname, node) for parent in ast.walk(fn) for fname, value in ast.iter_fields(parent)
            for node in (value if isinstance(value, list) else [value])
            if isinstance(node, ast.AST) and m.match(node)]
    if m.match(fn):  # the function itself (a change of its whole body)
        hits = [(None, None, fn)]
    if len(hits) != 1:
        raise MutantMissing(f"{m.label}: {len(hits)} nodes match in {m.module}.{m.function} (want exactly 1)")
    parent, fname, node = hits[0]
    new = m.change(node)
    if parent is not None:
        value = getattr(parent, fname)
        if isinstance(value, list):
            i = next(k for k, v in enumerate(value) if v is node)
            value[i:i + 1] = [] if new is None else [new]
            if not value:
                value.append(ast.Pass())
        else:
            setattr(parent, fname, new)
    return ast.fix_missing_locations(tree)


def check_target(m: Constant | Structural) -> None:
    """Raise MutantMissing unless the mutant's target exists once (no import of the package)."""
    if isinstance(m, Structural):
        mutated_tree(m)
        return
    tree = ast.parse(_module_path(m.module).read_text(encoding="utf-8"))
    assigned = [n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if _is_name(t, m.name)]
    if len(assigned) != 1:
        raise MutantMissing(f"{m.module}.{m.name}: assigned {len(assigned)} times at module level (want 1)")


class _MutantLoader(importlib.abc.Loader):
    def __init__(self, tree: ast.Module, path: Path) -> None:
        self.tree, self.path = tree, path

    def create_module(self, spec):  # noqa: ANN001, ANN201
        return None

    def exec_module(self, module) -> None:  # noqa: ANN001
        exec(compile(self.tree, str(self.path), "exec"), module.__dict__)


class _MutantFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, tree: ast.Module, path: Path) -> None:
        self.name, self.loader, self.path = name, _MutantLoader(tree, path), path

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201
        if fullname != self.name:
            return None
        return importlib.util.spec_from_file_location(fullname, self.path, loader=self.loader)


# child's exit code when every selected test was skipped (or none collected): the mutant was not tested
NOTHING_RAN = 98


class _Ran:
    """A pytest plugin counting the tests whose call phase ran (passed or failed, not skipped)."""

    def __init__(self) -> None:
        self.calls = 0

    def pytest_runtest_logreport(self, report) -> None:  # noqa: ANN001
        if report.when == "call" and report.outcome in ("passed", "failed"):
            self.calls += 1


def missing_requirements(m: Constant | Structural) -> list[str]:
    """The optional modules a mutant's tests need that are not installed."""
    return [r for r in getattr(m, "requires", ()) if importlib.util.find_spec(r) is None]


def child(index: int, pytest_args: list[str]) -> int:
    """In a fresh interpreter: apply mutant `index` (-1: none), run pytest; 1 when a test failed (killed),
    0 when all passed, 97 when the mutant did not reach the code it targets."""
    m = MUTANTS[index] if index >= 0 else None
    if isinstance(m, Constant):
        import importlib

        mod = importlib.import_module(m.module)
        old = getattr(mod, m.name)
        new = type(old)(old * m.factor) if isinstance(old, float) else old * m.factor
        setattr(mod, m.name, new)
    elif isinstance(m, Structural):
        if m.module in sys.modules:
            print(f"mutation: {m.module} was imported before the mutant", flush=True)
            return 97
        sys.meta_path.insert(0, _MutantFinder(m.module, mutated_tree(m), _module_path(m.module)))
    ran = _Ran()
    code = int(pytest.main(["-q", "-x", "-p", "no:cacheprovider", *pytest_args], plugins=[ran]))
    if code in (0, 5) and ran.calls == 0:  # all skipped (an optional module missing), or none collected: not run
        print("mutation: no test ran (all skipped)", flush=True)
        return NOTHING_RAN
    if isinstance(m, Constant):
        stale = [name for name, mod in list(sys.modules.items()) if name.startswith("mhla_cli")
                 and getattr(mod, m.name, new) is not new and getattr(mod, m.name, new) == old]
        if stale:
            print(f"mutation: {m.name} kept its old value in {stale}", flush=True)
            return 97
    elif isinstance(m, Structural):
        loaded = sys.modules.get(m.module)
        if loaded is not None and not isinstance(getattr(loaded, "__loader__", None), _MutantLoader):
            print(f"mutation: {m.module} was loaded without the mutant", flush=True)
            return 97
    return code


def run_mutant(index: int, tests: tuple[str, ...]) -> tuple[int, str]:
    """(pytest's exit code in the child, its last line) for mutant `index` (-1: the code as it is)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_mutations as t; "
            f"sys.exit(t.child({index}, {list(tests)!r}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = (r.stdout + r.stderr).strip().splitlines() or ["?"]
    tail = next((ln for ln in reversed(lines) if ln.startswith("mutation:")), lines[-1])
    return r.returncode, tail


# ---------------------------------------------------------------------------------------------
# tests

@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.label)
def test_every_mutant_has_its_target(mutant: Constant | Structural) -> None:
    """Each target exists exactly once (a rewording that loses it fails here, in the default suite)."""
    check_target(mutant)


def test_a_missing_target_fails_loudly() -> None:
    gone = Structural("gone", "mhla_cli.solve.ridge_cv", "cv_ridge", lambda n: _calls(n, "no_such_call"), lambda n: n)
    with pytest.raises(MutantMissing, match="0 nodes match"):
        check_target(gone)
    with pytest.raises(MutantMissing, match="0 functions"):
        check_target(Structural("gone", "mhla_cli.solve.ridge_cv", "no_such_function", lambda n: True, lambda n: n))
    with pytest.raises(MutantMissing, match="assigned 0 times"):
        check_target(Constant("mhla_cli.numerics", "NO_SUCH_TOL", 1e4))


def test_a_structural_mutant_changes_the_code() -> None:
    """The applied tree differs from the code exactly where the mutant says (here: the CV floor)."""
    m = next(s for s in STRUCTURAL if s.label == "CV without its rounding floor")
    before = ast.unparse(ast.parse(_module_path(m.module).read_text(encoding="utf-8")))
    after = ast.unparse(mutated_tree(m))
    assert "np.argmin(np.maximum(mean, floor))" in before and "np.argmin(mean)" in after
    assert "np.argmin(np.maximum(mean, floor))" not in after


def _run_mutants(mutants: list[tuple[int, Constant | Structural]]) -> None:
    """Each mutant's tests pass on the code as it is and fail on the mutant (pytest exit 1); the table printed."""
    t0 = time.perf_counter()
    for tests in dict.fromkeys(m.tests for _, m in mutants):  # the unmutated code passes every selection
        code, tail = run_mutant(-1, tests)
        assert code == 0, f"the tests {tests} fail (or none of them runs) on the code as it is: {tail}"
    killed, lines, broken = {}, [], []
    for i, m in mutants:
        check_target(m)
        code, tail = run_mutant(i, m.tests)
        if code not in (0, 1):
            broken.append(f"{m.label}: exit {code} ({tail})")
        killed[m.label] = code == 1
        lines.append(f"{m.label}: {'killed' if code == 1 else 'SURVIVED'} ({tail})")
    print("\n".join(lines) + f"\n{len(mutants)} mutants in {time.perf_counter() - t0:.0f} s")
    assert not broken, "\n".join(broken)
    survivors = [n for n, k in killed.items() if not k and n not in EQUIVALENT]
    assert not survivors, "\n".join(lines)


@pytest.mark.slow
def test_every_mutation_fails_its_tests() -> None:
    """Every mutant whose tests' optional modules are installed (the others: the test below)."""
    aside = [m.label for m in MUTANTS if missing_requirements(m)]
    if aside:
        print(f"{len(aside)} mutants set aside (their tests need an optional module not installed here; "
              "test_every_mutation_needing_extras_fails_its_tests runs them)")
    _run_mutants([(i, m) for i, m in enumerate(MUTANTS) if not missing_requirements(m)])


@pytest.mark.slow
def test_every_mutation_needing_extras_fails_its_tests() -> None:
    """The mutants whose tests need optional modules (.ci/run's torch phase installs them all): a missing one
    fails here, it is not skipped."""
    needing = [(i, m) for i, m in enumerate(MUTANTS) if getattr(m, "requires", ())]
    missing = sorted({r for _, m in needing for r in missing_requirements(m)})
    assert not missing, f"the mutants' tests need {missing}: install them (the hf and lens extras)"
    _run_mutants(needing)


if __name__ == "__main__":  # the table: python tests/test_mutations.py [LABEL ...]
    only = set(sys.argv[1:])
    for i, m in enumerate(MUTANTS):
        if only and m.label not in only:
            continue
        code, tail = run_mutant(i, m.tests)
        note = "" if code == 1 or m.label not in EQUIVALENT else f" [equivalent: {EQUIVALENT[m.label]}]"
        print(f"| {m.label} | {'killed' if code == 1 else 'SURVIVED'} | {tail}{note} |", flush=True)
