"""The algebra of Features (mhla_cli.statistics.algebra): sums of parts in unlike bases, the change of basis.

References: plain numpy on materialised canonical features (tests/_reference.py).
"""

from __future__ import annotations

import numpy as np

from _reference import canonical, features, ratio
from conftest import relerr
from _records import ragged_data
from mhla_cli.statistics import basis
from mhla_cli.statistics.algebra import add_into
from mhla_cli.statistics.accumulate import chunk_features


def test_adding_parts_in_unlike_bases_equals_the_whole() -> None:
    """Two parts each in the whitening of its own (very different) tokens: their sum is the whole
    data's, changed into the whitening of all tokens; the reference is the concatenation."""
    X1, o1, y1 = ragged_data(1)
    X2, o2, y2 = ragged_data(2, scale=np.array([1.0, 1e-3, 30.0]))
    a, b = chunk_features(X1, o1, y1, 3), chunk_features(X2, o2, y2, 3)
    assert not basis.same(a.basis, b.basis)
    total = a + b
    X = np.concatenate([X1, X2])
    off = np.concatenate([o1, o2[1:] + o1[-1]])
    y = np.concatenate([y1, y2])
    ref = canonical(X, off, y)
    lam = total.solver_stats()[1] / total.n_samples
    assert ratio(np.linalg.eigvalsh(lam), ref["eigenvalues"]) < 1e-9
    G = total.basis.T @ (total.token_gram / total.n_tokens) @ total.basis
    assert np.abs(G - np.eye(3)).max() < 1e-9
    # the own sums add exactly, whatever the bases
    assert np.array_equal(total.token_gram, a.token_gram + b.token_gram)
    # and the difference gives the part back
    back = total - b
    assert ratio(np.linalg.eigvalsh(back.solver_stats()[1] / back.n_samples),
                 np.linalg.eigvalsh(a.solver_stats()[1] / a.n_samples)) < 1e-8
    # the inputs are not changed by the addition
    assert basis.same(a.basis, chunk_features(X1, o1, y1, 3).basis)


def test_canonical_is_idempotent_and_change_basis_is_exact() -> None:
    X, off, y = ragged_data(3, scale=np.array([1.0, 1e-2, 1.0]))
    f = chunk_features(X, off, y, 3, basis="identity")  # accumulated in the tokens' own coordinates
    assert f.correction()[0] is None  # chunk_features ends canonical
    A, gb, mb = f.solver_stats()
    gb, mb = gb.copy(), mb.copy()
    f.canonical()
    assert np.array_equal(f.basis_gram, gb) and np.array_equal(f.basis_moments, mb)
    # an exact change there and back
    C = np.linalg.qr(np.random.default_rng(0).standard_normal((3, 3)))[0] * 2.0
    g = f.copy().change_basis(C).change_basis(np.linalg.inv(C))
    assert ratio(g.basis_gram, gb) < 1e-12 and ratio(g.basis, A) < 1e-12


def test_add_into_is_the_in_place_sum() -> None:
    """add_into(acc, part) and acc.add(part) give the counts and sums of acc + part."""
    X1, o1, y1 = ragged_data(8)
    X2, o2, y2 = ragged_data(9, scale=np.array([2.0, 1.0, 1e-2]))
    a, b = chunk_features(X1, o1, y1, 3), chunk_features(X2, o2, y2, 3)
    total = a + b
    acc = a.copy()
    add_into(acc, b)
    assert (acc.n_samples, acc.n_tokens, acc.weight) == (total.n_samples, total.n_tokens, total.weight)
    assert np.array_equal(acc.token_gram, total.token_gram)
    assert ratio(acc.solver_stats()[1], total.solver_stats()[1]) < 1e-12
    assert ratio(a.copy().add(b).solver_stats()[1], total.solver_stats()[1]) < 1e-12


# ---------------------------------------------------------------- the basis Gram held as its distinct entries


def _held_and_expanded(monkeypatch, make):
    """make() run with the accumulation on K (the basis Gram held as symgram.Pairs) and on the syrk (arrays)."""
    from mhla_cli.linalg import symgram

    out = []
    for rule in (1, 10**9):
        monkeypatch.setattr(symgram, "SYMGRAM_MIN_D", rule)
        out.append(make())
    return out


