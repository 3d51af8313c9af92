"""Tokens files: their layout and rules (validation), and the one chunk reader of mhla.

A tokens file holds `tokens` (T, d) + `offsets` (N+1,), or `tokens` (N, n, d); optional `targets`
and `weights` (docs/tokens.md). `iter_chunks` reads half-open sample ranges [a, b) of it; every
command that reads tokens (featurize, predict, compare, the witness, inspect, probes) goes through it.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
import math
import os
import sys
from typing import Any

import h5py
import numpy as np

from . import formats
from ..errors import InputError, Refused
from ..samples import LAST, Samples, check_attention, from_attrs, samples_of
from ..signals import check_interrupted


# Largest number of offsets read at once while validating a ragged tokens file.
_OFFSET_BLOCK = 1 << 20


@dataclass(frozen=True)
class TokensInfo:
    """Layout of a validated tokens file (nothing is loaded)."""

    path: str
    layout: str  # "ragged" (tokens (T, d) + offsets) or "dense" (tokens (N, n, d))
    n_samples: int
    d: int
    n_tokens: int
    dtype: str
    has_targets: bool
    seq_len: int | None  # for the dense layout
    # What a sample is (mhla_cli.samples): LAST, or for per-position data (targets (T, d) / (N, n, d),
    # weights per position) CAUSAL or BIDIRECTIONAL as the file's `attention` attribute says (causal
    # without it; `read_as` applies an --attention option).
    samples: Samples = LAST
    # Optional `weights`: (N,) for last-token data, (T,) or (N, n) for per-position data.
    has_weights: bool = False
    # Width of the targets when it differs from d (a head's output beside the hidden states);
    # None: the targets are d wide, or there are none (`out_dim`).
    d_out: int | None = None
    # The file's root attribute `attention` ("causal" / "bidirectional"), None when it has none.
    attention: str | None = None
    # The bias terms (docs/bias_terms.md, `with_bias_terms`): the reader appends a constant coordinate 1 to
    # every token (`d` counts it) and, with `target_pad`, a coordinate 0 to every target (`out_dim` counts it).
    constant: bool = False
    target_pad: bool = False

    @property
    def per_position(self) -> bool:
        """Targets and weights are stored per position (CAUSAL or BIDIRECTIONAL samples)."""
        return self.samples.per_position

    @property
    def out_dim(self) -> int:
        """Width of the targets (d unless the file says otherwise)."""
        return self.d if self.d_out is None else int(self.d_out)

    @property
    def dense_len(self) -> int:
        """The positions of every sample of the dense layout (`seq_len`, which it always has)."""
        assert self.seq_len is not None, "dense_len of a ragged layout"
        return int(self.seq_len)

    @property
    def stored_d(self) -> int:
        """Width of the tokens as stored (`d` less the appended constant coordinate)."""
        return self.d - int(self.constant)


def inspect_tokens(path: str | os.PathLike) -> TokensInfo:
    """Validate the structure of a tokens file (shapes, dtypes, offsets) and describe it."""
    with formats.open_input(path) as f:
        formats.expect_kind(f, path, "tokens")
        return _inspect_tokens_open(f, path)


def _inspect_tokens_open(f: h5py.File, path: str | os.PathLike) -> TokensInfo:
    if "tokens" not in f or not isinstance(f["tokens"], h5py.Dataset):
        raise InputError("missing dataset 'tokens' (shape (T, d) with 'offsets', or (N, n, d))", path)
    tok = f["tokens"]
    formats.check_numeric(tok, "tokens", path)
    if tok.ndim == 3:
        if "offsets" in f:
            raise InputError("'tokens' has shape (N, n, d) but an 'offsets' dataset is present; "
                             "use tokens (T, d) with offsets, or (N, n, d) without", path)
        N, n, d = (int(s) for s in tok.shape)
        if N == 0:
            raise InputError("no samples (tokens has shape (0, n, d))", path)
        if n == 0 or d == 0:
            raise InputError(f"'tokens' has shape {tok.shape}: sequences need >= 1 token of dimension >= 1", path)
        layout, T, seq_len = "dense", N * n, n
    elif tok.ndim == 2:
        T, d = (int(s) for s in tok.shape)
        if d == 0:
            raise InputError("'tokens' has shape (T, 0): token dimension must be >= 1", path)
        if "offsets" not in f:
            raise InputError("'tokens' has shape (T, d) but there is no 'offsets' dataset (N+1 integers "
                             "marking where each sequence starts); or store tokens as (N, n, d)", path)
        off = f["offsets"]
        if not isinstance(off, h5py.Dataset) or off.ndim != 1 or off.dtype.kind not in "iu":
            raise InputError("'offsets' must be a 1-d integer dataset of length N+1", path)
        N = int(off.shape[0]) - 1
        if N <= 0:
            raise InputError("no samples ('offsets' needs N+1 >= 2 entries)", path)
        _check_offsets(off, T, path)
        layout, seq_len = "ragged", None
    else:
        raise InputError(f"'tokens' has rank {tok.ndim} (shape {tok.shape}), expected (T, d) with "
                         "'offsets' or (N, n, d)", path)
    has_targets = "targets" in f
    per_position = False
    d_out = None
    if has_targets:
        tg = f["targets"]
        if not isinstance(tg, h5py.Dataset):
            raise InputError("'targets' is a group, expected a dataset (N, d)", path)
        formats.check_numeric(tg, "targets", path)
        shape = tuple(int(s) for s in tg.shape)
        per_position = _targets_layout(shape, layout, N, T, d, seq_len, path)
        if shape and shape[-1] != d:
            d_out = shape[-1]
    has_weights = "weights" in f
    if has_weights:
        per_position = _check_weights_shape(f["weights"], layout, N, T, seq_len, has_targets, per_position, path)
    attention = _attention_attr(f, path)
    if attention is not None and not per_position:
        if (has_targets or has_weights) and N != T:
            raise InputError(f"attribute 'attention' is {attention!r} but the targets / weights are per sequence: "
                             "attention applies to per-position data; the file is inconsistent", path)
        per_position = True  # no per-sequence data: every position is a sample, read as the attribute says
    samples = samples_of(per_position) if attention is None else from_attrs({**f.attrs, "per_position": 1}, path)
    return TokensInfo(str(path), layout, N, d, T, str(tok.dtype), has_targets, seq_len,
                      samples, has_weights, d_out, attention)


def _attention_attr(f: h5py.File, path: str | os.PathLike) -> str | None:
    """The file's root attribute `attention`, validated; None when absent."""
    if "attention" not in f.attrs:
        return None
    v = f.attrs["attention"]
    v = v.decode() if isinstance(v, bytes) else str(v)
    return check_attention(v, "attribute 'attention'", path)


