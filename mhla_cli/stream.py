"""Streaming accumulation of the sufficient statistics (gram, moments, ...) over chunks of samples.

Everything here is a sum over samples, so statistics of disjoint sample ranges add up
(`Features.__add__`). `reduce_span` computes the statistics of one half-open range [lo, hi) and is
the only place the data are read; the serial loop, worker pools (mhla_cli.parallel), shards and
Dask all call it. Per chunk: a reader thread fetches the next chunk in its stored dtype, the
per-sequence X^T X are batched matmuls, and one syrk of the block [H | Y] updates gram, moments
and target_gram together (docs/performance.md).
"""

from __future__ import annotations

import builtins
import contextlib
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import h5py
import numpy as np

from . import basis as basis_mod
from . import formats
from .errors import InputError
from .memory import check_memory
from .tokens import ReadBuffers, TokensInfo, check_chunk, inspect_tokens, iter_chunks, read_chunk
from .features import n_features, pair_index
from .tokens import check_weights
from .features import check_normalize
from .formats import read_normalize
from . import parallel
from .parallel import CANCEL, Cancelled

# Target size of the per-chunk work buffers; the default chunk size is derived from it.
CHUNK_BYTES = 64 * 2**20


@dataclass
class Features:
    """Sufficient statistics of a dataset (sums over samples, float64).

    gram = sum_i H_i H_i^T (psi, psi); moments = sum_i H_i y_i^T (psi, d); target_gram =
    sum_i y_i y_i^T; token_gram = sum over all tokens of x x^T; last_token_gram = sum_i x_n x_n^T.
    """

    d: int
    n_samples: int
    n_tokens: int
    gram: np.ndarray
    token_gram: np.ndarray
    last_token_gram: np.ndarray
    moments: np.ndarray | None = None
    target_gram: np.ndarray | None = None
    token_dtype: str = "float64"
    sample_range: tuple[int, int] | None = None
    source: dict[str, Any] | None = None
    extra_attrs: dict[str, Any] = field(default_factory=dict)
    # The solver's basis (mhla_cli.basis): tokens X A, and the sums of their features. None: the
    # tokens' own coordinates (files of format version 1). While `gram` / `moments` are None they
    # are derived from these by `finalize`.
    basis: np.ndarray | None = None
    basis_gram: np.ndarray | None = None
    basis_moments: np.ndarray | None = None
    # Causal mode: every weighted prefix X[:t] was a sample (docs/formats.md, "per-position data").
    per_position: bool = False
    # "none", or "length": S divided by the number of tokens of the prefix / sequence.
    normalize: str = "none"
    # Sequences read (the unit of sample ranges and shards); None when unknown (older files).
    n_sequences: int | None = None

    # The sums in the tokens' own coordinates (docs/formats.md); the solver basis adds BASIS_SUMS.
    SUMS = ("gram", "moments", "target_gram", "token_gram", "last_token_gram")
    BASIS_SUMS = ("basis_gram", "basis_moments")

    @property
    def n_features(self) -> int:
        return n_features(self.d)

    @property
    def has_targets(self) -> bool:
        return self.target_gram is not None

    @property
    def lambda_d(self) -> np.ndarray:
        """Lambda_D = gram / N, the empirical second-moment matrix of the features (Lemma 2.3)."""
        return self.gram / max(self.n_samples, 1)

    def solver_stats(self) -> tuple[np.ndarray | None, np.ndarray, np.ndarray | None]:
        """(A, gram_b, moments_b): the basis the solver works in (None: the tokens' own) and the sums there."""
        if self.basis is None:
            return None, self.gram, self.moments
        return self.basis, self.basis_gram, self.basis_moments

    def finalize(self) -> Features:
        """Derive `gram` and `moments` (tokens' own coordinates) from the basis sums, if not yet done."""
        if self.basis is not None and self.gram is None:
            with np.errstate(over="ignore", invalid="ignore"):
                self.gram = basis_mod.gram_from_basis(self.basis, self.basis_gram)
                if self.basis_moments is not None:
                    self.moments = basis_mod.features_from_basis(self.basis, self.basis_moments)
            _check_overflow(self, "the data", None)
        return self

    def datasets(self) -> dict[str, np.ndarray | None]:
        """The datasets of a features file (docs/formats.md)."""
        self.finalize()
        data = {"gram": self.gram, "moments": self.moments, "target_gram": self.target_gram,
                "token_gram": self.token_gram, "last_token_gram": self.last_token_gram}
        if self.basis is not None:
            data.update(basis=self.basis, basis_gram=self.basis_gram, basis_moments=self.basis_moments)
        return data

    def add(self, other: Features) -> Features:
        """self += other (counts and every sum), in place; returns self."""
        _add_into(self, other)
        return self

    def __sub__(self, part: Features) -> Features:
        """Statistics of the samples in `self` but not in `part` (every sum subtracts; same basis)."""
        self.finalize()
        part.finalize()
        out = Features(d=self.d, n_samples=self.n_samples - part.n_samples, n_tokens=self.n_tokens - part.n_tokens,
                       token_dtype=self.token_dtype, normalize=self.normalize, per_position=self.per_position,
                       **{k: None if getattr(self, k) is None else getattr(self, k) - getattr(part, k)
                          for k in self.SUMS})
        if self.basis is not None and basis_mod.same(self.basis, part.basis):
            out.basis = self.basis
            out.basis_gram = self.basis_gram - part.basis_gram
            out.basis_moments = None if self.basis_moments is None else self.basis_moments - part.basis_moments
        return out

    def __add__(self, other: Features) -> Features:
        total = Features.zeros(self.d, self.has_targets,
                               self.token_dtype if self.token_dtype == other.token_dtype else "float64")
        total.normalize, total.per_position = self.normalize, self.per_position
        total.n_sequences = 0 if self.n_sequences is not None and other.n_sequences is not None else None
        _add_into(total, self)
        _add_into(total, other)
        if self.sample_range and other.sample_range:
            total.sample_range = (min(self.sample_range[0], other.sample_range[0]),
                                  max(self.sample_range[1], other.sample_range[1]))
        total.source = self.source
        return total

    @classmethod
    def zeros(cls, d: int, has_targets: bool, token_dtype: str = "float64") -> Features:
        psi = n_features(d)
        return cls(d=d, n_samples=0, n_tokens=0, gram=np.zeros((psi, psi)),
                   token_gram=np.zeros((d, d)), last_token_gram=np.zeros((d, d)),
                   moments=np.zeros((psi, d)) if has_targets else None,
                   target_gram=np.zeros((d, d)) if has_targets else None, token_dtype=token_dtype)

    # ---------------------------------------------------------------- persistence
    def save(self, path: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = (),
             extra: dict[str, np.ndarray] | None = None, extra_attrs: dict[str, Any] | None = None) -> None:
        """Write a features file atomically (`extra` datasets and attributes beside, e.g. per-fold sums)."""
        formats.write_file(path, "features", {**self.datasets(), **(extra or {})},
                           {**self.file_attrs(), **(extra_attrs or {})}, inputs)

    def file_attrs(self) -> dict[str, Any]:
        """The attributes of a features file (docs/formats.md)."""
        attrs: dict[str, Any] = {"d": self.d, "n_samples": self.n_samples, "n_tokens": self.n_tokens,
                                 "n_features": self.n_features, "token_dtype": self.token_dtype}
        if self.sample_range is not None:
            attrs["sample_lo"], attrs["sample_hi"] = self.sample_range
        if self.source is not None:
            attrs["source"] = json.dumps(self.source)
        attrs["normalize"] = self.normalize
        attrs["per_position"] = int(self.per_position)
        if self.n_sequences is not None:
            attrs["n_sequences"] = int(self.n_sequences)
        attrs.update(self.extra_attrs)
        return attrs

    @classmethod
    def load(cls, path: str | os.PathLike) -> Features:
        """Read and validate a features file."""
        with formats.open_input(path) as f:
            formats.expect_kind(f, path, "features")
            d = formats.read_attr_int(f, "d", path)
            n = formats.read_attr_int(f, "n_samples", path)
            t = formats.read_attr_int(f, "n_tokens", path)
            psi = n_features(d)
            gram = formats.read_array(f, "gram", path).astype(np.float64, copy=False)
            if gram.shape != (psi, psi):
                raise InputError(f"'gram' has shape {gram.shape}, expected (psi, psi) = ({psi}, {psi}) "
                                 f"for d = {d}", path)
            if not np.isfinite(gram).all():
                raise InputError("'gram' contains NaN or Inf", path)
            if not _is_symmetric(gram):
                raise InputError("'gram' is not symmetric; the file is corrupted", path)
            tg = formats.read_array(f, "token_gram", path).astype(np.float64)
            lg = formats.read_array(f, "last_token_gram", path).astype(np.float64)
            for name, arr in (("token_gram", tg), ("last_token_gram", lg)):
                if arr.shape != (d, d):
                    raise InputError(f"'{name}' has shape {arr.shape}, expected ({d}, {d})", path)
            moments = target_gram = None
            if "moments" in f:
                moments = formats.read_array(f, "moments", path).astype(np.float64, copy=False)
                if moments.shape != (psi, d):
                    raise InputError(f"'moments' has shape {moments.shape}, expected ({psi}, {d})", path)
                if "target_gram" not in f:
                    raise InputError("has 'moments' but no 'target_gram'", path)
                target_gram = formats.read_array(f, "target_gram", path).astype(np.float64)
                if target_gram.shape != (d, d):
                    raise InputError(f"'target_gram' has shape {target_gram.shape}, expected ({d}, {d})", path)
            if n < 1:
                raise InputError(f"n_samples = {n}: no samples", path)
            rng = None
            if "sample_lo" in f.attrs and "sample_hi" in f.attrs:
                rng = (int(f.attrs["sample_lo"]), int(f.attrs["sample_hi"]))
            source = json.loads(f.attrs["source"]) if "source" in f.attrs else None
            basis, basis_gram, basis_moments = _load_basis(f, path, d, moments is not None)
            dtype = f.attrs.get("token_dtype", "float64")
            dtype = dtype.decode() if isinstance(dtype, bytes) else str(dtype)
            normalize = read_normalize(f, path)
            per_position = bool(int(f.attrs.get("per_position", 0)))
            n_seq = int(f.attrs["n_sequences"]) if "n_sequences" in f.attrs else None
            extra = {}
            for k in EXTRA_ATTRS:
                if k in f.attrs:
                    v = f.attrs[k]
                    extra[k] = v.decode() if isinstance(v, bytes) else (v.item() if hasattr(v, "item") else v)
        return cls(d=d, n_samples=n, n_tokens=t, gram=gram, token_gram=tg, last_token_gram=lg,
                   moments=moments, target_gram=target_gram, token_dtype=dtype, sample_range=rng,
                   source=source, extra_attrs=extra, basis=basis, basis_gram=basis_gram,
                   basis_moments=basis_moments, per_position=per_position, normalize=normalize,
                   n_sequences=n_seq)


