"""A layer as a sum of MHLA blocks, each on its own token directions: the joint statistics, certificate and least
squares (docs/blocks.md).

Block b reads the wide tokens x (D-dim) through its own map P_b (D x d_b): it is an MHLA of x~_b = P_b^T x,

    yhat_t = sum_b sum_h V_bh S~_b Q_bh x~_bt,   S~_b = P_b^T S P_b,

linear in the concatenated features [phi(X P_1), ..., phi(X P_B)] (and, with `affine`, the wide token's (x, 1)):
least squares, the ridge and the certificate are those of one Gram of m = sum_b psi_b (+ the affine block's k)
features. Its cost is that of one MHLA of m features: m^2 per sample in the pass, m^3 in the solve.

Coordinates. Block b's features are those of its whitened tokens Z_b = X P_b A_b (A_b the whitening of
P_b^T G P_b, G = sum_i w_i S_i / sum_i w_i n_i the metric of the canonical coordinates:
mhla_cli.statistics.basis) in orthonormal pair coordinates; the affine block is
(x, 1) whitened by its second moment over the queries (on its range: tokens on a hyperplane, such as a layer norm's
output, leave that direction out, as mhla_cli.solve.affine_block does). An invertible map of a block's reduced
tokens changes its features orthogonally, so the spectrum of Lambda~ = sum w phi phi^T / sum w, the verdict and
the fitted function do not depend on the units of any block.

The verdict is proven as the MHLA's: a Cholesky of Lambda~ - t I (mhla_cli.linalg.factorization). Blocks whose
token directions overlap share the functions of the common directions: which block holds them is then not
determined, the Cholesky fails and the reasons say so; the fit is the minimum-norm one (the sum is still the
least-squares function).

Two streaming passes over a tokens file: the tokens' second moments (the A_b and the affine block's whitening),
then the joint sums, per contiguous fold when the ridge is to be chosen by cross-validation.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError
from ..io.tokens import TokensInfo, check_finite, check_weights, inspect_tokens, iter_chunks, read_as
from ..linalg.factorization import Factorization
from ..linalg.memory import SLACK_BYTES, available_memory
from ..model.heads_sum import HeadsSum
from ..model.heads import Heads, W_from_p, heads_from_W
from ..numerics import affine_hull_tol, lambda_min_of_verdict, numerical_tolerance
from ..samples import ReadSpec, Samples
from ..statistics import basis as basis_mod
from .certificate import Certificate
from .lstsq import solve_system
from .ridge_cv import CV_FLOOR, ridge_grid

__all__ = ["BlockStatistics", "block_statistics", "certify_blocks", "fit_blocks", "MAP_COND_MAX", "OVERLAP_TOL"]

# A token map whose columns are this close to dependent (the ratio of its extreme singular values, after scaling
# the columns to unit norm) is refused: its block would have the same features twice.
MAP_COND_MAX = 1e8
# Two blocks overlap when the smallest singular value of [Q_1, ..., Q_B] (orthonormal bases of the maps' spans) is
# below this: a common direction (the sum of their spans is not direct), reported with a failed verdict.
OVERLAP_TOL = 1e-6
# Chunks: about this many bytes of feature rows (R x m float64) at a time.
ROWS_BYTES = 64 * 2**20
# The statistics' m x m matrices held at once besides the folds' (the total, the factorization's copies).
GRAM_COPIES = 3


@dataclass
class BlockStatistics:
    """The joint sums of a sum of blocks (module docstring), in the blocks' canonical coordinates.

    `maps` P_b (D, d_b) as given; `bases` A_b (d_b, d_b) (the block's features are of X P_b A_b); `affine_map`
    A_f (D + 1, k) of the affine block (None without it). `gram` (m, m), `moments` (m, D_out), `target_gram`
    (D_out, D_out): sums of w phi phi^T, w phi y^T and w y y^T over the samples; `weight` sum w. `folds`: the same
    sums of each contiguous fold of sequences (their sum is the total), for the ridge by cross-validation."""

    maps: list[np.ndarray]
    bases: list[np.ndarray]
    affine_map: np.ndarray | None
    gram: np.ndarray
    moments: np.ndarray
    target_gram: np.ndarray
    weight: float
    n_samples: int
    n_tokens: int
    layout: Samples
    normalize: str
    folds: list[tuple[np.ndarray, np.ndarray, np.ndarray, float, int]] = field(default_factory=list)
    source: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def sizes(self) -> list[int]:
        """The features of each block (psi_b = d_b^2 (d_b + 1) / 2), then the affine block's k when present."""
        out = [int(P.shape[1]) ** 2 * (int(P.shape[1]) + 1) // 2 for P in self.maps]
        return out + ([int(self.affine_map.shape[1])] if self.affine_map is not None else [])

    @property
    def n_features(self) -> int:
        return int(self.gram.shape[0])

    @property
    def width(self) -> int:
        """D, the wide tokens' dimension."""
        return int(self.maps[0].shape[0])


def _check_maps(maps: Sequence[Any], D: int, path: str | os.PathLike) -> list[np.ndarray]:
    """The token maps as float64 (D, d_b) arrays of independent columns, or an InputError."""
    if len(maps) < 1:
        raise InputError("a sum of blocks needs at least one token map", path)
    out = []
    for b, P in enumerate(maps):
        P = np.asarray(P, dtype=np.float64)
        if P.ndim != 2 or P.shape[0] != D or not 1 <= P.shape[1] <= D:
            raise InputError(f"token map {b} has shape {P.shape}, expected ({D}, d_b) with 1 <= d_b <= {D} "
                             "(the tokens' width by the block's)", path)
        if not np.isfinite(P).all():
            raise InputError(f"token map {b} contains NaN or Inf", path)
        norms = np.linalg.norm(P, axis=0)
        s = np.linalg.svd(P / np.where(norms > 0, norms, 1.0), compute_uv=False) if norms.all() else np.zeros(1)
        if s[-1] <= 0 or s[0] / s[-1] > MAP_COND_MAX:
            raise InputError(f"token map {b} has dependent columns (condition number above {MAP_COND_MAX:.0e}): "
                             "the block would hold the same features twice", path)
        out.append(P)
    return out


def overlap(maps: Sequence[np.ndarray]) -> float:
    """The smallest singular value of the orthonormal bases of the maps' spans side by side: 0 when the blocks
    share a token direction (the sum of their spans is not direct), 1 when their spans are orthogonal."""
    Q = np.hstack([np.linalg.qr(P)[0] for P in maps])
    if Q.shape[1] > Q.shape[0]:
        return 0.0
    return float(np.linalg.svd(Q, compute_uv=False)[-1])


def _chunk(info: TokensInfo, m: int, chunk_size: int | None) -> int:
    if chunk_size:
        return int(chunk_size)
    per_seq = max(1.0, info.n_tokens / max(1, info.n_samples))
    return max(1, int(ROWS_BYTES // (8 * per_seq * max(m, info.d, info.out_dim))))


def _token_pass(info: TokensInfo, size: int, affine: bool) -> tuple[np.ndarray, np.ndarray | None, float]:
    """(sum_i w_i S_i over the samples = sum_tokens c x x^T, the second moment sum w f f^T / sum w of f = (x, 1)
    over the queries or None, sum_i w_i n_i): the metric of the canonical coordinates (G / sum w n, as
    mhla_cli.statistics.basis takes it) and the affine block's second moment."""
    D = info.d
    Gx = np.zeros((D, D))
    Gf = np.zeros((D + 1, D + 1)) if affine else None
    total, query_weight = 0.0, 0.0
    for a, _, tokens, offsets, targets, weights in iter_chunks(info, (0, info.n_samples), size, with_weights=True):
        check_finite(tokens, offsets, targets, a, info.path)
        check_weights(weights, offsets, a, info.per_position, info.path)
        X = np.asarray(tokens, dtype=np.float64)
        c, rows, w = info.samples.token_weights(np.asarray(offsets), weights)
        Gx += (X if c is None else X * c[:, None]).T @ X
        total += float(X.shape[0] if c is None else c.sum())
        if Gf is not None:
            Xq = X if rows is None else X[rows]
            F = np.hstack([Xq, np.ones((Xq.shape[0], 1))])
            Gf += (F if w is None else F * w[:, None]).T @ F
            query_weight += float(F.shape[0] if w is None else w.sum())
    return Gx, None if Gf is None else Gf / (query_weight if query_weight > 0 else 1.0), total


def _affine_whitening(Gf: np.ndarray, n_samples: int) -> np.ndarray:
    """A_f (D + 1, k): whitens (x, 1) by its second moment Gf (sum w f f^T / sum w, so that the block's part of
    Lambda~ is I, as every block's is near I) on its range (directions below affine_hull_tol of the
    largest eigenvalue are the hyperplanes the tokens lie on, left out)."""
    w, V = np.linalg.eigh(0.5 * (Gf + Gf.T))
    top = float(w[-1])
    if not np.isfinite(top) or top <= 0:
        raise InputError("the tokens are all zero: the affine block has no features")
    keep = w > affine_hull_tol(Gf.shape[0], n_samples) * top
    scaled: np.ndarray = V[:, keep] / np.sqrt(w[keep])
    return scaled


def sample_features(X: np.ndarray, offsets: np.ndarray, maps: Sequence[np.ndarray], layout: Samples,
                    normalize: str, affine_map: np.ndarray | None = None) -> np.ndarray:
    """(R, m): every sample's concatenated features of a chunk (tokens X (t, D), offsets from 0): block b's of the
    tokens X maps[b] in orthonormal pair coordinates, then the affine block's (x, 1) affine_map of the queries."""
    parts = []
    for M in maps:
        q = layout.queries(X @ M, offsets, normalize)
        upper = q.sample_upper() * basis_mod.pair_scale(M.shape[1])
        parts.append((upper[:, :, None] * q.x[:, None, :]).reshape(upper.shape[0], -1))
    if affine_map is not None:
        rows = layout.queries(X, offsets, normalize).x
        parts.append(np.hstack([rows, np.ones((rows.shape[0], 1))]) @ affine_map)
    return np.hstack(parts)


def _fold_ranges(n: int, folds: int, path: str | os.PathLike) -> list[tuple[int, int]]:
    if folds == 0:
        return [(0, n)]
    if folds < 2 or folds > n:
        raise InputError(f"folds must be 0 (none) or 2 to the {n} sequences, got {folds}", path)
    edges = np.linspace(0, n, folds + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def _check_memory(m: int, D_out: int, folds: int, path: str | os.PathLike) -> None:
    need = (GRAM_COPIES + folds) * (8 * m * (m + D_out)) + ROWS_BYTES + SLACK_BYTES
    have = available_memory()
    if need > have:
        raise InputError(f"the blocks have m = {m} features together: their Gram{'s' if folds else ''} need about "
                         f"{need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB available; use fewer or "
                         "smaller blocks, fewer folds, or fit the blocks one by one on their own targets", path)


def block_statistics(data: str | os.PathLike, maps: Sequence[Any], read: ReadSpec | None = None,
                     affine: bool = False, folds: int = 0, chunk_size: int | None = None,
                     progress: Callable[[int], None] | None = None) -> BlockStatistics:
    """The joint sums of the blocks with token maps `maps` (each (D, d_b)) over a tokens file of D-dim tokens with
    targets of any width (module docstring). `read`: the layout and the normalisation (mhla_cli.samples.ReadSpec;
    the bias terms are not supported: add the affine block). `affine`: the affine block of (x, 1) beside the
    blocks. `folds` (0 or >= 2): also the sums of that many contiguous folds of sequences (for ridge="auto").
    `progress(k)`: called with the sequences of each chunk read (both passes)."""
    read = ReadSpec() if read is None else read
    if read.bias_terms:
        raise InputError("a sum of blocks has no bias terms: add the affine block of the wide token instead", data)
    info = inspect_tokens(data)
    info = read_as(info, read.layout) if read.layout is not None else info
    if not info.has_targets:
        raise InputError("the data have no 'targets': a sum of blocks is fitted to (X, y) pairs", data)
    P = _check_maps(maps, info.d, data)
    fold_ranges = _fold_ranges(info.n_samples, int(folds), data)
    sizes = [p.shape[1] ** 2 * (p.shape[1] + 1) // 2 for p in P]
    m = sum(sizes) + (info.d + 1 if affine else 0)
    _check_memory(m, info.out_dim, int(folds), data)
    t0 = time.perf_counter()
    size = _chunk(info, m, chunk_size)
    Gx, Gf, token_weight = _token_pass(info, size, affine)
    if progress is not None:
        progress(info.n_samples)
    bases = [basis_mod.whitening(p.T @ Gx @ p, token_weight, round32=False) for p in P]
    Af = None if Gf is None else _affine_whitening(Gf, info.n_tokens)
    m = sum(sizes) + (0 if Af is None else Af.shape[1])
    t1 = time.perf_counter()
    whitened = [p @ A for p, A in zip(P, bases)]
    normalize = read.normalize or "none"
    sums = [_fold_sums(info, lo, hi, size, whitened, normalize, Af, m, progress) for lo, hi in fold_ranges]
    G, M, YY = (a.copy() for a in sums[0][:3]) if folds else sums[0][:3]  # the total, added in place (no stack)
    for s in sums[1:]:
        G += s[0]
        M += s[1]
        YY += s[2]
    return BlockStatistics(
        maps=P, bases=bases, affine_map=Af, gram=G, moments=M, target_gram=YY,
        weight=float(sum(s[3] for s in sums)), n_samples=int(sum(s[4] for s in sums)), n_tokens=int(info.n_tokens),
        layout=info.samples, normalize=normalize, folds=sums if folds else [], source=str(data),
        seconds={"moments": t1 - t0, "sums": time.perf_counter() - t1})


def _fold_sums(info: TokensInfo, lo: int, hi: int, size: int, maps: list[np.ndarray], normalize: str,
               Af: np.ndarray | None, m: int, progress: Callable[[int], None] | None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, int]:
    """(sum w phi phi^T, sum w phi y^T, sum w y y^T, sum w, samples of weight > 0) over sequences [lo, hi)."""
    e = info.out_dim
    G, M, YY = np.zeros((m, m)), np.zeros((m, e)), np.zeros((e, e))
    W, n = 0.0, 0
    for a, b, tokens, offsets, targets, weights in iter_chunks(info, (lo, hi), size, with_weights=True):
        check_finite(tokens, offsets, targets, a, info.path)
        check_weights(weights, offsets, a, info.per_position, info.path)
        F = sample_features(np.asarray(tokens, dtype=np.float64), np.asarray(offsets), maps, info.samples,
                            normalize, Af)
        Y = np.asarray(targets, dtype=np.float64)
        w = np.ones(F.shape[0]) if weights is None else np.asarray(weights, dtype=np.float64)
        keep = w > 0
        F, Y, w = F[keep], Y[keep], w[keep]
        Fw = F * w[:, None]
        G += Fw.T @ F
        M += Fw.T @ Y
        YY += (Y * w[:, None]).T @ Y
        W += float(w.sum())
        n += int(keep.sum())
        if progress is not None:
            progress(b - a)
    return 0.5 * (G + G.T), M, YY, W, n


def certify_blocks(stats: BlockStatistics, min_eig: float = 0.0) -> Certificate:
    """The certificate of the joint Gram (module docstring): identifiable when a Cholesky of Lambda~ - t I
    succeeds, t the larger of the numerical tolerance and `min_eig`."""
    if min_eig < 0 or not np.isfinite(min_eig):
        raise InputError(f"min_eig must be a finite number >= 0, got {min_eig}")
    W = stats.weight if stats.weight > 0 else 1.0
    fac = Factorization(stats.gram, stats.n_features, 1.0 / W)
    m = stats.n_features
    lmax = fac.lambda_max()
    tol = numerical_tolerance(lmax, m)
    threshold = max(tol, float(min_eig))
    if lmax <= 0:
        proof = "all features are zero"
    elif stats.n_samples < m:
        proof = "N < psi samples"
    else:
        proof = "cholesky of Lambda~ - t I" if fac.proves_above(threshold) else "cholesky of Lambda~ - t I failed"
    identifiable = proof == "cholesky of Lambda~ - t I"
    d = int(stats.width)
    cert = Certificate(identifiable, fac.lambda_min(), lmax, fac.rank(tol), m, stats.n_samples, threshold, tol,
                       float(min_eig), "full", d, d, eigenvalues=fac.known_eigenvalues(), span_features=m,
                       proof=proof).bound_lambda_min()
    if not identifiable:
        cert.reasons = _reasons(stats, cert, fac, threshold)
    cert.seconds = dict(fac.seconds)
    return cert


def _reasons(stats: BlockStatistics, cert: Certificate, fac: Factorization, threshold: float) -> list[str]:
    """Why the joint features do not certify: counts, overlapping blocks, and the blocks the null directions lie
    on."""
    m = cert.n_features
    out = []
    if stats.n_samples < m:
        out.append(f"N = {stats.n_samples} samples < {m} features: at least {m} samples are needed "
                   "(necessary, not sufficient)")
    if len(stats.maps) > 1 and overlap(stats.maps) < OVERLAP_TOL:
        out.append("the blocks' token directions overlap (the sum of their spans is not direct): the functions of "
                   "the common directions belong to several blocks, and which one holds them is not determined")
    if cert.lambda_max > 0:
        _, N = fac.null_space(threshold)
        if N.shape[1]:
            edges = np.cumsum([0, *stats.sizes])
            share = [float(np.sum(N[a:b] ** 2)) / N.shape[1] for a, b in zip(edges[:-1], edges[1:])]
            names = [f"block {b}" for b in range(len(stats.maps))] + (["the affine block"] if stats.affine_map
                                                                      is not None else [])
            where = ", ".join(f"{100 * s:.3g} % on {n}" for n, s in zip(names, share) if s >= 0.0005)
            out.append(f"{N.shape[1]} direction(s) of the joint features are excited less than the threshold "
                       f"{threshold:.3g}: {where}")
    return out


def _solve(G: np.ndarray, M: np.ndarray, W: float, ridge: float) -> tuple[np.ndarray, Factorization, float, bool]:
    """The solution of (Lambda~ + ridge I) sol = M / W (minimum norm where singular), its factorization, the
    numerical tolerance of its eigenvalues and whether Lambda~ is proven positive definite."""
    fac = Factorization(G, G.shape[0], 1.0 / W)
    lmax = fac.lambda_max()
    tol = numerical_tolerance(lmax, G.shape[0])
    pd = lmax > 0 and fac.proves_above(tol)
    return solve_system(fac, M / W, ridge, tol, pd), fac, tol, pd


def cv_ridge_blocks(stats: BlockStatistics) -> dict[str, Any]:
    """The ridge by K-fold cross-validation over the statistics' folds (mhla_cli.solve.ridge_cv's grid and rule:
    the smallest held-out MSE, ties below its floor to the smallest ridge): each fold's held-out SSE along the
    grid from one eigendecomposition of the rest."""
    if len(stats.folds) < 2:
        raise InputError("the ridge by cross-validation needs statistics with folds (block_statistics(folds=K))")
    W = stats.weight if stats.weight > 0 else 1.0
    lmax = float(np.linalg.eigvalsh(stats.gram / W)[-1])
    grid = ridge_grid(lmax)
    errs = np.empty((grid.size, len(stats.folds)))
    e = stats.moments.shape[1]
    for k, (Gv, Mv, YYv, Wv, nv) in enumerate(stats.folds):
        Wt = W - Wv
        if nv < 1 or Wt <= 0:
            raise InputError(f"fold {k} has {nv} samples: every fold needs samples, and so does the rest")
        ev, V = np.linalg.eigh((stats.gram - Gv) / Wt)
        a = V.T @ ((stats.moments - Mv) / Wt)
        Gvv, Mvv = V.T @ Gv @ V, V.T @ Mv
        tol = numerical_tolerance(float(ev[-1]), ev.size)
        for i, r in enumerate(grid):
            inv = np.where(ev + r > tol, 1.0 / np.maximum(ev + r, tol), 0.0) if r == 0 else 1.0 / (ev + r)
            s = a * inv[:, None]
            errs[i, k] = (float(np.sum(s * (Gvv @ s))) - 2 * float(np.sum(s * Mvv)) + float(np.trace(YYv))) / (Wv * e)
    mean = errs.mean(axis=1)
    floor = CV_FLOOR * float(np.trace(stats.target_gram)) / (W * e)
    best = int(np.argmin(np.maximum(mean, floor)))
    return {"chosen": float(grid[best]), "rule": "minimum", "lambda_max": lmax, "cv_mse": float(mean[best]),
            "least_squares_cv_mse": float(mean[0]), "n_folds": len(stats.folds),
            "table": [{"ridge": float(r), "cv_mse": float(v)} for r, v in zip(grid, mean)]}


def fit_blocks(stats: BlockStatistics, ridge: float | str = 0.0) -> HeadsSum:
    """Least squares over the joint features (lstsq.fit's rules: the ridge in the units of Lambda~'s lambda_max,
    the minimum norm where singular; ridge="auto" chooses it by cross-validation over the statistics' folds). The
    result is the sum of blocks: block b's heads of the tokens X P_b A_b (factored heads, in the model's
    coordinates) and the affine map of (x, 1) when the statistics have the affine block."""
    t0 = time.perf_counter()
    cv = None
    if isinstance(ridge, str):
        if ridge != "auto":
            raise InputError(f"ridge must be a number >= 0 or 'auto', got {ridge!r}")
        cv = cv_ridge_blocks(stats)
        ridge = float(cv["chosen"])
    ridge = float(ridge)
    if ridge < 0 or not np.isfinite(ridge):
        raise InputError(f"ridge must be a finite number >= 0, got {ridge}")
    W = stats.weight if stats.weight > 0 else 1.0
    sol, fac, tol, pd = _solve(stats.gram, stats.moments, W, ridge)
    sse = float(np.sum(sol * (stats.gram @ sol))) - 2 * float(np.sum(sol * stats.moments)) + float(
        np.trace(stats.target_gram))
    e = stats.moments.shape[1]
    parts, start = [], 0
    info = {"normalize": stats.normalize, **stats.layout.fit_attrs()}
    for P, A, size in zip(stats.maps, stats.bases, stats.sizes):
        parts.append(_block_heads(sol[start:start + size].T, P @ A, e, info))
        start += size
    affine = {}
    if stats.affine_map is not None:
        Wf = (stats.affine_map @ sol[start:]).T  # y = sol_f^T A_f^T (x, 1)
        affine = {"affine_weight": np.ascontiguousarray(Wf[:, :-1]), "affine_bias": np.ascontiguousarray(Wf[:, -1])}
    identifiable = bool(pd and stats.n_samples >= stats.n_features)
    lmin, bound = lambda_min_of_verdict(fac.lambda_min(), tol, identifiable)
    out_info: dict[str, Any] = {
        **info, "ridge": ridge, "train_mse": max(sse, 0.0) / (W * e), "n_features": stats.n_features,
        "block_features": stats.sizes, "n_samples": stats.n_samples, "n_tokens": stats.n_tokens,
        "identifiable": identifiable, "lambda_min": lmin,
        "lambda_max": fac.lambda_max(), "seconds": {**stats.seconds, "solve": time.perf_counter() - t0},
        "fitted": "jointly"}
    if bound is not None:
        out_info["lambda_min_bound"] = bound
    if cv is not None:
        out_info["cv"] = cv
    return HeadsSum(parts=parts, info=out_info, **affine)


def _block_heads(coef_orth: np.ndarray, P: np.ndarray, e: int, info: dict[str, Any]) -> Heads:
    """Factored heads of one block from its coefficients (e, psi_b) on the orthonormal pair coordinates of the
    tokens X P: the coefficients of the plain features (pair_scale undone), their heads by the SVD of W
    (heads_from_W), and the maps P (D, d_b), U = I (e)."""
    d = P.shape[1]
    coef = coef_orth * basis_mod.feature_scale(d)[None, :]
    heads, _ = heads_from_W(W_from_p(coef))
    return Heads(V=heads.V, Q=heads.Q, info=dict(info), P=np.ascontiguousarray(P), U=np.eye(e))
