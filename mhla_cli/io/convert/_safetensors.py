"""`.safetensors` inputs: the tensors are read from their byte ranges (the format: an 8-byte
little-endian header length, a JSON header of dtype, shape and data_offsets, then the data)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from ._source import Reader, _raw_reader, _Source
from ...errors import InputError

# safetensors dtype names -> numpy (BF16 is widened exactly to float32)
_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
              "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}


def _bf16_reader(raw: Callable[[int, int], np.ndarray]) -> Callable[[int, int], np.ndarray]:
    return lambda a, b: (raw(a, b).astype(np.uint32) << 16).view(np.float32)


def safetensors_sources(path: Path, stack: ExitStack | None = None) -> list[_Source]:
    """The tensors of a .safetensors file, named by their keys."""
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


SAFETENSORS = Reader("safetensors", (".safetensors",), safetensors_sources)
