"""NumPy `.npy` and `.npz` inputs.

Contiguous data (.npy, uncompressed .npz members) are read with plain file reads at their byte
offsets, so the pages read are not held by this process; compressed .npz members are decompressed
as a stream, in order; column-major compressed members are loaded whole.
"""

from __future__ import annotations

import struct
import zipfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from ._source import Reader, _check_size, _raw_reader, _rows_of, _Source
from ...errors import InputError

# Bytes skipped at once when a compressed stream moves forward.
_SKIP_BYTES = 16 << 20


def _npy_header(fh: Any, path: Path, what: str = ".npy") -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) of the .npy header at the file position (left after the header)."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(fh)
        else:
            raise InputError(f"{what} format version {version} is not supported (save with numpy's np.save)", path)
    except (ValueError, EOFError, OSError) as exc:
        raise InputError(f"not a valid {what} file ({exc})", path) from None
    if dtype.hasobject:
        raise InputError("holds Python objects (a pickled object array, e.g. a list of sequences of different "
                         "lengths): save one (T, d) array of all tokens and an offsets array instead", path)
    return tuple(int(s) for s in shape), bool(fortran), dtype


def npy_sources(path: Path, stack: ExitStack | None = None) -> list[_Source]:
    """The one array of a .npy file, named "tokens" (the driver names it by NAME=FILE or the stem)."""
    with open(path, "rb") as fh:
        shape, fortran, dtype = _npy_header(fh, path)
        offset = fh.tell()
    _check_size(path, offset + dtype.itemsize * int(np.prod(shape, dtype=np.int64)))
    if fortran and len(shape) > 1:
        arr = np.load(path, mmap_mode="r")  # column-major: rows are not contiguous in the file
        return [_Source("tokens", shape, dtype, lambda a, b: np.ascontiguousarray(arr[a:b]), str(path))]
    return [_Source("tokens", shape, dtype, _raw_reader(path, offset, shape, dtype), str(path))]


class _ZipStream:
    """Rows of a compressed .npz member, decompressed in order (reopened to go back)."""

    def __init__(self, zf: zipfile.ZipFile, member: str, path: Path, stack: ExitStack) -> None:
        self.zf, self.member, self.path = zf, member, path
        self.fh: Any = None
        self.pos = 0
        stack.callback(self.close)
        self.shape, self.fortran, self.dtype = self._open()
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))

    def _open(self) -> tuple[tuple[int, ...], bool, np.dtype]:
        self.close()
        self.fh = self.zf.open(self.member)
        self.pos = 0
        return _npy_header(self.fh, self.path, f"member {self.member} of the .npz")

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None

    def _bytes(self, n: int) -> bytes:
        try:
            data = self.fh.read(n)
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise InputError(f"cannot read member {self.member} ({exc}); the file may be corrupted",
                             self.path) from None
        if len(data) != n:
            raise InputError(f"member {self.member} is truncated", self.path)
        return data

    def read(self, a: int, b: int) -> np.ndarray:
        if self.fh is None or a < self.pos:
            self._open()
        while self.pos < a:  # skip forward in blocks
            k = min(a - self.pos, max(1, _SKIP_BYTES // max(1, self.row_bytes)))
            self._bytes(k * self.row_bytes)
            self.pos += k
        data = self._bytes((b - a) * self.row_bytes)
        self.pos = b
        return np.frombuffer(data, dtype=self.dtype).reshape((b - a, *self.shape[1:]))


def npz_sources(path: Path, stack: ExitStack) -> list[_Source]:
    """The members of a .npz archive, named by their keys."""
    try:
        zf = stack.enter_context(zipfile.ZipFile(path))
    except (zipfile.BadZipFile, OSError) as exc:
        raise InputError(f"not a valid .npz archive ({exc})", path) from None
    out = []
    for info in zf.infolist():
        name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
        if info.compress_type == zipfile.ZIP_STORED:
            with open(path, "rb") as fh:  # the member's data start after its local header
                fh.seek(info.header_offset)
                local = fh.read(30)
                if len(local) != 30 or local[:4] != b"PK\x03\x04":
                    raise InputError(f"member {info.filename} has a corrupted header", path)
                n_name, n_extra = struct.unpack("<HH", local[26:30])
                fh.seek(info.header_offset + 30 + n_name + n_extra)
                shape, fortran, dtype = _npy_header(fh, path, f"member {info.filename} of the .npz")
                offset = fh.tell()
            _check_size(path, offset + dtype.itemsize * int(np.prod(shape, dtype=np.int64)))
            if not (fortran and len(shape) > 1):
                out.append(_Source(name, shape, dtype, _raw_reader(path, offset, shape, dtype), str(path)))
                continue
        stream = _ZipStream(zf, info.filename, path, stack)
        if stream.fortran and len(stream.shape) > 1:
            # column-major and compressed: rows cannot be streamed, so this member is loaded whole
            with zf.open(info.filename) as fh:
                arr = np.lib.format.read_array(fh, allow_pickle=False)
            out.append(_Source(name, stream.shape, stream.dtype, _rows_of(arr), str(path)))
        else:
            out.append(_Source(name, stream.shape, stream.dtype, stream.read, str(path)))
    return out


NPY = Reader("NumPy .npy", (".npy",), npy_sources, one_array=True)
NPZ = Reader("NumPy .npz", (".npz",), npz_sources)
