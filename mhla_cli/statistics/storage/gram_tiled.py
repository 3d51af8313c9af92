"""The canonical Gram as tiles on a Dask cluster (mhla_cli.linalg.tiled_matrix.TiledMatrix: the lower
tiles are futures on the workers), a `GramStorage` (mhla_cli.statistics.storage.gram_storage).

Nothing here gathers the Gram into one process: sums and copies are tasks on the tiles, and the
factorization runs over them (the identifiable path: mhla_cli.linalg.factorization.NoEigensolver).
What would need the whole Gram in one process (`expand`, `pairs`, an HDF5 features file) or a change
of basis that mixes the tiles (`congruence`: the tiles are accumulated in the canonical basis
already, mhla_cli.statistics.distributed.tiled_statistics) is refused with one line. The store of a tiled Gram is a
Zarr store (mhla_cli.statistics.files.zarr_store), not an HDF5 dataset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from mhla_cli.errors import InputError, Refused
from mhla_cli.io import formats
from mhla_cli.linalg.factorization import Factorization
from mhla_cli.linalg.tiled_matrix import TiledMatrix, tile_offsets
from mhla_cli.statistics.storage.gram_storage import GramStorage

__all__ = ["TiledGram"]


class TiledGram(GramStorage):
    """The Gram as the lower tiles of a TiledMatrix (`held`); tiles are never changed in place. No form of a
    features file: written as a Zarr store (zarr_store.save)."""

    @classmethod
    def holds(cls, obj: Any) -> bool:
        return isinstance(obj, TiledMatrix)

    @classmethod
    def of_array(cls, G: np.ndarray, q: int, r: int) -> TiledGram:
        """Tiles of r rows (one pair factor each), run on dask's threaded scheduler (no client)."""
        o = tile_offsets([r] * q)
        tiles = {(i, j): np.array(G[o[i]:o[i + 1], o[j]:o[j + 1]], dtype=np.float64)
                 for i in range(q) for j in range(i + 1)}
        return TiledGram(TiledMatrix(None, tiles, [r] * q))

    def _map(self, kind: str, fn: Callable[..., Any], *others: TiledGram) -> TiledGram:
        """A TiledMatrix of fn(tile, other tiles...) per tile, one task each (TiledMatrix.tilewise)."""
        m = self.held
        for o in others:
            if o.held.sizes != m.sizes:
                raise InputError(f"cannot add Grams tiled differently (tile sides {m.sizes[:1]} and "
                                 f"{o.held.sizes[:1]}, {m.nb} and {o.held.nb} tiles)")
        out = m.tilewise(kind, fn, *(o.held for o in others))
        out.tasks[kind] = len(out.tiles)
        return TiledGram(out)

    def all_finite(self) -> bool:
        m = self.held
        # one flag per tile comes back, not the tile
        return all(m.per_tile("finite", formats.all_finite))

    def copy(self) -> TiledGram:
        m = self.held
        return TiledGram(TiledMatrix(m.client, m.tiles, m.sizes, m.spill))  # tiles are immutable

    def zeros_like(self) -> TiledGram:
        return self._map("zeros", np.zeros_like)

    def add(self, other: GramStorage) -> TiledGram:
        if not isinstance(other, TiledGram):
            raise Refused("cannot add a Gram held in one process to one tiled on a cluster: accumulate both "
                          "on the cluster ({scheduler})", scheduler={})
        return self._map("add", np.add, other)

    def congruence(self, P: np.ndarray, R: np.ndarray, overwrite: bool = False) -> NoReturn:
        raise InputError("a change of basis of a Gram tiled on a cluster is not supported: its tiles are "
                         "accumulated in the canonical basis of the data")

    def expand(self) -> NoReturn:
        _refuse_gather("the Gram as one array")

    def pairs(self, q: int, r: int) -> NoReturn:
        _refuse_gather("the Gram's distinct entries")

    def factorization(self, scale: float = 1.0, n_full: int | None = None, device: str | None = None
                      ) -> Factorization:
        if device not in (None, "cpu"):
            raise Refused(f"{{device:{device}}}: a Gram tiled on a cluster is factorized on the workers", device={})
        return Factorization(None, n_full, scale, matrix=self.held)

    def written(self, transform: Callable[[GramStorage], GramStorage] | None = None) -> NoReturn:
        raise Refused("a Gram tiled on a cluster is written as a Zarr store ({tiled_store}), not to an HDF5 "
                      "features file", tiled_store={})


def _refuse_gather(what: str) -> NoReturn:
    raise InputError(f"{what} would be gathered into one process from the tiles on the cluster; the cluster "
                     "path never does (certify and fit run over the tiles)")
