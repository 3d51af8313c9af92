"""HDF5 file formats of mhla: names, versions, validation, provenance and atomic writes.

Every file mhla writes has root attributes ``mhla_kind``, ``mhla_format_version`` and
``mhla_version``; tokens files made by users need no attributes at all. See docs/formats.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .errors import InputError
from .features import n_features

FORMAT_NAME = "mhla"
FORMAT_VERSION = 1
KINDS = ("tokens", "features", "model", "heads", "predictions")

# Largest number of offsets read at once while validating a ragged tokens file.
_OFFSET_BLOCK = 1 << 20


def _version() -> str:
    from . import __version__

    return __version__


# --------------------------------------------------------------------------------------------
# opening files
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def open_input(path: str | os.PathLike) -> Iterator[h5py.File]:
    """Open an HDF5 file for reading, turning every way it can fail into an `InputError`."""
    p = Path(path)
    if not p.exists():
        raise InputError("no such file", p)
    if p.is_dir():
        raise InputError("is a directory, expected an HDF5 file", p)
    try:
        is_hdf5 = h5py.is_hdf5(p)
    except OSError as exc:
        raise InputError(f"cannot read: {exc}", p) from None
    if not is_hdf5:
        raise InputError("not an HDF5 file", p)
    try:
        f = h5py.File(p, "r")
    except OSError as exc:
        raise InputError(
            f"cannot open HDF5 file ({exc}); it may be truncated or corrupted, or locked by a writer "
            "(on shared filesystems try HDF5_USE_FILE_LOCKING=FALSE)",
            p,
        ) from None
    try:
        yield f
    except (OSError, KeyError, RuntimeError) as exc:
        # h5py raises these for corrupted or truncated datasets while reading.
        raise InputError(f"cannot read data ({exc}); the file may be truncated or corrupted", p) from None
    finally:
        f.close()


def read_array(f: h5py.File, name: str, path: str | os.PathLike) -> np.ndarray:
    """Read a whole dataset, with a clear error when it is missing or not an array."""
    if name not in f:
        raise InputError(f"missing dataset '{name}'", path)
    ds = f[name]
    if not isinstance(ds, h5py.Dataset):
        raise InputError(f"'{name}' is a group, expected a dataset", path)
    check_numeric(ds, name, path)
    return np.asarray(ds[()])


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
    kind = file_kind(f, path)
    if kind not in kinds:
        raise InputError(f"is a {kind} file, expected {' or '.join(kinds)}", path)
    return kind


# --------------------------------------------------------------------------------------------
# tokens files
# --------------------------------------------------------------------------------------------


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
    if has_targets:
        tg = f["targets"]
        if not isinstance(tg, h5py.Dataset):
            raise InputError("'targets' is a group, expected a dataset (N, d)", path)
        check_numeric(tg, "targets", path)
        if tg.shape != (N, d):
            raise InputError(f"'targets' has shape {tg.shape}, expected (N, d) = ({N}, {d})", path)
    return TokensInfo(str(path), layout, N, d, T, str(tok.dtype), has_targets, seq_len)


def _check_offsets(off: h5py.Dataset, T: int, path: str | os.PathLike) -> None:
    n = off.shape[0]
    prev = None
    for lo in range(0, n, _OFFSET_BLOCK):
        block = np.asarray(off[lo:min(n, lo + _OFFSET_BLOCK + 1)], dtype=np.int64)
        if lo == 0 and block[0] != 0:
            raise InputError(f"offsets[0] = {block[0]}, expected 0", path)
        if prev is not None and block[0] != prev:
            pass  # overlapping read keeps blocks consistent
        steps = np.diff(block)
        bad = np.flatnonzero(steps <= 0)
        if bad.size:
            i = lo + int(bad[0])
            raise InputError(f"offsets not strictly increasing at sample {i} (offsets[{i}] = {block[bad[0]]}, "
                             f"offsets[{i + 1}] = {block[bad[0] + 1]}): every sequence needs >= 1 token", path)
        prev = block[-1]
    last = int(off[n - 1])
    if last != T:
        raise InputError(f"offsets[N] = {last} but tokens has T = {T} rows; they must be equal", path)


def read_tokens_span(f: h5py.File, info: TokensInfo, lo: int, hi: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Samples [lo, hi) of an open tokens file: (tokens (t, d), offsets (hi-lo+1,) from 0, targets or None).

    Dense files come back in the ragged layout with equal-length offsets, so that callers handle
    one layout; `tokens` keeps the stored dtype.
    """
    if info.layout == "dense":
        n = int(info.seq_len)
        tokens = f["tokens"][lo:hi].reshape(-1, info.d)
        offsets = np.arange(hi - lo + 1, dtype=np.int64) * n
    else:
        offsets = np.asarray(f["offsets"][lo:hi + 1], dtype=np.int64)
        tokens = f["tokens"][offsets[0]:offsets[-1]]
        offsets = offsets - offsets[0]
    targets = f["targets"][lo:hi] if info.has_targets else None
    return tokens, offsets, targets


