"""Streaming accumulation of the sufficient statistics (gram, moments, ...) over chunks of samples.

Everything here is a sum over samples, so statistics of disjoint sample ranges add up
(`Features.__add__`, mhla_cli.statistics.stats). `reduce_span` computes the statistics of one half-open range
[lo, hi) and is the only place the data are read; the serial loop, worker pools
(mhla_cli.statistics.parallel), shards and Dask all call it. Per chunk: a reader thread fetches the next chunk
in its stored dtype, the tokens are transformed to the pass's basis (X A), the per-sequence
(X A)^T (X A) are batched matmuls, and the canonical sums are updated either by the Gram's
distinct entries K = U^T V (mhla_cli.linalg.symgram: half the flops of a syrk, for d >= symgram.SYMGRAM_MIN_D)
or by one syrk of the block [Ht | Y] (docs/performance.md). `featurize` ends in the whitening of all the data read
(mhla_cli.statistics.basis).
"""

from __future__ import annotations

import builtins
import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np

from . import basis as basis_mod
from ..linalg import device as device_mod
from ..io import formats
from . import parallel
from . import structure as structure_mod
from ..linalg import symgram
from ..numerics import SINGULAR_BASIS_COND
from ..linalg.factorization import POTRF_THREADED_MAX
from ..errors import InputError
from ..feature_map import check_normalize, n_features, pair_index
from ..linalg.memory import (block_featurize_bytes, block_solve_bytes, check_floor, check_memory, featurize_bytes, solve_bytes,
                     solve_kind)
from .parallel import CANCEL, Cancelled
from .algebra import add_into
from .features import Features, check_overflow
from ..io.tokens import (ReadBuffers, TokensInfo, check_chunk, check_weights, inspect_tokens, iter_chunks, read_chunk,
                     require_square)

__all__ = ["Features", "chunk_features", "default_chunk_size", "estimate_basis", "featurize", "load_features",
           "prefix_moments", "reduce_span", "reduce_spans", "sample_rows", "sequence_moments", "shard_range",
           "shard_span", "work_spans"]

# Target size of the per-chunk work buffers; the default chunk size is derived from it.
CHUNK_BYTES = 64 * 2**20


