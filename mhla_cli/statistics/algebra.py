"""The algebra of `Features`: sums that add and subtract, and the change of basis of their canonical part.

Every field of a Features is a sum over samples, so the statistics of disjoint parts add up
(`add_into`, `a.add(b)`, `a + b`, `a - b`). The canonical sums live in a basis A (tokens X A,
mhla_cli.statistics.basis); `change_basis` moves them to X A C exactly (up to rounding), `canonical`
to the whitening of the data's own token Gram, and parts in different bases are added in the
whitening of their sum. A block on the data's spans (`on_spans`) changes by the spans' R factors and
is `expand`ed when the spans of two parts differ. `FeaturesAlgebra` is mixed into
mhla_cli.statistics.features.Features (which imports this module, so it cannot import Features back): its
methods return `Self`, the functions here take `FeaturesAlgebra`, and the record's fields are declared for the
type checker by its base, mhla_cli.statistics.record_fields.FeaturesFields.
"""

from __future__ import annotations

from typing import Any, Self

import numpy as np

from mhla_cli.statistics import basis as basis_mod
from mhla_cli.errors import InputError, Refused
from mhla_cli.linalg.memory import check_memory
from mhla_cli.statistics.files.features_file import BASIS_SUMS, StoredGram
from mhla_cli.statistics.record_fields import FeaturesFields
from mhla_cli.statistics.structure import change as structure_change

# The basis sums other than basis_gram (held by its storage, mhla_cli.statistics.storage.gram_storage: `_add_basis_gram`).
_OTHER_BASIS_SUMS = tuple(k for k in BASIS_SUMS if k != "basis_gram")


