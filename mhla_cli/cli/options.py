"""Option types shared by the commands, and the parsing of option strings ('auto', 'i/M')."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, overload

import math

import typer

from mhla_cli.errors import InputError, Refused

if TYPE_CHECKING:
    from mhla_cli.samples import ReadSpec

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]


def _complete_device(incomplete: str) -> list[str]:
    """The device spellings a shell completion offers (counting GPUs would import torch: cuda:0 stands for them)."""
    return [v for v in ("cpu", "cuda", "cuda:0", "torch:cpu") if v.startswith(incomplete)]


# Choice options are Literal types: help shows the values, completion offers them, a wrong value is a
# usage error naming them, and the command receives a plain str.
DeviceOpt = Annotated[str, typer.Option(
    "--device", metavar="DEVICE", autocompletion=_complete_device,
    help="Where the psi x psi work runs: cpu (numpy, the default), cuda or cuda:I (torch on a GPU, float64; the "
    "gpu extra), torch:cpu (the GPU code on the CPU). docs/gpu.md. Example: --device cuda:0")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or human summary on stderr.")]


OutOpt = Annotated[Path, typer.Option("--output", "-o", help="Output HDF5 file (.h5, .hdf5 or .hdf; written "
                                      "atomically).", dir_okay=True, resolve_path=False)]


SchedulerTimeoutOpt = Annotated[float | None, typer.Option(
    "--scheduler-timeout", metavar="SECONDS", help="With --scheduler: how long the scheduler has to answer and to "
    "have a running worker (default 60 s: statistics.distributed.scheduler.SCHEDULER_TIMEOUT); a cluster that does neither, or "
    "whose workers' memory cannot hold a tile of the Gram, is refused (exit 2) naming the cause "
    "(docs/cluster.md). Example: --scheduler-timeout 300", show_default=False)]

# The remedy the CLI adds to a cluster's refusal (statistics.distributed.scheduler.SchedulerError), by its cause.
CLUSTER_REMEDIES = {
    "connect": "check the address, that the scheduler runs and that this machine reaches it",
    "answer": "check that the address is a Dask scheduler's (not another service's); a busy one may need longer: "
              "--scheduler-timeout SECONDS (now {t:g})",
    "workers": "start workers for it (dask worker ADDRESS), or wait longer for them: --scheduler-timeout SECONDS "
               "(now {t:g})",
    "memory": "start the workers with a larger memory limit (dask worker --memory-limit) or fewer threads each",
    "killed": "give the workers more memory (dask worker --memory-limit), or see why they crash in their logs",
    "lost": "check that the scheduler still runs, and run the command again",
}


# The cluster's refusals (mhla_cli.solve.cluster.ClusterRefused.rule) in the words of the options; a rule not here
# is said in the library's words.
CLUSTER_WORDS = {
    "minimum_norm": "the data do not determine the function (the Cholesky of Lambda~ - t I over the tiles failed): "
                    "their minimum-norm fit needs an eigendecomposition, which has no distributed form; fit with "
                    "--ridge L (L > 0: a Cholesky of Lambda~ + L I on the cluster), or without --scheduler",
    "small_ridge": "--ridge at or below the numerical tolerance is the minimum-norm fit, which needs an "
                   "eigendecomposition: with --scheduler give a larger --ridge, or fit without --scheduler",
    "hdf5_features": "an HDF5 features file is the single-machine form of the statistics: certify or fit it "
                     "without --scheduler, or featurize the tokens on the cluster into a Zarr store "
                     "(featurize --scheduler ... -o FEATS.zarr)",
    "affine": "--affine-from cannot run on a cluster: the affine block of the wide tokens is accumulated and "
              "solved beside the Gram in one process, not tiled; featurize, certify and fit it without --scheduler",
}


# The remedies of the library's refusals (mhla_cli.errors.Refused) in the words of the options.
REMEDY_OPTIONS = {
    "reduce": "mhla reduce {tokens} -o REDUCED.h5 --dim {dim}",
    "cluster": "--scheduler (docs/cluster.md)",
    "no_cluster": "without --scheduler",
    "cpu": "--device cpu",
    "bias_terms": "--bias-terms",
    "affine_from": "--affine-from",
    "attention": "the same --attention",
    "folds": "`mhla featurize DATA -o FEATS --folds K`",
    "like": "`mhla reduce {wide} --like {reduced} -o NEW.h5`",
    "keys": "--key",
    "key": "--key {}",
    "mask": "--mask {}",
    "compat_on": "--compatibility-mode on",
    "compat_off": "--compatibility-mode off",
    "compat_either": "--compatibility-mode on|off",
    "attention_opt": "--attention",
    "attention_is": "--attention {}",
    "bias_terms_opt": "--bias-terms",
    "affine_file": "--affine-from {}",
    "wide": "wide=, or --affine-from",
    "causal_flag": "--causal",
    "dim_opt": "--dim",
    "dim": "--dim {}",
    "method_opt": "--method",
    "method": "--method {}",
    "weights": "--weights",
    "weights_file": "--weights FILE",
    "like_opt": "--like",
    "like_reduced": "mhla reduce --like",
    "like_it": "`mhla reduce ... --like`",
    "unreduce_opt": "--unreduce",
    "unreduced": "mhla export-heads --unreduce",
    "unreduced_heads": "export-heads --unreduce",
    "predict_wide": "`mhla predict --affine-from`",
    "scheduler": "--scheduler",
    "device": "--device {}",
    "tiled_store": "featurize --scheduler ... -o FEATS.zarr",
    "certify_observed": "`mhla certify --domain observed`",
}


def in_options(exc: Refused) -> Refused:
    """The library's refusal with its remedies in the words of the options (REMEDY_OPTIONS), same file."""
    return Refused(exc.worded(REMEDY_OPTIONS), exc.path)


