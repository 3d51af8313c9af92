"""A layer as a sum of blocks on the command line (docs/blocks.md): `fit` and `certify` with `--blocks`, and
`predict` / `export-heads` of a blocks file; the commands call these when they are given blocks."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..errors import InputError
from .console import emit_json, fmt, progress_bar, say, warn, working
from .options import check_hdf5_output, parse_auto

if TYPE_CHECKING:
    from ..solve.blocks import BlockStatistics

BlocksOpt = Annotated[list[Path] | None, typer.Option(
    "--blocks", metavar="MAPS", show_default=False,
    help="Fit (or certify) a sum of blocks, one per --blocks (docs/blocks.md): each MAPS is a reduced file of `mhla "
    "reduce` whose token map P_b (D x d_b) the block reads the wide tokens of DATA through; all blocks are fitted "
    "jointly by least squares on DATA's targets (any width), one certificate of their joint features. DATA is a "
    "tokens file of the wide tokens. Example: mhla fit layer1.h5 -o sum.h5 --blocks h0.h5 --blocks h1.h5 --affine")]
AffineOpt = Annotated[bool, typer.Option(
    "--affine", help="With --blocks: the token-wise affine map of the wide token (x, 1) beside the blocks, in the same "
    "least squares and certificate.")]
FoldsOpt = Annotated[int | None, typer.Option(
    "--folds", min=2, metavar="K", show_default=False,
    help="With --blocks --ridge auto: the K contiguous folds of sequences of its cross-validation (default 5).")]

# The folds of `fit --blocks --ridge auto` without --folds.
DEFAULT_FOLDS = 5

# The options each use of blocks takes (the parameters' names); any other given is refused.
FIT_OPTIONS = {"data", "output", "blocks", "affine", "folds", "ridge", "normalize", "attention", "chunk_size",
               "json_out", "quiet"}
CERTIFY_OPTIONS = {"data", "blocks", "affine", "min_eig", "normalize", "attention", "chunk_size", "json_out", "quiet"}
PREDICT_OPTIONS = {"model_path", "data", "output", "chunk_size", "workers", "json_out", "quiet"}
EXPORT_OPTIONS = {"model_path", "output", "json_out", "quiet"}


def check_given(allowed: set[str], what: str, path: Path) -> None:
    """Refuse (exit 2, one line) an option given on the command line that does not apply to `what`."""
    from typer._click.core import ParameterSource  # typer's click, as mhla_cli.cli.help uses it
    from typer._click.globals import get_current_context

    ctx = get_current_context()
    for p in ctx.command.params:
        source = ctx.get_parameter_source(p.name) if p.name is not None else None
        if p.name not in allowed and source not in (None, ParameterSource.DEFAULT):
            name = p.opts[0] if p.opts else str(p.name)
            raise InputError(f"{name} does not apply to {what}", path)


def is_blocks_file(path: Path) -> bool:
    """Whether `path` is a blocks file (`mhla fit --blocks`); a file that cannot be read as mhla's HDF5 (heads in
    .npz form, a damaged file) is left to the command's own reader, which says what it is."""
    from ..io.formats import kind_of

    try:
        return kind_of(path) == "blocks"
    except InputError:
        return False


def check_not_blocks(blocks: list[Path] | None, affine: bool, folds: int | None) -> None:
    """--affine and --folds are options of --blocks."""
    if not blocks and (affine or folds is not None):
        raise InputError("--affine and --folds are options of --blocks (the affine map beside a sum of blocks, the "
                         "folds of its --ridge auto); a single MHLA takes --affine-from")


def _statistics(data: Path, blocks: list[Path], affine: bool, folds: int, normalize: str | None,
                attention: str | None, chunk_size: int | None, quiet: bool) -> BlockStatistics:
    """The joint statistics of the blocks over DATA, its two passes under one progress bar."""
    from ..api.learn import block_maps
    from ..io.tokens import inspect_tokens
    from ..samples import ReadSpec
    from ..solve.blocks import block_statistics
    from ..statistics.stream import data_kind

    if data_kind(data) != "tokens":
        raise InputError("--blocks reads a tokens file of the wide tokens (a sum of blocks keeps no statistics "
                         "file): give the tokens file", data)
    maps = block_maps(blocks, data)
    info = inspect_tokens(data)
    with progress_bar("blocks", 2 * info.n_samples, quiet) as advance:
        stats = block_statistics(data, maps, read=ReadSpec(attention, normalize), affine=affine, folds=folds,
                                 chunk_size=chunk_size, progress=advance)
    if stats.layout.per_position:
        say(f"  samples: {stats.layout.words}", quiet)
        if attention is None and info.attention is None:  # shown with --quiet too: the layout decides the sum
            warn(f"{data} has per-position targets and no 'attention' attribute: read as causal by default (a "
                 "decoder's prefixes); --attention bidirectional reads an encoder's windows")
    return stats


