"""`mhla certify`: the identifiability certificate, the witness, and certificates on given inputs (--on)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from ..errors import InputError
from ..numerics import DETERMINED_TOL, EPS, RANK_RULE, quote
from .blocks import AffineOpt, BlocksOpt, certify_blocks_cmd, check_not_blocks
from .console import BOUND_SIGNS, emit_json, fmt, load_with_progress, progress_bar, say, warn, working
from .options import (CLUSTER_WORDS, AffineFromOpt, AttentionOpt, BiasTermsOpt, ChunkOpt, DeviceOpt, JsonOpt,
                      NormalizeOpt, QuietOpt, SchedulerTimeoutOpt, about, check_hdf5_output, check_scheduler_timeout,
                      on_cluster, statistics_for)

if TYPE_CHECKING:
    from ..samples import ReadSpec


def certify_cmd(
    data: Annotated[Path, typer.Argument(help="Tokens file or features file.")],
    min_eig: Annotated[float, typer.Option("--min-eig", min=0.0,
                                           help="Demand lambda_min > this (a margin for CI); lambda_min is "
                                                "the canonical one (whitened tokens, orthonormal features: unit-free); "
                                                f"the numerical tolerance {RANK_RULE} (eps = {EPS:.4g}) always "
                                                "applies; the verdict is proven by a Cholesky of Lambda~ - t I, "
                                                "t = the larger of the two.")] = 0.0,
    domain: Annotated[Literal["full", "observed"], typer.Option(
        "--domain", help="full: every input in R^d (the paper). observed: inputs in the span of the data's "
        "tokens / last tokens.")] = "full",
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
    attention: AttentionOpt = None,
    bias_terms: BiasTermsOpt = False,
    affine_from: AffineFromOpt = None,
    chunk_size: ChunkOpt = None,
    device: DeviceOpt = "cpu",
    scheduler: Annotated[str | None, typer.Option(
        "--scheduler", metavar="ADDRESS", help="Certify on a Dask cluster, the Gram tiled on its workers and never "
        "gathered: a scheduler address (tcp://host:8786), a scheduler file (.json), or local / local:K (the cluster "
        "extra). DATA is then a tokens file or a Zarr features store (featurize --scheduler -o FEATS.zarr); the "
        "verdict is a Cholesky of Lambda~ - t I over the tiles, lambda_min and lambda_max Lanczos estimates "
        "(docs/cluster.md). Example: --scheduler local:4")] = None,
    scheduler_timeout: SchedulerTimeoutOpt = None,
    blocks: BlocksOpt = None,
    affine: AffineOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Certify that the data determine the learned function (Lemma 2.3). Exit 0 yes, 1 no, 2 error.

    lambda_min / lambda_max are those of the canonical Lambda~: the features of the whitened tokens
    (the second moment of all tokens made I) in orthonormal coordinates, so they do not change with
    the units or the basis of the tokens (docs/certificate.md).

    With --on PROBES: whether every zero-loss model gives the same output on each probe input (its
    feature vector in the range of gram: relative null-space component <= {DETERMINED_TOL}); a probe with
    a component along token directions of the data that float64 cannot resolve is reported as not
    resolvable (exit 1), as the full certificate is.

    Example (a CI gate): mhla certify data.h5 --json > cert.json || exit 1;  mhla certify data.h5 --witness w.h5

    Example (given inputs): mhla certify train.h5 --on heldout.h5 -o report.h5 --json

    Example (a GPU): mhla certify feats.h5 --device cuda --json

    Example (an encoder's windows, every position): mhla certify bert_l1.h5 --attention bidirectional

    Example (with the terms a head's biases add): mhla certify enc.h5 --bias-terms

    Example (with the wide token's affine map): mhla certify h8.h5 --affine-from hidden384.h5

    Example (a Dask cluster): mhla certify data.h5 --scheduler tcp://10.0.0.5:8786 --json

    Example (a layer as a sum of blocks, docs/blocks.md): mhla certify layer.h5 --blocks h0.h5 --blocks h1.h5 --affine
    """
    from ..samples import ReadSpec  # the layouts need NumPy: not for --help

    check_not_blocks(blocks, affine, None)
    if blocks:
        return certify_blocks_cmd(data, blocks, affine, min_eig, normalize, attention, chunk_size, json_out, quiet)
    dev = _check_options(data, min_eig, domain, witness, on, report, affine_from, device, scheduler, scheduler_timeout)
    read = ReadSpec(attention, normalize, bias_terms)  # how a tokens file is read (None: as the data say)
    if on is not None:
        _certify_on(data, on, report, read, chunk_size, json_out, quiet, dev)
        return
    with on_cluster(scheduler, scheduler_timeout, data):
        _certify(data, min_eig, domain, witness, read, chunk_size, json_out, quiet, dev, affine_from, scheduler)


