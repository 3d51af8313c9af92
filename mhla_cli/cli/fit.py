"""`mhla fit`, `mhla export-heads` and `mhla spectrum`: models and their heads."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from mhla_cli.io import formats
from mhla_cli.numerics import FEWEST_TOL, quote
from mhla_cli.linalg.device import check_device
from mhla_cli.errors import InputError
from mhla_cli.statistics.folds import load_for_cv
from mhla_cli.model.export import save_heads
from mhla_cli.model.heads import Heads
from mhla_cli.api.learn import RequestError, check_export_options, check_fit_file, check_fit_targets, export_heads, fit, fit_warnings, needs_folds, score_on_data
from mhla_cli.solve.lowrank import convergence_warning, fewest_message, hit_limit
from mhla_cli.model.model import Model, load_function
from mhla_cli.solve.spectrum import UnreliableHeadCount, plot_spectrum, pyplot, spectrum, text_histogram
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.files.store_location import is_store
from mhla_cli.statistics.stream import data_kind
from mhla_cli.io.tokens import inspect_tokens
from mhla_cli.cli.blocks import AffineOpt, BlocksOpt, FoldsOpt, export_blocks_cmd, is_blocks_file, fit_blocks_cmd
from mhla_cli.cli.console import BOUND_SIGNS, emit_json, fmt, progress_bar, say, say_samples, warn, working
from mhla_cli.cli.options import CLUSTER_WORDS, REMEDY_OPTIONS, AffineFromOpt, AttentionOpt, BiasTermsOpt, ChunkOpt, DeviceOpt, about, JsonOpt, NormalizeOpt, OutOpt, QuietOpt, SchedulerTimeoutOpt, check_heads_output, check_hdf5_output, check_scheduler_timeout, data_location, on_cluster, parse_auto, require_optional, statistics_for

if TYPE_CHECKING:
    from mhla_cli.samples import ReadSpec


def fit_cmd(
    data: Annotated[Path, typer.Argument(help="Tokens file (with targets) or features file.")],
    output: OutOpt,
    ridge: Annotated[str, typer.Option("--ridge", metavar="L|auto", help="Ridge penalty l on the canonical "
                                       "coefficients: solve (Lambda~ + l I) p_b^T = m~ (see `mhla certify`; l is in "
                                       "the units of the reported lambda_max, whatever the token units); 'auto': l "
                                       "by K-fold CV (the lowest held-out MSE over 0 and 30 values from 1e-8 to 10 "
                                       "times lambda_max, never worse than least squares).")] = "0",
    heads: Annotated[str | None, typer.Option("--heads", help="Factorised fit with H heads (V_h, Q_h), or 'auto' "
                                              "(H by K-fold CV); needs far fewer samples when H is small.")] = None,
    weight_decay: Annotated[float, typer.Option("--weight-decay", min=0.0, help="With --heads: penalty "
                                                "L (||V||^2 + ||Q||^2) / 2 on the factors.")] = 0.0,
    nuclear: Annotated[str | None, typer.Option("--nuclear", help="Nuclear-norm fit: MSE-style loss + LAMBDA "
                                                "||W||_* (FISTA), or 'auto' (LAMBDA by K-fold CV).")] = None,
    restarts: Annotated[int, typer.Option("--restarts", min=1, help="With --heads: number of starts "
                                          "(SVD of the least-squares W, then random); the best is kept.")] = 10,
    seed: Annotated[int, typer.Option("--seed", help="With --heads: seed of the random starts.")] = 0,
    normalize: NormalizeOpt = None,
    attention: AttentionOpt = None,
    bias_terms: BiasTermsOpt = False,
    affine_from: AffineFromOpt = None,
    chunk_size: ChunkOpt = None,
    device: DeviceOpt = "cpu",
    scheduler: Annotated[str | None, typer.Option(
        "--scheduler", metavar="ADDRESS", help="Fit on a Dask cluster, the Gram tiled on its workers and never "
        "gathered: a scheduler address (tcp://host:8786), a scheduler file (.json), or local / local:K (the cluster "
        "extra). DATA is then a tokens file or a Zarr features store; coef comes from two distributed triangular "
        "solves with the Cholesky factor of Lambda~ - t I (or of Lambda~ + l I with --ridge l), and MODEL is the "
        "file a fit on one machine writes. Data that do not determine the function need --ridge there (docs/cluster.md).")] = None,
    scheduler_timeout: SchedulerTimeoutOpt = None,
    blocks: BlocksOpt = None,
    affine: AffineOpt = False,
    folds: FoldsOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Least-squares fit of coef p on the feature statistics (Algorithm 1); writes coef and min-norm W.

    With --heads H or --nuclear LAMBDA: a low-rank fit (W of rank <= H is stored), from the statistics only.
    'auto' chooses by 5-fold CV (folds computed from a tokens file, or stored by `featurize --folds K`);
    --ridge auto chooses the ridge the same way.

    Example: mhla fit feats.h5 -o model.h5 --json;  mhla fit data.h5 -o model.h5 --heads auto

    Example (a GPU): mhla fit feats.h5 -o model.h5 --device cuda

    Example (an encoder's windows): mhla fit bert_l1.h5 -o model.h5 --attention bidirectional --ridge auto
    (the model records the attention: `mhla predict` writes its output at every position)

    Example (a head with biases): mhla fit enc.h5 -o model.h5 --bias-terms (then `mhla export-heads` writes the
    heads and their bias terms)

    Example (with the wide token's affine map): mhla fit h8.h5 -o model.h5 --affine-from hidden384.h5 --ridge 1e-6
    (then `mhla predict model.h5 h8.h5 -o p.h5 --affine-from hidden384.h5`)

    Example (a Dask cluster): mhla fit data.h5 --scheduler tcp://10.0.0.5:8786 -o model.h5 --ridge 1e-6

    Example (a layer as a sum of blocks): mhla fit layer.h5 -o sum.h5 --blocks h0.h5 --blocks h1.h5
    """
    from mhla_cli.samples import ReadSpec  # the layouts need NumPy: not for --help

    if blocks or affine or folds is not None:  # a sum of blocks (docs/blocks.md): --affine and --folds are its own
        return fit_blocks_cmd(data, output, blocks, affine, folds, ridge, normalize, attention, chunk_size, json_out, quiet)
    h, lam, r, dev = _check_options(data, output, ridge, heads, nuclear, normalize, attention, bias_terms,
                                    affine_from, chunk_size, device, scheduler, scheduler_timeout)
    read = ReadSpec(attention, normalize, bias_terms)  # how a tokens file is read (None: as the data say)
    with about(data), on_cluster(scheduler, scheduler_timeout, data):  # about: e.g. a features file without targets
        model, load_seconds = _fit(data, r, h, lam, weight_decay, restarts, seed, read, chunk_size, dev, affine_from,
                                   scheduler, quiet)
    model.save(output, inputs=(data,) + ((affine_from,) if affine_from is not None else ()))
    info = dict(model.info)
    info["output"] = str(output)
    info["seconds"] = {**load_seconds, **info.get("seconds", {})}
    if "tasks" in info:  # on a cluster
        info.update(input=data_location(data), scheduler=scheduler)
    _say_fit(info, output, h is not None or lam is not None, quiet)
    for w in fit_warnings(info, ridge_name="--ridge", words=REMEDY_OPTIONS):
        warn(w)
    if json_out:
        emit_json(info)


