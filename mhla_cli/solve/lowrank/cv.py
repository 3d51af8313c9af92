"""Choosing H or LAMBDA by K-fold cross-validation on per-fold statistics (the one-standard-error rule)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import InputError
from mhla_cli.statistics.features import Features
from ..ridge_cv import cv_floor
from ._numerics import _serial_blas
from .factorised import fit_factorised
from .losses import mse
from .nuclear import fit_nuclear, nuclear_lambda_max


def _pick(scores: list[tuple[float, float, float]], prefer_last: bool, floor: float = 0.0) -> int:
    """One-standard-error rule over (param, mean, se): the simplest model within 1 SE of the best.

    Means below `floor` (rounding level of an exact fit) count as equal.
    """
    means = np.maximum(np.array([s[1] for s in scores]), floor)
    best = int(np.nanargmin(means))
    bound = means[best] + scores[best][2]
    ok = [i for i, m in enumerate(means) if m <= bound]
    return max(ok) if prefer_last else min(ok)


def _cv_table(params: list[int] | list[float], errs: np.ndarray) -> list[tuple[float, float, float]]:
    K = errs.shape[1]
    return [(float(p), float(errs[i].mean()), float(errs[i].std(ddof=1) / np.sqrt(K)) if K > 1 else 0.0)
            for i, p in enumerate(params)]


@_serial_blas
def cv_heads(total: Features, folds: list[Features], candidates: list[int] | None = None,
             weight_decay: float = 0.0, restarts: int = 2, seed: int = 0) -> dict[str, Any]:
    """Validation MSE per head count H over K folds (train on the other folds' summed statistics).

    Picks the smallest H within one standard error of the best; scanning stops once two
    consecutive H are worse than the best so far.
    """
    if len(folds) < 2:
        raise InputError("cross-validation needs at least 2 folds")
    d = total.d
    if candidates is None:
        candidates = list(range(1, min(d * d, 12) + 1))
    rows: list[np.ndarray] = []
    used: list[int] = []
    worse = 0
    best = np.inf
    unconverged = 0
    for H in candidates:
        errs = []
        for k, fold in enumerate(folds):
            train = _minus(total, fold)
            res = fit_factorised(train, H, weight_decay=weight_decay, restarts=restarts, seed=seed + k)
            unconverged += not res.info["converged"]
            errs.append(mse(fold, res.coef))
        rows.append(np.array(errs))
        used.append(H)
        m = max(float(np.mean(errs)), cv_floor(total))
        if m < best * (1 - 1e-9):
            best, worse = m, 0
        else:
            worse += 1
            if worse >= 2:
                break
    table = _cv_table(used, np.array(rows))
    i = _pick(table, prefer_last=False, floor=cv_floor(total))
    return {"chosen": int(used[i]), "table": [{"heads": int(p), "cv_mse": m, "se": s} for p, m, s in table],
            "fits": len(used) * len(folds), "unconverged_fits": int(unconverged)}


@_serial_blas
def cv_nuclear(total: Features, folds: list[Features], n_grid: int = 10, decades: float = 5.0
               ) -> dict[str, Any]:
    """Validation MSE along a LAMBDA path lambda_max * 10^(-decades * i / (n_grid - 1)), warm-started.

    Picks the largest LAMBDA within one standard error of the best.
    """
    if len(folds) < 2:
        raise InputError("cross-validation needs at least 2 folds")
    lmax = nuclear_lambda_max(total)
    grid = [lmax * 10 ** (-decades * i / max(n_grid - 1, 1)) for i in range(n_grid)]
    errs = np.zeros((len(grid), len(folds)))
    unconverged = 0
    for k, fold in enumerate(folds):
        train = _minus(total, fold)
        W0 = None
        for i, lam in enumerate(grid):
            res = fit_nuclear(train, lam, W0=W0, max_iter=2000, tol=1e-7)
            unconverged += not res.info["converged"]
            W0 = res.W
            errs[i, k] = mse(fold, res.coef)
    table = _cv_table(grid, errs)
    i = _pick(table, prefer_last=True, floor=cv_floor(total))
    return {"chosen": float(grid[i]), "lambda_max": lmax,
            "table": [{"lambda": p, "cv_mse": m, "se": s} for p, m, s in table],
            "fits": len(grid) * len(folds), "unconverged_fits": int(unconverged)}


def _minus(total: Features, part: Features) -> Features:
    """Statistics of the samples in `total` but not in `part`."""
    return total - part
