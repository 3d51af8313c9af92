"""The core commands: generate, featurize, certify, fit, export-heads, predict, inspect."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from .. import formats, synthetic
from ..errors import InputError
from ..heads import export_heads
from ..model import Model, load_function
from ..forward import predict_file, rollout_file
from ..solve import certify, fit
from ..stream import Features, featurize
from ._common import ChunkOpt, JsonOpt, OutOpt, QuietOpt, emit_json, fmt, progress_bar, say, warn
from ..tokens import inspect_tokens

generate_app = typer.Typer(help="Make synthetic datasets (tokens files with targets).", no_args_is_help=True)


NormalizeOpt = Annotated[str | None, typer.Option(
    "--normalize", help="none (default) or length: divide S by the number of tokens of the prefix (per-position "
    "data) or sequence, the 1/n-scaled linear attention; stored in the features, model and heads files. "
    "Example: --normalize length")]


def _load_or_featurize(path: Path, chunk_size: int | None, quiet: bool,
                       normalize: str | None = None) -> tuple[Features, str]:
    """Features of a features file (whose normalisation must match `normalize` if given) or a tokens file."""
    from ..stream import check_normalize

    if normalize is not None:
        check_normalize(normalize)
    kind = formats.kind_of(path)
    if kind == "features":
        feats = Features.load(path)
        if normalize is not None and normalize != feats.normalize:
            raise InputError(f"was featurized with --normalize {feats.normalize}, not {normalize}; "
                             "re-run `mhla featurize` with the normalisation wanted", path)
        return feats, kind
    if kind == "tokens":
        info = inspect_tokens(path)
        with progress_bar("featurize", info.n_samples, quiet) as advance:
            return featurize(path, chunk_size=chunk_size, progress=advance, normalize=normalize or "none"), kind
    raise InputError(f"is a {kind} file, expected a tokens or features file", path)


@generate_app.command("teacher")
def generate_teacher_cmd(
    output: OutOpt,
    dim: Annotated[int, typer.Option("--dim", min=1, help="Token dimension d.")],
    heads: Annotated[int, typer.Option("--heads", min=1, help="Number of teacher heads H.")],
    n_samples: Annotated[int, typer.Option("--n-samples", min=1, help="Number of sequences N.")],
    seq_len: Annotated[str, typer.Option("--seq-len", help="Sequence length n, or MIN:MAX for ragged lengths.")] = "100",
    noise: Annotated[float, typer.Option("--noise", min=0.0, help="Std of Gaussian label noise.")] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="Random seed.")] = 0,
    teacher_out: Annotated[Path | None, typer.Option("--teacher-out", help="Also write the teacher as a heads file.")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="Stored dtype: float32 or float64.")] = "float32",
    per_position: Annotated[bool, typer.Option("--per-position", help="Targets at every position (T, d): the "
                                               "teacher's output on every prefix (autoregressive data).")] = False,
    normalize: NormalizeOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Gaussian tokens labelled by a random H-head MHLA teacher (outputs scaled to RMS 1).

    Example: mhla generate teacher -o data.h5 --dim 4 --heads 2 --n-samples 2048 --seq-len 100 --teacher-out teacher.h5

    Example (causal): mhla generate teacher -o ar.h5 --dim 3 --heads 2 --n-samples 10 --seq-len 5:40 --per-position
    """
    if dtype not in ("float32", "float64"):
        raise InputError(f"--dtype must be float32 or float64, got {dtype}")
    from ..stream import check_normalize

    normalize = check_normalize(normalize or "none")
    formats.check_output_path(output)
    if teacher_out is not None:
        formats.check_output_path(teacher_out)
        if Path(teacher_out).resolve() == Path(output).resolve():
            raise InputError("--teacher-out must differ from -o", teacher_out)
    ds, teacher = synthetic.generate_teacher(dim, heads, n_samples, seq_len, noise, seed, dtype=dtype,
                                             per_position=per_position, normalize=normalize)
    attrs = {"generator": "teacher", "seed": seed, "noise": noise, "n_heads": heads,
             "per_position": int(per_position), "normalize": normalize}
    ds.save(output, dtype=dtype, attrs=attrs)
    if teacher_out is not None:
        teacher.save(teacher_out)
    summary = {"output": str(output), "n_samples": ds.n_samples, "d": dim, "n_tokens": int(ds.offsets[-1]),
               "n_heads": heads, "teacher": str(teacher_out) if teacher_out else None,
               "per_position": per_position, "normalize": normalize}
    say(f"wrote {output}: N = {ds.n_samples} sequences, d = {dim}, {summary['n_tokens']} tokens"
        + (f"; teacher ({heads} heads) in {teacher_out}" if teacher_out else ""), quiet)
    if json_out:
        emit_json(summary)