def _check_options(data: Path, output: Path, ridge: str, heads: str | None, nuclear: str | None,
                   normalize: str | None, attention: str | None, bias_terms: bool, affine_from: Path | None,
                   chunk_size: int | None, device: str, scheduler: str | None, scheduler_timeout: float | None
                   ) -> tuple[Any, Any, Any, str | None]:
    """The rules of fit's options, before any work: the parsed --heads, --nuclear, --ridge and the device."""
    check_hdf5_output(output, (data, affine_from), "a model file", "model")
    if scheduler is not None and affine_from is not None:
        raise InputError(CLUSTER_WORDS["affine"], affine_from)
    auto = ridge.strip().lower() == "auto"
    if affine_from is not None and (heads is not None or nuclear is not None):
        raise InputError(FLAG_WORDS["affine_least_squares"])
    dev = check_device(device, data)
    check_scheduler_timeout(scheduler, scheduler_timeout)
    if scheduler is not None and (heads is not None or nuclear is not None or auto or dev is not None):
        raise InputError("--scheduler fits least squares (with a --ridge l > 0, or none) on the cluster's CPUs: "
                         "it cannot be combined with --heads, --nuclear, --ridge auto or --device")
    if not is_store(data_location(data)):
        check_fit_targets(data)
    h, lam = parse_auto(heads, "--heads", int), parse_auto(nuclear, "--nuclear", float)
    r = parse_auto(ridge, "--ridge", float)
    if scheduler is None:  # the memory of one machine, and the folds 'auto' needs
        with in_flags():
            check_fit_file(data, ridge=r, heads=h, nuclear=lam, normalize=normalize, chunk_size=chunk_size,
                           attention=attention, bias_terms=bias_terms)
    return h, lam, r, dev


