"""`mhla convert INPUT... -o TOKENS.h5`: tokens files from NumPy, safetensors, torch, HDF5 and Arrow files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import InputError
from ..io import convert as convert_mod
from ..io.tokens import TokensInfo
from .console import emit_json, progress_bar, say
from .options import LAYOUT_OPTION, ChunkOpt, JsonOpt, OutOpt, QuietOpt


def convert_cmd(
    inputs: Annotated[list[str], typer.Argument(
        help="Input files: .npy, .npz, .safetensors, .pt/.pth (torch extra), HDF5 activations, a Hugging Face "
             "datasets directory or .arrow file (SAELens caches; arrow extra). A .npy holds the array named by "
             "NAME=FILE (tokens=X.npy, offsets=, targets=, weights=, attention_mask=) or by its stem "
             "(targets.npy); any other single .npy holds the tokens. Several files holding tokens (or a "
             "directory, or a glob) are joined in the order given.", show_default=False)],
    output: OutOpt,
    mask: Annotated[str | None, typer.Option("--mask", help="The padding mask's array name (default: "
                                             "attention_mask (N, n) of 0/1, or lengths (N,)).",
                                             show_default=False)] = None,
    key: Annotated[list[str] | None, typer.Option(
        "--key", help="ROLE=NAME: read the array NAME as ROLE (tokens, targets, weights, offsets, mask); "
        "NAME\\[h] is head h of an array of 4 axes \\[batch, pos, head, d], NAME\\[sum] the sum over its heads; "
        "nested keys are dotted (a.b). Repeatable. Example: --key tokens=hidden", show_default=False)] = None,
    attention: Annotated[str | None, typer.Option(
        "--attention", **LAYOUT_OPTION, help="How the model's attention ran, for per-position targets (required for them, refused "
        "otherwise): causal (a decoder such as GPT-2: position t sees the positions up to t, every prefix is a sample) or "
        "bidirectional (an encoder such as BERT: every position sees the whole window). Written as the file's "
        "attribute 'attention'. Example: --attention bidirectional", show_default=False)] = None,
    compat: Annotated[str | None, typer.Option(
        "--compatibility-mode", metavar="on|off", help="For a TransformerLens 4 "
        "TransformerBridge cache: whether bridge.enable_compatibility_mode() was on (LayerNorm folded, weights centred, "
        "value biases folded) or off (Hugging Face's numerics), when the cache does not record it as its "
        "'compatibility_mode' entry. Written as the attribute transformer_lens_compatibility_mode: heads fitted "
        "on one are wrong on the other.", show_default=False)] = None,
    chunk_size: ChunkOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Convert arrays to a tokens file: (N, n, d) tokens, or (T, d) tokens with offsets; targets, weights.

    Arrays are named as the datasets of a tokens file (tokens, offsets, targets, weights; see
    docs/tokens.md): by their .npz, .safetensors, torch dict or HDF5 names, or by the .npy rules of
    INPUTS; --key gives any array a role. A torch file may also hold one tensor (the tokens) or a list
    of (n_i, d) tensors (ragged sequences). Inputs are checked as every reader checks them (shapes,
    offsets, NaN/Inf, weights >= 0) and copied in chunks, so files larger than memory convert.

    Activations as models and interpretability tools write them (docs/converting.md):
    `last_hidden_state` / `hidden_states` are read as the tokens; padded tokens (N, n, d) with
    `attention_mask` (N, n) or `lengths` (N,) become the unpadded sequences (the last kept position
    is the query; per-position targets are masked alike); bfloat16 is widened exactly. Hook points
    (a TransformerLens cache saved with torch.save(cache.cache_dict); the columns of a datasets
    directory) that no --key picks are left out. Per-position targets (N, n, e) need --attention.
    Targets may be of another width than the tokens (then `mhla reduce` them).

    A TransformerLens 4 TransformerBridge cache records whether compatibility mode was on (its
    'compatibility_mode' entry, or --compatibility-mode): heads fitted on one mode are wrong on the other.

    Example (TransformerLens, head 5 of a GPT-2 layer before W_O): mhla convert cache.pt --key
    tokens=blocks.3.hook_resid_pre --key targets=blocks.3.attn.hook_z\\[5] --attention causal -o head.h5

    Example (BERT, the whole attention layer, padded batch): mhla convert cache.pt attention_mask=mask.npy
    --key tokens=blocks.1.hook_resid_pre --key targets=blocks.1.hook_attn_out --attention bidirectional -o
    layer.h5

    Example (SAELens cache of two hooks): mhla convert activations/ --key tokens=blocks.0.hook_resid_pre
    --key targets=blocks.0.hook_attn_out --attention causal -o data.h5

    Example (Hugging Face): mhla convert acts.pt --key targets=head_out -o data.h5

    Example (shards): mhla convert shards/ -o all.h5

    Example: mhla convert X.npy targets=y.npy -o data.h5

    Example (ragged): mhla convert tokens.npy offsets.npy targets.npy -o data.h5

    Example: mhla convert data.npz -o data.h5 && mhla certify data.h5
    """
    if compat not in (None, "on", "off"):
        raise InputError(f"--compatibility-mode {compat}: expected on or off")
    with progress_bar("convert", None, quiet) as advance:  # type: ignore[arg-type]  # None: no known total
        info = convert_mod.convert_files(inputs, output, chunk_size=chunk_size, progress=advance, mask=mask,
                                         keys=key, attention=attention,
                                         compatibility_mode=None if compat is None else compat == "on")
    _report(info, output, inputs, attention, json_out, quiet)


def _report(info: TokensInfo, output: Path, inputs: list[str], attention: str | None, json_out: bool,
            quiet: bool) -> None:
    """The summary of a conversion: one line on stderr, the --json object on stdout."""
    summary = {"output": str(output),
               "inputs": [str(p) for _, p in map(convert_mod.parse_input, convert_mod.expand_inputs(inputs))],
               "layout": info.layout, "n_samples": info.n_samples, "d": info.d, "n_tokens": info.n_tokens,
               "dtype": info.dtype, "targets": info.has_targets, "per_position": info.per_position,
               "weights": info.has_weights, "d_out": info.out_dim, "attention": attention,
               "compatibility_mode": convert_mod.recorded_compatibility_mode(output)}
    mode = summary["compatibility_mode"]
    extras = [x for x, on in (("targets", info.has_targets), ("weights", info.has_weights),
                              ("per position", info.per_position), (f"attention {attention}", attention),
                              (f"TransformerLens compatibility mode {mode}", mode)) if on]
    say(f"wrote {output}: N = {info.n_samples} sequences ({info.layout}), d = {info.d}, {info.n_tokens} tokens "
        f"({info.dtype})" + (f"; {', '.join(extras)}" if extras else ""), quiet)
    if json_out:
        emit_json(summary)


def register(app: typer.Typer) -> None:
    app.command("convert")(convert_cmd)