@generate_app.command("assoc")
def generate_assoc_cmd(
    output: OutOpt,
    keys: Annotated[int, typer.Option("--keys", min=1, help="Number of key/value pairs k (token dim 2k).")],
    n_samples: Annotated[int, typer.Option("--n-samples", min=1, help="Number of sequences N.")],
    orthogonal_fraction: Annotated[float, typer.Option("--orthogonal-fraction", min=0.0, max=1.0,
                                                       help="Share of samples with orthogonal keys/values.")] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="Random seed.")] = 0,
    teacher_out: Annotated[Path | None, typer.Option("--teacher-out", help="Also write the exact 1-head teacher.")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="Stored dtype: float32 or float64.")] = "float32",
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """The paper's associative memory: rows (k_j, v_j) then (q, 0); target (0, sum_j <q,k_j> v_j).

    Example: mhla generate assoc -o assoc.h5 --keys 4 --n-samples 16384 --orthogonal-fraction 1.0
    """
    if dtype not in ("float32", "float64"):
        raise InputError(f"--dtype must be float32 or float64, got {dtype}")
    formats.check_output_path(output)
    if teacher_out is not None:
        formats.check_output_path(teacher_out)
    ds, teacher = synthetic.generate_assoc(keys, n_samples, orthogonal_fraction, seed, dtype=dtype)
    ds.save(output, dtype=dtype, attrs={"generator": "assoc", "seed": seed,
                                        "orthogonal_fraction": orthogonal_fraction, "keys": keys})
    if teacher_out is not None:
        teacher.save(teacher_out)
    say(f"wrote {output}: N = {ds.n_samples} associative-memory sequences, k = {keys}, d = {2 * keys}", quiet)
    if json_out:
        emit_json({"output": str(output), "n_samples": ds.n_samples, "d": 2 * keys, "keys": keys,
                   "orthogonal_fraction": orthogonal_fraction,
                   "teacher": str(teacher_out) if teacher_out else None})


