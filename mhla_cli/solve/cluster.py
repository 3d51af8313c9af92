"""Certify and fit with the canonical Gram tiled on a Dask cluster: the identifiable path of the solve.

The statistics come from mhla_cli.statistics.distributed.tiled_statistics (a tokens file accumulated on the cluster) or
mhla_cli.statistics.files.zarr_store (a features store whose tiles the workers read); the client holds
their d x d sums and the psi x d moments, the tiles stay on the workers. The factorization is the
single-machine one (mhla_cli.linalg.factorization) over a linalg.tiled_matrix.TiledMatrix:

- the verdict is the Cholesky of Lambda~ - t I over the tiles, t the certificate's threshold
  (certificate.certify_tiled), proven by inertia as on one machine; when it fails the data are not
  identifiable, and the column where it failed is the reason;
- lambda_max is block Lanczos on Lambda~, lambda_min block Lanczos on (Lambda~ - t I)^-1 through the
  distributed factor (or, when the Cholesky failed, on lambda_max I - Lambda~): estimates, with their
  convergence records, as on the single-machine Lanczos path;
- the fit is two distributed triangular solves against the moments with the same factor (and
  iterative refinement), or with the factor of Lambda~ + r I for a ridge r; coef (d x psi) is
  gathered and the model is the one a single-machine fit makes;
- nothing needs an eigendecomposition, which has no distributed form: the minimum-norm fit of
  singular data, the null space and the observed domain are refused (`ClusterRefused`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from mhla_cli.errors import InputError
from mhla_cli.io import formats
from mhla_cli.linalg.factorization import Factorization
from mhla_cli.model.heads import W_from_p
from mhla_cli.model import scores
from mhla_cli.model.model import Model
from mhla_cli.numerics import lambda_min_of_verdict, mse_resolution, numerical_tolerance
from mhla_cli.samples import ReadSpec
from mhla_cli.statistics import basis as basis_mod
from mhla_cli.statistics.distributed import parallel
from mhla_cli.statistics.distributed import tiled_statistics
from mhla_cli.statistics.files import zarr_store
from mhla_cli.statistics.distributed.scheduler import check_worker_memory
from mhla_cli.statistics.distributed.tiled_statistics import TiledStatistics

__all__ = ["ClusterRefused", "factorization", "fit_tiled", "open_statistics"]


class ClusterRefused(InputError):
    """What the cluster's solve does not do (it needs an eigendecomposition); `rule` names it so that a
    caller can word it in its own options (`RULES`)."""

    def __init__(self, rule: str, path: str | os.PathLike | None = None) -> None:
        super().__init__(RULES[rule], path)
        self.rule = rule


RULES = {
    "minimum_norm": "the data do not determine the function (the Cholesky of Lambda~ - t I failed): their "
                    "minimum-norm fit needs an eigendecomposition, which has no distributed form; fit with a "
                    "ridge r > 0 (a Cholesky of Lambda~ + r I) on the cluster, or without a scheduler on one machine",
    "small_ridge": "a ridge at or below the numerical tolerance is the minimum-norm fit, which needs an "
                   "eigendecomposition; on the cluster the ridge must exceed the tolerance",
    "domain": "the observed domain needs the spans of the tokens and a change of the tiles' coordinates; "
              "certify it on one machine",
    "hdf5_features": "an HDF5 features file is the single-machine form of the statistics: certify or fit it "
                     "without a scheduler, or featurize the tokens on the cluster into a Zarr store",
    "kind": "is not a tokens file or a Zarr features store",
    "targets": "the data have no 'targets': fit needs (X, y) pairs",
    "affine": "the affine block of the wide tokens cannot run on a cluster: it is accumulated and solved beside "
              "the Gram in one process, not tiled; featurize, certify and fit it without a scheduler",
    "in_memory": "statistics in memory are certified and fitted on one machine: give no scheduler (a cluster "
                 "takes a tokens file, a Zarr features store or statistics tiled there)",
    "device": "on a cluster the factorization runs on the workers' CPUs: give no device",
    "solver": "on a cluster the fit is least squares with a ridge >= 0 on the workers' CPUs: no heads, nuclear, "
              "'auto' or device",
}


@contextlib.contextmanager
def open_statistics(data: Any, scheduler: Any = None, chunk_size: int | None = None,
                    normalize: str | None = None, tile_features: int | None = None, attention: str | None = None,
                    bias_terms: bool = False) -> Iterator[TiledStatistics]:
    """The tiled statistics of `data` on the cluster of `scheduler` (an address, "local[:K]", a scheduler
    file or a dask.distributed Client: parallel.DaskMap), freed and the connection closed on exit:
    `data` a tokens file (accumulated on the cluster, its samples read with `attention` and `bias_terms` as
    featurize reads them), a Zarr features store (its tiles read by the workers), or TiledStatistics
    already on a cluster (used as they are)."""
    if isinstance(data, TiledStatistics):
        yield data
        return
    if scheduler is None:
        raise InputError("the statistics of a file on a cluster need a scheduler (an address, local or a Client)")
    store = zarr_store.is_store(data)
    kind = "features" if store else formats.kind_of(data)
    if kind == "features" and not store:
        raise ClusterRefused("hdf5_features", data)
    if kind not in ("tokens", "features"):
        raise ClusterRefused("kind", data)
    if store:
        zarr_store.require_zarr()
    with parallel.make_map(scheduler=scheduler) as pmap:
        client = pmap.client
        if store:
            check_worker_memory(client, zarr_store.tile_bytes(data))
            stats = zarr_store.load_tiled(data, client)
            if normalize is not None and normalize != stats.sums.normalize:
                raise InputError(f"was featurized with normalisation '{stats.sums.normalize}', not '{normalize}'; "
                                 "featurize it again with the normalisation wanted", data)
            if attention is not None and attention != (stats.sums.samples.attention or attention):
                raise InputError(f"holds {stats.sums.samples.words}, not attention '{attention}'; featurize it again "
                                 "with the attention wanted", data)
            if bias_terms and not stats.sums.bias_terms:
                raise InputError("was featurized without the bias terms; featurize it again with them", data)
        else:
            stats = tiled_statistics.accumulate(data, client, chunk_size=chunk_size,
                                                read=ReadSpec(attention, normalize or "none", bias_terms),
                                                tile_features=tile_features)
        try:
            yield stats
        finally:
            with contextlib.suppress(Exception):
                stats.release()


def factorization(stats: TiledStatistics) -> Factorization:
    """The factorization of the canonical Lambda~ over the tiles, made once per statistics
    (TiledStatistics.factorization)."""
    return stats.factorization()


def threshold_of(fac: Factorization, min_eig: float = 0.0) -> tuple[float, float, float]:
    """(lambda_max, the numerical tolerance, the threshold t = the larger of it and min_eig) as
    certificate.certify_tiled takes them."""
    lmax = fac.lambda_max()
    tol = numerical_tolerance(lmax, fac.n_full)
    return lmax, tol, max(tol, float(min_eig))


def failure_reason(fac: Factorization, threshold: float, below_margin: bool = False) -> str:
    """The reason a Cholesky of Lambda~ - t I over the tiles failed: the column and tile row where it did,
    and what it means (`below_margin`: t is a demanded margin above the numerical tolerance, and the
    estimated lambda_min lies above the tolerance)."""
    exc = fac.cholesky_failure(threshold)
    where = "" if exc is None else f" at feature {exc.column} (tile row {exc.tile} of {exc.of})"
    text = (f"the Cholesky of Lambda~ - t I (t = {threshold:.3g}) over the tiles failed{where}: Lambda~ has an "
            "eigenvalue at or below t")
    if below_margin:
        lmin, _ = lambda_min_of_verdict(fac.lambda_min(), threshold, False)  # at most t: the Cholesky failed
        return text + f"; lambda_min ~ {lmin:.3g} is above the numerical tolerance: below the demanded margin"
    return (text + ", so the data do not determine the function; which features its null space holds needs an "
            "eigendecomposition: certify on one machine to see them")


def fit_tiled(stats: TiledStatistics, ridge: float = 0.0, path: str | os.PathLike | None = None) -> Model:
    """Least squares over p (Algorithm 1, step 1) with the Gram tiled on a cluster: the model a
    single-machine fit (solve.lstsq.fit) makes, from a Cholesky of Lambda~ - t I (the verdict, reused
    with iterative refinement) or of Lambda~ + ridge I (`open_statistics` gives `stats`; `path` names the data in
    errors). The minimum-norm fit of data that do not determine the function is refused (ClusterRefused)."""
    if not np.isfinite(ridge) or ridge < 0:
        raise InputError(f"ridge must be a finite number >= 0, got {ridge}")
    ridge = float(ridge)
    feats = stats.sums
    if feats.target_gram is None or feats.basis_moments is None:
        raise ClusterRefused("targets", path)
    A, psi, N = feats.basis, feats.n_features, feats.n_samples
    assert A is not None and feats.basis_moments is not None  # tiled statistics: in their basis, with targets
    W = feats.weight or 1.0
    fac = factorization(stats)
    lmax, tol, _ = threshold_of(fac)
    block_pd = lmax > 0 and fac.proves_above(tol)
    if not block_pd and ridge == 0.0:
        raise ClusterRefused("minimum_norm", path)
    if 0.0 < ridge <= tol:
        raise ClusterRefused("small_ridge", path)
    identifiable = bool(block_pd and N >= psi)
    lmin, bound = lambda_min_of_verdict(fac.lambda_min(), tol, identifiable)  # never contradicting the verdict
    rhs = feats.basis_moments / W
    t0 = time.perf_counter()
    sol = fac.ridge_solve(rhs, ridge, tol) if ridge > 0 else fac.solve(rhs)
    assert sol is not None  # without a ridge the block was proven positive definite above
    coef_b = sol.T
    coef = basis_mod.coef_from_basis(A, coef_b)
    seconds = {**fac.seconds, **stats.matrix.seconds, "solve": time.perf_counter() - t0}
    mse, resolution = _train_mse(stats, coef_b)
    info = {
        "ridge": ridge, "train_mse": mse, "mse_resolution": resolution, "lambda_min": lmin, "lambda_max": lmax,
        "identifiable": identifiable,
        "condition_number": ((lmax + ridge) / (max(lmin, 0.0) + ridge) if ridge > 0
                             else (lmax / lmin) if lmin > tol else float("inf")),
        # counting the eigenvalues at or below t needs an eigendecomposition: no rank unless identifiable
        "rank": psi if block_pd else None, "n_features": psi, "n_samples": N, "method": "lstsq",
        "basis": "canonical", "normalize": feats.normalize, "seconds": seconds,
        # the cluster's numbers: lambda_min and lambda_max are Lanczos estimates (their records)
        "estimated": ["lambda_min", "lambda_max"], "estimates": {k: dict(v) for k, v in fac.iterations.items()},
        "tasks": dict(stats.matrix.tasks),
    }
    if bound is not None:
        info["lambda_min_bound"] = bound
    if feats.bias_terms:
        info["bias_terms"] = True
    info.update(feats.samples.fit_attrs())  # per-position samples: how they read the window, with its parameters
    info["train_r2"] = scores.train_r2(feats, mse)
    return Model(coef=coef, W=W_from_p(coef), d=feats.d, info=info, coef_b=coef_b, basis=np.array(A))


def _train_mse(stats: TiledStatistics, pb: np.ndarray) -> tuple[float, float]:
    """solve.lstsq.train_mse on the tiles: sum w ||p H - y||^2 = tr(p_b G p_b^T) - 2 tr(p_b M) + tr(Y),
    G p_b^T one distributed product; per output of the targets' own width (the bias terms' padded target 0
    is no output: the mean is over n_outputs = d - 1 of them), as one machine's."""
    feats = stats.sums
    N, d = (feats.weight if feats.weight > 0 else 1.0), feats.n_outputs
    assert feats.basis_moments is not None and feats.target_gram is not None  # with targets
    quad = float(np.sum(stats.matrix.matmat(np.ascontiguousarray(pb.T)) * pb.T))
    sse = quad - 2 * float(np.einsum("ij,ji->", pb, feats.basis_moments)) + float(np.trace(feats.target_gram))
    scale = float(np.trace(feats.target_gram)) + quad
    return max(sse, 0.0) / (N * d), mse_resolution(feats.n_features, scale, N, d)
