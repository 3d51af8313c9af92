"""The factorised fit: H heads (V_h, Q_h) fitted to the statistics by ALS then Levenberg-Marquardt."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import InputError
from ...model.heads import W_from_p, p_from_W
from ..lstsq import fit
from mhla_cli.statistics.features import Features
from ._gauss_newton import _damped_solve, _normal_parts
from mhla_cli.numerics import EPS
from ._numerics import _serial_blas
from ._params import _balance, _heads_from_svd, _p_of, _pack, _to_heads, _unpack
from ._solver import solver_info
from .affine import min_nuclear_W
from .losses import _need_targets, mse, sse
from .result import LowRankFit


def _factorised_objective(feats: Features, Vm: np.ndarray, Qm: np.ndarray, wd: float) -> float:
    p = _p_of(Vm, Qm)
    return sse(feats, p) / feats.weight + 0.5 * wd * (float((Vm**2).sum()) + float((Qm**2).sum()))


def _solve_psd(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Minimum-norm solution of a symmetric PSD system (eigh, relative cut-off)."""
    import scipy.linalg  # here, not at import (start-up)

    w, v = scipy.linalg.eigh(A)
    cut = A.shape[0] * EPS * max(float(w[-1]), 0.0)
    inv = np.where(w > cut, 1.0 / np.where(w > cut, w, 1.0), 0.0)
    return v @ (inv * (v.T @ b))


def _als_lm(feats: Features, Vm: np.ndarray, Qm: np.ndarray, wd: float, als_sweeps: int,
            max_iter: int, tol: float) -> tuple[np.ndarray, np.ndarray, float, int, dict[str, Any]]:
    """ALS sweeps (exact block solves, normal equations from gram/moments) then Levenberg-Marquardt."""
    feats.expand()  # every feature (a block on the data's spans is expanded)
    Vm, Qm = _als(feats, Vm, Qm, wd, als_sweeps)
    f = _factorised_objective(feats, Vm, Qm, wd)
    mu = 1e-4
    it = 0
    assert feats.target_gram is not None  # has_targets
    f0 = max(float(np.trace(feats.target_gram)) / feats.weight, 1e-300)
    stop = "max_iter"
    res = float("inf")
    for it in range(1, max_iter + 1):
        Vm, Qm, f, mu, df, accepted = _lm_try(feats, Vm, Qm, f, mu, wd)
        # Stop when a step gains less than `tol` relative (statistically irrelevant), or at the
        # float64 resolution of the loss.
        res = df / max(f, f0 * 1e-12)
        if not accepted:
            stop = "no-descent"  # no damped step lowers the loss: a minimum at the loss's resolution
            break
        if res <= tol:
            stop = "tolerance"
            break
    Vm, Qm, f = _gauss_newton_finish(feats, Vm, Qm, f, f0, wd)
    info = solver_info("ALS + Levenberg-Marquardt (factorised fit)", stop != "max_iter", it, max_iter,
                       res if np.isfinite(res) else 0.0,
                       "relative objective decrease of the last Levenberg-Marquardt step", tol, stop=stop)
    return Vm, Qm, f, it, info


def _als(feats: Features, Vm: np.ndarray, Qm: np.ndarray, wd: float, sweeps: int) -> tuple[np.ndarray, np.ndarray]:
    """`sweeps` alternating exact solves for V then Q (each a ridge-wd least squares), balanced after each."""
    H, dd = Vm.shape
    nblk = H * dd
    assert feats.moments is not None  # has_targets
    Mt = feats.moments.T
    for _ in range(sweeps):
        HVV, _, _, bV, _ = _normal_parts(feats, Vm, Qm, Mt)
        Vm = _solve_psd(HVV + wd * np.eye(nblk), bV).reshape(H, dd)
        _, HQQ, _, _, bQ = _normal_parts(feats, Vm, Qm, Mt)
        Qm = _solve_psd(HQQ + wd * np.eye(nblk), bQ).reshape(H, dd)
        Vm, Qm = _balance(Vm, Qm)
    return Vm, Qm