def featurize_cmd(
    data: Annotated[Path, typer.Argument(help="Tokens file (tokens + offsets, or tokens (N, n, d)).")],
    output: OutOpt,
    chunk_size: ChunkOpt = None,
    shard: Annotated[str | None, typer.Option("--shard", help="Only the i-th of M contiguous sample ranges, as i/M (0-based).")] = None,
    folds: Annotated[int | None, typer.Option("--folds", min=2, help="Also store the statistics of K contiguous "
                                              "folds (for `fit --heads auto` / `--nuclear auto`).")] = None,
    workers: Annotated[int, typer.Option("--workers", "-j", min=0, help="Parallel local workers (0: one per "
                                         "core); the result equals the serial one up to summation order.")] = 1,
    scheduler: Annotated[str | None, typer.Option("--scheduler", help="Run on a Dask cluster: a scheduler address "
                                                  "(tcp://host:8786), a scheduler file (.json), or local / local:K "
                                                  "(needs the dask extra).")] = None,
    normalize: NormalizeOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Stream a tokens file into the feature statistics (gram, moments, ...), in float64.

    Per-position data (targets (T, d), or (N, n, d) with dense tokens) are featurized causally: every
    prefix X[:t] with weight > 0 is a sample (target y_t); optional `weights` weigh samples.

    Memory is O(chunk + psi^2) whatever N is. For job arrays, run one --shard i/M per job and sum
    the parts with `mhla merge`.

    Example: mhla featurize data.h5 -o feats.h5 --workers 4
    Example (job array): mhla featurize data.h5 --shard 3/8 -o part_3.h5 && mhla merge part_*.h5 -o feats.h5
    """
    if scheduler is not None and workers != 1:
        raise InputError("--workers and --scheduler cannot be combined (the Dask cluster sets the workers)")
    from ..stream import check_normalize

    parallel = {"workers": workers, "scheduler": scheduler, "normalize": check_normalize(normalize or "none")}
    formats.check_output_path(output, (data,))
    info = inspect_tokens(data)
    shard_t = _parse_shard(shard)
    total = info.n_samples
    if shard_t is not None:
        from ..stream import shard_range

        lo, hi = shard_range(info.n_samples, *shard_t)
        total = hi - lo
    with progress_bar("featurize", total, quiet) as advance:
        if folds is not None:
            from ..folds import featurize_folds, save_with_folds

            if shard_t is not None:
                raise InputError("--folds and --shard cannot be combined")
            feats, fold_feats = featurize_folds(data, folds, chunk_size=chunk_size, progress=advance, **parallel)
        else:
            feats = featurize(data, chunk_size=chunk_size, shard=shard_t, progress=advance, **parallel)
    if folds is not None:
        save_with_folds(feats, fold_feats, output, inputs=(data,))
    else:
        feats.save(output, inputs=(data,))
    psi = feats.n_features
    say(f"wrote {output}: d = {feats.d}, psi = {psi} features, N = {feats.n_samples} "
        + ("positions (causal)" if feats.per_position else "samples") + f", {feats.n_tokens} tokens"
        + ("" if feats.has_targets else " (no targets)")
        + (", S normalised by length" if feats.normalize == "length" else ""), quiet)
    if json_out:
        emit_json({"output": str(output), "d": feats.d, "n_features": psi, "n_samples": feats.n_samples,
                   "n_tokens": feats.n_tokens, "has_targets": feats.has_targets,
                   "per_position": feats.per_position, "normalize": feats.normalize,
                   "n_sequences": feats.n_sequences,
                   "sample_range": list(feats.sample_range) if feats.sample_range else None})


def _parse_shard(shard: str | None) -> tuple[int, int] | None:
    if shard is None:
        return None
    try:
        i, m = (int(x) for x in shard.split("/"))
    except ValueError:
        raise InputError(f"--shard '{shard}': expected i/M, e.g. 0/8") from None
    if m < 1 or not 0 <= i < m:
        raise InputError(f"--shard '{shard}': need 0 <= i < M")
    return i, m


def certify_cmd(
    data: Annotated[Path, typer.Argument(help="Tokens file or features file.")],
    min_eig: Annotated[float, typer.Option("--min-eig", min=0.0,
                                           help="Demand lambda_min(Lambda_D) > this (a margin for CI); "
                                                "the numerical tolerance psi*eps*lambda_max always applies.")] = 0.0,
    domain: Annotated[str, typer.Option("--domain", help="full: every input in R^d (the paper). observed: "
                                        "inputs in the span of the data's tokens / last tokens.")] = "full",
    witness: Annotated[Path | None, typer.Option("--witness", help="When not identifiable, write two models with "
                                                 "the same training loss but different functions, and an "
                                                 "input on which they differ, to this file.")] = None,
    on: Annotated[Path | None, typer.Option("--on", metavar="PROBES", help="Instead of all inputs, test the inputs "
                                            "of this tokens file (every sequence, or every weighted position of "
                                            "per-position data): exit 0 when the data determine the output on "
                                            "every one. Example: mhla certify train.h5 --on test.h5 -o report.h5")] = None,
    report: Annotated[Path | None, typer.Option("--output", "-o", metavar="REPORT", help="With --on: write the "
                                                "per-probe residuals and the undetermined probes to this HDF5 "
                                                "file.")] = None,
    normalize: NormalizeOpt = None,
    chunk_size: ChunkOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Certify that the data determine the learned function (Lemma 2.3). Exit 0 yes, 1 no, 2 error.

    With --on PROBES: whether every zero-loss model gives the same output on each probe input (its
    feature vector in the range of gram: relative null-space component <= 1e-8).

    Example (a CI gate): mhla certify data.h5 --json > cert.json || exit 1;  mhla certify data.h5 --witness w.h5

    Example (given inputs): mhla certify train.h5 --on heldout.h5 -o report.h5 --json
    """
    if domain not in ("full", "observed"):
        raise InputError(f"--domain must be full or observed, got '{domain}'")
    if on is None and report is not None:
        raise InputError("-o/--output REPORT is the report of --on PROBES; give --on")
    if on is not None:
        if witness is not None or domain != "full" or min_eig > 0:
            raise InputError("--on tests the given probes: it cannot be combined with --witness, --domain "
                             "or --min-eig")
        inspect_tokens(on)
        if report is not None:
            formats.check_output_path(report, (data, on))
        _certify_on(data, on, report, normalize, chunk_size, json_out, quiet)
        return
    if witness is not None:
        formats.check_output_path(witness, (data,))
        if formats.kind_of(data) == "tokens" and inspect_tokens(data).per_position:
            raise InputError("--witness supports last-token data only (this file has per-position data)", data)
    feats, _ = _load_or_featurize(data, chunk_size, quiet, normalize)
    if witness is not None and (feats.per_position or feats.normalize != "none"):
        raise InputError("--witness supports unweighted last-token data without --normalize only", data)
    cert = certify(feats, min_eig=min_eig, domain=domain)
    out = cert.to_dict()
    out["input"] = str(data)
    try:
        out["input_identity"] = formats.source_identity(data)
    except InputError:
        pass
    verdict = "identifiable" if cert.identifiable else "NOT identifiable"
    say(f"{data}: {verdict} on the {domain} domain: lambda_min = {fmt(cert.lambda_min)}, "
        f"lambda_max = {fmt(cert.lambda_max)}, threshold = {fmt(cert.threshold)}, rank {cert.rank}/"
        f"{cert.n_features}, N = {cert.n_samples}", quiet, style="green" if cert.identifiable else "red")
    if domain == "observed":
        say(f"  observed domain: dim U = {cert.dim_tokens}, dim U_n = {cert.dim_last_tokens}, "
            f"{cert.n_features} reduced features", quiet)
    for r in cert.reasons:
        say(f"  - {r}", quiet)
    if witness is not None and not cert.identifiable:
        from ..witness import make_witness

        wit = make_witness(feats, data=data, cert=cert, chunk_size=chunk_size)
        wit.save(witness, inputs=(data,))
        wi = wit.info
        out["witness"] = {"output": str(witness), **wit.summary()}
        say(f"  witness in {witness} ({wi['kind']}): {wi['message']}", quiet,
            style="yellow" if wi["kind"] != "indistinguishable" else None)
        say(f"  probe input: {wi['probe']}", quiet)
    elif witness is not None:
        warn("the data certify: no witness to write")
    if json_out:
        emit_json(out)
    if not cert.identifiable:
        raise typer.Exit(1)


def _certify_on(data: Path, on: Path, report: Path | None, normalize: str | None, chunk_size: int | None,
                json_out: bool, quiet: bool) -> None:
    from ..probes import certify_probes

    feats, _ = _load_or_featurize(data, chunk_size, quiet, normalize)
    with progress_bar("probes", inspect_tokens(on).n_samples, quiet) as advance:
        rep = certify_probes(feats, on, chunk_size=chunk_size, progress=advance)
    if report is not None:
        rep.save(report, inputs=(data, on))
    out = rep.to_dict()
    out.update({"input": str(data), "probes": str(on), "output": str(report) if report is not None else None})
    n_und = out["n_undetermined"]
    unit = "positions" if rep.per_position else "sequences"
    if rep.determined:
        say(f"{on}: all {rep.n_probes} probe {unit} are determined by {data} (max relative null-space "
            f"component {fmt(out['max_residual'])} <= {rep.tol:g}; null space of gram: {rep.null_dim} of "
            f"{feats.n_features} directions)", quiet, style="green")
    else:
        say(f"{on}: {n_und} of {rep.n_probes} probe {unit} are NOT determined by {data}: zero-loss models "
            f"differ there (relative null-space component > {rep.tol:g}; null space of gram: {rep.null_dim} "
            f"of {feats.n_features} directions); first: {out['first_undetermined']}", quiet, style="red")
    if report is not None:
        say(f"  report in {report}", quiet)
    if json_out:
        emit_json(out)
    if not rep.determined:
        raise typer.Exit(1)


def fit_cmd(
    data: Annotated[Path, typer.Argument(help="Tokens file (with targets) or features file.")],
    output: OutOpt,
    ridge: Annotated[float, typer.Option("--ridge", min=0.0, help="Ridge penalty l: minimise "
                                         "(1/N) sum_i ||p H_i - y_i||^2 + l ||p||_F^2, i.e. solve (gram/N + l I) p^T "
                                         "= moments/N (l is in the units of Lambda_D, which scale as tokens^6).")] = 0.0,
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
    chunk_size: ChunkOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Least-squares fit of coef p on the feature statistics (Algorithm 1); writes coef and min-norm W.

    With --heads H or --nuclear LAMBDA: a low-rank fit (W of rank <= H is stored), from the statistics only.
    'auto' chooses by 5-fold CV (folds computed from a tokens file, or stored by `featurize --folds K`).

    Example: mhla fit feats.h5 -o model.h5 --json;  mhla fit data.h5 -o model.h5 --heads auto
    """
    formats.check_output_path(output, (data,))
    from ..lowrank import fit_model, parse_auto

    h, lam = parse_auto(heads, "--heads", int), parse_auto(nuclear, "--nuclear", float)
    lowrank_fit = h is not None or lam is not None
    if lowrank_fit and ridge > 0:
        raise InputError("--ridge applies to the least-squares fit; use --weight-decay with --heads")
    if "auto" in (h, lam):
        from ..folds import load_for_cv

        if normalize not in (None, "none"):
            raise InputError("'auto' with --normalize: featurize first, e.g. `mhla featurize DATA -o FEATS "
                             "--folds 5 --normalize length`, then fit FEATS")

        with progress_bar("featurize", inspect_tokens(data).n_samples
                          if formats.kind_of(data) == "tokens" else 0, quiet) as advance:
            feats, fold_feats = load_for_cv(data, chunk_size=chunk_size, progress=advance)
    else:
        feats, _ = _load_or_featurize(data, chunk_size, quiet, normalize)
        fold_feats = None
    if lowrank_fit:
        model = fit_model(feats, heads=h, nuclear=lam, weight_decay=weight_decay, restarts=restarts, seed=seed,
                          folds=fold_feats)
    else:
        model = fit(feats, ridge=ridge)
    model.info["normalize"] = feats.normalize
    model.save(output, inputs=(data,))
    info = dict(model.info)
    info["output"] = str(output)
    if info["train_mse"] <= info["mse_resolution"]:
        mse_text = (f"train MSE ~ 0 (below the {fmt(info['mse_resolution'])} float64 resolution of the "
                    "statistics; `mhla predict` gives the exact value)")
    else:
        mse_text = f"train MSE = {fmt(info['train_mse'])}"
    say(f"wrote {output}: {mse_text}, lambda_min = {fmt(info['lambda_min'])}, "
        f"condition number = {fmt(info['condition_number'])}", quiet)
    if lowrank_fit:
        say(f"  {info['method']} fit: {info['n_heads']} head(s), final objective {fmt(info['objective'])}"
            + (f" (CV over {info['n_folds']} folds chose {info['cv']['chosen']:.4g})" if "cv" in info else "")
            + (f"; head strengths ||V_h|| ||Q_h|| = {', '.join(fmt(x) for x in info['head_norms'])}"
               if "head_norms" in info else ""), quiet)
        from ..lowrank import solver_warnings

        for w in solver_warnings(info):
            warn(w)
    elif not info["identifiable"]:
        warn("the data do not determine the function (gram is singular or N < psi): this is the "
             + ("ridge-regularised" if ridge > 0 else "minimum-norm") + " solution; see `mhla certify`")
    elif info["condition_number"] > 1e10:
        warn(f"ill-conditioned solve (condition number {fmt(info['condition_number'])})"
             + ("" if ridge > 0 else "; consider --ridge"))
    if json_out:
        emit_json(info)


def export_heads_cmd(
    model_path: Annotated[Path, typer.Argument(metavar="MODEL", help="Model file from `mhla fit`.")],
    output: OutOpt,
    max_heads: Annotated[str | None, typer.Option("--max-heads", help="Keep at most the H strongest heads; 'auto': "
                                                  "the spectrum's outliers (see `mhla spectrum`).")] = None,
    tol: Annotated[float, typer.Option("--tol", min=0.0, help="Drop heads with s_h <= tol * s_max.")] = 1e-12,
    fewest: Annotated[bool, typer.Option("--fewest", help="The fewest heads computing the same function "
                                         "(relative function error <= 1e-8, verified).")] = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """SVD of W into heads V_h, Q_h (at most d^2), reporting the relative function change.

    Example: mhla export-heads model.h5 -o heads.h5 --max-heads 4;  mhla export-heads model.h5 -o heads.h5 --fewest --json
    """
    formats.check_output_path(output, (model_path,))
    from ..lowrank import fewest_heads, parse_auto

    mh = parse_auto(max_heads, "--max-heads", int)
    if fewest and mh is not None:
        raise InputError("--fewest and --max-heads cannot be combined")
    model = Model.load(model_path)
    if fewest:
        heads = fewest_heads(model.coef)
    elif mh == "auto":
        from ..spectrum import outlier_heads

        heads = outlier_heads(model)
    else:
        heads = export_heads(model, tol=tol, max_heads=mh)
    heads.info["normalize"] = model.info.get("normalize", "none")
    from ..export import save_heads  # the format (.h5, .npz, .safetensors) from the suffix

    save_heads(heads, output, inputs=(model_path,))
    out = {"output": str(output), "n_heads": heads.n_heads, "d": heads.d,
           "relative_function_error": heads.info["relative_function_error"],
           "singular_values": heads.info["singular_values"]}
    if fewest or mh == "auto":
        from ..lowrank import convergence_warning, fewest_message, hit_limit

        keys = ("rel_error", "lower_bound", "proven_minimal", "starts_tried", "starts_per_head_count", "best_error",
                "lower_bound_info") if fewest else ("threshold", "threshold_method")
        out.update({k: heads.info[k] for k in keys}, converged=(heads.info["solver"] or {}).get("converged"),
                   solver=heads.info["solver"])
    say(f"wrote {output}: {heads.n_heads} heads of d = {heads.d}; relative function change "
        f"||p_kept - p|| / ||p|| = {fmt(out['relative_function_error'])}", quiet)
    if fewest:
        say(f"  {fewest_message(heads.info)}", quiet)
    if (fewest or mh == "auto") and hit_limit(heads.info["solver"]):
        warn(convergence_warning(heads.info["solver"], "the minimum-nuclear-norm W")
             + ("; it only seeds the search, the heads are verified" if fewest else
                "; the outlier count is from an unconverged W"))
    if json_out:
        emit_json(out)


def predict_cmd(
    model_path: Annotated[Path, typer.Argument(metavar="MODEL|HEADS", help="Model or heads file.")],
    data: Annotated[Path, typer.Argument(help="Tokens file.")],
    output: OutOpt,
    all_positions: Annotated[bool, typer.Option("--all-positions", help="Also write the unmasked output at every "
                                                "position (S over the whole sequence).")] = False,
    causal: Annotated[bool, typer.Option("--causal", help="Also write `outputs` (T, d): the last-token output of "
                                         "every prefix X[:t] (autoregressive); MSE over the weighted positions of "
                                         "per-position targets. Example: mhla predict model.h5 ar.h5 -o pred.h5 "
                                         "--causal")] = False,
    chunk_size: ChunkOpt = None,
    workers: Annotated[int, typer.Option("--workers", "-j", min=0, help="Parallel local workers (0: one per "
                                         "core); the output equals the serial one.")] = 1,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Last-token predictions (and, optionally, every position's output) of a model on a tokens file.

    The model's normalisation (`--normalize` at fit time) is applied.

    Example: mhla predict heads.h5 data.h5 -o pred.h5 --json --workers 2

    Example (autoregressive): mhla predict model.h5 ar.h5 -o pred.h5 --causal --json
    """
    formats.check_output_path(output, (model_path, data))
    if causal and all_positions:
        raise InputError("--causal and --all-positions cannot be combined: --causal outputs the masked "
                         "(prefix) output at every position, --all-positions the unmasked one")
    fn = load_function(model_path)
    info = inspect_tokens(data)
    with progress_bar("predict", info.n_samples, quiet) as advance:
        res = predict_file(fn, data, output, all_positions=all_positions, chunk_size=chunk_size,
                           progress=advance, inputs=(model_path,), workers=workers, causal=causal)
    res["output"] = str(output)
    if info.per_position and not causal:
        warn("the data have per-position targets: use --causal to score every prefix (no MSE computed)")
    say(f"wrote {output}: {res['n_samples']} predictions"
        + (f", {info.n_tokens} causal outputs" if causal else "")
        + (f"; MSE against targets = {fmt(res['mse'])} over {res['n_scored']} "
           + ("positions" if causal and info.per_position else "sequences") if "mse" in res else ""), quiet)
    if json_out:
        emit_json(res)


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
    formats.check_output_path(output, (model_path, data) + ((snap,) if snap is not None else ()))
    fn = load_function(model_path)
    info = inspect_tokens(data)
    with progress_bar("rollout", info.n_samples, quiet) as advance:
        res = rollout_file(fn, data, output, steps, codebook=snap, chunk_size=chunk_size, progress=advance,
                           inputs=(model_path,))
    say(f"wrote {output}: {res['n_samples']} sequences continued by {steps} generated tokens each"
        + (f" (snapped to {snap})" if snap is not None else ""), quiet)
    if json_out:
        emit_json(res)


def inspect_cmd(
    path: Annotated[Path, typer.Argument(help="Any mhla file (tokens, features, model, heads, predictions).")],
    json_out: JsonOpt = False,
) -> None:
    """Say what kind of mhla file this is, its shapes and attributes, and whether it is valid.

    Exit 0 when valid, 2 otherwise. Example: mhla inspect feats.h5 --json
    """
    from rich.markup import escape

    from ..inspect import inspect_file

    rep = inspect_file(path)
    if json_out:
        emit_json(rep)
    else:
        say(escape(f"{path}: {rep['kind'] or 'unknown'} file, {'valid' if rep['valid'] else 'INVALID'}"))
        for key in ("layout", "d", "n_features", "n_samples", "n_tokens", "n_heads", "dtype", "has_targets",
                    "per_position", "has_weights", "normalize", "n_undetermined"):
            if rep.get(key) is not None:
                say(escape(f"  {key} = {rep[key]}"))
        for name, ds in rep["datasets"].items():
            if "shape" in ds:
                say(escape(f"  {name}: shape {tuple(ds['shape'])}, {ds['dtype']}"))
            else:
                say(escape(f"  {name}: group"))
        for k, v in rep["attrs"].items():
            say(escape(f"  @{k} = {v}"))
    if not rep["valid"]:
        # The same one-line error the other commands print (stderr), after the report.
        sys.stderr.write(f"mhla: error: {' '.join(str(rep['error']).split())}\n")
        raise typer.Exit(2)


def register(app: typer.Typer) -> None:
    app.add_typer(generate_app, name="generate")
    app.command("featurize")(featurize_cmd)
    app.command("certify")(certify_cmd)
    app.command("fit")(fit_cmd)
    app.command("export-heads")(export_heads_cmd)
    app.command("predict")(predict_cmd)
    app.command("rollout")(rollout_cmd)
    app.command("inspect")(inspect_cmd)
