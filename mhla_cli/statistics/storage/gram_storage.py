"""Where the canonical Gram lives: the one interface of its storages.

The canonical Gram sum_i w_i Ht_i Ht_i^T (n x n, n = psi or the block on the data's spans) of a
`Features` record (mhla_cli.statistics.features) is held by a `GramStorage`: dense in memory
(mhla_cli.statistics.storage.gram_dense), as its distinct entries (mhla_cli.statistics.storage.gram_pairs:
symgram.Pairs, K = U^T V of the Gram's symmetry), or as tiles on a Dask cluster
(mhla_cli.statistics.storage.gram_tiled). The record, its algebra and its file ask the storage, never
its type:

- `n`, `held` (the object held), `all_finite`, `copy`, `zeros_like`;
- the algebra: `add` (the sum of two Grams of the same features) and `congruence` (the change of
  basis kron(P, R) G kron(P, R)^T of rows s (x) x, acting on the two factors);
- `expand` (the n x n array, when a consumer asks for one) and `pairs` (the distinct entries);
- the factorization: `factorization` (mhla_cli.linalg.factorization.Factorization over the matrix
  the storage holds: the array, or the tiles without gathering them);
- the file: `written` (the full Gram as a features file writes it, made when written) and the
  class's `dataset` / `read` (which HDF5 dataset holds it, and reading it back validated).

A storage is one module: a subclass registered with `@register`, whose `holds` recognises the
object it wraps, so that `wrap` turns what a record is given (an array, a symgram.Pairs, a
TiledMatrix, ...) into its storage.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from mhla_cli.errors import InputError
from mhla_cli.io import formats
from mhla_cli.linalg.factorization import Factorization
from mhla_cli.statistics import basis as basis_mod

if TYPE_CHECKING:
    import h5py

__all__ = ["GramStorage", "file_storages", "own_of", "register", "storages", "wrap"]

_STORAGES: list[type[GramStorage]] = []


class GramStorage(ABC):
    """A symmetric n x n Gram of rows s (x) x (s of length q, x of length r; n = q r) and where it lives."""

    # The HDF5 dataset of a features file that holds this storage (None: not written to HDF5).
    dataset: ClassVar[str | None] = None

    def __init__(self, held: Any) -> None:
        self.held = held

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.n} x {self.n}: {self.held!r}>"

    @classmethod
    @abstractmethod
    def holds(cls, obj: Any) -> bool:
        """Whether `obj` is what this storage wraps."""

    @property
    def n(self) -> int:
        """The Gram's side."""
        return int(self.held.shape[0])

    @abstractmethod
    def all_finite(self) -> bool:
        """No NaN nor Inf among the entries."""

    @abstractmethod
    def copy(self) -> GramStorage:
        """A deep copy."""

    @abstractmethod
    def zeros_like(self) -> GramStorage:
        """A zero Gram of the same form and shape."""

    @abstractmethod
    def add(self, other: GramStorage) -> GramStorage:
        """self + other, in self's memory where the forms allow (returned: the storage of the sum)."""

    @abstractmethod
    def congruence(self, P: np.ndarray, R: np.ndarray, overwrite: bool = False) -> GramStorage:
        """kron(P, R) G kron(P, R)^T (rows s (x) x -> (P s) (x) (R x)); `overwrite`: in self's memory
        when P and R are square (the caller owns the Gram)."""

    @abstractmethod
    def expand(self) -> np.ndarray:
        """The n x n array (the held one, or one made from it)."""

    @abstractmethod
    def pairs(self, q: int, r: int) -> np.ndarray:
        """The distinct entries K (q(q+1)/2, r(r+1)/2) of the Gram (mhla_cli.linalg.symgram)."""

    def factorization(self, scale: float = 1.0, n_full: int | None = None, device: str | None = None
                      ) -> Factorization:
        """The Factorization of scale * G (every direction outside the n x n block of an n_full x n_full
        matrix an exact null direction)."""
        return Factorization(self.expand(), n_full, scale, device)

    @abstractmethod
    def written(self, transform: Callable[[GramStorage], GramStorage] | None = None
                ) -> formats.Deferred | np.ndarray:
        """The full n x n Gram (of `transform(self)`, applied when written) as a features file writes it:
        the held array itself, or a `formats.Deferred` made when written."""

    @classmethod
    def read(cls, f: h5py.File, path: str | os.PathLike, q: int, r: int, block: bool = False) -> GramStorage:
        """The storage held by `cls.dataset` of the features file `f`, validated (`block`: the block on the
        data's spans)."""
        raise NotImplementedError(f"{cls.__name__} is not read from a features file")


def register(cls: type[GramStorage]) -> type[GramStorage]:
    """Class decorator: make a storage known to `wrap` and `file_storages`."""
    if cls not in _STORAGES:
        _STORAGES.append(cls)
    return cls


def storages() -> tuple[type[GramStorage], ...]:
    """The registered storages, in the order of registration."""
    return tuple(_STORAGES)


def wrap(obj: Any) -> GramStorage | None:
    """The storage of `obj` (None for None; a storage as it is)."""
    if obj is None or isinstance(obj, GramStorage):
        return obj
    for cls in _STORAGES:
        if cls.holds(obj):
            return cls(obj)
    raise TypeError(f"no Gram storage holds a {type(obj).__name__}")


def file_storages(f: h5py.File) -> list[type[GramStorage]]:
    """The storages whose dataset the features file `f` holds (one in a valid file)."""
    return [cls for cls in _STORAGES if cls.dataset is not None and cls.dataset in f]


def own_of(storage: GramStorage, basis: np.ndarray) -> GramStorage:
    """The Gram of the tokens' own features M_A^-1 G M_A^-T from the canonical one `storage` of the basis
    A (a new storage of the same form), refused (InputError) when it overflowed float64."""
    with np.errstate(over="ignore", invalid="ignore"):
        own = storage.congruence(*basis_mod.from_basis_factors(basis))
    if not own.all_finite():
        raise InputError("the statistics of the data overflow float64 (tokens or targets too large); "
                         "rescale the data")
    return own
