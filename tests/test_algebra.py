"""The algebra of Features (mhla_cli.statistics.algebra): sums of parts in unlike bases, the change of basis.

References: plain numpy on materialised canonical features (tests/_reference.py).
"""

from __future__ import annotations

import numpy as np

from _reference import canonical, ratio
from _records import ragged_data
from mhla_cli.statistics import basis
from mhla_cli.statistics.algebra import add_into
from mhla_cli.statistics.stream import chunk_features


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
