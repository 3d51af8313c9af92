"""HDF5 activations: the datasets of an HDF5 file that is not already a tokens file (say, padded
hidden states beside an attention mask, as a capture script writes them with h5py), named by their
paths with dots ('acts/hidden' is 'acts.hidden') and read in slices through h5py."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import h5py

from ._roles import NAMES
from ._source import Reader, _rows_of, _Source
from .. import formats
from ...errors import InputError


def is_hdf5(p: Path) -> bool:
    """An HDF5 file, whatever its suffix."""
    try:
        return p.is_file() and h5py.is_hdf5(p)
    except OSError:
        return False


def hdf5_sources(path: Path, stack: ExitStack) -> list[_Source]:
    """The datasets of an HDF5 file, refusing a file that mhla reads as it is."""
    f = stack.enter_context(formats.open_input(path))
    kind = f.attrs.get("mhla_kind")
    if kind is not None:
        raise InputError(f"is already an mhla {kind} file: mhla reads it as it is", path)
    if "tokens" in f and all(n in NAMES and isinstance(f[n], h5py.Dataset) for n in f):
        raise InputError("is already a tokens file: mhla reads it as it is", path)
    out: list[_Source] = []

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset) and obj.ndim >= 1:
            out.append(_Source(name.replace("/", "."), tuple(int(s) for s in obj.shape), obj.dtype,
                               _rows_of(obj), str(path)))

    f.visititems(visit)
    return out


HDF5 = Reader("HDF5", formats.HDF5_SUFFIXES, hdf5_sources, claims=is_hdf5)
