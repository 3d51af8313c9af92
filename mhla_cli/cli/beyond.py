"""Commands beyond the paper: spectrum (real heads vs noise) and compare (same function?)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .. import formats
from ..compare import compare
from ..lowrank import convergence_warning
from ..model import load_function
from ..spectrum import plot_spectrum, spectrum, text_histogram
from ._common import (
    ChunkOpt,
    JsonOpt,
    QuietOpt,
    emit_json,
    fmt,
    progress_bar,
    say,
    warn,
)
from ..tokens import inspect_tokens


def spectrum_cmd(
    model_path: Annotated[Path, typer.Argument(metavar="MODEL", help="Model or heads file.")],
    plot: Annotated[Path | None, typer.Option("--plot", help="Also write a PNG of the spectrum "
                                              "(needs the 'plot' extra: matplotlib).")] = None,
    max_iter: Annotated[int, typer.Option("--max-iter", min=1, help="Iteration limit of the minimum-nuclear-norm "
                                          "solver (a warning says when it is reached).")] = 5000,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Head strengths: singular values of the minimum-nuclear-norm W of the model's function, split into
    heads (outliers) and a noise bulk by the Gavish-Donoho threshold on the nonzero values.

    Example: mhla spectrum model.h5 --plot spectrum.png --json
    """
    if plot is not None:
        formats.check_output_path(plot, (model_path,))
    fn = load_function(model_path)
    spec = spectrum(fn, max_iter=max_iter)
    out = {k: v for k, v in spec.items() if k != "W"}
    out["input"] = str(model_path)
    if not spec["converged"]:
        warn(convergence_warning(spec["solver"], "the minimum-nuclear-norm W") + ": its zero singular values, "
             "and so the head count below, are not reliable")
    say(f"{'UNCONVERGED: ' if not spec['converged'] else ''}{model_path}: {spec['n_outliers']} head(s) above the threshold {fmt(spec['threshold'])} "
        f"({spec['threshold_method']}); {spec['nonzero_rank']} nonzero of {len(spec['singular_values'])} "
        f"singular values, effective rank {fmt(spec['effective_rank'])}", quiet)
    say(text_histogram(spec), quiet)
    if plot is not None:
        plot_spectrum(spec, plot)
        out["plot"] = str(plot)
        say(f"wrote {plot}", quiet)
    if json_out:
        emit_json(out)


def compare_cmd(
    a: Annotated[Path, typer.Argument(metavar="A", help="Model or heads file.")],
    b: Annotated[Path, typer.Argument(metavar="B", help="Model or heads file (the reference).")],
    tol: Annotated[float, typer.Option("--tol", min=0.0, help="Pass when ||p_A - p_B|| / ||p_B|| <= tol.")] = 1e-6,
    on: Annotated[Path | None, typer.Option("--on", help="Tokens file: also report the RMS difference "
                                            "of the two models' predictions on it.")] = None,
    chunk_size: ChunkOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Do A and B compute the same function? Exit 0 if the relative p-distance <= tol, 1 if not, 2 on error.

    Example (a CI gate): mhla compare retrained.h5 model.h5 --tol 1e-6 --on heldout.h5 --json
    """
    fa, fb = load_function(a), load_function(b)
    if on is not None:
        info = inspect_tokens(on)
        with progress_bar("compare", info.n_samples, quiet) as advance:
            res = compare(fa, fb, tol=tol, on=on, chunk_size=chunk_size, progress=advance)
    else:
        res = compare(fa, fb, tol=tol)
    res["a"], res["b"] = str(a), str(b)
    verdict = "same function" if res["same"] else "different functions"
    say(f"{verdict}: ||p_A - p_B|| = {fmt(res['distance'])}, relative {fmt(res['relative_distance'])} "
        f"(tol {fmt(tol)})" + (f"; RMS prediction difference on {on} = {fmt(res['rms_prediction_difference'])}"
                               if on is not None else ""), quiet, style="green" if res["same"] else "red")
    if json_out:
        emit_json(res)
    if not res["same"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("spectrum")(spectrum_cmd)
    app.command("compare")(compare_cmd)