def test_a_held_basis_gram_changes_and_adds_as_the_expanded_one(monkeypatch) -> None:
    """The change of basis on the two factors, the own gram derived from them, sums of parts in unlike
    bases (both held, or one held and one expanded) and a copy: the same statistics as with arrays, and
    the held form is kept through all of it (never expanded until read)."""
    from conftest import assert_same_stats
    from mhla_cli.linalg import symgram

    X1, o1, y1 = ragged_data(1)
    X2, o2, y2 = ragged_data(2, scale=np.array([1.0, 1e-3, 30.0]))
    # accumulated in the tokens' own coordinates: the canonical change is far from the identity
    held, plain = _held_and_expanded(monkeypatch, lambda: [chunk_features(X, o, y, 3, basis="identity")
                                                           for X, o, y in ((X1, o1, y1), (X2, o2, y2))])
    assert all(isinstance(f.basis_gram_held, symgram.Pairs) for f in held)
    assert all(isinstance(f.basis_gram_held, np.ndarray) for f in plain)
    total_held, total_plain = held[0] + held[1], plain[0] + plain[1]
    assert isinstance(total_held.basis_gram_held, symgram.Pairs)
    mixed = held[0].copy() + plain[1]  # one part held, one expanded
    copy = held[1].copy()
    assert isinstance(copy.basis_gram_held, symgram.Pairs) and copy.basis_gram_held.K is not held[1].basis_gram_held.K
    for a, b in ((held[0], plain[0]), (held[1], plain[1]), (total_held, total_plain), (mixed, total_plain),
                 (copy, plain[1])):
        assert_same_stats(a, b)  # gram (derived on the factors), moments, ..., and Lambda~'s spectrum
        assert relerr(a.basis_gram, b.basis_gram) < 1e-12 and np.array_equal(a.basis_gram, a.basis_gram.T)
    # against the materialised reference: the sum's Lambda~ and the own gram of the whole data
    X = np.concatenate([X1, X2])
    off = np.concatenate([o1, o2[1:] + o1[-1]])
    lam = total_held.solver_stats()[1] / total_held.n_samples
    assert ratio(np.linalg.eigvalsh(lam), canonical(X, off, np.concatenate([y1, y2]))["eigenvalues"]) < 1e-9
    H = np.stack([features(X[a:b]) for a, b in zip(off[:-1], off[1:])])
    assert relerr(total_held.gram, H.T @ H) < 1e-12


def test_a_held_block_on_the_spans_expands_as_the_expanded_one(monkeypatch) -> None:
    """A block on the data's spans held as its distinct entries: its change of basis (by the spans' R
    factors) and its expansion to all psi features, against the same with arrays."""
    from conftest import assert_same_stats
    from mhla_cli.linalg import symgram

    X, o, y = ragged_data(3)
    X[:, 2] = X[:, 0] - 2 * X[:, 1]  # tokens in a plane: the data have spans
    E = np.linalg.qr(np.random.default_rng(0).standard_normal((6, 4)))[0]
    F = np.linalg.qr(np.random.default_rng(1).standard_normal((3, 2)))[0]

    held, plain = _held_and_expanded(monkeypatch, lambda: chunk_features(X, o, y, 3, basis="identity"))
    for f in (held, plain):  # the block of the full sums on (E, F) (the sums are exact there), in each form
        g = f.basis_gram_held
        f.basis_gram = g.congruence(E.T, F.T) if isinstance(g, symgram.Pairs) else \
            basis.kron_congruence(E.T, F.T, g)
        f.basis_moments = basis.kron_apply(E.T, F.T, f.basis_moments)
        f.span_pairs, f.span_last = E, F
        f.gram = f.moments = None
    assert isinstance(held.basis_gram_held, symgram.Pairs)
    C = np.linalg.qr(np.random.default_rng(4).standard_normal((3, 3)))[0] * 2.0 + np.eye(3)
    for f in (held, plain):
        f.change_basis(C)
    assert isinstance(held.basis_gram_held, symgram.Pairs) and held.on_spans
    assert relerr(held.basis_gram, plain.basis_gram) < 1e-12
    held.expand(), plain.expand()
    assert not held.on_spans and held.basis_gram.shape == (18, 18)
    assert_same_stats(held, plain)