def check_scheduler_timeout(scheduler: str | None, timeout: float | None) -> None:
    """--scheduler-timeout: a finite number of seconds > 0, and only with --scheduler (before any work)."""
    if timeout is not None and scheduler is None:
        raise InputError("--scheduler-timeout bounds the waits on a Dask cluster: give --scheduler")
    if timeout is not None and not (0 < timeout < math.inf):
        raise InputError(f"--scheduler-timeout must be a finite number of seconds > 0, got {timeout}")


@contextmanager
def on_cluster(scheduler: str | None, timeout: float | None, data: Any = None) -> Iterator[None]:
    """A command's work on the cluster of --scheduler, its waits bounded by --scheduler-timeout: a refusal of
    the cluster (statistics.distributed.scheduler.SchedulerError) gains its remedy (`CLUSTER_REMEDIES`), what the
    cluster's solve does not do (solve.cluster.ClusterRefused) is said in the options' words (`CLUSTER_WORDS`), and an
    error that
    names no file (a store's chunk that cannot be decoded) names `data`. Without a scheduler: nothing."""
    check_scheduler_timeout(scheduler, timeout)
    if scheduler is None:
        yield
        return
    from mhla_cli.solve.cluster import ClusterRefused
    from mhla_cli.statistics.distributed.scheduler import SchedulerError, scheduler_timeout

    with scheduler_timeout(timeout) as t:
        try:
            yield
        except SchedulerError as exc:
            raise InputError(f"{exc}; {CLUSTER_REMEDIES[exc.cause].format(t=t)}") from None
        except ClusterRefused as exc:
            if exc.rule not in CLUSTER_WORDS:
                raise
            raise InputError(CLUSTER_WORDS[exc.rule], exc.path if exc.path is not None else data) from None
        except Refused as exc:
            if exc.path is None and data is not None:
                raise Refused(exc.template, data, **exc.remedies) from None
            raise
        except InputError as exc:
            if exc.path is None and data is not None:
                raise InputError(str(exc), data) from None
            raise


ChunkOpt = Annotated[int | None, typer.Option("--chunk-size", min=1,
                                              help="Samples per chunk (default: sized to ~64 MiB of buffers).")]


_Number = TypeVar("_Number", int, float)


