"""What every reader returns: `_Source` (one input array and a reader of its rows), and `Reader`
(one input format: its suffixes, how it is recognised, and the function that lists its arrays).

Also the pieces readers share: plain reads of a C-order array at a byte offset of a file, an
in-memory array as a source, and the page dropper that hands back the pages of a memory-mapped
file once they are copied.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import InputError


@dataclass
class _Source:
    """One input array: its name, shape and dtype, and a reader of its rows [a, b) (first axis)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[int, int], np.ndarray]
    label: str  # the file it came from (for messages)
    # One hook of a store of many (a datasets directory): left out unless --key picks it.
    spare: bool = False

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (first-axis entry) as read."""
        return self.dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))


@dataclass(frozen=True)
class Reader:
    """One input format of `mhla convert`.

    `sources(path, stack)` lists the input's arrays (files it opens stay open until `stack` closes).
    A file is read by the first reader that `claims` it by its content, else by its suffix; a
    directory that a reader claims is one input (a datasets directory), any other directory stands
    for its files of known suffixes. `one_array`: the input holds one array, named by NAME=FILE or by
    its file's stem (.npy).
    """

    what: str  # its name in messages, e.g. "NumPy .npy"
    suffixes: tuple[str, ...]
    sources: Callable[[Path, ExitStack], list[_Source]]
    claims: Callable[[Path], bool] | None = None
    one_array: bool = False


def _raw_reader(path: Path, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> Callable[[int, int], np.ndarray]:
    """Rows [a, b) of a C-order array stored at byte `offset` of a file, by plain reads."""
    row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))

    def read(a: int, b: int) -> np.ndarray:
        out = np.empty((b - a, *shape[1:]), dtype=dtype)
        if out.nbytes:
            with open(path, "rb", buffering=0) as fh:
                fh.seek(offset + a * row_bytes)
                view = out.reshape(-1).view(np.uint8).data
                got = 0
                while got < out.nbytes:
                    n = fh.readinto(view[got:])
                    if not n:
                        raise InputError("is truncated: it ends inside the data", path)
                    got += n
        return out

    return read


def _check_size(path: Path, end: int) -> None:
    size = path.stat().st_size
    if end > size:
        raise InputError(f"is truncated: the header describes {end} bytes, the file has {size}", path)


def _rows_of(arr: Any) -> Callable[[int, int], np.ndarray]:
    """The reader of rows [a, b) of an in-memory array or an h5py dataset."""
    return lambda a, b: arr[a:b]


def _array_source(name: str, arr: np.ndarray, label: str) -> _Source:
    return _Source(name, tuple(int(s) for s in arr.shape), arr.dtype,
                   lambda a, b: np.ascontiguousarray(arr[a:b]), label)


class _PageDropper:
    """Hands back to the kernel the pages of a memory-mapped file that have been copied (madvise
    MADV_DONTNEED; Linux), so that reading a file mapped into memory (torch.load(mmap=True), an
    Arrow memory map) does not grow the RSS.

    Only whole pages inside a mapping of that very file (per /proc/self/smaps) with no page changed
    are dropped: the next access reads them from the file again, so no data can change.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.ranges: list[tuple[int, int]] = []
        if not sys.platform.startswith("linux"):
            return
        try:
            smaps = Path("/proc/self/smaps").read_text()
            self.madvise = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            return
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        target = os.path.realpath(path)
        ours = False
        for line in smaps.splitlines():
            fields = line.split(None, 5)
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's header line
                ours = len(fields) == 6 and fields[5] == target
                if ours:
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    self.ranges.append((lo, hi))
            elif ours and fields[0] == "Anonymous:" and int(fields[1]) > 0:
                # pages of the mapping were changed (copied on write, e.g. torch swapped the bytes of a
                # big-endian file): dropping them would bring back the file's bytes, so drop nothing.
                # (Private_Dirty would also count the page-cache pages of a file just written, which
                # hold the file's bytes and may be dropped.)
                self.ranges = []
                return

    def __call__(self, addr: int, nbytes: int) -> None:
        page = mmap.PAGESIZE
        lo, hi = -(-addr // page) * page, (addr + nbytes) // page * page
        if hi > lo and any(a <= lo and hi <= b for a, b in self.ranges):
            self.madvise(lo, hi - lo, 4)  # MADV_DONTNEED