class FeaturesAlgebra(FeaturesFields):
    """The algebra of a `Features` record (mixed into it): the basis, sums and differences."""

    def expand(self) -> Self:
        """In place: the full psi x psi sums from the block on the data's spans (exact: the sums are
        zero outside it), and the own-coordinate ones; for consumers that need every feature."""
        if self.on_spans:
            check_memory(self.d)
            E, F, storage = self.span_pairs, self.span_last, self.gram_storage
            assert E is not None and F is not None and storage is not None, "a block holds its spans and Gram"
            self.basis_gram = storage.congruence(E, F, overwrite=True)
            _map_rows(self, lambda m: basis_mod.kron_apply(E, F, m))
            self.span_pairs = self.span_last = None
            self.factor_cache.clear()
        return self.finalize()

    def ensure_basis(self) -> Self:
        """Give statistics known only on the own features the basis A = I (canonical coordinates)."""
        if self.basis is None:
            eye = np.eye(self.d)
            self.basis = eye
            gram = self.gram
            assert gram is not None, "statistics without a basis hold their own gram"
            self.basis_gram = basis_mod.gram_to_basis(eye, gram)
            self.basis_moments = None if self.moments is None else basis_mod.features_to_basis(eye, self.moments)
            self.basis_token_gram = self.token_gram.copy()
            self.basis_last_token_gram = self.last_token_gram.copy()
        return self

    def change_basis(self, C: np.ndarray) -> Self:
        """In place: the basis sums of X A -> of X A C (exact up to rounding; the own sums stay)."""
        self.ensure_basis()
        self.factor_cache.clear()
        if self.on_spans:
            # s -> P_C s, x -> C^T x map span E to P_C E = U1 R1 and F to C^T F = U2 R2 (QR): the block
            # coordinates change by R1 (x) R2 (mhla_cli.statistics.structure)
            E, F, storage = self.span_pairs, self.span_last, self.gram_storage
            assert E is not None and F is not None and storage is not None, "a block holds its spans and Gram"
            U1, U2, R1, R2 = structure_change(E, F, basis_mod.orth_pair_map(C), C.T)
            self.basis_gram = storage.congruence(R1, R2, overwrite=True)
            _map_rows(self, lambda m: basis_mod.kron_apply(R1, R2, m))
            self.span_pairs, self.span_last = U1, U2
        else:
            # through the Gram's storage, in place where it may be (a Features owns its sums: `copy` makes new ones)
            P, R = basis_mod.orth_pair_map(C), C.T
            if self.gram_storage is not None:
                self.basis_gram = self.gram_storage.congruence(P, R, overwrite=True)
            _map_rows(self, lambda m: basis_mod.kron_apply(P, R, m))
        self.basis_token_gram = C.T @ self.basis_token_gram @ C
        self.basis_last_token_gram = C.T @ self.basis_last_token_gram @ C
        self.basis = self.basis @ C
        return self

    def to_basis(self, A: np.ndarray) -> Self:
        """In place: the basis sums in basis A."""
        own = self.ensure_basis().basis
        assert own is not None, "ensure_basis gives the record a basis"
        if not basis_mod.same(own, A):
            self.change_basis(basis_mod.transition(own, A))
            self.basis = np.array(A, dtype=np.float64)
        return self


    def correction(self) -> tuple[np.ndarray | None, float]:
        """(C, cond C) that makes the basis the whitening of the data (None: it already is)."""
        G = self.ensure_basis().basis_token_gram
        assert G is not None, "ensure_basis gives the record its basis token Gram"
        return basis_mod.correction(G, self.token_weight)

    def canonical(self) -> Self:
        """In place: the basis becomes the whitening of this data's token Gram (A^T G A = I); returns self."""
        C, _ = self.correction()
        if C is not None:
            self.change_basis(C)
        return self

    def solver_stats(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(A, gram_b, moments_b): the canonical basis and the sums of the canonical features there."""
        self.canonical()
        return self.basis, self.basis_gram, self.basis_moments  # type: ignore[return-value]

    def add(self, other: FeaturesAlgebra) -> Self:
        """self += other (counts and every sum), in place; returns self."""
        add_into(self, other)
        return self

    def __sub__(self, part: FeaturesAlgebra) -> Self:
        """Statistics of the samples in `self` but not in `part` (every sum subtracts)."""
        self.expand()
        part.expand()
        out = self.with_sums(n_samples=self.n_samples - part.n_samples, n_tokens=self.n_tokens - part.n_tokens,
                             n_sequences=None, weight_sum=self.weight - part.weight,
                             token_weight_sum=self.token_weight - part.token_weight,
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
            if self.affine is not None:
                self.affine.check_addable(other.affine)
                assert other.affine is not None, "check_addable refuses a part without the affine block"
                out.affine = self.affine.copy()
                out.affine.add(other.affine, -1.0)
        return out

    def __add__(self, other: FeaturesAlgebra) -> Self:
        total = type(self).zeros(self.d, self.has_targets,
                                 self.token_dtype if self.token_dtype == other.token_dtype else "float64",
                                 d_out=_out_width(self))  # add_into refuses another width
        total.read = self.read
        total.n_sequences = 0 if self.n_sequences is not None and other.n_sequences is not None else None
        add_into(total, self)
        add_into(total, other)
        if self.sample_range and other.sample_range:
            total.sample_range = (min(self.sample_range[0], other.sample_range[0]),
                                  max(self.sample_range[1], other.sample_range[1]))
        total.source = self.source
        return total


def _out_width(feats: Any) -> int:
    """The targets' width D_out of statistics (`Features.d_out`; the mixin's self is a Features)."""
    return int(feats.d_out)


def add_into(acc: FeaturesAlgebra, part: FeaturesAlgebra) -> None:
    """acc += part (counts and every sum), in place.

    Parts in the same basis add exactly. Otherwise both are changed into the whitening of their sum
    (each change is well conditioned: a part's basis suits its own data, and the sum's whitening
    shrinks or grows a part's directions by at most the inverse of its share of the tokens); an
    empty acc (Features.zeros) adopts the part's basis.
    """
    _check_addable(acc, part)
    n_sequences = None if acc.n_sequences is None or part.n_sequences is None \
        else acc.n_sequences + part.n_sequences
    if is_empty(part):  # a part whose weights are all 0: zero sums, nothing to add in any basis
        acc.n_sequences = n_sequences
        return
    if is_empty(acc) and acc.basis is not None:  # an empty part first: the sum is the other part's
        keep = {k: getattr(acc, k) for k in ("sample_range", "source", "extra_attrs", "token_dtype")}
        acc.__dict__.update(part.copy().__dict__)
        acc.__dict__.update(keep)
        acc.factor_cache.clear()
        acc.n_sequences = n_sequences
        return
    acc.n_sequences = n_sequences
    acc.factor_cache.clear()
    if acc.on_spans or part.on_spans:
        part = _common_spans(acc, part)
    part = _common_basis(acc, part)
    if acc.basis is not None:
        _add_basis_gram(acc, part)
        for k in _OTHER_BASIS_SUMS:
            a = getattr(acc, k)
            if a is not None:
                a += getattr(part, k)
        if acc.affine is not None:
            assert part.affine is not None, "_check_addable refuses a part without the affine block"
            acc.affine.add(part.affine)
    acc.n_samples += part.n_samples
    acc.n_tokens += part.n_tokens
    acc.weight_sum = acc.weight + part.weight
    acc.token_weight_sum = acc.token_weight + part.token_weight
    _add_own_sums(acc, part)


def is_empty(feats: FeaturesAlgebra) -> bool:
    """Statistics of no sample (a shard, fold or chunk whose weights are all 0): their sums are all 0."""
    return feats.n_samples == 0 and feats.n_tokens == 0 and feats.weight == 0 and feats.token_weight == 0


def _add_basis_gram(acc: FeaturesAlgebra, part: FeaturesAlgebra) -> None:
    """acc.basis_gram += part.basis_gram (same basis and block), through the Gram's storage (as distinct
    entries when both are held so, else as arrays; tile by tile on a cluster)."""
    if acc.gram_storage is not None:
        assert part.gram_storage is not None, "a part in the same basis holds its basis Gram too"
        acc.basis_gram = acc.gram_storage.add(part.gram_storage)


def _map_rows(feats: FeaturesAlgebra, fn: Any) -> None:
    """In place: the rows of the sums on the MHLA's features (basis_moments, and the affine block's cross sums,
    mhla_cli.statistics.affine_sums) through `fn`, the map of their coordinates."""
    if feats.basis_moments is not None:
        feats.basis_moments = fn(feats.basis_moments)
    if feats.affine is not None:
        feats.affine.map_rows(fn)


def _check_addable(acc: FeaturesAlgebra, part: FeaturesAlgebra) -> None:
    """Refuse to add statistics of different data shapes, targets, normalisations or modes."""
    if part.bias_terms != acc.bias_terms:
        with_, without = ("the part", "the sum") if part.bias_terms else ("the sum", "the part")
        raise Refused(f"cannot add statistics with and without the bias terms ({with_} has them, {without} "
                      "not): featurize every part with the same {bias_terms_opt}", bias_terms_opt={})
    if part.d != acc.d:
        raise InputError(f"cannot add statistics of d = {acc.d} and d = {part.d}")
    if part.has_targets != acc.has_targets:
        raise InputError("cannot add statistics with and without targets")
    if part.d_out != acc.d_out:
        raise InputError(f"cannot add statistics of targets {acc.d_out} and {part.d_out} wide")
    if part.normalize != acc.normalize:
        raise InputError(f"cannot add statistics with different normalisations ({acc.normalize} and "
                         f"{part.normalize}): featurize every part with the same normalisation")
    empty = acc.n_samples == 0 and acc.n_tokens == 0 and acc.basis is None
    if (part.affine is None) != (acc.affine is None) and not (empty and acc.affine is None):
        raise Refused("cannot add statistics with and without the affine block ({affine_from}): featurize every "
                      "part with the same {affine_from}", affine_from={})
    if part.affine is not None and acc.affine is not None:
        acc.affine.check_addable(part.affine)
    if part.samples != acc.samples:
        raise Refused(f"cannot add statistics of {part.samples.name} samples to statistics of {acc.samples.name} "
                      "samples: featurize every part with {attention} (and per-position targets or not)",
                      attention={})


def _adopt_basis(acc: FeaturesAlgebra, part: FeaturesAlgebra) -> None:
    """An empty acc takes the part's basis, with zero basis sums of the part's shapes."""
    acc.basis = np.array(part.basis)
    acc.affine = None if part.affine is None else part.affine.zeros_like()
    held = part.gram_storage
    acc.basis_gram = None if held is None else held.zeros_like()
    for k in _OTHER_BASIS_SUMS:
        v = getattr(part, k)
        setattr(acc, k, None if v is None else np.zeros_like(v))


def _common_spans(acc: FeaturesAlgebra, part: FeaturesAlgebra) -> FeaturesAlgebra:
    """Blocks on the data's spans (one or both reduced): the same spans add block by block; otherwise
    acc is expanded, and the part returned expanded (a copy), so that the full sums add."""
    if part.on_spans and acc.basis is None and acc.n_samples == 0 and acc.n_tokens == 0:
        # an empty sum (Features.zeros) adopts the part's spans, as it adopts its basis (_common_basis)
        acc.span_pairs, acc.span_last = np.array(part.span_pairs), np.array(part.span_last)
        acc.gram = acc.moments = None
        _adopt_basis(acc, part)
    same = (acc.on_spans and part.on_spans and basis_mod.same(acc.basis, part.basis)
            and _equal(acc.span_pairs, part.span_pairs) and _equal(acc.span_last, part.span_last))
    if not same:  # different spans: add the full sums (the union of the spans)
        acc.expand()
        if part.on_spans:
            part = part.copy().expand()
    return part


def _equal(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Both held and equal (the spans of two blocks)."""
    return a is not None and b is not None and np.array_equal(a, b)


