"""Low-rank MHLA: the fewest heads computing a function, and low-rank fits from few samples.

Notation: A is the linear map W -> p (heads.p_from_W); its kernel is the part of W antisymmetric in
(j, k), so {W : A(W) = p} is an affine set and every W in it computes the same function. A rank-H
W = sum_h vec(V_h) vec(Q_h)^T is an H-head MHLA. Weight decay (||V||^2 + ||Q||^2) / 2 on the factors
equals ||W||_* at the balanced optimum, so the nuclear-norm fit is the convex relaxation of the
factorised one. Losses use the statistics only: sum_i ||p H_i - y_i||^2 = tr(p G p^T) - 2 tr(p M) +
tr(T) with G = gram, M = moments, T = target_gram.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import functools
import warnings
from collections.abc import Callable

import numpy as np
import scipy.linalg
from threadpoolctl import threadpool_limits

from .errors import InputError
from .features import n_features, pair_index
from .heads import Heads, W_from_p, heads_from_W, p_from_W
from .model import Model
from .solve import fit, train_mse
from .stream import Features

EPS = float(np.finfo(np.float64).eps)


def _serial_blas(fn: Callable) -> Callable:
    """Run with one BLAS thread: these loops do many small (d^2 x d^2) solves, where threads only cost."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with threadpool_limits(limits=1, user_api="blas"):
            return fn(*args, **kwargs)
    return wrapper

# --------------------------------------------------------------------------------------------
# the map A: W -> p, its adjoint, the projection onto {W : A(W) = p}
# --------------------------------------------------------------------------------------------


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
    return out  # type: ignore[return-value]


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


def solver_info(name: str, converged: bool, iterations: int, max_iter: int, final_residual: float,
                residual: str, tol: float, **extra: Any) -> dict[str, Any]:
    """The record every iterative solver returns: did it stop on its criterion or at its limit."""
    return {"solver": name, "converged": bool(converged), "iterations": int(iterations), "max_iter": int(max_iter),
            "final_residual": float(final_residual), "residual": residual, "tol": float(tol), **extra}


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


# --------------------------------------------------------------------------------------------
# heads <-> parameters, Jacobians of p
# --------------------------------------------------------------------------------------------


def _pack(V: np.ndarray, Q: np.ndarray) -> np.ndarray:
    return np.concatenate([V.reshape(-1), Q.reshape(-1)])


