"""The canonical Gram as its distinct entries: K (q(q+1)/2, r(r+1)/2) of a Gram of rows s (x) x
(mhla_cli.linalg.symgram.Pairs; about a quarter of the numbers), a `GramStorage`
(mhla_cli.statistics.storage.gram_storage). The 'basis_gram_pairs' dataset of a compact features file."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from mhla_cli.errors import InputError
from mhla_cli.io import formats
from mhla_cli.linalg import symgram
from mhla_cli.statistics.storage.gram_storage import GramStorage, wrap

if TYPE_CHECKING:
    import h5py

__all__ = ["PAIRS_FORMAT", "PairsGram"]

# mhla format version from which a features file may hold the canonical Gram as its distinct entries
# only (`featurize --compact`: 'basis_gram_pairs', and no 'gram' nor 'basis_gram').
PAIRS_FORMAT = 5


class PairsGram(GramStorage):
    """The Gram held as its distinct entries (`held`: a symgram.Pairs); changed on its two factors. In a
    features file: the form "compact", 'basis_gram_pairs' alone (the own 'gram' derived on load)."""

    form = "compact"
    file_datasets = (formats.PAIRS_DATASET,)

    @classmethod
    def holds(cls, obj: Any) -> bool:
        return isinstance(obj, symgram.Pairs)

    @classmethod
    def of_array(cls, G: np.ndarray, q: int, r: int) -> PairsGram:
        return PairsGram(symgram.Pairs(symgram.pairs_from_gram(np.asarray(G, dtype=np.float64), q, r), q, r))

    def all_finite(self) -> bool:
        return formats.all_finite(self.held.K)  # the Gram's entries are K's

    def copy(self) -> PairsGram:
        return PairsGram(self.held.copy())

    def zeros_like(self) -> PairsGram:
        return PairsGram(symgram.Pairs(np.zeros_like(self.held.K), self.held.q, self.held.r))

    def add(self, other: GramStorage) -> GramStorage:
        if isinstance(other, PairsGram) and (other.held.q, other.held.r) == (self.held.q, self.held.r):
            self.held.K += other.held.K
            return self
        g = self.expand()  # forms that differ add as arrays
        g += other.expand()
        out = wrap(g)
        assert out is not None, "an array is held by a storage"
        return out

    def congruence(self, P: np.ndarray, R: np.ndarray, overwrite: bool = False) -> PairsGram:
        return PairsGram(self.held.congruence(P, R, overwrite=overwrite))

    def expand(self) -> np.ndarray:
        return self.held.expand()

    def pairs(self, q: int, r: int) -> np.ndarray:
        if (q, r) != (self.held.q, self.held.r):
            raise ValueError(f"held on factors of lengths {self.held.q}, {self.held.r}, not {q}, {r}")
        return self.held.K

    def written(self, transform: Callable[[GramStorage], GramStorage] | None = None) -> formats.Deferred:
        # a block of rows at a time (never held whole)
        n = self.n
        return formats.Deferred(lambda: (self if transform is None else transform(self)).held.rows(), 8 * n * n,
                                shape=(n, n))

    @classmethod
    def file_data(cls, storage: GramStorage, q: int, r: int) -> dict[str, Any]:
        return {formats.PAIRS_DATASET: storage.pairs(q, r)}

    @classmethod
    def from_file(cls, f: h5py.File, path: str | os.PathLike, q: int, r: int, block: bool = False) -> PairsGram:
        """Validated: format version, shape, finite values."""
        name = formats.PAIRS_DATASET
        version = int(f.attrs.get("mhla_format_version", 2))
        if version < PAIRS_FORMAT:
            raise InputError(f"has '{name}' but format version {version}: the compact form exists from "
                             f"version {PAIRS_FORMAT} on; the file is corrupted", path)
        K = formats.read_matrix(f, name, path)
        if K.shape != symgram.pairs_shape(q, r):
            raise InputError(f"'{name}' has shape {K.shape}, expected {symgram.pairs_shape(q, r)} (the "
                             f"distinct entries of a ({q * r}, {q * r}) Gram)", path)
        if not formats.all_finite(K):
            raise InputError(f"'{name}' contains NaN or Inf; the file is corrupted", path)
        return PairsGram(symgram.Pairs(K, q, r))