def _check_options(data: Path, min_eig: float, domain: str, witness: Path | None, on: Path | None,
                   report: Path | None, affine_from: Path | None, device: str, scheduler: str | None,
                   scheduler_timeout: float | None) -> str | None:
    """The rules of certify's options, before any work (the library here, not at the top: `mhla certify --help`
    and completion load only the parser); the device."""
    from ..linalg.device import check_device
    from ..solve.domains import check_domain
    from ..io.tokens import inspect_tokens

    check_domain(domain)
    dev = check_device(device, data)
    check_scheduler_timeout(scheduler, scheduler_timeout)
    if scheduler is not None:
        if affine_from is not None:
            raise InputError(CLUSTER_WORDS["affine"], affine_from)
        if witness is not None or on is not None or domain != "full" or dev is not None:
            raise InputError("--scheduler certifies the full domain on the cluster's CPUs: it cannot be combined "
                             "with --witness, --on, --domain observed or --device (they need an eigendecomposition "
                             "or one machine)")
    if on is None and report is not None:
        raise InputError("-o/--output REPORT is the report of --on PROBES; give --on")
    if affine_from is not None and (on is not None or witness is not None or domain != "full"):
        raise InputError("--affine-from certifies the extended features on the full domain: it cannot be combined "
                         "with --on, --witness or --domain")
    if on is not None:
        if witness is not None or domain != "full" or min_eig > 0:
            raise InputError("--on tests the given probes: it cannot be combined with --witness, --domain "
                             "or --min-eig")
        if report is not None:
            check_hdf5_output(report, (data, on), "the report", "probes")
        inspect_tokens(on)
    return dev


# The witness's rules (mhla_cli.solve.witness.WitnessRefused.rule) in the words of the command's options.
_WITNESS_TEXT = {
    "per_position": "--witness supports last-token data only (this file has per-position data)",
    "targets": "--witness needs targets: the two models are compared by their training loss",
    "normalized": "--witness supports unweighted last-token data without --normalize only",
    "bias_terms": "--witness supports the MHLA's features only: certify without --bias-terms for a witness",
}


def _witness_rules(data: Path, check: Callable[[], None]) -> None:
    """Run one of the library's witness checks; its refusal becomes the option's message about `data`."""
    from ..solve.witness import WitnessRefused

    try:
        check()
    except WitnessRefused as exc:
        raise InputError(_WITNESS_TEXT[exc.rule], data) from None