def _common_basis(acc: FeaturesAlgebra, part: FeaturesAlgebra) -> FeaturesAlgebra:
    """Bring acc and the part to one basis (acc's, or the whitening of their sum); the part returned
    (a copy when it had to change)."""
    raw = acc._gram_raw
    empty = acc.n_samples == 0 and acc.n_tokens == 0 and (not isinstance(raw, np.ndarray) or not raw.any())
    if acc.basis is None and part.basis is None:
        pass  # own sums only
    elif empty and acc.basis is None:
        _adopt_basis(acc, part)
    else:
        acc.ensure_basis()
        if part.basis is None:
            part = part.copy().ensure_basis()
        if not basis_mod.same(acc.basis, part.basis):
            part = part.copy()
            # the token Gram of the sum in acc's basis (X A_acc = X A_part Cp), then its whitening A_acc C
            assert acc.basis is not None and part.basis is not None, "ensure_basis gives both a basis"
            Cp = basis_mod.transition(part.basis, acc.basis)
            G = acc.basis_token_gram + Cp.T @ part.basis_token_gram @ Cp
            C = basis_mod.whitening(G, acc.token_weight + part.token_weight, round32=False)
            acc.change_basis(C)
            part.to_basis(acc.basis)
    return part


def _add_own_sums(acc: FeaturesAlgebra, part: FeaturesAlgebra) -> None:
    """acc's sums on the tokens' own features += the part's (a gram derived from the basis sums is
    derived again for the sum, when both were finalized)."""
    known = (np.ndarray, StoredGram)
    ga, gp = acc._gram_raw, part._gram_raw
    if isinstance(ga, known) and isinstance(gp, known):
        own_a, own_p = acc.gram, part.gram  # both known (a stored one is read and kept): the own sums add
        assert own_a is not None and own_p is not None, "a known gram reads as an array"
        own_a += own_p
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
