"""`mhla reduce DATA -o OUT --dim d` (or `--like REDUCED`): wide tokens and targets to d dimensions."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..model import reduce as reduce_mod
from ..io.tokens import inspect_tokens
from .console import emit_json, progress_bar, say
from .options import ChunkOpt, JsonOpt, OutOpt, QuietOpt


def reduce_cmd(
    data: Annotated[Path, typer.Argument(help="Tokens file (e.g. a model's hidden states and a head's outputs).",
                                         show_default=False)],
    output: OutOpt,
    dim: Annotated[int | None, typer.Option("--dim", help="Dimensions to keep (fits the maps on DATA).",
                                            show_default=False)] = None,
    like: Annotated[Path | None, typer.Option("--like", help="Apply the maps recorded in this reduced tokens file "
                                              "(held-out data in the same coordinates).", show_default=False)] = None,
    chunk_size: ChunkOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Map tokens x to P^T x and targets y to U^T y (top-d eigenvectors of their second moments).

    One pass accumulates sum x x^T (D x D) and sum y y^T (D_out x D_out) in float64; P and U are their
    top-d eigenvectors (signed: largest entry positive); a second pass writes OUT, a tokens file of the
    same layout, offsets and weights that records both maps and the share of each second moment they
    keep. Fit and certify OUT; `mhla export-heads MODEL -o HEADS --unreduce OUT` puts the heads back in
    the original coordinates.

    Example: mhla reduce hidden384.h5 -o h8.h5 --dim 8 && mhla fit h8.h5 -o m.h5

    Example (held-out data, same maps): mhla reduce test384.h5 --like h8.h5 -o t8.h5
    """
    info = inspect_tokens(data)
    passes = 1 if like is not None else 2
    with progress_bar("reduce", passes * info.n_samples, quiet) as advance:
        red = reduce_mod.reduce_tokens(data, output, dim=dim, like=like, chunk_size=chunk_size, progress=advance)
    summary = {"output": str(output), "input": str(data), "like": None if like is None else str(like),
               "d": red.dim, "D": int(red.P.shape[0]), "D_out": None if red.U is None else int(red.U.shape[0]),
               "token_share": red.token_share, "target_share": red.target_share, "n_samples": info.n_samples}
    shares = f"keeps {red.token_share:.4g} of the tokens' second moment" if red.token_share is not None else ""
    if like is not None:
        shares = ""  # the shares recorded in LIKE are of its own data
    elif red.target_share is not None:
        shares += f", {red.target_share:.4g} of the targets'"
    src = f" (the maps of {like})" if like is not None else ""
    say(f"wrote {output}: N = {info.n_samples} sequences, tokens {info.d} -> {red.dim}"
        + (f", targets {red.U.shape[0]} -> {red.dim}" if red.U is not None and info.has_targets else "")
        + src + (f"; {shares}" if shares else ""), quiet)
    if json_out:
        emit_json(summary)


def register(app: typer.Typer) -> None:
    app.command("reduce")(reduce_cmd)