def _load_basis(f: h5py.File, path: str | os.PathLike, d: int, has_targets: bool
                ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """The solver basis and its sums (format version 2); (None, None, None) for version-1 files."""
    names = [k for k in ("basis", "basis_gram", "basis_moments") if k in f]
    if not names:
        return None, None, None
    need = ["basis", "basis_gram"] + (["basis_moments"] if has_targets else [])
    missing = [k for k in need if k not in f]
    if missing:
        raise InputError(f"has {', '.join(names)} but no {', '.join(missing)}; the file is incomplete", path)
    psi = n_features(d)
    A = formats.read_array(f, "basis", path).astype(np.float64)
    if A.shape != (d, d):
        raise InputError(f"'basis' has shape {A.shape}, expected ({d}, {d})", path)
    if not np.isfinite(np.linalg.cond(A)) or np.linalg.cond(A) > 1e12:
        raise InputError("'basis' is singular; the file is corrupted", path)
    gb = formats.read_array(f, "basis_gram", path).astype(np.float64)
    if gb.shape != (psi, psi):
        raise InputError(f"'basis_gram' has shape {gb.shape}, expected ({psi}, {psi})", path)
    if not _is_symmetric(gb):
        raise InputError("'basis_gram' is not symmetric; the file is corrupted", path)
    mb = None
    if has_targets:
        mb = formats.read_array(f, "basis_moments", path).astype(np.float64)
        if mb.shape != (psi, d):
            raise InputError(f"'basis_moments' has shape {mb.shape}, expected ({psi}, {d})", path)
    return A, gb, mb


# Attributes of a features file kept in `Features.extra_attrs` when it is loaded: which shard of
# the source it holds, and for a partial merge the sample ranges it covers (JSON).
EXTRA_ATTRS = ("shard", "sample_ranges", "partial")


def _is_symmetric(a: np.ndarray, block: int = 1024) -> bool:
    """a == a.T up to 1e-12 of its largest entry (checked in row blocks: no psi x psi temporaries)."""
    if not a.size:
        return True
    tol = 1e-12 * float(np.abs(a).max())
    for lo in range(0, a.shape[0], block):
        hi = min(a.shape[0], lo + block)
        if float(np.abs(a[lo:hi] - a[:, lo:hi].T).max()) > tol:
            return False
    return True


# --------------------------------------------------------------------------------------------
# per-chunk kernels
# --------------------------------------------------------------------------------------------


def sequence_moments(tokens: np.ndarray, offsets: np.ndarray, out: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Per-sequence S = X^T X (B, d, d) and last tokens (B, d), float64, vectorised over the chunk.

    `tokens` may have any real dtype: they are converted to float64 in cache-sized blocks just
    before each product (products of float32 or integer values are then exact). Equal lengths are
    batched matmuls; ragged chunks are grouped by length (padding with zero rows, which do not
    change S), one batched matmul per group. `out` is an optional (B, d, d) buffer for S.
    """
    # Overflow from absurdly large tokens is reported by the finiteness check, not as a warning.
    with np.errstate(over="ignore", invalid="ignore"):
        return _sequence_moments(np.asarray(tokens), np.asarray(offsets, dtype=np.int64), out)


def _sequence_moments(tokens: np.ndarray, offsets: np.ndarray, out: np.ndarray | None
                      ) -> tuple[np.ndarray, np.ndarray]:
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
_CONTROLLER: Any = None


def _single_blas_thread() -> Any:
    """Context limiting BLAS to one thread (tiny per-sequence products gain nothing from more)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        from threadpoolctl import ThreadpoolController

        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER.limit(limits=1, user_api="blas")


class _Accumulator:
    """Running sums of one reduction, with reusable work buffers.

    The Gram of the block [H | Y] (B x (psi + d)) holds gram, moments and target_gram at once, so
    each chunk costs one syrk (numpy's `Ft @ Ft.T` on the transposed block); `G` accumulates it
    in float64.
    """

    def __init__(self, d: int, has_targets: bool, basis: np.ndarray | None = None, causal: bool = False,
                 normalize: str = "none") -> None:
        self.causal = causal  # per-position data: every prefix is a sample (see _add_rows)
        self.normalize = normalize
        self.n_sequences = 0
        self.d = d
        self.basis = None if basis_mod.is_identity(basis) else np.asarray(basis, dtype=np.float64)
        # The features of X A are formed from S = X^T X as P_A upper(S) and A^T x_n: two small
        # products per chunk. (Transforming the tokens first costs a pass over them and gains
        # nothing measurable: on tests/test_basis.py's rotated cond(A) = 1e3 data the function
        # error is 3e-8 either way, set by mapping p back to the tokens' own coordinates.)
        self._pair_map = None if self.basis is None else basis_mod.pair_map(self.basis)
        self.psi = n_features(d)
        self.has_targets = has_targets
        self.width = self.psi + (d if has_targets else 0)
        self.G: np.ndarray | None = None
        self._prod: np.ndarray | None = None
        self._bufs: dict[str, np.ndarray] = {}
        j, k = pair_index(d)
        self._upper_idx = (j * d + k).astype(np.intp)
        self.token_gram = np.zeros((d, d))
        self.last_token_gram = np.zeros((d, d))
        self.n_samples = 0
        self.n_tokens = 0

    def _buf(self, name: str, rows: int, shape: tuple[int, ...]) -> np.ndarray:
        """A reusable (rows, *shape) float64 work array."""
        buf = self._bufs.get(name)
        if buf is None or buf.shape[0] < rows:
            buf = self._bufs[name] = np.empty((rows, *shape))
        return buf[:rows]

    def _buf_t(self, name: str, rows: int, cols: int) -> np.ndarray:
        """A reusable C-contiguous (rows, cols) float64 work array (cols = samples of the chunk)."""
        size = rows * cols
        buf = self._bufs.get(name)
        if buf is None or buf.size < size:
            buf = self._bufs[name] = np.empty(size)
        return buf[:size].reshape(rows, cols)

    def add(self, tokens: np.ndarray, offsets: np.ndarray, targets: np.ndarray | None,
            check: Callable[[float], None] | None = None, weights: np.ndarray | None = None) -> None:
        """Add one chunk: tokens (t, d) of any real dtype, offsets (B+1,) from 0, targets (B, d) or None.

        `check(top)` may reject the chunk, given a bound on the largest squared token entry, before
        anything is added. With a basis A the features are those of X A (token_gram and
        last_token_gram stay in the tokens' own coordinates). Causal mode, weights ((B,), or (t,)
        in causal mode) or a normalisation go through `_add_rows`.
        """
        d, psi = self.d, self.psi
        B = offsets.size - 1
        if B == 0:
            return
        if self.causal or weights is not None or self.normalize != "none":
            self._add_rows(tokens, offsets, targets, check, weights)
            return
        self.n_sequences += B
        # errstate: NaN / Inf tokens are reported by `check`, not as numpy warnings
        with _single_blas_thread(), np.errstate(invalid="ignore", over="ignore"):
            S, last = sequence_moments(tokens, offsets, out=self._buf("S", B, (d, d)))
            if check is not None:  # the diagonals bound every squared token entry (NaN stays NaN)
                check(float(np.max(np.diagonal(S, axis1=1, axis2=2))) if S.size else 0.0)
            self.token_gram += S.sum(axis=0)
            self.last_token_gram += last.T @ last
            # The block is built transposed, Ft = [H | Y]^T (psi + d, B): every elementwise loop
            # then runs over the B samples of the chunk (long, contiguous) instead of over d.
            Ft = self._buf_t("F", self.width, B)
            # gather the distinct entries row-wise (contiguous), then transpose: ~10x faster than a
            # strided gather from the transposed view
            upper_rows = np.take(S.reshape(B, d * d), self._upper_idx, axis=1, out=self._buf("Ur", B, (psi // d,)))
            upper = self._buf_t("U", psi // d, B)
            last_t = self._buf_t("L", d, B)
            if self.basis is None:
                upper[...] = upper_rows.T
                last_t[...] = last.T
            else:
                # the features of X A: upper(A^T S A) = P_A upper(S) and A^T x_n (mhla_cli.basis),
                # one small matrix product each, in the (small @ wide) orientation BLAS is fast at
                np.matmul(self._pair_map, upper_rows.T, out=upper)
                np.matmul(self.basis.T, last.T, out=last_t)
            H = Ft[:psi].reshape(psi // d, d, B)
            # H_(j,k,l) = S[j,k] x_n[l] (BACKGROUND.md, "Why learning it is a linear regression")
            np.multiply(upper[:, None, :], last_t[None, :, :], out=H)
            if targets is not None:
                Ft[psi:] = targets.T
        self._syrk(Ft)
        self.n_samples += B
        self.n_tokens += int(offsets[-1])

    def _add_rows(self, tokens: np.ndarray, offsets: np.ndarray, targets: np.ndarray | None,
                  check: Callable[[float], None] | None, weights: np.ndarray | None) -> None:
        """Add a chunk sample by sample: rows = positions (causal) or sequences, each of weight w >= 0.

        gram += sum w h h^T, moments += sum w h y^T, target_gram += sum w y y^T (one syrk of the block
        sqrt(w) [H | Y] over the rows with w > 0); token_gram += sum w S (unnormalised S of each
        sample), last_token_gram += sum w x x^T (x the sample's last token); n_samples += #{w > 0}.
        """
        d, psi = self.d, self.psi
        j, k = pair_index(d)
        B = offsets.size - 1
        with _single_blas_thread(), np.errstate(invalid="ignore", over="ignore"):
            upper, last = sample_rows(tokens, offsets, self.causal)  # unnormalised here
            if check is not None:
                # the diagonal of every whole sequence's Gram bounds its squared entries
                ends = offsets[1:] - 1 if self.causal else np.arange(B)
                diag = upper[ends][:, j == k]
                check(float(np.max(diag)) if diag.size else 0.0)
            if self.basis is not None:
                # token statistics in the tokens' own coordinates, features of X A (see add)
                upper_own, last_own = upper, last
                upper = (self._pair_map @ upper.T).T
                last = (self.basis.T @ last.T).T
            keep = None
            if weights is not None:
                keep = np.flatnonzero(weights > 0)
                if keep.size == weights.size:
                    keep = None
            w = None if weights is None else (weights if keep is None else weights[keep])
            if self.basis is None:
                upper_own, last_own = upper, last
            if keep is not None:
                upper, last = upper[keep], last[keep]
                upper_own, last_own = upper_own[keep], last_own[keep]
                if targets is not None:
                    targets = targets[keep]
            R = upper.shape[0]
            tg_upper = upper_own.sum(axis=0) if w is None else w @ upper_own
            self.token_gram[j, k] += tg_upper
            self.token_gram[k, j] += np.where(j == k, 0.0, tg_upper)
            lw = last_own if w is None else last_own * np.sqrt(w)[:, None]
            self.last_token_gram += lw.T @ lw
            if self.normalize == "length":
                if self.causal:
                    pos = position_numbers(offsets)
                    upper /= (pos if keep is None else pos[keep])[:, None]
                else:
                    lengths = np.diff(offsets).astype(np.float64)
                    upper /= (lengths if keep is None else lengths[keep])[:, None]
            if R:
                sw = None if w is None else np.sqrt(w)
                Ft = self._buf_t("F", self.width, R)
                upper_t = self._buf_t("U", psi // d, R)
                upper_t[...] = upper.T
                last_t = self._buf_t("L", d, R)
                last_t[...] = last.T
                if sw is not None:
                    last_t *= sw  # sqrt(w) h = S (sqrt(w) x): the syrk then sums w h h^T
                H = Ft[:psi].reshape(psi // d, d, R)
                np.multiply(upper_t[:, None, :], last_t[None, :, :], out=H)
                if targets is not None:
                    Ft[psi:] = targets.T
                    if sw is not None:
                        Ft[psi:] *= sw
        if R:
            self._syrk(Ft)
        self.n_samples += R
        self.n_tokens += int(offsets[-1])
        self.n_sequences += B

    def _syrk(self, Ft: np.ndarray) -> None:
        """G += Ft Ft^T (a syrk; several BLAS threads only pay off for a wide block)."""
        with contextlib.nullcontext() if self.width >= MIN_THREADED_WIDTH else _single_blas_thread():
            if self.G is None:
                self.G = np.empty((self.width, self.width))
                np.matmul(Ft, Ft.T, out=self.G)
            else:
                if self._prod is None:
                    self._prod = np.empty_like(self.G)
                np.matmul(Ft, Ft.T, out=self._prod)
                self.G += self._prod

    def result(self, token_dtype: str = "float64", finalize: bool = True) -> Features:
        """The statistics so far (views into the accumulator; the work buffers are released).

        With a basis and `finalize=False`, `gram` and `moments` are left to `Features.finalize`
        (partial sums of a larger reduction need only the basis sums).
        """
        self._bufs.clear()
        self._prod = None
        if self.G is None:
            out = Features.zeros(self.d, self.has_targets, token_dtype)
            if self.basis is not None:
                out.basis, out.basis_gram = self.basis, out.gram.copy()
                out.basis_moments = None if out.moments is None else out.moments.copy()
            return out
        psi, G = self.psi, self.G
        gram, moments = G[:psi, :psi], (G[:psi, psi:] if self.has_targets else None)
        out = Features(d=self.d, n_samples=self.n_samples, n_tokens=self.n_tokens, gram=gram,
                       token_gram=self.token_gram, last_token_gram=self.last_token_gram, moments=moments,
                       target_gram=G[psi:, psi:] if self.has_targets else None, token_dtype=token_dtype)
        if self.basis is not None:
            out.basis, out.basis_gram, out.basis_moments = self.basis, gram, moments
            out.gram = out.moments = None
            if finalize:
                out.finalize()
        return out


def _result(acc: _Accumulator, token_dtype: str = "float64", finalize: bool = True) -> Features:
    """acc.result() with the causal-mode fields (per_position, normalize, n_sequences) filled in."""
    feats = acc.result(token_dtype, finalize=finalize)
    feats.per_position, feats.normalize, feats.n_sequences = acc.causal, acc.normalize, acc.n_sequences
    return feats


def chunk_features(tokens: np.ndarray, offsets: np.ndarray, targets: np.ndarray | None, d: int,
                   weights: np.ndarray | None = None, per_position: bool = False,
                   normalize: str = "none", basis: np.ndarray | str | None = "auto") -> Features:
    """Statistics of one in-memory chunk (tokens (t, d), offsets from 0, targets (B, d) or None).

    With `per_position` every prefix is a sample: targets (t, d), weights (t,); otherwise targets
    (B, d), weights (B,). `normalize="length"` divides S by the prefix / sequence length.
    `basis`: "auto" whitens with the chunk's own token Gram, an array is used as given, None or
    "identity" accumulates in the tokens' own coordinates.
    """
    check_normalize(normalize)
    tokens = np.asarray(tokens)
    if isinstance(basis, str) and basis == "auto":
        X = tokens.astype(np.float64)
        basis = basis_mod.whitening(X.T @ X, X.shape[0])
    elif isinstance(basis, str):
        if basis != "identity":
            raise InputError(f"unknown basis '{basis}', expected auto, identity or a (d, d) array")
        basis = None
    acc = _Accumulator(d, targets is not None, basis, causal=per_position, normalize=normalize)
    acc.add(tokens, np.asarray(offsets, dtype=np.int64),
            None if targets is None else np.asarray(targets, dtype=np.float64),
            weights=None if weights is None else np.asarray(weights, dtype=np.float64))
    return _result(acc, str(tokens.dtype))


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# the reduction
# --------------------------------------------------------------------------------------------


def default_chunk_size(info: TokensInfo) -> int:
    """Samples per chunk so that the chunk's buffers stay near CHUNK_BYTES."""
    psi = n_features(info.d)
    mean_len = max(1.0, info.n_tokens / info.n_samples)
    # [H | Y] block + S + pair products, and two float64 read slots of tokens and targets
    per_sample = 8 * (psi + info.d) + 8 * (info.d * info.d + psi // info.d) + 2 * 8 * info.d * (mean_len + 1)
    if getattr(info, "per_position", False):
        # every position is a row of the [H | Y] block, with its prefix Gram entries
        per_sample = mean_len * (8 * (psi + info.d) + 3 * 8 * (psi // info.d) + 4 * 8 * info.d)
    rows = CHUNK_BYTES // per_sample
    if psi + info.d >= 512:
        # the per-chunk cost outside the syrk (adding the psi^2 product) shrinks as 1/rows
        rows = max(rows, MIN_SYRK_ROWS if not getattr(info, "per_position", False)
                   else math.ceil(MIN_SYRK_ROWS / mean_len))
    return int(max(1, min(info.n_samples, rows)))


def reduce_span(info: TokensInfo, span: tuple[int, int], chunk_size: int | None = None,
                progress: Callable[[int], None] | None = None, prefetch: bool = True,
                normalize: str = "none", basis: np.ndarray | None = None, finalize: bool = True) -> Features:
    """Statistics of samples [lo, hi) of the tokens file `info.path` (opened here, read in chunks).

    This is the one chunk reduction of mhla: the serial loop, worker pools, Dask and shards all
    call it. `progress(n)` is called after each chunk of n samples (sequences). Per-position data
    (info.per_position) make every weighted prefix a sample; `normalize="length"` divides S by the
    prefix (sequence) length. `basis` (d, d): accumulate the features of X @ basis (see
    mhla_cli.basis; `estimate_basis`); `finalize=False` leaves the sums in the tokens' own
    coordinates to `Features.finalize` (for partial sums).
    """
    lo, hi = span
    per_position = getattr(info, "per_position", False)
    acc = _Accumulator(info.d, info.has_targets, basis, causal=per_position, normalize=check_normalize(normalize))
    for a, b, tokens, offsets, targets, weights in iter_chunks(info, (lo, hi), chunk_size or default_chunk_size(info), prefetch,
                                                               with_weights=True):
        if CANCEL.is_set():
            raise Cancelled("the reduction was cancelled")
        check_weights(weights, offsets, a, per_position, info.path)
        acc.add(tokens, offsets, targets,
                check=lambda top, a=a, t=tokens, o=offsets, y=targets: check_chunk(info, a, t, o, y, top),
                weights=weights)
        if progress is not None:
            progress(b - a)
    total = _result(acc, info.dtype, finalize=False)
    _check_overflow(total, f"samples {lo}..{hi}", info.path)
    if finalize:
        total.finalize()
        _check_overflow(total, f"samples {lo}..{hi}", info.path)
    total.sample_range = (lo, hi)
    return total


def _check_overflow(feats: Features, what: str, path: str | os.PathLike | None) -> None:
    arrays = [feats.gram, feats.moments, feats.basis_gram, feats.basis_moments, feats.target_gram]
    if not all(a is None or np.isfinite(a).all() for a in arrays):
        raise InputError(f"the statistics of {what} overflow float64 (tokens or targets too large); "
                         "rescale the data", path)


# Samples read to estimate the solver basis: up to this many tokens, in _BASIS_BLOCKS blocks spread
# evenly over the file (the same samples whatever the shard, chunk size or worker count).
BASIS_SAMPLE_TOKENS = 1 << 18
_BASIS_BLOCKS = 8


def estimate_basis(info: TokensInfo) -> np.ndarray:
    """The solver basis of a tokens file: a float32-rounded whitening of a fixed sample's token Gram.

    Deterministic in the file's content (every shard, worker and machine gets the same basis, so
    their sums add up exactly). Any invertible basis gives the same function and verdict in exact
    arithmetic; this one keeps the solver's Gram well conditioned whatever the token units.
    """
    N = info.n_samples
    mean_len = max(1.0, info.n_tokens / max(N, 1))
    per_block = max(1, int(BASIS_SAMPLE_TOKENS / mean_len / _BASIS_BLOCKS))
    blocks: list[tuple[int, int]] = []  # disjoint: small files are read once, not block by block
    for a in sorted({(N * i) // _BASIS_BLOCKS for i in range(_BASIS_BLOCKS)}):
        b = min(N, a + per_block)
        if blocks and a <= blocks[-1][1]:
            blocks[-1] = (blocks[-1][0], max(b, blocks[-1][1]))
        else:
            blocks.append((a, b))
    G = np.zeros((info.d, info.d))
    count = 0
    bufs = ReadBuffers()
    with formats.open_input(info.path) as f, np.errstate(invalid="ignore", over="ignore"):
        for a, b in blocks:
            tokens, offsets, targets = read_chunk(f, info, a, b, bufs)
            X = tokens.astype(np.float64)
            top = float(np.max(X * X)) if X.size else 0.0
            check_chunk(info, a, tokens, offsets, targets, top)
            G += X.T @ X
            count += X.shape[0]
    return basis_mod.whitening(G, count)


def _add_into(acc: Features, part: Features) -> None:
    """acc += part (counts and every sum), in place.

    Parts in different solver bases are converted into acc's basis first (basis.change); an empty
    acc (Features.zeros) adopts the part's basis.
    """
    if part.d != acc.d:
        raise InputError(f"cannot add statistics of d = {acc.d} and d = {part.d}")
    if part.has_targets != acc.has_targets:
        raise InputError("cannot add statistics with and without targets")
    if part.normalize != acc.normalize:
        raise InputError(f"cannot add statistics with different normalisations ({acc.normalize} and "
                         f"{part.normalize}): featurize every part with the same normalisation")
    if part.per_position != acc.per_position:
        raise InputError("cannot add per-position (causal) statistics to last-token statistics")
    acc.n_sequences = None if acc.n_sequences is None or part.n_sequences is None \
        else acc.n_sequences + part.n_sequences
    if acc.basis is None and part.basis is not None:
        if acc.n_samples == 0 and not acc.gram.any():
            acc.basis = part.basis
            acc.basis_gram = np.zeros_like(part.basis_gram)
            acc.basis_moments = None if acc.moments is None else np.zeros_like(part.basis_moments)
        else:  # acc holds sums in the tokens' own coordinates: move them into the part's basis
            acc.basis = part.basis
            acc.basis_gram, acc.basis_moments = basis_mod.change(None, part.basis, acc.gram, acc.moments)
    if acc.basis is not None:
        if basis_mod.same(acc.basis, part.basis):
            gb, mb = part.solver_stats()[1:]
        else:
            gb, mb = basis_mod.change(part.basis, acc.basis, *part.solver_stats()[1:])
        acc.basis_gram += gb
        if acc.basis_moments is not None:
            acc.basis_moments += mb
    acc.n_samples += part.n_samples
    acc.n_tokens += part.n_tokens
    if acc.gram is not None and part.gram is not None:
        acc.gram += part.gram
        if acc.moments is not None and part.moments is not None:
            acc.moments += part.moments
    else:  # derived from the basis sums by finalize()
        acc.gram = acc.moments = None
    acc.token_gram += part.token_gram
    acc.last_token_gram += part.last_token_gram
    if acc.target_gram is not None:
        acc.target_gram += part.target_gram


def reduce_spans(info: TokensInfo, span_list: Sequence[tuple[int, int]],
                 map: Callable[..., Iterable[Features]] = builtins.map,  # noqa: A002 (like builtins.map)
                 chunk_size: int | None = None,
                 progress: Callable[[int], None] | None = None, normalize: str = "none",
                 basis: np.ndarray | None = None) -> Features:
    """Sum of `reduce_span` over `span_list`, evaluated with `map` (builtin, a pool's, Dask's).

    `map(fn, spans)` may also yield partial sums (Dask tree-reduces on the cluster); the parts are
    added in the order they come.
    """
    total: Features | None = None
    for part in map(partial(reduce_span, info, chunk_size=chunk_size, normalize=normalize, basis=basis,
                            finalize=False), span_list):
        if total is None:
            total = part  # each part is a fresh result: sum into it
        else:
            _add_into(total, part)
        if progress is not None:
            progress(part.n_sequences if part.n_sequences is not None else part.n_samples)
    if total is None:
        total = Features.zeros(info.d, info.has_targets, info.dtype)
        total.per_position, total.normalize = getattr(info, "per_position", False), normalize
    total.finalize()
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
              basis: np.ndarray | str | None = "auto") -> Features:
    """Sufficient statistics of a tokens file, streamed in chunks of `chunk_size` samples.

    `shard=(i, M)` restricts to the i-th (0-based) of M contiguous sample ranges. Parallelism:
    `workers=K` (a local pool, see mhla_cli.parallel), `scheduler` (a Dask address, or "local" /
    "local:K"), or any `map` (builtin map, a pool's map, ...) over the spans; all call `reduce_span`.
    Per-position data (targets (T, d) or weights per position) are featurized causally: every
    prefix with weight > 0 is a sample. `normalize="length"` divides S by the number of tokens.
    `basis`: "auto" (`estimate_basis`, from the whole file whatever the shard), a (d, d) array, or
    None / "identity" (the tokens' own coordinates, as format version 1).
    """
    check_normalize(normalize)
    info = inspect_tokens(path)
    if isinstance(basis, str) and basis == "auto":
        basis = estimate_basis(info)
    elif isinstance(basis, str):
        if basis != "identity":
            raise InputError(f"unknown basis '{basis}', expected auto, identity or a (d, d) array")
        basis = None
    elif basis is not None:
        basis = np.asarray(basis, dtype=np.float64)
        if basis.shape != (info.d, info.d) or not np.isfinite(basis).all() or np.linalg.cond(basis) > 1e12:
            raise InputError(f"the basis must be an invertible ({info.d}, {info.d}) array", path)
    lo, hi = shard_span(info.n_samples, shard, path)
    size = chunk_size or default_chunk_size(info)
    if map is None and workers <= 1 and scheduler is None:
        check_memory(info.d, path=path)
        feats = reduce_span(info, (lo, hi), size, progress=progress, normalize=normalize, basis=basis)
    else:
        with parallel.make_map(workers=workers, scheduler=scheduler, map=map) as pmap:
            check_memory(info.d, copies=pmap.local_copies, path=path)
            # workers (possibly on other hosts) open the file themselves: give them an absolute path
            winfo = replace(info, path=os.path.abspath(info.path))
            feats = reduce_spans(winfo, work_spans(lo, hi, size, pmap.n_workers), map=pmap,
                                 chunk_size=size, progress=progress, normalize=normalize, basis=basis)
    if feats.n_samples == 0:
        raise InputError(f"every weight of samples {lo}..{hi} is 0: there is no sample to learn from", path)
    feats.sample_range = (lo, hi)
    feats.token_dtype = info.dtype
    feats.source = dict(formats.source_identity(path), n_samples=info.n_samples)
    if shard is not None:
        feats.extra_attrs["shard"] = f"{shard[0]}/{shard[1]}"
    return feats


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


def load_features(path: str | os.PathLike, chunk_size: int | None = None, normalize: str | None = None,
                  progress: Callable[[int], None] | None = None) -> Features:
    """The statistics of a features file, or of a tokens file (featurized here, streamed).

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
        return featurize(path, chunk_size=chunk_size, progress=progress, normalize=normalize or "none")
    raise InputError(f"is a {kind} file, expected a tokens or features file", path)

