"""The accumulator of one pass: running sums of a chunk stream in one basis (`Accumulator`), and
the statistics of one in-memory chunk (`chunk_features`).

Per chunk the tokens are transformed to the pass's basis (X A), the per-sequence (X A)^T (X A) are
batched matmuls (mhla_cli.kernels), and the canonical sums are updated either by the Gram's
distinct entries K = U^T V (mhla_cli.linalg.symgram: half the flops of a syrk, for d >=
symgram.SYMGRAM_MIN_D) or by one syrk of the block [Ht | Y] (docs/performance.md), by the backend of
`device` (mhla_cli.linalg.backends: the host's HostGram, or torch's on a device).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mhla_cli.statistics import basis as basis_mod
from mhla_cli import bias_terms as bias_mod
from mhla_cli.linalg import device as device_mod
from mhla_cli.linalg import symgram
from mhla_cli.numerics import SINGULAR_BASIS_COND
from mhla_cli.linalg.backends import MIN_THREADED_WIDTH, PANEL_BYTES, single_blas_thread, get_backend, gram_parts
from mhla_cli.errors import InputError
from mhla_cli.feature_map import n_features, pair_index
from mhla_cli.linalg.memory import check_floor
from mhla_cli.kernels import BLOCK_ELEMENTS, sequence_moments
from mhla_cli.samples import LAST, ReadSpec, Samples, samples_of
from mhla_cli.statistics.affine_sums import AffineSums, split_targets
from mhla_cli.statistics.features import Features, check_overflow

__all__ = ["MIN_THREADED_WIDTH", "PANEL_BYTES", "chunk_features"]


class Accumulator:
    """Running sums of one pass in one basis A, with reusable work buffers.

    Per chunk the tokens are transformed first (X A, a d x d product per token: docs/certificate.md), the features are those of X A in canonical coordinates
    (mhla_cli.statistics.basis), and the Gram of the block [Ht | Y] (B x (psi + d)) holds basis_gram,
    basis_moments and target_gram at once, so each chunk costs one syrk (numpy's `Ft @ Ft.T` on the
    transposed block); the backend's Gram (`_gram`: backends.HostGram, device.DeviceGram) accumulates it in
    float64. From symgram.SYMGRAM_MIN_D on (symgram.SymGram, or device.DevicePairs on a device) the chunk
    instead adds the Gram's distinct entries K = U^T V of the
    two factors s and x_n (mhla_cli.linalg.symgram), and `result` holds basis_gram as K (symgram.Pairs:
    changed on the factors, expanded exactly when first read or written). The token
    Grams are accumulated both on the tokens' own coordinates (exact zeros stay zeros) and on X A.
    """

    def __init__(self, d: int, has_targets: bool, basis: np.ndarray | None = None, samples: Samples = LAST,
                 normalize: str = "none", spans: tuple[np.ndarray, np.ndarray] | None = None,
                 traces: bool = False, device: str | None = None, n_affine: int = 0,
                 d_out: int | None = None) -> None:
        self.samples = samples  # what a sample is (mhla_cli.samples: its rows, see _add_rows)
        self.normalize = normalize
        self.n_sequences = 0
        self.d = d
        self.basis = np.eye(d) if basis is None else np.asarray(basis, dtype=np.float64)
        self._transform = not basis_mod.same(self.basis, None)
        self.psi = n_features(d)
        # spans (E (q, a), F (d, b)): accumulate only the block features (E^T s) (x) (F^T x_n)
        # (mhla_cli.statistics.structure); nf features in all
        self.spans = None if spans is None else (np.ascontiguousarray(spans[0], dtype=np.float64),
                                                 np.ascontiguousarray(spans[1], dtype=np.float64))
        self.nf = self.psi if spans is None else int(spans[0].shape[1] * spans[1].shape[1])
        # traces: accumulate only the two partial traces of the canonical Gram (`find_spans`)
        self.traces = (np.zeros((self.psi // d, self.psi // d)), np.zeros((d, d))) if traces else None
        if traces:
            self.nf, has_targets, n_affine = 0, False, 0
        self.has_targets = has_targets
        # the affine block (mhla_cli.statistics.affine_sums): its n_affine features f ride beside the targets,
        # [y, f], so that the one Gram of [Ht | y | f] holds its sums too; `result` splits them off
        self.n_affine = int(n_affine)
        # the targets' width D_out (None: d); the Gram of the features does not depend on it
        self.d_out = d if d_out is None else int(d_out)
        self.n_targets = (self.d_out if has_targets else 0) + self.n_affine
        self.width = self.nf + self.n_targets
        # the backend (mhla_cli.linalg.backends, resolved once from `device`) accumulates the features'
        # Gram (host: backends.HostGram, a syrk or the Gram's distinct entries; torch: device.DeviceGram /
        # DevicePairs); the token-side work (S, the token Grams, the traces of a span pass) stays here
        self.backend = get_backend(None if traces else device)
        self.device = self.backend.device
        factors: tuple[int, int] = (self.psi // d, d) if self.spans is None \
            else (self.spans[0].shape[1], self.spans[1].shape[1])
        self._gram: Any = None if traces else self.backend.gram(*factors, self.n_targets, self.width,
                                                               self.nf, self.spans, pairs=samples.window_rows)
        self._bufs: dict[str, np.ndarray] = {}
        j, k = pair_index(d)
        self._upper_idx = (j * d + k).astype(np.intp)
        self._scale = np.ascontiguousarray(basis_mod.pair_scale(d))
        self.token_gram = np.zeros((d, d))
        self.last_token_gram = np.zeros((d, d))
        self.basis_token_gram = np.zeros((d, d))
        self.basis_last_token_gram = np.zeros((d, d))
        self._derived_token_gram = np.zeros((d, d))  # basis token Gram whose own one is derived in result()
        self._derived_last_token_gram = np.zeros((d, d))  # the same for the query tokens' Gram
        self._inv = None if not self._transform else np.linalg.inv(self.basis)
        self.n_samples = 0
        # sum w y over the samples with targets (Features.target_sum; and sum w f of the affine block)
        self.target_sum = np.zeros(self.n_targets) if self.n_targets else None
        self._moments_share: float | None = None  # of a chunk's time in `add`, for its progress ticks
        self.n_tokens = 0
        # the weight totals (Features): sum w over the samples, sum w n over their tokens
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

    def _basis_tokens(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(X, X A) of a chunk's tokens, float64 (X A in a reused buffer; X itself without a basis)."""
        X = np.asarray(tokens, dtype=np.float64)
        if not self._transform:
            return X, X
        Xb = self._buf("Xb", X.shape[0], (self.d,))
        np.matmul(X, self.basis, out=Xb)
        return X, Xb

    def _tokens(self, tokens: np.ndarray, check: Callable[[float], None] | None,
                token_weights: np.ndarray | None, last_rows: np.ndarray | None,
                last_weights: np.ndarray | None, basis_tokens: tuple[np.ndarray, np.ndarray] | None = None
                ) -> np.ndarray:
        """Add the chunk's token Grams (own and basis; weighted per token) and return X A (float64).

        token_gram += X^T diag(c) X (c: per-token weights, None = 1); last_token_gram += sum w x x^T
        over the rows `last_rows` (None: every token) with weights `last_weights`. `basis_tokens`: (X, X A)
        already made (`_basis_tokens`).
        """
        X = np.asarray(tokens, dtype=np.float64) if basis_tokens is None else basis_tokens[0]
        Xw = X if token_weights is None else X * token_weights[:, None]
        own = X.T @ Xw
        if check is not None:  # the diagonal bounds every squared token entry (NaN stays NaN)
            diag = np.diagonal(own) if token_weights is None else np.einsum("ij,ij->j", X, X)
            check(float(np.max(diag)) if diag.size else 0.0)
        Xb = self._basis_tokens(X)[1] if basis_tokens is None else basis_tokens[1]
        self.token_gram += own
        self.basis_token_gram += Xb.T @ (Xb if token_weights is None else Xb * token_weights[:, None])
        for src, dst in ((X, self.last_token_gram), (Xb, self.basis_last_token_gram)):
            L = src if last_rows is None else src[last_rows]
            dst += L.T @ (L if last_weights is None else L * last_weights[:, None])
        return Xb

    def _derived_grams(self, grams: tuple[np.ndarray, np.ndarray, np.ndarray],
                       check: Callable[[float], None] | None) -> None:
        """Add the token Grams a layout's rows carry (samples.Rows.token_grams, in the basis: sum w S, sum w x x^T
        over the queries, and the plain sum of the tokens' x x^T, which bounds every squared token entry for
        `check`); the own-coordinate ones are derived from them once per pass (`result`, `_from_basis`)."""
        token_b, query_b, plain_b = grams
        if check is not None:  # up to rounding (NaN stays NaN)
            check(float(np.max(np.diagonal(self._from_basis(plain_b)))) * (1.0 + 1e-6))
        self._derived_token_gram += token_b
        self.basis_token_gram += token_b
        self._derived_last_token_gram += query_b
        self.basis_last_token_gram += query_b

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
        step = max(1, BLOCK_ELEMENTS // (n * d))
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
        anything is added. Per-position samples (targets (t, d)), weights ((B,), or (t,) per position) or a
        normalisation go through `_add_rows`. `tick(f)`, if given, is told the share f in [0, 1) of the chunk's work done
        while the per-sequence moments are computed (a progress bar inside a large chunk; the sums do
        not depend on it); the syrk that follows is one BLAS call and reports nothing.
        """
        d, psi = self.d, self.psi
        B = offsets.size - 1
        if B == 0:
            return
        if self.samples.per_position or weights is not None or self.normalize != "none":
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
        with single_blas_thread(), np.errstate(invalid="ignore", over="ignore"):
            lengths = np.diff(offsets)
            if (lengths == lengths[0]).all() and offsets[0] == 0 and tokens.shape[0] == offsets[-1]:
                S, last = self._equal_moments(tokens, B, int(lengths[0]), check, moments_done)
            else:
                Xb = self._tokens(tokens, check, None, offsets[1:] - 1, None)
                S, last = sequence_moments(Xb, offsets, out=self._buf("S", B, (d, d)), progress=moments_done)
            # gather the distinct entries row-wise (contiguous reads), then transpose, not a strided
            # gather from the transposed view (one cache line per entry)
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
        """Add a chunk as its layout's rows (mhla_cli.samples: `Samples.rows`), every sample of weight w >= 0.

        A row of one sample: gram += w h h^T, moments += w h y^T, target_gram += w y y^T (one syrk of the
        block sqrt(w) [H | Y], or K); a row of a window's samples (BIDIRECTIONAL): gram += (s s^T) (x)
        (X^T W X), moments += s (x) (X^T W Y) (K). token_gram += sum w S (unnormalised S of each sample),
        last_token_gram += sum w x x^T (x the sample's query token); n_samples += #{w > 0}.
        """
        B = offsets.size - 1
        T = int(offsets[-1])
        c, query_rows, query_weights = self.samples.token_weights(offsets, weights)
        with single_blas_thread(), np.errstate(invalid="ignore", over="ignore"):
            X, Xb = self._basis_tokens(tokens)
            rows = self.samples.rows(Xb, offsets, weights, targets)
            if rows.token_grams is None:
                self._tokens(X, check, c, query_rows, query_weights, (X, Xb))
            else:  # the rows' own token Grams (a window's S): no pass over the tokens
                self._derived_grams(rows.token_grams, check)
            upper = rows.upper
            upper *= self._scale  # canonical coordinates
            if self.normalize == "length":
                upper /= rows.lengths[:, None]
            R = rows.n_rows
            if R and rows.xx is None:
                assert rows.x is not None, "rows of one sample each hold its query token"
                block = self._transposed_rows(upper, rows.x, rows.y, rows.w)
        if R and rows.xx is None:
            self._add_target_sum(rows.y, rows.w)
            self._emit(*block)  # outside the one-thread block (the syrk's threads)
        elif R:
            self._emit_windows(upper, rows)
        self.n_samples += rows.n_samples
        self.n_tokens += T
        self.n_sequences += B
        # sum w over the samples, and sum w n = sum over the tokens of c (the weights of the samples
        # that contain the token)
        self.weight_sum += float(np.sum(weights)) if weights is not None else float(self.samples.count(B, T))
        self.token_weight_sum += float(np.sum(c)) if c is not None else float(T)

    def _transposed_rows(self, upper: np.ndarray, last: np.ndarray, targets: np.ndarray | None,
                         w: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The rows' factors transposed into the work buffers, weighted by sqrt(w) (w None: all 1):
        (upper_t (q, R), last_t (d, R), targets_t (d, R) or None) for `_emit`."""
        R = upper.shape[0]
        sw = None if w is None else np.sqrt(w)
        upper_t = self._buf_t("U", self.psi // self.d, R)
        upper_t[...] = upper.T
        last_t = self._buf_t("L", self.d, R)
        last_t[...] = last.T
        if sw is not None:
            last_t *= sw  # sqrt(w) h = S (sqrt(w) x): the syrk then sums w h h^T
        y_t = None
        if targets is not None:
            y_t = targets.T if sw is None else targets.T * sw
        return upper_t, last_t, y_t

    def _add_target_sum(self, targets: np.ndarray | None, w: np.ndarray | None) -> None:
        """target_sum += sum w y over the rows added (w None: all 1)."""
        if targets is None or self.target_sum is None or self.traces is not None:
            return
        y = np.asarray(targets, dtype=np.float64)
        self.target_sum += y.sum(axis=0) if w is None else w @ y

    def _emit(self, upper_t: np.ndarray, last_t: np.ndarray, targets_t: np.ndarray | None) -> None:
        """Add the rows' block [Ht | Y] to the backend's Gram (`backends.HostGram`, `device.DeviceGram`, ...):
        upper_t (q, R) canonical S entries, last_t (d, R), targets_t (d, R) or None; in a span pass, the
        two partial traces instead."""
        if self.traces is not None:  # sum w ||x||^2 s s^T and sum w ||s||^2 x x^T (last_t holds sqrt(w) x)
            with single_blas_thread():
                nx = np.einsum("ij,ij->j", last_t, last_t)
                ns = np.einsum("ij,ij->j", upper_t, upper_t)
                self.traces[0][...] += (upper_t * nx) @ upper_t.T
                self.traces[1][...] += (last_t * ns) @ last_t.T
            return
        if self.width:
            self._gram.add(upper_t, last_t, targets_t)

    def _emit_windows(self, upper: np.ndarray, rows: Any) -> None:
        """Add rows of several samples each (samples.Rows.xx: a window's X^T W X and X^T W Y) to the backend's
        Gram; upper (R, q) canonical S entries. In a span pass the two partial traces instead:
        sum tr(xx) s s^T and sum ||s||^2 xx."""
        if self.traces is not None:
            with single_blas_thread():
                tr = np.einsum("rii->r", rows.xx)
                ns = np.einsum("ij,ij->i", upper, upper)
                self.traces[0][...] += (upper.T * tr) @ upper
                self.traces[1][...] += np.einsum("r,rlm->lm", ns, rows.xx)
            return
        if self.target_sum is not None and rows.y_sum is not None:
            self.target_sum += rows.y_sum
        if self.width:
            self._gram.add_windows(np.ascontiguousarray(upper.T), rows.xx, rows.xy, rows.yy)

    def pipeline(self) -> Any:
        """A block for the loop over a pass's chunks: the backend's (backends.HostGram.pipeline: a chunk's
        GEMMs overlap the next chunk's preparation), or nothing."""
        make = getattr(self._gram, "pipeline", None)
        return contextlib.nullcontext() if make is None else make()

    def result(self, token_dtype: str = "float64") -> Features:
        """The statistics, in the accumulator's basis (the accumulator is spent: its work buffers are
        released and its Gram becomes the result's, in place).

        G is mirrored from its lower triangle and compacted in place so that basis_gram is a
        C-contiguous psi x psi array at its start (moments and the target Gram are copied out first).
        `gram` and `moments` (own coordinates) are left to `Features.finalize`.
        """
        self._bufs.clear()
        d = self.d
        # the features accumulated: all psi, or the block on the spans (self.nf)
        out, self._gram = (None if self._gram is None else self._gram.result()), None
        gram_b, moments, target_gram = gram_parts(out, self.width, self.nf, self.n_targets > 0)
        target_sum, affine = self.target_sum, None
        if self.n_affine:  # [y, f] -> y's sums and the affine block's (mhla_cli.statistics.affine_sums)
            moments, target_gram, target_sum, parts = split_targets(moments, target_gram, target_sum,
                                                                    self.d_out, self.has_targets)
            affine = AffineSums(*parts, width=self.n_affine - 1)
        token_gram = self.token_gram + self._from_basis(self._derived_token_gram)
        self.last_token_gram += self._from_basis(self._derived_last_token_gram)
        out = Features(d=d, n_samples=self.n_samples, n_tokens=self.n_tokens, gram=None,
                       token_gram=token_gram, last_token_gram=self.last_token_gram,
                       target_gram=target_gram, token_dtype=token_dtype,
                       basis=self.basis, basis_gram=gram_b, basis_moments=moments,
                       basis_token_gram=self.basis_token_gram, basis_last_token_gram=self.basis_last_token_gram,
                       read=ReadSpec(self.samples, self.normalize), n_sequences=self.n_sequences,
                       target_sum=target_sum,
                       weight_sum=self.weight_sum, token_weight_sum=self.token_weight_sum, affine=affine)
        if self.spans is not None:
            out.span_pairs, out.span_last = self.spans
        return out


def chunk_features(tokens: np.ndarray, offsets: np.ndarray, targets: np.ndarray | None, d: int,
                   weights: np.ndarray | None = None, read: ReadSpec | None = None,
                   basis: np.ndarray | str | None = "auto", device: str | None = None) -> Features:
    """Statistics of one in-memory chunk (tokens (t, d), offsets from 0, targets (B, d) or None), read as
    `read` says (mhla_cli.samples.ReadSpec: the layout, the normalisation, the bias terms; None: last-token
    samples, S not normalised, no bias terms).

    With a per-position layout every position is a sample: targets (t, d), weights (t,) (mhla_cli.samples:
    "causal" reads S of the prefix X[:t], "bidirectional" of the whole window); with LAST (or no layout)
    targets (B, d), weights (B,). `read.normalize` "length" divides S by its number of tokens.
    `basis`: the basis accumulated in ("auto": the whitening of the chunk's own tokens; an array;
    None or "identity": the tokens' own coordinates); the result is then changed exactly to the
    whitening of the chunk's token Gram (`Features.canonical`). `device` (mhla_cli.linalg.device): where the
    features and their Gram are built. `read.bias_terms`: the statistics of the tokens (x, 1) and the targets
    (y, 0) (docs/bias_terms.md; the result's d is d + 1).
    """
    read = ReadSpec(LAST) if read is None else read
    layout = read.layout
    samples = layout if isinstance(layout, Samples) else samples_of(layout is not None, layout)
    normalize, bias_terms = read.normalize or "none", read.bias_terms
    tokens = np.asarray(tokens)
    if bias_terms:
        tokens, targets, d = bias_mod.with_constant(tokens), bias_mod.pad_targets(targets), d + 1
    check_floor(d, what="featurize")
    device = device_mod.check_device(device)
    basis = basis_option(basis, d, None)
    if basis is None:
        X = tokens.astype(np.float64)
        basis = basis_mod.whitening(X.T @ X, X.shape[0])
    d_out = None if targets is None else int(np.shape(targets)[-1])
    acc = Accumulator(d, targets is not None, basis, samples=samples, normalize=normalize, device=device, d_out=d_out)
    acc.add(tokens, np.asarray(offsets, dtype=np.int64),
            None if targets is None else np.asarray(targets, dtype=np.float64),
            weights=None if weights is None else np.asarray(weights, dtype=np.float64))
    feats = acc.result(str(tokens.dtype))
    feats.bias_terms = bias_terms
    check_overflow(feats, "the data", None)
    return feats.canonical().finalize()


def basis_option(basis: np.ndarray | str | None, d: int, path: str | os.PathLike | None) -> np.ndarray | None:
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
