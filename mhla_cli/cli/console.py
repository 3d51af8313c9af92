"""Console output of the commands: human messages and warnings on stderr, JSON on stdout, progress bars."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from ..samples import ReadSpec
    from mhla_cli.statistics.features import Features

err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def _clean(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    np = sys.modules.get("numpy")  # a NumPy value can only come from a run that imported NumPy
    if np is not None and isinstance(obj, np.ndarray):
        return _clean(obj.tolist())
    if np is not None and isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    return obj


# The version of the JSON objects' layout, the first key of every object `--json` prints: it changes when a
# key is removed or changes meaning (new keys do not change it).
SCHEMA_VERSION = 1

# This run's JSON state: whether the command asked for JSON, whether it printed its object, and the input
# the command was handed (its first path argument), for the error object of a run that fails.
_JSON: dict[str, Any] = {"requested": False, "emitted": False, "input": None, "argv": None}


def emit_json(obj: dict[str, Any]) -> None:
    """Print one JSON object on stdout (non-finite floats become null), `schema_version` first."""
    sys.stdout.write(json.dumps(_clean({"schema_version": SCHEMA_VERSION, **obj}), sort_keys=False) + "\n")
    sys.stdout.flush()
    _JSON["emitted"] = True


def start_json_run(args: list[str]) -> None:
    """Reset the JSON state for a run of `args` (the command line after `mhla`)."""
    head = args[:args.index("--")] if "--" in args else args
    _JSON.update(requested="--json" in head, emitted=False, input=None, argv=["mhla", *args])


def command_started() -> None:
    """A command's body is about to run: record its command line for the provenance of what it writes
    (here, not at start-up, so that `--help` and completion do not load the file formats)."""
    from ..io import formats

    formats.set_command(_JSON["argv"])


def note_input(path: Any) -> None:
    """Record the input of the command being run (its first path argument)."""
    _JSON["input"] = None if path is None else str(path)


def emit_error_json(message: str, code: int, path: str | None = None) -> None:
    """When the run asked for --json and printed no object yet: one object with `error`, `exit_code` and
    the input's `path`, so that `mhla certify missing.h5 --json > cert.json` leaves no empty file."""
    if not _JSON["requested"] or _JSON["emitted"]:
        return
    try:
        emit_json({"error": " ".join(str(message).split()), "exit_code": code,
                   "path": path if path is not None else _JSON["input"]})
    except (OSError, ValueError):
        pass


def say(message: str, quiet: bool = False, style: str | None = None) -> None:
    """Human output on stderr (plain text: brackets in paths or feature names are not markup)."""
    if not quiet:
        err_console.print(message, style=style, markup=False)


def warn(message: str) -> None:
    """A warning on stderr (shown even with --quiet)."""
    err_console.print(f"mhla: warning: {message}", style="yellow", markup=False)


@contextmanager
def progress_bar(description: str, total: int, quiet: bool) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr (only when stderr is a terminal and not quiet); yields advance(n)."""
    if quiet or not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=err_console, transient=True) as prog:
        task = prog.add_task(description, total=total)
        yield lambda n: prog.advance(task, n)


@contextmanager
def working(description: str, quiet: bool) -> Iterator[None]:
    """A spinner with the elapsed time on stderr for a step that reports no progress of its own (a
    factorization inside LAPACK); only when stderr is a terminal and not quiet."""
    if quiet or not sys.stderr.isatty():
        yield
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), TimeElapsedColumn(),
                  console=err_console, transient=True) as prog:
        prog.add_task(description, total=None)
        yield


def fmt(x: float | None) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float) and not math.isfinite(x):
        return "inf"
    return f"{x:.4g}"


def say_samples(feats: Features, data: Path, attention: str | None, quiet: bool) -> None:
    """Say what per-position samples were read as (nothing for last-token data), and warn (also with --quiet)
    when a tokens file without an 'attention' attribute was read as causal by default, saying how to read it
    bidirectionally; and that the statistics hold the bias terms."""
    if feats.bias_terms:
        say(f"  bias terms: the features of the tokens (x, 1), {feats.d - 1} coordinates and the constant "
            "(docs/bias_terms.md)", quiet)
    if feats.affine is not None:
        src = (feats.affine.source or {}).get("name")
        say(f"  affine block: the query's wide token (x_wide, 1), {feats.affine.width} coordinates and the constant"
            + (f", of {src}" if src else "") + " (docs/bias_terms.md)", quiet)
    if not feats.per_position:
        return
    from ..io.tokens import inspect_tokens
    from ..statistics.stream import data_kind

    default = (attention is None and data_kind(data) == "tokens" and inspect_tokens(data).attention is None)
    say(f"  samples: {feats.samples.words}", quiet)
    if default:  # shown with --quiet too: the layout decides what the model is
        warn(f"{data} has per-position targets and no 'attention' attribute: read as causal by default (a "
             "decoder's prefixes, S of the tokens up to t); --attention bidirectional reads an encoder's windows "
             "(every position with the whole window's S)")


# How lambda_min is written where its estimate contradicted the proven verdict (numerics.lambda_min_of_verdict).
BOUND_SIGNS: dict[str | None, str] = {"at_most": "<=", "above": ">"}


def load_with_progress(path: Path, chunk_size: int | None, quiet: bool, read: ReadSpec | None = None,
                       device: str | None = None, affine_from: Path | None = None
                       ) -> tuple[Features, str, dict[str, float]]:
    """Features of a features or tokens file (with a progress bar when featurizing; a tokens file read as `read`
    says, mhla_cli.samples.ReadSpec, which a features file must match), the file kind, and the seconds it took
    ({"pass": s} when a tokens file was featurized, else {"load": s}); says what the samples are (`say_samples`)."""
    from ..samples import ReadSpec
    from ..statistics.stream import data_kind, load_features
    from ..io.tokens import inspect_tokens

    kind = data_kind(path)
    total = inspect_tokens(path).n_samples if kind == "tokens" else 0
    t = time.perf_counter()
    with progress_bar("featurize", total, quiet) as advance:
        feats = load_features(path, chunk_size=chunk_size, progress=advance, device=device, affine_from=affine_from,
                              read=read or ReadSpec(normalize=None))
        if kind == "features":
            feats.expand_held()  # a compact file's Gram: expanded within the load's seconds
    say_samples(feats, path, None if read is None else read.attention, quiet)
    return feats, kind, {"pass" if kind == "tokens" else "load": time.perf_counter() - t}
