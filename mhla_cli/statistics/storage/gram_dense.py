"""The canonical Gram dense in memory: one float64 n x n array (a `GramStorage`,
mhla_cli.statistics.storage.gram_storage), the 'basis_gram' dataset of a features file."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from mhla_cli.errors import InputError
from mhla_cli.io import formats
from mhla_cli.linalg import symgram
from mhla_cli.numerics import SYMMETRY_TOL
from mhla_cli.statistics import basis as basis_mod
from mhla_cli.statistics.storage.gram_storage import GramStorage

if TYPE_CHECKING:
    import h5py

__all__ = ["DenseGram", "is_symmetric"]


class DenseGram(GramStorage):
    """The Gram as an n x n array (`held`), changed in its own memory where it may be. In a features file:
    the form "full", 'basis_gram' beside the own 'gram'."""

    form = "full"
    file_datasets = ("basis_gram",)
    own_gram_in_file = True

    @classmethod
    def holds(cls, obj: Any) -> bool:
        return isinstance(obj, np.ndarray)

    @classmethod
    def of_array(cls, G: np.ndarray, q: int, r: int) -> DenseGram:
        return DenseGram(np.array(G, dtype=np.float64))

    def all_finite(self) -> bool:
        return formats.all_finite(self.held)

    def copy(self) -> DenseGram:
        return DenseGram(np.array(self.held))

    def zeros_like(self) -> DenseGram:
        return DenseGram(np.zeros_like(self.held))

    def add(self, other: GramStorage) -> GramStorage:
        self.held += other.expand()
        return self

    def congruence(self, P: np.ndarray, R: np.ndarray, overwrite: bool = False) -> DenseGram:
        return DenseGram(basis_mod.kron_congruence(P, R, self.held, overwrite=overwrite and _writeable(self.held)))

    def expand(self) -> np.ndarray:
        return self.held

    def pairs(self, q: int, r: int) -> np.ndarray:
        return symgram.pairs_from_gram(self.held, q, r)

    def written(self, transform: Callable[[GramStorage], GramStorage] | None = None) -> formats.Deferred | np.ndarray:
        if transform is None:
            return self.held
        n = self.n
        return formats.Deferred(lambda: transform(self).expand(), 8 * n * n)

    @classmethod
    def file_data(cls, storage: GramStorage, q: int, r: int) -> dict[str, Any]:
        return {"basis_gram": storage.written()}

    @classmethod
    def load_bytes(cls, f: h5py.File) -> int:
        return 0  # read as the expanded Gram itself

    @classmethod
    def from_file(cls, f: h5py.File, path: str | os.PathLike, q: int, r: int, block: bool = False) -> DenseGram:
        n = q * r
        if block:
            gb = formats.read_array(f, "basis_gram", path).astype(np.float64)
            if gb.shape != (n, n) or not np.isfinite(gb).all() or not is_symmetric(gb):
                raise InputError(f"'basis_gram' must be a finite symmetric ({n}, {n}) block, got shape {gb.shape}",
                                 path)
            return DenseGram(gb)
        gb = formats.read_matrix(f, "basis_gram", path)  # read in place: the one psi x psi array of a load
        if gb.shape != (n, n):
            raise InputError(f"'basis_gram' has shape {gb.shape}, expected ({n}, {n})", path)
        if not is_symmetric(gb):
            raise InputError("'basis_gram' is not symmetric; the file is corrupted", path)
        return DenseGram(gb)


def _writeable(a: np.ndarray) -> bool:
    """An array a congruence may overwrite (float64, writeable, square)."""
    return a.dtype == np.float64 and a.flags.writeable and a.ndim == 2 and a.shape[0] == a.shape[1]


def is_symmetric(a: np.ndarray, tile: int = 512) -> bool:
    """a == a.T up to SYMMETRY_TOL of its largest entry (checked tile by tile: no psi x psi temporaries)."""
    if not a.size:
        return True
    n = a.shape[0]
    top = diff = 0.0
    for i0 in range(0, n, tile):
        i1 = min(n, i0 + tile)
        for j0 in range(i0, n, tile):
            j1 = min(n, j0 + tile)
            upper, lower = a[i0:i1, j0:j1], a[j0:j1, i0:i1]
            top = max(top, float(np.abs(upper).max()), float(np.abs(lower).max()))
            diff = max(diff, float(np.abs(upper - lower.T).max()))
    return diff <= SYMMETRY_TOL * top

