"""The map A: W -> p, its adjoint, the projection onto {W : A(W) = p}, and the minimum-nuclear-norm W."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from ...errors import InputError
from ...feature_map import n_features, pair_index
from ...model.heads import W_from_p, p_from_W
from ._numerics import _serial_blas
from ._solver import solver_info


@lru_cache(maxsize=32)
def _p_index(d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For each entry e of p.ravel() (order a, then feature): W rows/cols of its one or two terms.

    p[e] = W[r1, c1] + m * W[r2, c2], m = 1 for j < k and 0 for j = k.
    """
    j, k = pair_index(d)
    a = np.arange(d)[:, None, None]
    jj = j[None, :, None]
    kk = k[None, :, None]
    ll = np.arange(d)[None, None, :]
    shape = (d, j.size, d)
    r1 = np.broadcast_to(a * d + jj, shape).ravel()
    c1 = np.broadcast_to(kk * d + ll, shape).ravel()
    r2 = np.broadcast_to(a * d + kk, shape).ravel()
    c2 = np.broadcast_to(jj * d + ll, shape).ravel()
    m = np.broadcast_to((jj != kk).astype(np.float64), shape).ravel()
    out = tuple(np.ascontiguousarray(x) for x in (r1, c1, r2, c2, m))
    for x in out:
        x.setflags(write=False)
    return out  # type: ignore[return-value]  # the five arrays


def p_adjoint(R: np.ndarray) -> np.ndarray:
    """A^T: the W (d^2, d^2) with <A(W'), R> = <W', A^T R> for all W' (R has the shape of p)."""
    d = R.shape[0]
    j, k = pair_index(d)
    # A^T puts p[a,(j,k,l)] at both (a*d+j, k*d+l) and (a*d+k, j*d+l); W_from_p puts half of it.
    c = np.where(j == k, 1.0, 2.0)[None, :, None]
    return W_from_p((np.asarray(R, dtype=np.float64).reshape(d, j.size, d) * c).reshape(d, -1))


def project_affine(W: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """Orthogonal projection of W onto {W : p(W) = coef}: W + A^+ (coef - A W), A^+ = W_from_p."""
    return W + W_from_p(coef - p_from_W(W))


def svt(W: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
    """Singular-value soft thresholding (the prox of t ||.||_*); returns the result and its singular values."""
    U, s, Vt = np.linalg.svd(W)
    s = np.maximum(s - t, 0.0)
    r = int((s > 0).sum())
    return (U[:, :r] * s[:r]) @ Vt[:r], s


def nuclear_norm(W: np.ndarray) -> float:
    return float(np.linalg.svd(W, compute_uv=False).sum())


def _check_coef(coef: np.ndarray) -> tuple[np.ndarray, int]:
    coef = np.asarray(coef, dtype=np.float64)
    d = coef.shape[0] if coef.ndim == 2 else 0
    if coef.ndim != 2 or coef.shape != (d, n_features(d)):
        raise InputError(f"coef must have shape (d, psi), got {coef.shape}")
    return coef, d


@_serial_blas
def min_nuclear_W(coef: np.ndarray, tol: float = 1e-11, max_iter: int = 5000,
                  W0: np.ndarray | None = None, return_info: bool = False
                  ) -> np.ndarray | tuple[np.ndarray, dict[str, Any]]:
    """The minimum-nuclear-norm W with p(W) = coef (Douglas-Rachford splitting).

    Splits min ||W||_* + indicator{A W = coef}: x = proj(z), y = svt(2x - z, t), z += y - x. The
    returned W is feasible to rounding whether or not the iteration converged; it converged when
    ||y - x|| <= tol ||x|| (the fixed-point residual, reported as final_residual) before max_iter.
    With return_info=True returns (W, info) with info from `solver_info`.
    """
    coef, d = _check_coef(coef)
    residual = "||y - x|| / ||x|| (Douglas-Rachford fixed-point residual)"
    norm = float(np.linalg.norm(coef))
    if norm == 0:
        W = np.zeros((d * d, d * d))
        info = solver_info("min-nuclear-norm (Douglas-Rachford)", True, 0, max_iter, 0.0, residual, tol)
        return (W, info) if return_info else W
    z = W_from_p(coef / norm) if W0 is None else np.asarray(W0, dtype=np.float64) / norm
    target = coef / norm
    s0 = np.linalg.svd(project_affine(z, target), compute_uv=False)
    # Step t: a fraction of the typical singular value; DR converges for any t > 0, this one fast.
    t = 0.5 * float(np.mean(s0[s0 > 1e-12 * s0[0]]))
    x = project_affine(z, target)
    y = x
    converged = False
    it = 0
    res = float("inf")
    for it in range(1, max_iter + 1):
        x = project_affine(z, target)
        y, _s = svt(2 * x - z, t)
        diff = y - x
        z = z + diff
        res = float(np.linalg.norm(diff)) / max(float(np.linalg.norm(x)), 1e-300)
        if res <= tol:
            converged = True
            break
    W = project_affine(y, target) * norm
    if not return_info:
        return W
    return W, solver_info("min-nuclear-norm (Douglas-Rachford)", converged, it, max_iter, res, residual, tol)