def _fit(data: Path, r: Any, h: Any, lam: Any, weight_decay: float, restarts: int, seed: int, read: ReadSpec,
         chunk_size: int | None, device: str | None, affine_from: Path | None, scheduler: str | None, quiet: bool
         ) -> tuple[Model, dict[str, float]]:
    """The model of `data` by the library's one `fit`, on one machine or on the cluster of `scheduler`, with the
    seconds of its load; a model whose statistics' squares underflow is scored on its tokens file."""
    fold_feats = None
    if needs_folds(r, h, lam):
        stats, fold_feats, load_seconds = _load_for_cv(data, chunk_size, quiet, read, affine_from)
    else:
        stats, load_seconds = statistics_for(data, scheduler, chunk_size, quiet, read, device, affine_from)
    with working(f"fit on the cluster {scheduler}: the tiled Gram, its Cholesky and the triangular solves"
                 if scheduler else f"fit: solving on the canonical Lambda~ ({stats.n_features} features)", quiet), \
            in_flags():
        model = fit(stats, ridge=r, heads=h, nuclear=lam, weight_decay=weight_decay, restarts=restarts, seed=seed,
                    folds=fold_feats, device=device, scheduler=scheduler, read=read, chunk_size=chunk_size)
    if model.info.get("targets_underflow") and data_kind(data) == "tokens":
        # the statistics' squares underflow: R^2 and the MSE from a scoring pass over the data, as predict does
        with working("fit: scoring the data (the targets' squares underflow the statistics)", quiet):
            model.info.update(score_on_data(model, data, chunk_size, affine_from))
    return model, load_seconds


# The library's rules of a fit or export request (api.learn.RULES) in the words of the flags.
FLAG_WORDS = {
    "ridge_with_lowrank": "--ridge applies to the least-squares fit; use --weight-decay with --heads",
    "auto_without_folds": "has no per-fold statistics, which 'auto' needs: make them with "
                          "`mhla featurize DATA -o FEATS --folds K`, or fit the tokens file directly",
    "auto_with_normalize": "'auto' with --normalize: featurize first, e.g. `mhla featurize DATA -o FEATS "
                           "--folds 5 --normalize length`, then fit FEATS",
    "fewest_with_max_heads": "--fewest and --max-heads cannot be combined",
    "affine_least_squares": "--affine-from is fitted by least squares (--ridge L or auto; no --heads or --nuclear)",
    "lowrank_width": "--heads and --nuclear need targets as wide as the tokens; fit targets of another width by "
                     "least squares (without --heads / --nuclear)",
    "fewest_width": "--fewest needs a model whose outputs are as wide as its tokens; export without --fewest "
                    "(--max-heads H keeps the strongest heads)",
    "affine_domain": "the certificate with --affine-from is of the full domain: certify without --domain",
    "blocks_least_squares": "--blocks is fitted by least squares (--ridge L or auto, --folds K; no --heads or --nuclear)",
    "blocks_in_memory": "--blocks is certified and fitted on one machine's CPU, on the full domain: no --scheduler, "
                        "--device or --domain",
}


@contextlib.contextmanager
def in_flags() -> Iterator[None]:
    """A RequestError of the library raised again in the words of the flags (FLAG_WORDS), same file."""
    try:
        yield
    except RequestError as exc:
        raise InputError(FLAG_WORDS[exc.rule], exc.path) from None


def _load_for_cv(data: Path, chunk_size: int | None, quiet: bool, read: ReadSpec, affine_from: Path | None = None
                 ) -> tuple[Features, list[Features], dict[str, float]]:
    """The statistics of `data` read as `read` says with their per-fold statistics ('auto'), and the seconds."""
    t0 = time.perf_counter()
    with progress_bar("featurize", inspect_tokens(data).n_samples
                      if data_kind(data) == "tokens" else 0, quiet) as advance:
        feats, fold_feats = load_for_cv(data, chunk_size=chunk_size, progress=advance, read=read,
                                        affine_from=affine_from)
        feats.expand_held()
    say_samples(feats, data, read.attention, quiet)
    return feats, fold_feats, {"load": time.perf_counter() - t0}


