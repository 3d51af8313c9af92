"""`mhla reduce DATA -o OUT --dim d` (or `--like REDUCED`): wide tokens and targets to d dimensions."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

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
    method: Annotated[Literal["pca", "supervised", "weights"] | None, typer.Option(
        "--method", help="How the token map P is chosen (default pca): pca (the tokens' top principal directions), "
        "supervised (the top input directions of the token-wise least-squares map to the targets, in the tokens' "
        "whitened metric: needs targets), weights (the directions that keep W x in mean square over the tokens: "
        "needs --weights). Recorded in OUT with the share of what P keeps. Example: --method supervised",
        show_default=False)] = None,
    weights: Annotated[Path | None, typer.Option(
        "--weights", help="With --method weights: a .npz or .safetensors file of the matrices the head reads the "
        "token through, named W, W_Q, W_K or W_V, each (k, D) (rows read the token: W x) or stacked (m, k, D). "
        "Example: --method weights --weights qkv.npz",
        show_default=False)] = None,
    keep_targets: Annotated[bool, typer.Option(
        "--keep-targets", help="Reduce the tokens only: the targets are copied at their own width D_out (no U), so "
        "that fit, certify, predict and export-heads --unreduce work on the full output (a head's 32-dim or a "
        "layer's 384-dim output), with no output-reduction ceiling.")] = False,
    chunk_size: ChunkOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Map tokens x to P^T x and targets y to U^T y (d dimensions each).

    One pass accumulates sum x x^T (D x D) and sum y y^T (D_out x D_out) in float64; U is the targets'
    top-d eigenvectors (signed: largest entry positive), and P by --method: pca, the tokens' top-d
    eigenvectors; supervised, the top-d input directions of the least-squares map from the tokens to the
    targets in the tokens' whitened metric (reduced-rank regression, from sum w x x^T and sum w x y^T over
    the scored samples; completed by principal directions when the targets' read has fewer than d);
    weights, the top-d directions that keep W x in mean square over the tokens. A second pass writes
    OUT, a tokens file of the same layout, offsets and weights that records both maps, the method and
    the share of what each keeps. Fit and certify OUT; `mhla export-heads MODEL -o HEADS --unreduce OUT`
    puts the heads back in the original coordinates.

    Example: mhla reduce hidden384.h5 -o h8.h5 --dim 8 && mhla fit h8.h5 -o m.h5

    Example (what the targets need): mhla reduce hidden384.h5 -o h8.h5 --dim 8 --method supervised

    Example (what the head reads): mhla reduce hidden384.h5 -o h8.h5 --dim 8 --method weights --weights qkv.npz

    Example (held-out data, same maps): mhla reduce test384.h5 --like h8.h5 -o t8.h5
    """
    info = inspect_tokens(data)
    passes = 1 if like is not None else 2
    with progress_bar("reduce", passes * info.n_samples, quiet) as advance:
        red = reduce_mod.reduce_tokens(data, output, dim=dim, like=like, chunk_size=chunk_size, progress=advance,
                                       method=method, weights=weights, keep_targets=keep_targets)
    summary = {"output": str(output), "input": str(data), "like": None if like is None else str(like),
               "d": red.dim, "D": int(red.P.shape[0]), "D_out": None if red.U is None else int(red.U.shape[0]),
               "keep_targets": red.keep_targets, "method": red.method, "weights": red.weights, "share_of": reduce_mod.METHODS[red.method],
               "token_share": red.token_share, "target_share": red.target_share, "n_samples": info.n_samples}
    shares = (f"{red.method}: keeps {red.token_share:.4g} of {reduce_mod.METHODS[red.method]}"
              if red.token_share is not None else "")
    if like is not None:
        shares = ""  # the shares recorded in LIKE are of its own data
    elif red.target_share is not None:
        shares += f", {red.target_share:.4g} of the targets'"
    src = f" (the maps of {like})" if like is not None else ""
    say(f"wrote {output}: N = {info.n_samples} sequences, tokens {info.d} -> {red.dim}"
        + (f", targets {red.U.shape[0]} -> {red.dim}" if red.U is not None and info.has_targets else "")
        + (f", targets kept at width {info.out_dim}" if red.keep_targets and info.has_targets else "")
        + src + (f"; {shares}" if shares else ""), quiet)
    if json_out:
        emit_json(summary)


def register(app: typer.Typer) -> None:
    app.command("reduce")(reduce_cmd)
