"""The canonical token basis: the whitening of all tokens, its estimate, its verification, and its maps.

The certificate's numbers belong to the data, not to the units of the tokens (docs/certificate.md). Tokens are whitened, X -> X A with A^T G A = I and G = token_gram / n_tokens
(the second moment of all the tokens of the data, each counted with the weights of the samples that
contain it: features.Features), and the features of X A are taken in orthonormal coordinates

    Ht(X) = D H(X),   D = 1 on the pairs j = k, sqrt 2 on the pairs j < k   (||Ht|| = ||S||_F ||x_n||),

so that for data X T (T invertible) the whitened tokens are X A M with M orthogonal, and
Ht(X M) = O_M Ht(X) with O_M = kron(D P_M D^-1, M^T) orthogonal: the spectrum of
Lambda~ = (1/N) sum Ht Ht^T, the rank and the verdict do not depend on T.

Maps, with P_A = pair_map(A) (upper(A^T S A) = P_A upper(S)):
    Ht(X A) = M_A H(X),      M_A = kron(D P_A, A^T)          (own upper-triangle features -> canonical)
    Ht(X A C) = O_C Ht(X A), O_C = kron(D P_C D^-1, C^T)     (one canonical basis -> another)
and a function with coefficients p_b on Ht(X A) has p = p_b M_A on H(X).

The features of X A are always formed from the transformed tokens ((X A)^T (X A) per sequence),
never by transforming S: the rounding of S (eps |S|) would be amplified by up to cond(A)^2.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from mhla_cli.feature_map import pair_index

from mhla_cli.numerics import CANONICAL_TOL, EQUILIBRATE_RATIO, UNRESOLVED_REL

# A basis change of the sums by C amplifies their rounding by about cond(C)^6 (the features are
# cubic, the Gram quadratic in them): up to this condition number (4^6 ~ 4e3 -> ~1e-12 relative) the
# sums are changed exactly to the whitening of the data; beyond it a stream pass is redone in the
# whitening of the data (stream.featurize).
CHANGE_COND = 4.0
# CANONICAL_TOL (mhla_cli.numerics): a basis already the whitening of the data is left unchanged.


@lru_cache(maxsize=64)
def pair_scale(d: int) -> np.ndarray:
    """D of the orthonormal coordinates: 1 for the pairs j = k, sqrt 2 for j < k (feature pair order)."""
    j, k = pair_index(d)
    s = np.where(j == k, 1.0, np.sqrt(2.0))
    s.setflags(write=False)
    return s


def feature_scale(d: int) -> np.ndarray:
    """D expanded to the psi features (pair-major, l fastest)."""
    return np.repeat(pair_scale(d), d)


def pair_map(B: np.ndarray) -> np.ndarray:
    """Matrix P with upper(B^T S B) = P upper(S) for symmetric S, in feature pair order.

    B (d, r) need not be square. For square B, pair_map(A @ B) = pair_map(B) @ pair_map(A).
    """
    d, r = B.shape
    j, k = pair_index(d)
    jr, kr = pair_index(r)
    # (B^T S B)[j',k'] = sum_{j<=k} c S[j,k], c = B[j,j']B[k,k'] + B[k,j']B[j,k'] (j<k), B[j,j']B[j,k'] (j=k)
    A = B[j][:, jr] * B[k][:, kr] + B[k][:, jr] * B[j][:, kr]
    A[j == k] *= 0.5
    return A.T


def orth_pair_map(B: np.ndarray) -> np.ndarray:
    """D_r P_B D_d^-1: S -> B^T S B in orthonormal pair coordinates (orthogonal rows for orthonormal B)."""
    d, r = B.shape
    return pair_scale(r)[:, None] * pair_map(B) / pair_scale(d)[None, :]


def _positive(total: float) -> float:
    """A normaliser (sum w n: any positive number, the weights carry no units); 1 for an empty sum."""
    t = float(total)
    return t if t > 0 else 1.0


def equilibrate(G: np.ndarray) -> np.ndarray:
    """r (d,) with r_j = 1 / sqrt(G[j,j]) rounded to a power of 2 (1 where G[j,j] = 0): diag(r) G diag(r)
    has a diagonal in [1/2, 2] (the symmetric scaling of LAPACK's dpoequ), so that a rescaling of the token coordinates leaves
    nothing for an eigendecomposition's floor to lose."""
    g = np.diagonal(G).astype(np.float64)
    ok = (g > 0) & np.isfinite(g)
    # powers of 2 (as LAPACK's dgeequb): the scaling is exact, and a float32-valued matrix stays so
    k = np.round(-0.5 * np.log2(np.where(ok, g, 1.0)))
    return np.where(ok, np.ldexp(1.0, k.astype(np.int64)), 1.0)


def whitening(token_gram: np.ndarray, n_tokens: float, round32: bool = True) -> np.ndarray:
    """A (d, d) with A^T (token_gram / n_tokens) A ~ I; `n_tokens` is the token weight sum w n
    (features.Features.token_weight), any positive number.

    A is the symmetric inverse square root of G. Directions it does not resolve (eigenvalues <=
    d eps of the largest, UNRESOLVED_REL) keep the scale of the largest one; when there are such
    directions, G is equilibrated first (G_e = R G R, R = diag(`equilibrate`): a diagonal near 1) and
    A = R G_e^(-1/2) is used if it resolves more of them, so that a diagonal scaling of the tokens,
    however large, is taken out exactly before the eigendecomposition (data that need no
    equilibration keep the symmetric A bit for bit). What neither resolves (a rotated direction of
    relative standard deviation below about sqrt(d eps): `unresolved`) keeps the scale of the
    largest one. A coordinate that is exactly 0 in every token (a zero row and column of the Gram)
    stays its own coordinate (A is block diagonal there), so that it is still exactly 0 in X A and
    in the token Gram derived back from X A. `round32` rounds to float32 values (after the
    power-of-2 scaling R is taken out), which makes an estimate reproducible bit for bit on any
    machine; it costs nothing in conditioning (the sums are corrected exactly after the pass,
    `correction`).
    """
    d = token_gram.shape[0]
    G = np.asarray(token_gram, dtype=np.float64) / _positive(n_tokens)
    G = 0.5 * (G + G.T)
    if not np.isfinite(G).all():
        return np.eye(d)
    live = np.flatnonzero(np.diagonal(G) != 0.0)
    if live.size == 0:
        return np.eye(d)
    Gl = G[np.ix_(live, live)]
    best = None
    for r in (np.ones(live.size), *_equilibration(Gl)):
        Ge = Gl * r[:, None] * r[None, :]
        w, V = np.linalg.eigh(Ge)
        top = float(w[-1])
        if not np.isfinite(top) or top <= 0.0:
            continue
        lost = int((w <= UNRESOLVED_REL * d * top).sum())
        if best is None or lost < best[0]:
            best = (lost, r, w, V, top)
        if lost == 0:
            break
    if best is None:
        return np.eye(d)
    _, r, w, V, top = best
    w = np.where(w > UNRESOLVED_REL * d * top, w, top)
    Ae = (V / np.sqrt(w)) @ V.T
    if round32:
        Ae = Ae.astype(np.float32).astype(np.float64)
    # the coordinates G never excites: the scale of the largest live one
    A = np.eye(d) * (float(r.min()) / np.sqrt(top))
    if round32:
        A = A.astype(np.float32).astype(np.float64)
    A[np.ix_(live, live)] = r[:, None] * Ae
    return A


# EQUILIBRATE_RATIO (mhla_cli.numerics): a token Gram whose diagonal spans more than it is equilibrated
# before `whitening`'s eigendecomposition when that resolves more directions; below it the symmetric
# whitening already resolves what equilibration would (a diagonal scaling by at most 1e2 in standard
# deviation), and rounding-level directions (tokens in a rotated subspace) stay where the symmetric
# floor puts them.


def _equilibration(G: np.ndarray) -> tuple[np.ndarray, ...]:
    """(r,) from `equilibrate` when G's positive diagonal spans more than EQUILIBRATE_RATIO, else ()."""
    g = np.diagonal(G)
    g = g[g > 0]
    if g.size < 2 or not float(g.max()) > EQUILIBRATE_RATIO * float(g.min()):
        return ()
    return (equilibrate(G),)


# UNRESOLVED_REL (mhla_cli.numerics): eigenvalues of an equilibrated token Gram at or below d * it * its
# largest are not resolvable in float64 (`whitening`, `unresolved`).


def unresolved(token_gram: np.ndarray) -> int:
    """How many directions of the tokens float64 cannot resolve: eigenvalues <= d eps of the largest
    of the token Gram, equilibrated where that resolves more (as `whitening` does), i.e. variances
    too small to tell from rounding (exact-zero coordinates are not counted; the certificate calls
    them zero)."""
    d = token_gram.shape[0]
    G = np.asarray(token_gram, dtype=np.float64)
    G = 0.5 * (G + G.T)
    if not np.isfinite(G).all():
        return 0
    live = np.flatnonzero(np.diagonal(G) != 0.0)
    if live.size == 0:
        return 0
    Gl = G[np.ix_(live, live)]
    lost = d
    for r in (np.ones(live.size), *_equilibration(Gl)):
        w = np.linalg.eigvalsh(Gl * r[:, None] * r[None, :])
        lost = min(lost, int((w <= UNRESOLVED_REL * d * max(float(w[-1]), 0.0)).sum()))
    return lost


# `unresolved_canonical`: in the canonical coordinates the whitening brings every direction it resolves to a
# variance of ~1 (A^T G A = I, to the basis's own accuracy) and keeps those it does not at the largest scale,
# where their variance is at most d UNRESOLVED_REL of it (~1e-15): an eigenvalue of the canonical token Gram at
# or below this fraction of its largest is a direction the whitening did not resolve (1e-8: the geometric
# middle of the two, far from both).
UNRESOLVED_CANONICAL = 1e-8


def unresolved_canonical(basis_token_gram: np.ndarray) -> int:
    """How many token directions the whitening of the data did not resolve, counted in the canonical
    coordinates (unit-free: not a cut in the tokens' own units, whose rounding depends on their scales):
    eigenvalues of the canonical token Gram A^T G A at or below UNRESOLVED_CANONICAL of its largest;
    coordinates that are exactly 0 in every token are none (the certificate calls them zero)."""
    G = np.asarray(basis_token_gram, dtype=np.float64)
    G = 0.5 * (G + G.T)
    live = np.flatnonzero(np.diagonal(G) != 0.0)
    if live.size == 0 or not np.isfinite(G).all():
        return 0
    w = np.linalg.eigvalsh(G[np.ix_(live, live)])
    return int((w <= UNRESOLVED_CANONICAL * max(float(w[-1]), 0.0)).sum())


def unresolved_directions(basis_token_gram: np.ndarray, k: int) -> np.ndarray:
    """(d, k) orthonormal columns: in the canonical coordinates of a basis A (tokens X A), the k token
    directions float64 does not resolve (`unresolved`: the whitening kept them at the largest scale,
    so the canonical token Gram A^T G A is near 0 there and near 1 on the others), i.e. the
    eigenvectors of its k smallest eigenvalues; coordinates that are exactly 0 in every token are no
    such direction (they are not counted by `unresolved` either)."""
    d = basis_token_gram.shape[0]
    out = np.zeros((d, 0))
    if k <= 0:
        return out
    G = 0.5 * (basis_token_gram + basis_token_gram.T)
    live = np.flatnonzero(np.diagonal(G) != 0.0)
    k = min(k, live.size)
    if k == 0 or not np.isfinite(G).all():
        return out
    _, V = np.linalg.eigh(G[np.ix_(live, live)])
    out = np.zeros((d, k))
    out[live] = V[:, :k]
    return out


def round32(A: np.ndarray) -> np.ndarray:
    """A rounded to float32 values relative to each row's power-of-2 scale (so that rows far outside
    float32's range, tokens coordinates of scale 1e-40 or 1e40, round rather than overflow)."""
    A = np.asarray(A, dtype=np.float64)
    n = np.max(np.abs(A), axis=1)
    ok = (n > 0) & np.isfinite(n)
    k = np.round(np.log2(np.where(ok, n, 1.0))).astype(np.int64)
    r = np.where(ok, np.ldexp(1.0, k), 1.0)[:, None]
    return (A / r).astype(np.float32).astype(np.float64) * r


def row_scaled_cond(A: np.ndarray) -> float:
    """cond(R A) with R = 1 / the row norms of A: the condition of a basis up to a rescaling of the
    token coordinates (which `whitening` takes out exactly), inf when a row is zero or not finite."""
    A = np.asarray(A, dtype=np.float64)
    if not np.isfinite(A).all():
        return float("inf")
    n = np.linalg.norm(A, axis=1)
    if (n <= 0).any():
        return float("inf")
    return float(np.linalg.cond(A / n[:, None]))


def correction(basis_token_gram: np.ndarray, n_tokens: float) -> tuple[np.ndarray | None, float]:
    """(C, cond(C)): X A C is the whitening of the data whose token Gram in basis A is `basis_token_gram`.

    C is None when A is already that whitening (A^T G A within CANONICAL_TOL of I on the tokens' span).
    """
    d = basis_token_gram.shape[0]
    G = np.asarray(basis_token_gram, dtype=np.float64) / _positive(n_tokens)
    G = 0.5 * (G + G.T)
    if not np.isfinite(G).all():
        return None, 1.0
    # a coordinate that is exactly 0 in every token stays its own coordinate (`whitening`): its zero
    # eigenvalue is no direction left to whiten (counted, it made every canonical() apply a change again)
    nonzero = np.flatnonzero(np.diagonal(G) != 0.0)
    w = np.linalg.eigvalsh(G[np.ix_(nonzero, nonzero)])
    top = float(w[-1]) if w.size else 0.0
    if top <= 0.0:
        return None, 1.0
    live = w[w > UNRESOLVED_REL * d * top]
    if live.size < w.size and unresolved(G) < w.size - live.size:
        live = w  # resolved once equilibrated (a coordinate far smaller than the others is not "zero")
    if float(np.abs(live - 1.0).max()) <= CANONICAL_TOL and float(np.abs(live[-1] - 1.0)) <= CANONICAL_TOL:
        return None, 1.0
    C = whitening(G, 1.0, round32=False)
    s = np.linalg.svd(C, compute_uv=False)
    return C, float(s[0] / s[-1])


def _apply_rows(P: np.ndarray, R: np.ndarray, X: np.ndarray) -> np.ndarray:
    """kron(P, R) @ X for X (P.shape[1] * R.shape[1], m), features ordered (pair, l), l fastest."""
    npairs_out, npairs = P.shape
    d_out, d = R.shape
    m = X.shape[1]
    Z = np.tensordot(P, X.reshape(npairs, d * m), axes=(1, 0)).reshape(npairs_out, d, m)
    return np.matmul(R, Z).reshape(npairs_out * d_out, m)


def _congruence(P: np.ndarray, R: np.ndarray, G: np.ndarray, overwrite: bool = False) -> np.ndarray:
    """K G K^T for K = kron(P, R), symmetrised (O(psi^2 (q + d)) through the Kronecker structure).

    For square P and R the product is formed in place in one psi x psi array (a copy of G, or G
    itself with `overwrite`), with temporaries of a few MiB: K (K G)^T, the transpose and the
    symmetrisation taken block by block. Other shapes use two out-of-place products.
    """
    if P.shape[0] != P.shape[1] or R.shape[0] != R.shape[1]:
        half = np.ascontiguousarray(_apply_rows(P, R, G).T)
        out = _apply_rows(P, R, half)
        del half
        out += out.T.copy()
        out *= 0.5
        return out
    out = G if overwrite else np.array(G, dtype=np.float64, order="C")
    _apply_rows_inplace(P, R, out)  # K G
    _transpose_inplace(out)  # (K G)^T
    _apply_rows_inplace(P, R, out)  # K G^T K^T
    _symmetrize_inplace(out)
    return out


# Bytes of the work arrays of the in-place kernels below (per block of rows or columns).
_WORK_BYTES = 8 * 2**20
# Side of the square tiles of the in-place transpose and symmetrisation.
_TILE = 256


def _apply_rows_inplace(P: np.ndarray, R: np.ndarray, X: np.ndarray) -> None:
    """X <- kron(P, R) @ X in place, for square P (q, q), R (d, d) and X (q d, m) (rows may be strided).

    The same products as `_apply_rows` (P over the pairs, then R over l), a block of columns or of
    pairs at a time through a work array of about _WORK_BYTES.
    """
    q, d, m = P.shape[0], R.shape[0], X.shape[1]
    X3 = X.view()
    X3.shape = (q, d, m)  # a view (raises rather than copy)
    cols = max(1, min(m, _WORK_BYTES // (8 * q)))
    work = np.empty(q * cols)
    for l in range(d):
        Xl = X3[:, l, :]
        for c0 in range(0, m, cols):
            c1 = min(m, c0 + cols)
            w = work[:q * (c1 - c0)].reshape(q, c1 - c0)
            np.matmul(P, Xl[:, c0:c1], out=w)
            Xl[:, c0:c1] = w
    pairs = max(1, min(q, _WORK_BYTES // (8 * d * m)))
    work = np.empty(pairs * d * m)
    for p0 in range(0, q, pairs):
        p1 = min(q, p0 + pairs)
        w3 = work[:(p1 - p0) * d * m].reshape(p1 - p0, d, m)
        np.matmul(R, X3[p0:p1], out=w3)
        X3[p0:p1] = w3


def _transpose_inplace(G: np.ndarray, tile: int = _TILE) -> None:
    """G <- G^T in place for a square G, tile by tile."""
    n = G.shape[0]
    for i0 in range(0, n, tile):
        i1 = min(n, i0 + tile)
        D = G[i0:i1, i0:i1]
        D[...] = D.T.copy()
        for j0 in range(i1, n, tile):
            j1 = min(n, j0 + tile)
            upper = G[i0:i1, j0:j1].copy()
            G[i0:i1, j0:j1] = G[j0:j1, i0:i1].T
            G[j0:j1, i0:i1] = upper.T


def _symmetrize_inplace(G: np.ndarray, tile: int = _TILE) -> None:
    """G <- (G + G^T) / 2 in place, tile by tile (the same rounding as `(G + G.T) * 0.5`)."""
    n = G.shape[0]
    for i0 in range(0, n, tile):
        i1 = min(n, i0 + tile)
        for j0 in range(i0, n, tile):
            j1 = min(n, j0 + tile)
            s = G[i0:i1, j0:j1] + G[j0:j1, i0:i1].T
            s *= 0.5
            G[i0:i1, j0:j1] = s
            G[j0:j1, i0:i1] = s.T


def feature_map(A: np.ndarray) -> np.ndarray:
    """M_A (psi, psi) with Ht(X A) = M_A H(X), materialised (for tests and small d)."""
    d = A.shape[0]
    return np.kron(pair_scale(d)[:, None] * pair_map(A), A.T)


def _to_basis_factors(A: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d = A.shape[0]
    return pair_scale(d)[:, None] * pair_map(A), A.T


def _from_basis_factors(A: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Factors of M_A^-1 = kron(P_A^-1 D^-1, A^-T) (P_A^-1 = P_(A^-1))."""
    d = A.shape[0]
    Ainv = np.linalg.inv(A)
    return pair_map(Ainv) / pair_scale(d)[None, :], Ainv.T


def features_to_basis(A: np.ndarray, X: np.ndarray) -> np.ndarray:
    """M_A @ X: own feature columns X (psi, m) -> canonical features of the tokens X A."""
    return _apply_rows(*_to_basis_factors(A), X)


def features_from_basis(A: np.ndarray, Xb: np.ndarray) -> np.ndarray:
    """M_A^-1 @ Xb (the inverse map of `features_to_basis`)."""
    return _apply_rows(*_from_basis_factors(A), Xb)


def gram_to_basis(A: np.ndarray, gram: np.ndarray) -> np.ndarray:
    """M_A gram M_A^T: a Gram of own features -> of the canonical features of X A."""
    return _congruence(*_to_basis_factors(A), gram)


def coef_from_basis(A: np.ndarray, coef_b: np.ndarray) -> np.ndarray:
    """p = p_b M_A: coefficients (m, psi) on the tokens' own features."""
    P, R = _to_basis_factors(A)
    return _apply_rows(P.T, R.T, np.ascontiguousarray(coef_b.T)).T


def coef_to_basis(A: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """p_b = p M_A^-1 (the inverse of `coef_from_basis`)."""
    P, R = _from_basis_factors(A)
    return _apply_rows(P.T, R.T, np.ascontiguousarray(coef.T)).T


def transition(A_from: np.ndarray, A_to: np.ndarray) -> np.ndarray:
    """C with X A_to = (X A_from) C (the rows, one per token coordinate, scaled alike first: the same
    system, without the token coordinates' scales in its conditioning)."""
    n = np.linalg.norm(A_from, axis=1)
    n = np.where(n > 0, n, 1.0)[:, None]
    return np.linalg.solve(A_from / n, A_to / n)


def same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Two bases are the same (None is the identity)."""
    if a is None and b is None:
        return True
    d = (a if a is not None else b).shape[0]  # type: ignore[union-attr]  # not both None (above)
    a = np.eye(d) if a is None else a
    b = np.eye(d) if b is None else b
    return bool(np.array_equal(a, b))


# Tokens read to estimate the basis before a pass: up to this many, in SAMPLE_BLOCKS blocks spread
# evenly over the file (the same samples whatever the shard, chunk size or worker count). The
# estimate only has to be good enough for the pass (CHANGE_COND); the sums are then corrected to the
# whitening of all the tokens, or the pass is redone in it.
SAMPLE_TOKENS = 1 << 18
SAMPLE_BLOCKS = 8


def block_samples(n_samples: int, n_tokens: int) -> int:
    """Samples in one block of the estimate's sample: about SAMPLE_TOKENS / SAMPLE_BLOCKS tokens."""
    mean_len = max(1.0, n_tokens / max(n_samples, 1))
    return max(1, int(SAMPLE_TOKENS / mean_len / SAMPLE_BLOCKS))


def sample_blocks(n_samples: int, n_tokens: int, per_block: int | None = None) -> list[tuple[int, int]]:
    """Disjoint sample ranges [a, b) of the estimate's sample (small files: read once, not per block);
    `per_block` samples from each of the SAMPLE_BLOCKS starts instead of `block_samples` (a head of
    each block: spans.probe_blocks)."""
    N = n_samples
    per_block = block_samples(n_samples, n_tokens) if per_block is None else int(per_block)
    blocks: list[tuple[int, int]] = []
    for a in sorted({(N * i) // SAMPLE_BLOCKS for i in range(SAMPLE_BLOCKS)}):
        b = min(N, a + per_block)
        if blocks and a <= blocks[-1][1]:
            blocks[-1] = (blocks[-1][0], max(b, blocks[-1][1]))
        else:
            blocks.append((a, b))
    return blocks


# Public names of the Kronecker kernels (used by mhla_cli.statistics.structure).
kron_apply = _apply_rows
kron_congruence = _congruence
from_basis_factors = _from_basis_factors  # M_A^-1 = kron(P, R): (P, R)
