"""Tokens files from other formats: NumPy .npy / .npz, safetensors, torch .pt, and in-memory arrays.

`write_tokens` writes arrays (a list of sequences, or tokens + offsets) as a tokens file and
`convert_files` does the same for files. Both copy the data in chunks of samples into the HDF5
output, so inputs larger than memory convert in bounded memory, and both validate like every reader
(`tokens.inspect_tokens` for shapes and offsets, `tokens.check_finite` and `tokens.check_weights` for
the values, chunk by chunk) before the output is renamed into place: a bad input leaves nothing.

Arrays are named as the datasets of a tokens file (docs/tokens.md): tokens, offsets, targets,
weights. A `.npy` holds the array named by its file stem (`tokens.npy`) or by `NAME=FILE`; any other
single `.npy` holds the tokens. Contiguous data (.npy, uncompressed .npz members, safetensors) are
read with plain file reads at their byte offsets, so the pages read are not held by this process;
compressed .npz members are decompressed as a stream, in order; torch files are memory-mapped.

Above ~500 lines because each input format (npy, npz, safetensors, torch, HDF5 activations with padding
masks, several files in one output) is a reader of the same chunked copy and validation, kept beside it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import mmap
import os
import re
import struct
import sys
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from . import formats
from . import tokens as tokens_mod
from ..errors import InputError
from ..linalg.device import import_torch

NAMES = ("tokens", "offsets", "targets", "weights")
# Names of a model's activations read as the tokens when no array is named `tokens` (Hugging Face).
TOKEN_ALIASES = ("last_hidden_state", "hidden_states")
# Names of a padding mask: attention_mask (N, n) of 0/1, or lengths (N,) (the first lengths[i] kept).
MASK_NAMES = ("attention_mask", "lengths")
# Roles of --key ROLE=NAME.
ROLES = ("tokens", "targets", "weights", "offsets", "mask")
SUFFIXES = (".npy", ".npz", ".safetensors", ".pt", ".pth")
# Output suffixes that name another format (an output's suffix means its format).
_OTHER_FORMATS = (*SUFFIXES, ".csv", ".tsv", ".txt", ".json", ".zip", ".pkl", ".pickle")
# Bytes of token (and per-position target) rows copied per chunk (at least one sample per chunk).
CHUNK_BYTES = 16 << 20
_OFFSET_BLOCK = 1 << 20


@dataclass
class _Source:
    """One input array: its name, shape and dtype, and a reader of its rows [a, b) (first axis)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[int, int], np.ndarray]
    label: str  # the file it came from (for messages)


# --------------------------------------------------------------------------------------------
# readers
# --------------------------------------------------------------------------------------------


def _raw_reader(path: Path, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> Callable[[int, int], np.ndarray]:
    """Rows [a, b) of a C-order array stored at byte `offset` of a file, by plain reads."""
    row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))

    def read(a: int, b: int) -> np.ndarray:
        out = np.empty((b - a, *shape[1:]), dtype=dtype)
        if out.nbytes:
            with open(path, "rb", buffering=0) as fh:
                fh.seek(offset + a * row_bytes)
                view = memoryview(out.reshape(-1).view(np.uint8))
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