def read_as(info: TokensInfo, attention: str | Samples | None) -> TokensInfo:
    """`info` with its per-position samples read with `attention` (a per-position layout or its name, mhla_cli.samples;
    None: as the file says, causal without its attribute). Refused: attention for data with one target per
    sequence, and an attention that contradicts the file's attribute (its layout's name or parameters)."""
    name = check_attention(attention)
    if name is None:
        return info
    if not info.per_position:
        raise InputError(f"attention {name!r} applies to per-position samples, but this file holds one "
                         "target per sequence (last-token data)", info.path)
    if info.attention is not None and info.attention != name:
        raise InputError(f"attention {name!r} was asked but the file's attribute 'attention' is "
                         f"{info.attention!r}", info.path)
    if isinstance(attention, Samples):
        samples = samples_of(True, attention)
        if info.attention is not None and samples != info.samples:
            raise InputError(f"the layout {samples} was asked but the file's is {info.samples}", info.path)
    else:
        samples = info.samples if info.attention is not None else samples_of(True, name)
    return replace(info, samples=samples)


def with_bias_terms(info: TokensInfo, pad_targets: bool = True) -> TokensInfo:
    """`info` read with the bias terms (docs/bias_terms.md): every token x becomes (x, 1), so that the MHLA of
    these tokens holds the terms a head's biases add; with `pad_targets` every target y becomes (y, 0) (the
    statistics of a fit keep the MHLA's square shape: the padded output's coefficients are exactly 0)."""
    if info.constant:
        return info
    out = info.out_dim
    pad = bool(pad_targets and info.has_targets)
    d_out = None if not info.has_targets or out + int(pad) == info.d + 1 else out + int(pad)
    return replace(info, d=info.d + 1, constant=True, target_pad=pad, d_out=d_out)