@overload
def parse_auto(value: str, name: str, kind: type[_Number]) -> _Number | str: ...
@overload
def parse_auto(value: str | None, name: str, kind: type[_Number]) -> _Number | str | None: ...
def parse_auto(value: str | None, name: str, kind: type[_Number]) -> _Number | str | None:
    """'auto', None, or a number of `kind` (int or float) from a CLI string."""
    if value is None:
        return None
    if str(value).strip().lower() == "auto":
        return "auto"
    try:
        x = kind(value)
    except ValueError:
        raise InputError(f"{name} '{value}': expected {'an integer' if kind is int else 'a number'} or 'auto'") from None
    if kind is int and x < 1:
        raise InputError(f"{name} must be >= 1, got {x}")
    if kind is float and (x < 0 or not math.isfinite(x)):
        raise InputError(f"{name} must be a finite number >= 0, got {x}")
    return x


Normalize = Literal["none", "length"]
NormalizeOpt = Annotated[Normalize | None, typer.Option(
    "--normalize", help="none (default) or length: divide S by the number of tokens of the prefix (per-position "
    "data) or sequence, the 1/n-scaled linear attention; stored in the features, model and heads files. "
    "Example: --normalize length")]


def data_location(path: Path) -> str:
    """A command's file argument as a location: the path, or the fsspec URL (s3://bucket/feats.zarr) that
    pathlib turned into scheme:/bucket/... (a Zarr store may be anywhere the Dask workers reach)."""
    import re

    text = str(path)
    m = re.match(r"^([a-z][a-z0-9+.-]+):/(?!/)", text)
    if m and m.group(1) != "file":
        return f"{m.group(1)}://{text[m.end():]}"
    return text


def layout_name(value: str | None) -> str | None:
    """The value of --attention: a registered per-position layout's name (mhla_cli.samples.attentions, read when
    the option is parsed: a layout registered after this import is a choice too; the import of the layouts, and
    so of NumPy, waits until then: `--help` needs none)."""
    from mhla_cli.samples import attentions

    if value is not None and value not in attentions():
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(repr(a) for a in attentions())}.")
    return value


def _complete_layout(incomplete: str) -> list[str]:
    from mhla_cli.samples import attentions

    return [a for a in attentions() if a.startswith(incomplete)]


# the keywords of an --attention option (the layout's name)
LAYOUT_OPTION: dict[str, Any] = {"parser": layout_name, "metavar": "LAYOUT",
                                 "autocompletion": _complete_layout}


AttentionOpt = Annotated[str | None, typer.Option(
    "--attention", **LAYOUT_OPTION, help="How per-position targets are read (docs/bidirectional.md): causal, the default, a "
    "decoder's prefixes (S of the tokens up to t); bidirectional, an encoder's positions (S of the whole window, "
    "every position a sample). Default: the tokens file's 'attention' attribute, causal without one; an option "
    "that contradicts the attribute is refused. Stored in the features and model files. Example: --attention "
    "bidirectional")]


BiasTermsOpt = Annotated[bool, typer.Option(
    "--bias-terms", help="Add the terms a head's biases add (docs/bias_terms.md): the features of the tokens (x, 1), "
    "S (x) x_t and the lower-degree S, m (x) x_t, m, n x_t, n (m = sum_i x_i; / n with --normalize length), in the "
    "same least squares and certificate. Stored in the features and model files; export-heads writes the bias "
    "terms beside the heads. Example: --bias-terms")]


AffineFromOpt = Annotated[Path | None, typer.Option(
    "--affine-from", metavar="WIDE", help="Add the token-wise affine map of the UNREDUCED token (docs/bias_terms.md): "
    "WIDE is the tokens file `mhla reduce` read to make DATA (checked by its fingerprint); its tokens (x_wide, 1) at "
    "every sample's query are a block of D + 1 features beside the MHLA's, whitened by their own second moment. "
    "Example: mhla fit h8.h5 -o m.h5 --affine-from hidden384.h5", show_default=False)]


def parse_shard(shard: str | None) -> tuple[int, int] | None:
    if shard is None:
        return None
    try:
        i, m = (int(x) for x in shard.split("/"))
    except ValueError:
        raise InputError(f"--shard '{shard}': expected i/M, e.g. 0/8") from None
    return i, m