def _npy_source(name: str, path: Path) -> _Source:
    with open(path, "rb") as fh:
        shape, fortran, dtype = _npy_header(fh, path)
        offset = fh.tell()
    _check_size(path, offset + dtype.itemsize * int(np.prod(shape, dtype=np.int64)))
    if fortran and len(shape) > 1:
        arr = np.load(path, mmap_mode="r")  # column-major: rows are not contiguous in the file
        return _Source(name, shape, dtype, lambda a, b: np.ascontiguousarray(arr[a:b]), str(path))
    return _Source(name, shape, dtype, _raw_reader(path, offset, shape, dtype), str(path))


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
            k = min(a - self.pos, max(1, CHUNK_BYTES // max(1, self.row_bytes)))
            self._bytes(k * self.row_bytes)
            self.pos += k
        data = self._bytes((b - a) * self.row_bytes)
        self.pos = b
        return np.frombuffer(data, dtype=self.dtype).reshape((b - a, *self.shape[1:]))


def _npz_sources(path: Path, stack: ExitStack) -> list[_Source]:
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
            out.append(_Source(name, stream.shape, stream.dtype, lambda a, b, arr=arr: arr[a:b], str(path)))
        else:
            out.append(_Source(name, stream.shape, stream.dtype, stream.read, str(path)))
    return out


# safetensors dtype names -> numpy (BF16 is widened exactly to float32)
_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
              "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}


def _bf16_reader(raw: Callable[[int, int], np.ndarray]) -> Callable[[int, int], np.ndarray]:
    return lambda a, b: (raw(a, b).astype(np.uint32) << 16).view(np.float32)


def _safetensors_sources(path: Path) -> list[_Source]:
    """The tensors of a .safetensors file, read from their byte ranges (the format: an 8-byte
    little-endian header length, a JSON header of dtype, shape and data_offsets, then the data)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise InputError("not a valid .safetensors file (bad header length)", path)
        try:
            header = json.loads(fh.read(n))
        except (ValueError, UnicodeDecodeError) as exc:
            raise InputError(f"not a valid .safetensors file ({exc})", path) from None
    if not isinstance(header, dict):
        raise InputError("not a valid .safetensors file (the header is not a JSON object)", path)
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            kind, shape, (begin, end) = meta["dtype"], tuple(int(s) for s in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise InputError(f"not a valid .safetensors file (bad header entry for '{name}')", path) from None
        if kind not in _ST_DTYPES and kind != "BF16":
            raise InputError(f"tensor '{name}' has dtype {kind}, which mhla cannot read; store float32/float64 "
                             "or integers", path)
        dtype = np.dtype("<u2" if kind == "BF16" else _ST_DTYPES[kind])
        if int(end) - int(begin) != dtype.itemsize * int(np.prod(shape, dtype=np.int64)) or 8 + n + int(end) > size:
            raise InputError(f"tensor '{name}': its data_offsets do not match its shape; the file may be "
                             "truncated or corrupted", path)
        raw = _raw_reader(path, 8 + n + int(begin), shape, dtype)
        if kind == "BF16":
            out.append(_Source(name, shape, np.dtype(np.float32), _bf16_reader(raw), str(path)))
        else:
            out.append(_Source(name, shape, dtype, raw, str(path)))
    return out


def _torch(path: str | os.PathLike | None = None) -> Any:
    """torch for reading .pt files (the package's one import of it: linalg.device.import_torch)."""
    return import_torch("reading torch .pt files", path)


def _tensor_source(name: str, t: Any, label: str, release: _PageDropper | None = None) -> _Source:
    torch = _torch()
    t = t.detach()
    widen = t.dtype == torch.bfloat16  # no numpy bfloat16: widened exactly to float32
    if widen:
        dtype = np.dtype(np.float32)
    else:
        try:
            dtype = torch.empty(0, dtype=t.dtype).numpy().dtype
        except (TypeError, RuntimeError):
            raise InputError(f"tensor '{name}' has dtype {t.dtype}, which mhla cannot read; store float32/float64 "
                             "or integers", label) from None

    def read(a: int, b: int) -> np.ndarray:
        rows = t[a:b]
        out = rows.float().numpy() if widen else np.array(rows.numpy())
        if release is not None and rows.is_contiguous():
            release(rows.data_ptr(), rows.numel() * rows.element_size())
        return out

    return _Source(name, tuple(int(s) for s in t.shape), dtype, read, label)


class _PageDropper:
    """Hands back to the kernel the pages of a memory-mapped file that have been copied (madvise
    MADV_DONTNEED; Linux), so that reading a torch file mapped with mmap=True does not grow the RSS.

    Only whole pages inside a read-only use of a mapping of that very file (per /proc/self/maps) are
    dropped: the next access reads them from the file again, so no data can change.
    """

    def __init__(self, path: Path) -> None:
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
            elif ours and fields[0] == "Private_Dirty:" and int(fields[1]) > 0:
                # torch changed pages of the mapping (e.g. swapped the bytes of a big-endian file):
                # dropping them would bring back the file's bytes, so drop nothing
                self.ranges = []
                return

    def __call__(self, addr: int, nbytes: int) -> None:
        page = mmap.PAGESIZE
        lo, hi = -(-addr // page) * page, (addr + nbytes) // page * page
        if hi > lo and any(a <= lo and hi <= b for a, b in self.ranges):
            self.madvise(lo, hi - lo, 4)  # MADV_DONTNEED


def _torch_sources(path: Path) -> list[_Source]:
    torch = _torch(path)
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            release: _PageDropper | None = _PageDropper(path)
        except RuntimeError as exc:
            if "mmap" not in str(exc).lower() and "zip" not in str(exc).lower():
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)  # a legacy (non-zip) file: in memory
            release = None
    except Exception as exc:  # noqa: BLE001 (torch and pickle raise many types)
        reason = " ".join(str(exc).split())
        if "weights only load failed" in reason.lower():  # torch's advice to unpickle anything is not ours
            reason = "not a torch.save file of tensors, lists and dicts"
        raise InputError(f"cannot read as a torch file ({reason[:200]}); mhla reads a tensor, a list of (n_i, d) "
                         "tensors or a dict of them (torch.save, loaded with weights_only=True)", path) from None
    label = str(path)
    if isinstance(obj, torch.Tensor):
        return [_tensor_source("tokens", obj, label, release)]
    if isinstance(obj, (list, tuple)):
        _check_sequence_list(obj, "the file", path)
        return _value_sources({"tokens": obj}, label, release)
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise InputError("a dict with keys that are not strings; name the tensors tokens, offsets, targets, "
                             "weights", path)
        return _value_sources(obj, label, release)
    raise InputError(f"holds a {type(obj).__name__}; mhla reads a tensor, a list of (n_i, d) tensors or a dict of "
                     "them", path)


# --------------------------------------------------------------------------------------------
# in-memory values: arrays, tensors and lists of sequences
# --------------------------------------------------------------------------------------------


def _as_array(x: Any, name: str, label: str) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    try:
        arr = np.asarray(x)
    except (ValueError, TypeError) as exc:
        raise InputError(f"'{name}' is not an array ({exc})", label) from None
    if arr.dtype.hasobject:
        raise InputError(f"'{name}' holds Python objects (sequences of different lengths?), expected an array "
                         "of numbers", label)
    return arr


def _concat_source(name: str, seqs: Sequence[Any], label: str, release: _PageDropper | None = None
                   ) -> tuple[_Source, np.ndarray]:
    """A list of (n_i, ...) arrays as one concatenated array (read piece by piece) and its offsets."""
    arrays = [_as_array(s, name, label) for s in seqs]
    if not arrays:
        raise InputError(f"'{name}' is an empty list: no samples", label)
    first = arrays[0]
    for i, a in enumerate(arrays):
        if a.ndim < 1 or a.shape[1:] != first.shape[1:]:
            row = ", ".join(map(str, first.shape[1:]))
            raise InputError(f"'{name}': sequence {i} has shape {a.shape}, expected (n_i, {row}) like sequence 0",
                             label)
    dtype = np.result_type(*arrays)
    offsets = np.concatenate([[0], np.cumsum([a.shape[0] for a in arrays])]).astype(np.int64)

    def read(a: int, b: int) -> np.ndarray:
        i0 = int(np.searchsorted(offsets, a, side="right")) - 1
        parts = []
        i = i0
        while i < len(arrays) and offsets[i] < b:
            lo, hi = max(a, int(offsets[i])) - int(offsets[i]), min(b, int(offsets[i + 1])) - int(offsets[i])
            parts.append(arrays[i][lo:hi])
            i += 1
        if not parts:
            return np.empty((0, *first.shape[1:]), dtype)
        out = np.concatenate(parts).astype(dtype, copy=False)
        spans = [(p.ctypes.data, p.ctypes.data + p.nbytes) for p in parts if p.flags.c_contiguous]
        if release is not None and spans:
            # one range over all the parts (and what lies between them in the file: zip headers), so
            # that the pages shared by neighbouring sequences go too
            lo = min(a for a, _ in spans)
            release(lo, max(b for _, b in spans) - lo)
        return out

    return _Source(name, (int(offsets[-1]), *first.shape[1:]), dtype, read, label), offsets


def _array_source(name: str, arr: np.ndarray, label: str) -> _Source:
    return _Source(name, tuple(int(s) for s in arr.shape), arr.dtype,
                   lambda a, b: np.ascontiguousarray(arr[a:b]), label)


def _check_sequence_list(obj: Sequence[Any], what: str, path: str | os.PathLike) -> None:
    """Refuse clearly a tuple / list that is not a list of (n_i, d) sequences: e.g. a model's output
    tuple (last_hidden_state (N, n, d), pooler_output (N, d)) or the per-layer `hidden_states`."""
    shapes = [tuple(getattr(x, "shape", ())) for x in obj]
    if obj and all(len(sh) == 2 for sh in shapes) and len({sh[1] for sh in shapes}) == 1:
        return  # ragged sequences (n_i, d)
    kind = type(obj).__name__
    listed = ", ".join(str(sh) for sh in shapes[:4]) + (", ..." if len(shapes) > 4 else "")
    raise InputError(f"{what} holds a {kind} of {len(shapes)} arrays of shapes {listed}, not a list of (n_i, d) "
                     "sequences (a model's output tuple, or the hidden states of every layer?): save a dict naming "
                     "the arrays, e.g. {'tokens': out.last_hidden_state, 'attention_mask': mask} or "
                     "{'tokens': out.hidden_states[k], ...}", path)


def _value_sources(values: dict[str, Any], label: str, release: _PageDropper | None = None) -> list[_Source]:
    """Sources of named values: arrays or tensors; tokens, targets, weights may be lists of sequences."""
    out = []
    for name, v in values.items():
        if v is None:
            continue
        if isinstance(v, (list, tuple)):
            # a list of sequences (n_i, d) for tokens; of per-sequence rows or per-position blocks otherwise
            row_ndim = {"tokens": 2, "targets": 1, "weights": 0}.get(name)
            if name in TOKEN_ALIASES:
                _check_sequence_list(v, f"'{name}'", label)
                row_ndim = 2
            if row_ndim is None:
                raise InputError(f"'{name}' is a list; give it as one array", label)
            items = [_as_array(s, name, label) for s in v]
            if name != "tokens" and items and all(x.ndim == row_ndim for x in items):
                out.append(_array_source(name, _as_array(np.stack(items), name, label), label))
                continue
            src, offsets = _concat_source(name, items, label, release)
            out.append(src)
            if name == "tokens" or name in TOKEN_ALIASES:
                if values.get("offsets") is not None:
                    raise InputError("give 'offsets' only with tokens as one (T, d) array, not with a list of "
                                     "sequences (their lengths are the offsets)", label)
                out.append(_array_source("offsets", offsets, label))
        elif type(v).__module__.startswith("torch") and hasattr(v, "detach"):
            out.append(_tensor_source(name, v, label, release))
        else:
            out.append(_array_source(name, _as_array(v, name, label), label))
    return out


# --------------------------------------------------------------------------------------------
# the writer
# --------------------------------------------------------------------------------------------


def _relabel(exc: InputError, tmp: Path, where: str) -> InputError:
    """The reader's error about the temporary output, said of the inputs it was made from."""
    if exc.path != str(tmp):
        return exc
    return InputError(str(exc)[len(exc.path) + 2:], where)


def _plan(f: h5py.File, info: tokens_mod.TokensInfo, rows: int, chunk_size: int | None
          ) -> Iterator[tuple[int, int, np.ndarray]]:
    """(a, b, offsets[a..b]) for chunks of samples of about `rows` token rows (at least one sample)."""
    N = info.n_samples
    if info.layout == "dense":
        n = int(info.seq_len)
        step = chunk_size or max(1, rows // n)
        for a, b in tokens_mod.spans(0, N, step):
            yield a, b, np.arange(a, b + 1, dtype=np.int64) * n
        return
    for s in range(0, N, _OFFSET_BLOCK):
        e = min(N, s + _OFFSET_BLOCK)
        off = np.asarray(f["offsets"][s:e + 1], dtype=np.int64)
        a = s
        while a < e:
            b = int(np.searchsorted(off, off[a - s] + rows, side="right")) - 1 + s
            b = min(e, a + chunk_size) if chunk_size else min(e, max(a + 1, b))
            yield a, b, off[a - s:b - s + 1]
            a = b


def _reopen(tmp: Path) -> h5py.File:
    """The private temporary output, opened again for writing (no lock: nobody else opens it)."""
    try:
        return h5py.File(tmp, "r+", locking=False)
    except ValueError:  # HDF5 older than 1.10.7 / 1.12.1: no locking property
        return h5py.File(tmp, "r+")


def _write(out: str | os.PathLike, sources: list[_Source], inputs: tuple[str | os.PathLike, ...],
           chunk_size: int | None, progress: Callable[[int], None] | None) -> tokens_mod.TokensInfo:
    labels = list(dict.fromkeys(s.label for s in sources))
    where = " + ".join(labels) if labels else "input"
    _check_names(sources, where)
    src = {s.name: s for s in sources}
    for s in sources:
        formats.check_numeric(s, s.name, s.label)  # a duck-typed dataset: only its dtype is read
    suffix = Path(out).suffix.lower()
    if suffix in _OTHER_FORMATS:
        raise InputError(f"the output is an HDF5 tokens file: give it a .h5 name, not {suffix}", out)
    o = formats.check_output_path(out, inputs)
    with formats.atomic_path(o) as tmp:
        with formats.create_output(tmp) as f:
            for k, v in formats.header("tokens", inputs).items():
                f.attrs[k] = v
            for s in sources:
                f.create_dataset(s.name, shape=s.shape, dtype=s.dtype)
            if "offsets" in src and src["offsets"].shape:
                off = src["offsets"]
                for a, b in tokens_mod.spans(0, off.shape[0], _OFFSET_BLOCK):
                    f["offsets"][a:b] = off.read(a, b)
        try:
            info = tokens_mod.inspect_tokens(tmp)  # the reader's own checks of shapes and offsets
        except InputError as exc:
            raise _relabel(exc, tmp, where) from None
        with _reopen(tmp) as f:
            _copy(f, info, src, chunk_size, progress)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
    return dataclasses.replace(info, path=str(o))


def _copy(f: h5py.File, info: tokens_mod.TokensInfo, src: dict[str, _Source], chunk_size: int | None,
          progress: Callable[[int], None] | None) -> None:
    """Copy tokens, targets and weights chunk by chunk, refusing NaN, Inf and bad weights as readers do."""
    N, d = info.n_samples, info.d
    tok = src["tokens"]
    row_bytes = tok.dtype.itemsize * d + (8 * d if info.per_position else 0)
    data = [s for name, s in src.items() if name != "offsets"]
    for a, b, off in _plan(f, info, max(1, CHUNK_BYTES // row_bytes), chunk_size):
        r0, r1 = int(off[0]), int(off[-1])
        local = off - r0
        rows = {s.name: (a, b) if s.shape[0] == N else (r0, r1) for s in data}  # per sample, or per token
        chunk = {s.name: s.read(*rows[s.name]) for s in data}
        tokens_mod.check_finite(chunk["tokens"].reshape(-1, d), local, None, a, tok.label)
        if "targets" in chunk:
            tokens_mod.check_finite(chunk["tokens"][:0].reshape(0, d), local, chunk["targets"], a,
                                    src["targets"].label)
        if "weights" in chunk:
            w = np.asarray(chunk["weights"], dtype=np.float64).reshape(-1)
            tokens_mod.check_weights(w, local, a, info.per_position and w.size != b - a, src["weights"].label)
        for name, arr in chunk.items():
            lo, hi = rows[name]
            if hi > lo:
                f[name][lo:hi] = arr
        if progress is not None:
            progress(b - a)


def write_tokens(path: str | os.PathLike, tokens: Any, offsets: Any = None, targets: Any = None,
                 weights: Any = None, *, chunk_size: int | None = None,
                 progress: Callable[[int], None] | None = None) -> tokens_mod.TokensInfo:
    """Write a tokens file (atomically) from arrays; returns the layout of the file written.

    `tokens`: a list of (n_i, d) sequences (written ragged, offsets from their lengths), a (T, d)
    array with `offsets` (N+1,), or an (N, n, d) array. `targets` (N, d) or per position (T, d) /
    (N, n, d), and `weights` (N,) or (T,) / (N, n), may also be lists (one row or one block per
    sequence). Arrays may be numpy arrays, memory maps or torch tensors; they are copied in chunks.
    Refused (InputError, nothing written) as every reader refuses them: wrong shapes, offsets that do
    not increase, NaN or Inf, negative weights.
    """
    values = {"tokens": tokens, "offsets": offsets, "targets": targets, "weights": weights}
    return _write(path, _value_sources(values, "input"), (), chunk_size, progress)


def parse_input(spec: str | os.PathLike) -> tuple[str | None, Path]:
    """'NAME=FILE' -> (NAME, FILE); a plain path -> (None, path)."""
    s = str(spec)
    name, sep, rest = s.partition("=")
    if sep and name in NAMES and not Path(s).exists():
        return name, Path(rest)
    return None, Path(s)


def _file_sources(name: str | None, p: Path, stack: ExitStack) -> list[_Source]:
    if not p.exists():
        raise InputError("no such file", p)
    if p.is_dir():
        raise InputError("is a directory, expected a .npy, .npz, .safetensors or .pt file", p)
    suffix = p.suffix.lower()
    if name is not None and suffix != ".npy":
        raise InputError("NAME=FILE names the array of a .npy file; the arrays of .npz, .safetensors and .pt "
                         "files are named inside them", p)
    try:
        is_hdf5 = h5py.is_hdf5(p)
    except OSError:
        is_hdf5 = False
    if is_hdf5:
        raise InputError("is already an HDF5 file: mhla reads it as it is", p)
    if suffix == ".npy":
        return [_npy_source(name or (p.stem if p.stem in NAMES else "tokens"), p)]
    if suffix == ".npz":
        return _npz_sources(p, stack)
    if suffix == ".safetensors":
        return _safetensors_sources(p)
    if suffix in (".pt", ".pth"):
        return _torch_sources(p)
    text = " (text: load it with np.loadtxt and np.save it as .npy)" if suffix in (".csv", ".tsv", ".txt") else ""
    raise InputError(f"unknown input format '{suffix or p.name}': mhla convert reads .npy, .npz, .safetensors "
                     f"and .pt files{text}", p)


# --------------------------------------------------------------------------------------------
# activations as models write them: names, padding masks, several files
# --------------------------------------------------------------------------------------------


def parse_keys(keys: Sequence[str] | None) -> dict[str, str]:
    """--key ROLE=NAME options -> {NAME: ROLE} (ROLE: tokens, targets, weights, offsets, mask)."""
    out: dict[str, str] = {}
    for k in keys or ():
        role, sep, name = str(k).partition("=")
        if not sep or not name or role not in ROLES:
            raise InputError(f"--key {k}: expected ROLE=NAME with ROLE one of {', '.join(ROLES)} (e.g. "
                             "--key tokens=hidden)")
        if name in out and out[name] != role:
            raise InputError(f"--key: '{name}' is given two roles ({out[name]} and {role})")
        out[name] = role
    roles = list(out.values())
    dup = sorted({r for r in roles if roles.count(r) > 1})
    if dup:
        raise InputError(f"--key: more than one array given the role {', '.join(dup)}")
    return out


def _rename(sources: list[_Source], keymap: dict[str, str], mask: str | None) -> tuple[list[_Source], str | None]:
    """Sources renamed by --key (the mask role names the mask) and the token aliases; the mask's name."""
    out = []
    for s in sources:
        role = keymap.get(s.name)
        if role == "mask":
            mask = s.name
        elif role is not None:
            s = dataclasses.replace(s, name=role)
        out.append(s)
    names = [s.name for s in out]
    if "tokens" not in names:
        alias = [a for a in TOKEN_ALIASES if a in names]
        if alias:
            out = [dataclasses.replace(s, name="tokens") if s.name == alias[0] else s for s in out]
    return out, mask


# Bytes of mask rows read at once while counting a padded file's lengths.
_MASK_BYTES = 16 << 20


def _mask_rows(mask: _Source, n: int) -> Callable[[int, int], np.ndarray]:
    """Rows [a, b) of the keep mask (bool (b-a, n)): an attention mask of 0/1, or lengths (N,)."""
    if len(mask.shape) == 1:
        def read(a: int, b: int) -> np.ndarray:
            lens = np.asarray(mask.read(a, b))
            return np.arange(n)[None, :] < lens.astype(np.int64)[:, None]
        return read

    def read2(a: int, b: int) -> np.ndarray:
        return np.asarray(mask.read(a, b)) != 0
    return read2


def _check_mask(mask: _Source, N: int, n: int, label: str) -> np.ndarray:
    """The offsets (N+1,) of the kept tokens; refuses a mask of another shape, values other than 0/1
    (lengths outside 1..n) and sequences with no token kept."""
    if mask.dtype.kind not in "biuf":
        raise InputError(f"'{mask.name}' has dtype {mask.dtype}, expected 0/1 numbers (or integer lengths)", label)
    lengths = np.empty(N, dtype=np.int64)
    step = max(1, _MASK_BYTES // max(1, n * max(1, mask.dtype.itemsize)))
    for a in range(0, N, step):
        b = min(N, a + step)
        m = np.asarray(mask.read(a, b))
        if len(mask.shape) == 1:
            bad = ~((m >= 1) & (m <= n) & (m == np.floor(m)))
            if bad.any():
                i = a + int(np.flatnonzero(bad)[0])
                raise InputError(f"'{mask.name}' of sequence {i} is {m[i - a]!r}: lengths must be whole numbers in "
                                 f"1..{n} (the padded length)", label)
            lengths[a:b] = m.astype(np.int64)
        else:
            bad = ~((m == 0) | (m == 1))
            if bad.any():
                i, t = (int(x[0]) for x in np.nonzero(bad))
                raise InputError(f"'{mask.name}' of sequence {a + i}, position {t} is {m[i, t]!r}: an attention "
                                 "mask holds 0 (padding) or 1 (a token)", label)
            lengths[a:b] = (m != 0).sum(axis=1)
            empty = np.flatnonzero(lengths[a:b] == 0)
            if empty.size:
                raise InputError(f"sequence {a + int(empty[0])} has no token: its '{mask.name}' is all 0", label)
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _masked(src: _Source, keep: Callable[[int, int], np.ndarray], offsets: np.ndarray) -> _Source:
    """Rows of a padded (N, n, ...) array at the kept positions, flattened: (T, ...) in order."""
    rest = src.shape[2:]

    def read(a: int, b: int) -> np.ndarray:
        if b <= a:
            return np.empty((0, *rest), src.dtype)
        i0 = int(np.searchsorted(offsets, a, side="right")) - 1
        i1 = int(np.searchsorted(offsets, b, side="left"))
        rows = np.asarray(src.read(i0, i1))[keep(i0, i1)]
        r0 = a - int(offsets[i0])
        return rows[r0:r0 + (b - a)]

    return _Source(src.name, (int(offsets[-1]), *rest), src.dtype, read, src.label)


def _flat(src: _Source) -> _Source:
    """A dense (N, n, ...) array read as (N n, ...) rows."""
    n = src.shape[1]
    rest = src.shape[2:]

    def read(a: int, b: int) -> np.ndarray:
        if b <= a:
            return np.empty((0, *rest), src.dtype)
        i0, i1 = a // n, -(-b // n)
        rows = np.asarray(src.read(i0, i1)).reshape(-1, *rest)
        return rows[a - i0 * n:b - i0 * n]

    return _Source(src.name, (src.shape[0] * n, *rest), src.dtype, read, src.label)


def _apply_mask(sources: list[_Source], mask_name: str | None, label: str, explicit: bool) -> list[_Source]:
    """Padded tokens (N, n, d) with a mask (N, n) or lengths (N,): the unpadded sequences (ragged; the
    last kept position is the query), per-position targets and weights masked the same way."""
    by = {s.name: s for s in sources}
    if mask_name is None:
        found = [m for m in MASK_NAMES if m in by]
        if len(found) > 1:
            raise InputError(f"both {' and '.join(repr(f) for f in found)}: give one padding mask (or name it with "
                             "--mask NAME)", label)
        mask_name = found[0] if found else None
    if mask_name is None:
        return sources
    if mask_name not in by:
        if explicit:
            have = ", ".join(repr(s.name) for s in sources) or "nothing"
            raise InputError(f"no array '{mask_name}' to use as the padding mask (found {have})", label)
        return sources
    mask = by[mask_name]
    tok = by.get("tokens")
    if tok is None:
        return sources  # the missing tokens are reported by the writer
    if len(tok.shape) != 3:
        raise InputError(f"'{mask_name}' masks padded tokens (N, n, d), but 'tokens' has shape {tok.shape}", label)
    if "offsets" in by:
        raise InputError(f"give either '{mask_name}' (padded tokens) or 'offsets' (ragged tokens), not both", label)
    N, n = tok.shape[0], tok.shape[1]
    want = (N,) if len(mask.shape) == 1 else (N, n)
    if mask.shape != want:
        raise InputError(f"'{mask_name}' has shape {mask.shape}, expected (N, n) = ({N}, {n}) (0/1 per position) "
                         f"or (N,) = ({N},) (lengths)", label)
    offsets = _check_mask(mask, N, n, label)
    keep = _mask_rows(mask, n)
    out = []
    for s in sources:
        if s.name == mask_name:
            continue
        if s.name == "tokens" or (len(s.shape) >= 2 and s.shape[:2] == (N, n) and s.name in ("targets", "weights")
                                  and not (s.name == "targets" and len(s.shape) == 2)):
            s = _masked(s, keep, offsets)  # per position: tokens, targets (N, n, e), weights (N, n)
        out.append(s)
    out.append(_array_source("offsets", offsets, label))
    return out


def _check_names(sources: list[_Source], where: str) -> None:
    names = [s.name for s in sources]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InputError(f"more than one array named {', '.join(repr(d) for d in dup)}", where)
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise InputError(f"unknown array{'s' if len(unknown) > 1 else ''} {', '.join(repr(u) for u in unknown)}: "
                         "a tokens file holds only tokens, offsets, targets and weights (rename the arrays, map "
                         "them with --key ROLE=NAME, or name a .npy file NAME=FILE)", where)
    if "tokens" not in names:
        found = ", ".join(repr(n) for n in names) or "nothing"
        raise InputError(f"no 'tokens' array (found {found}; name one with --key tokens=NAME)", where)


@dataclass
class _Part:
    """One input file of several: its arrays (named as a tokens file's) and their layout."""

    label: str
    src: dict[str, _Source]
    N: int
    dense: int | None  # n for (N, n, d) tokens, None for ragged (T, d) + offsets

    @property
    def d(self) -> int:
        return int(self.src["tokens"].shape[-1])

    def role(self, name: str) -> str | None:
        """How `name` is laid out: "sequence" (first axis N) or "position" (per token), None if absent."""
        s = self.src.get(name)
        if s is None:
            return None
        if self.dense is not None:
            per_pos = len(s.shape) >= 2 and s.shape[1] == self.dense and (name == "weights" or len(s.shape) == 3)
        else:
            T = self.src["tokens"].shape[0]
            per_pos = s.shape[0] == T and T != self.N
        return "position" if per_pos else "sequence"

    def layout(self) -> tuple[Any, ...]:
        tg = self.src.get("targets")
        return (self.d, self.role("targets"), None if tg is None else int(tg.shape[-1]), self.role("weights"))


def _part(sources: list[_Source], label: str) -> _Part:
    _check_names(sources, label)
    src = {s.name: s for s in sources}
    tok = src["tokens"]
    if len(tok.shape) == 3:
        return _Part(label, src, int(tok.shape[0]), int(tok.shape[1]))
    if len(tok.shape) != 2 or "offsets" not in src:
        raise InputError(f"'tokens' has shape {tok.shape}: to join several files each needs tokens (N, n, d), "
                         "(N, n, d) with a padding mask, or (T, d) with offsets", label)
    return _Part(label, src, int(src["offsets"].shape[0]) - 1, None)


def _concat(name: str, parts: list[_Source]) -> _Source:
    """Sources joined along their first axis, read part by part."""
    sizes = np.concatenate([[0], np.cumsum([p.shape[0] for p in parts])]).astype(np.int64)
    dtype = np.result_type(*[p.dtype for p in parts])

    def read(a: int, b: int) -> np.ndarray:
        out = []
        for k, p in enumerate(parts):
            lo, hi = max(a, int(sizes[k])), min(b, int(sizes[k + 1]))
            if hi > lo:
                out.append(np.asarray(p.read(lo - int(sizes[k]), hi - int(sizes[k]))).astype(dtype, copy=False))
        if not out:
            return np.empty((0, *parts[0].shape[1:]), dtype)
        return np.concatenate(out)

    return _Source(name, (int(sizes[-1]), *parts[0].shape[1:]), dtype, read, " + ".join(p.label for p in parts))


def _join(parts: list[_Part]) -> list[_Source]:
    """Several files' arrays as one: concatenated in the order given (dense when every file is dense
    with one n, else ragged), refusing a file of another d or layout."""
    first = parts[0]
    for p in parts[1:]:
        if p.d != first.d:
            raise InputError(f"has tokens of d = {p.d} but {first.label} has d = {first.d}: the files cannot be "
                             "joined", p.label)
        if p.layout() != first.layout():
            def desc(q: _Part) -> str:
                d, tr, te, wr = q.layout()
                return (f"targets {'per ' + tr + f' ({te} wide)' if tr else 'none'}, weights "
                        f"{'per ' + wr if wr else 'none'}")
            raise InputError(f"has another layout than {first.label} ({desc(p)}; {desc(first)}): the files cannot "
                             "be joined", p.label)
    dense = all(p.dense is not None and p.dense == first.dense for p in parts)
    out = []
    names = [n for n in ("tokens", "targets", "weights") if n in first.src]
    if dense:
        for name in names:
            out.append(_concat(name, [p.src[name] for p in parts]))
        return out
    flat: dict[str, list[_Source]] = {n: [] for n in names}
    offs = [np.zeros(1, dtype=np.int64)]
    total = 0
    for p in parts:
        for name in names:
            s = p.src[name]
            flat[name].append(_flat(s) if p.dense is not None and p.role(name) in ("position",) or
                              (p.dense is not None and name == "tokens") else s)
        if p.dense is not None:
            o = np.arange(1, p.N + 1, dtype=np.int64) * p.dense
        else:
            off = p.src["offsets"]
            o = np.asarray(off.read(1, off.shape[0]), dtype=np.int64)
        offs.append(o + total)
        total += int(o[-1]) if o.size else 0
    for name in names:
        out.append(_concat(name, flat[name]))
    off = np.concatenate(offs)
    out.append(_array_source("offsets", off, " + ".join(p.label for p in parts)))
    return out


def expand_inputs(inputs: Sequence[str | os.PathLike]) -> list[str]:
    """Inputs with directories replaced by their files of a known suffix (sorted by name) and
    unexpanded shell patterns (*, ?, [) by their matches (sorted)."""
    import glob

    out: list[str] = []
    for spec in inputs:
        s = str(spec)
        name, p = parse_input(s)
        if name is None and p.is_dir():
            files = sorted(str(q) for q in p.iterdir() if q.is_file() and q.suffix.lower() in SUFFIXES)
            if not files:
                raise InputError("is a directory with no .npy, .npz, .safetensors or .pt file", p)
            out += files
        elif name is None and not p.exists() and any(c in s for c in "*?["):
            files = sorted(glob.glob(s))
            if not files:
                raise InputError("matches no file", s)
            out += files
        else:
            out.append(s)
    return out


def convert_files(inputs: Sequence[str | os.PathLike], output: str | os.PathLike, *,
                  chunk_size: int | None = None, progress: Callable[[int], None] | None = None,
                  mask: str | None = None, keys: Sequence[str] | None = None) -> tokens_mod.TokensInfo:
    """Write the arrays of `inputs` (.npy, .npz, .safetensors, .pt) as one tokens file `output`.

    A `.npy` input holds one array: the one named by `NAME=FILE` (e.g. `targets=y.npy`), else by its
    stem when that is a dataset name (`offsets.npy`), else the tokens (allowed once). The others hold
    arrays named as the datasets of a tokens file; a torch file may also hold a tensor (the tokens)
    or a list of (n_i, d) tensors (ragged sequences). Validated and written as `write_tokens`.

    Activations as models write them: `last_hidden_state` or `hidden_states` are the tokens when no
    array is named `tokens`; `keys` ("ROLE=NAME": tokens, targets, weights, offsets, mask) name any
    array's role; padded tokens (N, n, d) with an `attention_mask` (N, n) of 0/1 or `lengths` (N,)
    (or the array named by `mask`) become the unpadded sequences, the last kept position the query
    (per-position targets and weights masked alike). When several files hold tokens (a directory or
    a glob gives its files sorted), each is one part and they are joined in the order given; a file
    of another d or layout is refused, naming it.
    """
    if not inputs:
        raise InputError("no input files")
    keymap = parse_keys(keys)
    specs = [parse_input(i) for i in expand_inputs(inputs)]
    with ExitStack() as stack:
        plain = [p for n, p in specs if n is None and p.suffix.lower() == ".npy" and p.stem not in NAMES]
        per_file: list[tuple[Path, list[_Source], str | None]] = []
        for name, p in specs:
            srcs, mask_name = _rename(_file_sources(name, p, stack), keymap, mask)
            per_file.append((p, srcs, mask_name))
        holders = [p for p, srcs, _ in per_file if any(s.name == "tokens" for s in srcs)]
        if len(holders) > 1 and not plain:
            parts = []
            for p, srcs, mask_name in per_file:
                if not any(s.name == "tokens" for s in srcs):
                    raise InputError("holds no tokens: when several files hold tokens each file is one part to "
                                     "join, with its own targets and weights", p)
                parts.append(_part(_apply_mask(srcs, mask_name, str(p), mask is not None), str(p)))
            sources = _join(parts)
        else:
            if len(plain) > 1:
                raise InputError(f"cannot tell which array each of {', '.join(p.name for p in plain)} holds: name "
                                 "the files tokens.npy, offsets.npy, targets.npy, weights.npy, or write NAME=FILE "
                                 "(e.g. targets=y.npy)")
            sources = [s for _, srcs, _ in per_file for s in srcs]
            where = " + ".join(str(p) for p, _, _ in per_file)
            mask_name = next((m for _, _, m in per_file if m is not None), None)
            sources = _apply_mask(sources, mask_name, where, mask is not None)
        return _write(output, sources, tuple(p for _, p in specs), chunk_size, progress)