def require_square(info: TokensInfo, what: str) -> None:
    """Refuse (one line naming `mhla reduce`) a file whose targets are not as wide as its tokens, for
    `what`, a job that needs equal widths (the MHLA maps R^d to R^d)."""
    if info.has_targets and info.out_dim != info.d:
        raise Refused(f"the targets are {info.out_dim} wide but the tokens d = {info.d}: {what} needs targets "
                      "of the tokens' width; map both to the same dimension with {reduce}", info.path,
                      reduce={"tokens": info.path, "dim": "K"})


def _targets_layout(shape: tuple[int, ...], layout: str, N: int, T: int, d: int, seq_len: int | None,
                    path: str | os.PathLike) -> bool:
    """True for per-position targets ((T, e) with offsets, (N, n, e) with dense tokens), False for (N, e).

    The width e of the targets is d, or any other width >= 1 (`TokensInfo.d_out`: a head's output
    beside the hidden states, for `mhla reduce`). With ragged tokens and T = N (every sequence one
    token) the two meanings coincide: last-token.
    """
    e = shape[-1] if len(shape) in (2, 3) and shape[-1] >= 1 else d
    if shape == (N, e):
        return False
    if layout == "ragged" and shape == (T, e):
        return True
    if layout == "dense" and shape == (N, seq_len, e):
        return True
    per_pos = f"(T, d) = ({T}, {d})" if layout == "ragged" else f"(N, n, d) = ({N}, {seq_len}, {d})"
    raise InputError(f"'targets' has shape {shape}, expected (N, d) = ({N}, {d}) (one target per sequence) "
                     f"or {per_pos} (one target per position)", path)


def _check_weights_shape(w: Any, layout: str, N: int, T: int, seq_len: int | None, has_targets: bool,
                         per_position: bool, path: str | os.PathLike) -> bool:
    """Validate the shape of `weights`; returns whether the data are per-position.

    (N,) weighs sequences (last-token data); (T,) -- or (N, n) with dense tokens -- weighs positions,
    and without targets makes the data per-position (every weighted prefix is a sample).
    """
    if not isinstance(w, h5py.Dataset):
        raise InputError("'weights' is a group, expected a dataset", path)
    formats.check_numeric(w, "weights", path)
    shape = tuple(int(s) for s in w.shape)
    per_seq_ok = shape == (N,)
    per_pos_ok = shape == (T,) or (layout == "dense" and shape == (N, seq_len))
    if N == T:  # every sequence has one token: both meanings coincide
        per_seq_ok = per_pos_ok = per_seq_ok or per_pos_ok
    if per_position and not per_pos_ok:
        alt = f"(T,) = ({T},)" + (f" or (N, n) = ({N}, {seq_len})" if layout == "dense" else "")
        raise InputError(f"'weights' has shape {shape} but the targets are per position: expected {alt}", path)
    if has_targets and not per_position and not per_seq_ok:
        raise InputError(f"'weights' has shape {shape} but the targets are per sequence (N, d): expected "
                         f"(N,) = ({N},); for per-position weights store per-position targets", path)
    if not (per_seq_ok or per_pos_ok):
        alt = f"(N,) = ({N},) per sequence, or (T,) = ({T},)" + (
            f" or (N, n) = ({N}, {seq_len})" if layout == "dense" else "") + " per position"
        raise InputError(f"'weights' has shape {shape}, expected {alt}", path)
    return per_position or (per_pos_ok and not per_seq_ok)