# --------------------------------------------------------------------------------------------
# per-chunk kernels
# --------------------------------------------------------------------------------------------


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
            step = max(1, _BLOCK_ELEMENTS // (X.shape[1] * d))
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
    order = np.argsort(lengths, kind="stable")
    sorted_len = lengths[order]
    start = 0
    while start < B:
        lo_len = int(sorted_len[start])
        limit = lo_len + lo_len // 4 + 4  # pad by at most ~25 % (+4 rows) within a group
        stop = int(np.searchsorted(sorted_len, limit, side="right"))
        idx = order[start:stop]
        L = int(sorted_len[stop - 1])
        ar = np.arange(L)
        valid = ar[None, :] < lengths[idx][:, None]
        rows = np.where(valid, offsets[idx][:, None] + ar[None, :], 0)
        X = tokens[rows].astype(np.float64, copy=False)
        X[~valid] = 0.0
        S[idx] = np.matmul(X.transpose(0, 2, 1), X)
        start = stop
        if progress is not None:
            progress(stop)
    return S, last


def prefix_moments(tokens: np.ndarray, offsets: np.ndarray, normalize: str = "none"
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Distinct entries of the prefix Grams S_t = sum_{s<=t} x_s x_s^T of every position, vectorised.

    tokens (T, d) of any real dtype, offsets (B+1,) from 0. Returns `upper` (T, d(d+1)/2) float64,
    the entries S_t[j, k], j <= k, in feature pair order (features.pair_index), and the tokens
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
                rows = np.minimum(offsets[idx][:, None] + ar[None, :], T - 1)
                block = P[rows]  # rows past a sequence's end are padding after its valid prefix
                np.cumsum(block, axis=1, out=block)
                P[rows[valid]] = block[valid]
                start = stop
        if normalize == "length":
            P /= position_numbers(offsets)[:, None]
        return P, X


def position_numbers(offsets: np.ndarray) -> np.ndarray:
    """1-based position t of every token in its sequence, float64 (T,)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    T = int(offsets[-1] - offsets[0])
    return (np.arange(T) - np.repeat(offsets[:-1] - offsets[0], lengths) + 1).astype(np.float64)


def sample_rows(tokens: np.ndarray, offsets: np.ndarray, per_position: bool, normalize: str = "none"
                ) -> tuple[np.ndarray, np.ndarray]:
    """(upper entries of S (R, npairs), last tokens (R, d)) of every sample of a chunk, float64.

    Per-position data: one row per position (prefix_moments); last-token data: one row per
    sequence (S = X^T X, divided by the length with normalize="length").
    """
    if per_position:
        return prefix_moments(tokens, offsets, normalize)
    d = tokens.shape[1]
    S, last = sequence_moments(tokens, offsets)
    j, k = pair_index(d)
    upper = S[:, j, k]
    if normalize == "length":
        upper /= np.diff(np.asarray(offsets, dtype=np.int64)).astype(np.float64)[:, None]
    return upper, last


# float64 elements per conversion block in sequence_moments (512 KiB: stays in cache for the product)
_BLOCK_ELEMENTS = 1 << 16


# Narrower [H | Y] blocks use one BLAS thread: measured on 2 shared cores, OpenBLAS with 2 threads
# took 397 ms for a (9500 x 44) syrk that one thread does in 1.6 ms, and 196 ms vs 41 ms at width
# 520 (a thread waits for a core held by another process); wider blocks amortise the wait.
MIN_THREADED_WIDTH = 1024
# Rows per chunk at least, for wide blocks: as in the dsyrk baseline (4096 x psi) of benchmarks/.
MIN_SYRK_ROWS = 4096
# Work array of one panel of the accumulator's update (`_Accumulator._syrk`).
PANEL_BYTES = 32 * 2**20
_CONTROLLER: Any = None


def _single_blas_thread() -> Any:
    """Context limiting BLAS to one thread (tiny per-sequence products gain nothing from more)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        from threadpoolctl import ThreadpoolController

        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER.limit(limits=1, user_api="blas")


def _blas_threads() -> int:
    """The number of threads BLAS uses now (threadpoolctl; 1 when unknown)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        from threadpoolctl import ThreadpoolController

        _CONTROLLER = ThreadpoolController()
    counts = [int(lib.num_threads) for lib in _CONTROLLER.select(user_api="blas").lib_controllers]
    return max(1, min(counts)) if counts else 1


class _Accumulator:
    """Running sums of one reduction in one basis A, with reusable work buffers.

    Per chunk the tokens are transformed first (X A, a d x d product per token: BACKGROUND.md,
    "The canonical certificate", Numerics), the features are those of X A in canonical coordinates
    (mhla_cli.statistics.basis), and the Gram of the block [Ht | Y] (B x (psi + d)) holds basis_gram,
    basis_moments and target_gram at once, so each chunk costs one syrk (numpy's `Ft @ Ft.T` on the
    transposed block); `G` accumulates it in float64. From symgram.SYMGRAM_MIN_D on (`_pairs`, or
    device.DevicePairs on a device) the chunk instead adds the Gram's distinct entries K = U^T V of the
    two factors s and x_n (mhla_cli.linalg.symgram), and `result` expands K to basis_gram exactly. The token Grams are accumulated both on the
    tokens' own coordinates (exact zeros stay zeros) and on X A.
    """

    def __init__(self, d: int, has_targets: bool, basis: np.ndarray | None = None, causal: bool = False,
                 normalize: str = "none", spans: tuple[np.ndarray, np.ndarray] | None = None,
                 traces: bool = False, device: str | None = None) -> None:
        self.causal = causal  # per-position data: every prefix is a sample (see _add_rows)
        self.normalize = normalize
        self.n_sequences = 0
        self.d = d
        self.basis = np.eye(d) if basis is None else np.asarray(basis, dtype=np.float64)
        self._transform = not basis_mod.same(self.basis, None)
        self.psi = n_features(d)
        # spans (E (q, a), F (d, b)): accumulate only the block features (E^T s) (x) (F^T x_n)
        # (mhla_cli.statistics.structure); nf features in all
        self.spans = None if spans is None else tuple(np.ascontiguousarray(m, dtype=np.float64) for m in spans)
        self.nf = self.psi if spans is None else int(spans[0].shape[1] * spans[1].shape[1])
        # traces: accumulate only the two partial traces of the canonical Gram (`find_spans`)
        self.traces = (np.zeros((self.psi // d, self.psi // d)), np.zeros((d, d))) if traces else None
        if traces:
            self.nf, has_targets = 0, False
        self.has_targets = has_targets
        self.width = self.nf + (d if has_targets else 0)
        self.G: np.ndarray | None = None
        # device (mhla_cli.linalg.device): the features and their Gram on a torch device; the token-side
        # work (S, the token Grams, the traces of a span pass) stays here
        self.device = None if traces else device
        self._dgram: Any = None
        # the Gram's own symmetry (mhla_cli.linalg.symgram): on the host, K = U^T V of the distinct entries
        # instead of a syrk of the materialised block, when the factors are wide enough to gain
        self._factors = (self.psi // d, d) if spans is None else (self.spans[0].shape[1], self.spans[1].shape[1])
        self._pairs = None if traces or self.device is not None else symgram.accumulator(
            *self._factors, d if has_targets else 0)
        self._bufs: dict[str, np.ndarray] = {}
        j, k = pair_index(d)
        self._upper_idx = (j * d + k).astype(np.intp)
        self._scale = np.ascontiguousarray(basis_mod.pair_scale(d))
        self.token_gram = np.zeros((d, d))
        self.last_token_gram = np.zeros((d, d))
        self.basis_token_gram = np.zeros((d, d))
        self.basis_last_token_gram = np.zeros((d, d))
        self._derived_token_gram = np.zeros((d, d))  # basis token Gram whose own one is derived in result()
        self._inv = None if not self._transform else np.linalg.inv(self.basis)
        self.n_samples = 0
        # sum w y over the samples with targets (Features.target_sum)
        self.target_sum = np.zeros(d) if has_targets else None
        self._moments_share: float | None = None  # of a chunk's time in `add`, for its progress ticks
        self.n_tokens = 0
        # the weight totals (stats.Features): sum w over the samples, sum w n over their tokens
        self.weight_sum = 0.0
        self.token_weight_sum = 0.0

    def _buf(self, name: str, rows: int, shape: tuple[int, ...]) -> np.ndarray:
        """A reusable (rows, *shape) float64 work array."""
        buf = self._bufs.get(name)
        if buf is None or buf.shape[0] < rows:
            buf = self._bufs[name] = np.empty((rows, *shape))
        return buf[:rows]

    def _buf_t(self, name: str, rows: int, cols: int) -> np.ndarray:
        """A reusable C-contiguous (rows, cols) float64 work array (cols = samples of the chunk)."""
        return symgram.work_array(self._bufs, name, rows, cols)

    def _tokens(self, tokens: np.ndarray, check: Callable[[float], None] | None,
                token_weights: np.ndarray | None, last_rows: np.ndarray | None,
                last_weights: np.ndarray | None) -> np.ndarray:
        """Add the chunk's token Grams (own and basis; weighted per token) and return X A (float64).

        token_gram += X^T diag(c) X (c: per-token weights, None = 1); last_token_gram += sum w x x^T
        over the rows `last_rows` (None: every token) with weights `last_weights`.
        """
        X = np.asarray(tokens, dtype=np.float64)
        t = X.shape[0]
        Xw = X if token_weights is None else X * token_weights[:, None]
        own = X.T @ Xw
        if check is not None:  # the diagonal bounds every squared token entry (NaN stays NaN)
            diag = np.diagonal(own) if token_weights is None else np.einsum("ij,ij->j", X, X)
            check(float(np.max(diag)) if diag.size else 0.0)
        if self._transform:
            Xb = self._buf("Xb", t, (self.d,))
            np.matmul(X, self.basis, out=Xb)
        else:
            Xb = X
        self.token_gram += own
        self.basis_token_gram += Xb.T @ (Xb if token_weights is None else Xb * token_weights[:, None])
        for src, dst in ((X, self.last_token_gram), (Xb, self.basis_last_token_gram)):
            L = src if last_rows is None else src[last_rows]
            dst += L.T @ (L if last_weights is None else L * last_weights[:, None])
        return Xb

    def _from_basis(self, Gb: np.ndarray) -> np.ndarray:
        """A^-T Gb A^-1: a token Gram of X A back in the tokens' own coordinates (symmetrised)."""
        if self._inv is None:
            return Gb.copy()
        own = self._inv.T @ Gb @ self._inv
        return 0.5 * (own + own.T)

    def _equal_moments(self, tokens: np.ndarray, B: int, n: int, check: Callable[[float], None] | None,
                       progress: Callable[[int], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """`_tokens` + `sequence_moments` for B sequences of n tokens, fused in cache-sized blocks.

        Per block of sequences: convert to float64, X A, and the batched (X A)^T (X A); the token
        Grams follow from S (the own one derived, `_from_basis`). Returns S of X A (B, d, d) and the
        last tokens of X A (B, d).
        """
        d = self.d
        X = tokens.reshape(B, n, d)
        S = self._buf("S", B, (d, d))
        step = max(1, _BLOCK_ELEMENTS // (n * d))
        work = self._buf("W", min(step, B) * n, (d,))
        work_b = self._buf("Wb", min(step, B) * n, (d,)) if self._transform else work
        for a in range(0, B, step):
            b = min(B, a + step)
            w = work[:(b - a) * n]
            np.copyto(w, X[a:b].reshape(-1, d))
            wb = work_b[:(b - a) * n]
            if self._transform:
                np.matmul(w, self.basis, out=wb)
            w3 = wb.reshape(b - a, n, d)
            np.matmul(w3.transpose(0, 2, 1), w3, out=S[a:b])
            if progress is not None:
                progress(b)  # sequences done
        Gb = S.sum(axis=0)
        # The own token Gram of these tokens is derived from that of X A (A^-T Gb A^-1, once per
        # pass in `result`): a GEMM over every token less per chunk. Exact zeros stay exact
        # (basis.whitening keeps a coordinate that is 0 in every token apart).
        own = self._from_basis(Gb)
        if check is not None:  # the diagonal bounds every squared token entry up to rounding (NaN stays NaN)
            check(float(np.max(np.diagonal(own))) * (1.0 + 1e-6))
        last_own = X[:, -1, :].astype(np.float64)
        last = last_own @ self.basis if self._transform else last_own
        self._derived_token_gram += Gb
        self.basis_token_gram += Gb
        self.last_token_gram += last_own.T @ last_own
        self.basis_last_token_gram += last.T @ last
        return S, last

    def add(self, tokens: np.ndarray, offsets: np.ndarray, targets: np.ndarray | None,
            check: Callable[[float], None] | None = None, weights: np.ndarray | None = None,
            tick: Callable[[float], None] | None = None) -> None:
        """Add one chunk: tokens (t, d) of any real dtype, offsets (B+1,) from 0, targets (B, d) or None.

        `check(top)` may reject the chunk, given a bound on the largest squared token entry, before
        anything is added. Causal mode, weights ((B,), or (t,) in causal mode) or a normalisation go
        through `_add_rows`. `tick(f)`, if given, is told the share f in [0, 1) of the chunk's work done
        while the per-sequence moments are computed (a progress bar inside a large chunk; the sums do
        not depend on it); the syrk that follows is one BLAS call and reports nothing.
        """
        d, psi = self.d, self.psi
        B = offsets.size - 1
        if B == 0:
            return
        if self.causal or weights is not None or self.normalize != "none":
            self._add_rows(tokens, offsets, targets, check, weights)
            return
        t0 = time.perf_counter()
        # the moments' share of a chunk's time: measured on the previous chunk; for the first, a guess
        # from the operation counts (the memory-bound moments cost ~30x a syrk flop)
        share = self._moments_share
        if share is None:
            m, s = 30.0 * tokens.shape[0] * d * d, 0.5 * B * self.width ** 2
            share = min(0.95, max(0.05, m / (m + s)))
        moments_done = None if tick is None else (lambda k: tick(share * k / B))
        # errstate: NaN / Inf tokens are reported by `check`, not as numpy warnings
        with _single_blas_thread(), np.errstate(invalid="ignore", over="ignore"):
            lengths = np.diff(offsets)
            if (lengths == lengths[0]).all() and offsets[0] == 0 and tokens.shape[0] == offsets[-1]:
                S, last = self._equal_moments(tokens, B, int(lengths[0]), check, moments_done)
            else:
                Xb = self._tokens(tokens, check, None, offsets[1:] - 1, None)
                S, last = sequence_moments(Xb, offsets, out=self._buf("S", B, (d, d)), progress=moments_done)
            # gather the distinct entries row-wise (contiguous), then transpose: ~10x faster than a
            # strided gather from the transposed view
            upper_rows = np.take(S.reshape(B, d * d), self._upper_idx, axis=1, out=self._buf("Ur", B, (psi // d,)))
            upper = self._buf_t("U", psi // d, B)
            np.multiply(upper_rows.T, self._scale[:, None], out=upper)  # canonical coordinates D upper(S)
            last_t = self._buf_t("L", d, B)
            last_t[...] = last.T
        t1 = time.perf_counter()
        self._add_target_sum(targets, None)
        # outside the one-thread block: the syrk uses the BLAS threads (`_syrk`)
        self._emit(upper, last_t, None if targets is None else targets.T)
        t2 = time.perf_counter()
        if t2 > t0:
            self._moments_share = min(0.95, max(0.05, (t1 - t0) / (t2 - t0)))
        self.n_sequences += B
        self.n_samples += B
        self.n_tokens += int(offsets[-1])
        self.weight_sum += B
        self.token_weight_sum += int(offsets[-1])

    def _add_rows(self, tokens: np.ndarray, offsets: np.ndarray, targets: np.ndarray | None,
                  check: Callable[[float], None] | None, weights: np.ndarray | None) -> None:
        """Add a chunk sample by sample: rows = positions (causal) or sequences, each of weight w >= 0.

        gram += sum w h h^T, moments += sum w h y^T, target_gram += sum w y y^T (one syrk of the block
        sqrt(w) [H | Y] over the rows with w > 0); token_gram += sum w S (unnormalised S of each
        sample), last_token_gram += sum w x x^T (x the sample's last token); n_samples += #{w > 0}.
        """
        d, psi = self.d, self.psi
        B = offsets.size - 1
        lengths = np.diff(offsets)
        T = int(offsets[-1])
        w_all = np.ones(T if self.causal else B) if weights is None else weights
        # sum over samples of w S = sum over tokens of c x x^T: c = the weight of the sequence
        # (last-token data), or the sum of the weights of the prefixes containing the token (causal)
        if self.causal:
            seq = np.repeat(np.arange(B), lengths)
            tail = np.cumsum(w_all[::-1])[::-1]
            ends = np.append(tail, 0.0)[offsets[1:]]
            c = tail - ends[seq]
            last_rows, last_w = None, w_all
        else:
            c = np.repeat(w_all, lengths)
            last_rows, last_w = offsets[1:] - 1, w_all
        unit = weights is None and not self.causal
        with _single_blas_thread(), np.errstate(invalid="ignore", over="ignore"):
            Xb = self._tokens(tokens, check, None if unit else c, last_rows, None if unit else last_w)
            upper, last = sample_rows(Xb, offsets, self.causal)  # unnormalised here
            keep = None
            if weights is not None:
                keep = np.flatnonzero(weights > 0)
                if keep.size == weights.size:
                    keep = None
            w = None if weights is None else (weights if keep is None else weights[keep])
            if keep is not None:
                upper, last = upper[keep], last[keep]
                if targets is not None:
                    targets = targets[keep]
            R = upper.shape[0]
            upper *= self._scale  # canonical coordinates
            if self.normalize == "length":
                if self.causal:
                    pos = position_numbers(offsets)
                    upper /= (pos if keep is None else pos[keep])[:, None]
                else:
                    lens = lengths.astype(np.float64)
                    upper /= (lens if keep is None else lens[keep])[:, None]
            if R:
                sw = None if w is None else np.sqrt(w)
                upper_t = self._buf_t("U", psi // d, R)
                upper_t[...] = upper.T
                last_t = self._buf_t("L", d, R)
                last_t[...] = last.T
                if sw is not None:
                    last_t *= sw  # sqrt(w) h = S (sqrt(w) x): the syrk then sums w h h^T
                y_t = None
                if targets is not None:
                    y_t = targets.T if sw is None else targets.T * sw
        if R:
            self._add_target_sum(targets, w)
            self._emit(upper_t, last_t, y_t)  # outside the one-thread block (the syrk's threads)
        self.n_samples += R
        self.n_tokens += T
        self.n_sequences += B
        # sum w over the samples, and sum w n = sum over the tokens of c (the weights of the samples
        # that contain the token)
        self.weight_sum += float(np.sum(w_all))
        self.token_weight_sum += float(np.sum(c))

    def _add_target_sum(self, targets: np.ndarray | None, w: np.ndarray | None) -> None:
        """target_sum += sum w y over the rows added (w None: all 1)."""
        if targets is None or self.target_sum is None or self.traces is not None:
            return
        y = np.asarray(targets, dtype=np.float64)
        self.target_sum += y.sum(axis=0) if w is None else w @ y

    def _emit(self, upper_t: np.ndarray, last_t: np.ndarray, targets_t: np.ndarray | None) -> None:
        """Add the rows' block [Ht | Y] to the Gram: upper_t (q, R) canonical S entries, last_t (d, R),
        targets_t (d, R) or None. On the host the block is built transposed, Ft = [Ht | Y]^T
        (psi + d, R), so that every elementwise loop runs over the R samples of the chunk (long,
        contiguous) instead of over d, then one syrk; on a device (`device.DeviceGram`) it is built
        there."""
        if self.device is not None:
            if self._dgram is None:
                from ..linalg.device import DeviceGram, DevicePairs

                q, r = self._factors
                self._dgram = (DevicePairs(self.device, q, r, self.d if self.has_targets else 0, self.spans)
                               if symgram.use_pairs(q, r) else DeviceGram(self.device, self.width, self.nf, self.spans))
            if self.width:
                self._dgram.add(upper_t, last_t, targets_t)
            return
        if self._pairs is not None:
            if self.spans is not None:  # the block coordinates E^T s and F^T x_n
                upper_t, last_t = self.spans[0].T @ upper_t, self.spans[1].T @ last_t
            # a wide block shares its panels out over as many Python threads as BLAS has threads
            # (each panel's GEMM on one BLAS thread: symgram.SymGram.add); a narrow one runs on one
            wide = self.width >= MIN_THREADED_WIDTH
            with contextlib.nullcontext() if wide else _single_blas_thread():
                self._pairs.add(upper_t, last_t, targets_t, threads=_blas_threads() if wide else 1)
            return
        with _single_blas_thread():  # elementwise work and small products
            Ft = self._buf_t("F", self.width, upper_t.shape[1])
            self._fill(Ft, upper_t, last_t)
            if targets_t is not None and self.traces is None:
                Ft[self.nf:] = targets_t
        if self.traces is None:
            self._syrk(Ft)  # with the BLAS threads a wide block pays for

    def _fill(self, Ft: np.ndarray, upper_t: np.ndarray, last_t: np.ndarray) -> None:
        """Ft[:nf] = the features of the rows, transposed: upper_t (q, R) canonical, last_t (d, R)."""
        R = upper_t.shape[1]
        if self.traces is not None:  # sum w ||x||^2 s s^T and sum w ||s||^2 x x^T (last_t holds sqrt(w) x)
            nx = np.einsum("ij,ij->j", last_t, last_t)
            ns = np.einsum("ij,ij->j", upper_t, upper_t)
            self.traces[0][...] += (upper_t * nx) @ upper_t.T
            self.traces[1][...] += (last_t * ns) @ last_t.T
            return
        if self.spans is not None:  # the block coordinates E^T s and F^T x_n
            upper_t, last_t = self.spans[0].T @ upper_t, self.spans[1].T @ last_t
        H = Ft[:self.nf].reshape(upper_t.shape[0], last_t.shape[0], R)
        # H_(j,k,l) = S[j,k] x_n[l] (BACKGROUND.md, "Why learning it is a linear regression")
        np.multiply(upper_t[:, None, :], last_t[None, :, :], out=H)

    def _syrk(self, Ft: np.ndarray) -> None:
        """G += Ft Ft^T on the lower triangle (mirrored in `result`), in place: one BLAS dsyrk into G,
        or (wider than POTRF_THREADED_MAX) panels of rows, each one GEMM Ft[a:b] Ft[:b]^T into a work
        array of about PANEL_BYTES added to G[a:b, :b]: the flops of a syrk, and no psi x psi product
        beside G. Several BLAS threads only pay off for a wide block.
        """
        W = self.width
        if W == 0:
            return
        with contextlib.nullcontext() if W >= MIN_THREADED_WIDTH else _single_blas_thread():
            if self.G is None:
                self.G = np.zeros((W, W))
            if W <= POTRF_THREADED_MAX:
                # BLAS dsyrk straight into G (no work array): G's lower triangle (C order) is the upper
                # triangle of the F-ordered G^T, and Ft Ft^T = (Ft^T)^T (Ft^T) with Ft^T F-ordered
                from scipy.linalg import blas

                out = blas.dsyrk(1.0, Ft.T, beta=1.0, c=self.G.T, trans=1, lower=0, overwrite_c=1)
                if not np.shares_memory(out, self.G):  # a copy was made: keep its triangle
                    self.G[...] = np.tril(out.T)
                return
            # above it OpenBLAS's threaded syrk segfaults (factorization.POTRF_THREADED_MAX): GEMM panels
            rows = max(1, min(W, PANEL_BYTES // (8 * W)))
            work = self._buf_t("P", rows, W)
            for a in range(0, W, rows):
                b = min(W, a + rows)
                w = work.reshape(-1)[:(b - a) * b].reshape(b - a, b)
                np.matmul(Ft[a:b], Ft[:b].T, out=w)
                self.G[a:b, :b] += w

    def result(self, token_dtype: str = "float64") -> Features:
        """The statistics, in the accumulator's basis (the accumulator is spent: its work buffers are
        released and its Gram becomes the result's, in place).

        G is mirrored from its lower triangle and compacted in place so that basis_gram is a
        C-contiguous psi x psi array at its start (moments and the target Gram are copied out first).
        `gram` and `moments` (own coordinates) are left to `Features.finalize`.
        """
        self._bufs.clear()
        psi, d = self.nf, self.d  # the features accumulated (all psi, or the block on the spans)
        if self._dgram is not None:
            out, self._dgram = self._dgram.result(), None
            if isinstance(out, symgram.SymGram):
                self._pairs = out
            else:
                self.G = out
        if self._pairs is not None:  # the Gram from its distinct entries (mhla_cli.linalg.symgram)
            pairs, self._pairs = self._pairs, None
            pairs.release_work()
            gram_b, moments, target_gram = pairs.gram(), pairs.moments(), pairs.target_gram()
        else:
            G = self.G if self.G is not None else np.zeros((self.width, self.width))
            self.G = None
            _mirror_lower(G)
            moments = G[:psi, psi:].copy() if self.has_targets else None
            target_gram = G[psi:, psi:].copy() if self.has_targets else None
            gram_b = _compact_leading(G, psi)
        token_gram = self.token_gram + self._from_basis(self._derived_token_gram)
        out = Features(d=d, n_samples=self.n_samples, n_tokens=self.n_tokens, gram=None,
                       token_gram=token_gram, last_token_gram=self.last_token_gram,
                       target_gram=target_gram, token_dtype=token_dtype,
                       basis=self.basis, basis_gram=gram_b, basis_moments=moments,
                       basis_token_gram=self.basis_token_gram, basis_last_token_gram=self.basis_last_token_gram,
                       per_position=self.causal, normalize=self.normalize, n_sequences=self.n_sequences,
                       target_sum=self.target_sum,
                       weight_sum=self.weight_sum, token_weight_sum=self.token_weight_sum)
        if self.spans is not None:
            out.span_pairs, out.span_last = self.spans
        return out


def _mirror_lower(G: np.ndarray, tile: int = 256) -> None:
    """G[i, j] = G[j, i] for i < j, in place, tile by tile (G exactly symmetric from its lower triangle)."""
    n = G.shape[0]
    for i0 in range(0, n, tile):
        i1 = min(n, i0 + tile)
        D = G[i0:i1, i0:i1]
        D[np.triu_indices(i1 - i0, 1)] = D.T[np.triu_indices(i1 - i0, 1)]
        for j0 in range(i1, n, tile):
            j1 = min(n, j0 + tile)
            G[i0:i1, j0:j1] = G[j0:j1, i0:i1].T


def _compact_leading(G: np.ndarray, n: int, rows: int = 256) -> np.ndarray:
    """The leading n x n block of a C-contiguous square G, moved in place to G's first n^2 entries.

    Returns a C-contiguous (n, n) view of G's memory (G's other entries are overwritten).
    """
    W = G.shape[0]
    flat = G.reshape(-1)
    if W == n:
        return G
    # row i moves from i W to i n <= i W: rows done in increasing order never overwrite a row still
    # to be moved (numpy buffers the overlap within a block)
    for a in range(0, n, rows):
        b = min(n, a + rows)
        flat[a * n:b * n].reshape(b - a, n)[...] = G[a:b, :n]
    return flat[:n * n].reshape(n, n)


def chunk_features(tokens: np.ndarray, offsets: np.ndarray, targets: np.ndarray | None, d: int,
                   weights: np.ndarray | None = None, per_position: bool = False,
                   normalize: str = "none", basis: np.ndarray | str | None = "auto",
                   device: str | None = None) -> Features:
    """Statistics of one in-memory chunk (tokens (t, d), offsets from 0, targets (B, d) or None).

    With `per_position` every prefix is a sample: targets (t, d), weights (t,); otherwise targets
    (B, d), weights (B,). `normalize="length"` divides S by the prefix / sequence length.
    `basis`: the basis accumulated in ("auto": the whitening of the chunk's own tokens; an array;
    None or "identity": the tokens' own coordinates); the result is then changed exactly to the
    whitening of the chunk's token Gram (`Features.canonical`). `device` (mhla_cli.linalg.device): where the
    features and their Gram are built.
    """
    check_normalize(normalize)
    check_floor(d, what="featurize")
    device = device_mod.check_device(device)
    tokens = np.asarray(tokens)
    basis = _basis_option(basis, d, None)
    if basis is None:
        X = tokens.astype(np.float64)
        basis = basis_mod.whitening(X.T @ X, X.shape[0])
    acc = _Accumulator(d, targets is not None, basis, causal=per_position, normalize=normalize, device=device)
    acc.add(tokens, np.asarray(offsets, dtype=np.int64),
            None if targets is None else np.asarray(targets, dtype=np.float64),
            weights=None if weights is None else np.asarray(weights, dtype=np.float64))
    feats = acc.result(str(tokens.dtype))
    check_overflow(feats, "the data", None)
    return feats.canonical().finalize()


def _basis_option(basis: np.ndarray | str | None, d: int, path: str | os.PathLike | None) -> np.ndarray | None:
    """A `basis` argument -> the (d, d) array to accumulate in, or None for "auto" (estimate it)."""
    if isinstance(basis, str):
        if basis == "auto":
            return None
        if basis != "identity":
            raise InputError(f"unknown basis '{basis}', expected auto, identity or a (d, d) array")
        return np.eye(d)
    if basis is None:
        return np.eye(d)
    A = np.asarray(basis, dtype=np.float64)
    if A.shape != (d, d) or not np.isfinite(A).all() or basis_mod.row_scaled_cond(A) > SINGULAR_BASIS_COND:
        raise InputError(f"the basis must be an invertible ({d}, {d}) array", path)
    return A


# --------------------------------------------------------------------------------------------
# the reduction
# --------------------------------------------------------------------------------------------


def default_chunk_size(info: TokensInfo) -> int:
    """Samples per chunk so that the chunk's buffers stay near CHUNK_BYTES."""
    psi = n_features(info.d)
    mean_len = max(1.0, info.n_tokens / info.n_samples)
    rows = CHUNK_BYTES // _sample_bytes(info)
    if psi + info.d >= 512:
        # the per-chunk cost outside the syrk (adding the psi^2 product) shrinks as 1/rows
        rows = max(rows, MIN_SYRK_ROWS if not getattr(info, "per_position", False)
                   else math.ceil(MIN_SYRK_ROWS / mean_len))
    return int(max(1, min(info.n_samples, rows)))


def _sample_bytes(info: TokensInfo) -> int:
    """Bytes of the chunk buffers per sample (sequence) of a chunk."""
    psi, d = n_features(info.d), info.d
    mean_len = max(1.0, info.n_tokens / info.n_samples)
    # [H | Y] block + S + pair products, and two float64 read slots of tokens and targets
    per_sample = 8 * (psi + d) + 8 * (d * d + psi // d) + 2 * 8 * d * (mean_len + 1)
    if getattr(info, "per_position", False):
        # every position is a row of the [H | Y] block, with its prefix Gram entries
        per_sample = mean_len * (8 * (psi + d) + 3 * 8 * (psi // d) + 4 * 8 * d)
    return int(per_sample)


def chunk_buffer_bytes(info: TokensInfo, chunk_size: int | None = None) -> int:
    """Bytes of one reduction's chunk buffers (mhla_cli.linalg.memory): the chunk's arrays and the panel."""
    rows = min(chunk_size or default_chunk_size(info), info.n_samples)
    W = n_features(info.d) + (info.d if info.has_targets else 0)
    panel = 8 * W * max(1, min(W, PANEL_BYTES // (8 * W)))
    return int(rows * _sample_bytes(info) * 1.25) + panel


def device_pass_bytes(info: TokensInfo, chunk_size: int | None = None, block: int | None = None) -> int:
    """Bytes a pass holds on a device (`device.DeviceGram`): the Gram of [Ht | Y] and a chunk's block."""
    W = (n_features(info.d) if block is None else block) + (info.d if info.has_targets else 0)
    rows = min(chunk_size or default_chunk_size(info), info.n_samples)
    if getattr(info, "per_position", False):
        rows = int(rows * max(1.0, info.n_tokens / info.n_samples))
    return 8 * W * W + 2 * 8 * W * rows + 64 * 2**20


def featurize_need(info: TokensInfo, chunk_size: int | None = None, workers: int = 1,
                   derive: bool = True, block: int | None = None) -> Callable[[int], int]:
    """need(d): the peak bytes of featurizing `info` with its dimension set to d (memory.check_memory).

    `block`: at the file's own d only that many features are accumulated (the data's spans).
    """
    def need(d: int) -> int:
        other = replace(info, d=d)
        if block is not None and d == info.d:
            return block_featurize_bytes(block, d, chunk_buffer_bytes(other, chunk_size), workers, info.has_targets)
        return featurize_bytes(d, chunk_buffer_bytes(other, chunk_size), workers, info.has_targets, derive)
    return need


def _add_chunks(acc: _Accumulator, info: TokensInfo, span: tuple[int, int], chunk_size: int | None = None,
                progress: Callable[[int], None] | None = None, prefetch: bool = True) -> None:
    """Read samples [lo, hi) in chunks, validate each and add it to `acc`.

    `progress(n)` gets the samples of every chunk, in up to PROGRESS_STEPS parts when the chunk reports
    its work as it goes (`_Accumulator.add`'s tick), so that a bar moves within the large chunks of a
    big file; the parts of a chunk sum to its samples, and nothing else depends on them.
    """
    per_position = getattr(info, "per_position", False)
    for a, b, tokens, offsets, targets, weights in iter_chunks(info, span, chunk_size or default_chunk_size(info),
                                                               prefetch, with_weights=True):
        if CANCEL.is_set():
            raise Cancelled("the reduction was cancelled")
        check_weights(weights, offsets, a, per_position, info.path)
        told = [0]  # samples of this chunk reported so far

        def tick(f: float, n: int = b - a, told: list[int] = told) -> None:
            k = min(n - 1, int(f * n))
            if k - told[0] >= max(1, n // PROGRESS_STEPS):
                progress(k - told[0])
                told[0] = k
        acc.add(tokens, offsets, targets if acc.has_targets else None,
                check=lambda top, a=a, t=tokens, o=offsets, y=targets: check_chunk(info, a, t, o, y, top),
                weights=weights, tick=None if progress is None else tick)
        if progress is not None:
            progress(b - a - told[0])


# A chunk's progress is reported in at most this many parts (`_add_chunks`).
PROGRESS_STEPS = 64


def reduce_span(info: TokensInfo, span: tuple[int, int], chunk_size: int | None = None,
                progress: Callable[[int], None] | None = None, prefetch: bool = True,
                normalize: str = "none", basis: np.ndarray | None = None, finalize: bool = True,
                spans: tuple[np.ndarray, np.ndarray] | None = None, device: str | None = None) -> Features:
    """Statistics of samples [lo, hi) of the tokens file `info.path` (opened here, read in chunks).

    This is the one chunk reduction of mhla: the serial loop, worker pools, Dask and shards all
    call it. `progress(n)` is called after each chunk of n samples (sequences). Per-position data
    (info.per_position) make every weighted prefix a sample; `normalize="length"` divides S by the
    prefix (sequence) length. `basis` (d, d; None = the identity): accumulate the features of
    X @ basis (mhla_cli.statistics.basis). `finalize=False` returns the sums of that basis as they are (partial
    sums of a larger reduction add exactly); otherwise they are changed to the whitening of the
    span's tokens and the own-coordinate sums derived. `spans` (E, F) in the canonical coordinates of
    `basis`: accumulate only the block on the data's spans (mhla_cli.statistics.structure, `find_spans`).
    `device` (mhla_cli.linalg.device): build the features and their Gram there ("cuda" in a worker process:
    one GPU per worker); the result is the same float64 Features.
    """
    lo, hi = span
    per_position = getattr(info, "per_position", False)
    device = device_mod.worker_device(device)
    acc = _Accumulator(info.d, info.has_targets, basis, causal=per_position, normalize=check_normalize(normalize),
                       spans=spans, device=device)
    _add_chunks(acc, info, span, chunk_size, progress, prefetch)
    total = acc.result(info.dtype)
    check_overflow(total, f"samples {lo}..{hi}", info.path)
    if finalize:
        total.canonical().finalize()
        check_overflow(total, f"samples {lo}..{hi}", info.path)
    total.sample_range = (lo, hi)
    return total


def estimate_basis(info: TokensInfo) -> np.ndarray:
    """An estimate of the whitening of a tokens file, from a fixed sample (basis.sample_blocks).

    Deterministic in the file's content (every shard, worker and machine gets the same basis, so
    their sums add up exactly). It only has to be good enough to accumulate in: `featurize` checks it
    against the token Gram of all the data at the end of the pass (basis.correction).
    """
    G = np.zeros((info.d, info.d))
    count = 0
    bufs = ReadBuffers()
    with formats.open_input(info.path) as f, np.errstate(invalid="ignore", over="ignore"):
        for a, b in basis_mod.sample_blocks(info.n_samples, info.n_tokens):
            tokens, offsets, targets = read_chunk(f, info, a, b, bufs)
            X = tokens.astype(np.float64)
            top = float(np.max(X * X)) if X.size else 0.0
            check_chunk(info, a, tokens, offsets, targets, top)
            G += X.T @ X
            count += X.shape[0]
    return basis_mod.whitening(G, count)


def reduce_spans(info: TokensInfo, span_list: Sequence[tuple[int, int]],
                 map: Callable[..., Iterable[Features]] = builtins.map,  # noqa: A002 (like builtins.map)
                 chunk_size: int | None = None,
                 progress: Callable[[int], None] | None = None, normalize: str = "none",
                 basis: np.ndarray | None = None, finalize: bool = True,
                 spans: tuple[np.ndarray, np.ndarray] | None = None, device: str | None = None) -> Features:
    """Sum of `reduce_span` over `span_list`, evaluated with `map` (builtin, a pool's, Dask's).

    `map(fn, spans)` may also yield partial sums (Dask tree-reduces on the cluster); the parts are
    added in the order they come, all in `basis`. `finalize` as in `reduce_span`. `progress` is told
    each part's samples when it comes back, or, with worker threads of this process
    (parallel.ThreadMap), each chunk's as the workers go (one call at a time).
    """
    total: Features | None = None
    threads = progress is not None and isinstance(map, parallel.ThreadMap)
    lock, raised = threading.Lock(), []

    def locked(n: int) -> None:
        with lock:
            if raised:  # the callback raised (e.g. to interrupt): it is not called again
                return
            try:
                progress(n)  # type: ignore[misc]
            except BaseException:
                raised.append(True)
                raise
    for part in map(partial(reduce_span, info, chunk_size=chunk_size, normalize=normalize, basis=basis,
                            finalize=False, spans=spans, device=device, progress=locked if threads else None),
                    span_list):
        if total is None:
            total = part  # each part is a fresh result: sum into it
        else:
            add_into(total, part)
        if progress is not None and not threads:
            progress(part.n_sequences if part.n_sequences is not None else part.n_samples)
    if total is None:
        total = _Accumulator(info.d, info.has_targets, basis, causal=getattr(info, "per_position", False),
                             normalize=normalize, spans=spans).result(info.dtype)
    if finalize:
        total.canonical().finalize()
    total.token_dtype = info.dtype
    if span_list:
        total.sample_range = (span_list[0][0], span_list[-1][1])
    return total


def work_spans(lo: int, hi: int, chunk_size: int, n_workers: int, per_worker: int = 4) -> list[tuple[int, int]]:
    """About `per_worker` spans per worker (for load balance), each at least one chunk long."""
    n = hi - lo
    parts = max(1, min(math.ceil(n / max(1, chunk_size)), per_worker * max(1, n_workers)))
    return [(lo + (n * i) // parts, lo + (n * (i + 1)) // parts) for i in range(parts)]


def featurize(path: str | os.PathLike, chunk_size: int | None = None,
              shard: tuple[int, int] | None = None,
              map: Callable[..., Iterable[Features]] | None = None,  # noqa: A002
              progress: Callable[[int], None] | None = None,
              workers: int = 1, scheduler: str | None = None, normalize: str = "none",
              basis: np.ndarray | str | None = "auto", spans: str = "auto", device: str | None = None) -> Features:
    """Sufficient statistics of a tokens file, streamed in chunks of `chunk_size` samples.

    `shard=(i, M)` restricts to the i-th (0-based) of M contiguous sample ranges. Parallelism:
    `workers=K` (a local pool, see mhla_cli.statistics.parallel), `scheduler` (a Dask address, or "local" /
    "local:K"), or any `map` (builtin map, a pool's map, ...) over the spans; all call `reduce_span`.
    Per-position data (targets (T, d) or weights per position) are featurized causally: every
    prefix with weight > 0 is a sample. `normalize="length"` divides S by the number of tokens.

    The basis: the pass accumulates in an estimate (`basis` "auto": `estimate_basis`, from the whole
    file whatever the shard; a (d, d) array; None / "identity": the tokens' own coordinates), which
    is then checked against the token Gram of all the data read (of the shard, for a shard): the
    sums are changed exactly to its whitening when that change is well conditioned
    (cond <= basis.CHANGE_COND), and otherwise the pass is redone in that whitening. The result is
    always in the whitening of its own data (`Features.canonical`).

    `device` (mhla_cli.linalg.device: "cpu" / None numpy, "cuda", "cuda:I", "torch:cpu"): where the features
    and their Gram are built (with workers, "cuda" gives each worker one GPU in turn); its free memory
    is checked before the pass.
    """
    check_normalize(normalize)
    check_spans(spans)
    device = device_mod.check_device(device, path)
    info = inspect_tokens(path)
    check_floor(info.d, path, "featurize")  # wide tokens: before anything of their size
    require_square(info, "featurize")
    serial = map is None and workers <= 1 and scheduler is None
    # every feature for sure: refused before any work (a pool's workers are counted once it is made);
    # otherwise after the cheap span pass, with the block it found
    whole = spans == "off" or (spans == "auto" and n_features(info.d) < SPANS_MIN_FEATURES)
    if serial and whole:
        check_memory(info.d, path=path, need=featurize_need(info, chunk_size), what="featurize")
    A = _basis_option(basis, info.d, path)
    if A is None:
        A = estimate_basis(info)
    lo, hi = shard_span(info.n_samples, shard, path)
    size = chunk_size or default_chunk_size(info)
    # the data's spans (a cheap pass; none spent when the basis sample already fills psi)
    found, A, span_passes = find_spans(info, A, (lo, hi), size, normalize, spans)
    if serial and not whole:
        check_memory(info.d, path=path, need=featurize_need(info, chunk_size, block=_block(found)), what="featurize")
    if serial:
        device_mod.check_device_memory(device, device_pass_bytes(info, size, _block(found)), "featurize", path)

    def spans_in(A_run: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The spans in the canonical coordinates of the basis A_run (a redone pass changes it)."""
        if found is None or basis_mod.same(A_run, A):
            return found
        Ct = basis_mod.transition(A, A_run)
        return structure_mod.change(found[0], found[1], basis_mod.orth_pair_map(Ct), Ct.T)[:2]

    if serial:

        def run(A: np.ndarray) -> Features:
            return reduce_span(info, (lo, hi), size, progress=progress, normalize=normalize, basis=A,
                               finalize=False, spans=spans_in(A), device=device)
        feats = _in_whitening(run, A)
    else:
        with parallel.make_map(workers=workers, scheduler=scheduler, map=map) as pmap:
            check_memory(info.d, copies=pmap.local_copies, path=path,
                         need=featurize_need(info, chunk_size, pmap.local_copies, block=_block(found)),
                         what="featurize")
            # each worker holds its own Gram on its device (device.worker_device)
            device_mod.check_device_memory(
                device, device_mod.workers_per_device(device, pmap.local_copies)
                * device_pass_bytes(info, size, _block(found)), f"featurize ({pmap.local_copies} workers)", path)
            # workers (possibly on other hosts) open the file themselves: give them an absolute path
            winfo = replace(info, path=os.path.abspath(info.path))
            spans_ = work_spans(lo, hi, size, pmap.n_workers)

            def run(A: np.ndarray) -> Features:
                return reduce_spans(winfo, spans_, map=pmap, chunk_size=size, progress=progress,
                                    normalize=normalize, basis=A, finalize=False, spans=spans_in(A),
                                    device=device)
            feats = _in_whitening(run, A)
    feats.extra_attrs["span_passes"] = span_passes
    if feats.n_samples == 0:
        raise InputError(f"every weight of samples {lo}..{hi} is 0: there is no sample to learn from", path)
    feats.finalize()
    check_overflow(feats, f"samples {lo}..{hi}", path)
    feats.sample_range = (lo, hi)
    feats.token_dtype = info.dtype
    feats.source = dict(formats.source_identity(path), n_samples=info.n_samples)
    if shard is not None:
        feats.extra_attrs["shard"] = f"{shard[0]}/{shard[1]}"
    return feats


# "auto": featurize accumulates only the block on the data's spans when it holds at most this share
# of the psi features (below it the block's factorization costs <= 1/8 of the full one, O(n^3)).
SPANS_SHARE = 0.5
# ... and psi is at least this (smaller statistics are cheap whole, and keep every feature for the
# commands that need them: low-rank fits, the witness, folds).
SPANS_MIN_FEATURES = 2048
SPANS = ("auto", "on", "off")


def check_spans(spans: str) -> str:
    """Validate featurize's `spans` option."""
    if spans not in SPANS:
        raise InputError(f"unknown spans option '{spans}', expected auto, on or off")
    return spans


def span_traces(info: TokensInfo, span: tuple[int, int], A: np.ndarray, chunk_size: int | None = None,
                normalize: str = "none") -> tuple[np.ndarray, np.ndarray, Features]:
    """The two partial traces of the canonical Gram of samples [lo, hi) in basis A (tokens X A):
    sum w ||x_n||^2 s s^T (q x q) and sum w ||s||^2 x_n x_n^T (d x d) (mhla_cli.statistics.structure), and the
    token Grams of the same pass (a Features without feature sums, for `Features.correction`).

    A cheap pass: O(q^2) per sample instead of the Gram's O(psi^2).
    """
    acc = _Accumulator(info.d, False, A, causal=getattr(info, "per_position", False),
                       normalize=check_normalize(normalize), traces=True)
    _add_chunks(acc, info, span, chunk_size)
    tp, tl = acc.traces  # type: ignore[misc]
    return 0.5 * (tp + tp.T), 0.5 * (tl + tl.T), acc.result(info.dtype)


def find_spans(info: TokensInfo, A: np.ndarray, span: tuple[int, int], chunk_size: int,
               normalize: str = "none", spans: str = "auto"
               ) -> tuple[tuple[np.ndarray, np.ndarray] | None, np.ndarray, int]:
    """((E, F) bases of the data's spans in the canonical coordinates of the returned basis, or None:
    accumulate every feature; the basis to accumulate in; the passes over the data spent).

    The spans are read off partial traces in a basis that whitens the data to within
    basis.CHANGE_COND (else the pass is redone in the whitening it measured, which is then returned):
    in a badly scaled basis the traces' small directions would fall under the cut. "auto" first looks
    at the fixed sample of `estimate_basis` (its spans are within the data's): when they already hold
    more than SPANS_SHARE of the features, no pass is spent.
    """
    if check_spans(spans) == "off":
        return None, A, 0
    check_floor(info.d, info.path, "featurize")
    share = 1.0 if spans == "on" else SPANS_SHARE
    psi = n_features(info.d)
    if spans == "auto" and psi < SPANS_MIN_FEATURES:
        return None, A, 0
    if spans == "auto":
        blocks = basis_mod.sample_blocks(info.n_samples, info.n_tokens)
        tp, tl = np.zeros((psi // info.d, psi // info.d)), np.zeros((info.d, info.d))
        for block in blocks:
            a, b, _ = span_traces(info, block, A, chunk_size, normalize)
            tp += a
            tl += b
        st = structure_mod.from_traces(tp, tl)
        if not st.reduced or st.n > share * psi:
            return None, A, 0
    tp, tl, part = span_traces(info, span, A, chunk_size, normalize)
    passes = 1
    C, cond = part.correction()
    if C is not None and cond > basis_mod.CHANGE_COND:
        A = basis_mod.round32(part.basis @ C)
        tp, tl, _ = span_traces(info, span, A, chunk_size, normalize)
        passes = 2
    st = structure_mod.from_traces(tp, tl)
    if not st.reduced or st.n > share * psi:
        return None, A, passes
    return (np.ascontiguousarray(st.E), np.ascontiguousarray(st.F)), A, passes


def _block(found: tuple[np.ndarray, np.ndarray] | None) -> int | None:
    """Features of the block on the data's spans (None: all psi)."""
    return None if found is None else int(found[0].shape[1] * found[1].shape[1])


def _in_whitening(run: Callable[[np.ndarray], Features], A: np.ndarray) -> Features:
    """run(A) (a pass accumulating in basis A), verified against the whitening of the data it read.

    The sums are changed exactly to that whitening when the change is well conditioned; otherwise
    the pass is redone once in it (its float32 rounding then needs only a tiny exact change).
    Records `basis_passes` (1 or 2) and `basis_correction_cond` (cond of the first correction) in
    extra_attrs (attributes of the features file).
    """
    feats = run(A)
    C, cond = feats.correction()
    passes = 1
    if C is not None and cond > basis_mod.CHANGE_COND:
        feats = run(basis_mod.round32(feats.basis @ C))
        passes = 2
    feats.extra_attrs.update(basis_passes=passes, basis_correction_cond=float(cond))
    return feats.canonical()


def shard_span(n: int, shard: tuple[int, int] | None, path: str | os.PathLike | None = None) -> tuple[int, int]:
    """The sample range [lo, hi) of shard (i, M) of n samples (all of them for None); validated here."""
    if shard is None:
        return 0, n
    i, m = shard
    if not (m >= 1 and 0 <= i < m):
        raise InputError(f"shard {i}/{m}: need 0 <= i < M")
    lo, hi = shard_range(n, i, m)
    if hi <= lo:
        raise InputError(f"shard {i}/{m} is empty: the file has only {n} samples", path)
    return lo, hi


def shard_range(n: int, i: int, m: int) -> tuple[int, int]:
    """The i-th of m contiguous, nearly equal ranges of [0, n)."""
    return (n * i) // m, (n * (i + 1)) // m


def solve_need(path: str | os.PathLike, ridge: float = 0.0, lowrank: bool = False,
               chunk_size: int | None = None, command: str = "certify") -> tuple[int, Callable[[int], int]] | None:
    """(d, need(d)): the peak bytes of certifying / fitting (`command`) the statistics of a features or
    tokens file (a tokens file is featurized first), for memory.check_memory; None for other kinds."""
    kind = formats.kind_of(path)
    if kind == "features":
        with formats.open_input(path) as f:
            d = formats.read_attr_int(f, "d", path)
            n = formats.read_attr_int(f, "n_samples", path)
            block = formats.stored_block(f)
        if block is not None and not lowrank:  # only the block on the data's spans is factorized
            kind_b = solve_kind(d, n, ridge, lowrank, command, n=block)
            return d, lambda k: (block_solve_bytes(block, kind_b) if k == d
                                 else solve_bytes(k, solve_kind(k, n, ridge, lowrank, command)))
        return d, lambda k: solve_bytes(k, solve_kind(k, n, ridge, lowrank, command))
    if kind == "tokens":
        info = inspect_tokens(path)
        check_floor(info.d, path, command)
        require_square(info, command)
        if n_features(info.d) >= SPANS_MIN_FEATURES and not lowrank:
            return None  # featurize may find a block on the data's spans: it checks its pass itself
        n = info.n_tokens if info.per_position else info.n_samples
        pass_ = featurize_need(info, chunk_size, derive=False)
        return info.d, lambda k: max(pass_(k), solve_bytes(k, solve_kind(k, n, ridge, lowrank, command)))
    return None


def check_solve_memory(path: str | os.PathLike, what: str, ridge: float = 0.0, lowrank: bool = False,
                       chunk_size: int | None = None) -> None:
    """Refuse before any work a certify / fit of `path` that cannot fit in memory (`solve_need`)."""
    job = solve_need(path, ridge, lowrank, chunk_size, command=what)
    if job is not None:
        check_memory(job[0], path=path, need=job[1], what=what)


def load_features(path: str | os.PathLike, chunk_size: int | None = None, normalize: str | None = None,
                  progress: Callable[[int], None] | None = None, device: str | None = None) -> Features:
    """The statistics of a features file, or of a tokens file (featurized here, streamed, on `device`).

    `normalize` (if given) must match a features file's normalisation, and is applied to a tokens file.
    """
    if normalize is not None:
        check_normalize(normalize)
    kind = formats.kind_of(path)
    if kind == "features":
        feats = Features.load(path)
        if normalize is not None and normalize != feats.normalize:
            raise InputError(f"was featurized with normalisation '{feats.normalize}', not '{normalize}'; "
                             "featurize it again with the normalisation wanted", path)
        return feats
    if kind == "tokens":
        return featurize(path, chunk_size=chunk_size, progress=progress, normalize=normalize or "none",
                         device=device)
    raise InputError(f"is a {kind} file, expected a tokens or features file", path)

