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

import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from .. import formats
from ..stream import Features, load_features
from ..tokens import inspect_tokens

err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def _clean(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _clean(obj.tolist())
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    return obj


def emit_json(obj: dict[str, Any]) -> None:
    """Print one JSON object on stdout (non-finite floats become null)."""
    sys.stdout.write(json.dumps(_clean(obj), sort_keys=False) + "\n")
    sys.stdout.flush()


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


def load_with_progress(path: Path, chunk_size: int | None, quiet: bool,
                       normalize: str | None = None, device: str | None = None) -> tuple[Features, str, dict[str, float]]:
    """Features of a features or tokens file (with a progress bar when featurizing), the file kind, and
    the seconds it took ({"pass": s} when a tokens file was featurized, else {"load": s})."""
    kind = formats.kind_of(path)
    total = inspect_tokens(path).n_samples if kind == "tokens" else 0
    t = time.perf_counter()
    with progress_bar("featurize", total, quiet) as advance:
        feats = load_features(path, chunk_size=chunk_size, normalize=normalize, progress=advance, device=device)
    return feats, kind, {"pass" if kind == "tokens" else "load": time.perf_counter() - t}
