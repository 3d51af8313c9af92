"""The registry of input formats: one `Reader` per format, in the order they are tried.

A new input format is a module that defines a `Reader` (`_source.Reader`) and one line here.
"""

from __future__ import annotations

from pathlib import Path

from ._arrow import ARROW
from ._hdf5 import HDF5
from ._numpy import NPY, NPZ
from ._safetensors import SAFETENSORS
from ._source import Reader
from ._torch import TORCH

READERS: tuple[Reader, ...] = (NPY, NPZ, SAFETENSORS, TORCH, HDF5, ARROW)

# The file suffixes some reader reads (lower case).
SUFFIXES = tuple(s for r in READERS for s in r.suffixes)


def known(last: str = "and") -> str:
    """The formats read, for messages: '.npy, .npz, .safetensors and .pt'."""
    names = [r.suffixes[0] for r in READERS]
    return f"{', '.join(names[:-1])} {last} {names[-1]}"


def reader_for(path: Path) -> Reader | None:
    """The reader of an existing input: the first that claims it by its content, else by its suffix."""
    for r in READERS:
        if r.claims is not None and r.claims(path):
            return r
    if path.is_dir():
        return None
    suffix = path.suffix.lower()
    return next((r for r in READERS if suffix in r.suffixes), None)
