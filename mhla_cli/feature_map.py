"""The cubic feature map H(X) of the paper and its index bookkeeping.

H(X)_(j,k,l) = S[j,k] * x_n[l] with S = X^T X, for 0 <= j <= k < d and 0 <= l < d, ordered j, then
k (from j), then l fastest; psi = d^2 (d+1) / 2 features.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from .errors import InputError


def n_features(d: int) -> int:
    """psi = d^2 (d + 1) / 2, the number of distinct cubic features for token dimension d."""
    return d * d * (d + 1) // 2


def d_of_psi(psi: int) -> int:
    """The token width d of psi = d^2 (d + 1) / 2 features (ValueError when psi is no such count)."""
    d = 1
    while n_features(d) < psi:
        d += 1
    if n_features(d) != psi:
        raise ValueError(f"{psi} is not d^2 (d + 1) / 2 for any d")
    return d


@lru_cache(maxsize=64)
def pair_index(d: int) -> tuple[np.ndarray, np.ndarray]:
    """Row/column indices (j, k), j <= k, of the upper triangle in feature order."""
    j, k = np.triu_indices(d)
    j.setflags(write=False)
    k.setflags(write=False)
    return j, k


@lru_cache(maxsize=64)
def feature_index(d: int) -> np.ndarray:
    """Array (psi, 3) of (j, k, l) for each feature, in feature order."""
    j, k = pair_index(d)
    npairs = j.size
    idx = np.empty((npairs, d, 3), dtype=np.int64)
    idx[:, :, 0] = j[:, None]
    idx[:, :, 1] = k[:, None]
    idx[:, :, 2] = np.arange(d)[None, :]
    flat = idx.reshape(-1, 3)
    flat.setflags(write=False)
    return flat


def features_from_moments(S: np.ndarray, last: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """H for a batch: S (B, d, d) token Gram matrices and last tokens (B, d) -> (B, psi) float64."""
    B, d, _ = S.shape
    j, k = pair_index(d)
    upper = S[:, j, k]  # (B, npairs)
    if out is None:
        out = np.empty((B, j.size * d), dtype=np.float64)
    np.multiply(upper[:, :, None], last[:, None, :], out=out.reshape(B, j.size, d))
    return out


def cubic_features(X: np.ndarray) -> np.ndarray:
    """H(X) (psi,) for one sequence X (n, d), in float64."""
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or X.shape[0] < 1:
        raise ValueError("X must have shape (n, d) with n >= 1")
    S = X.T @ X
    out: np.ndarray = features_from_moments(S[None], X[-1][None])[0]
    return out


NORMALIZATIONS = ("none", "length")


def check_normalize(normalize: str) -> str:
    """Validate a --normalize value ("none" or "length")."""
    if normalize not in NORMALIZATIONS:
        raise InputError(f"the normalisation must be none or length, got '{normalize}'")
    return normalize
