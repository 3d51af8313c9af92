"""The features file (mhla_cli.statistics.files.features_file): format versions 3-5, the compact form, the refusals.

References: plain numpy on materialised canonical features (tests/_reference.py).
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from _reference import ratio
from _records import ragged_data, weighted_features
from conftest import unseal
from mhla_cli.errors import InputError
from mhla_cli.statistics.features import Features
from mhla_cli.io.formats import PAIRS_DATASET
from mhla_cli.statistics.storage.gram_pairs import PAIRS_FORMAT
from mhla_cli.statistics.files import features_file  # noqa: F401  (the module under test, through Features)
from mhla_cli.statistics.accumulate import chunk_features


def _write_features(tmp_path: Path) -> Path:
    X, off, y = ragged_data(4)
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


# --------------------------------------------------------------------------------------------
# the weight totals (format version 5): sum w and sum w n
# --------------------------------------------------------------------------------------------


def _as_version_4(path: Path) -> None:
    """A features file as format version 4 wrote it (no weight totals)."""
    with h5py.File(path, "r+") as f:
        del f.attrs["weight_sum"], f.attrs["token_weight_sum"]
        unseal(f)
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
    feats = weighted_features(3, per_position)
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
    X, off, y = ragged_data(6, n=80, d=3)
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


@pytest.mark.parametrize("spans", ["off", "on"])
def test_a_held_basis_gram_writes_the_same_files(tmp_path: Path, monkeypatch, spans: str) -> None:
    """Statistics whose basis Gram is held as its distinct entries (symgram.Pairs: the accumulation on K)
    write the same full and compact files as those held as arrays (the syrk): the full file's psi x psi
    datasets derived when written; the compact one holds the entries as they were; a compact file loads
    them held, and they are expanded only when read."""
    from mhla_cli.linalg import symgram
    from mhla_cli.statistics.stream import featurize

    rng = np.random.default_rng(7)
    off = np.concatenate([[0], np.cumsum(rng.integers(1, 8, size=50))])
    X = rng.standard_normal((int(off[-1]), 3)) * np.array([1.0, 30.0, 1e-2])
    if spans == "on":
        X[:, 2] = X[:, 0] + X[:, 1]
    src = tmp_path / "t.h5"
    with h5py.File(src, "w") as f:
        f["tokens"], f["offsets"], f["targets"] = X, off, rng.standard_normal((50, 3))
    files = {}
    for rule in (1, 10**9):
        monkeypatch.setattr(symgram, "SYMGRAM_MIN_D", rule)
        feats = featurize(src, spans=spans)
        assert isinstance(feats.basis_gram_held, symgram.Pairs) == (rule == 1) and feats.on_spans == (spans == "on")
        for compact in (False, True):
            path = tmp_path / f"{rule}-{compact}.h5"
            feats.save(path, compact=compact)
            files[rule, compact] = path
        assert isinstance(feats.basis_gram_held, symgram.Pairs) == (rule == 1)  # saving expanded nothing held
    for compact in (False, True):
        with h5py.File(files[1, compact], "r") as a, h5py.File(files[10**9, compact], "r") as b:
            assert set(a) == set(b)
            for name in a:
                assert ratio(a[name][()], b[name][()]) < 1e-13, name
    back = Features.load(files[1, True])
    assert isinstance(back.basis_gram_held, symgram.Pairs)
    with h5py.File(files[10**9, False], "r") as f:
        assert ratio(back.basis_gram, f["basis_gram"][()]) < 1e-13
    assert isinstance(back.basis_gram_held, np.ndarray)  # expanded once read, and kept


def test_a_version_4_file_reads_as_before(tmp_path: Path) -> None:
    """Files of the format before the compact form (version 4: 'gram' and 'basis_gram') still read."""
    from conftest import assert_same_stats

    feats, full, _ = _compact_pair(tmp_path)
    with h5py.File(full, "r+") as f:
        unseal(f)
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
    assert red.on_spans
    red.save(tmp_path / "b.h5", compact=True)
    back = Features.load(tmp_path / "b.h5")
    assert back.on_spans and ratio(back.basis_gram, red.basis_gram) < 1e-15
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
