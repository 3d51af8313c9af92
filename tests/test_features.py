"""The Features record (mhla_cli.statistics.features): its repr and its weight totals (sum w, sum w n).

References: plain numpy on materialised canonical features (tests/_reference.py).
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from _reference import canonical, ratio
from _records import ragged_data, weighted_features
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.accumulate import chunk_features
from mhla_cli.samples import ReadSpec, samples_of


def test_repr_is_short_and_shows_no_arrays() -> None:
    from mhla_cli.statistics.stream import featurize

    feats = featurize(Path(__file__).resolve().parent.parent / "sample_data" / "teacher.h5")
    r = repr(feats)
    assert r == ("Features(d=4, n_features=40, n_samples=2048, n_tokens=204800, samples='last', "
                 "normalize='none', targets=True)")


def test_weight_totals_are_sums_that_add_subtract_and_round_trip(tmp_path: Path) -> None:
    """weight_sum = sum w, token_weight_sum = sum w n (the reference's normalisers); the totals add
    and subtract with the parts, and a features file keeps them."""
    X, off, y = ragged_data(11, n=30)
    w = np.random.default_rng(5).uniform(0.0, 4.0, 30)
    w[::7] = 0.0
    f = chunk_features(X, off, y, 3, weights=w)
    lengths = np.diff(off)
    assert f.n_samples == int((w > 0).sum()) and f.n_tokens == int(off[-1])
    assert abs(f.weight - w.sum()) <= 1e-12 * w.sum() and abs(f.token_weight - w @ lengths) <= 1e-12 * (w @ lengths)
    ref = canonical(X, off, y, weights=w)
    assert ratio(np.linalg.eigvalsh(f.solver_stats()[1] / f.weight), ref["eigenvalues"]) < 1e-10
    # per-position data: every prefix is a sample, of n = its length
    X2, off2, _ = ragged_data(12, n=20)
    wp = np.random.default_rng(6).uniform(0.0, 2.0, int(off2[-1]))
    y2 = np.random.default_rng(7).standard_normal((int(off2[-1]), 3))
    g = chunk_features(X2, off2, y2, 3, weights=wp, read=ReadSpec(samples_of(True)))
    prefix_len = np.concatenate([np.arange(1, b - a + 1) for a, b in zip(off2[:-1], off2[1:])])
    assert abs(g.token_weight - wp @ prefix_len) <= 1e-12 * (wp @ prefix_len) and abs(g.weight - wp.sum()) <= 1e-12 * wp.sum()
    # unweighted last-token data: the counts
    h = chunk_features(X, off, y, 3)
    assert h.weight == h.n_samples == 30 and h.token_weight == h.n_tokens == int(off[-1])
    # sums that add, and subtract
    a, b = weighted_features(1), weighted_features(2)
    total = a + b
    assert total.weight == a.weight + b.weight and total.token_weight == a.token_weight + b.token_weight
    back = total - b
    assert abs(back.weight - a.weight) <= 1e-12 * a.weight
    # a features file keeps them
    path = tmp_path / "w.h5"
    a.save(path)
    with h5py.File(path) as fh:
        assert int(fh.attrs["mhla_format_version"]) >= 5
        assert float(fh.attrs["weight_sum"]) == a.weight and float(fh.attrs["token_weight_sum"]) == a.token_weight
    c = Features.load(path)
    assert c.weight == a.weight and c.token_weight == a.token_weight


def test_the_record_has_its_algebra_and_its_file() -> None:
    from mhla_cli import Features as public
    from mhla_cli.statistics import algebra
    from mhla_cli.statistics.files import features_file

    assert Features is public
    assert issubclass(Features, algebra.FeaturesAlgebra) and issubclass(Features, features_file.FeaturesFile)
    f = Features.zeros(2, True)
    assert f.gram.shape == (f.n_features, f.n_features) and f._gram_raw is f.gram  # the field, held


def test_expand_held_expands_a_held_basis_gram_once(monkeypatch) -> None:
    """`expand_held` turns a basis Gram held as its distinct entries into the array it stands for (what
    reading `basis_gram` does), and leaves an array as it is."""
    from mhla_cli.linalg import symgram

    X, off, y = ragged_data(4)
    monkeypatch.setattr(symgram, "SYMGRAM_MIN_D", 1)
    feats = chunk_features(X, off, y, 3)
    held = feats.basis_gram_held
    assert isinstance(held, symgram.Pairs)
    assert feats.expand_held() is feats and isinstance(feats.basis_gram_held, np.ndarray)
    assert np.array_equal(feats.basis_gram_held, held.expand())
    same = feats.basis_gram_held
    feats.expand_held()
    assert feats.basis_gram_held is same
