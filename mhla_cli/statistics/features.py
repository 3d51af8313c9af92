"""`Features`: the record of the sufficient statistics of a dataset (sums over samples).

Every field is a sum over samples, so the statistics of disjoint parts add up (`add`, `+`, `-`).
Beside the sums on the tokens' own features (`gram`, `moments`, ...) a Features holds the same sums
on the canonical features of the whitened tokens X A (mhla_cli.statistics.basis): `basis_gram` =
sum Ht Ht^T, `basis_moments` = sum Ht y^T, `basis_token_gram` = A^T token_gram A and
`basis_last_token_gram` = A^T last_token_gram A, accumulated from the transformed tokens. The
certificate and the fit read only these (`solver_stats`), after `canonical` has made A the
whitening of the data's own token Gram (A^T G A = I, G = token_gram / token_weight_sum, the weight
totals of `Features`).

The record holds its fields, counts and the own `gram` (held, read from the file or derived from the
basis sums when first used); where `basis_gram` lives (an array, its distinct entries, tiles on a
cluster) is its storage's business (`gram_storage`, mhla_cli.statistics.storage.gram_storage); its algebra (`add`, `+`, `-`, the change of basis) is
mhla_cli.statistics.algebra and its file (`save`, `load`) mhla_cli.statistics.files.features_file, both
mixed into the class.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from mhla_cli.statistics import basis as basis_mod
from mhla_cli.io import formats
from mhla_cli.errors import InputError
from mhla_cli.feature_map import n_features
from mhla_cli.samples import LAST, ReadSpec, Samples
from mhla_cli.statistics.files import features_file
from mhla_cli.statistics.storage import gram_storage
from mhla_cli.statistics.storage.gram_storage import GramStorage
from mhla_cli.statistics.affine_sums import AffineSums
from mhla_cli.statistics.algebra import FeaturesAlgebra
from mhla_cli.statistics.files.features_file import DERIVED, FeaturesFile, StoredGram


class _OwnGram:
    """The field `Features.gram` = sum_i H_i H_i^T on the tokens' own features (psi, psi): held, or
    derived from the basis sums (`finalize`) or read from the file (`load`) when first used, so that
    certify and fit hold one psi x psi array of statistics. Stored as `_gram` (`Features._gram_raw`)."""

    def __get__(self, obj: Features | None, owner: type | None = None) -> np.ndarray | None:
        if obj is None:  # no class-level value: the dataclass field has no default
            raise AttributeError("gram")
        g = obj.__dict__.get("_gram")
        if isinstance(g, StoredGram):
            g = obj.__dict__["_gram"] = g.read()
        elif g is DERIVED:
            g = obj.__dict__["_gram"] = obj._derive_gram()
        return g

    def __set__(self, obj: Features, value: Any) -> None:
        obj.__dict__["_gram"] = value


class _BasisGram:
    """The field `Features.basis_gram` = sum_i Ht_i Ht_i^T (psi, psi; the block on the data's spans when
    reduced), held by a Gram storage (mhla_cli.statistics.storage.gram_storage: an array, its distinct entries,
    tiles on a cluster; `Features.gram_storage`). Read, it is the array: a storage held in another form
    is expanded when first read, and kept so. Set, the value (an array, a symgram.Pairs, a storage, ...)
    is wrapped in its storage. The algebra and the file ask the storage (`gram_storage`)."""

    def __get__(self, obj: Features | None, owner: type | None = None) -> np.ndarray | None:
        if obj is None:  # the dataclass default
            return None
        storage: gram_storage.GramStorage | None = obj.__dict__.get("_basis_gram")
        if storage is None:
            return None
        g = storage.expand()
        if g is not storage.held:  # held in another form: expanded once, and kept
            obj.__dict__["_basis_gram"] = gram_storage.wrap(g)
        return g

    def __set__(self, obj: Features, value: Any) -> None:
        obj.__dict__["_basis_gram"] = gram_storage.wrap(value)


@dataclass
class Features(FeaturesAlgebra, FeaturesFile):
    """Sufficient statistics of a dataset (sums over samples, float64).

    gram = sum_i H_i H_i^T (psi, psi); moments = sum_i H_i y_i^T (psi, d); target_gram =
    sum_i y_i y_i^T; token_gram = sum over samples of w S (for last-token data without weights: the
    sum of x x^T over all tokens); last_token_gram = sum_i w_i x_n x_n^T. The basis_* sums are the
    same on the canonical features of X A (module docstring): `basis` A, the whitening of the data's own
    tokens; `basis_gram`, `basis_moments`, `basis_token_gram`, `basis_last_token_gram` (docs/formats.md).

    `a + b` and `a.add(b)` sum two records (parts in other bases are changed into the whitening of their
    sum: mhla_cli.statistics.algebra); `save` writes a features file (format version 6; `compact=True`: the
    Gram as its distinct entries; `form=`: a registered storage's form) and `load` reads versions 1-6 (mhla_cli.statistics.files.features_file);
    `on_spans`: only the block on the data's spans is held (`span_pairs`, `span_last`, no `gram` /
    `moments`), which `expand()` turns into every feature. `mhla_cli.Features` is this class.
    """

    d: int
    n_samples: int
    n_tokens: int
    if TYPE_CHECKING:  # for mypy, the descriptor: read, an array or None; set, any form it holds
        gram: _OwnGram = _OwnGram()
    else:  # not a default: a required field, read or derived when used (_OwnGram.__get__(None) raises)
        gram: np.ndarray | None = _OwnGram()
    # mypy takes gram's descriptor for a default, which the dataclass does not (_OwnGram.__get__)
    token_gram: np.ndarray  # type: ignore[misc]
    last_token_gram: np.ndarray  # type: ignore[misc]
    moments: np.ndarray | None = None
    target_gram: np.ndarray | None = None
    token_dtype: str = "float64"
    sample_range: tuple[int, int] | None = None
    source: dict[str, Any] | None = None
    extra_attrs: dict[str, Any] = field(default_factory=dict)
    # The basis A (tokens X A) and the sums of the canonical features there. None: only the own
    # sums are known (format version 1, per-fold sums); `ensure_basis` then takes A = I.
    basis: np.ndarray | None = None
    # default None; held by a Gram storage (`gram_storage`: an array, its distinct entries, tiles)
    if TYPE_CHECKING:  # for mypy, the descriptor: read, an array or None; set, any form a storage wraps
        basis_gram: _BasisGram = _BasisGram()
    else:
        basis_gram: np.ndarray | None = _BasisGram()
    basis_moments: np.ndarray | None = None
    basis_token_gram: np.ndarray | None = None
    basis_last_token_gram: np.ndarray | None = None
    # How the tokens were read (mhla_cli.samples.ReadSpec), one sub-record: what a sample was (`samples`:
    # LAST, CAUSAL (every weighted prefix X[:t]) or BIDIRECTIONAL (every weighted position, S of the whole
    # window); docs/tokens.md, "Per-position data"), the normalisation of S (`normalize`: "none", or
    # "length": S divided by the number of tokens of the prefix / sequence) and the bias terms
    # (`bias_terms`, docs/bias_terms.md: the statistics are those of the tokens (x, 1) and the targets
    # (y, 0), so that `d` counts the constant coordinate and the last target is the padded 0).
    read: ReadSpec = ReadSpec(LAST)
    # Sequences read (the unit of sample ranges and shards); None when unknown (older files).
    n_sequences: int | None = None
    # The data's spans (mhla_cli.statistics.structure), when featurize accumulated only the block on them:
    # orthonormal bases (q, a) of span{s_i} and (d, b) of span{x_n,i} in the canonical coordinates of
    # `basis`; basis_gram (a b, a b) and basis_moments (a b, d) are then the sums of the block
    # features (E^T s) (x) (F^T x_n), and gram / moments stay None until `expand`.
    span_pairs: np.ndarray | None = None
    span_last: np.ndarray | None = None
    # Factorizations of the canonical Lambda~ by domain (mhla_cli.linalg.factorization, solve.domains.factorize);
    # emptied whenever the basis sums change.
    factor_cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # sum_i w_i y_i (d,) over the samples (with weight_sum below, the scored data's mean, for R^2:
    # mhla_cli.model.scores); None when unknown (files written before it was accumulated)
    target_sum: np.ndarray | None = None
    # The weight totals (docs/formats_features.md): weight_sum = sum_i w_i over the samples and
    # token_weight_sum = sum_i w_i n_i (n_i the sample's token count; for per-position data every
    # prefix is a sample), so that G = token_gram / token_weight_sum and Lambda~ = basis_gram /
    # weight_sum carry no units of the weights. None (the default): the counts n_samples and
    # n_tokens, i.e. unweighted last-token data (`__post_init__`).
    weight_sum: float | None = None
    token_weight_sum: float | None = None
    # The token-wise affine block of the wide tokens (mhla_cli.statistics.affine_sums: `featurize --affine-from`),
    # its cross sums' rows in the coordinates of basis_moments; None without it.
    affine: AffineSums | None = None

    def __post_init__(self) -> None:
        self.weight_sum = float(self.n_samples if self.weight_sum is None else self.weight_sum)
        self.token_weight_sum = float(self.n_tokens if self.token_weight_sum is None else self.token_weight_sum)

    # The sums on the tokens' own features (docs/formats_features.md), and those in the basis.
    SUMS = features_file.SUMS
    BASIS_SUMS = features_file.BASIS_SUMS

    @property
    def n_features(self) -> int:
        return n_features(self.d)

    @property
    def per_position(self) -> bool:
        """The samples were positions (CAUSAL or BIDIRECTIONAL), not sequences."""
        return self.samples.per_position

    @property
    def samples(self) -> Samples:
        """What a sample was (mhla_cli.samples), of `read`."""
        return self.read.layout  # type: ignore[return-value]  # a record's layout is always a Samples

    @samples.setter
    def samples(self, value: Samples) -> None:
        self.read = replace(self.read, layout=value)

    @property
    def normalize(self) -> str:
        """The normalisation of S, of `read`."""
        return self.read.normalize  # type: ignore[return-value]  # a record's normalisation is always known

    @normalize.setter
    def normalize(self, value: str) -> None:
        self.read = replace(self.read, normalize=value)

    @property
    def bias_terms(self) -> bool:
        """The statistics are those of the tokens (x, 1) (the bias terms), of `read`."""
        return self.read.bias_terms

    @bias_terms.setter
    def bias_terms(self, value: bool) -> None:
        self.read = replace(self.read, bias_terms=value)

    def __repr__(self) -> str:  # the shapes and counts, not the psi x psi sums
        return (f"Features(d={self.d}, n_features={self.n_features}, n_samples={self.n_samples}, "
                f"n_tokens={self.n_tokens}, samples={self.samples.name!r}, normalize={self.normalize!r}, "
                + ("bias_terms=True, " if self.bias_terms else "")
                + (f"affine_width={self.affine.width}, " if self.affine is not None else "") +
                f"targets={self.moments is not None or self.basis_moments is not None})")

    @property
    def has_targets(self) -> bool:
        return self.target_gram is not None

    @property
    def d_out(self) -> int:
        """The width D_out of the targets the moments hold (any width; d without targets), the padded 0
        of the bias terms included."""
        return self.d if self.target_gram is None else int(self.target_gram.shape[0])

    @property
    def n_outputs(self) -> int:
        """The targets' own width: D_out, or D_out - 1 with the bias terms (the padded 0 is not an output)."""
        return self.d_out - int(self.bias_terms)

    @property
    def on_spans(self) -> bool:
        """Only the block on the data's spans is held (featurize --spans)."""
        return self.span_pairs is not None

    @property
    def _gram_raw(self) -> Any:
        """`gram` as held: an array, None (not derived yet), DERIVED or a StoredGram (read when used)."""
        return self.__dict__.get("_gram")

    @property
    def gram_storage(self) -> GramStorage | None:
        """Where `basis_gram` lives (mhla_cli.statistics.storage.gram_storage), or None."""
        return self.__dict__.get("_basis_gram")

    @property
    def basis_gram_held(self) -> Any:
        """`basis_gram` as held by its storage: an array, its distinct entries (symgram.Pairs, not
        expanded), the tiles on a cluster, or None."""
        storage = self.gram_storage
        return None if storage is None else storage.held

    def expand_held(self) -> Self:
        """Expand a basis Gram held in another form than an array now rather than when first read (so
        that a command times it with the load); returns self."""
        self.basis_gram  # noqa: B018  (the descriptor expands and keeps it)
        return self

    @property
    def lambda_d(self) -> np.ndarray:
        """Lambda_D = gram / sum w on the tokens' own features (the certificate uses `solver_stats`)."""
        gram = self.expand().gram
        assert gram is not None, "expand derives the own gram"
        return gram / (self.weight if self.weight > 0 else 1.0)

    @property
    def weight(self) -> float:
        """sum_i w_i over the samples: the normaliser of Lambda~ and of the mean squared error."""
        return float(self.weight_sum)  # type: ignore[arg-type]

    @property
    def token_weight(self) -> float:
        """sum_i w_i n_i: the normaliser of the token Gram, G = token_gram / token_weight."""
        return float(self.token_weight_sum)  # type: ignore[arg-type]

    def finalize(self) -> Self:
        """Derive `moments` (tokens' own coordinates) from the basis sums, if not yet done; `gram` is
        derived from them when first used (a psi x psi matrix that certify and fit never need);
        not for a block on the data's spans (`expand` does)."""
        if self._gram_raw is None and not self.on_spans:
            if self.basis_moments is not None:
                assert self.basis is not None, "basis sums come with their basis"
                with np.errstate(over="ignore", invalid="ignore"):
                    self.moments = basis_mod.features_from_basis(self.basis, self.basis_moments)
            self.gram = DERIVED
            check_overflow(self, "the data", None)
        return self

    def _derive_gram(self) -> np.ndarray:
        """The own-coordinate gram from the basis sums (M_A^-1 gram_b M_A^-T; `finalize`), through the
        storage (on the two factors when the basis Gram is held as its distinct entries)."""
        return self.own_storage().expand()

    def own_storage(self) -> GramStorage:
        """The own-coordinate gram in the form the basis Gram is held in (the congruence by M_A^-1)."""
        storage, A = self.gram_storage, self.basis
        assert storage is not None and A is not None, "a gram derived from the basis sums has them"
        return gram_storage.own_of(storage, A)

    def copy(self) -> Self:
        """A deep copy of the sums (metadata shared): `dataclasses.replace` with the arrays copied (a field
        added later is carried as it is), the basis Gram in the form it is held in, a lazy own gram lazy."""
        arrays: dict[str, Any] = {k: None if getattr(self, k) is None else np.array(getattr(self, k))
                  for k in (*self.SUMS, "basis", *self.BASIS_SUMS, "span_pairs", "span_last", "target_sum")
                  if k not in ("gram", "basis_gram")}
        storage = self.gram_storage
        raw = self._gram_raw
        return replace(self, **arrays, basis_gram=None if storage is None else storage.copy(),
                       gram=np.array(raw) if isinstance(raw, np.ndarray) else raw,
                       extra_attrs=dict(self.extra_attrs), factor_cache={},
                       affine=None if self.affine is None else self.affine.copy())

    def with_sums(self, **fields: Any) -> Self:
        """A record of the same data description as this one (d, `read`, counts, weight totals, token dtype,
        sequences read) holding other sums: `fields` (sums and any other field), every sum, the basis, the
        spans, the affine block and the provenance not given left out (None or empty)."""
        cleared: dict[str, Any] = {k: None for k in (*self.SUMS, "basis", *self.BASIS_SUMS, "span_pairs",
                                                      "span_last", "target_sum", "affine", "sample_range", "source")}
        cleared.update(extra_attrs={}, factor_cache={})
        return replace(self, **{**cleared, **fields})

    @classmethod
    def zeros(cls, d: int, has_targets: bool, token_dtype: str = "float64", d_out: int | None = None) -> Self:
        psi, e = n_features(d), d if d_out is None else int(d_out)  # e: the targets' width D_out
        return cls(d=d, n_samples=0, n_tokens=0, gram=np.zeros((psi, psi)),
                   token_gram=np.zeros((d, d)), last_token_gram=np.zeros((d, d)),
                   moments=np.zeros((psi, e)) if has_targets else None,
                   target_gram=np.zeros((e, e)) if has_targets else None, token_dtype=token_dtype,
                   target_sum=np.zeros(e) if has_targets else None)


def check_overflow(feats: Features, what: str, path: str | os.PathLike | None) -> None:
    """Refuse statistics that overflowed float64."""
    raw = feats._gram_raw  # a gram not derived or read yet is checked when it is
    storage = feats.gram_storage
    arrays = [raw if isinstance(raw, np.ndarray) else None, feats.moments, feats.basis_moments, feats.target_gram]
    if not all(a is None or formats.all_finite(a) for a in arrays) or not (storage is None or storage.all_finite()):
        raise InputError(f"the statistics of {what} overflow float64 (tokens, targets or weights too large; "
                         "weights carry no units: any common factor gives the same fit); "
                         "rescale the data", path)
