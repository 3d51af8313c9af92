"""Features (mhla_cli.stats): the sums, their algebra across bases, their file and its refusals.

References: plain numpy on materialised canonical features (tests/_reference.py).
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from _reference import canonical, ratio
from mhla_cli import basis
from mhla_cli.errors import InputError
from mhla_cli.stats import PAIRS_DATASET, PAIRS_FORMAT, Features
from mhla_cli.stream import chunk_features


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
    from mhla_cli.stream import featurize

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
