"""Streaming accumulation of the sufficient statistics (gram, moments, ...) over chunks of samples.

Everything here is a sum over samples, so statistics of disjoint sample ranges add up
(`Features.__add__`). `reduce_span` computes the statistics of one half-open range [lo, hi) and is
the only place the data are read; the serial loop, a process pool, shards and Dask all call it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import h5py
import numpy as np

from . import formats
from .errors import InputError
from .features import features_from_moments, n_features

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

    @property
    def n_features(self) -> int:
        return n_features(self.d)

    @property
    def has_targets(self) -> bool:
        return self.moments is not None

    @property
    def lambda_d(self) -> np.ndarray:
        """Lambda_D = gram / N, the empirical second-moment matrix of the features (Lemma 2.3)."""
        return self.gram / max(self.n_samples, 1)

    def __add__(self, other: Features) -> Features:
        if other.d != self.d:
            raise InputError(f"cannot add statistics of d = {self.d} and d = {other.d}")
        if other.has_targets != self.has_targets:
            raise InputError("cannot add statistics with and without targets")
        rng = None
        if self.sample_range and other.sample_range:
            rng = (min(self.sample_range[0], other.sample_range[0]),
                   max(self.sample_range[1], other.sample_range[1]))
        return Features(
            d=self.d,
            n_samples=self.n_samples + other.n_samples,
            n_tokens=self.n_tokens + other.n_tokens,
            gram=self.gram + other.gram,
            token_gram=self.token_gram + other.token_gram,
            last_token_gram=self.last_token_gram + other.last_token_gram,
            moments=None if self.moments is None else self.moments + other.moments,
            target_gram=None if self.target_gram is None else self.target_gram + other.target_gram,
            token_dtype=self.token_dtype if self.token_dtype == other.token_dtype else "float64",
            sample_range=rng,
            source=self.source,
        )

    @classmethod
    def zeros(cls, d: int, has_targets: bool, token_dtype: str = "float64") -> Features:
        psi = n_features(d)
        return cls(d=d, n_samples=0, n_tokens=0, gram=np.zeros((psi, psi)),
                   token_gram=np.zeros((d, d)), last_token_gram=np.zeros((d, d)),
                   moments=np.zeros((psi, d)) if has_targets else None,
                   target_gram=np.zeros((d, d)) if has_targets else None, token_dtype=token_dtype)

    # ---------------------------------------------------------------- persistence
    def save(self, path: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = ()) -> None:
        """Write a features file atomically."""
        attrs: dict[str, Any] = {"d": self.d, "n_samples": self.n_samples, "n_tokens": self.n_tokens,
                                 "n_features": self.n_features, "token_dtype": self.token_dtype}
        if self.sample_range is not None:
            attrs["sample_lo"], attrs["sample_hi"] = self.sample_range
        if self.source is not None:
            attrs["source"] = json.dumps(self.source)
        attrs.update(self.extra_attrs)
        formats.write_file(path, "features", {
            "gram": self.gram, "moments": self.moments, "target_gram": self.target_gram,
            "token_gram": self.token_gram, "last_token_gram": self.last_token_gram,
        }, attrs, inputs)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Features:
        """Read and validate a features file."""
        with formats.open_input(path) as f:
            formats.expect_kind(f, path, "features")
            d = formats.read_attr_int(f, "d", path)
            n = formats.read_attr_int(f, "n_samples", path)
            t = formats.read_attr_int(f, "n_tokens", path)
            psi = n_features(d)
            gram = formats.read_array(f, "gram", path).astype(np.float64)
            if gram.shape != (psi, psi):
                raise InputError(f"'gram' has shape {gram.shape}, expected (psi, psi) = ({psi}, {psi}) "
                                 f"for d = {d}", path)
            if not np.isfinite(gram).all():
                raise InputError("'gram' contains NaN or Inf", path)
            scale = float(np.abs(gram).max()) if gram.size else 0.0
            if not np.allclose(gram, gram.T, rtol=0, atol=1e-12 * scale):
                raise InputError("'gram' is not symmetric; the file is corrupted", path)
            tg = formats.read_array(f, "token_gram", path).astype(np.float64)
            lg = formats.read_array(f, "last_token_gram", path).astype(np.float64)
            for name, arr in (("token_gram", tg), ("last_token_gram", lg)):
                if arr.shape != (d, d):
                    raise InputError(f"'{name}' has shape {arr.shape}, expected ({d}, {d})", path)
            moments = target_gram = None
            if "moments" in f:
                moments = formats.read_array(f, "moments", path).astype(np.float64)
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
            dtype = f.attrs.get("token_dtype", "float64")
            dtype = dtype.decode() if isinstance(dtype, bytes) else str(dtype)
        return cls(d=d, n_samples=n, n_tokens=t, gram=gram, token_gram=tg, last_token_gram=lg,
                   moments=moments, target_gram=target_gram, token_dtype=dtype, sample_range=rng,
                   source=source)


# --------------------------------------------------------------------------------------------
# per-chunk kernels
# --------------------------------------------------------------------------------------------


def sequence_moments(tokens: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-sequence S = X^T X (B, d, d) and last tokens (B, d), float64, vectorised over the chunk.

    Sequences are grouped by length (padding with zero rows, which do not change S) so that each
    group is one batched matmul.
    """
    tokens = np.asarray(tokens, dtype=np.float64)
    d = tokens.shape[1]
    lengths = np.diff(offsets)
    B = lengths.size
    last = tokens[offsets[1:] - 1]
    S = np.empty((B, d, d))
    if B and (lengths == lengths[0]).all():
        X = tokens.reshape(B, int(lengths[0]), d)
        np.matmul(X.transpose(0, 2, 1), X, out=S)
        return S, last
    padded = np.concatenate([tokens, np.zeros((1, d))])
    zero_row = tokens.shape[0]
    order = np.argsort(lengths, kind="stable")
    sorted_len = lengths[order]
    start = 0
    while start < B:
        lo_len = int(sorted_len[start])
        limit = lo_len + lo_len // 4 + 4  # pad by at most ~25 % (+4 rows) within a group
        stop = int(np.searchsorted(sorted_len, limit, side="right"))
        idx_seq = order[start:stop]
        L = int(sorted_len[stop - 1])
        ar = np.arange(L)
        rows = offsets[idx_seq][:, None] + ar[None, :]
        rows = np.where(ar[None, :] < lengths[idx_seq][:, None], rows, zero_row)
        X = padded[rows]
        S[idx_seq] = np.matmul(X.transpose(0, 2, 1), X)
        start = stop
    return S, last


