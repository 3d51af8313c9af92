"""`Features`: the sufficient statistics of a dataset (sums over samples), their algebra and their file.

Every field is a sum over samples, so the statistics of disjoint parts add up (`add`, `+`, `-`).
Beside the sums on the tokens' own features (`gram`, `moments`, ...) a Features holds the same sums
on the canonical features of the whitened tokens X A (mhla_cli.statistics.basis): `basis_gram` =
sum Ht Ht^T, `basis_moments` = sum Ht y^T, `basis_token_gram` = A^T token_gram A and
`basis_last_token_gram` = A^T last_token_gram A, accumulated from the transformed tokens. The
certificate and the fit read only these (`solver_stats`), after `canonical` has made A the
whitening of the data's own token Gram (A^T G A = I, G = token_gram / token_weight_sum, the weight
totals of `Features`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

from . import basis as basis_mod
from ..io import formats
from ..linalg import symgram
from ..errors import InputError
from ..feature_map import n_features
from ..numerics import ORTHONORMAL_TOL, SINGULAR_BASIS_COND, SYMMETRY_TOL
from ..io.formats import read_normalize
from .structure import change as structure_change

# Attributes of a features file kept in `Features.extra_attrs` when it is loaded: which shard of
# the source it holds, for a partial merge the sample ranges it covers (JSON), and how featurize
# reached the whitening of the data (passes over the tokens, cond of the estimate's correction), and
# the passes spent finding the data's spans (stream.find_spans; 0: none).
EXTRA_ATTRS = ("shard", "sample_ranges", "partial", "basis_passes", "basis_correction_cond", "span_passes")
# mhla format version from which basis_gram / basis_moments are canonical (orthonormal coordinates,
# basis = the whitening of the file's own token Gram); version 2 stored upper-triangle coordinates.
CANONICAL_FORMAT = 3
# mhla format version from which features files hold the weight totals (attributes weight_sum =
# sum w and token_weight_sum = sum w n: Lambda~ and G carry no units of the weights).
WEIGHTS_FORMAT = 5
WEIGHT_ATTRS = ("weight_sum", "token_weight_sum")
# mhla format version from which a features file may hold the canonical Gram as its distinct entries
# only (`featurize --compact`: 'basis_gram_pairs', K of mhla_cli.linalg.symgram, and no 'gram' nor
# 'basis_gram'; both are derived on load). Files of this version without it are as before.
PAIRS_FORMAT = 5
# The dataset of a compact features file (`Features.save(compact=True)`).
PAIRS_DATASET = formats.PAIRS_DATASET


@dataclass
class Features:
    """Sufficient statistics of a dataset (sums over samples, float64).

    gram = sum_i H_i H_i^T (psi, psi); moments = sum_i H_i y_i^T (psi, d); target_gram =
    sum_i y_i y_i^T; token_gram = sum over samples of w S (for last-token data without weights: the
    sum of x x^T over all tokens); last_token_gram = sum_i w_i x_n x_n^T. The basis_* sums are the
    same on the canonical features of X A (module docstring).
    """

    d: int
    n_samples: int
    n_tokens: int
    gram: np.ndarray | None
    token_gram: np.ndarray
    last_token_gram: np.ndarray
    moments: np.ndarray | None = None
    target_gram: np.ndarray | None = None
    token_dtype: str = "float64"
    sample_range: tuple[int, int] | None = None
    source: dict[str, Any] | None = None
    extra_attrs: dict[str, Any] = field(default_factory=dict)
    # The basis A (tokens X A) and the sums of the canonical features there. None: only the own
    # sums are known (format version 1, per-fold sums); `ensure_basis` then takes A = I.
    basis: np.ndarray | None = None
    basis_gram: np.ndarray | None = None
    basis_moments: np.ndarray | None = None
    basis_token_gram: np.ndarray | None = None
    basis_last_token_gram: np.ndarray | None = None
    # Causal mode: every weighted prefix X[:t] was a sample (docs/formats.md, "per-position data").
    per_position: bool = False
    # "none", or "length": S divided by the number of tokens of the prefix / sequence.
    normalize: str = "none"
    # Sequences read (the unit of sample ranges and shards); None when unknown (older files).
    n_sequences: int | None = None
    # The data's spans (mhla_cli.statistics.structure), when featurize accumulated only the block on them:
    # orthonormal bases (q, a) of span{s_i} and (d, b) of span{x_n,i} in the canonical coordinates of
    # `basis`; basis_gram (a b, a b) and basis_moments (a b, d) are then the sums of the block
    # features (E^T s) (x) (F^T x_n), and gram / moments stay None until `expand`.
    span_pairs: np.ndarray | None = None
    span_last: np.ndarray | None = None
    # Factorizations of the canonical Lambda~ by domain (mhla_cli.linalg.factorization, solve.factorize);
    # emptied whenever the basis sums change.
    factor_cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # sum_i w_i y_i (d,) over the samples (with weight_sum below, the scored data's mean, for R^2:
    # mhla_cli.model.scores); None when unknown (files written before it was accumulated)
    target_sum: np.ndarray | None = None
    # The weight totals (docs/formats.md, "Weights"): weight_sum = sum_i w_i over the samples and
    # token_weight_sum = sum_i w_i n_i (n_i the sample's token count; for per-position data every
    # prefix is a sample), so that G = token_gram / token_weight_sum and Lambda~ = basis_gram /
    # weight_sum carry no units of the weights. None (the default): the counts n_samples and
    # n_tokens, i.e. unweighted last-token data (`__post_init__`).
    weight_sum: float | None = None
    token_weight_sum: float | None = None

    def __post_init__(self) -> None:
        self.weight_sum = float(self.n_samples if self.weight_sum is None else self.weight_sum)
        self.token_weight_sum = float(self.n_tokens if self.token_weight_sum is None else self.token_weight_sum)

    # The sums on the tokens' own features (docs/formats.md), and those in the basis.
    SUMS = ("gram", "moments", "target_gram", "token_gram", "last_token_gram")
    BASIS_SUMS = ("basis_gram", "basis_moments", "basis_token_gram", "basis_last_token_gram")

    @property
    def n_features(self) -> int:
        return n_features(self.d)

    def __repr__(self) -> str:  # the shapes and counts, not the psi x psi sums
        return (f"Features(d={self.d}, n_features={self.n_features}, n_samples={self.n_samples}, "
                f"n_tokens={self.n_tokens}, per_position={self.per_position}, normalize={self.normalize!r}, "
                f"targets={self.moments is not None or self.basis_moments is not None})")

    @property
    def has_targets(self) -> bool:
        return self.target_gram is not None

    @property
    def reduced(self) -> bool:
        """Only the block on the data's spans is held (featurize --spans)."""
        return self.span_pairs is not None

    @property
    def _gram_raw(self) -> Any:
        """`gram` as held: an array, None (not derived yet), _DERIVED or a StoredGram (read when used)."""
        return self.__dict__.get("_gram")

    @property
    def lambda_d(self) -> np.ndarray:
        """Lambda_D = gram / sum w on the tokens' own features (the certificate uses `solver_stats`)."""
        self.expand()
        return self.gram / (self.weight if self.weight > 0 else 1.0)

    def expand(self) -> Features:
        """In place: the full psi x psi sums from the block on the data's spans (exact: the sums are
        zero outside it), and the own-coordinate ones; for consumers that need every feature."""
        if self.reduced:
            from ..linalg.memory import check_memory

            check_memory(self.d)
            E, F = self.span_pairs, self.span_last
            self.basis_gram = basis_mod.kron_congruence(E, F, self.basis_gram)
            if self.basis_moments is not None:
                self.basis_moments = basis_mod.kron_apply(E, F, self.basis_moments)
            self.span_pairs = self.span_last = None
            self.factor_cache.clear()
        return self.finalize()

    # ---------------------------------------------------------------- the basis
    def ensure_basis(self) -> Features:
        """Give statistics known only on the own features the basis A = I (canonical coordinates)."""
        if self.basis is None:
            eye = np.eye(self.d)
            self.basis = eye
            self.basis_gram = basis_mod.gram_to_basis(eye, self.gram)
            self.basis_moments = None if self.moments is None else basis_mod.features_to_basis(eye, self.moments)
            self.basis_token_gram = self.token_gram.copy()
            self.basis_last_token_gram = self.last_token_gram.copy()
        return self

    def change_basis(self, C: np.ndarray) -> Features:
        """In place: the basis sums of X A -> of X A C (exact up to rounding; the own sums stay)."""
        self.ensure_basis()
        self.factor_cache.clear()
        if self.reduced:
            # s -> P_C s, x -> C^T x map span E to P_C E = U1 R1 and F to C^T F = U2 R2 (QR): the block
            # coordinates change by R1 (x) R2 (mhla_cli.statistics.structure)
            U1, U2, R1, R2 = structure_change(self.span_pairs, self.span_last, basis_mod.orth_pair_map(C), C.T)
            self.basis_gram = basis_mod.kron_congruence(R1, R2, self.basis_gram)
            if self.basis_moments is not None:
                self.basis_moments = basis_mod.kron_apply(R1, R2, self.basis_moments)
            self.span_pairs, self.span_last = U1, U2
        else:
            # in place: a Features owns its sums (`copy` makes new ones)
            self.basis_gram, self.basis_moments = basis_mod.change_by(C, self.basis_gram, self.basis_moments,
                                                                      overwrite=_writeable(self.basis_gram))
        self.basis_token_gram = C.T @ self.basis_token_gram @ C
        self.basis_last_token_gram = C.T @ self.basis_last_token_gram @ C
        self.basis = self.basis @ C
        return self

    def to_basis(self, A: np.ndarray) -> Features:
        """In place: the basis sums in basis A."""
        self.ensure_basis()
        if not basis_mod.same(self.basis, A):
            self.change_basis(basis_mod.transition(self.basis, A))
            self.basis = np.array(A, dtype=np.float64)
        return self

    @property
    def weight(self) -> float:
        """sum_i w_i over the samples: the normaliser of Lambda~ and of the mean squared error."""
        return float(self.weight_sum)  # type: ignore[arg-type]

    @property
    def token_weight(self) -> float:
        """sum_i w_i n_i: the normaliser of the token Gram, G = token_gram / token_weight."""
        return float(self.token_weight_sum)  # type: ignore[arg-type]

    def correction(self) -> tuple[np.ndarray | None, float]:
        """(C, cond C) that makes the basis the whitening of the data (None: it already is)."""
        self.ensure_basis()
        return basis_mod.correction(self.basis_token_gram, self.token_weight)

    def canonical(self) -> Features:
        """In place: the basis becomes the whitening of this data's token Gram (A^T G A = I); returns self."""
        C, _ = self.correction()
        if C is not None:
            self.change_basis(C)
        return self

    def solver_stats(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(A, gram_b, moments_b): the canonical basis and the sums of the canonical features there."""
        self.canonical()
        return self.basis, self.basis_gram, self.basis_moments  # type: ignore[return-value]

    def finalize(self) -> Features:
        """Derive `moments` (tokens' own coordinates) from the basis sums, if not yet done; `gram` is
        derived from them when first used (a psi x psi matrix that certify and fit never need);
        not for a block on the data's spans (`expand` does)."""
        if self._gram_raw is None and not self.reduced:
            if self.basis_moments is not None:
                with np.errstate(over="ignore", invalid="ignore"):
                    self.moments = basis_mod.features_from_basis(self.basis, self.basis_moments)
            self.gram = _DERIVED
            check_overflow(self, "the data", None)
        return self

    def _derive_gram(self) -> np.ndarray:
        """The own-coordinate gram from the basis sums (M_A^-1 gram_b M_A^-T; `finalize`)."""
        with np.errstate(over="ignore", invalid="ignore"):
            gram = basis_mod.gram_from_basis(self.basis, self.basis_gram)
        if not formats.all_finite(gram):
            raise InputError("the statistics of the data overflow float64 (tokens or targets too large); "
                             "rescale the data")
        return gram

    def datasets(self, compact: bool = False) -> dict[str, np.ndarray | None]:
        """The datasets of a features file (docs/formats.md). `compact`: the canonical Gram as its
        distinct entries only (PAIRS_DATASET), without 'gram' and 'basis_gram'."""
        self.finalize()
        self.canonical()
        data = {"gram": None if compact else self.gram, "moments": self.moments, "target_gram": self.target_gram,
                "token_gram": self.token_gram, "last_token_gram": self.last_token_gram}
        data.update(basis=self.basis, **{k: getattr(self, k) for k in self.BASIS_SUMS})
        if compact:
            data["basis_gram"] = None
            data[PAIRS_DATASET] = symgram.pairs_from_gram(self.basis_gram, *self.factor_sizes())
        data.update(span_pairs=self.span_pairs, span_last=self.span_last)  # None (not written) unless reduced
        data["target_sum"] = self.target_sum  # None (not written) when unknown
        return data

    # ---------------------------------------------------------------- algebra
    def add(self, other: Features) -> Features:
        """self += other (counts and every sum), in place; returns self."""
        add_into(self, other)
        return self

    def __sub__(self, part: Features) -> Features:
        """Statistics of the samples in `self` but not in `part` (every sum subtracts)."""
        self.expand()
        part.expand()
        out = Features(d=self.d, n_samples=self.n_samples - part.n_samples, n_tokens=self.n_tokens - part.n_tokens,
                       token_dtype=self.token_dtype, normalize=self.normalize, per_position=self.per_position,
                       weight_sum=self.weight - part.weight, token_weight_sum=self.token_weight - part.token_weight,
                       **{k: None if getattr(self, k) is None else getattr(self, k) - getattr(part, k)
                          for k in self.SUMS})
        if self.target_sum is not None and part.target_sum is not None:
            out.target_sum = self.target_sum - part.target_sum
        if self.basis is not None and part.basis is not None:
            other = part.copy().to_basis(self.basis)
            out.basis = self.basis
            for k in self.BASIS_SUMS:
                a, b = getattr(self, k), getattr(other, k)
                setattr(out, k, None if a is None else a - b)
        return out

    def __add__(self, other: Features) -> Features:
        total = Features.zeros(self.d, self.has_targets,
                               self.token_dtype if self.token_dtype == other.token_dtype else "float64")
        total.normalize, total.per_position = self.normalize, self.per_position
        total.n_sequences = 0 if self.n_sequences is not None and other.n_sequences is not None else None
        add_into(total, self)
        add_into(total, other)
        if self.sample_range and other.sample_range:
            total.sample_range = (min(self.sample_range[0], other.sample_range[0]),
                                  max(self.sample_range[1], other.sample_range[1]))
        total.source = self.source
        return total

    def copy(self) -> Features:
        """A deep copy of the sums (metadata shared)."""
        arrays = {k: None if getattr(self, k) is None else np.array(getattr(self, k))
                  for k in (*self.SUMS, "basis", *self.BASIS_SUMS, "span_pairs", "span_last") if k != "gram"}
        raw = self._gram_raw
        arrays["gram"] = np.array(raw) if isinstance(raw, np.ndarray) else raw  # a lazy gram stays lazy
        return Features(d=self.d, n_samples=self.n_samples, n_tokens=self.n_tokens, token_dtype=self.token_dtype,
                        sample_range=self.sample_range, source=self.source, extra_attrs=dict(self.extra_attrs),
                        per_position=self.per_position, normalize=self.normalize, n_sequences=self.n_sequences,
                        target_sum=None if self.target_sum is None else np.array(self.target_sum),
                        weight_sum=self.weight_sum,
                        token_weight_sum=self.token_weight_sum, **arrays)

    @classmethod
    def zeros(cls, d: int, has_targets: bool, token_dtype: str = "float64") -> Features:
        psi = n_features(d)
        return cls(d=d, n_samples=0, n_tokens=0, gram=np.zeros((psi, psi)),
                   token_gram=np.zeros((d, d)), last_token_gram=np.zeros((d, d)),
                   moments=np.zeros((psi, d)) if has_targets else None,
                   target_gram=np.zeros((d, d)) if has_targets else None, token_dtype=token_dtype,
                   target_sum=np.zeros(d) if has_targets else None)

    # ---------------------------------------------------------------- persistence
    def save(self, path: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = (),
             extra: dict[str, np.ndarray] | None = None, extra_attrs: dict[str, Any] | None = None,
             compact: bool = False) -> None:
        """Write a features file atomically (`extra` datasets and attributes beside, e.g. per-fold sums);
        `compact`: the Gram as its distinct entries only (`datasets`)."""
        formats.write_file(path, "features", {**self.datasets(compact), **(extra or {})},
                           {**self.file_attrs(), **(extra_attrs or {})}, inputs)

    def factor_sizes(self) -> tuple[int, int]:
        """(q, r): the lengths of the pair factor and of the token factor of the basis features
        (d(d+1)/2 and d; the spans' widths for a block), for mhla_cli.linalg.symgram."""
        if self.reduced:
            return int(self.span_pairs.shape[1]), int(self.span_last.shape[1])
        return n_features(self.d) // self.d, self.d

    def file_attrs(self) -> dict[str, Any]:
        """The attributes of a features file (docs/formats.md)."""
        attrs: dict[str, Any] = {"d": self.d, "n_samples": self.n_samples, "n_tokens": self.n_tokens,
                                 "n_features": self.n_features, "token_dtype": self.token_dtype,
                                 "weight_sum": self.weight, "token_weight_sum": self.token_weight}
        if self.sample_range is not None:
            attrs["sample_lo"], attrs["sample_hi"] = self.sample_range
        if self.source is not None:
            attrs["source"] = json.dumps(self.source)
        attrs["normalize"] = self.normalize
        attrs["per_position"] = int(self.per_position)
        if self.n_sequences is not None:
            attrs["n_sequences"] = int(self.n_sequences)
        attrs.update(self.extra_attrs)
        return attrs

    @classmethod
    def load(cls, path: str | os.PathLike) -> Features:
        """Read and validate a features file."""
        with formats.open_input(path) as f:
            formats.expect_kind(f, path, "features")
            d = formats.read_attr_int(f, "d", path)
            n = formats.read_attr_int(f, "n_samples", path)
            t = formats.read_attr_int(f, "n_tokens", path)
            psi = n_features(d)
            reduced = "span_pairs" in f or "span_last" in f  # only the block on the data's spans
            # a compact file: the own gram is derived from the basis sums when used (`finalize`)
            gram = None if reduced else _DERIVED if PAIRS_DATASET in f else _stored_gram(f, path, d, psi)
            tg = formats.read_array(f, "token_gram", path).astype(np.float64)
            lg = formats.read_array(f, "last_token_gram", path).astype(np.float64)
            for name, arr in (("token_gram", tg), ("last_token_gram", lg)):
                if arr.shape != (d, d):
                    raise InputError(f"'{name}' has shape {arr.shape}, expected ({d}, {d})", path)
            moments = target_gram = None
            if "moments" in f and not reduced:
                moments = formats.read_array(f, "moments", path).astype(np.float64, copy=False)
                if moments.shape != (psi, d):
                    raise InputError(f"'moments' has shape {moments.shape}, expected ({psi}, {d})", path)
            has_targets = "basis_moments" in f if reduced else moments is not None
            if has_targets:
                if "target_gram" not in f:
                    raise InputError("has moments but no 'target_gram'", path)
                target_gram = formats.read_array(f, "target_gram", path).astype(np.float64)
                if target_gram.shape != (d, d):
                    raise InputError(f"'target_gram' has shape {target_gram.shape}, expected ({d}, {d})", path)
            if n < 1:
                raise InputError(f"n_samples = {n}: no samples", path)
            rng = None
            if "sample_lo" in f.attrs and "sample_hi" in f.attrs:
                rng = (int(f.attrs["sample_lo"]), int(f.attrs["sample_hi"]))
            source = json.loads(f.attrs["source"]) if "source" in f.attrs else None
            sums = _load_basis(f, path, d, has_targets, tg, lg) if not reduced else _load_block(f, path, d, has_targets)
            dtype = f.attrs.get("token_dtype", "float64")
            dtype = dtype.decode() if isinstance(dtype, bytes) else str(dtype)
            normalize = read_normalize(f, path)
            per_position = bool(int(f.attrs.get("per_position", 0)))
            n_seq = int(f.attrs["n_sequences"]) if "n_sequences" in f.attrs else None
            t_sum = _load_target_sum(f, path, d) if has_targets else None
            weights = _load_weights(f, path, n, t, per_position, n_seq)
            extra = {}
            for k in EXTRA_ATTRS:
                if k in f.attrs:
                    v = f.attrs[k]
                    extra[k] = v.decode() if isinstance(v, bytes) else (v.item() if hasattr(v, "item") else v)
        return cls(d=d, n_samples=n, n_tokens=t, gram=gram, token_gram=tg, last_token_gram=lg,
                   moments=moments, target_gram=target_gram, token_dtype=dtype, sample_range=rng,
                   source=source, extra_attrs=extra, per_position=per_position, normalize=normalize,
                   n_sequences=n_seq, target_sum=t_sum, weight_sum=weights[0],
                   token_weight_sum=weights[1], **sums)


def _load_target_sum(f: h5py.File, path: str | os.PathLike, d: int) -> np.ndarray | None:
    """target_sum (d,), validated; None in files without it."""
    if "target_sum" not in f:
        return None
    s = formats.read_array(f, "target_sum", path).astype(np.float64)
    if s.shape != (d,):
        raise InputError(f"'target_sum' has shape {s.shape}, expected ({d},)", path)
    if not np.isfinite(s).all():
        raise InputError("'target_sum' contains NaN or Inf; the file is corrupted", path)
    return s


def _load_weights(f: h5py.File, path: str | os.PathLike, n: int, t: int, per_position: bool,
                  n_seq: int | None) -> tuple[float, float]:
    """(weight_sum, token_weight_sum) of a features file (format >= WEIGHTS_FORMAT), or of an older one
    converted: unweighted last-token data have the counts; the others are refused (their totals
    cannot be told from the file)."""
    version = int(f.attrs.get("mhla_format_version", 2))
    have = [k for k in WEIGHT_ATTRS if k in f.attrs]
    if version < WEIGHTS_FORMAT and not have:
        if per_position or (n_seq is not None and n_seq != n):
            what = "per-position" if per_position else "weighted"
            raise InputError(f"holds {what} statistics of format version {version}, before the weight totals "
                             f"(version {WEIGHTS_FORMAT}); run `mhla featurize` on its tokens file again", path)
        return float(n), float(t)
    if len(have) < len(WEIGHT_ATTRS):
        missing = [k for k in WEIGHT_ATTRS if k not in have]
        raise InputError(f"has no attribute {', '.join(repr(k) for k in missing)}; the file is incomplete", path)
    out = []
    for k in WEIGHT_ATTRS:
        v = f.attrs[k]
        try:
            x = float(np.asarray(v).reshape(()))
        except (TypeError, ValueError):
            raise InputError(f"attribute '{k}' = {v!r} is not a number", path) from None
        if not np.isfinite(x) or x <= 0:
            raise InputError(f"attribute '{k}' = {x!r}, expected a finite number > 0", path)
        out.append(x)
    return out[0], out[1]


def _load_basis(f: h5py.File, path: str | os.PathLike, d: int, has_targets: bool, tg: np.ndarray,
                lg: np.ndarray) -> dict[str, np.ndarray | None]:
    """The basis and its canonical sums; {} for version-1 files (`ensure_basis` derives them).

    Version-2 files stored basis_gram / basis_moments in upper-triangle coordinates and no basis token
    Grams: they are converted here (D gram D, D moments; A^T G A).
    """
    names = [k for k in ("basis", *Features.BASIS_SUMS) if k in f]
    if not names:
        return {}
    version = int(f.attrs.get("mhla_format_version", 2))
    if PAIRS_DATASET in f:
        names.append(PAIRS_DATASET)
    need = ["basis", PAIRS_DATASET if PAIRS_DATASET in f else "basis_gram"] + (["basis_moments"] if has_targets else [])
    if version >= CANONICAL_FORMAT:
        need += ["basis_token_gram", "basis_last_token_gram"]
    missing = [k for k in need if k not in f]
    if missing:
        raise InputError(f"has {', '.join(names)} but no {', '.join(missing)}; the file is incomplete", path)
    psi = n_features(d)
    A = formats.read_array(f, "basis", path).astype(np.float64)
    if A.shape != (d, d):
        raise InputError(f"'basis' has shape {A.shape}, expected ({d}, {d})", path)
    if not np.isfinite(A).all() or basis_mod.row_scaled_cond(A) > SINGULAR_BASIS_COND:
        raise InputError("'basis' is singular; the file is corrupted", path)
    if PAIRS_DATASET in f:
        gb = _read_pairs(f, path, psi // d, d)
    else:
        gb = formats.read_matrix(f, "basis_gram", path)  # read in place: the one psi x psi array of a load
        if gb.shape != (psi, psi):
            raise InputError(f"'basis_gram' has shape {gb.shape}, expected ({psi}, {psi})", path)
        if not _is_symmetric(gb):
            raise InputError("'basis_gram' is not symmetric; the file is corrupted", path)
    mb = None
    if has_targets:
        mb = formats.read_array(f, "basis_moments", path).astype(np.float64)
        if mb.shape != (psi, d):
            raise InputError(f"'basis_moments' has shape {mb.shape}, expected ({psi}, {d})", path)
    if version < CANONICAL_FORMAT:
        D = basis_mod.feature_scale(d)
        gb *= D[:, None]
        gb *= D[None, :]
        mb = None if mb is None else mb * D[:, None]
        btg, blg = A.T @ tg @ A, A.T @ lg @ A
    else:
        btg = formats.read_array(f, "basis_token_gram", path).astype(np.float64)
        blg = formats.read_array(f, "basis_last_token_gram", path).astype(np.float64)
        for name, arr in (("basis_token_gram", btg), ("basis_last_token_gram", blg)):
            if arr.shape != (d, d) or not np.isfinite(arr).all():
                raise InputError(f"'{name}' has shape {arr.shape} or non-finite values, expected finite ({d}, {d})",
                                 path)
    return {"basis": A, "basis_gram": gb, "basis_moments": mb, "basis_token_gram": btg,
            "basis_last_token_gram": blg}


def _load_block(f: h5py.File, path: str | os.PathLike, d: int, has_targets: bool) -> dict[str, np.ndarray | None]:
    """The basis, the data's spans and the block sums of a file featurized on the spans (format >= 4)."""
    compact = PAIRS_DATASET in f
    need = ["basis", "span_pairs", "span_last", "basis_token_gram", "basis_last_token_gram"]
    need += ["basis_moments"] if has_targets else []
    missing = [k for k in [*need, PAIRS_DATASET if compact else "basis_gram"] if k not in f]
    if missing:
        raise InputError(f"holds the block on the data's spans but no {', '.join(missing)}; the file is "
                         "incomplete", path)
    q = d * (d + 1) // 2
    out: dict[str, np.ndarray | None] = {k: formats.read_array(f, k, path).astype(np.float64) for k in need}
    if compact:
        E, F = out["span_pairs"], out["span_last"]
        if E.ndim == 2 and F.ndim == 2:
            out["basis_gram"] = _read_pairs(f, path, E.shape[1], F.shape[1])
    else:
        out["basis_gram"] = formats.read_array(f, "basis_gram", path).astype(np.float64)
    out.setdefault("basis_moments", None)
    A, E, F = out["basis"], out["span_pairs"], out["span_last"]
    if A.shape != (d, d) or not np.isfinite(A).all() or basis_mod.row_scaled_cond(A) > SINGULAR_BASIS_COND:
        raise InputError(f"'basis' has shape {A.shape} or is singular, expected an invertible ({d}, {d})", path)
    for name, M, rows in (("span_pairs", E, q), ("span_last", F, d)):
        if M.ndim != 2 or M.shape[0] != rows or M.shape[1] > rows or not np.isfinite(M).all() \
                or np.abs(M.T @ M - np.eye(M.shape[1])).max() > ORTHONORMAL_TOL:
            raise InputError(f"'{name}' must have orthonormal columns of length {rows}, got shape {M.shape}", path)
    n = E.shape[1] * F.shape[1]
    gb = out["basis_gram"]
    if gb.shape != (n, n) or not np.isfinite(gb).all() or not _is_symmetric(gb):
        raise InputError(f"'basis_gram' must be a finite symmetric ({n}, {n}) block, got shape {gb.shape}", path)
    mb = out["basis_moments"]
    if mb is not None and mb.shape != (n, d):
        raise InputError(f"'basis_moments' has shape {mb.shape}, expected ({n}, {d})", path)
    for name in ("basis_token_gram", "basis_last_token_gram"):
        if out[name].shape != (d, d) or not np.isfinite(out[name]).all():
            raise InputError(f"'{name}' has shape {out[name].shape} or non-finite values, expected finite ({d}, {d})",
                             path)
    return out


def _read_pairs(f: h5py.File, path: str | os.PathLike, q: int, r: int) -> np.ndarray:
    """The canonical Gram (q r, q r) of a compact file, from its distinct entries (PAIRS_DATASET:
    (q(q+1)/2, r(r+1)/2), mhla_cli.linalg.symgram), validated: format version, no 'basis_gram' beside it,
    shape, finite values."""
    version = int(f.attrs.get("mhla_format_version", 2))
    if version < PAIRS_FORMAT:
        raise InputError(f"has '{PAIRS_DATASET}' but format version {version}: the compact form exists from "
                         f"version {PAIRS_FORMAT} on; the file is corrupted", path)
    if "basis_gram" in f:
        raise InputError(f"has both 'basis_gram' and '{PAIRS_DATASET}'; the file is corrupted", path)
    K = formats.read_matrix(f, PAIRS_DATASET, path)
    if K.shape != symgram.pairs_shape(q, r):
        raise InputError(f"'{PAIRS_DATASET}' has shape {K.shape}, expected {symgram.pairs_shape(q, r)} (the "
                         f"distinct entries of a ({q * r}, {q * r}) Gram)", path)
    if not formats.all_finite(K):
        raise InputError(f"'{PAIRS_DATASET}' contains NaN or Inf; the file is corrupted", path)
    return symgram.gram_from_pairs(K, q, r)


def _is_symmetric(a: np.ndarray, tile: int = 512) -> bool:
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


def _writeable(a: np.ndarray | None) -> bool:
    """An array the basis change may overwrite (float64, writeable, square)."""
    return (a is not None and a.dtype == np.float64 and a.flags.writeable and a.ndim == 2
            and a.shape[0] == a.shape[1])


class _Derived:
    """`Features.gram` to be derived from the basis sums when first used (`Features.finalize`)."""

    def __repr__(self) -> str:
        return "<gram derived from the basis sums when used>"

    def __reduce__(self) -> str:
        return "_DERIVED"  # unpickled as the module's one instance (`_get_gram` tests identity)


_DERIVED = _Derived()


class StoredGram:
    """The 'gram' dataset of a features file: validated when the file was loaded (tile by tile),
    read when first used (certify and fit never need it)."""

    def __init__(self, path: str | os.PathLike, psi: int) -> None:
        self.path = str(path)
        self.abspath = os.path.abspath(path)
        self.psi = psi
        self.stamp = _stamp(self.abspath)

    def __repr__(self) -> str:
        return f"<gram stored in {self.path}>"

    def read(self) -> np.ndarray:
        if _stamp(self.abspath) != self.stamp:
            raise InputError("changed since its statistics were loaded (its 'gram' is read when first "
                             "used); run the command again", self.path)
        with formats.open_input(self.abspath) as f:
            gram = formats.read_matrix(f, "gram", self.path)
        if gram.shape != (self.psi, self.psi):
            raise InputError(f"'gram' has shape {gram.shape}, expected ({self.psi}, {self.psi})", self.path)
        return gram


def _stamp(path: str) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def _stored_gram(f: h5py.File, path: str | os.PathLike, d: int, psi: int) -> StoredGram:
    """Validate the stored own gram without holding it (shape, finite, symmetric); read when used."""
    ds = formats.dataset(f, "gram", path)
    if ds.shape != (psi, psi):
        formats.read_array(f, "gram", path)  # its NaN / Inf are reported first, as they always were
        raise InputError(f"'gram' has shape {ds.shape}, expected (psi, psi) = ({psi}, {psi}) for d = {d}", path)
    formats.check_stored_symmetric(f, "gram", path)
    return StoredGram(path, psi)


def _get_gram(self: Features) -> np.ndarray | None:
    g = self.__dict__.get("_gram")
    if isinstance(g, StoredGram):
        g = self.__dict__["_gram"] = g.read()
    elif g is _DERIVED:
        g = self.__dict__["_gram"] = self._derive_gram()
    return g


def _set_gram(self: Features, value: Any) -> None:
    self.__dict__["_gram"] = value


# The dataclass field `gram` is a property: derived from the basis sums or read from the file when
# first used (`finalize`, `load`), so that certify and fit hold one psi x psi array of statistics.
Features.gram = property(_get_gram, _set_gram, doc="sum_i H_i H_i^T on the tokens' own features (psi, psi)")  # type: ignore[assignment]


def check_overflow(feats: Features, what: str, path: str | os.PathLike | None) -> None:
    """Refuse statistics that overflowed float64."""
    raw = feats._gram_raw  # a gram not derived or read yet is checked when it is
    arrays = [raw if isinstance(raw, np.ndarray) else None, feats.moments, feats.basis_gram, feats.basis_moments,
              feats.target_gram]
    if not all(a is None or formats.all_finite(a) for a in arrays):
        raise InputError(f"the statistics of {what} overflow float64 (tokens or targets too large); "
                         "rescale the data", path)


def add_into(acc: Features, part: Features) -> None:
    """acc += part (counts and every sum), in place.

    Parts in the same basis add exactly. Otherwise both are changed into the whitening of their sum
    (each change is well conditioned: a part's basis suits its own data, and the sum's whitening
    shrinks or grows a part's directions by at most the inverse of its share of the tokens); an
    empty acc (Features.zeros) adopts the part's basis.
    """
    if part.d != acc.d:
        raise InputError(f"cannot add statistics of d = {acc.d} and d = {part.d}")
    if part.has_targets != acc.has_targets:
        raise InputError("cannot add statistics with and without targets")
    if part.normalize != acc.normalize:
        raise InputError(f"cannot add statistics with different normalisations ({acc.normalize} and "
                         f"{part.normalize}): featurize every part with the same normalisation")
    if part.per_position != acc.per_position:
        raise InputError("cannot add per-position (causal) statistics to last-token statistics")
    acc.n_sequences = None if acc.n_sequences is None or part.n_sequences is None \
        else acc.n_sequences + part.n_sequences
    acc.factor_cache.clear()
    if acc.reduced or part.reduced:
        if part.reduced and acc.basis is None and acc.n_samples == 0 and acc.n_tokens == 0:
            # an empty sum (Features.zeros) adopts the part's spans, as it adopts its basis below
            acc.span_pairs, acc.span_last = np.array(part.span_pairs), np.array(part.span_last)
            acc.gram = acc.moments = None
            acc.basis = np.array(part.basis)
            for k in Features.BASIS_SUMS:
                v = getattr(part, k)
                setattr(acc, k, None if v is None else np.zeros_like(v))
        same = (acc.reduced and part.reduced and basis_mod.same(acc.basis, part.basis)
                and np.array_equal(acc.span_pairs, part.span_pairs) and np.array_equal(acc.span_last, part.span_last))
        if not same:  # different spans: add the full sums (the union of the spans)
            acc.expand()
            if part.reduced:
                part = part.copy().expand()
    raw = acc._gram_raw
    empty = acc.n_samples == 0 and acc.n_tokens == 0 and (not isinstance(raw, np.ndarray) or not raw.any())
    if acc.basis is None and part.basis is None:
        pass  # own sums only
    elif empty and acc.basis is None:
        acc.basis = np.array(part.basis)
        for k in Features.BASIS_SUMS:
            v = getattr(part, k)
            setattr(acc, k, None if v is None else np.zeros_like(v))
    else:
        acc.ensure_basis()
        if part.basis is None:
            part = part.copy().ensure_basis()
        if not basis_mod.same(acc.basis, part.basis):
            part = part.copy()
            # the token Gram of the sum in acc's basis (X A_acc = X A_part Cp), then its whitening A_acc C
            Cp = basis_mod.transition(part.basis, acc.basis)
            G = acc.basis_token_gram + Cp.T @ part.basis_token_gram @ Cp
            C = basis_mod.whitening(G, acc.token_weight + part.token_weight, round32=False)
            acc.change_basis(C)
            part.to_basis(acc.basis)
    if acc.basis is not None:
        for k in Features.BASIS_SUMS:
            a = getattr(acc, k)
            if a is not None:
                a += getattr(part, k)
    acc.n_samples += part.n_samples
    acc.n_tokens += part.n_tokens
    acc.weight_sum = acc.weight + part.weight
    acc.token_weight_sum = acc.token_weight + part.token_weight
    known = (np.ndarray, StoredGram)
    ga, gp = acc._gram_raw, part._gram_raw
    if isinstance(ga, known) and isinstance(gp, known):
        acc.gram += part.gram  # both known (a stored one is read): the own sums add
        if acc.moments is not None and part.moments is not None:
            acc.moments += part.moments
    else:  # derived from the basis sums by finalize()
        acc.gram = acc.moments = None
        if ga is not None and gp is not None:  # both were finalized (one lazily): so is the sum
            acc.finalize()
    acc.token_gram += part.token_gram
    acc.last_token_gram += part.last_token_gram
    if acc.target_gram is not None:
        acc.target_gram += part.target_gram
    if acc.target_sum is not None and part.target_sum is not None:
        acc.target_sum = acc.target_sum + part.target_sum
    else:
        acc.target_sum = None
