"""HDF5 file formats of mhla: names, versions, validation, provenance and atomic writes.

Every file mhla writes has root attributes ``mhla_kind``, ``mhla_format_version`` and
``mhla_version``; tokens files made by users need no attributes at all. See docs/formats.md.

Above ~500 lines because it is the one place that knows every file kind's names and versions (the
checks of docs/formats.md, one small function a rule) and the atomic-write protocol they share.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shlex
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .._version import __version__
from ..errors import InputError
from ..feature_map import NORMALIZATIONS
from ..numerics import SYMMETRY_TOL
from ..signals import check_interrupted, shield_signals
from ..feature_map import n_features

FORMAT_NAME = "mhla"
# 5: features files hold the weight totals (features_file.WEIGHTS_FORMAT) and may hold the canonical Gram as its
# distinct entries (features_file.PAIRS_FORMAT, --compact); model files the canonical coefficients
FORMAT_VERSION = 5
# The dataset of those distinct entries in a compact features file (mhla_cli.statistics.features_file, docs/formats.md).
PAIRS_DATASET = "basis_gram_pairs"
KINDS = ("tokens", "features", "model", "heads", "predictions")


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


def _is_text(head: bytes) -> bool:
    """True if the bytes are UTF-8 text (a multi-byte character may be cut at the end)."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:
            return False
        text = head[:exc.start].decode("utf-8")
    return all(c.isprintable() or c in "\t\r\n" for c in text)


def not_hdf5_reason(p: Path) -> str:
    """Why a file is refused as not HDF5: what it is instead (by its first bytes), and how to convert it."""
    try:
        size = p.stat().st_size
        with open(p, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        head, size = b"", 0
    convert = f"convert it with: mhla convert {shlex.quote(str(p))} -o {shlex.quote(str(p.with_suffix('.h5')))}"
    what = None
    if not head:
        return "is empty, not an HDF5 file"
    if head.startswith(b"\x93NUMPY"):
        what = "a NumPy .npy array"
    elif head.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(p) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, OSError):
            names = []
        if any(n.endswith("data.pkl") for n in names):
            what = "a PyTorch file (torch.save)"
        elif {"V.npy", "Q.npy", "format.npy"} <= set(names):
            return "is mhla heads in NumPy .npz form (from export-heads), not an HDF5 file"
        elif names and all(n.endswith(".npy") for n in names):
            what = "a NumPy .npz archive"
        else:
            return "is a zip archive, not an HDF5 file"
    elif len(head) > 8 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < size:
        if b'"mhla-heads"' in head:
            return "is mhla heads in safetensors form (from export-heads), not an HDF5 file"
        what = "a safetensors file"
    elif head[:1] == b"\x80" and p.suffix.lower() in (".pt", ".pth"):
        what = "a PyTorch file (legacy torch.save)"
    elif _is_text(head):
        return ("is a text file (CSV?), not an HDF5 file: load it with numpy (np.loadtxt), np.save the array and "
                "run mhla convert on the .npy")
    if what is None:
        return "not an HDF5 file (mhla convert makes tokens files from .npy, .npz, .safetensors and .pt files)"
    return f"is {what}, not an HDF5 file: {convert}"


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
        raise InputError(not_hdf5_reason(p), p)
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
    arr = np.asarray(dataset(f, name, path)[()])
    if finite and arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise InputError(f"'{name}' contains NaN or Inf; the file is corrupted", path)
    return arr


def dataset(f: h5py.File, name: str, path: str | os.PathLike) -> h5py.Dataset:
    """The dataset `name`, with a clear error when it is missing, a group, or not real numbers."""
    if name not in f:
        raise InputError(f"missing dataset '{name}'", path)
    ds = f[name]
    if not isinstance(ds, h5py.Dataset):
        raise InputError(f"'{name}' is a group, expected a dataset", path)
    check_numeric(ds, name, path)
    return ds


def read_matrix(f: h5py.File, name: str, path: str | os.PathLike) -> np.ndarray:
    """Read a whole dataset as float64 straight into a new array (no second copy); as `read_array`."""
    ds = dataset(f, name, path)
    out = np.empty(ds.shape, dtype=np.float64)
    if out.size:
        ds.read_direct(out)
    if not all_finite(out):
        raise InputError(f"'{name}' contains NaN or Inf; the file is corrupted", path)
    return out


def value_text(x: Any) -> str:
    """A value as a message shows it: a NumPy scalar or array as the Python number or list it holds
    (-10000.0, [1, 2]; never np.float32(-10000.0)), anything else as its repr."""
    if isinstance(x, np.generic) or (isinstance(x, np.ndarray) and x.ndim == 0):
        return repr(x.item())
    if isinstance(x, np.ndarray):
        return repr(x.tolist())
    return repr(x)


