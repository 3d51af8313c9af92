"""Choosing the ridge penalty by K-fold cross-validation on per-fold statistics (`mhla fit --ridge auto`).

Fold k's training statistics are the total minus fold k (Features.__sub__), in their own canonical
coordinates (lstsq.fit's: the whitening of the training tokens, Lambda~ = gram_b / sum w). One
eigendecomposition Lambda~ = V diag(lambda) V^T per fold gives the ridge solution of every penalty r,
p_b(r)^T = V diag(1 / (lambda + r)) V^T m~, with eigenvalues at or below the certificate's numerical
tolerance taken as exact zeros (so r = 0 is the minimum-norm least-squares fit, lstsq.fit's). Each
held-out error comes from the held-out fold's statistics in the same coordinates, never from features:
SSE = tr(p_b G_val p_b^T) - 2 tr(p_b M_val) + tr(T_val). Statistics with the affine block of the wide tokens are
cross-validated the same way on their extended features (mhla_cli.solve.affine_block: `extended_path`), the
ridge in the units of the extended lambda_max (the fit's).

The grid: r = 0 (least squares) and N_GRID values log-spaced from GRID_LO to GRID_HI times the total's
lambda_max (the certificate's; `--ridge` is in those units). The rule: the minimum of the mean
held-out MSE over the folds (CV errors below the rounding floor count as equal, and the smallest
ridge among equals wins), so the choice is never worse in CV error than least squares (r = 0).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import affine_block
from .domains import FULL
from ..errors import InputError
from ..numerics import numerical_tolerance
from ..statistics.features import Features

# The grid: r = 0 and N_GRID penalties from GRID_LO to GRID_HI times lambda_max, log-spaced
# (10 decades below lambda_max down to the rounding level of Lambda~, one decade above).
N_GRID = 30
GRID_LO = 1e-8
GRID_HI = 1e1
# Held-out MSEs at or below this times the mean target energy per output are rounding (an exact fit):
# they count as equal (`cv_floor`; also the floor of lowrank.cv's choices).
CV_FLOOR = 1e-14


def cv_floor(total: Features) -> float:
    """The held-out MSE indistinguishable from 0: CV_FLOOR times the mean target energy per output."""
    assert total.target_gram is not None  # statistics with targets
    return CV_FLOOR * float(np.trace(total.target_gram)) / (total.weight * total.n_outputs)


def ridge_grid(lambda_max: float, n_grid: int = N_GRID, lo: float = GRID_LO, hi: float = GRID_HI) -> np.ndarray:
    """[0, lo lambda_max, ..., hi lambda_max] (n_grid log-spaced penalties after the 0)."""
    if not np.isfinite(lambda_max) or lambda_max <= 0:
        return np.zeros(1)
    return np.concatenate([[0.0], lambda_max * np.logspace(np.log10(lo), np.log10(hi), n_grid)])


def fold_path(train: Features, val: Features, grid: np.ndarray) -> np.ndarray:
    """Held-out SSE of every ridge in `grid` (fit on `train`, scored on `val`), from one eigendecomposition.

    `train` is changed in place into its canonical basis; `val` is not changed.
    """
    A, _, _ = train.solver_stats()
    N, psi = train.weight, train.n_features  # sum w: Lambda~ and m~ carry no units of the weights
    fac = FULL.factorize(train)
    st = fac.structure
    assert train.basis_moments is not None  # statistics with targets, in their basis
    rhs = st.restrict(train.basis_moments / N)
    w, V = fac.eigh()  # of Lambda~ on the block of the data's spans (every other direction an exact null)
    tol = numerical_tolerance(fac.lambda_max(), psi)
    keep = w > tol
    w, V = w[keep], V[:, keep]
    c = V.T @ rhs  # the moments in the eigenvectors' coordinates
    v = val.copy().to_basis(A)  # the held-out sums in the training coordinates
    G = st.compress(v.basis_gram)
    M = st.restrict(v.basis_moments)
    assert v.target_gram is not None  # statistics with targets
    energy = float(np.trace(v.target_gram))
    out = np.empty(grid.size)
    for i, r in enumerate(grid):
        sol = V @ (c / (w + r)[:, None])  # (n, d): p_b^T on the block
        quad = float(np.sum((G @ sol) * sol))
        out[i] = max(quad - 2.0 * float(np.sum(sol * M)) + energy, 0.0)
    return out


def extended_path(train: Features, val: Features, grid: np.ndarray) -> np.ndarray:
    """`fold_path` of the extended features (the MHLA's and the affine block: affine_block.extended), from one
    eigendecomposition of the training fold's extended Lambda~; the held-out sums in its coordinates."""
    A, _, _ = train.solver_stats()
    ext = affine_block.extended(train)
    fac = ext.fac
    rhs = affine_block.extended_moments(train, ext)
    w, V = fac.eigh()
    keep = w > numerical_tolerance(fac.lambda_max(), ext.n_full)
    w, V = w[keep], V[:, keep]
    c = V.T @ rhs
    v = val.copy().to_basis(A)
    assert v.affine is not None and train.affine is not None and v.target_gram is not None  # the block, targets
    v.affine.to_f_basis(train.affine.f_basis)
    G, M = affine_block.held_out_sums(v, ext)
    energy = float(np.trace(v.target_gram))
    out = np.empty(grid.size)
    for i, r in enumerate(grid):
        sol = V @ (c / (w + r)[:, None])
        out[i] = max(float(np.sum((G @ sol) * sol)) - 2.0 * float(np.sum(sol * M)) + energy, 0.0)
    return out


def weighted_folds(folds: list[Features]) -> tuple[list[Features], list[int]]:
    """(the folds that hold samples, the indices of those that hold none): a fold whose weights are all 0 holds
    no held-out error to measure and changes no training sum, so cross-validation skips it (and says so)."""
    kept = [f for f in folds if f.n_samples > 0 and f.weight > 0]
    return kept, [k for k, f in enumerate(folds) if not (f.n_samples > 0 and f.weight > 0)]


def cv_ridge(total: Features, folds: list[Features], n_grid: int = N_GRID) -> dict[str, Any]:
    """The ridge by K-fold CV: the grid's held-out MSE (mean and standard error over the folds) and the
    minimum (module docstring). Returns {"chosen", "rule", "lambda_max", "table": [{"ridge", "cv_mse",
    "se"}], "least_squares_cv_mse", "n_folds"}."""
    if len(folds) < 2:
        raise InputError("cross-validation needs at least 2 folds")
    if not total.has_targets or any(not f.has_targets for f in folds):
        raise InputError("cross-validation needs targets in every fold")
    extended = total.affine is not None
    lmax = (affine_block.extended(total).fac if extended else FULL.factorize(total)).lambda_max()
    path = extended_path if extended else fold_path
    grid = ridge_grid(lmax, n_grid)
    errs = np.empty((grid.size, len(folds)))
    for k, fold in enumerate(folds):
        if fold.n_samples < 1 or fold.n_samples >= total.n_samples:
            raise InputError(f"fold {k} has {fold.n_samples} of the {total.n_samples} samples: every fold needs "
                             "samples, and so does the rest")
        errs[:, k] = path(total - fold, fold, grid) / (fold.weight * total.n_outputs)  # weighted means
    mean = errs.mean(axis=1)
    se = errs.std(axis=1, ddof=1) / np.sqrt(len(folds))
    floor = cv_floor(total)
    best = int(np.argmin(np.maximum(mean, floor)))  # the first (smallest ridge) of equals
    return {"chosen": float(grid[best]), "rule": "minimum", "lambda_max": float(lmax),
            "least_squares_cv_mse": float(mean[0]), "cv_mse": float(mean[best]), "n_folds": len(folds),
            "table": [{"ridge": float(r), "cv_mse": float(m), "se": float(s)} for r, m, s in zip(grid, mean, se)]}
