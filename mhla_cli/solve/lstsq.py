"""Algorithm 1, step 1: least squares over p on the sufficient statistics, and the training MSE from them."""

from __future__ import annotations

import time

import numpy as np

from ..errors import InputError
from ..linalg.factorization import Factorization
from ..model.heads import W_from_p
from ..model.canonical import gram_pairs_of
from ..model.model import Model
from ..numerics import lambda_min_of_verdict, mse_resolution, numerical_tolerance
from ..statistics import basis as basis_mod
from ..statistics.features import Features
from .domains import FULL


def fit(feats: Features, ridge: float = 0.0, device: str | None = None) -> Model:
    """Least squares over p on the sufficient statistics (Algorithm 1, step 1), in the canonical basis.

    Solves (Lambda~ + ridge I) p_b^T = m~ with Lambda~ = gram_b / sum w and m~ = moments_b / sum w the
    canonical sums (mhla_cli.statistics.basis), and maps p = p_b M_A back to the tokens' own features. With
    ridge = 0 and a singular Lambda~ it returns the minimum-norm p_b (pseudo-inverse with the
    certificate's numerical tolerance). The ridge and the minimum norm are taken in the canonical
    coordinates, so the learned function does not depend on the units of the tokens, and `ridge` is
    in the units of the certificate's lambda_max. `device`: where the factorization runs (mhla_cli.linalg.device).
    """
    if not feats.has_targets:
        raise InputError("the data have no 'targets': fit needs (X, y) pairs")
    if ridge < 0 or not np.isfinite(ridge):
        raise InputError(f"ridge must be a finite number >= 0, got {ridge}")
    if feats.affine is not None:  # a fit of the MHLA's features alone would leave the block out
        raise InputError("the statistics hold the affine block of the wide tokens: fit the extended features "
                         "(mhla_cli.fit)")
    A, _, moments_b = feats.solver_stats()
    assert moments_b is not None  # has_targets
    N = feats.n_samples
    W = feats.weight if feats.weight > 0 else 1.0  # sum w: the normaliser of Lambda~ and m~
    psi = feats.n_features
    fac = FULL.factorize(feats, device)
    st = fac.structure
    # the factorized block on the data's spans (mhla_cli.statistics.structure): the moments lie in its range
    rhs = moments_b / W if feats.on_spans else st.restrict(moments_b / W)
    lmax = fac.lambda_max()
    tol = numerical_tolerance(lmax, psi)
    # proven as the certificate's: a Cholesky of the block's Lambda~ - tol I (reused by the solve)
    block_pd = lmax > 0 and fac.proves_above(tol)
    lmin = fac.lambda_min()
    t_solve = time.perf_counter()
    coef_b = st.embed(solve_system(fac, rhs, ridge, tol, block_pd)).T
    with np.errstate(over="ignore", invalid="ignore"):  # coefficients that overflow: refused by api.learn
        coef = basis_mod.coef_from_basis(A, coef_b)
    seconds = {**fac.seconds, "solve": time.perf_counter() - t_solve}
    identifiable = bool(block_pd and fac.n == psi and N >= psi)
    lmin, bound = lambda_min_of_verdict(lmin, tol, identifiable)  # never contradicting the verdict
    mse, resolution = _train_mse_b(feats, coef_b)
    info = {
        "ridge": float(ridge), "train_mse": mse, "mse_resolution": resolution, "lambda_min": lmin,
        "lambda_max": lmax, "identifiable": identifiable,
        # the condition number of the system actually solved (regularised when ridge > 0)
        "condition_number": ((lmax + ridge) / (max(lmin, 0.0) + ridge) if ridge > 0
                             else (lmax / lmin) if lmin > tol else float("inf")),
        "rank": fac.rank(tol), "n_features": psi, "n_samples": N, "method": "lstsq",
        "basis": "canonical", "normalize": getattr(feats, "normalize", "none"), "seconds": seconds,
    }
    # the canonical coefficients and their basis: predict evaluates the function there (Model.evaluation);
    # the data's Lambda~ measures a change of the function on them (mhla_cli.model.canonical)
    if bound is not None:
        info["lambda_min_bound"] = bound
    if feats.bias_terms:
        info["bias_terms"] = True
    K, E, F = gram_pairs_of(feats)
    return Model(coef=coef, W=W_from_p(coef), d=feats.d, info=info, coef_b=coef_b, basis=np.array(A),
                 gram_pairs=K, gram_spans=None if E is None or F is None else (E, F))


def solve_system(fac: Factorization, rhs: np.ndarray, ridge: float, tol: float, block_pd: bool) -> np.ndarray:
    """The block's solution of (Lambda~ + ridge I) x = rhs: ridge, Cholesky or minimum norm."""
    sol = None
    if ridge > 0:
        sol = fac.ridge_solve(rhs, ridge, tol)
    elif block_pd:
        # The block is positive definite: a solve with the certificate's Cholesky factor.
        sol = fac.solve(rhs)
    if sol is None:
        # Singular (or numerically so): the pseudo-inverse with the certificate's tolerance, i.e.
        # the minimum-norm p_b (no component along the null directions of Lambda~).
        sol = fac.pinv_solve(rhs, tol)
    return sol


def train_mse(feats: Features, coef: np.ndarray) -> tuple[float, float]:
    """Mean squared error sum_i w_i ||p H_i - y_i||^2 / (d sum_i w_i) from the statistics alone, and
    its float64 resolution.

    sum_i w_i ||p H_i - y_i||^2 = tr(p_b gram_b p_b^T) - 2 tr(p_b moments_b) + tr(target_gram), evaluated
    on the canonical sums (p_b = p M_A^-1); cancellation limits the accuracy to about
    eps * tr(target_gram).
    """
    A, _, _ = feats.solver_stats()
    return _train_mse_b(feats, basis_mod.coef_to_basis(A, coef))


def _train_mse_b(feats: Features, pb: np.ndarray) -> tuple[float, float]:
    """`train_mse` of the canonical coefficients p_b.

    With only the block on the data's spans held (gram_b = Q G_r Q^T, moments_b = Q M_r), p_b enters
    through p_b Q alone, exactly (mhla_cli.statistics.structure).
    """
    # sum w: the weighted mean; per output of the targets' own width (the bias terms' padded 0 is none)
    N, d = (feats.weight if feats.weight > 0 else 1.0), feats.n_outputs
    _, gram_b, moments_b = feats.solver_stats()
    assert moments_b is not None and feats.target_gram is not None  # statistics with targets
    if feats.on_spans:
        assert feats.span_pairs is not None and feats.span_last is not None  # held on the data's spans
        pb = basis_mod.kron_apply(feats.span_pairs.T, feats.span_last.T, np.ascontiguousarray(pb.T)).T
    quad = float(np.sum((pb @ gram_b) * pb))
    sse = quad - 2 * float(np.einsum("ij,ji->", pb, moments_b)) + float(np.trace(feats.target_gram))
    scale = float(np.trace(feats.target_gram)) + quad
    resolution = mse_resolution(feats.n_features, scale, N, d)
    return max(sse, 0.0) / (N * d), resolution