def _certify(data: Path, min_eig: float, domain: str, witness: Path | None, read: ReadSpec,
             chunk_size: int | None, json_out: bool, quiet: bool, device: str | None,
             affine_from: Path | None = None, scheduler: str | None = None) -> None:
    """The certificate of `data` (and --witness), by the library's one `certify` on one machine or on the cluster
    of `scheduler`: its text, its JSON, exit 1 when not identifiable."""
    from ..api.learn import certify
    from ..solve.witness import check_witness_features, check_witness_input
    from ..statistics.stream import check_solve_memory

    if witness is not None:
        check_hdf5_output(witness, (data,), "the witness file", "model")
        _witness_rules(data, lambda: check_witness_input(data))
    if scheduler is None:
        check_solve_memory(data, "certify", chunk_size=chunk_size, read=read)
    stats, seconds = statistics_for(data, scheduler, chunk_size, quiet, read, device, affine_from)
    if witness is not None:
        _witness_rules(data, lambda: check_witness_features(stats))
    with working(f"certify on the cluster {scheduler}: the tiled Gram and its Cholesky" if scheduler else
                 f"certify: factorizing the canonical Lambda~ ({stats.n_features} features)", quiet):
        cert = certify(stats, min_eig=min_eig, domain=domain, device=device, scheduler=scheduler, read=read,
                       chunk_size=chunk_size)
    out = _cert_json(cert, data, seconds)
    if cert.tasks:  # on a cluster
        out.update(input=stats, scheduler=scheduler)
        _say_tiled(cert, stats, quiet)
    else:
        out.update(attention=stats.samples.attention, bias_terms=stats.bias_terms,
                   affine_width=None if stats.affine is None else stats.affine.width)
        _say_certificate(cert, data, domain, quiet)
    if witness is not None and not cert.identifiable:
        out["witness"] = _write_witness(stats, data, cert, witness, chunk_size, quiet)
    elif witness is not None:
        warn("the data certify: no witness to write")
    if json_out:
        emit_json(out)
    if not cert.identifiable:
        raise typer.Exit(1)


def _say_certificate(cert: Any, data: Path, domain: str, quiet: bool) -> None:
    """What `mhla certify` says of a certificate made on one machine."""
    verdict = "identifiable" if cert.identifiable else "NOT identifiable"
    say(f"{data}: {verdict} on the {domain} domain: {lambda_min_text(cert, '=')}, "
        f"lambda_max = {fmt(cert.lambda_max)}, threshold = {fmt(cert.threshold)}, rank {cert.rank}/"
        f"{cert.n_features}, N = {cert.n_samples}", quiet, style="green" if cert.identifiable else "red")
    if domain == "observed":
        say(f"  observed domain: dim U = {cert.dim_tokens}, dim U_n = {cert.dim_last_tokens}, "
            f"{cert.n_features} reduced features", quiet)
    for note in getattr(cert, "notes", []):
        say(f"  {note}", quiet)
    for r in cert.reasons:
        say(f"  - {r}", quiet)


def lambda_min_text(cert: Any, sign: str) -> str:
    """'lambda_min = x' (sign '=' or '~'), or, where the estimate contradicted the proven verdict, the bound
    the verdict proves with the estimate beside it: 'lambda_min <= t (the estimate x is not resolved ...)'."""
    if cert.lambda_min_bound is None:
        return f"lambda_min {sign} {fmt(cert.lambda_min)}"
    return (f"lambda_min {BOUND_SIGNS[cert.lambda_min_bound]} {fmt(cert.lambda_min)} (the estimate "
            f"{fmt(cert.lambda_min_estimate)} is not resolved against the threshold; the proven verdict stands)")


def _say_tiled(cert: Any, where: str, quiet: bool) -> None:
    """What `mhla certify --scheduler` says of a certificate made over the tiles (mhla_cli.solve.cluster)."""
    verdict = "identifiable" if cert.identifiable else "NOT identifiable"
    rank = f"rank {cert.rank}/{cert.n_features}" if cert.rank is not None else \
        f"rank not counted (an eigendecomposition) of {cert.n_features}"
    say(f"{where}: {verdict} on the full domain (on the cluster): {lambda_min_text(cert, '~')}, "
        f"lambda_max ~ {fmt(cert.lambda_max)} (Lanczos estimates), threshold = {fmt(cert.threshold)}, {rank}, "
        f"N = {cert.n_samples}", quiet, style="green" if cert.identifiable else "red")
    for name, rec in cert.estimates.items():
        if not rec.get("converged", True):
            warn(f"the Lanczos estimate of {name} did not converge (relative residual "
                 f"{fmt(rec.get('relative_residual'))}); the verdict is the Cholesky's and stands")
    for r in cert.reasons:
        say(f"  - {r}", quiet)