def check_hdf5_output(path: Path, inputs: tuple[Path | None, ...] = (), what: str = "the output",
                      kind: str | None = None) -> Path:
    """An HDF5 output path, refused (InputError, exit 2) before any work when its suffix names another
    format (model.npz would be HDF5 under a NumPy name), it cannot be written, or it holds a file that is not
    mhla's file of `kind` (formats.check_replaceable)."""
    from mhla_cli.io import formats

    formats.check_hdf5_suffix(path, what)
    return formats.check_output_path(path, tuple(i for i in inputs if i is not None), kind)


def check_heads_output(path: Path, inputs: tuple[Path | None, ...] = ()) -> str:
    """A heads output: its format by the suffix (HDF5, .npz, .safetensors; any other suffix refused), the
    optional package it needs, and a writable path; all before any work."""
    from mhla_cli.io import formats
    from mhla_cli.model.export import heads_format

    fmt = heads_format(path)
    if fmt == "safetensors":
        from mhla_cli.model.export import safetensors_module  # the library's own refusal, with its install hint
        require_optional("safetensors.numpy", safetensors_module)
    formats.check_output_path(path, tuple(i for i in inputs if i is not None), "heads")
    return fmt


@contextmanager
def about(path: Path) -> Iterator[None]:
    """Name `path` in an InputError raised without a file: a library check of the data it was handed in
    memory (e.g. statistics without targets) becomes ``<path>: ...``."""
    try:
        yield
    except Refused as exc:
        if exc.path is None:
            raise Refused(exc.template, path, **exc.remedies) from None
        raise
    except InputError as exc:
        if exc.path is None:
            raise InputError(str(exc), path) from None
        raise


def require_optional(module: str, refuse: Callable[[], Any]) -> None:
    """Refuse a run whose optional package `module` is missing, before any work: `refuse()` is the library
    call that raises the InputError naming the extra to install (so the hint has one home)."""
    try:
        importlib.import_module(module)
    except ImportError:
        refuse()
        raise InputError(f"the optional package {module.split('.')[0]} is not installed") from None


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS reports it, else os.cpu_count())."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_common_params(ctx: Any) -> None:
    """The checks every command gets before its body runs, from its parsed parameters:

    - a path given as '-' (standard input / output, by convention) is refused: mhla reads and writes files
      (HDF5 with random access, written atomically), and `-o -` would otherwise write a file named '-';
    - `--workers` above the cores available is noted on stderr (one line; the run goes on).
    """
    from mhla_cli.cli.console import warn

    for p in getattr(ctx.command, "params", ()):
        value = ctx.params.get(p.name)
        values = value if isinstance(value, (list, tuple)) else (value,)
        is_arg = type(p).__name__.endswith("Argument")
        for v in values:
            if (isinstance(v, Path) or (is_arg and isinstance(v, str))) and (str(v) == "-" or str(v).endswith("=-")):
                name = p.opts[0] if not is_arg and getattr(p, "opts", None) else str(p.name).upper()
                raise InputError(f"{name} '{v}': mhla reads and writes files, not standard input or output; give a "
                                 "file path")
    workers = ctx.params.get("workers")
    cores = available_cores()
    if isinstance(workers, int) and workers > cores:
        warn(f"--workers {workers} is more than the {cores} cores available here: the workers share them")


def require_dask(scheduler: str | None) -> None:
    """--scheduler needs Dask: refused before any work when it is missing (parallel.make_map's message)."""
    if scheduler is None:
        return
    from mhla_cli.statistics.distributed.parallel import make_map

    def refuse() -> None:
        with make_map(scheduler=scheduler):
            pass
    require_optional("dask.distributed", refuse)


def statistics_for(path: Path, scheduler: str | None, chunk_size: int | None, quiet: bool, read: ReadSpec,
                   device: str | None, affine_from: Path | None = None) -> tuple[Any, dict[str, float]]:
    """What a command hands the library's `certify` / `fit` (mhla_cli.api.learn), and the seconds of its load: on
    one machine the statistics loaded under a progress bar (`load_with_progress`); with a scheduler the data's
    location, which the cluster's workers read (Dask: refused before any work when it is missing)."""
    from .console import load_with_progress

    if scheduler is not None:
        require_dask(scheduler)
        return data_location(path), {}
    feats, _, seconds = load_with_progress(path, chunk_size, quiet, read, device, affine_from)
    return feats, seconds

