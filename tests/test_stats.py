"""Features (mhla_cli.statistics.stats): the sums, their algebra across bases, their file and its refusals.

References: plain numpy on materialised canonical features (tests/_reference.py).
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from _reference import canonical, ratio
from mhla_cli.statistics import basis
from mhla_cli.errors import InputError
from mhla_cli.statistics.stats import PAIRS_DATASET, PAIRS_FORMAT, Features
from mhla_cli.statistics.stream import chunk_features


def _data(seed: int, n: int = 60, d: int = 3, scale: np.ndarray | float = 1.0):
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(2, 7, size=n))])
    X = rng.standard_normal((int(offsets[-1]), d)) * scale
    y = rng.standard_normal((n, d))
    return X, offsets, y


def test_adding_parts_in_unlike_bases_equals_the_whole() -> None:
    """Two parts each in the whitening of its own (very different) tokens: their sum is the whole
    data's, changed into the whitening of all tokens; the reference is the concatenation."""
    X1, o1, y1 = _data(1)
    X2, o2, y2 = _data(2, scale=np.array([1.0, 1e-3, 30.0]))
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
    X, off, y = _data(3, scale=np.array([1.0, 1e-2, 1.0]))
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


def _write_features(tmp_path: Path) -> Path:
    X, off, y = _data(4)
    path = tmp_path / "f.h5"
    chunk_features(X, off, y, 3).save(path)
    return path


@pytest.mark.parametrize("name,bad", [
    ("basis_token_gram", lambda a: a[:2]),
    ("basis_last_token_gram", lambda a: a * np.nan),
    ("basis_gram", lambda a: a + np.triu(np.ones_like(a), 1)),
    ("basis", lambda a: np.zeros_like(a)),
])
def test_load_refuses_each_broken_basis_dataset(tmp_path: Path, name: str, bad) -> None:
    path = _write_features(tmp_path)
    with h5py.File(path, "r+") as f:
        arr = bad(f[name][()])
        del f[name]
        f[name] = arr
    with pytest.raises(InputError, match=name):
        Features.load(path)