def check_weights(weights: np.ndarray | None, offsets: np.ndarray, lo: int, per_position: bool,
                  path: str | os.PathLike) -> None:
    """Raise an InputError naming the first sample whose weight is negative, NaN or Inf, or positive but
    subnormal (below float64's smallest normal number, MIN_WEIGHT: its products in the sums lose their
    digits; the weights carry no units, so a common factor restores them)."""
    if weights is None or weights.size == 0:
        return
    bad = ~(np.isfinite(weights) & (weights >= 0))
    tiny = (weights > 0) & (weights < MIN_WEIGHT)
    if bad.any() or tiny.any():
        row = int(np.flatnonzero(bad | tiny)[0])
        i = lo + (int(np.searchsorted(offsets, row, side="right") - 1) if per_position else row)
        where = f"sample {i}" + (f", position {row - int(offsets[i - lo])}" if per_position else "")
        w = float(weights[row])
        if bad[row]:
            raise InputError(f"weights of {where} is {w!r}: weights must be finite and >= 0", path)
        raise InputError(f"weights of {where} is {w:.3g}, below float64's smallest normal number {MIN_WEIGHT:.3g} "
                         "(its products in the sums would lose their digits); weights carry no units: multiply "
                         "them all by the same factor (e.g. 1e300)", path)


# The smallest positive weight accepted: float64's smallest normal number (not a tolerance: float64's
# range; subnormal weights keep few or no digits in the weighted sums).
MIN_WEIGHT = sys.float_info.min


def _check_offsets(off: h5py.Dataset, T: int, path: str | os.PathLike) -> None:
    n = off.shape[0]
    for lo in range(0, n, _OFFSET_BLOCK):
        # Blocks overlap by one entry, so the step across a block boundary is checked too.
        block = np.asarray(off[lo:min(n, lo + _OFFSET_BLOCK + 1)], dtype=np.int64)
        if lo == 0 and block[0] != 0:
            raise InputError(f"offsets[0] = {block[0]}, expected 0", path)
        steps = np.diff(block)
        bad = np.flatnonzero(steps <= 0)
        if bad.size:
            i = lo + int(bad[0])
            raise InputError(f"offsets not strictly increasing at sample {i} (offsets[{i}] = {block[bad[0]]}, "
                             f"offsets[{i + 1}] = {block[bad[0] + 1]}): every sequence needs >= 1 token", path)
    last = int(off[n - 1])
    if last != T:
        raise InputError(f"offsets[N] = {last} but tokens has T = {T} rows; they must be equal", path)


def _read_positions(f: h5py.File, name: str, info: TokensInfo, lo: int, hi: int, offsets: np.ndarray
                    ) -> np.ndarray:
    """Rows of a per-position dataset (targets or weights) for samples [lo, hi) (offsets from 0)."""
    ds = f[name]
    if info.layout == "dense" and ds.ndim >= 2 and ds.shape[1] == info.seq_len and ds.shape[0] == info.n_samples \
            and (ds.ndim == 3 or name == "weights"):
        return np.asarray(ds[lo:hi])
    t0 = lo * info.dense_len if info.layout == "dense" else int(f["offsets"][lo])
    return np.asarray(ds[t0:t0 + int(offsets[-1])])


def read_weights(f: h5py.File, info: TokensInfo, lo: int, hi: int, offsets: np.ndarray
                      ) -> np.ndarray | None:
    """float64 weights of samples [lo, hi): (hi-lo,) per sequence or (t,) per position; None if absent."""
    if not info.has_weights:
        return None
    if info.per_position:
        return _read_positions(f, "weights", info, lo, hi, offsets).reshape(-1).astype(np.float64)
    return np.asarray(f["weights"][lo:hi], dtype=np.float64)


# Largest token / target magnitude accepted: the cubic statistics sum N * n^2 * |x|^6 (tokens) and
# N * |y|^2 (targets), which must stay far from the float64 overflow at ~1.8e308.
MAX_TOKEN_ABS = 1e40


MAX_TARGET_ABS = 1e100

# MAX_EXACT_INT (2^53, mhla_cli.numerics): int64 / uint64 tokens beyond it would be rounded when
# converted to float64, so they are refused.
from ..numerics import MAX_EXACT_INT  # noqa: E402


