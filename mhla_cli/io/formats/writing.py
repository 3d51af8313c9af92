"""Writing mhla's files: output paths (an output's suffix means its format; never over an input), the
atomic-write protocol (a temporary file in the output's directory, renamed on success, nothing left on
failure or interrupt), the header every file carries, and `write_file`."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ...errors import InputError
from ...signals import check_interrupted, shield_signals
from . import manifest
from .identity import provenance
from .reading import FORMAT_VERSION, KINDS, _h5_file, _h5_reason, _is_write_error

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


def check_output_directory(out: Path) -> None:
    """Refuse (InputError) an output whose directory does not exist or cannot be written."""
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"output directory '{parent}' does not exist", out)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"output directory '{parent}' is not writable", out)


def overlaps(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether the paths `a` and `b` (resolved: symbolic links followed) are one, or one lies inside the other."""
    ra, rb = Path(a).resolve(), Path(b).resolve()
    return ra == rb or ra in rb.parents or rb in ra.parents


# What marks a file mhla wrote, besides an HDF5 file's root attribute mhla_kind: heads in .npz or .safetensors
# form carry the metadata format = "mhla-heads" (model.export.FORMAT_NAME); a PNG mhla drew, the text chunk
# Software = "mhla ..." (PNG_SOFTWARE, solve.spectrum.plot_spectrum). The first MARK_BYTES of a file are read.
HEADS_MARK = "mhla-heads"
# ... and "replacement" for a spliced replacement in .safetensors form (mhla_cli.model.splice.save_replacement).
REPLACEMENT_MARK = "mhla-replacement"
PNG_SOFTWARE = "mhla"
MARK_BYTES = 1 << 16


def written_kind(path: str | os.PathLike) -> str | None:
    """The kind of the existing file `path` when mhla wrote it (its mhla_kind; "heads" for heads in .npz or
    .safetensors form; "plot" for a PNG it drew), else None (a user's file, or unreadable)."""
    p = Path(path)
    try:
        if h5py.is_hdf5(p):
            with _h5_file(p, "r", False) as f:
                kind = f.attrs.get("mhla_kind")
            return None if kind is None else kind.decode() if isinstance(kind, bytes) else str(kind)
        with open(p, "rb") as fh:
            head = fh.read(MARK_BYTES)
    except (OSError, ValueError, RuntimeError):
        return None
    if head.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(p) as z, z.open("format.npy") as fh:
                return "heads" if str(np.load(fh, allow_pickle=False)) == HEADS_MARK else None
        except (zipfile.BadZipFile, OSError, KeyError, ValueError):
            return None
    if len(head) > 8 and head[8:9] == b"{":
        header = head[8:8 + int.from_bytes(head[:8], "little")]
        for mark, kind in ((HEADS_MARK, "heads"), (REPLACEMENT_MARK, "replacement")):
            if f'"{mark}"'.encode() in header:
                return kind
    if head.startswith(b"\x89PNG") and b"tEXtSoftware\x00" + PNG_SOFTWARE.encode() in head:
        return "plot"
    return None


def check_replaceable(out: str | os.PathLike, kind: str | None = None) -> None:
    """Refuse (InputError) to replace an existing file that mhla did not write, or (`kind` given) one of another
    kind: an output replaces only what an earlier run of the same command wrote."""
    o = Path(out)
    if not o.exists():
        return
    found = written_kind(o)
    if found is None:
        raise InputError("output path exists and is not a file mhla wrote; it is left as it is: remove it or "
                         "choose another -o path", o)
    if kind is not None and found != kind:
        raise InputError(f"output path exists and is an mhla {found} file, not a {kind} file; it is left as it is: "
                         "remove it or choose another -o path", o)


def check_output_path(out: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = (),
                      kind: str | None = None) -> Path:
    """Reject an output path that cannot be written, that names or lies inside one of the inputs (or holds one),
    or that holds a file mhla did not write, or one of another kind than `kind` (`check_replaceable`)."""
    o = Path(out)
    if o.is_dir():
        raise InputError("output path is a directory; give a file name", o)
    if o.exists() and not o.is_file():
        raise InputError("output path exists and is not a regular file (a device, pipe or socket); "
                         "give a file name", o)
    check_output_directory(o)
    for i in inputs:
        if i is None:
            continue
        ip = Path(i)
        try:
            same = ip.exists() and o.exists() and os.path.samefile(ip, o)
        except OSError:
            same = False
        if same or overlaps(ip, o):
            raise InputError("output would overwrite an input file; choose another -o path", o)
    check_replaceable(o, kind)
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
        reason = _h5_reason(exc) if from_h5py or not getattr(exc, "strerror", None) else getattr(exc, "strerror")
        raise InputError(f"cannot write output ({reason}); nothing was written", o) from None
    except BaseException:
        with shield_signals(), contextlib.suppress(OSError):
            tmp_path.unlink()
        raise


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
    """Write the attributes and datasets, and for the kinds that carry one the manifest (manifest.seal: the
    checksum of every dataset, taken from the array as it is written, and of the attributes as read back)."""
    for k, v in meta.items():
        f.attrs[k] = v
    for k, v in (attrs or {}).items():
        if v is not None:
            f.attrs[k] = v
    sums: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, arr in datasets.items():
        if arr is None:
            continue
        if isinstance(arr, Deferred) and arr.shape is not None:
            ds = f.create_dataset(name, shape=arr.shape, dtype=np.float64)
            h = manifest.Hasher(arr.shape)
            for r0, block in arr.make():
                ds[r0:r0 + block.shape[0]] = block
                h.update(block)
            sums[name] = (tuple(arr.shape), h.hexdigest())
            continue
        arr = np.asarray(arr.make() if isinstance(arr, Deferred) else arr)
        sums[name] = (tuple(arr.shape), manifest.digest(arr))
        _put(f, name, arr, compression)
    if meta.get("mhla_kind") in manifest.MANIFEST_KINDS:
        f.attrs[manifest.MANIFEST_ATTR] = manifest.seal({k: f.attrs[k] for k in f.attrs.keys()}, sums)


def _put(f: h5py.File, name: str, arr: np.ndarray, compression: str | None) -> None:
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
    o = check_output_path(out, inputs, kind)
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
