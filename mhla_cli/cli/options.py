"""Option types shared by the commands, and the parsing of option strings ('auto', 'i/M')."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from ..errors import InputError

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]


QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or human summary on stderr.")]


OutOpt = Annotated[Path, typer.Option("--output", "-o", help="Output HDF5 file (written atomically).",
                                      dir_okay=True, resolve_path=False)]


ChunkOpt = Annotated[int | None, typer.Option("--chunk-size", min=1,
                                              help="Samples per chunk (default: sized to ~64 MiB of buffers).")]


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


NormalizeOpt = Annotated[str | None, typer.Option(
    "--normalize", help="none (default) or length: divide S by the number of tokens of the prefix (per-position "
    "data) or sequence, the 1/n-scaled linear attention; stored in the features, model and heads files. "
    "Example: --normalize length")]


def parse_shard(shard: str | None) -> tuple[int, int] | None:
    if shard is None:
        return None
    try:
        i, m = (int(x) for x in shard.split("/"))
    except ValueError:
        raise InputError(f"--shard '{shard}': expected i/M, e.g. 0/8") from None
    return i, m