def check_exact_ints(arr: np.ndarray | None, offsets: np.ndarray, lo: int, path: str | os.PathLike | None,
                     name: str = "tokens") -> None:
    """Refuse integers that float64 cannot hold exactly (|x| > 2^53), naming the first such sample."""
    if arr is None or arr.dtype.kind not in "iu" or arr.dtype.itemsize < 8 or arr.size == 0:
        return
    top, bottom = int(arr.max()), int(arr.min())  # Python ints: no overflow of abs(int64 min)
    if top <= MAX_EXACT_INT and bottom >= -MAX_EXACT_INT:
        return
    a2 = arr.reshape(arr.shape[0], -1)
    bad = (a2 > MAX_EXACT_INT).any(axis=1)
    if arr.dtype.kind == "i":
        bad |= (a2 < -MAX_EXACT_INT).any(axis=1)
    row = int(np.flatnonzero(bad)[0])
    value = top if top > MAX_EXACT_INT else bottom
    i = lo + int(np.searchsorted(offsets, row, side="right") - 1) if name == "tokens" else lo + row
    raise InputError(f"{name} of sample {i} hold {arr.dtype} values up to {value}, beyond 2^53 = {MAX_EXACT_INT}: "
                     "float64 cannot hold them exactly (store the tokens as float64, or rescale them)", path)


def check_finite(tokens: np.ndarray, offsets: np.ndarray, targets: np.ndarray | None, lo: int,
                 path: str | os.PathLike) -> None:
    """Raise an InputError naming the first sample that holds NaN or Inf (or values so large that
    the float64 statistics would overflow, or integers float64 cannot hold exactly: check_exact_ints)."""
    check_interrupted()  # called once per chunk: a cheap point to honour a swallowed signal
    check_exact_ints(tokens, offsets, lo, path)
    for name, arr, limit in (("tokens", tokens, MAX_TOKEN_ABS), ("targets", targets, MAX_TARGET_ABS)):
        if arr is None or arr.dtype.kind != "f" or arr.size == 0:
            continue
        top = float(np.max(np.abs(arr)))  # NaN propagates through max
        if top <= limit:
            continue
        a2 = arr.reshape(arr.shape[0], -1)
        finite = np.isfinite(a2).all(axis=1)
        if not finite.all():
            row, what = int(np.flatnonzero(~finite)[0]), "contain NaN or Inf"
        else:
            row = int(np.flatnonzero((np.abs(a2) > limit).any(axis=1))[0])
            what = (f"contain values up to {top:.3g}, too large for the float64 statistics "
                    f"(limit {limit:.0e}); rescale the data")
        by_token = name == "tokens" or (arr.shape[0] == offsets[-1] and arr.shape[0] != offsets.size - 1)
        i = lo + (int(np.searchsorted(offsets, row, side="right") - 1) if by_token else row)
        raise InputError(f"{name} of sample {i} {what}", path)


