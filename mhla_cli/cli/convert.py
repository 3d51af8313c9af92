"""`mhla convert INPUT... -o TOKENS.h5`: tokens files from NumPy, safetensors and torch files."""

from __future__ import annotations

from typing import Annotated

import typer

from .. import convert as convert_mod
from .console import emit_json, progress_bar, say
from .options import ChunkOpt, JsonOpt, OutOpt, QuietOpt


def convert_cmd(
    inputs: Annotated[list[str], typer.Argument(
        help="Input files: .npy, .npz, .safetensors, .pt/.pth. A .npy holds the array named by NAME=FILE "
             "(tokens=X.npy, offsets=, targets=, weights=) or by its stem (targets.npy); any other single "
             ".npy holds the tokens.", show_default=False)],
    output: OutOpt,
    chunk_size: ChunkOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Convert arrays to a tokens file: (N, n, d) tokens, or (T, d) tokens with offsets; targets, weights.

    Arrays are named as the datasets of a tokens file (tokens, offsets, targets, weights; see
    docs/formats.md): by their .npz, .safetensors or torch dict keys, or by the .npy rules of INPUTS.
    A torch file may also hold one tensor (the tokens) or a list of (n_i, d) tensors (ragged
    sequences); it needs the torch extra. Inputs are checked as every reader checks them (shapes,
    offsets, NaN/Inf, weights >= 0) and copied in chunks, so files larger than memory convert.

    Example: mhla convert X.npy targets=y.npy -o data.h5

    Example (ragged): mhla convert tokens.npy offsets.npy targets.npy -o data.h5

    Example: mhla convert data.npz -o data.h5 && mhla certify data.h5
    """
    with progress_bar("convert", None, quiet) as advance:  # type: ignore[arg-type]
        info = convert_mod.convert_files(inputs, output, chunk_size=chunk_size, progress=advance)
    summary = {"output": str(output), "inputs": [str(p) for _, p in map(convert_mod.parse_input, inputs)],
               "layout": info.layout, "n_samples": info.n_samples, "d": info.d, "n_tokens": info.n_tokens,
               "dtype": info.dtype, "targets": info.has_targets, "per_position": info.per_position,
               "weights": info.has_weights}
    extras = [x for x, on in (("targets", info.has_targets), ("weights", info.has_weights),
                              ("per position", info.per_position)) if on]
    say(f"wrote {output}: N = {info.n_samples} sequences ({info.layout}), d = {info.d}, {info.n_tokens} tokens "
        f"({info.dtype})" + (f"; {', '.join(extras)}" if extras else ""), quiet)
    if json_out:
        emit_json(summary)


def register(app: typer.Typer) -> None:
    app.command("convert")(convert_cmd)
