"""Shared CLI plumbing: consoles, JSON output, progress bars, option types."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from ..errors import InputError
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

err_console = Console(stderr=True, highlight=False, soft_wrap=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or human summary on stderr.")]
OutOpt = Annotated[Path, typer.Option("--output", "-o", help="Output HDF5 file (written atomically).",
                                      dir_okay=True, resolve_path=False)]
ChunkOpt = Annotated[int | None, typer.Option("--chunk-size", min=1,
                                              help="Samples per chunk (default: sized to ~64 MiB of buffers).")]


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


def fmt(x: float | None) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float) and not math.isfinite(x):
        return "inf"
    return f"{x:.4g}"


def parse_auto(value: str | None, name: str, kind: type) -> int | float | str | None:
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
    if kind is float and (x < 0 or not np.isfinite(x)):
        raise InputError(f"{name} must be a finite number >= 0, got {x}")
    return x