def _system(feats: Features, Vm: np.ndarray, Qm: np.ndarray, wd: float) -> tuple[np.ndarray, np.ndarray]:
    """The Gauss-Newton matrix (with the weight decay) and the gradient of the objective at (Vm, Qm)."""
    nblk = Vm.size
    p = _p_of(Vm, Qm)
    assert feats.gram is not None and feats.moments is not None  # expanded, has_targets
    HVV, HQQ, HVQ, gV, gQ = _normal_parts(feats, Vm, Qm, p @ feats.gram - feats.moments.T)
    Hs = np.block([[HVV, HVQ], [HVQ.T, HQQ]]) + wd * np.eye(2 * nblk)
    return Hs, np.concatenate([gV, gQ]) + wd * _pack(Vm, Qm)


def _lm_try(feats: Features, Vm: np.ndarray, Qm: np.ndarray, f: float, mu: float, wd: float
            ) -> tuple[np.ndarray, np.ndarray, float, float, float, bool]:
    """One Levenberg-Marquardt iteration of `_als_lm`: up to 25 dampings; (V, Q, objective, next mu, the
    decrease, whether a step was accepted)."""
    H, dd = Vm.shape
    d = int(round(np.sqrt(dd)))
    x = _pack(Vm, Qm)
    Hs, g = _system(feats, Vm, Qm, wd)
    scale = float(np.mean(np.diag(Hs))) or 1.0
    for _ in range(25):
        try:
            step = _damped_solve(Hs + mu * scale * np.eye(Hs.shape[0]), -g)
        except (np.linalg.LinAlgError, ValueError):  # not positive definite to rounding: damp more
            mu *= 4
            continue
        V2, Q2 = _unpack(x + step, H, d)
        f2 = _factorised_objective(feats, V2, Q2, wd)
        if f2 <= f:
            Vm, Qm = _balance(V2, Q2)
            df = f - f2
            return Vm, Qm, _factorised_objective(feats, Vm, Qm, wd), max(mu / 3, 1e-12), df, True
        mu *= 4
    return Vm, Qm, f, mu, 0.0, False


def _gauss_newton_finish(feats: Features, Vm: np.ndarray, Qm: np.ndarray, f: float, f0: float, wd: float
                         ) -> tuple[np.ndarray, np.ndarray, float]:
    """Near an exact fit the loss itself only resolves ~eps * tr(T) (cancellation), so finish with
    Gauss-Newton steps accepted on the gradient norm, which has no such floor (at most 20)."""
    H, dd = Vm.shape
    d = int(round(np.sqrt(dd)))
    for _ in range(20):
        x = _pack(Vm, Qm)
        Hs, g = _system(feats, Vm, Qm, wd)
        try:
            step = _damped_solve(Hs + 1e-12 * (float(np.mean(np.diag(Hs))) or 1.0) * np.eye(Hs.shape[0]), -g)
        except (np.linalg.LinAlgError, ValueError):  # singular to rounding: the finish stops here
            break
        V2, Q2 = _unpack(x + step, H, d)
        _, g2 = _system(feats, V2, Q2, wd)
        f2 = _factorised_objective(feats, V2, Q2, wd)
        if not (np.linalg.norm(g2) < 0.5 * np.linalg.norm(g) and f2 <= f + 1e-12 * f0):
            break
        Vm, Qm = _balance(V2, Q2)
        f = _factorised_objective(feats, Vm, Qm, wd)
    return Vm, Qm, f


