"""HDF5 file formats of mhla: names, versions, validation, provenance and atomic writes.

Every file mhla writes has root attributes ``mhla_kind``, ``mhla_format_version`` and
``mhla_version``; tokens files made by users need no attributes at all. See docs/formats.md.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ._version import __version__
from .errors import InputError
from .memory import check_memory
from .signals import check_interrupted, shield_signals
from .features import n_features

FORMAT_NAME = "mhla"
FORMAT_VERSION = 2
KINDS = ("tokens", "features", "model", "heads", "predictions")

# Largest number of offsets read at once while validating a ragged tokens file.
_OFFSET_BLOCK = 1 << 20


def _version() -> str:
    return __version__


# --------------------------------------------------------------------------------------------
# opening files
# --------------------------------------------------------------------------------------------


# errno values meaning "this filesystem does not support file locks" (Lustre/NFS/GPFS mounts without
# flock): reading is then safe without a lock, as HDF5's own BEST_EFFORT mode does for ENOSYS.
_LOCK_UNSUPPORTED = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP}
_LOCK_HELD = {errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES}
# errno values of a failed write (disk full, file too large, quota).
_WRITE_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS}


def _h5_errno(exc: BaseException) -> int | None:
    """The errno behind an h5py error (h5py only sets it for some; HDF5 puts it in the message)."""
    if isinstance(exc, OSError) and exc.errno:
        return int(exc.errno)
    m = re.search(r"errno = (\d+)", str(exc))
    return int(m.group(1)) if m else None


def _is_lock_error(exc: BaseException) -> bool:
    return re.search(r"\block", str(exc).lower()) is not None  # "unable to lock file", not "superblock"


def _is_write_error(exc: BaseException) -> bool:
    """True for errors of writing (disk full, quota, file too large), as opposed to reading."""
    text = str(exc).lower()
    if "write failed" in text or "unable to extend file" in text or "can't write" in text:
        return True
    return isinstance(exc, OSError) and not _is_lock_error(exc) and exc.errno in _WRITE_ERRNOS


def _env_locking() -> bool | str | None:
    """Locking requested by HDF5_USE_FILE_LOCKING (FALSE/0, TRUE/1, BEST_EFFORT), or None if unset."""
    v = os.environ.get("HDF5_USE_FILE_LOCKING", "").strip().upper()
    if v in ("FALSE", "0"):
        return False
    if v in ("TRUE", "1"):
        return True
    if v == "BEST_EFFORT":
        return "best-effort"
    return None


def _h5_file(p: Path, mode: str, locking: bool | str | None) -> h5py.File:
    if locking is None:
        return h5py.File(p, mode)
    try:
        return h5py.File(p, mode, locking=locking)
    except ValueError:  # HDF5 older than 1.10.7 / 1.12.1: no locking property; use the default
        return h5py.File(p, mode)


def _open_read(p: Path, locking: bool | None) -> h5py.File:
    """h5py.File(p, "r") honouring HDF5_USE_FILE_LOCKING, falling back to no lock where unsupported."""
    env = _env_locking()
    want = locking if locking is not None else env
    try:
        return _h5_file(p, "r", want)
    except OSError as exc:
        if not _is_lock_error(exc):
            raise
        code = _h5_errno(exc)
        if want is None and code in _LOCK_UNSUPPORTED:
            # The filesystem has no flock (common on cluster filesystems): read without a lock.
            return _h5_file(p, "r", False)
        if code in _LOCK_HELD:
            raise InputError(
                "is locked by another process (HDF5 file locking: probably a program writing it); wait "
                "for it to finish, or if the lock is stale or the filesystem is shared read-only, run "
                "with HDF5_USE_FILE_LOCKING=FALSE", p) from None
        raise InputError(f"cannot lock the file for reading ({_h5_reason(exc)}); on shared cluster "
                         "filesystems run with HDF5_USE_FILE_LOCKING=FALSE", p) from None


def _h5_reason(exc: BaseException) -> str:
    """A short, one-line reason from an h5py/HDF5 error message."""
    text = " ".join(str(exc).split())
    m = re.search(r"error message = '([^']*)'", text)
    if m:
        return m.group(1)
    return text[:300]


@contextlib.contextmanager
def open_input(path: str | os.PathLike, locking: bool | None = None) -> Iterator[h5py.File]:
    """Open an HDF5 file read-only, turning every way it can fail into an `InputError`.

    `locking=None` follows HDF5_USE_FILE_LOCKING (HDF5 takes a shared lock, so many readers may
    open one file at once) and reads without a lock on filesystems that do not support locks;
    `locking=False` never locks.
    """
    check_interrupted()  # re-raise a signal whose exception a destructor swallowed
    p = Path(path)
    if not p.exists():
        raise InputError("no such file", p)
    if p.is_dir():
        raise InputError("is a directory, expected an HDF5 file", p)
    if not os.access(p, os.R_OK):
        raise InputError("permission denied (the file is not readable)", p)
    try:
        is_hdf5 = h5py.is_hdf5(p)
    except OSError as exc:
        raise InputError(f"cannot read: {_h5_reason(exc)}", p) from None
    if not is_hdf5:
        raise InputError("not an HDF5 file", p)
    try:
        f = _open_read(p, locking)
    except OSError as exc:
        raise InputError(
            f"cannot open HDF5 file ({_h5_reason(exc)}); it may be truncated or corrupted", p) from None
    try:
        yield f
    except (OSError, KeyError, RuntimeError) as exc:
        if _is_write_error(exc):
            raise  # an output being written inside this block failed: not this input's fault
        # h5py raises these for corrupted or truncated datasets while reading.
        raise InputError(f"cannot read data ({_h5_reason(exc)}); the file may be truncated or corrupted",
                         p) from None
    finally:
        with contextlib.suppress(Exception):
            f.close()


def read_array(f: h5py.File, name: str, path: str | os.PathLike, finite: bool = True) -> np.ndarray:
    """Read a whole dataset, with a clear error when it is missing, not real numbers, or not finite."""
    if name not in f:
        raise InputError(f"missing dataset '{name}'", path)
    ds = f[name]
    if not isinstance(ds, h5py.Dataset):
        raise InputError(f"'{name}' is a group, expected a dataset", path)
    check_numeric(ds, name, path)
    arr = np.asarray(ds[()])
    if finite and arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise InputError(f"'{name}' contains NaN or Inf; the file is corrupted", path)
    return arr


def check_numeric(ds: h5py.Dataset, name: str, path: str | os.PathLike) -> None:
    """Raise unless the dataset holds real numbers (ints or floats; not complex, strings, compounds)."""
    kind = ds.dtype.kind
    if kind not in "iuf" or ds.dtype.names is not None:
        raise InputError(
            f"dataset '{name}' has dtype {ds.dtype}, expected real numbers (float32/float64 or integers)",
            path,
        )


def file_kind(f: h5py.File, path: str | os.PathLike) -> str:
    """The mhla kind of an open file: from its attributes, or guessed from its datasets."""
    attrs = f.attrs
    version = attrs.get("mhla_format_version")
    if version is not None and int(version) > FORMAT_VERSION:
        raise InputError(
            f"written with mhla format version {int(version)}, this mhla reads version "
            f"{FORMAT_VERSION}; upgrade mhla",
            path,
        )
    kind = attrs.get("mhla_kind")
    if kind is not None:
        kind = kind.decode() if isinstance(kind, bytes) else str(kind)
        if kind not in KINDS:
            raise InputError(f"unknown mhla_kind '{kind}'", path)
        return kind
    for name, k in (("gram", "features"), ("coef", "model"), ("V", "heads"), ("tokens", "tokens"),
                    ("predictions", "predictions")):
        if name in f:
            return k
    names = ", ".join(sorted(f.keys())) or "nothing"
    raise InputError(
        f"not an mhla file: expected a 'tokens' dataset (or an mhla features/model/heads file), found {names}",
        path,
    )


def kind_of(path: str | os.PathLike) -> str:
    """The mhla kind of the file at `path` (see `file_kind`)."""
    with open_input(path) as f:
        return file_kind(f, path)


def expect_kind(f: h5py.File, path: str | os.PathLike, *kinds: str) -> str:
    """The kind of an open file; an InputError unless it is one of `kinds`.

    For a features file this also refuses up front a d whose psi x psi statistics cannot fit in
    memory (memory.check_memory), before anything large is read.
    """
    kind = file_kind(f, path)
    if kind not in kinds:
        raise InputError(f"is a {kind} file, expected {' or '.join(kinds)}", path)
    if kind == "features" and "d" in f.attrs:
        check_memory(read_attr_int(f, "d", path), path=path)
    return kind


# --------------------------------------------------------------------------------------------
# tokens files
# --------------------------------------------------------------------------------------------


# The report of `mhla certify --on PROBES -o REPORT` (mhla_cli.probes).
KINDS += ("probes",)


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
    # Per-position (causal) data: every prefix X[:t] is a sample, targets (T, d) / (N, n, d).
    per_position: bool = False
    # Optional `weights`: (N,) for last-token data, (T,) or (N, n) for per-position data.
    has_weights: bool = False

    def sample_tokens(self, lo: int, hi: int, offsets: np.ndarray | None = None) -> int:
        """Number of tokens of samples [lo, hi)."""
        if self.layout == "dense":
            return (hi - lo) * int(self.seq_len)
        assert offsets is not None
        return int(offsets[hi] - offsets[lo])


def inspect_tokens(path: str | os.PathLike) -> TokensInfo:
    """Validate the structure of a tokens file (shapes, dtypes, offsets) and describe it."""
    with open_input(path) as f:
        expect_kind(f, path, "tokens")
        return _inspect_tokens_open(f, path)


def _inspect_tokens_open(f: h5py.File, path: str | os.PathLike) -> TokensInfo:
    if "tokens" not in f or not isinstance(f["tokens"], h5py.Dataset):
        raise InputError("missing dataset 'tokens' (shape (T, d) with 'offsets', or (N, n, d))", path)
    tok = f["tokens"]
    check_numeric(tok, "tokens", path)
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
    if has_targets:
        tg = f["targets"]
        if not isinstance(tg, h5py.Dataset):
            raise InputError("'targets' is a group, expected a dataset (N, d)", path)
        check_numeric(tg, "targets", path)
        per_position = _targets_layout(tuple(int(s) for s in tg.shape), layout, N, T, d, seq_len, path)
    has_weights = "weights" in f
    if has_weights:
        per_position = _check_weights_shape(f["weights"], layout, N, T, seq_len, has_targets, per_position, path)
    return TokensInfo(str(path), layout, N, d, T, str(tok.dtype), has_targets, seq_len, per_position, has_weights)


def _targets_layout(shape: tuple[int, ...], layout: str, N: int, T: int, d: int, seq_len: int | None,
                    path: str | os.PathLike) -> bool:
    """True for per-position targets ((T, d) with offsets, (N, n, d) with dense tokens), False for (N, d).

    With ragged tokens and T = N (every sequence one token) the two meanings coincide: last-token.
    """
    if shape == (N, d):
        return False
    if layout == "ragged" and shape == (T, d):
        return True
    if layout == "dense" and shape == (N, seq_len, d):
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
    check_numeric(w, "weights", path)
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
    """Raise an InputError naming the first sample whose weight is negative, NaN or Inf."""
    if weights is None or weights.size == 0:
        return
    bad = ~(np.isfinite(weights) & (weights >= 0))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        i = lo + (int(np.searchsorted(offsets, row, side="right") - 1) if per_position else row)
        where = f"sample {i}" + (f", position {row - int(offsets[i - lo])}" if per_position else "")
        raise InputError(f"weights of {where} is {weights[row]!r}: weights must be finite and >= 0", path)


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


def read_tokens_span(f: h5py.File, info: TokensInfo, lo: int, hi: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Samples [lo, hi) of an open tokens file: (tokens (t, d), offsets (hi-lo+1,) from 0, targets or None).

    Dense files come back in the ragged layout with equal-length offsets, so that callers handle
    one layout; `tokens` keeps the stored dtype.
    """
    check_interrupted()
    if info.layout == "dense":
        n = int(info.seq_len)
        tokens = f["tokens"][lo:hi].reshape(-1, info.d)
        offsets = np.arange(hi - lo + 1, dtype=np.int64) * n
    else:
        offsets = np.asarray(f["offsets"][lo:hi + 1], dtype=np.int64)
        tokens = f["tokens"][offsets[0]:offsets[-1]]
        offsets = offsets - offsets[0]
    targets = None
    if info.has_targets:
        if info.per_position:
            targets = _read_positions(f, "targets", info, lo, hi, offsets).reshape(-1, info.d)
        else:
            targets = f["targets"][lo:hi]
    return tokens, offsets, targets