def _record(stats: BlockStatistics, data: Path, blocks: list[Path]) -> dict[str, Any]:
    """What fit and certify --blocks report of the statistics: the blocks, their features, the samples read."""
    return {"input": str(data), "blocks": [str(b) for b in blocks], "n_blocks": len(blocks),
            "block_features": stats.sizes, "affine": stats.affine_map is not None, "n_features": stats.n_features,
            "n_samples": stats.n_samples, "n_tokens": stats.n_tokens, "normalize": stats.normalize,
            "attention": stats.layout.attention}


def _blocks_text(n: int) -> str:
    return f"{n} block" + ("" if n == 1 else "s")


def _features_text(rec: dict[str, Any]) -> str:
    sizes = [str(s) for s in rec["block_features"]]
    if rec["affine"]:
        sizes[-1] = f"affine {sizes[-1]}"
    return f"features per block {' + '.join(sizes)} = {rec['n_features']}"


def fit_blocks_cmd(data: Path, output: Path, blocks: list[Path] | None, affine: bool, folds: int | None, ridge: str,
                   normalize: str | None, attention: str | None, chunk_size: int | None, json_out: bool,
                   quiet: bool) -> None:
    """`mhla fit DATA -o OUT --blocks MAPS ...`: the sum of blocks fitted jointly, written as a blocks file."""
    from ..api.learn import fit
    from ..model.forward import predict_file

    check_not_blocks(blocks, affine, folds)
    assert blocks  # check_not_blocks refused the others
    check_given(FIT_OPTIONS, "a sum of blocks (--blocks)", data)
    check_hdf5_output(output, (data, *blocks), "a blocks file", "blocks")
    r = parse_auto(ridge, "--ridge", float)
    if folds is not None and r != "auto":
        raise InputError("--folds K are the folds of --ridge auto: give --ridge auto, or no --folds")
    t0 = time.perf_counter()
    stats = _statistics(data, blocks, affine, DEFAULT_FOLDS if folds is None and r == "auto" else (folds or 0),
                        normalize, attention, chunk_size, quiet)
    with working(f"fit: least squares over the blocks' {stats.n_features} joint features", quiet):
        heads_sum = fit(stats, ridge=r)
    heads_sum.save(output, inputs=(data, *blocks))
    with progress_bar("score", stats.n_samples, quiet) as advance:  # R^2 scale-free, on the samples fitted
        scores = predict_file(heads_sum, data, chunk_size=chunk_size, progress=advance)
    info = heads_sum.info
    out = {"output": str(output), **_record(stats, data, blocks), "identifiable": info["identifiable"],
           "lambda_min": info["lambda_min"], "lambda_max": info["lambda_max"], "ridge": info["ridge"],
           "ridge_cv": info.get("cv"), "train_mse": info["train_mse"], "train_r2": scores.r2,
           "n_heads": heads_sum.n_heads, "seconds": {**info["seconds"], "total": time.perf_counter() - t0}}
    verdict = "identifiable" if out["identifiable"] else "NOT identifiable"
    say(f"wrote {output}: a sum of {_blocks_text(len(blocks))}, {heads_sum.n_heads} heads; the joint features are {verdict} "
        f"(lambda_min = {fmt(out['lambda_min'])}); {_features_text(out)}", quiet,
        style="green" if out["identifiable"] else "red")
    cv = out["ridge_cv"]
    say(f"  ridge = {fmt(out['ridge'])}" + (f" (--ridge auto: {cv['n_folds']}-fold CV, held-out MSE "
                                              f"{fmt(cv['cv_mse'])}; least squares {fmt(cv['least_squares_cv_mse'])})"
                                              if cv else "")
        + f", train MSE = {fmt(out['train_mse'])}, train R^2 = {fmt(out['train_r2'])}", quiet)
    say(f"  read {stats.n_samples} samples, {stats.n_tokens} tokens; {fmt(out['seconds']['total'])} s", quiet)
    if not out["identifiable"]:
        warn("the data do not determine the sum of blocks: this is the "
             + ("ridge-regularised" if out["ridge"] > 0 else "minimum-norm") + " solution; `mhla certify DATA "
             "--blocks ...` says why")
    if json_out:
        emit_json(out)


