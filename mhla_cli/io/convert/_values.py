"""In-memory values as sources: numpy arrays, torch tensors, and lists of sequences (ragged data).

`write_tokens` and the torch reader (whose `torch.load` gives tensors, lists and dicts) go through
`_value_sources`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._roles import TOKEN_ALIASES
from ._source import _array_source, _PageDropper, _Source
from ...errors import InputError
from ...linalg.device import import_torch


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
        if release is not None and rows.numel():
            # the bytes the rows span in the file (all of them for a strided view, e.g. one head of a hook saved
            # as a slice: the pages dropped that other rows share are read from the file again when needed)
            span = 1 + sum((n - 1) * st for n, st in zip(rows.shape, rows.stride()))
            release(rows.data_ptr(), span * rows.element_size())
        return out

    return _Source(name, tuple(int(s) for s in t.shape), dtype, read, label)


def _as_array(x: Any, name: str, label: str) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    if isinstance(x, dict):
        raise InputError(f"'{name}' is a dict of {len(x)} entries, expected an array", label)
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