def _say_fit(info: dict[str, Any], output: Path, lowrank_fit: bool, quiet: bool) -> None:
    """What `mhla fit` says of the model it wrote: its train MSE and conditioning, the low-rank fit, the CV."""
    if info["train_mse"] <= info["mse_resolution"]:
        mse_text = (f"train MSE ~ 0 (below the {fmt(info['mse_resolution'])} float64 resolution of the "
                    "statistics; `mhla predict` gives the exact value)")
    else:
        mse_text = f"train MSE = {fmt(info['train_mse'])}"
    if info.get("train_r2") is not None:
        mse_text += f", train R^2 = {fmt(info['train_r2'])}"
    lmin = f"{BOUND_SIGNS.get(info.get('lambda_min_bound'), '=')} {fmt(info['lambda_min'])}"
    say(f"wrote {output}: {mse_text}, lambda_min {lmin}, "
        f"condition number = {fmt(info['condition_number'])}", quiet)
    if info.get("affine_hyperplanes"):
        n = len(info["affine_hyperplanes"])
        say(f"  the wide tokens lie on {n} hyperplane(s) a^T x = c (`mhla certify` names them): the affine map is "
            "fitted, and the condition number taken, on their affine hull", quiet)
    if lowrank_fit:
        say(f"  {info['method']} fit: {info['n_heads']} head(s), final objective {fmt(info['objective'])}"
            + (f" (CV over {info['n_folds']} folds chose {info['cv']['chosen']:.4g})" if "cv" in info else "")
            + (f"; head strengths ||V_h|| ||Q_h|| = {', '.join(fmt(x) for x in info['head_norms'])}"
               if "head_norms" in info else ""), quiet)
    if "ridge_cv" in info:
        cv = info["ridge_cv"]
        say(f"  --ridge auto: {cv['n_folds']}-fold CV chose ridge {fmt(cv['chosen'])} (held-out MSE "
            f"{fmt(cv['cv_mse'])}; least squares {fmt(cv['least_squares_cv_mse'])})", quiet)