def certify_blocks_cmd(data: Path, blocks: list[Path], affine: bool, min_eig: float, normalize: str | None,
                       attention: str | None, chunk_size: int | None, json_out: bool, quiet: bool) -> None:
    """`mhla certify DATA --blocks MAPS ...`: the certificate of the blocks' joint features; exit 1 when not
    identifiable."""
    from ..api.learn import certify

    check_given(CERTIFY_OPTIONS, "a sum of blocks (--blocks)", data)
    t0 = time.perf_counter()
    stats = _statistics(data, blocks, affine, 0, normalize, attention, chunk_size, quiet)
    with working(f"certify: factorizing the blocks' joint Lambda~ ({stats.n_features} features)", quiet):
        cert = certify(stats, min_eig=min_eig)
    out = {**cert.to_dict(), **_record(stats, data, blocks),
           "seconds": {**stats.seconds, **cert.seconds, "total": time.perf_counter() - t0}}
    verdict = "identifiable" if cert.identifiable else "NOT identifiable"
    say(f"{data}: a sum of {_blocks_text(len(blocks))} is {verdict}: lambda_min = {fmt(cert.lambda_min)}, lambda_max = "
        f"{fmt(cert.lambda_max)}, threshold = {fmt(cert.threshold)}, rank {cert.rank}/{cert.n_features}, "
        f"N = {cert.n_samples}; {_features_text(out)}", quiet, style="green" if cert.identifiable else "red")
    for r in cert.reasons:
        say(f"  - {r}", quiet)
    if json_out:
        emit_json(out)
    if not cert.identifiable:
        raise typer.Exit(1)


def predict_blocks_cmd(model_path: Path, data: Path, output: Path, chunk_size: int | None, workers: int,
                       json_out: bool, quiet: bool) -> None:
    """`mhla predict BLOCKS DATA -o PRED`: a blocks file's outputs (every position of a per-position layout)."""
    from ..io.tokens import inspect_tokens
    from ..model.forward import predict_file
    from ..model.heads_sum import load_blocks

    check_given(PREDICT_OPTIONS, "a blocks file", model_path)
    heads_sum = load_blocks(model_path)
    with progress_bar("predict", inspect_tokens(data).n_samples, quiet) as advance:
        res = predict_file(heads_sum, data, output, chunk_size=chunk_size, progress=advance, inputs=(model_path,),
                           workers=workers)
    every = heads_sum.layout.per_position
    say(f"wrote {output}: {res.n_samples} predictions of a sum of {_blocks_text(heads_sum.n_blocks)}"
        + (f", the outputs at {heads_sum.layout.words}" if every else "")
        + (f"; MSE against targets = {fmt(res.mse)} over {res.n_scored} "
           + ("sequences" if res.scored_as == "sequences" else "positions") + f", R^2 = {fmt(res.r2)}"
           if res.n_scored is not None else ""), quiet)
    if json_out:
        emit_json({**res.to_dict(), "output": str(output), "n_blocks": heads_sum.n_blocks})


def export_blocks_cmd(model_path: Path, output: Path, json_out: bool, quiet: bool) -> None:
    """`mhla export-heads BLOCKS -o HEADS`: the dense heads of the sum (one MHLA of the wide tokens)."""
    from ..model.export import save_heads
    from ..model.heads_sum import load_blocks
    from .options import about

    check_given(EXPORT_OPTIONS, "a blocks file", model_path)
    heads_sum = load_blocks(model_path)
    with about(model_path):
        heads = heads_sum.dense()  # refused for a sum with an affine map: plain heads cannot hold it
    save_heads(heads, output, inputs=(model_path,))
    out = {"output": str(output), "input": str(model_path), "n_blocks": heads_sum.n_blocks,
           "n_heads": heads.n_heads, "d": heads.d, "d_out": heads.d_out}
    say(f"wrote {output}: the {heads.n_heads} heads of a sum of {_blocks_text(heads_sum.n_blocks)} as one MHLA of "
        f"d = {heads.d} -> d_out = {heads.d_out} (V (H, d_out, d), Q (H, d, d))", quiet)
    if json_out:
        emit_json(out)