@_serial_blas
def fit_factorised(feats: Features, n_heads: int, weight_decay: float = 0.0, restarts: int = 10,
                   seed: int = 0, als_sweeps: int = 5, max_iter: int = 300, tol: float = 1e-8,
                   init_coef: np.ndarray | None = None) -> LowRankFit:
    """Minimise (1/N) sum_i ||p(W) H_i - y_i||^2 + wd (||V||^2 + ||Q||^2) / 2 over H heads (V_h, Q_h).

    Non-convex: runs `restarts` starts and keeps the lowest objective. Start 0 is the top-H SVD of
    the minimum-nuclear-norm W of the least-squares (min-norm) coef, start 1 the top-H SVD of its
    min-norm W, the rest Gaussian with matching scale (seeded by `seed`). With no weight decay the
    starts stop at the first exact fit (zero loss to rounding). Each start: ALS sweeps (with one factor
    fixed the loss is quadratic in the other; normal equations from gram and moments), then
    Levenberg-Marquardt on all factors. Uses the statistics only.
    """
    _need_targets(feats)
    if n_heads < 1:
        raise InputError(f"the number of heads must be >= 1, got {n_heads}")
    if weight_decay < 0 or not np.isfinite(weight_decay):
        raise InputError(f"weight_decay must be a finite number >= 0, got {weight_decay}")
    if restarts < 1:
        raise InputError(f"restarts must be >= 1, got {restarts}")
    d = feats.d
    H = int(n_heads)
    rng = np.random.default_rng(seed)
    if init_coef is None:
        init_coef = fit(feats).coef
    W_mn = W_from_p(init_coef)
    starts: list[tuple[str, np.ndarray, np.ndarray]] = []
    if np.linalg.norm(init_coef) > 0:
        starts.append(("svd-min-nuclear", *_heads_from_svd(min_nuclear_W(init_coef, tol=1e-6, max_iter=1000), H)))
        if restarts > 1:
            starts.append(("svd-min-norm", *_heads_from_svd(W_mn, H)))
    scale = float(np.linalg.svd(W_mn, compute_uv=False)[0]) if np.linalg.norm(W_mn) > 0 else 1.0
    while len(starts) < restarts:
        V0 = rng.standard_normal((H, d * d))
        Q0 = rng.standard_normal((H, d * d))
        c = np.sqrt(scale / (H * np.sqrt(d * d * d * d)))
        starts.append(("random", V0 * c, Q0 * c))
    starts = starts[:restarts]
    results = []
    assert feats.target_gram is not None  # has_targets
    floor = 1e-26 * float(np.trace(feats.target_gram)) / feats.weight
    for name, V0, Q0 in starts:
        Vm, Qm, f, it, sinfo = _als_lm(feats, V0, Q0, weight_decay, als_sweeps, max_iter, tol)
        if weight_decay == 0 and f <= floor:
            # An exact fit (zero loss to rounding): converged whatever the step test said.
            sinfo.update(converged=True, stop="exact-fit")
        results.append((f, name, Vm, Qm, it, sinfo))
        if weight_decay == 0 and f <= floor:
            break  # an exact fit: no start can do better
    objs = [(r[0], r[1]) for r in results]
    f, name, Vm, Qm, it, sinfo = min(results, key=lambda r: r[0])
    sinfo["starts_at_limit"] = sum(1 for r in results if not r[5]["converged"])
    sinfo["starts"] = len(results)
    W = Vm.T @ Qm
    coef = p_from_W(W)
    heads = _to_heads(Vm, Qm, d)
    info = {"method": "factorised", "n_heads": H, "weight_decay": float(weight_decay), "restarts": restarts,
            "seed": seed, "objective": f, "train_mse": mse(feats, coef), "best_start": name,
            "iterations": it, "converged": sinfo["converged"], "final_residual": sinfo["final_residual"],
            "solver": sinfo, "start_objectives": {f"{i}:{n}": v for i, (v, n) in enumerate(objs)},
            "head_norms": (np.linalg.norm(Vm, axis=1) * np.linalg.norm(Qm, axis=1)).tolist()}
    return LowRankFit(coef=coef, W=W, info=info, heads=heads)
