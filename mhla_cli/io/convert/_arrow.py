"""Hugging Face `datasets` directories and `.arrow` files, through pyarrow (the arrow extra).

A directory written by `Dataset.save_to_disk` (SAELens's activation cache is one) holds
`dataset_info.json`, `state.json` (its `_data_files` lists the data files in order) and
`data-XXXXX-of-YYYYY.arrow` files in the Arrow IPC streaming format. Each column is one array: an
`Array2D(shape=(context, d))` column (one per hook) is (N, context, d), a `Sequence(length=L)`
column (N, L), a value column (N,). The columns are a store of hooks: those no `--key` picks are
left out. The files are memory-mapped and read batch by batch; on Linux the pages copied are handed
back to the kernel as the copy proceeds.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from ._source import Reader, _PageDropper, _Source
from ...errors import InputError

_HINT = "pip install 'pyarrow>=14.0.1' (mhla's [arrow] extra)"


def _pyarrow(path: Path) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
    except ImportError:
        raise InputError(f"reading Arrow files: pyarrow is not installed; {_HINT}", path) from None
    return pyarrow


def is_dataset_dir(p: Path) -> bool:
    """A directory written by `datasets` (`save_to_disk`): one input, not a folder of inputs."""
    return p.is_dir() and any((p / n).is_file() for n in ("state.json", "dataset_info.json", "dataset_dict.json"))


def _data_files(p: Path) -> list[Path]:
    """The Arrow files of a dataset directory (in the order of state.json), or the file itself."""
    if not p.is_dir():
        return [p]
    if (p / "dataset_dict.json").is_file():
        try:
            splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        except (ValueError, OSError, AttributeError):
            splits = []
        first = splits[0] if splits else "SPLIT"
        raise InputError(f"is a DatasetDict of splits {', '.join(map(str, splits)) or '(none listed)'}: convert one "
                         f"split, e.g. mhla convert {p / str(first)} -o OUT.h5", p)
    files: list[Path] = []
    if (p / "state.json").is_file():
        try:
            state = json.loads((p / "state.json").read_text())
            files = [p / str(f["filename"]) for f in state["_data_files"]]
            indices = state.get("_indices_data_files")
        except (ValueError, OSError, KeyError, TypeError, AttributeError):
            raise InputError("has a state.json that does not list its data files ('_data_files')", p) from None
        if indices:
            raise InputError("holds an indices mapping (a shuffled or filtered dataset saved by an old datasets): "
                             "save it again with ds.flatten_indices().save_to_disk(DIR)", p)
    else:
        files = sorted(p.glob("data-*.arrow")) or sorted(p.glob("*.arrow"))
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise InputError(f"lists data files that are not there: {', '.join(missing[:3])}", p)
    if not files:
        raise InputError("is a datasets directory with no .arrow data files", p)
    return files


def _batches(pa: Any, f: Path, stack: ExitStack) -> list[Any]:
    """The record batches of an Arrow IPC file (streaming format, as datasets writes it, or file format)."""
    try:
        mm = stack.enter_context(pa.memory_map(str(f), "r"))
        try:
            return list(pa.ipc.open_stream(mm))
        except pa.ArrowInvalid:
            mm.seek(0)
            reader = pa.ipc.open_file(mm)
            return [reader.get_batch(i) for i in range(reader.num_record_batches)]
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"not a valid Arrow IPC file ({' '.join(str(exc).split())[:200]})", f) from None


def _storage(col: Any) -> Any:
    """A column's storage: an extension array (datasets' Array2D, if its type is registered) unwrapped."""
    return getattr(col, "storage", col)


def _row_shape(pa: Any, col: Any) -> tuple[tuple[int, ...], Any] | None:
    """(shape of one row, leaf arrow type) from a column's first row; None for a non-numeric column."""
    shape, arr, t = [], col.slice(0, 1), col.type
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        if pa.types.is_fixed_size_list(t):
            shape.append(int(t.list_size))
        else:
            off = arr.offsets.to_numpy()
            shape.append(int(off[1] - off[0]))  # the first entry's length
        arr, t = arr.flatten(), t.value_type
    if not (pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_boolean(t)):
        return None
    return tuple(shape), t


def _rows(pa: Any, col: Any, shape: tuple[int, ...], name: str, label: str, release: _PageDropper) -> np.ndarray:
    """The rows of a column slice as one (rows, *shape) array (a view of the mapped file if it can);
    the pages of the list offsets read are handed back."""
    arr = col
    for size in shape:
        if arr.null_count:
            raise InputError(f"column '{name}' has missing (null) entries", label)
        if not pa.types.is_fixed_size_list(arr.type):
            off = arr.offsets.to_numpy()
            if not np.all(np.diff(off) == size):
                raise InputError(f"column '{name}' has rows of other shapes than its first row {shape}: mhla reads "
                                 "a column of one shape per row", label)
            release(off.ctypes.data, off.nbytes)
        arr = arr.flatten()
    if arr.null_count:
        raise InputError(f"column '{name}' has missing (null) entries", label)
    return arr.to_numpy(zero_copy_only=False).reshape(len(col), *shape)


def arrow_sources(path: Path, stack: ExitStack) -> list[_Source]:
    """The numeric columns of a datasets directory (or one .arrow file), each a spare source."""
    pa = _pyarrow(path)
    files = _data_files(path)
    batches: list[tuple[Any, _PageDropper]] = []
    schema = None
    for f in files:
        got = _batches(pa, f, stack)
        release = _PageDropper(f)
        for b in got:
            if schema is None:
                schema = b.schema
            elif not b.schema.equals(schema):
                raise InputError(f"has columns {b.schema.names} of other types than those of {files[0].name} "
                                 f"{schema.names}", f)
            if b.num_rows:
                batches.append((b, release))
    if schema is None or not batches:
        raise InputError("holds no rows", path)
    starts = np.cumsum([0] + [b.num_rows for b, _ in batches]).astype(np.int64)
    label = str(path)
    out = []
    for j, name in enumerate(schema.names):
        found = _row_shape(pa, _storage(batches[0][0].column(j)))
        if found is None:
            continue  # text and other columns: never arrays
        shape, leaf = found
        dtype = np.dtype(leaf.to_pandas_dtype())

        def read(a: int, b: int, j: int = j, shape: tuple[int, ...] = shape, name: str = name,
                 dtype: np.dtype = dtype) -> np.ndarray:
            dest = np.empty((b - a, *shape), dtype)
            pos, k = a, int(np.searchsorted(starts, a, side="right")) - 1
            while pos < b:
                batch, release = batches[k]
                lo, hi = pos - int(starts[k]), min(b, int(starts[k + 1])) - int(starts[k])
                rows = _rows(pa, _storage(batch.column(j)).slice(lo, hi - lo), shape, name, label, release)
                dest[pos - a:pos - a + hi - lo] = rows
                release(rows.ctypes.data, rows.nbytes)  # only pages of the mapped file, once copied
                pos, k = int(starts[k]) + hi, k + 1
            return dest

        out.append(_Source(name, (int(starts[-1]), *shape), dtype, read, label, spare=True))
    return out


ARROW = Reader("Hugging Face datasets (Arrow)", (".arrow",), arrow_sources, claims=is_dataset_dir)