class ReadBuffers:
    """Reusable destination arrays of one reader slot (grown on demand)."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: Any = np.float64) -> np.ndarray:
        size = math.prod(shape)
        buf = self._arrays.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self._arrays[name] = np.empty(max(size, int(0 if buf is None else buf.size * 1.25)), dtype)
        return buf[:size].reshape(shape)


def read_chunk(f: h5py.File, info: TokensInfo, a: int, b: int, bufs: ReadBuffers,
                with_weights: bool = False) -> tuple[Any, ...]:  # (tokens, offsets, targets[, weights]) (targets, weights: or None)
    """Samples [a, b) (tokens (t, d) in the stored dtype, offsets from 0, float64 targets) into `bufs`.

    Tokens keep their stored dtype (half the bytes of float64 for float32); `sequence_moments`
    converts them block by block. Unusual dtypes (float16, big-endian, ...) are read as float64.
    """
    d = info.stored_d
    dt = np.dtype(info.dtype)
    tok_dtype = dt if dt.isnative and dt in (np.float32, np.float64, np.int32, np.int64, np.int16,
                                              np.int8, np.uint8, np.uint16, np.uint32) else np.float64
    if dt.kind in "iu" and dt.itemsize == 8:
        # 64-bit integers stay integers (any byte order): check_exact_ints sees the stored values
        tok_dtype = np.dtype(f"{dt.kind}8")
    if info.layout == "dense":
        n = info.dense_len
        dest = bufs.get("tokens", (b - a, n, d), tok_dtype)
        if b > a:
            f["tokens"].read_direct(dest, np.s_[a:b])
        tokens = dest.reshape(-1, d)
        offsets = np.arange(b - a + 1, dtype=np.int64) * n
    else:
        offsets = np.asarray(f["offsets"][a:b + 1], dtype=np.int64)
        t0, t1 = int(offsets[0]), int(offsets[-1])
        tokens = bufs.get("tokens", (t1 - t0, d), tok_dtype)
        if t1 > t0:
            f["tokens"].read_direct(tokens, np.s_[t0:t1])
        offsets -= t0
    if info.constant:
        tokens = _with_constant(tokens, bufs)
    targets = None
    if info.has_targets and getattr(info, "per_position", False):
        # per-position targets (t, d): rows of the chunk's tokens
        e = info.out_dim - int(info.target_pad)
        targets = bufs.get("targets", (int(offsets[-1]), e))
        if b > a:
            if info.layout == "dense":
                f["targets"].read_direct(targets.reshape(b - a, info.dense_len, e), np.s_[a:b])
            else:
                t0 = int(f["offsets"][a])
                f["targets"].read_direct(targets, np.s_[t0:t0 + int(offsets[-1])])
    elif info.has_targets:
        targets = bufs.get("targets", (b - a, info.out_dim - int(info.target_pad)))
        if b > a:
            f["targets"].read_direct(targets, np.s_[a:b])
    if targets is not None and info.target_pad:
        padded = bufs.get("targets_padded", (targets.shape[0], targets.shape[1] + 1))
        padded[:, :-1] = targets
        padded[:, -1] = 0.0
        targets = padded
    if with_weights:
        return tokens, offsets, targets, read_weights(f, info, a, b, offsets)
    return tokens, offsets, targets


def _with_constant(tokens: np.ndarray, bufs: ReadBuffers) -> np.ndarray:
    """(t, d + 1): the tokens with a constant coordinate 1 appended (the bias terms), in their dtype."""
    out = bufs.get("tokens_constant", (tokens.shape[0], tokens.shape[1] + 1), tokens.dtype)
    out[:, :-1] = tokens
    out[:, -1] = 1
    return out


def iter_chunks(info: TokensInfo, sample_range: tuple[int, int], chunk_size: int,
                prefetch: bool = True, with_weights: bool = False) -> Iterator[tuple[Any, ...]]:
    """Yield (a, b, tokens, offsets, targets) for the chunks of samples [lo, hi) (see read_chunk).

    Per-position data give targets (t, d). `with_weights` appends the chunk's float64 weights
    ((b-a,) per sequence or (t,) per position, or None) to every item.

    The arrays are reused: each is valid until the next item is requested. With `prefetch` a
    reader thread reads the next chunk while the caller computes on this one.
    """
    lo, hi = sample_range
    todo = chunk_ranges(lo, hi, chunk_size)
    slots = (ReadBuffers(), ReadBuffers())
    with formats.open_input(info.path) as f:
        if not prefetch or len(todo) < 2:
            for a, b in todo:
                yield (a, b, *read_chunk(f, info, a, b, slots[0], with_weights))
            return
        with ThreadPoolExecutor(1, thread_name_prefix="mhla-read") as pool:
            fut = pool.submit(read_chunk, f, info, *todo[0], slots[0], with_weights)
            for i, (a, b) in enumerate(todo):
                chunk = fut.result()
                if i + 1 < len(todo):
                    # the slot written next was last used by chunk i - 1, whose consumer is done
                    fut = pool.submit(read_chunk, f, info, *todo[i + 1], slots[(i + 1) % 2], with_weights)
                yield (a, b, *chunk)


def check_chunk(info: TokensInfo, a: int, tokens: np.ndarray, offsets: np.ndarray,
                 targets: np.ndarray | None, top: float) -> None:
    """Refuse NaN, Inf and overflowing magnitudes: a cheap test on `top` (>= every squared token
    entry, NaN if any is NaN), the exact check on failure."""
    bad = False
    if np.dtype(info.dtype).kind == "f":
        bad = not top <= MAX_TOKEN_ABS ** 2
    else:
        check_exact_ints(tokens, offsets, a, info.path)
    if targets is not None and targets.size:  # max and -min: no |targets| array (per-position targets are large)
        bad = bad or not max(float(targets.max()), -float(targets.min())) <= MAX_TARGET_ABS
    if bad:
        check_finite(tokens, offsets, targets, a, info.path)


def chunk_ranges(lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    """Half-open ranges [a, b) of at most `size` samples covering [lo, hi)."""
    size = max(1, int(size))
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)]