def chunk_features(tokens: np.ndarray, offsets: np.ndarray, targets: np.ndarray | None, d: int) -> Features:
    """Statistics of one in-memory chunk (tokens (t, d), offsets from 0, targets (B, d) or None)."""
    S, last = sequence_moments(tokens, offsets)
    B = S.shape[0]
    psi = n_features(d)
    width = psi + (d if targets is not None else 0)
    F = np.empty((B, width))
    features_from_moments(S, last, out=F[:, :psi])
    if targets is not None:
        F[:, psi:] = targets
    # One syrk for [H | Y]: its blocks are gram, moments and target_gram.
    G = F.T @ F
    return Features(
        d=d, n_samples=B, n_tokens=int(offsets[-1]),
        gram=G[:psi, :psi], token_gram=S.sum(axis=0), last_token_gram=last.T @ last,
        moments=G[:psi, psi:] if targets is not None else None,
        target_gram=G[psi:, psi:] if targets is not None else None,
    )


# --------------------------------------------------------------------------------------------
# the reduction
# --------------------------------------------------------------------------------------------


def default_chunk_size(info: formats.TokensInfo) -> int:
    """Samples per chunk so that the chunk's buffers stay near CHUNK_BYTES."""
    psi = n_features(info.d)
    mean_len = max(1.0, info.n_tokens / info.n_samples)
    per_sample = 8 * (psi + info.d) + 8 * info.d * mean_len * 3 + 8 * info.d * info.d * 2
    return int(max(1, min(info.n_samples, CHUNK_BYTES // per_sample)))


def spans(lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    """Half-open ranges [a, b) of at most `size` samples covering [lo, hi)."""
    size = max(1, int(size))
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)]


def reduce_span(info: formats.TokensInfo, span: tuple[int, int], chunk_size: int | None = None) -> Features:
    """Statistics of samples [lo, hi) of the tokens file `info.path` (opened here, read in chunks)."""
    lo, hi = span
    chunk_size = chunk_size or default_chunk_size(info)
    total = Features.zeros(info.d, info.has_targets, info.dtype)
    with formats.open_input(info.path) as f:
        for a, b in spans(lo, hi, chunk_size):
            tokens, offsets, targets = formats.read_tokens_span(f, info, a, b)
            formats.check_finite(tokens, offsets, targets, a, info.path)
            part = chunk_features(tokens, offsets, targets, info.d)
            _add_into(total, part)
    total.sample_range = (lo, hi)
    total.token_dtype = info.dtype
    return total


def _add_into(acc: Features, part: Features) -> None:
    acc.n_samples += part.n_samples
    acc.n_tokens += part.n_tokens
    acc.gram += part.gram
    acc.token_gram += part.token_gram
    acc.last_token_gram += part.last_token_gram
    if acc.moments is not None:
        acc.moments += part.moments
        acc.target_gram += part.target_gram


def reduce_spans(info: formats.TokensInfo, span_list: Sequence[tuple[int, int]],
                 map: Callable[..., Iterable[Features]] = map,  # noqa: A002 (cooler-style name)
                 chunk_size: int | None = None,
                 progress: Callable[[int], None] | None = None) -> Features:
    """Sum of `reduce_span` over `span_list`, evaluated with `map` (builtin, pool.map, ...)."""
    total = Features.zeros(info.d, info.has_targets, info.dtype)
    for part in map(partial(reduce_span, info, chunk_size=chunk_size), span_list):
        _add_into(total, part)
        if progress is not None:
            progress(part.n_samples)
    if span_list:
        total.sample_range = (span_list[0][0], span_list[-1][1])
    return total


def check_memory(d: int, budget_bytes: int | None = None) -> None:
    """Refuse up front a d whose psi x psi statistics (and their solve) would not fit in memory."""
    if budget_bytes is None:
        budget_bytes = _available_memory()
    need = _stats_bytes(d)
    if need > budget_bytes:
        fits = 1
        while _stats_bytes(fits + 1) <= budget_bytes:
            fits += 1
        raise InputError(
            f"d = {d} needs psi = {n_features(d)} features and about {need / 2**30:.1f} GiB for the "
            f"psi x psi statistics, more than the {budget_bytes / 2**30:.1f} GiB available; "
            f"the largest d that fits is {fits}")


def _stats_bytes(d: int) -> int:
    psi = n_features(d)
    return 3 * 8 * (psi + d) ** 2  # accumulator, per-chunk product, eigen-solve workspace


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**40


def featurize(path: str | os.PathLike, chunk_size: int | None = None,
              shard: tuple[int, int] | None = None,
              map: Callable[..., Iterable[Features]] = map,  # noqa: A002
              progress: Callable[[int], None] | None = None) -> Features:
    """Sufficient statistics of a tokens file, streamed in chunks of `chunk_size` samples.

    `shard=(i, M)` restricts to the i-th (0-based) of M contiguous sample ranges. `map` evaluates
    the chunk reductions (builtin map, a pool's map, ...); results are summed in order.
    """
    info = formats.inspect_tokens(path)
    check_memory(info.d)
    lo, hi = 0, info.n_samples
    if shard is not None:
        i, m = shard
        if not (m >= 1 and 0 <= i < m):
            raise InputError(f"shard {i}/{m}: need 0 <= i < M")
        lo, hi = shard_range(info.n_samples, i, m)
        if hi <= lo:
            raise InputError(f"shard {i}/{m} is empty: the file has only {info.n_samples} samples", path)
    size = chunk_size or default_chunk_size(info)
    feats = reduce_spans(info, spans(lo, hi, size), map=map, chunk_size=size, progress=progress)
    feats.source = formats.source_identity(path)
    return feats


def shard_range(n: int, i: int, m: int) -> tuple[int, int]:
    """The i-th of m contiguous, nearly equal ranges of [0, n)."""
    return (n * i) // m, (n * (i + 1)) // m


def with_source(feats: Features, source: dict[str, Any] | None) -> Features:
    return replace(feats, source=source)