def check_finite(tokens: np.ndarray, offsets: np.ndarray, targets: np.ndarray | None, lo: int,
                 path: str | os.PathLike) -> None:
    """Raise an InputError naming the first sample that holds NaN or Inf."""
    if tokens.dtype.kind == "f" and not np.isfinite(tokens).all():
        row = int(np.flatnonzero(~np.isfinite(tokens).all(axis=1))[0])
        i = lo + int(np.searchsorted(offsets, row, side="right") - 1)
        raise InputError(f"tokens of sample {i} contain NaN or Inf", path)
    if targets is not None and targets.dtype.kind == "f" and not np.isfinite(targets).all():
        i = lo + int(np.flatnonzero(~np.isfinite(targets).all(axis=1))[0])
        raise InputError(f"targets of sample {i} contain NaN or Inf", path)


def source_identity(path: str | os.PathLike) -> dict[str, Any]:
    """Name, size and a content fingerprint of an input file (shapes, dtypes, offsets, token ends)."""
    p = Path(path)
    h = hashlib.sha256()
    with open_input(p) as f:
        for name in sorted(f.keys()):
            obj = f[name]
            if isinstance(obj, h5py.Dataset):
                h.update(f"{name}:{obj.shape}:{obj.dtype};".encode())
        if "offsets" in f and isinstance(f["offsets"], h5py.Dataset):
            off = f["offsets"]
            for lo in range(0, off.shape[0], _OFFSET_BLOCK):
                h.update(np.ascontiguousarray(off[lo:lo + _OFFSET_BLOCK]).tobytes())
        for name in ("tokens", "targets", "gram", "coef", "V", "Q"):
            if name in f and isinstance(f[name], h5py.Dataset) and f[name].ndim >= 1 and f[name].shape[0]:
                ds = f[name]
                k = min(ds.shape[0], 256)
                h.update(np.ascontiguousarray(ds[:k]).tobytes())
                h.update(np.ascontiguousarray(ds[ds.shape[0] - k:]).tobytes())
    return {"path": str(p), "size": p.stat().st_size, "fingerprint": h.hexdigest()[:32]}


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------


def check_output_path(out: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = ()) -> Path:
    """Reject an output path that cannot be written or that names one of the inputs."""
    o = Path(out)
    if o.is_dir():
        raise InputError("output path is a directory; give a file name", o)
    parent = o.parent if str(o.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"output directory '{parent}' does not exist", o)
    if not os.access(parent, os.W_OK):
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


class Interrupted(BaseException):
    """Raised inside mhla when SIGTERM arrives, so that `finally` blocks clean up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def sigterm_as_exception() -> Iterator[None]:
    """Turn SIGTERM into `Interrupted` for the duration (main thread only)."""
    try:
        old = signal.getsignal(signal.SIGTERM)
        def handler(signum: int, frame: Any) -> None:  # noqa: ARG001
            raise Interrupted(signum)
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not in the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def atomic_path(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `out`; rename it to `out` only if the block succeeds."""
    o = Path(out)
    parent = o.parent if str(o.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{o.name}.", suffix=".tmp-mhla", dir=parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, o)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp_path.unlink()
        raise InputError(f"cannot write output ({exc.strerror or exc}); nothing was written", o) from None
    except BaseException:
        with contextlib.suppress(OSError):
            tmp_path.unlink()
        raise


def provenance(inputs: tuple[str | os.PathLike, ...] = ()) -> dict[str, Any]:
    """Attributes saying which mhla, command and inputs made a file."""
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
        "mhla_command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]) if sys.argv else "",
        "mhla_inputs": json.dumps(ids),
        "mhla_created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_file(out: str | os.PathLike, kind: str, datasets: Mapping[str, np.ndarray | None],
               attrs: Mapping[str, Any] | None = None, inputs: tuple[str | os.PathLike, ...] = (),
               compression: str | None = None) -> Path:
    """Write an mhla file of `kind` atomically (temp file + rename); None datasets are skipped."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    o = check_output_path(out, inputs)
    meta = {"mhla_kind": kind, "mhla_format_version": FORMAT_VERSION, **provenance(inputs)}
    with atomic_path(o) as tmp:
        with h5py.File(tmp, "w") as f:
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