def test_load_refuses_a_version_3_file_without_its_basis_token_grams(tmp_path: Path) -> None:
    path = _write_features(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["basis_last_token_gram"]
    with pytest.raises(InputError, match="basis_last_token_gram"):
        Features.load(path)


def test_repr_is_short_and_shows_no_arrays() -> None:
    from mhla_cli.statistics.stream import featurize

    feats = featurize(Path(__file__).resolve().parent.parent / "sample_data" / "teacher.h5")
    r = repr(feats)
    assert r == ("Features(d=4, n_features=40, n_samples=2048, n_tokens=204800, per_position=False, "
                 "normalize='none', targets=True)")


# --------------------------------------------------------------------------------------------
# the weight totals (format version 5): sum w and sum w n
# --------------------------------------------------------------------------------------------


def _weighted(seed: int, per_position: bool = False) -> Features:
    X, off, y = _data(seed, n=40)
    rng = np.random.default_rng(seed + 100)
    rows = int(off[-1]) if per_position else off.size - 1
    if per_position:
        y = rng.standard_normal((rows, 3))
    w = rng.uniform(0.0, 3.0, rows)
    w[::5] = 0.0
    return chunk_features(X, off, y, 3, weights=w, per_position=per_position)


def test_weight_totals_are_sums_that_add_subtract_and_round_trip(tmp_path: Path) -> None:
    """weight_sum = sum w, token_weight_sum = sum w n (the reference's normalisers); the totals add
    and subtract with the parts, and a features file keeps them."""
    X, off, y = _data(11, n=30)
    w = np.random.default_rng(5).uniform(0.0, 4.0, 30)
    w[::7] = 0.0
    f = chunk_features(X, off, y, 3, weights=w)
    lengths = np.diff(off)
    assert f.n_samples == int((w > 0).sum()) and f.n_tokens == int(off[-1])
    assert abs(f.weight - w.sum()) <= 1e-12 * w.sum() and abs(f.token_weight - w @ lengths) <= 1e-12 * (w @ lengths)
    ref = canonical(X, off, y, weights=w)
    assert ratio(np.linalg.eigvalsh(f.solver_stats()[1] / f.weight), ref["eigenvalues"]) < 1e-10
    # per-position data: every prefix is a sample, of n = its length
    X2, off2, _ = _data(12, n=20)
    wp = np.random.default_rng(6).uniform(0.0, 2.0, int(off2[-1]))
    y2 = np.random.default_rng(7).standard_normal((int(off2[-1]), 3))
    g = chunk_features(X2, off2, y2, 3, weights=wp, per_position=True)
    prefix_len = np.concatenate([np.arange(1, b - a + 1) for a, b in zip(off2[:-1], off2[1:])])
    assert abs(g.token_weight - wp @ prefix_len) <= 1e-12 * (wp @ prefix_len) and abs(g.weight - wp.sum()) <= 1e-12 * wp.sum()
    # unweighted last-token data: the counts
    h = chunk_features(X, off, y, 3)
    assert h.weight == h.n_samples == 30 and h.token_weight == h.n_tokens == int(off[-1])
    # sums that add, and subtract
    a, b = _weighted(1), _weighted(2)
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


def _as_version_4(path: Path) -> None:
    """A features file as format version 4 wrote it (no weight totals)."""
    with h5py.File(path, "r+") as f:
        del f.attrs["weight_sum"], f.attrs["token_weight_sum"]
        f.attrs["mhla_format_version"] = 4


def test_a_version_4_file_of_unweighted_last_token_data_is_converted(tmp_path: Path) -> None:
    """Before version 5 the totals were not written: unweighted last-token data have the counts (and
    today's numbers exactly)."""
    path = _write_features(tmp_path)
    new = Features.load(path)
    _as_version_4(path)
    old = Features.load(path)
    assert old.weight == old.n_samples and old.token_weight == old.n_tokens
    assert np.array_equal(old.basis_gram, new.basis_gram) and old.weight == new.weight
    assert old.token_weight == new.token_weight


@pytest.mark.parametrize("per_position", [True, False])
def test_a_version_4_file_whose_totals_are_unknown_is_refused(tmp_path: Path, per_position: bool) -> None:
    """Per-position sums (sum w n is not the token count), or last-token sums with weight-0 samples
    (n_samples < n_sequences): refused with one line that says how to regenerate them."""
    feats = _weighted(3, per_position)
    if not per_position:
        assert feats.n_samples < feats.n_sequences
    path = tmp_path / "old.h5"
    feats.save(path)
    _as_version_4(path)
    with pytest.raises(InputError, match=r"format version 4.*mhla featurize") as e:
        Features.load(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("attr,value,match", [
    ("weight_sum", None, "no attribute 'weight_sum'"),
    ("token_weight_sum", None, "no attribute 'token_weight_sum'"),
    ("weight_sum", 0.0, "'weight_sum' = 0.0, expected a finite number > 0"),
    ("token_weight_sum", -2.0, "expected a finite number > 0"),
    ("weight_sum", np.nan, "expected a finite number > 0"),
    ("token_weight_sum", "many", "is not a number"),
])
def test_load_refuses_broken_weight_totals(tmp_path: Path, attr: str, value, match: str) -> None:
    """Format version 5: both totals present, finite and > 0 (one refusal per rule)."""
    path = _write_features(tmp_path)
    with h5py.File(path, "r+") as f:
        if value is None:
            del f.attrs[attr]
        else:
            f.attrs[attr] = value
    with pytest.raises(InputError, match=match):
        Features.load(path)


# ---------------------------------------------------------------- the compact file (featurize --compact)


def _compact_pair(tmp_path: Path) -> tuple[Features, Path, Path]:
    X, off, y = _data(6, n=80, d=3)
    feats = chunk_features(X, off, y, 3)
    full, compact = tmp_path / "full.h5", tmp_path / "compact.h5"
    feats.save(full)
    feats.save(compact, compact=True)
    return feats, full, compact


def test_compact_file_holds_the_distinct_entries_and_reads_back_the_same(tmp_path: Path) -> None:
    from conftest import assert_same_stats

    feats, full, compact = _compact_pair(tmp_path)
    with h5py.File(compact, "r") as f:
        assert "gram" not in f and "basis_gram" not in f
        assert f[PAIRS_DATASET].shape == (21, 6)  # (q(q+1)/2, d(d+1)/2), q = 6: 126 of psi^2 = 324 numbers
        assert int(f.attrs["mhla_format_version"]) >= PAIRS_FORMAT
    a, b = Features.load(full), Features.load(compact)
    assert ratio(b.basis_gram, a.basis_gram) < 1e-15 and np.array_equal(b.basis_gram, b.basis_gram.T)
    assert_same_stats(a, b, tol=1e-13)  # gram derived on read; counts, sums and the canonical spectra
    assert ratio(b.gram, feats.gram) < 1e-13


def test_a_version_4_file_reads_as_before(tmp_path: Path) -> None:
    """Files of the format before the compact form (version 4: 'gram' and 'basis_gram') still read."""
    from conftest import assert_same_stats

    feats, full, _ = _compact_pair(tmp_path)
    with h5py.File(full, "r+") as f:
        f.attrs["mhla_format_version"] = PAIRS_FORMAT - 1
    assert_same_stats(Features.load(full), feats, tol=1e-13)


def test_a_compact_block_on_the_spans_reads_back(tmp_path: Path) -> None:
    from mhla_cli.statistics.stream import featurize

    rng = np.random.default_rng(3)
    off = np.concatenate([[0], np.cumsum(rng.integers(1, 8, size=50))])
    X = rng.standard_normal((int(off[-1]), 3))
    X[:, 2] = X[:, 0] + X[:, 1]
    src = tmp_path / "t.h5"
    with h5py.File(src, "w") as f:
        f["tokens"], f["offsets"], f["targets"] = X, off, rng.standard_normal((50, 3))
    red = featurize(src, spans="on")
    assert red.reduced
    red.save(tmp_path / "b.h5", compact=True)
    back = Features.load(tmp_path / "b.h5")
    assert back.reduced and ratio(back.basis_gram, red.basis_gram) < 1e-15
    assert ratio(back.basis_moments, red.basis_moments) < 1e-15


@pytest.mark.parametrize("change,match", [
    (lambda f: _replace(f, PAIRS_DATASET, f[PAIRS_DATASET][()][:-1]), "shape"),
    (lambda f: _replace(f, PAIRS_DATASET, f[PAIRS_DATASET][()] * np.nan), "NaN"),
    (lambda f: _replace(f, "basis_gram", np.eye(18)), "both"),
    (lambda f: f.attrs.__setitem__("mhla_format_version", PAIRS_FORMAT - 1), "format version"),
    (lambda f: f.__delitem__(PAIRS_DATASET), "gram"),
])
def test_load_refuses_each_broken_compact_file(tmp_path: Path, change, match: str) -> None:
    _, _, compact = _compact_pair(tmp_path)
    with h5py.File(compact, "r+") as f:
        change(f)
    with pytest.raises(InputError, match=match):
        Features.load(compact)


def _replace(f: h5py.File, name: str, value: np.ndarray) -> None:
    if name in f:
        del f[name]
    f[name] = value