def export_heads_cmd(
    model_path: Annotated[Path, typer.Argument(metavar="MODEL", help="Model file from `mhla fit` (or a blocks file of "
                                                "`mhla fit --blocks`: the dense heads of the sum).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output heads file, its format named by the "
                                         "suffix: .h5 / .hdf5 / .hdf (HDF5), .npz (NumPy) or .safetensors (needs "
                                         "the safetensors extra); written atomically. Example: -o heads.npz")],
    max_heads: Annotated[str | None, typer.Option("--max-heads", help="Keep at most the H strongest heads; 'auto': "
                                                  "the spectrum's outliers (see `mhla spectrum`).")] = None,
    tol: Annotated[float, typer.Option("--tol", min=0.0, help="Drop heads with s_h <= tol * s_max (singular "
                                       "values of W in the canonical coordinates of the model's data).")] = 1e-12,
    fewest: Annotated[bool, typer.Option("--fewest", help=f"The fewest heads computing the same function: a "
                                         f"function change on the training data <= {quote(FEWEST_TOL)}, verified "
                                         "(the coefficient change for a model without its data's Lambda~).")] = False,
    unreduce: Annotated[Path | None, typer.Option("--unreduce", help="A tokens file written by `mhla reduce` (the "
                                                  "one MODEL was fitted on, or one --like it; checked against the "
                                                  "model's record of its data): write the heads of its original "
                                                  "widths, kept factored as the reduced heads V_h, Q_h and the maps "
                                                  "P (D x d), U (D_out x d), the function U V_h P^T x ... at the cost "
                                                  "of the reduced heads.", show_default=False)] = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """SVD of W into heads V_h, Q_h (at most d^2), reporting the change of the function on the training data.

    The heads are found in the canonical (whitened) coordinates of the model's data and written in the
    tokens' own, so counts do not depend on the units of the tokens. The change reported (and cut on by
    --fewest) is the RMS difference of the outputs over the training inputs relative to the RMS output,
    from the data's Lambda~ that `mhla fit` stores in the model; for model files without it (written
    before, or not by fit) only a coefficient change is given, named as such.

    With --unreduce REDUCED the heads are mapped back to the coordinates before `mhla reduce`: on the
    original tokens they compute U times the reduced model's outputs on the reduced tokens. They are written
    factored (V_h, Q_h of the reduced coordinates and the maps reduce_P, reduce_U): `mhla predict`, `compare`
    and `Heads.to_torch()` evaluate them at the cost of the reduced heads; `Heads.dense()` gives the D x D
    matrices V = U V_h P^T, Q = P Q_h P^T. REDUCED must hold the maps the model's training data were made
    with (another `mhla reduce` run of the same d is refused).

    Example: mhla export-heads model.h5 -o heads.h5 --max-heads 4;  mhla export-heads model.h5 -o heads.h5 --fewest --json

    Example: mhla export-heads m8.h5 -o heads384.safetensors --unreduce h8.h5
    """
    check_heads_output(output, (model_path,))  # the suffix names the format: an unknown one is refused
    if is_blocks_file(model_path):  # a sum of blocks: its dense heads
        return export_blocks_cmd(model_path, output, json_out, quiet)
    mh = parse_auto(max_heads, "--max-heads", int)
    with in_flags():
        check_export_options(mh, fewest)
    red = None
    model = Model.load(model_path)
    if unreduce is not None:
        from mhla_cli.model.reduce import check_unreduce, load_reduction

        red = load_reduction(unreduce)  # before the work: a file without maps is refused first
        unchecked = check_unreduce(model, unreduce, model_path)  # the maps the model's data were made with
        if unchecked is not None:
            warn(unchecked)
    try:
        heads = export_heads(model, tol=tol, max_heads=mh, fewest=fewest)
    except UnreliableHeadCount as exc:  # --max-heads auto without a reliable count: a failed check, no file
        warn(f"{model_path}: {exc}")
        if json_out:
            emit_json({"output": None, "n_heads": None, "n_outliers": None, "count_reliable": False,
                       "reason": str(exc), "input": str(model_path)})
        raise typer.Exit(1) from None
    if red is not None:
        from mhla_cli.model.reduce import unreduce_heads

        heads = unreduce_heads(heads, red, unreduce)
    save_heads(heads, output, inputs=(model_path,) + ((unreduce,) if unreduce is not None else ()))
    out = _export_record(heads, output, unreduce, fewest, mh == "auto")
    _say_export(heads, out, unreduce, fewest, mh == "auto", quiet)
    if json_out:
        emit_json(out)


def _export_record(heads: Heads, output: Path, unreduce: Path | None, fewest: bool, auto: bool) -> dict[str, Any]:
    """The `mhla export-heads --json` record of the heads written to `output` (with the search's or the
    spectrum's numbers for --fewest / --max-heads auto)."""
    out = {"output": str(output), "n_heads": heads.n_heads, "d": heads.d, "d_out": heads.d_out,
           "unreduced": None if unreduce is None else str(unreduce),
           "function_change": heads.info["function_change"], "coef_change": heads.info["coef_change"],
           "coordinates": heads.info["coordinates"], "singular_values": heads.info["singular_values"],
           "affine_block": heads.affine_weight is not None}
    if fewest or auto:
        keys = ("lower_bound", "proven_minimal", "starts_tried", "starts_per_head_count", "best_error",
                "lower_bound_info") if fewest else ("threshold", "threshold_method")
        out.update({k: heads.info[k] for k in keys}, converged=(heads.info["solver"] or {}).get("converged"),
                   solver=heads.info["solver"])
    return out


def _say_export(heads: Heads, out: dict[str, Any], unreduce: Path | None, fewest: bool, auto: bool,
                quiet: bool) -> None:
    """What `mhla export-heads` says of the heads it wrote, and the warning of a solver at its limit."""
    shape = f"d = {heads.d}" if heads.d_out == heads.d else f"d = {heads.d} -> d_out = {heads.d_out}"
    back = f" (in the coordinates of {unreduce} before mhla reduce)" if unreduce is not None else ""
    say(f"wrote {out['output']}: {heads.n_heads} heads of {shape}{back}; {change_text(out)}", quiet)
    if fewest:
        say(f"  {fewest_message(heads.info)}", quiet)
    if (fewest or auto) and hit_limit(heads.info["solver"]):
        warn(convergence_warning(heads.info["solver"], "the minimum-nuclear-norm W")
             + ("; it only seeds the search, the heads are verified" if fewest else
                f"; the outlier count is kept: its heads stand {fmt(heads.info.get('gap'))}x above the rest"))


def change_text(rec: dict[str, Any]) -> str:
    """The change of the function a head export or spectrum made, in words: on the training data when the model
    keeps its data's Lambda~, else the coefficient change, named as such (mhla_cli.model.canonical)."""
    if rec.get("function_change") is not None:
        return (f"function change on the training data (RMS output change / RMS output) = "
                f"{fmt(rec['function_change'])}")
    where = ("canonical (whitened) coordinates" if rec.get("coordinates") == "canonical"
             else "tokens' own coordinates, which depend on their units")
    why = ("a model with the affine map of the wide tokens keeps no Lambda~ of its data" if rec.get("affine_block")
           else "the model keeps no Lambda~ of its data; fit it again with this mhla")
    return (f"coefficient change ||p_b' - p_b|| / ||p_b|| = {fmt(rec['coef_change'])} in the {where} (no function "
            f"change on the data: {why})")


def spectrum_cmd(
    model_path: Annotated[Path, typer.Argument(metavar="MODEL", help="Model or heads file.")],
    plot: Annotated[Path | None, typer.Option("--plot", help="Also write a PNG of the spectrum to this .png "
                                              "file (needs the 'plot' extra: matplotlib; checked before any "
                                              "work). Example: --plot spectrum.png")] = None,
    max_iter: Annotated[int, typer.Option("--max-iter", min=1, help="Iteration limit of the minimum-nuclear-norm "
                                          "solver (a warning says when it is reached).")] = 5000,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Head strengths: singular values of the minimum-nuclear-norm W of the model's function, split into
    heads (outliers) and a noise bulk by the Gavish-Donoho threshold on the nonzero values.

    W is taken in the canonical (whitened) coordinates of the model's data, so the values and the count do
    not depend on the units of the tokens; a heads file, or a model file without its canonical basis, is
    taken in the tokens' own coordinates (JSON "coordinates" says which).

    Example: mhla spectrum model.h5 --plot spectrum.png --json
    """
    if plot is not None:
        check_plot_output(plot, (model_path,))
    fn = load_function(model_path)
    spec = spectrum(fn, max_iter=max_iter)
    out = {**spec.to_dict(), "input": str(model_path)}
    if not spec.count_reliable:  # one warning: no count (exit 1 below)
        warn(f"{model_path}: {spec.reason}")
    elif spec.converged is False:  # one warning: the count stands on its gap
        assert spec.solver is not None  # converged is False only for an iterative solver's record
        warn(convergence_warning(spec.solver, "the minimum-nuclear-norm W") + f"; the head count is kept: its "
             f"heads stand {fmt(spec.gap)}x above the rest")
    count = "no reliable count of" if spec.n_outliers is None else str(spec.n_outliers)
    say(f"{model_path}: {count} head(s) above the threshold {fmt(spec.threshold)} "
        f"({spec.threshold_method}); {spec.nonzero_rank} nonzero of {len(spec.singular_values)} "
        f"singular values of W in the {spec.coordinates} coordinates, effective rank {fmt(spec.effective_rank)}",
        quiet)
    say(text_histogram(spec), quiet)
    if plot is not None:
        plot_spectrum(spec, plot)
        out["plot"] = str(plot)
        say(f"wrote {plot}", quiet)
    if json_out:
        emit_json(out)
    if not spec.count_reliable:
        raise typer.Exit(1)


def check_plot_output(plot: Path, inputs: tuple[Path, ...]) -> None:
    """--plot writes a PNG: another suffix, or no matplotlib, is refused before any work."""
    if plot.suffix.lower() != ".png":
        raise InputError(f"--plot writes a PNG image; the suffix '{plot.suffix}' names another format: "
                         "use .png", plot)
    # without matplotlib, pyplot raises the library's InputError (with its install hint) at once
    require_optional("matplotlib", pyplot)  # matplotlib, not pyplot: it would pick a backend
    formats.check_output_path(plot, inputs, "plot")


def register(app: typer.Typer) -> None:
    app.command("fit")(fit_cmd)
    app.command("export-heads")(export_heads_cmd)
    app.command("spectrum")(spectrum_cmd)