def _cert_json(cert: Any, data: Path, seconds: dict[str, float]) -> dict[str, Any]:
    """`certify --json`: the certificate's dict, the seconds of the pass and of the factorization, the input."""
    from ..io import formats

    out = cert.to_dict()
    out["seconds"] = {**seconds, **cert.seconds}
    out["input"] = str(data)
    try:
        out["input_identity"] = formats.source_identity(data)
    except InputError:
        pass
    return out


def _write_witness(feats: Any, data: Path, cert: Any, witness: Path, chunk_size: int | None, quiet: bool
                   ) -> dict[str, Any]:
    """Build, verify and write the witness; say what it shows; its summary for the JSON."""
    from ..solve.witness import make_witness

    with about(data):
        wit = make_witness(feats, data=data, cert=cert, chunk_size=chunk_size)
    wit.save(witness, inputs=(data,))
    wi = wit.info
    say(f"  witness in {witness} ({wi['kind']}): {wi['message']}", quiet,
        style="yellow" if wi["kind"] != "indistinguishable" else None)
    say(f"  probe input: {wi['probe']}", quiet)
    return {"output": str(witness), **wit.summary()}


# the help quotes the constants from the code (mhla_cli.numerics)
certify_cmd.__doc__ = (certify_cmd.__doc__ or "").replace("{DETERMINED_TOL}", quote(DETERMINED_TOL))

def _certify_on(data: Path, on: Path, report: Path | None, read: ReadSpec, chunk_size: int | None,
                json_out: bool, quiet: bool, device: str | None = None) -> None:
    from ..solve.probes import certify_probes, null_space
    from ..solve.domains import factorize
    from ..statistics.stream import check_solve_memory
    from ..io.tokens import inspect_tokens

    check_solve_memory(data, "certify", chunk_size=chunk_size, read=read)
    feats, _, _ = load_with_progress(data, chunk_size, quiet, read, device)
    if feats.affine is not None:
        raise InputError("the statistics hold the affine block of the wide tokens: --on tests the MHLA's features "
                         "only; certify without --on", data)
    # the factorization and the null space first (under a spinner: the eigendecomposition of a
    # singular Lambda~ can take a while); the probes reuse both (cached on feats)
    with working(f"certify --on: the null space of the canonical Lambda~ ({feats.n_features} features)", quiet):
        factorize(feats, "full", device)
        null_space(feats)
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
        n_unres = out["n_unresolvable"]
        if n_und > n_unres:
            say(f"{on}: {n_und - n_unres} of {rep.n_probes} probe {unit} are NOT determined by {data}: zero-loss "
                f"models differ there (relative null-space component > {rep.tol:g}; null space of gram: "
                f"{rep.null_dim} of {feats.n_features} directions); first: "
                f"{[i for i in out['first_undetermined'] if i not in set(rep.unresolvable.tolist())][:10]}",
                quiet, style="red")
        if n_unres:
            say(f"{on}: {n_unres} of {rep.n_probes} probe {unit} are not resolvable in float64 by {data}: "
                f"its tokens have {rep.unresolved_dim} direction(s) of variance at most {feats.d} eps64 of the "
                "largest (too small for float64 to tell from rounding; the full certificate says so), and "
                "these probes have a component along them, so whether the data determine them cannot be "
                f"told; first: {out['first_unresolvable']}", quiet, style="red")
    if report is not None:
        say(f"  report in {report}", quiet)
    if json_out:
        emit_json(out)
    if not rep.determined:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("certify")(certify_cmd)
