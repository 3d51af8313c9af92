"""The token basis the solver works in: its estimate, and the maps it induces on features and coef.

The MHLA class is closed under an invertible change of token coordinates X -> X A (S -> A^T S A,
x_n -> A^T x_n; BACKGROUND.md, "Autoregressive data and certificates on given inputs"), so the
features of X A are an exact linear image of those of X:

    H(X A) = M_A H(X),   M_A = kron(P_A, A^T),   P_A = pair_map(A)  (upper(A^T S A) = P_A upper(S))

and a function with coefficients p_b in the basis has p = p_b M_A in the tokens' own coordinates.
Badly scaled or rotated tokens make gram = sum H H^T ill-conditioned to the sixth power of the
token condition number; accumulating the features of whitened tokens X A (A ~ token_gram^(-1/2))
keeps the solver's Gram well conditioned whatever the units (docs/numerics.md).
"""

from __future__ import annotations

import numpy as np

from .features import pair_index

EPS = float(np.finfo(np.float64).eps)


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


def whitening(token_gram: np.ndarray, n_tokens: int) -> np.ndarray:
    """A (d, d) with A^T (token_gram / n_tokens) A ~ I, rounded to float32 values.

    Directions the tokens do not excite (eigenvalues <= d eps lambda_max) keep the scale of the
    largest one. The float32 rounding makes the basis reproducible bit for bit from the same sample
    on any machine (shards featurized apart then add up exactly); it costs nothing in conditioning.
    """
    d = token_gram.shape[0]
    G = np.asarray(token_gram, dtype=np.float64) / max(int(n_tokens), 1)
    G = 0.5 * (G + G.T)
    w, V = np.linalg.eigh(G)
    top = float(w[-1]) if w.size else 0.0
    if not np.isfinite(top) or top <= 0.0:
        return np.eye(d)
    w = np.where(w > d * EPS * top, w, top)
    A = (V / np.sqrt(w)) @ V.T
    return A.astype(np.float32).astype(np.float64)


def is_identity(A: np.ndarray | None) -> bool:
    return A is None or bool(np.array_equal(A, np.eye(A.shape[0])))


def _apply_rows(P: np.ndarray, R: np.ndarray, X: np.ndarray) -> np.ndarray:
    """kron(P, R) @ X for X (psi, m) with features ordered (pair, l), l fastest."""
    npairs, d = P.shape[0], R.shape[0]
    m = X.shape[1]
    Z = np.tensordot(P, X.reshape(npairs, d * m), axes=(1, 0)).reshape(npairs, d, m)
    return np.matmul(R, Z).reshape(npairs * d, m)


def feature_map(A: np.ndarray) -> np.ndarray:
    """M_A (psi, psi) with H(X A) = M_A H(X), materialised (for tests and small d)."""
    return np.kron(pair_map(A), A.T)


def features_to_basis(A: np.ndarray, X: np.ndarray) -> np.ndarray:
    """M_A @ X: feature columns X (psi, m) of tokens in their own coordinates -> of the tokens X A."""
    return _apply_rows(pair_map(A), A.T, X)


def features_from_basis(A: np.ndarray, Xb: np.ndarray) -> np.ndarray:
    """M_A^-1 @ Xb (the inverse map of `features_to_basis`)."""
    Ainv = np.linalg.inv(A)
    return _apply_rows(pair_map(Ainv), Ainv.T, Xb)


def gram_from_basis(A: np.ndarray, gram_b: np.ndarray) -> np.ndarray:
    """gram = M^-1 gram_b M^-T: the Gram of the tokens' own features from the basis one."""
    Ainv = np.linalg.inv(A)
    P, R = pair_map(Ainv), Ainv.T
    half = _apply_rows(P, R, gram_b)
    out = _apply_rows(P, R, np.ascontiguousarray(half.T))
    return 0.5 * (out + out.T)


def coef_from_basis(A: np.ndarray, coef_b: np.ndarray) -> np.ndarray:
    """p = p_b M_A: coefficients (d, psi) in the tokens' own coordinates."""
    return _apply_rows(pair_map(A).T, A, np.ascontiguousarray(coef_b.T)).T


def coef_to_basis(A: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """p_b = p M_A^-1 (the inverse of `coef_from_basis`)."""
    Ainv = np.linalg.inv(A)
    return _apply_rows(pair_map(Ainv).T, Ainv, np.ascontiguousarray(coef.T)).T


def same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Two bases are the same (None is the identity)."""
    if a is None and b is None:
        return True
    d = (a if a is not None else b).shape[0]  # type: ignore[union-attr]
    a = np.eye(d) if a is None else a
    b = np.eye(d) if b is None else b
    return bool(np.array_equal(a, b))


def change(A_from: np.ndarray | None, A_to: np.ndarray, gram_b: np.ndarray, moments_b: np.ndarray | None
           ) -> tuple[np.ndarray, np.ndarray | None]:
    """Statistics in basis A_from -> in basis A_to (exact up to rounding; well conditioned when the
    two bases are close, as the whitenings of the same data are)."""
    d = A_to.shape[0]
    C = np.linalg.solve(np.eye(d) if A_from is None else A_from, A_to)  # X A_to = (X A_from) C
    P, R = pair_map(C), C.T
    half = _apply_rows(P, R, gram_b)
    g = _apply_rows(P, R, np.ascontiguousarray(half.T))
    m = None if moments_b is None else _apply_rows(P, R, moments_b)
    return 0.5 * (g + g.T), m