def _read_positions(f: h5py.File, name: str, info: TokensInfo, lo: int, hi: int, offsets: np.ndarray
                    ) -> np.ndarray:
    """Rows of a per-position dataset (targets or weights) for samples [lo, hi) (offsets from 0)."""
    ds = f[name]
    if info.layout == "dense" and ds.ndim >= 2 and ds.shape[1] == info.seq_len and ds.shape[0] == info.n_samples \
            and (ds.ndim == 3 or name == "weights"):
        return np.asarray(ds[lo:hi])
    t0 = lo * int(info.seq_len) if info.layout == "dense" else int(f["offsets"][lo])
    return np.asarray(ds[t0:t0 + int(offsets[-1])])


def read_weights_span(f: h5py.File, info: TokensInfo, lo: int, hi: int, offsets: np.ndarray
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


def check_finite(tokens: np.ndarray, offsets: np.ndarray, targets: np.ndarray | None, lo: int,
                 path: str | os.PathLike) -> None:
    """Raise an InputError naming the first sample that holds NaN or Inf (or values so large that
    the float64 statistics would overflow)."""
    check_interrupted()  # called once per chunk: a cheap point to honour a swallowed signal
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


# Inputs whose datasets hold at most this many bytes are fingerprinted over all their data; larger
# ones over their structure, offsets and a fixed sample of row blocks (see `source_identity`).
FULL_FINGERPRINT_BYTES = 16 * 2**20
_SAMPLED_BLOCKS = 64
_BLOCK_BYTES = 4 * 2**20
_identity_cache: dict[tuple[Any, ...], dict[str, Any]] = {}


def _hash_dataset(h: Any, ds: h5py.Dataset, full: bool) -> None:
    """Feed a dataset's contents (all rows, or head, tail and evenly spaced blocks) into `h`."""
    if ds.ndim == 0:
        h.update(np.ascontiguousarray(ds[()]).tobytes())
        return
    n = int(ds.shape[0])
    if n == 0:
        return
    row_bytes = max(1, ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64)))
    rows = max(1, _BLOCK_BYTES // row_bytes)
    sample = max(1, rows // 16)  # a sample of ~_BLOCK_BYTES/16 per block keeps this cheap
    if full or n <= sample * (_SAMPLED_BLOCKS + 2):
        for lo in range(0, n, rows):  # every byte, in order: independent of the block size
            h.update(np.ascontiguousarray(ds[lo:min(n, lo + rows)]).tobytes())
        return
    rows = sample
    for lo in sorted({0, n - rows, *(int(s) for s in np.linspace(0, n - rows, _SAMPLED_BLOCKS))}):
        h.update(f"@{lo}:{rows};".encode())
        h.update(np.ascontiguousarray(ds[lo:min(n, lo + rows)]).tobytes())


def source_identity(path: str | os.PathLike, full: bool | None = None) -> dict[str, Any]:
    """Name, size and content fingerprint of an input file, for provenance.

    The fingerprint is a SHA-256 (first 32 hex digits) of the datasets' names, shapes, dtypes and
    contents plus the attributes other than mhla_* (format and provenance), so it identifies the
    data, not the bytes of the file (re-saving the same data, with any chunking or compression,
    gives the same fingerprint). Files with more than
    FULL_FINGERPRINT_BYTES of data are fingerprinted over their shapes, every offset and a fixed
    sample of row blocks (`fingerprint_scope` says which); `full=True` forces a hash of everything.
    """
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        raise InputError("no such file", p) from None
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, full, FULL_FINGERPRINT_BYTES, _BLOCK_BYTES)
    if key in _identity_cache:
        return dict(_identity_cache[key])
    h = hashlib.sha256()
    with open_input(p) as f:
        dsets = {k: v for k, v in f.items() if isinstance(v, h5py.Dataset)}
        total = sum(int(ds.size) * ds.dtype.itemsize for ds in dsets.values())
        whole = bool(full) if full is not None else total <= FULL_FINGERPRINT_BYTES
        for k in sorted(f.attrs.keys()):
            if not k.startswith("mhla_"):  # format and provenance metadata are not data
                with contextlib.suppress(Exception):
                    h.update(f"attr {k}={f.attrs[k]!r};".encode())
        for name in sorted(dsets):
            ds = dsets[name]
            h.update(f"{name}:{ds.shape}:{ds.dtype.str};".encode())
            _hash_dataset(h, ds, whole or name == "offsets")
    ident = {"path": str(p), "name": p.name, "size": st.st_size, "fingerprint": h.hexdigest()[:32],
             "fingerprint_scope": "all data" if whole else "shapes, offsets and sampled rows"}
    _identity_cache[key] = ident
    return dict(ident)


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------


def check_output_path(out: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = ()) -> Path:
    """Reject an output path that cannot be written or that names one of the inputs."""
    o = Path(out)
    if o.is_dir():
        raise InputError("output path is a directory; give a file name", o)
    if o.exists() and not o.is_file():
        raise InputError("output path exists and is not a regular file (a device, pipe or socket); "
                         "give a file name", o)
    parent = o.parent if str(o.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"output directory '{parent}' does not exist", o)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"output directory '{parent}' is not writable", o)
    for i in inputs:
        if i is None:
            continue
        ip = Path(i)
        try:
            same = ip.exists() and o.exists() and os.path.samefile(ip, o)
        except OSError:
            same = False
        if same or ip.resolve() == o.resolve():
            raise InputError("output would overwrite an input file; choose another -o path", o)
    return o


