"""Per-chunk kernels: the per-sequence moments S = X^T X (and X^T Y), the prefix Grams of every position.

The sample layouts (mhla_cli.samples) build their rows from them; the streaming accumulation, the forward pass
and the probes call them through the layouts.

All float64, vectorised over a chunk (tokens of any real dtype are converted in cache-sized blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from .feature_map import pair_index

__all__ = ["length_groups", "position_numbers", "prefix_moments", "sequence_moments", "window_products"]


def sequence_moments(tokens: np.ndarray, offsets: np.ndarray, out: np.ndarray | None = None,
                     progress: Callable[[int], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-sequence S = X^T X (B, d, d) and last tokens (B, d), float64, vectorised over the chunk.

    `tokens` may have any real dtype: they are converted to float64 in cache-sized blocks just
    before each product (products of float32 or integer values are then exact). Equal lengths are
    batched matmuls; ragged chunks are grouped by length (padding with zero rows, which do not
    change S), one batched matmul per group. `out` is an optional (B, d, d) buffer for S.
    `progress(k)`, if given, is told the number k of sequences done after each block or group (the
    results do not depend on it).
    """
    # Overflow from absurdly large tokens is reported by the finiteness check, not as a warning.
    with np.errstate(over="ignore", invalid="ignore"):
        return _sequence_moments(np.asarray(tokens), np.asarray(offsets, dtype=np.int64), out, progress)


def _sequence_moments(tokens: np.ndarray, offsets: np.ndarray, out: np.ndarray | None,
                      progress: Callable[[int], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    d = tokens.shape[1]
    lengths = np.diff(offsets)
    B = lengths.size
    S = np.empty((B, d, d)) if out is None else out
    if B == 0:
        return S, np.empty((0, d))
    if (lengths == lengths[0]).all() and offsets[0] == 0 and tokens.shape[0] == offsets[-1]:
        X = tokens.reshape(B, int(lengths[0]), d)
        if X.dtype == np.float64:
            np.matmul(X.transpose(0, 2, 1), X, out=S)
        else:
            step = max(1, BLOCK_ELEMENTS // (X.shape[1] * d))
            work = np.empty((min(step, B), X.shape[1], d))
            for a in range(0, B, step):
                b = min(B, a + step)
                w = work[:b - a]
                np.copyto(w, X[a:b])
                np.matmul(w.transpose(0, 2, 1), w, out=S[a:b])
                if progress is not None:
                    progress(b)
        return S, X[:, -1, :].astype(np.float64)
    last = tokens[offsets[1:] - 1].astype(np.float64)
    for idx, rows, valid, stop in length_groups(offsets):
        X = tokens[rows].astype(np.float64, copy=False)
        X[~valid] = 0.0
        S[idx] = np.matmul(X.transpose(0, 2, 1), X)
        if progress is not None:
            progress(stop)
    return S, last


def prefix_moments(tokens: np.ndarray, offsets: np.ndarray, normalize: str = "none"
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Distinct entries of the prefix Grams S_t = sum_{s<=t} x_s x_s^T of every position, vectorised.

    tokens (T, d) of any real dtype, offsets (B+1,) from 0. Returns `upper` (T, d(d+1)/2) float64,
    the entries S_t[j, k], j <= k, in feature pair order (feature_map.pair_index), and the tokens
    themselves (T, d) float64 (the last token x_t of each prefix). With normalize="length" S_t is
    divided by t (the 1-based position in its sequence). S_t is a running sum: a cumsum of the
    per-token outer products within each sequence (equal lengths: one batched cumsum; ragged:
    grouped by length with trailing padding, which never enters a valid prefix).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        X = np.asarray(tokens, dtype=np.float64)
        offsets = np.asarray(offsets, dtype=np.int64)
        T, d = X.shape
        j, k = pair_index(d)
        P = X[:, j] * X[:, k]  # (T, npairs): upper entries of x_t x_t^T
        lengths = np.diff(offsets)
        B = lengths.size
        if B == 0 or T == 0:
            return P, X
        if (lengths == lengths[0]).all() and offsets[0] == 0 and T == offsets[-1]:
            n = int(lengths[0])
            np.cumsum(P.reshape(B, n, -1), axis=1, out=P.reshape(B, n, -1))
        else:
            for _idx, rows, valid, _stop in length_groups(offsets):
                block = P[rows]  # rows past a sequence's end are padding after its valid prefix
                np.cumsum(block, axis=1, out=block)
                P[rows[valid]] = block[valid]
        if normalize == "length":
            P /= position_numbers(offsets)[:, None]
        return P, X


def window_products(X: np.ndarray, Y: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """X_i^T Y_i (B, d, e) of every sequence i, float64: X (T, d) and Y (T, e) rows of the same tokens.

    Equal lengths are one batched matmul; ragged chunks are grouped by length (`length_groups`: padding
    rows are zero in X, so they add nothing)."""
    X = np.asarray(X, dtype=np.float64)
    Y = np.asarray(Y, dtype=np.float64)
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    B, d, e = lengths.size, X.shape[1], Y.shape[1]
    out = np.empty((B, d, e))
    if B == 0:
        return out
    if (lengths == lengths[0]).all() and offsets[0] == 0 and X.shape[0] == offsets[-1]:
        n = int(lengths[0])
        return np.matmul(X.reshape(B, n, d).transpose(0, 2, 1), Y.reshape(B, n, e), out=out)
    for idx, rows, valid, _stop in length_groups(offsets):
        Xg = X[rows]
        Xg[~valid] = 0.0
        out[idx] = np.matmul(Xg.transpose(0, 2, 1), Y[rows])
    return out


def length_groups(offsets: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """Ragged sequences grouped by length for batched products: (idx, rows, valid, stop) per group, idx the
    group's sequences, rows (k, L) their token rows padded to the group's longest with row offsets[0]
    (`valid` (k, L) marks the real ones), stop the number of sequences done after the group. Lengths are
    sorted; a group pads by at most ~25 % (+4 rows)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    B = lengths.size
    order = np.argsort(lengths, kind="stable")
    sorted_len = lengths[order]
    start = 0
    while start < B:
        lo_len = int(sorted_len[start])
        stop = int(np.searchsorted(sorted_len, lo_len + lo_len // 4 + 4, side="right"))
        idx = order[start:stop]
        L = int(sorted_len[stop - 1])
        ar = np.arange(L)
        valid = ar[None, :] < lengths[idx][:, None]
        rows = np.where(valid, offsets[idx][:, None] + ar[None, :], offsets[0])
        yield idx, rows, valid, stop
        start = stop


def position_numbers(offsets: np.ndarray) -> np.ndarray:
    """1-based position t of every token in its sequence, float64 (T,)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    T = int(offsets[-1] - offsets[0])
    return (np.arange(T) - np.repeat(offsets[:-1] - offsets[0], lengths) + 1).astype(np.float64)


# float64 elements per conversion block in sequence_moments (512 KiB: stays in cache for the product)
BLOCK_ELEMENTS = 1 << 16
