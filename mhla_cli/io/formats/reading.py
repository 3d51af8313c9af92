"""Reading mhla's HDF5 files: the names and versions of the file kinds, opening an input (locks, clear
errors for what is not HDF5), reading and validating its arrays and attributes, and the schema checks of the
files mhla writes (docs/formats.md)."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shlex
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ..._version import __version__
from ...errors import InputError
from ...feature_map import NORMALIZATIONS, n_features
from ...numerics import SYMMETRY_TOL
from ...signals import check_interrupted
from . import manifest

FORMAT_NAME = "mhla"
# 5: features files hold the weight totals (features_file.WEIGHTS_FORMAT) and may hold the canonical Gram as its
# distinct entries (features_file.PAIRS_FORMAT, --compact); model files the canonical coefficients
# 6: features, model, heads and probes files and Zarr stores carry a manifest (manifest.MANIFEST_FORMAT)
FORMAT_VERSION = 6
# The dataset of those distinct entries in a compact features file (mhla_cli.statistics.files.features_file, docs/formats.md).
PAIRS_DATASET = "basis_gram_pairs"
KINDS: tuple[str, ...] = ("tokens", "features", "model", "heads", "predictions", "blocks")


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
    key = id(f)
    _PENDING[key] = []
    try:
        try:
            yield f
        except InputError:
            raise
        except Exception:
            if _PENDING.get(key):  # what failed read a piece that is not what mhla wrote: say that
                raise _PENDING[key][0] from None
            raise
        if _PENDING.get(key):
            raise _PENDING[key][0]
    except (OSError, KeyError, RuntimeError) as exc:
        if _is_write_error(exc):
            raise  # an output being written inside this block failed: not this input's fault
        # h5py raises these for corrupted or truncated datasets while reading.
        raise InputError(f"cannot read data ({_h5_reason(exc)}); the file may be truncated or corrupted",
                         p) from None
    finally:
        _PENDING.pop(key, None)
        _MANIFESTS.pop(key, None)
        with contextlib.suppress(Exception):
            f.close()


# The pieces of each open input (by the id of its h5py File) found not to be what mhla wrote: reported when the
# input is closed, unless a check of what they hold said why first (so a damaged file is refused once, by its most
# specific reason); and each open input's manifest, read with its header (`file_kind`).
_PENDING: dict[int, list[InputError]] = {}
_MANIFESTS: dict[int, dict[str, Any] | None] = {}


def _defer(f: h5py.File, exc: InputError) -> None:
    """Report a corrupted piece of `f`: when `f` is closed by `open_input` (now, for a file opened otherwise)."""
    pending = _PENDING.get(id(f))
    if pending is None:
        raise exc
    pending.append(exc)


def _dataset_shapes(f: h5py.File) -> dict[str, tuple[int, ...]]:
    found: dict[str, tuple[int, ...]] = {}
    f.visititems(lambda name, obj: found.__setitem__(name, tuple(obj.shape)) if isinstance(obj, h5py.Dataset)
                 else None)
    return found


def _check_header(f: h5py.File, path: str | os.PathLike, kind: str) -> None:
    """The manifest of `f` read and its header and datasets' names and shapes checked (manifest.load)."""
    man = None
    try:
        try:
            attrs = {k: f.attrs[k] for k in f.attrs.keys()}
        except (OSError, TypeError, ValueError) as exc:
            raise manifest.corrupted(f"its attributes cannot be read ({_h5_reason(exc)})", path) from None
        man = manifest.load(attrs, kind, path)
        if man is not None:
            manifest.check_names(man, _dataset_shapes(f), path)
    except InputError as exc:
        _defer(f, exc)
    if id(f) in _PENDING:
        _MANIFESTS[id(f)] = man


def _check_data(f: h5py.File, name: str, arr: np.ndarray, path: str | os.PathLike) -> None:
    """A dataset as read equals what was written, by the file's manifest (none: nothing to check)."""
    try:
        if id(f) in _MANIFESTS:
            man = _MANIFESTS[id(f)]
        else:
            raw = f.attrs.get(manifest.MANIFEST_ATTR)
            if raw is None:
                return
            try:
                man = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
                man["datasets"]
            except (ValueError, TypeError, KeyError):
                raise manifest.corrupted(f"its manifest ('{manifest.MANIFEST_ATTR}') is not readable", path) from None
        manifest.check_array(man, name, arr, path)
    except InputError as exc:
        _defer(f, exc)


def read_array(f: h5py.File, name: str, path: str | os.PathLike, finite: bool = True) -> np.ndarray:
    """Read a whole dataset, with a clear error when it is missing, not real numbers, or not finite."""
    arr = np.asarray(dataset(f, name, path)[()])
    if finite and arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise InputError(f"'{name}' contains NaN or Inf; the file is corrupted", path)
    _check_data(f, name, arr, path)
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
    _check_data(f, name, out if ds.dtype.kind == "f" else out.astype(np.int64), path)
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
    `read_array` and gram_dense.is_symmetric), read tile by tile: nothing of its size is held.

    Each tile is read once and passed over three times (its max and min, which are NaN or +-Inf exactly
    when it holds one, and the difference to its mirror tile), not six (separate isfinite and abs passes):
    half the passes over memory (the timing: docs/performance_symmetry.md, "certify and fit")."""
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


def file_kind(f: h5py.File, path: str | os.PathLike, check: bool = True) -> str:
    """The mhla kind of an open file: from its attributes, or guessed from its datasets; `check`: its manifest
    read and its header checked (`_check_header`; what is wrong is reported when `f` is closed, after the checks of
    what the loader reads)."""
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
        if check:
            _check_header(f, path, kind)
        return kind
    for name, k in (("gram", "features"), ("coef", "model"), ("V", "heads"), ("tokens", "tokens"),
                    ("predictions", "predictions")):
        if name in f:
            if check:
                _check_header(f, path, k)
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
    """The mhla kind of the file at `path` (see `file_kind`; its manifest is checked by the loader that reads it)."""
    with open_input(path) as f:
        return file_kind(f, path, check=False)


def expect_kind(f: h5py.File, path: str | os.PathLike, *kinds: str) -> str:
    """The kind of an open file; an InputError unless it is one of `kinds`.

    (A features file's loader also refuses up front the statistics that cannot fit in memory:
    mhla_cli.statistics.files.features_file.expect_features.)
    """
    kind = file_kind(f, path)
    if kind not in kinds:
        raise InputError(f"is a {kind} file, expected {' or '.join(kinds)}", path)
    return kind


# The report of `mhla certify --on PROBES -o REPORT` (mhla_cli.solve.probes).
KINDS += ("probes",)


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
