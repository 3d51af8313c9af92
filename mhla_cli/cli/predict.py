"""`mhla predict`, `mhla rollout` and `mhla compare`: running and comparing learned functions."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..linalg.device import check_device
from ..errors import InputError
from ..model.forward import fitted_samples, predict_file, rollout_file
from ..model.model import load_function, normalize_of, token_dim
from ..model.compare import compare
from ..io.tokens import inspect_tokens
from ..samples import BIDIRECTIONAL, CAUSAL, LAST, layout_class
from .blocks import is_blocks_file, predict_blocks_cmd
from .console import emit_json, fmt, progress_bar, say, warn
from .options import ChunkOpt, DeviceOpt, JsonOpt, OutOpt, QuietOpt, check_hdf5_output


def predict_cmd(
    model_path: Annotated[Path, typer.Argument(metavar="MODEL|HEADS", help="Model, heads or blocks file.")],
    data: Annotated[Path, typer.Argument(help="Tokens file.")],
    output: OutOpt,
    all_positions: Annotated[bool, typer.Option("--all-positions", help="Also write the unmasked output at every "
                                                "position (S over the whole sequence) and score it against "
                                                "per-position targets of an encoder's windows (attribute "
                                                "'attention' bidirectional, or none). Example: mhla predict "
                                                "model.h5 heldout.h5 -o pred.h5 --all-positions --json")] = False,
    causal: Annotated[bool, typer.Option("--causal", help="Also write `outputs` (T, d): the last-token output of "
                                         "every prefix X[:t] (autoregressive); MSE over the weighted positions of "
                                         "per-position targets. Example: mhla predict model.h5 ar.h5 -o pred.h5 "
                                         "--causal")] = False,
    chunk_size: ChunkOpt = None,
    workers: Annotated[int, typer.Option("--workers", "-j", min=0, help="Parallel local workers (0: one per "
                                         "core); the output equals the serial one.")] = 1,
    device: DeviceOpt = "cpu",
    affine_from: Annotated[Path | None, typer.Option(
        "--affine-from", metavar="WIDE", help="For a model fitted with --affine-from (or its heads): the tokens file "
        "`mhla reduce` read to make DATA (held-out data reduced with `mhla reduce --like`), whose tokens the affine "
        "map takes. Example: mhla predict m.h5 t8.h5 -o p.h5 --affine-from test384.h5", show_default=False)] = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Last-token predictions (and, optionally, every position's output) of a model on a tokens file.

    The model's normalisation (`--normalize` at fit time) is applied. A model fitted with --attention
    bidirectional writes `outputs` (T, d) at every position (S of the whole window) and scores them
    against per-position targets (weights per position mask positions). --all-positions does the same for any
    model (e.g. one fitted at the last position, scored at every position of an encoder's windows).

    Weights (N,) of last-token targets weigh the MSE (fit's train_mse), with or without --causal.
    R^2 = 1 - SSE / SST over all outputs, SST about the scored targets' weighted mean (null when they
    do not vary).

    Example: mhla predict heads.h5 data.h5 -o pred.h5 --json --workers 2

    Example (autoregressive): mhla predict model.h5 ar.h5 -o pred.h5 --causal --json

    Example (an encoder's windows, a bidirectional model): mhla predict model.h5 heldout.h5 -o pred.h5 --json

    Example (a last-token model at every position of held-out windows): mhla predict model.h5 heldout.h5 -o
    pred.h5 --all-positions --json

    Example (a GPU): mhla predict model.h5 data.h5 -o pred.h5 --device cuda

    Example (a blocks file of `mhla fit --blocks`): mhla predict sum.h5 layer.h5 -o pred.h5 --json
    """
    check_hdf5_output(output, (model_path, data, affine_from), "a predictions file", "predictions")
    if is_blocks_file(model_path):  # a sum of blocks: its outputs in the layout it was fitted on
        return predict_blocks_cmd(model_path, data, output, chunk_size, workers, json_out, quiet)
    if causal and all_positions:
        raise InputError("--causal and --all-positions cannot be combined: --causal outputs the masked "
                         "(prefix) output at every position, --all-positions the unmasked one")
    dev = check_device(device, data)
    fn = load_function(model_path)
    info = inspect_tokens(data)
    every = fitted_samples(fn).predicts_every_position  # e.g. bidirectional: outputs at every position
    with progress_bar("predict", info.n_samples, quiet) as advance:
        res = predict_file(fn, data, output, all_positions=all_positions, chunk_size=chunk_size,
                           progress=advance, inputs=(model_path,) + ((affine_from,) if affine_from else ()),
                           workers=workers, device=dev, affine_from=affine_from, layout=CAUSAL if causal else None)
    if info.per_position and info.has_targets and res.n_scored is None:
        warn(_unscored(info.attention, all_positions))
    assumed = (res.scored_as == BIDIRECTIONAL.attention and info.attention is None and not every)
    say(f"wrote {output}: {res.n_samples} predictions"
        + (f", {info.n_tokens} {CAUSAL.name} outputs" if causal else "")
        + (f", {info.n_tokens} outputs at every position (bidirectional: S of the whole window)"
           if every or all_positions else "")
        + (f"; MSE against targets = {fmt(res.mse)} over {res.n_scored} "
           + ("sequences" if res.scored_as == "sequences" else "positions")
           + (" of weight > 0" if info.has_weights else "")
           + (f", R^2 = {fmt(res.r2)}" if res.r2 is not None else ", R^2 undefined (constant targets)")
           if res.n_scored is not None else ""), quiet)
    if assumed:
        warn(f"{data} has no 'attention' attribute: its per-position targets were scored as an encoder's (every "
             "position with the whole window's S); --causal scores them as a decoder's prefixes")
    if json_out:
        emit_json({**res.to_dict(), "output": str(output)})


