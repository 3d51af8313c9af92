"""Fewest heads: the fewest heads computing a given p, a proven lower bound, and the verdict wording."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import InputError
from ...feature_map import n_features, pair_index
from ...model.canonical import CanonicalFunction, canonical_function
from ...model.heads import Heads, W_from_p, heads_from_W, p_from_W
from ...numerics import FEWEST_TOL
from ...statistics.basis import feature_scale
from ._gauss_newton import _damped_solve, _normal_parts
from mhla_cli.numerics import EPS
from ._numerics import _serial_blas
from ._params import _balance, _heads_from_svd, _p_of, _pack, _unpack
from ._solver import solver_info
from .affine import _check_coef, min_nuclear_W


@dataclass
class _Metric:
    """A stand-in for Features in _normal_parts: the quadratic form (2/N) G of the residual."""

    gram: np.ndarray
    n_samples: int
    weight: float  # sum w, the normaliser of the loss (Features.weight)


def polish_heads(coef: np.ndarray, Vm: np.ndarray, Qm: np.ndarray, tol: float = 1e-13,
                 max_iter: int = 200, stall_window: int = 40, stall_factor: float = 0.5,
                 return_info: bool = False, metric: np.ndarray | None = None) -> tuple[Any, ...]:
    """Levenberg-Marquardt on p(V, Q) = coef; returns V, Q (H, d^2) and ||p - coef||_G / ||coef||_G.

    ||x||_G^2 = sum_a x_a G x_a^T with `metric` G (psi, psi), by default D^-2 (the orthonormal pair
    coordinates p_b = x / D, whose Frobenius norm an orthogonal change of the tokens keeps; statistics.basis).
    CanonicalFunction.metric gives the data's Lambda~ there. Stops when the relative error is <= tol
    (converged), when the cost fell by less than a factor `stall_factor` over the last `stall_window`
    accepted steps (a plateau: a local minimum or too few heads), when no damped step decreases the
    cost, or at max_iter. With return_info=True also returns the `solver_info` record (stop reason in
    info["stop"], final_residual = the relative error).
    """
    d = coef.shape[0]
    G = np.diag(1.0 / feature_scale(d) ** 2) if metric is None else np.asarray(metric, dtype=np.float64)

    def cost_of(r: np.ndarray) -> float:
        return max(float(np.sum((r @ G) * r)), 0.0)

    norm = float(np.sqrt(cost_of(coef))) or 1.0
    target = coef / norm
    Vm, Qm = _balance(Vm / np.sqrt(norm), Qm / np.sqrt(norm))
    r = _p_of(Vm, Qm) - target
    cost = cost_of(r)
    mu = 1e-3
    history = [cost]
    lm = _Metric(gram=G, n_samples=2, weight=2.0)  # (2/N) G = G
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
        step = _lm_step(lm, Vm, Qm, r, cost, mu, target, cost_of)
        if step is None:
            stop = "no-descent"
            break
        Vm, Qm, r, cost, mu = step
        history.append(cost)
    else:
        it = max_iter
        if np.sqrt(cost) <= tol:
            stop = "tolerance"
    s = np.sqrt(norm)
    err = float(np.sqrt(cost))
    if not return_info:
        return Vm * s, Qm * s, err
    info = solver_info("Levenberg-Marquardt (heads)", stop == "tolerance", it, max_iter, err,
                       "||p(V, Q) - p||_G / ||p||_G", tol, stop=stop)
    return Vm * s, Qm * s, err, info


def _lm_step(metric: _Metric, Vm: np.ndarray, Qm: np.ndarray, r: np.ndarray, cost: float, mu: float,
             target: np.ndarray, cost_of: Callable[[np.ndarray], float]
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float] | None:
    """One accepted Levenberg-Marquardt step of `polish_heads` from (Vm, Qm) with residual r (d, psi) and damping
    mu: the balanced new factors, their residual and cost and the next damping; None when no damping of up to
    30 tries decreases the cost."""
    H, d = Vm.shape[0], r.shape[0]
    # J^T G J and J^T G r from the structured blocks (no dense J).
    HVV, HQQ, HVQ, gV, gQ = _normal_parts(metric, Vm, Qm, r @ metric.gram)
    JtJ = np.block([[HVV, HVQ], [HVQ.T, HQQ]])
    g = np.concatenate([gV, gQ])
    scale = float(np.mean(np.diag(JtJ))) or 1.0
    for _ in range(30):
        A = JtJ + (mu * scale) * np.eye(JtJ.shape[0])
        try:
            step = _damped_solve(A, -g)
        except (np.linalg.LinAlgError, ValueError):
            mu *= 10
            continue
        V2, Q2 = _unpack(_pack(Vm, Qm) + step, H, d)
        r2 = _p_of(V2, Q2) - target
        c2 = cost_of(r2)
        if c2 < cost:
            V2, Q2 = _balance(V2, Q2)
            return V2, Q2, r2, c2, max(mu / 3, 1e-12)
        mu *= 4
    return None


def _rel_err(coef: np.ndarray, Vm: np.ndarray, Qm: np.ndarray) -> float:
    n = float(np.linalg.norm(coef))
    return float(np.linalg.norm(_p_of(Vm, Qm) - coef)) / n if n > 0 else 0.0


def head_lower_bound(coef: np.ndarray, tol: float = FEWEST_TOL, n_directions: int = 4, seed: int = 0,
                     radius: float | None = None) -> dict[str, Any]:
    """A proven lower bound on the heads of any MHLA whose coefficients are within `radius` of coef.

    With p_b = coef / D (the orthonormal pair coordinates, mhla_cli.statistics.basis.feature_scale) the
    distance is ||p_b' - p_b||_F; `radius` defaults to tol ||p_b||_F (CanonicalFunction.radius gives the
    radius of a function change <= tol on the data). For x in R^d, B(x)[a, l] = sum_{j<=k} x_j x_k
    p[a,(j,k,l)] = sum_{j,k} x_j x_k W[a*d+j, k*d+l] is the same for every W with that p (the kernel of A
    is antisymmetric in (j, k)), and an H-head W gives B(x) = sum_h (V_h x)(Q_h^T x)^T of rank <= H. For
    unit x, B(x) = sum_i u_i D_i p_b[a, i, l] with ||u D|| = ||x||^2 = 1, so ||B(x) - B'(x)||_2 <=
    ||p_b - p_b'||_F, and by Weyl's inequality every p' within the radius needs
    >= #{i : s_i(B(x)) > radius} heads. x runs over the coordinate vectors (B_j[a, l] = p[a,(j,j,l)]) and
    `n_directions` seeded random unit vectors; the bound is the largest of these ranks (>= 1 when p != 0;
    1 for an infinite radius).
    """
    coef, d = _check_coef(coef)
    norm = float(np.linalg.norm(coef / feature_scale(d)[None, :]))
    # The SVD itself is accurate to ~ d eps ||B||; the radius dominates for tol >> eps.
    thr = max(tol * norm if radius is None else float(radius), 10 * d * EPS * norm)
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
def fewest_heads(fn: np.ndarray | Any, tol: float = FEWEST_TOL, W: np.ndarray | None = None,
                 linear_upto: int = 6, n_starts: int = 16, seed: int = 0, max_iter: int = 500,
                 bisection_starts: int = 2) -> Heads:
    """The fewest heads found whose function matches fn's to `tol` (verified before returning).

    fn: a Model, Heads, coef or CanonicalFunction (mhla_cli.model.canonical). The search runs in the
    canonical coordinates of the model's data (the tokens' own for the others), and a head count is
    accepted when the function changes by at most `tol`: the RMS output change on the training data over
    the RMS output when the model keeps its data's Lambda~, else the coefficient change
    (CanonicalFunction.change). The heads are returned in the tokens' coordinates; a given `W` is in the
    search's. Lower bound L (`head_lower_bound` with CanonicalFunction.radius): no model within tol of fn
    has fewer heads. For H = L, L + 1,
    ... up to max(linear_upto, L) one by one, up to 2 + n_starts starts are polished by
    Levenberg-Marquardt: the top-H SVD of the min-nuclear-norm W, of the min-norm W, then n_starts
    top-H SVDs of random points of {W : p(W) = coef} (seeded by seed and H); the first start within
    tol is accepted (polished in the metric of the change: Lambda~ of the data, else the coefficients p_b).
    Beyond that, bisection up to the rank of the min-nuclear-norm W (an exact H-head
    fit extends to H + 1 heads; generic_rank(d) is tried first) with 2 + bisection_starts
    starts per H (each start costs O((H d^2)^3) per step there). `info`: n_heads, lower_bound,
    proven_minimal (n_heads == lower_bound), starts_tried / starts_per_head_count / best_error per H
    tried, function_change / coef_change / coordinates (CanonicalFunction.record), singular_values (of the
    min-nuclear-norm W in the search's coordinates), solver (the min-nuclear W's record).
    """
    cf = fn if isinstance(fn, CanonicalFunction) else canonical_function(fn)
    coef, d = _check_coef(cf.coef)
    if not 0 < tol < 1:
        raise InputError(f"tolerance must be in (0, 1), got {tol}")
    if n_starts < 0:
        raise InputError(f"n_starts must be >= 0, got {n_starts}")
    if float(np.linalg.norm(coef)) == 0:
        heads = Heads(V=np.zeros((1, d, d)), Q=np.zeros((1, d, d)))
        heads.info = {"n_heads": 1, **cf.record(coef), "singular_values": [0.0], "tol": tol, "lower_bound": 1,
                      "proven_minimal": True, "starts_tried": {}, "best_error": {}}
        return heads
    if W is None:
        Wn, nuc_info = min_nuclear_W(coef, return_info=True)
    else:
        Wn, nuc_info = np.asarray(W, dtype=np.float64) / cf.scale, None
    s = np.linalg.svd(Wn, compute_uv=False)
    # The SVD of the (feasible) min-nuclear W with all its nonzero values is an exact fallback.
    r_max = max(1, int((s > 1e-10 * s[0]).sum()))
    bound = head_lower_bound(coef, tol=tol, seed=seed, radius=cf.radius(tol))
    L = min(bound["lower_bound"], r_max)
    search = _HeadSearch(coef, Wn, W_from_p(coef), tol, seed, n_starts, max_iter, cf.change, cf.metric)
    top = min(max(linear_upto, L), r_max)
    best_H = next((H for H in range(L, top + 1) if search.attempt(H)[2] <= tol), None)
    if best_H is None:
        best_H = search.bisect(top, r_max, bisection_starts)
    Vm, Qm, err = search.tried[best_H]
    err = cf.change(_p_of(Vm, Qm))  # re-verify on the final arrays
    if err > tol:
        raise RuntimeError(f"fewest_heads: no factorisation within {tol:g} (best {err:.3g})")
    heads = cf.heads(Vm, Qm)
    proven = heads.n_heads <= bound["lower_bound"]
    heads.info = {"n_heads": heads.n_heads, **cf.record(_p_of(Vm, Qm)), "tol": tol,
                  "lower_bound": bound["lower_bound"], "proven_minimal": bool(proven),
                  "lower_bound_info": bound, **search.record(), "seed": seed,
                  "singular_values": (s * cf.scale).tolist(), "nuclear_rank": r_max, "solver": nuc_info}
    return heads


class _HeadSearch:
    """The starts `fewest_heads` polishes for each head count H, and the best of each H tried."""

    def __init__(self, coef: np.ndarray, Wn: np.ndarray, W_mn: np.ndarray, tol: float, seed: int, n_starts: int,
                 max_iter: int, change: Callable[[np.ndarray], float], metric: np.ndarray | None = None) -> None:
        self.coef, self.Wn, self.W_mn = coef, Wn, W_mn
        self.tol, self.seed, self.n_starts, self.max_iter = tol, seed, n_starts, max_iter
        # the measure a count is accepted on (CanonicalFunction.change) and the metric the starts are polished
        # in (its Lambda~, CanonicalFunction.metric; None: the coefficients p_b)
        self.change, self.metric = change, metric
        self.tried: dict[int, tuple[np.ndarray, np.ndarray, float]] = {}  # H -> (V, Q, relative error)
        self.n_tried: dict[int, int] = {}
        self.budget: dict[int, int] = {}

    def _start(self, H: int, i: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Start i: the top-H SVD of the min-nuclear-norm W, of the min-norm W, then random feasible points."""
        if i == 0:
            return _heads_from_svd(self.Wn, H)
        if i == 1:
            return _heads_from_svd(self.W_mn, H)
        return _random_start(self.coef, self.W_mn, H, rng, _START_SCALES[(i - 2) % len(_START_SCALES)])

    def attempt(self, H: int, k: int | None = None) -> tuple[np.ndarray, np.ndarray, float]:
        """The best of up to 2 + k (default n_starts) polished starts with H heads; the first within tol ends."""
        if H in self.tried:
            return self.tried[H]
        k = self.n_starts if k is None else k
        rng = np.random.default_rng([self.seed, H])
        best: tuple[np.ndarray, np.ndarray, float] | None = None
        n = 0
        for i in range(2 + k):
            V0, Q0 = self._start(H, i, rng)
            n += 1
            err0 = self.change(_p_of(V0, Q0))
            cand = (V0, Q0, err0)
            if err0 > self.tol * 1e-2:
                V1, Q1, _ = polish_heads(self.coef, V0, Q0, max_iter=self.max_iter, metric=self.metric)
                err1 = self.change(_p_of(V1, Q1))
                if err1 < err0:
                    cand = (V1, Q1, err1)
            if best is None or cand[2] < best[2]:
                best = cand
            if best[2] <= self.tol:
                break
        assert best is not None
        self.tried[H], self.n_tried[H], self.budget[H] = best, n, 2 + k
        return best

    def bisect(self, lo: int, hi: int, starts: int) -> int:
        """The smallest H in (lo, hi] found within tol (lo fails, or equals hi), by bisection with 2 + starts
        starts per H; the exact min-norm SVD (at most d^2 heads) when even hi fails."""
        tol = self.tol
        # A generic p (e.g. a noisy fit) is typically reachable with generic_rank(d) heads: try it first.
        r_gen = generic_rank(self.coef.shape[0])
        if lo < r_gen < hi and self.attempt(r_gen, starts)[2] <= tol:
            hi = r_gen
        elif self.attempt(hi, starts)[2] > tol:
            # Fallback: the min-norm SVD has at most d^2 heads and is exact.
            hd, _ = heads_from_W(self.W_mn, tol=0.0)
            V0, Q0 = hd.V.reshape(hd.n_heads, -1), hd.Q.reshape(hd.n_heads, -1)
            hi = hd.n_heads
            self.tried[hi] = (V0, Q0, self.change(_p_of(V0, Q0)))
            self.n_tried[hi] = self.n_tried.get(hi, 0) + 1
            self.budget[hi] = self.budget.get(hi, 0) + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.attempt(mid, starts)[2] <= tol:
                hi = mid
            else:
                lo = mid
        return hi

    def record(self) -> dict[str, dict[int, Any]]:
        """starts_tried, best_error and starts_per_head_count for each H tried (fewest_heads' info)."""
        return {"starts_tried": {int(h): self.n_tried[h] for h in sorted(self.n_tried)},
                "best_error": {int(h): float(self.tried[h][2]) for h in sorted(self.tried)},
                "starts_per_head_count": {int(h): self.budget[h] for h in sorted(self.budget)}}


def fewest_message(info: dict[str, Any]) -> str:
    """The verdict wording of --fewest: "proven minimal" only when the lower bound is met."""
    if info.get("proven_minimal"):
        return f"{info['n_heads']} heads, proven minimal (lower bound {info['lower_bound']})"
    per = info.get("starts_per_head_count") or {}
    counts = sorted({v for h, v in per.items() if int(h) < info["n_heads"]}, reverse=True)
    text = "/".join(str(c) for c in counts) or "0"
    return (f"{info['n_heads']} heads: fewest found ({text} starts per head count tried; "
            f"lower bound {info['lower_bound']})")


def generic_rank(d: int) -> int:
    """Smallest r with r (2 d^2 - r) >= d psi: a generic p needs at least this many heads."""
    n = d * d
    need = d * n_features(d)
    for r in range(1, n + 1):
        if r * (2 * n - r) >= need:
            return r
    return n