# Set when HDF5 failed to write a file: libhdf5 may then crash at interpreter shutdown while it
# retries the flush, so the CLI exits with os._exit after printing the error (see cli.main).
_hdf5_write_failed = False
_failed_writes: list[BaseException] = []


def hdf5_write_failed() -> bool:
    """True if an HDF5 write failed in this process (the CLI then skips interpreter teardown)."""
    return _hdf5_write_failed


def _is_h5py_dealloc_noise(exc_type: Any, tb: Any) -> bool:
    while tb is not None:
        if "h5py" in tb.tb_frame.f_code.co_filename and "_objects" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


@contextlib.contextmanager
def _quiet_h5py_dealloc() -> Iterator[None]:
    """Silence the tracebacks h5py prints from object destructors after a failed write.

    (The failure itself is raised by File.close and reported as one clear error line.)
    """
    old_unraisable, old_except = sys.unraisablehook, sys.excepthook

    def unraisable(u: Any) -> None:
        if "h5py" in repr(u.object) or _is_h5py_dealloc_noise(u.exc_type, u.exc_traceback):
            return
        old_unraisable(u)

    def excepthook(t: Any, v: Any, tb: Any) -> None:
        if _is_h5py_dealloc_noise(t, tb):
            return
        old_except(t, v, tb)

    sys.unraisablehook, sys.excepthook = unraisable, excepthook
    try:
        yield
    finally:
        sys.unraisablehook, sys.excepthook = old_unraisable, old_except