def _unscored(attention: str | None, all_positions: bool) -> str:
    """Why per-position targets got no MSE, and the option that scores them."""
    if attention == CAUSAL.attention:
        return ("the data's per-position targets are a decoder's (attribute 'attention' causal): --causal scores "
                "every prefix" + ("; the outputs of --all-positions use the whole window's S" if all_positions
                                  else "") + " (no MSE computed)")
    if attention == BIDIRECTIONAL.attention:
        return ("the data's per-position targets are an encoder's (attribute 'attention' bidirectional): "
                "--all-positions scores every position (no MSE computed)")
    return ("the data have per-position targets: --all-positions scores every position with the whole window's S "
            "(an encoder's), --causal every prefix (a decoder's) (no MSE computed)")


def rollout_cmd(
    model_path: Annotated[Path, typer.Argument(metavar="MODEL|HEADS", help="Model or heads file.")],
    data: Annotated[Path, typer.Argument(help="Tokens file of prompts (each sequence is continued).")],
    output: OutOpt,
    steps: Annotated[int, typer.Option("--steps", "-k", min=1, help="Tokens to generate per sequence.")],
    snap: Annotated[Path | None, typer.Option("--snap", metavar="CODEBOOK", help="Replace every generated token by "
                                              "the nearest (Euclidean) row of the dataset 'codebook' (C, d) of "
                                              "this HDF5 file (a vocabulary of token embeddings).")] = None,
    chunk_size: ChunkOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Generate autoregressively: append K tokens to every sequence, each the last-token output so far.

    The output is a tokens file (tokens (T + N K, d) float64 + offsets) that feeds back into mhla.
    The model's normalisation is applied.

    Example: mhla rollout model.h5 prompts.h5 --steps 20 -o continued.h5

    Example (symbols): mhla rollout heads.h5 prompts.h5 --steps 24 --snap vocab.h5 -o traces.h5 --json
    """
    check_hdf5_output(output, (model_path, data, snap), "a tokens file", "tokens")
    fn = load_function(model_path)
    info = inspect_tokens(data)
    with progress_bar("rollout", info.n_samples, quiet) as advance:
        res = rollout_file(fn, data, output, steps, codebook=snap, chunk_size=chunk_size, progress=advance,
                           inputs=(model_path,))
    say(f"wrote {output}: {res['n_samples']} sequences continued by {steps} generated tokens each"
        + (f" (snapped to {snap})" if snap is not None else ""), quiet)
    if json_out:
        emit_json(res)


def compare_cmd(
    a: Annotated[Path, typer.Argument(metavar="A", help="Model or heads file.")],
    b: Annotated[Path, typer.Argument(metavar="B", help="Model or heads file (the reference).")],
    tol: Annotated[float, typer.Option("--tol", min=0.0, help="Pass when the outputs differ by at most tol relative to "
                                       "B's: the RMS prediction difference on --on DATA over B's RMS prediction; "
                                       "without --on, the same on the training data of B (or A) when its model "
                                       "file keeps that data's Lambda~; with neither, ||p_A - p_B|| / ||p_B|| in "
                                       "the tokens' own coordinates.")] = 1e-6,
    on: Annotated[Path | None, typer.Option("--on", help="Tokens file: judge the two functions by the RMS difference "
                                            "of their predictions on it, relative to the RMS of B's, at the "
                                            "positions their layouts score (every position of a bidirectional "
                                            "model, every prefix of a causal one).")] = None,
    chunk_size: ChunkOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Do A and B compute the same function? Exit 0 if their outputs differ by at most tol (relative), 1 if not,
    2 on error.

    Without --on the outputs are compared on the training data of B (or of A): a model file from `mhla fit`
    keeps that data's Lambda~, so the RMS difference there needs no data file. Two heads files or older model
    files have none: they are compared by their coefficients in the tokens' own coordinates, which depend
    on the units of the tokens (the message says so; give --on DATA).

    Example (a CI gate): mhla compare retrained.h5 model.h5 --tol 1e-6 --on heldout.h5 --json
    """
    fa, fb = load_function(a), load_function(b)
    if token_dim(fa) != token_dim(fb):
        raise InputError(f"the models have different d ({token_dim(fa)} here, {token_dim(fb)} in {b}): nothing to "
                         "compare", a)
    if normalize_of(fa) != normalize_of(fb):
        raise InputError(f"the models use different normalisations ({normalize_of(fa)} here, {normalize_of(fb)} "
                         f"in {b}): their coef act on different features", a)
    if on is not None:
        info = inspect_tokens(on)
        with progress_bar("compare", info.n_samples, quiet) as advance:
            res = compare(fa, fb, tol=tol, on=on, chunk_size=chunk_size, progress=advance)
    else:
        res = compare(fa, fb, tol=tol)
    res["a"], res["b"] = str(a), str(b)
    verdict = "same function" if res["same"] else "different functions"
    coefs = f"||p_A - p_B|| / ||p_B|| = {fmt(res['relative_distance'])}"
    if res["judged_by"] == "data":
        where = ("" if res["scored_as"] == [LAST.name] else  # per-position models: the positions their layouts score
                 f" ({res['n_scored']} samples: {' and '.join(layout_class(n).scored_words for n in res['scored_as'])})")
        text = (f"{verdict} on {on}{where}: RMS prediction difference / RMS prediction of B = "
                f"{fmt(res['relative_rms_difference'])} (tol {fmt(tol)})")
    elif res["judged_by"] == "training data":
        text = (f"{verdict} on the training data of {b if res['measured_on'] == 'b' else a}: RMS output difference / "
                f"RMS output of B = {fmt(res['function_change'])} (tol {fmt(tol)})")
    else:
        text = (f"{verdict} by coefficients: {coefs} (tol {fmt(tol)}) in the tokens' own coordinates, which depend on "
                "their units (neither file keeps its data's Lambda~: --on DATA compares outputs)")
    say(text, quiet, style="green" if res["same"] else "red")
    if res["judged_by"] != "coefficients":
        say(f"  coefficients in the tokens' own coordinates: {coefs}", quiet)
    if res["training_data_differ"] and res["judged_by"] != "training data":
        say(f"  the outputs on the training data of {b if res['measured_on'] == 'b' else a} differ by "
            f"{fmt(res['function_change'])} relative (above tol): different functions", quiet)
    if res["judged_by"] == "training data" and res["same"] and res["training_data_identifiable"] is False:
        warn(f"the training data of {b if res['measured_on'] == 'b' else a} do not determine the function (see "
             "`mhla certify`): A and B agree there but may differ elsewhere; --on DATA compares them on other inputs")
    if json_out:
        emit_json(res)
    if not res["same"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("predict")(predict_cmd)
    app.command("rollout")(rollout_cmd)
    app.command("compare")(compare_cmd)
