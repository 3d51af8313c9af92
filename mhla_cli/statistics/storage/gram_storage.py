"""Where the canonical Gram lives: the one interface of its storages.

The canonical Gram sum_i w_i Ht_i Ht_i^T (n x n, n = psi or the block on the data's spans) of a
`Features` record (mhla_cli.statistics.features) is held by a `GramStorage`: dense in memory
(mhla_cli.statistics.storage.gram_dense), as its distinct entries (mhla_cli.statistics.storage.gram_pairs:
symgram.Pairs, K = U^T V of the Gram's symmetry), or as tiles on a Dask cluster
(mhla_cli.statistics.storage.gram_tiled). The record, its algebra and its file ask the storage, never
its type:

- `n`, `held` (the object held), `all_finite`, `copy`, `zeros_like`, and the class's `of_array` (a
  dense Gram converted into the storage's form);
- the algebra: `add` (the sum of two Grams of the same features) and `congruence` (the change of
  basis kron(P, R) G kron(P, R)^T of rows s (x) x, acting on the two factors);
- `expand` (the n x n array, when a consumer asks for one) and `pairs` (the distinct entries);
- the factorization: `factorization` (mhla_cli.linalg.factorization.Factorization over the matrix
  the storage holds: the array, or the tiles without gathering them);
- the features file (mhla_cli.statistics.files.features_file asks these, never a dataset name): the
  class's `form` (the name a file's Gram is saved in and `mhla inspect` reports), `file_datasets`
  (the datasets of that form: the file's storage is the one that claims them, `file_storage`),
  `own_gram_in_file` (whether the form also holds the own 'gram'), `file_data` (the datasets of a
  Gram of any storage written in this form), `from_file` (reading them back validated) and
  `load_bytes` (what reading them holds beside the expanded Gram); `written` is the full Gram as
  the file writes it, made when written.

A storage is one module: a subclass whose `holds` recognises the object it wraps, so that `wrap`
turns what a record is given (an array, a symgram.Pairs, a TiledMatrix, ...) into its storage.
The registry is explicit: `BUILT_IN` names the package's storages (imported when the registry is
first asked), and a storage defined elsewhere is added by one call of `register`.
"""

from __future__ import annotations

import importlib
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

__all__ = ["BUILT_IN", "GramStorage", "file_form", "file_storage", "file_storages", "own_of", "register",
           "storages", "wrap"]

# The package's storages, in the order `wrap` tries them (module of this folder, class): the registry.
BUILT_IN = (("gram_dense", "DenseGram"), ("gram_pairs", "PairsGram"), ("gram_tiled", "TiledGram"))
_STORAGES: list[type[GramStorage]] = []
_BUILT_IN_LOADED: list[bool] = [False]


class GramStorage(ABC):
    """A symmetric n x n Gram of rows s (x) x (s of length q, x of length r; n = q r) and where it lives."""

    # The name of this storage's form in a features file (`Features.save(form=...)`, `mhla inspect`'s
    # gram_form); None: not written to a features file.
    form: ClassVar[str | None] = None
    # The datasets of a features file that hold the Gram in this form (a file's storage claims them).
    file_datasets: ClassVar[tuple[str, ...]] = ()
    # Whether a file in this form also holds the own 'gram' (else derived from the basis sums on load).
    own_gram_in_file: ClassVar[bool] = False

    def __init__(self, held: Any) -> None:
        self.held = held

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.n} x {self.n}: {self.held!r}>"

    @classmethod
    @abstractmethod
    def holds(cls, obj: Any) -> bool:
        """Whether `obj` is what this storage wraps."""

    @classmethod
    @abstractmethod
    def of_array(cls, G: np.ndarray, q: int, r: int) -> GramStorage:
        """The symmetric n x n Gram `G` (n = q r) held in this storage's form (a conversion)."""

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
    def file_data(cls, storage: GramStorage, q: int, r: int) -> dict[str, Any]:
        """The datasets (`file_datasets`: arrays or `formats.Deferred`) of the Gram `storage` (of any
        storage) written in this form; (q, r) its factors' lengths."""
        raise NotImplementedError(f"{cls.__name__} is not written to a features file")

    @classmethod
    def from_file(cls, f: h5py.File, path: str | os.PathLike, q: int, r: int, block: bool = False
                  ) -> GramStorage:
        """The storage held by `file_datasets` of the features file `f`, validated (`block`: the block on
        the data's spans)."""
        raise NotImplementedError(f"{cls.__name__} is not read from a features file")

    @classmethod
    def load_bytes(cls, f: h5py.File) -> int:
        """The bytes that reading this form holds beside the expanded n x n Gram (its datasets, read and
        then expanded)."""
        return 8 * sum(int(np.prod(f[k].shape)) for k in cls.file_datasets if k in f)


