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
from mhla_cli.stats import Features
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


def test_repr_is_short_and_shows_no_arrays() -> None:
    from mhla_cli.stream import featurize

    feats = featurize(Path(__file__).resolve().parent.parent / "sample_data" / "teacher.h5")
    r = repr(feats)
    assert r == ("Features(d=4, n_features=40, n_samples=2048, n_tokens=204800, per_position=False, "
                 "normalize='none', targets=True)")