def _from_h5py(exc: BaseException) -> bool:
    """True if the exception was raised inside h5py (i.e. by libhdf5)."""
    tb = exc.__traceback__
    while tb is not None:
        if "h5py" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `out`; rename it to `out` only if the block succeeds.

    The temporary file is `.<name>.<random>.tmp-mhla` in the output's directory. On any error,
    KeyboardInterrupt or `Interrupted` it is removed and `out` is left as it was; a write error
    (disk full, quota, file too large) becomes an `InputError` naming `out`.
    """
    global _hdf5_write_failed
    o = Path(out)
    parent = o.parent if str(o.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{o.name}.", suffix=".tmp-mhla", dir=parent)
    except OSError as exc:
        raise InputError(f"cannot create a file in '{parent}' ({exc.strerror or exc})", o) from None
    os.close(fd)
    tmp_path = Path(tmp)
    # mkstemp creates 0600; give the output the permissions a plain open() would (0666 & ~umask).
    umask = os.umask(0)
    os.umask(umask)
    with contextlib.suppress(OSError):
        os.chmod(tmp_path, 0o666 & ~umask)
    try:
        with _quiet_h5py_dealloc():
            yield tmp_path
        check_interrupted()  # never commit an output after a signal
        os.replace(tmp_path, o)
        _fsync_dir(parent)
    except (OSError, RuntimeError) as exc:
        with shield_signals(), contextlib.suppress(OSError):
            tmp_path.unlink()
        if isinstance(exc, RuntimeError) and not _is_write_error(exc):
            raise
        from_h5py = _from_h5py(exc)
        if from_h5py:
            # After a failed write libhdf5 (2.0) crashes when the file's h5py objects are freed, so
            # keep them (referenced by the traceback) alive; the CLI leaves through os._exit.
            _hdf5_write_failed = True
            _failed_writes.append(exc)
        reason = _h5_reason(exc) if from_h5py or not getattr(exc, "strerror", None) else exc.strerror
        raise InputError(f"cannot write output ({reason}); nothing was written", o) from None
    except BaseException:
        with shield_signals(), contextlib.suppress(OSError):
            tmp_path.unlink()
        raise


_command: list[str] | None = None


def set_command(argv: list[str] | None) -> None:
    """Record the command line that provenance attributes report (the CLI sets it; default sys.argv)."""
    global _command
    _command = None if argv is None else [str(a) for a in argv]


def command_line() -> str:
    """The command line of this run, shell-quoted."""
    argv = _command if _command is not None else ([Path(sys.argv[0]).name] + sys.argv[1:] if sys.argv else [])
    return shlex.join(argv)


def provenance(inputs: tuple[str | os.PathLike, ...] = ()) -> dict[str, Any]:
    """Attributes saying which mhla, command and inputs (path, size, fingerprint) made a file."""
    ids = []
    for i in inputs:
        if i is None:
            continue
        try:
            ids.append(source_identity(i))
        except InputError:
            ids.append({"path": str(i)})
    return {
        "mhla_version": _version(),
        "mhla_command": command_line(),
        "mhla_inputs": json.dumps(ids),
        "mhla_created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# Outputs up to this size are built in memory (HDF5 core driver) and written with plain file I/O,
# so that a full disk gives a clean OSError instead of a failure inside libhdf5.
def header(kind: str, inputs: tuple[str | os.PathLike, ...] = ()) -> dict[str, Any]:
    """Root attributes of every file mhla writes: kind, format version and provenance."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    return {"mhla_kind": kind, "mhla_format_version": FORMAT_VERSION, **provenance(inputs)}