def register(cls: type[GramStorage]) -> type[GramStorage]:
    """Make a storage known to `wrap` and to the features file (tried after those registered before)."""
    _load_built_in()
    if cls.form is not None and any(c.form == cls.form and c is not cls for c in _STORAGES):
        raise ValueError(f"a Gram storage of form {cls.form!r} is registered already")
    if cls not in _STORAGES:
        _STORAGES.append(cls)
    return cls


def _load_built_in() -> None:
    """Import the package's storages (`BUILT_IN`) into the registry, once."""
    if _BUILT_IN_LOADED[0]:
        return
    _BUILT_IN_LOADED[0] = True
    found = [getattr(importlib.import_module(f"{__package__}.{module}"), name) for module, name in BUILT_IN]
    _STORAGES[:0] = [c for c in found if c not in _STORAGES]


def storages() -> tuple[type[GramStorage], ...]:
    """The registered storages: the package's (`BUILT_IN`), then those registered, in that order."""
    _load_built_in()
    return tuple(_STORAGES)


def wrap(obj: Any) -> GramStorage | None:
    """The storage of `obj` (None for None; a storage as it is)."""
    if obj is None or isinstance(obj, GramStorage):
        return obj
    for cls in storages():
        if cls.holds(obj):
            return cls(obj)
    raise TypeError(f"no Gram storage holds a {type(obj).__name__}")


def file_storages(f: h5py.File) -> list[type[GramStorage]]:
    """The storages whose datasets the features file `f` holds (one in a valid file)."""
    return [cls for cls in storages() if any(k in f for k in cls.file_datasets)]


def file_storage(f: h5py.File, path: str | os.PathLike) -> type[GramStorage] | None:
    """The storage of the canonical Gram of a features file (the one claiming its datasets), None when it
    has none; a file holding two forms of it is refused."""
    found = file_storages(f)
    if len(found) > 1:
        names = sorted(repr(k) for c in found for k in c.file_datasets if k in f)
        raise InputError(f"has both {' and '.join(names)}; the file is corrupted", path)
    return found[0] if found else None


def file_form(form: str) -> type[GramStorage]:
    """The storage that writes the features-file form `form`; an InputError naming the forms otherwise."""
    forms = {c.form: c for c in storages() if c.form is not None}
    if form not in forms:
        raise InputError(f"unknown form {form!r} of the Gram in a features file; expected one of "
                         f"{', '.join(sorted(forms))}")
    return forms[form]


def own_of(storage: GramStorage, basis: np.ndarray) -> GramStorage:
    """The Gram of the tokens' own features M_A^-1 G M_A^-T from the canonical one `storage` of the basis
    A (a new storage of the same form), refused (InputError) when it overflowed float64."""
    with np.errstate(over="ignore", invalid="ignore"):
        own = storage.congruence(*basis_mod.from_basis_factors(basis))
    if not own.all_finite():
        raise InputError("the statistics of the data overflow float64 (tokens or targets too large); "
                         "rescale the data")
    return own