def _unpack(x: np.ndarray, H: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    n = H * d * d
    return x[:n].reshape(H, d * d), x[n:].reshape(H, d * d)


def _p_of(Vm: np.ndarray, Qm: np.ndarray) -> np.ndarray:
    return p_from_W(Vm.T @ Qm)


def _jacobians(Vm: np.ndarray, Qm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """dp/dV (E, H d^2) and dp/dQ (E, H d^2); p is linear in each factor, so p = J_V v = J_Q q."""
    H, dd = Vm.shape
    d = int(round(np.sqrt(dd)))
    r1, c1, r2, c2, m = _p_index(d)
    E = r1.size
    e = np.arange(E)
    JV = np.zeros((E, H, dd))
    JQ = np.zeros((E, H, dd))
    # p[e] = sum_h V_h[r1] Q_h[c1] + m V_h[r2] Q_h[c2]
    JV[e, :, r1] = Qm[:, c1].T
    JV[e, :, r2] += m[:, None] * Qm[:, c2].T
    JQ[e, :, c1] = Vm[:, r1].T
    JQ[e, :, c2] += m[:, None] * Vm[:, r2].T
    return JV.reshape(E, H * dd), JQ.reshape(E, H * dd)


def _balance(Vm: np.ndarray, Qm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rescale V_h, Q_h to equal norms (same W; the weight-decay optimum of the scale gauge)."""
    nv = np.linalg.norm(Vm, axis=1)
    nq = np.linalg.norm(Qm, axis=1)
    ok = (nv > 0) & (nq > 0)
    c = np.ones_like(nv)
    c[ok] = np.sqrt(nq[ok] / nv[ok])
    return Vm * c[:, None], Qm / c[:, None]


def _heads_from_svd(W: np.ndarray, H: int) -> tuple[np.ndarray, np.ndarray]:
    U, s, Vt = np.linalg.svd(W)
    r = np.sqrt(s[:H])
    return (U[:, :H] * r).T.copy(), (Vt[:H].T * r).T.copy()


# --------------------------------------------------------------------------------------------
# 1. fewest heads
# --------------------------------------------------------------------------------------------


@dataclass
class _Metric:
    """A stand-in for Features in _normal_parts: the quadratic form (2/N) G of the residual."""

    gram: np.ndarray
    n_samples: int


def polish_heads(coef: np.ndarray, Vm: np.ndarray, Qm: np.ndarray, tol: float = 1e-13,
                 max_iter: int = 200, stall_window: int = 40, stall_factor: float = 0.5,
                 return_info: bool = False) -> tuple[Any, ...]:
    """Levenberg-Marquardt on p(V, Q) = coef; returns V, Q (H, d^2) and ||p - coef|| / ||coef||.

    Stops when the relative error is <= tol (converged), when the cost fell by less than a factor
    `stall_factor` over the last `stall_window` accepted steps (a plateau: a local minimum or too few
    heads), when no damped step decreases the cost, or at max_iter. With return_info=True also
    returns the `solver_info` record (stop reason in info["stop"], final_residual = relative p error).
    """
    norm = float(np.linalg.norm(coef))
    target = coef.ravel() / norm
    H = Vm.shape[0]
    d = coef.shape[0]
    Vm, Qm = _balance(Vm / np.sqrt(norm), Qm / np.sqrt(norm))
    r = _p_of(Vm, Qm).ravel() - target
    cost = float(r @ r)
    mu = 1e-3
    history = [cost]
    metric = _Metric(gram=np.eye(n_features(d)), n_samples=2)  # (2/N) G = I
    stop = "max_iter"
    it = 0
    for it in range(max_iter):
        if np.sqrt(cost) <= tol:
            stop = "tolerance"
            break
        # A plateau (a swamp or too few heads): little progress over the last stall_window steps.
        if (len(history) > stall_window and cost > stall_factor * history[-1 - stall_window]
                and cost > 1e4 * tol * tol):
            stop = "stalled"
            break
        # J^T J and J^T r from the structured blocks with an identity metric (no dense J).
        HVV, HQQ, HVQ, gV, gQ = _normal_parts(metric, Vm, Qm, r.reshape(d, -1))
        JtJ = np.block([[HVV, HVQ], [HVQ.T, HQQ]])
        g = np.concatenate([gV, gQ])
        scale = float(np.mean(np.diag(JtJ))) or 1.0
        improved = False
        for _ in range(30):
            A = JtJ + (mu * scale) * np.eye(JtJ.shape[0])
            try:
                step = _damped_solve(A, -g)
            except (np.linalg.LinAlgError, ValueError):
                mu *= 10
                continue
            V2, Q2 = _unpack(_pack(Vm, Qm) + step, H, d)
            r2 = _p_of(V2, Q2).ravel() - target
            c2 = float(r2 @ r2)
            if c2 < cost:
                Vm, Qm = _balance(V2, Q2)
                r, cost = r2, c2
                history.append(cost)
                mu = max(mu / 3, 1e-12)
                improved = True
                break
            mu *= 4
        if not improved:
            stop = "no-descent"
            break
    else:
        it = max_iter
        if np.sqrt(cost) <= tol:
            stop = "tolerance"
    s = np.sqrt(norm)
    err = float(np.sqrt(cost))
    if not return_info:
        return Vm * s, Qm * s, err
    info = solver_info("Levenberg-Marquardt (heads)", stop == "tolerance", it, max_iter, err,
                       "||p(V, Q) - p|| / ||p||", tol, stop=stop)
    return Vm * s, Qm * s, err, info


def _rel_err(coef: np.ndarray, Vm: np.ndarray, Qm: np.ndarray) -> float:
    n = float(np.linalg.norm(coef))
    return float(np.linalg.norm(_p_of(Vm, Qm) - coef)) / n if n > 0 else 0.0


def _to_heads(Vm: np.ndarray, Qm: np.ndarray, d: int) -> Heads:
    H = Vm.shape[0]
    return Heads(V=Vm.reshape(H, d, d).copy(), Q=Qm.reshape(H, d, d).copy())


def head_lower_bound(coef: np.ndarray, tol: float = 1e-8, n_directions: int = 4, seed: int = 0
                     ) -> dict[str, Any]:
    """A proven lower bound on the heads of any MHLA whose p is within `tol` (relative) of coef.

    For x in R^d, B(x)[a, l] = sum_{j<=k} x_j x_k p[a,(j,k,l)] = sum_{j,k} x_j x_k W[a*d+j, k*d+l] is the
    same for every W with that p (the kernel of A is antisymmetric in (j, k)), and an H-head W gives
    B(x) = sum_h (V_h x)(Q_h^T x)^T of rank <= H. For unit x, ||B(x) - B'(x)||_2 <= ||p - p'||_F, so by
    Weyl's inequality every p' with ||p' - p|| <= tol ||p|| needs >= #{i : s_i(B(x)) > tol ||p||} heads.
    x runs over the coordinate vectors (B_j[a, l] = p[a,(j,j,l)]) and `n_directions` seeded random
    unit vectors; the bound is the largest of these ranks (>= 1 when p != 0).
    """
    coef, d = _check_coef(coef)
    norm = float(np.linalg.norm(coef))
    # The SVD itself is accurate to ~ d eps ||B||; the tolerance dominates for tol >> eps.
    thr = max(tol, 10 * d * EPS) * norm
    j, k = pair_index(d)
    P = coef.reshape(d, j.size, d)
    xs = [np.eye(d)[i] for i in range(d)]
    rng = np.random.default_rng(seed)
    for _ in range(n_directions):
        x = rng.standard_normal(d)
        xs.append(x / np.linalg.norm(x))
    ranks = []
    for x in xs:
        B = np.einsum("i,ail->al", x[j] * x[k], P)
        ranks.append(int((np.linalg.svd(B, compute_uv=False) > thr).sum()))
    bound = max(ranks) if norm > 0 else 0
    return {"lower_bound": max(bound, 1) if norm > 0 else 1, "block_ranks": ranks[:d],
            "direction_ranks": ranks[d:], "threshold": thr,
            "method": "max rank of B(x)[a,l] = sum_{j<=k} x_j x_k p[a,(j,k,l)] over coordinate and random x, "
                      "counting singular values > tol ||p||"}


def _random_start(coef: np.ndarray, W_mn: np.ndarray, H: int, rng: np.random.Generator, scale: float
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Top-H SVD of a random point of {W : p(W) = coef}: the min-norm W plus a random kernel element
    of norm scale * ||W_mn|| (random kernel directions reach the other low-rank members of the set)."""
    K = rng.standard_normal(W_mn.shape)
    K = K - W_from_p(p_from_W(K))
    nk = float(np.linalg.norm(K))
    if nk > 0:
        K *= scale * float(np.linalg.norm(W_mn)) / nk
    return _heads_from_svd(W_mn + K, H)


_START_SCALES = (1.0, 2.0, 4.0, 0.5)


@_serial_blas
def fewest_heads(coef: np.ndarray, tol: float = 1e-8, W: np.ndarray | None = None,
                 linear_upto: int = 6, n_starts: int = 16, seed: int = 0, max_iter: int = 500,
                 bisection_starts: int = 2) -> Heads:
    """The fewest heads found whose function matches coef to `tol` relative (verified before returning).

    Lower bound L (`head_lower_bound`): no model within tol of coef has fewer heads. For H = L, L + 1,
    ... up to max(linear_upto, L) one by one, up to 2 + n_starts starts are polished by
    Levenberg-Marquardt: the top-H SVD of the min-nuclear-norm W, of the min-norm W, then n_starts
    top-H SVDs of random points of {W : p(W) = coef} (seeded by seed and H); the first start within
    tol is accepted. Beyond that, bisection up to the rank of the min-nuclear-norm W (an exact H-head
    fit extends to H + 1 heads; generic_rank(d) is tried first) with 2 + bisection_starts
    starts per H (each start costs O((H d^2)^3) per step there). `info`: n_heads, lower_bound,
    proven_minimal (n_heads == lower_bound), starts_tried / starts_per_head_count / best_error per H
    tried, rel_error (= relative_function_error), singular_values, solver (the min-nuclear W's record).
    """
    coef, d = _check_coef(coef)
    if not 0 < tol < 1:
        raise InputError(f"tolerance must be in (0, 1), got {tol}")
    if n_starts < 0:
        raise InputError(f"n_starts must be >= 0, got {n_starts}")
    norm = float(np.linalg.norm(coef))
    if norm == 0:
        heads = Heads(V=np.zeros((1, d, d)), Q=np.zeros((1, d, d)))
        heads.info = {"n_heads": 1, "relative_function_error": 0.0, "rel_error": 0.0, "singular_values": [0.0],
                      "tol": tol, "lower_bound": 1, "proven_minimal": True, "starts_tried": {}, "best_error": {}}
        return heads
    if W is None:
        Wn, nuc_info = min_nuclear_W(coef, return_info=True)
    else:
        Wn, nuc_info = W, None
    W_mn = W_from_p(coef)
    s = np.linalg.svd(Wn, compute_uv=False)
    # The SVD of the (feasible) min-nuclear W with all its nonzero values is an exact fallback.
    r_max = max(1, int((s > 1e-10 * s[0]).sum()))
    bound = head_lower_bound(coef, tol=tol, seed=seed)
    L = min(bound["lower_bound"], r_max)
    tried: dict[int, tuple[np.ndarray, np.ndarray, float]] = {}
    n_tried: dict[int, int] = {}
    budget: dict[int, int] = {}

    def attempt(H: int, k: int = n_starts) -> tuple[np.ndarray, np.ndarray, float]:
        if H in tried:
            return tried[H]
        rng = np.random.default_rng([seed, H])
        best: tuple[np.ndarray, np.ndarray, float] | None = None
        n = 0
        for i in range(2 + k):
            if i == 0:
                V0, Q0 = _heads_from_svd(Wn, H)
            elif i == 1:
                V0, Q0 = _heads_from_svd(W_mn, H)
            else:
                V0, Q0 = _random_start(coef, W_mn, H, rng, _START_SCALES[(i - 2) % len(_START_SCALES)])
            n += 1
            err0 = _rel_err(coef, V0, Q0)
            cand = (V0, Q0, err0)
            if err0 > tol * 1e-2:
                V1, Q1, _ = polish_heads(coef, V0, Q0, max_iter=max_iter)
                err1 = _rel_err(coef, V1, Q1)
                if err1 < err0:
                    cand = (V1, Q1, err1)
            if best is None or cand[2] < best[2]:
                best = cand
            if best[2] <= tol:
                break
        assert best is not None
        tried[H], n_tried[H], budget[H] = best, n, 2 + k
        return best

    best_H = None
    top = min(max(linear_upto, L), r_max)
    for H in range(L, top + 1):
        if attempt(H)[2] <= tol:
            best_H = H
            break
    if best_H is None:
        lo, hi = top, r_max  # lo fails (or equals hi); find the smallest success in (lo, hi]

        # A generic p (e.g. a noisy fit) is typically reachable with generic_rank(d) heads: try it first.
        r_gen = generic_rank(d)
        if lo < r_gen < hi and attempt(r_gen, bisection_starts)[2] <= tol:
            hi = r_gen
        elif attempt(hi, bisection_starts)[2] > tol:
            # Fallback: the min-norm SVD has at most d^2 heads and is exact.
            hd, _ = heads_from_W(W_mn, tol=0.0)
            V0, Q0 = hd.V.reshape(hd.n_heads, -1), hd.Q.reshape(hd.n_heads, -1)
            hi = hd.n_heads
            tried[hi] = (V0, Q0, _rel_err(coef, V0, Q0))
            n_tried[hi] = n_tried.get(hi, 0) + 1
            budget[hi] = budget.get(hi, 0) + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if attempt(mid, bisection_starts)[2] <= tol:
                hi = mid
            else:
                lo = mid
        best_H = hi
    Vm, Qm, err = tried[best_H]
    err = _rel_err(coef, Vm, Qm)  # re-verify on the final arrays
    if err > tol:
        raise RuntimeError(f"fewest_heads: no factorisation within {tol:g} (best {err:.3g})")
    heads = _to_heads(Vm, Qm, d)
    proven = heads.n_heads <= bound["lower_bound"]
    heads.info = {"n_heads": heads.n_heads, "relative_function_error": err, "rel_error": err, "tol": tol,
                  "lower_bound": bound["lower_bound"], "proven_minimal": bool(proven),
                  "lower_bound_info": bound,
                  "starts_tried": {int(h): n_tried[h] for h in sorted(n_tried)},
                  "best_error": {int(h): float(tried[h][2]) for h in sorted(tried)},
                  "starts_per_head_count": {int(h): budget[h] for h in sorted(budget)}, "seed": seed,
                  "singular_values": s.tolist(), "nuclear_rank": r_max, "solver": nuc_info}
    return heads


def fewest_message(info: dict[str, Any]) -> str:
    """The verdict wording of --fewest: "proven minimal" only when the lower bound is met."""
    if info.get("proven_minimal"):
        return f"{info['n_heads']} heads, proven minimal (lower bound {info['lower_bound']})"
    per = info.get("starts_per_head_count") or {}
    counts = sorted({v for h, v in per.items() if int(h) < info["n_heads"]}, reverse=True)
    text = "/".join(str(c) for c in counts) or "0"
    return (f"{info['n_heads']} heads: fewest found ({text} starts per head count tried; "
            f"lower bound {info['lower_bound']})")


def hit_limit(info: dict[str, Any] | None) -> bool:
    """True when an iterative solver's record says it stopped at its iteration limit, unconverged."""
    return bool(info) and not info.get("converged", True) and info.get("iterations", 0) >= info.get("max_iter", 0)


def solver_warnings(info: dict[str, Any]) -> list[str]:
    """Warnings for a fit/heads info dict: its solver record, and CV fits that stopped at their limit."""
    out = []
    solver = info.get("solver")
    if hit_limit(solver):
        out.append(convergence_warning(solver))
    cv = info.get("cv") or {}
    if cv.get("unconverged_fits"):
        out.append(f"{cv['unconverged_fits']} of {cv['fits']} cross-validation fits stopped at their iteration "
                   "limit before converging: the CV choice is from unconverged fits")
    return out


def convergence_warning(info: dict[str, Any], what: str | None = None) -> str:
    """The stderr warning text for an unconverged solver record."""
    return (f"{what or info['solver']} did not converge after {info['iterations']} iterations "
            f"(residual {info['final_residual']:.3g}, tolerance {info['tol']:.3g})")


# --------------------------------------------------------------------------------------------
# losses on the statistics
# --------------------------------------------------------------------------------------------


def sse(feats: Features, coef: np.ndarray) -> float:
    """sum_i ||p H_i - y_i||^2 from the statistics (solve.train_mse, the one training error)."""
    return train_mse(feats, coef)[0] * feats.n_samples * feats.d


def mse(feats: Features, coef: np.ndarray) -> float:
    """Mean squared error per output, sum_i ||p H_i - y_i||^2 / (N d) (solve.train_mse)."""
    return train_mse(feats, coef)[0]


def _need_targets(feats: Features) -> None:
    if not feats.has_targets:
        raise InputError("the data have no 'targets': fit needs (X, y) pairs")


# --------------------------------------------------------------------------------------------
# 2. factorised fit
# --------------------------------------------------------------------------------------------


@dataclass
class LowRankFit:
    """Result of a factorised or nuclear-norm fit: coef, W, and what happened."""

    coef: np.ndarray
    W: np.ndarray
    info: dict[str, Any] = field(default_factory=dict)
    heads: Heads | None = None


def _factorised_objective(feats: Features, Vm: np.ndarray, Qm: np.ndarray, wd: float) -> float:
    p = _p_of(Vm, Qm)
    return sse(feats, p) / feats.n_samples + 0.5 * wd * (float((Vm**2).sum()) + float((Qm**2).sum()))


def _damped_solve(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Solve a damped (positive definite) normal-equation system; ill-conditioning is expected here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scipy.linalg.LinAlgWarning)
        return scipy.linalg.solve(A, b, assume_a="pos")


def _structure(Vm: np.ndarray, Qm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two linear structures of p in the factors, per pair i = (j, k) of the feature order.

    p[a, (i, l)] = sum_h sum_k' P[h, a, i, k'] Q_h[k', l]  (P[h,a,i,k'] = V_h[a,j] d(k,k') + m V_h[a,k] d(j,k'))
                 = sum_h sum_j' R[h, i, l, j'] V_h[a, j']  (R[h,i,l,j'] = d(j,j') Q_h[k,l] + m d(k,j') Q_h[j,l])
    with m = 1 for j < k, 0 for j = k.
    """
    H, dd = Vm.shape
    d = int(round(np.sqrt(dd)))
    jp, kp = pair_index(d)
    V3 = Vm.reshape(H, d, d)
    Q3 = Qm.reshape(H, d, d)
    P = np.zeros((H, d, jp.size, d))
    R = np.zeros((H, jp.size, d, d))
    for i, (j, k) in enumerate(zip(jp, kp)):
        P[:, :, i, k] += V3[:, :, j]
        R[:, i, :, j] += Q3[:, k, :]
        if j != k:
            P[:, :, i, j] += V3[:, :, k]
            R[:, i, :, k] += Q3[:, j, :]
    return P, R


def _normal_parts(feats: Features, Vm: np.ndarray, Qm: np.ndarray, Rp: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Gauss-Newton blocks of the data term (1/N) sum_i ||p H_i - y_i||^2 and J^T applied to Rp.

    Returns H_VV, H_QQ, H_VQ (times 2/N) and (2/N) J_V^T vec(Rp), (2/N) J_Q^T vec(Rp) for Rp (d, psi);
    with Rp = p G - M^T these are the gradient. Parameter order: V (h, a, j), Q (h, k, l). The
    block structure (H_VV is block diagonal over outputs a) avoids forming J.
    """
    H, dd = Vm.shape
    d = int(round(np.sqrt(dd)))
    npair = d * (d + 1) // 2
    psi = npair * d
    c = 2.0 / feats.n_samples
    P, R = _structure(Vm, Qm)
    Rf = R.transpose(1, 2, 0, 3).reshape(psi, H * d)  # rows (i, l), cols (h, j')
    GR = (feats.gram @ Rf).reshape(npair, d, H, d)  # [i', l', h, j]
    B = (Rf.T @ GR.reshape(psi, H * d)).reshape(H, d, H, d)
    H_VV = np.einsum("hjgk,ab->hajgbk", B, np.eye(d)).reshape(H * dd, H * dd)
    # X[h,a,k, l,i',m] = sum_i P[h,a,i,k] G4[i,l,i',m], G4 = gram reshaped (npair, d, npair, d)
    X = P.transpose(0, 1, 3, 2).reshape(H * d * d, npair) @ feats.gram.reshape(npair, d * psi)
    X = X.reshape(H, d, d, d, npair, d)
    # H_QQ[h,k,l, g,n,m] = sum_{a,i'} X[h,a,k,l,i',m] P[g,a,i',n]
    XQ = X.transpose(0, 2, 3, 5, 1, 4).reshape(H * d * d * d, d * npair) @ P.transpose(1, 2, 0, 3).reshape(
        d * npair, H * d)
    H_QQ = XQ.reshape(H, d, d, d, H, d).transpose(0, 1, 2, 4, 5, 3).reshape(H * dd, H * dd)
    # H_VQ[h,a,j, g,n,m] = sum_i' GR[i',m,h,j] P[g,a,i',n]
    VQ = GR.transpose(2, 3, 1, 0).reshape(H * d * d, npair) @ P.transpose(2, 0, 1, 3).reshape(npair, H * d * d)
    H_VQ = VQ.reshape(H, d, d, H, d, d).transpose(0, 4, 1, 3, 5, 2).reshape(H * dd, H * dd)
    R4 = Rp.reshape(d, npair, d)
    gV = np.matmul(Rp.reshape(d, psi)[None], R.reshape(H, psi, d)).reshape(-1)
    gQ = (P.transpose(0, 3, 1, 2).reshape(H, d, d * npair) @ R4.reshape(d * npair, d)).reshape(-1)
    return c * H_VV, c * H_QQ, c * H_VQ, c * gV, c * gQ