def all_finite(a: np.ndarray, block_bytes: int = 8 << 20) -> bool:
    """np.isfinite(a).all(), in blocks of rows (no temporary of a's size)."""
    if a.ndim < 2 or a.nbytes <= block_bytes:
        return bool(np.isfinite(a).all())
    rows = max(1, block_bytes // max(1, a[:1].nbytes))
    return all(bool(np.isfinite(a[i:i + rows]).all()) for i in range(0, a.shape[0], rows))


def check_stored_symmetric(f: h5py.File, name: str, path: str | os.PathLike, tile: int = 1024) -> None:
    """A stored square dataset is finite and symmetric to SYMMETRY_TOL of its largest entry (the checks of
    `read_array` and features_file._is_symmetric), read tile by tile: nothing of its size is held.

    Each tile is read once and passed over three times (its max and min, which are NaN or +-Inf exactly
    when it holds one, and the difference to its mirror tile), not six: at psi = 7200 (d = 24) the check
    took 0.52-0.56 s against 0.67-0.72 s for the isfinite / abs passes before (a scratch script, the file in
    the page cache; the tiles' hyperslab reads are 0.3-0.4 s of it)."""
    ds = dataset(f, name, path)
    n = int(ds.shape[0])
    a, b, c = np.empty(tile * tile), np.empty(tile * tile), np.empty(tile * tile)
    top = diff = 0.0

    def extent(x: np.ndarray) -> float:
        hi, lo = float(x.max()), float(x.min())
        if not (math.isfinite(hi) and math.isfinite(lo)):  # max / min propagate NaN; Inf is an extreme
            raise InputError(f"'{name}' contains NaN or Inf; the file is corrupted", path)
        return max(hi, -lo)

    for i0 in range(0, n, tile):
        i1 = min(n, i0 + tile)
        for j0 in range(i0, n, tile):
            j1 = min(n, j0 + tile)
            upper = a[:(i1 - i0) * (j1 - j0)].reshape(i1 - i0, j1 - j0)
            ds.read_direct(upper, np.s_[i0:i1, j0:j1])
            top = max(top, extent(upper))
            if j0 == i0:
                lower = upper
            else:
                lower = b[:(j1 - j0) * (i1 - i0)].reshape(j1 - j0, i1 - i0)
                ds.read_direct(lower, np.s_[j0:j1, i0:i1])
                top = max(top, extent(lower))
            gap = c[:upper.size].reshape(upper.shape)
            np.subtract(upper, lower.T, out=gap)
            diff = max(diff, float(gap.max()), -float(gap.min()))
    if diff > SYMMETRY_TOL * top:
        raise InputError(f"'{name}' is not symmetric; the file is corrupted", path)


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


def stored_block(f: h5py.File) -> int | None:
    """The features of the block on the data's spans that a features file holds (None: all psi, or
    not known from the shapes): the side of 'basis_gram', or of the compact form's spans."""
    if "span_pairs" not in f:
        return None
    if "basis_gram" in f:
        return int(f["basis_gram"].shape[0])
    if "span_last" in f and len(f["span_pairs"].shape) == 2 and len(f["span_last"].shape) == 2:
        return int(f["span_pairs"].shape[1] * f["span_last"].shape[1])
    return None


def kind_of(path: str | os.PathLike) -> str:
    """The mhla kind of the file at `path` (see `file_kind`)."""
    with open_input(path) as f:
        return file_kind(f, path)


def expect_kind(f: h5py.File, path: str | os.PathLike, *kinds: str) -> str:
    """The kind of an open file; an InputError unless it is one of `kinds`.

    (A features file's loader also refuses up front the statistics that cannot fit in memory:
    mhla_cli.statistics.features_file.expect_features.)
    """
    kind = file_kind(f, path)
    if kind not in kinds:
        raise InputError(f"is a {kind} file, expected {' or '.join(kinds)}", path)
    return kind


# --------------------------------------------------------------------------------------------
# tokens files
# --------------------------------------------------------------------------------------------


# The report of `mhla certify --on PROBES -o REPORT` (mhla_cli.solve.probes).
KINDS += ("probes",)


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


# Files mhla reads that are not HDF5: heads exported for other frameworks (mhla_cli.model.export).
FOREIGN_SUFFIXES = (".npz", ".safetensors")


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
    if p.suffix.lower() in FOREIGN_SUFFIXES:
        # heads exported for other frameworks (.npz, .safetensors): the bytes identify the data
        whole = bool(full) if full is not None else st.st_size <= FULL_FINGERPRINT_BYTES
        with open(p, "rb") as fh:
            if whole:
                for block in iter(lambda: fh.read(_BLOCK_BYTES), b""):
                    h.update(block)
            else:
                for i in range(_SAMPLED_BLOCKS):
                    fh.seek((st.st_size * i) // _SAMPLED_BLOCKS)
                    h.update(fh.read(_BLOCK_BYTES // 64))
        ident = {"path": str(p), "name": p.name, "size": st.st_size, "fingerprint": h.hexdigest()[:32],
                 "fingerprint_scope": "all bytes" if whole else "sampled bytes"}
        _identity_cache[key] = ident
        return dict(ident)
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


# An output's suffix means its format: every HDF5 output takes one of these (or none).
HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf")


def check_hdf5_suffix(out: str | os.PathLike, what: str = "the output") -> Path:
    """`out`, refused (InputError) when its suffix names another format than HDF5 (model.npz would be
    HDF5 under a NumPy name)."""
    o = Path(out)
    if o.suffix and o.suffix.lower() not in HDF5_SUFFIXES:
        raise InputError(f"{what} is written in HDF5; the suffix '{o.suffix}' names another format: "
                         f"use {', '.join(HDF5_SUFFIXES[:-1])} or {HDF5_SUFFIXES[-1]}", o)
    return o


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


# Files up to this size are built in memory and written in one go; larger ones (psi x psi
# statistics) are written through libhdf5 straight from their arrays, without copies.
IN_MEMORY_WRITE_BYTES = 64 << 20
# Arrays larger than this that are not C-contiguous are written in blocks of rows (no full copy).
_BLOCK_WRITE_BYTES = 16 << 20


class Deferred:
    """A dataset computed only when `write_file` writes it, and released right after (so that a file of
    several psi x psi datasets derived from one held form never holds them all at once).

    `make()` returns the array; or, with `shape` given, an iterable of (first row, block of rows) of a
    float64 dataset of that shape, written block by block (the dataset is never held whole)."""

    def __init__(self, make: Callable[[], Any], nbytes: int, shape: tuple[int, ...] | None = None) -> None:
        self.make = make
        self.nbytes = int(nbytes)  # the size, for the free-space check before anything is computed
        self.shape = shape


def _fill(f: h5py.File, meta: Mapping[str, Any], attrs: Mapping[str, Any] | None,
          datasets: Mapping[str, np.ndarray | Deferred | None], compression: str | None) -> None:
    for k, v in meta.items():
        f.attrs[k] = v
    for k, v in (attrs or {}).items():
        if v is not None:
            f.attrs[k] = v
    for name, arr in datasets.items():
        if arr is None:
            continue
        if isinstance(arr, Deferred) and arr.shape is not None:
            ds = f.create_dataset(name, shape=arr.shape, dtype=np.float64)
            for r0, block in arr.make():
                ds[r0:r0 + block.shape[0]] = block
            continue
        arr = np.asarray(arr.make() if isinstance(arr, Deferred) else arr)
        if compression and arr.size > 1024:
            f.create_dataset(name, data=arr, compression=compression, shuffle=True)
        elif arr.nbytes > _BLOCK_WRITE_BYTES and arr.ndim >= 1 and not arr.flags.c_contiguous:
            ds = f.create_dataset(name, shape=arr.shape, dtype=arr.dtype)
            rows = max(1, _BLOCK_WRITE_BYTES // max(1, arr[:1].nbytes))
            for a in range(0, arr.shape[0], rows):
                ds[a:a + rows] = arr[a:a + rows]
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


def write_file(out: str | os.PathLike, kind: str, datasets: Mapping[str, np.ndarray | Deferred | None],
               attrs: Mapping[str, Any] | None = None, inputs: tuple[str | os.PathLike, ...] = (),
               compression: str | None = None) -> Path:
    """Write an mhla file of `kind` atomically (temp file + rename); None datasets are skipped.

    A `Deferred` dataset is computed when it is written and released after it.
    Files up to IN_MEMORY_WRITE_BYTES are built in memory and written in one go (then fsync'ed),
    larger ones through libhdf5 from the arrays themselves (no copy of a psi x psi matrix); a write
    error leaves `out` untouched and raises an InputError.
    """
    check_hdf5_suffix(out, f"a {kind} file")
    o = check_output_path(out, inputs)
    meta = header(kind, inputs)
    raw = sum(a.nbytes if isinstance(a, Deferred) else np.asarray(a).nbytes
              for a in datasets.values() if a is not None) + (1 << 16)
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
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
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


def read_normalize(f: Any, path: str | os.PathLike) -> str:
    """The `normalize` attribute of an open features, model or heads file ("none" when absent)."""
    v = f.attrs.get("normalize", "none")
    v = v.decode() if isinstance(v, bytes) else str(v)
    if v not in NORMALIZATIONS:
        raise InputError(f"attribute 'normalize' is '{v}', expected none or length", path)
    return v


def read_bias_terms(attrs: Any, path: str | os.PathLike | None) -> bool:
    """The `bias_terms` attribute of a features, model or heads file (0 / 1; False when absent: files
    before the bias terms, or without them)."""
    v = attrs.get("bias_terms", 0)
    try:
        x = int(np.asarray(v).reshape(()))
    except (TypeError, ValueError):
        raise InputError(f"attribute 'bias_terms' = {value_text(v)} is not 0 or 1", path) from None
    if x not in (0, 1):
        raise InputError(f"attribute 'bias_terms' = {x}, expected 0 or 1", path)
    return bool(x)