IN_MEMORY_WRITE_BYTES = 1 << 30


def _fill(f: h5py.File, meta: Mapping[str, Any], attrs: Mapping[str, Any] | None,
          datasets: Mapping[str, np.ndarray | None], compression: str | None) -> None:
    for k, v in meta.items():
        f.attrs[k] = v
    for k, v in (attrs or {}).items():
        if v is not None:
            f.attrs[k] = v
    for name, arr in datasets.items():
        if arr is None:
            continue
        arr = np.asarray(arr)
        if compression and arr.size > 1024:
            f.create_dataset(name, data=arr, compression=compression, shuffle=True)
        else:
            f.create_dataset(name, data=arr)


def _check_free_space(o: Path, need: int) -> None:
    parent = o.parent if str(o.parent) else Path(".")
    try:
        st = os.statvfs(parent)
    except (OSError, AttributeError):
        return
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise InputError(f"not enough disk space: the output needs about {need / 2**20:.1f} MiB, "
                         f"{free / 2**20:.1f} MiB are free in '{parent}'; nothing was written", o)


def create_output(tmp: str | os.PathLike) -> h5py.File:
    """Create a new HDF5 file at a private temporary path (no file lock: nobody else opens it)."""
    return _h5_file(Path(tmp), "w", False)


def write_file(out: str | os.PathLike, kind: str, datasets: Mapping[str, np.ndarray | None],
               attrs: Mapping[str, Any] | None = None, inputs: tuple[str | os.PathLike, ...] = (),
               compression: str | None = None) -> Path:
    """Write an mhla file of `kind` atomically (temp file + rename); None datasets are skipped.

    Files up to IN_MEMORY_WRITE_BYTES are built in memory and written in one go (then fsync'ed);
    a write error leaves `out` untouched and raises an InputError.
    """
    o = check_output_path(out, inputs)
    meta = header(kind, inputs)
    raw = sum(np.asarray(a).nbytes for a in datasets.values() if a is not None) + (1 << 16)
    if compression is None:
        _check_free_space(o, raw)
    with atomic_path(o) as tmp:
        if raw <= IN_MEMORY_WRITE_BYTES:
            with h5py.File(f"{tmp}.core", "w", driver="core", backing_store=False) as f:
                _fill(f, meta, attrs, datasets, compression)
                f.flush()
                image = f.id.get_file_image()
            with open(tmp, "wb") as fh:
                fh.write(image)
                fh.flush()
                os.fsync(fh.fileno())
        else:
            with create_output(tmp) as f:
                _fill(f, meta, attrs, datasets, compression)
    return o


# --------------------------------------------------------------------------------------------
# schema checks for files mhla writes
# --------------------------------------------------------------------------------------------


def d_from_psi_shape(shape: tuple[int, ...], path: str | os.PathLike, name: str) -> int:
    psi = int(shape[-1])
    d = 1
    while n_features(d) < psi:
        d += 1
    if n_features(d) != psi:
        raise InputError(f"'{name}' has {psi} feature columns, which is not d^2(d+1)/2 for any d", path)
    return d


def read_attr_int(f: h5py.File, name: str, path: str | os.PathLike) -> int:
    if name not in f.attrs:
        raise InputError(f"missing attribute '{name}'", path)
    try:
        return int(f.attrs[name])
    except (TypeError, ValueError):
        raise InputError(f"attribute '{name}' is not an integer", path) from None