def _solve_psd(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Minimum-norm solution of a symmetric PSD system (eigh, relative cut-off)."""
    w, v = scipy.linalg.eigh(A)
    cut = A.shape[0] * EPS * max(float(w[-1]), 0.0)
    inv = np.where(w > cut, 1.0 / np.where(w > cut, w, 1.0), 0.0)
    return v @ (inv * (v.T @ b))


def _als_lm(feats: Features, Vm: np.ndarray, Qm: np.ndarray, wd: float, als_sweeps: int,
            max_iter: int, tol: float) -> tuple[np.ndarray, np.ndarray, float, int]:
    """ALS sweeps (exact block solves, normal equations from gram/moments) then Levenberg-Marquardt."""
    H, dd = Vm.shape
    d = int(round(np.sqrt(dd)))
    nblk = H * dd
    Mt = feats.moments.T
    for _ in range(als_sweeps):
        HVV, _, _, bV, _ = _normal_parts(feats, Vm, Qm, Mt)
        Vm = _solve_psd(HVV + wd * np.eye(nblk), bV).reshape(H, dd)
        _, HQQ, _, _, bQ = _normal_parts(feats, Vm, Qm, Mt)
        Qm = _solve_psd(HQQ + wd * np.eye(nblk), bQ).reshape(H, dd)
        Vm, Qm = _balance(Vm, Qm)

    def system(Vm: np.ndarray, Qm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = _p_of(Vm, Qm)
        HVV, HQQ, HVQ, gV, gQ = _normal_parts(feats, Vm, Qm, p @ feats.gram - Mt)
        Hs = np.block([[HVV, HVQ], [HVQ.T, HQQ]]) + wd * np.eye(2 * nblk)
        return Hs, np.concatenate([gV, gQ]) + wd * _pack(Vm, Qm)

    f = _factorised_objective(feats, Vm, Qm, wd)
    mu = 1e-4
    it = 0
    f0 = max(float(np.trace(feats.target_gram)) / feats.n_samples, 1e-300)
    stop = "max_iter"
    res = float("inf")
    for it in range(1, max_iter + 1):
        x = _pack(Vm, Qm)
        Hs, g = system(Vm, Qm)
        scale = float(np.mean(np.diag(Hs))) or 1.0
        accepted = False
        df = 0.0
        for _ in range(25):
            step = _damped_solve(Hs + mu * scale * np.eye(Hs.shape[0]), -g)
            V2, Q2 = _unpack(x + step, H, d)
            f2 = _factorised_objective(feats, V2, Q2, wd)
            if f2 <= f:
                Vm, Qm = _balance(V2, Q2)
                df = f - f2
                f = _factorised_objective(feats, Vm, Qm, wd)
                mu = max(mu / 3, 1e-12)
                accepted = True
                break
            mu *= 4
        # Stop when a step gains less than `tol` relative (statistically irrelevant), or at the
        # float64 resolution of the loss.
        res = df / max(f, f0 * 1e-12)
        if not accepted:
            stop = "no-descent"  # no damped step lowers the loss: a minimum at the loss's resolution
            break
        if res <= tol:
            stop = "tolerance"
            break
    # Near an exact fit the loss itself only resolves ~eps * tr(T) (cancellation), so finish with
    # Gauss-Newton steps accepted on the gradient norm, which has no such floor.
    for _ in range(20):
        x = _pack(Vm, Qm)
        Hs, g = system(Vm, Qm)
        step = _damped_solve(Hs + 1e-12 * (float(np.mean(np.diag(Hs))) or 1.0) * np.eye(Hs.shape[0]), -g)
        V2, Q2 = _unpack(x + step, H, d)
        _, g2 = system(V2, Q2)
        f2 = _factorised_objective(feats, V2, Q2, wd)
        if not (np.linalg.norm(g2) < 0.5 * np.linalg.norm(g) and f2 <= f + 1e-12 * f0):
            break
        Vm, Qm = _balance(V2, Q2)
        f = _factorised_objective(feats, Vm, Qm, wd)
    info = solver_info("ALS + Levenberg-Marquardt (factorised fit)", stop != "max_iter", it, max_iter,
                       res if np.isfinite(res) else 0.0,
                       "relative objective decrease of the last Levenberg-Marquardt step", tol, stop=stop)
    return Vm, Qm, f, it, info


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
    floor = 1e-26 * float(np.trace(feats.target_gram)) / feats.n_samples
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


# --------------------------------------------------------------------------------------------
# 3. nuclear-norm fit
# --------------------------------------------------------------------------------------------


def _lipschitz(G: np.ndarray, d: int, iters: int = 40) -> float:
    """||W -> A^T (A(W) G)||_2 by power iteration, +5 %, capped by the bound 2 lambda_max(G)."""
    bound = 2.0 * float(scipy.linalg.eigh(G, eigvals_only=True, subset_by_index=[G.shape[0] - 1] * 2)[0])
    W = np.random.default_rng(0).standard_normal((d * d, d * d))
    est = 0.0
    for _ in range(iters):
        W2 = p_adjoint(p_from_W(W) @ G)
        n2 = float(np.linalg.norm(W2))
        if n2 == 0:
            return max(bound, 1e-300)
        est = n2 / float(np.linalg.norm(W))
        W = W2 / n2
    return max(min(1.05 * est, bound), 1e-300)


def nuclear_lambda_max(feats: Features) -> float:
    """The smallest LAMBDA for which W = 0 is optimal: ||grad at 0||_2 = (2/N) ||A^T M^T||_2."""
    _need_targets(feats)
    G0 = (2.0 / feats.n_samples) * p_adjoint(feats.moments.T)
    return float(np.linalg.norm(G0, 2))


@_serial_blas
def fit_nuclear(feats: Features, lam: float, max_iter: int = 5000, tol: float = 1e-9,
                W0: np.ndarray | None = None) -> LowRankFit:
    """Minimise (1/N) sum_i ||p(W) H_i - y_i||^2 + lam ||W||_* by FISTA with singular-value thresholding.

    The gradient (2/N) A^T (p G - M^T) is Lipschitz with L = (2/N) ||A^T (. G) A|| <= 4 lambda_max(G) / N
    (||A||^2 = 2); L from a power iteration (+5 %, capped by the bound); step 1/L, momentum with the gradient-based adaptive restart (O'Donoghue & Candes 2015).
    Stops when ||W_{k+1} - W_k|| <= tol ||W_k||.
    """
    _need_targets(feats)
    if lam < 0 or not np.isfinite(lam):
        raise InputError(f"the nuclear-norm weight must be a finite number >= 0, got {lam}")
    d = feats.d
    N = feats.n_samples
    G, Mt = feats.gram, feats.moments.T
    L = _lipschitz(G, d) * 2.0 / N
    W = np.zeros((d * d, d * d)) if W0 is None else np.array(W0, dtype=np.float64)
    Y = W.copy()
    t = 1.0
    converged = False
    it = 0
    res = float("inf")
    for it in range(1, max_iter + 1):
        p = p_from_W(Y)
        grad = (2.0 / N) * p_adjoint(p @ G - Mt)
        W_new, _ = svt(Y - grad / L, lam / L)
        t_new = 0.5 * (1 + np.sqrt(1 + 4 * t * t))
        step = W_new - W
        if float(np.sum((Y - W_new) * step)) > 0:  # momentum points uphill: restart
            t_new = 1.0
            Y = W_new.copy()
        else:
            Y = W_new + ((t - 1) / t_new) * step
        nstep = float(np.linalg.norm(step))
        W, t = W_new, t_new
        res = nstep / max(float(np.linalg.norm(W)), 1e-300)
        if res <= tol:
            converged = True
            break
    coef = p_from_W(W)
    s = np.linalg.svd(W, compute_uv=False)
    obj = sse(feats, coef) / N + lam * float(s.sum())
    info = {"method": "nuclear", "nuclear_lambda": float(lam), "objective": obj, "train_mse": mse(feats, coef),
            "iterations": it, "converged": converged, "final_residual": res,
            "solver": solver_info("FISTA (nuclear-norm fit)", converged, it, max_iter, res,
                                  "||W_k+1 - W_k|| / ||W_k+1|| (last proximal-gradient step)", tol),
            "rank": int((s > d * d * EPS * max(s[0], 0)).sum()), "singular_values": s.tolist()}
    return LowRankFit(coef=coef, W=W, info=info)


# --------------------------------------------------------------------------------------------
# 4. choosing H or LAMBDA by K-fold cross-validation on per-fold statistics
# --------------------------------------------------------------------------------------------


def _pick(scores: list[tuple[float, float, float]], prefer_last: bool, floor: float = 0.0) -> int:
    """One-standard-error rule over (param, mean, se): the simplest model within 1 SE of the best.

    Means below `floor` (rounding level of an exact fit) count as equal.
    """
    means = np.maximum(np.array([s[1] for s in scores]), floor)
    best = int(np.nanargmin(means))
    bound = means[best] + scores[best][2]
    ok = [i for i, m in enumerate(means) if m <= bound]
    return max(ok) if prefer_last else min(ok)


def _cv_floor(total: Features) -> float:
    """Validation MSE indistinguishable from 0: 1e-14 of the mean target energy per output."""
    return 1e-14 * float(np.trace(total.target_gram)) / (total.n_samples * total.d)


def _cv_table(params: list[float], errs: np.ndarray) -> list[tuple[float, float, float]]:
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
        m = max(float(np.mean(errs)), _cv_floor(total))
        if m < best * (1 - 1e-9):
            best, worse = m, 0
        else:
            worse += 1
            if worse >= 2:
                break
    table = _cv_table(used, np.array(rows))
    i = _pick(table, prefer_last=False, floor=_cv_floor(total))
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
    i = _pick(table, prefer_last=True, floor=_cv_floor(total))
    return {"chosen": float(grid[i]), "lambda_max": lmax,
            "table": [{"lambda": p, "cv_mse": m, "se": s} for p, m, s in table],
            "fits": len(grid) * len(folds), "unconverged_fits": int(unconverged)}


def _minus(total: Features, part: Features) -> Features:
    """Statistics of the samples in `total` but not in `part`."""
    return total - part


# --------------------------------------------------------------------------------------------
# the fit entry point used by `mhla fit --heads / --nuclear`
# --------------------------------------------------------------------------------------------


def fit_model(feats: Features, heads: int | str | None = None, nuclear: float | str | None = None,
              weight_decay: float = 0.0, restarts: int = 10, seed: int = 0,
              folds: list[Features] | None = None) -> Any:
    """A factorised (`heads`) or nuclear-norm (`nuclear`) fit as a solve.Model; 'auto' picks by K-fold CV.

    The Model's W is the low-rank W found (rank <= H for the factorised fit), so export-heads
    recovers the heads; info carries the base least-squares diagnostics plus the fit's own.
    """
    _need_targets(feats)
    if (heads is None) == (nuclear is None):
        raise InputError("give exactly one of heads and nuclear")
    if "auto" in (heads, nuclear) and not folds:
        raise InputError("'auto' needs per-fold statistics: pass folds, the statistics of K disjoint parts "
                         "of the data (mhla_cli.folds)")
    base = fit(feats)
    info = dict(base.info)
    cv = None
    if heads is not None:
        if heads == "auto":
            cv = cv_heads(feats, folds, weight_decay=weight_decay, restarts=min(restarts, 2), seed=seed)
            heads = cv["chosen"]
        res = fit_factorised(feats, int(heads), weight_decay=weight_decay, restarts=restarts, seed=seed,
                             init_coef=base.coef)
    else:
        if nuclear == "auto":
            cv = cv_nuclear(feats, folds)
            nuclear = cv["chosen"]
        res = fit_nuclear(feats, float(nuclear))
        res.info["n_heads"] = res.info["rank"]
    info.update(res.info)
    info["ridge"] = 0.0
    info["mse_resolution"] = base.info.get("mse_resolution")
    info["lstsq_train_mse"] = base.info["train_mse"]
    if cv is not None:
        info["cv"] = cv
        info["n_folds"] = len(folds)
    return Model(coef=res.coef, W=res.W, d=feats.d, info=info)


def generic_rank(d: int) -> int:
    """Smallest r with r (2 d^2 - r) >= d psi: a generic p needs at least this many heads."""
    n = d * d
    need = d * n_features(d)
    for r in range(1, n + 1):
        if r * (2 * n - r) >= need:
            return r
    return n
