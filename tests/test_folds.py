"""Per-fold statistics for cross-validation (mhla_cli.statistics.folds) against plain-numpy sums over materialised features."""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli.io import formats
from mhla_cli.model import synthetic
from mhla_cli.errors import InputError
from mhla_cli.statistics.folds import featurize_folds, load_folds, load_for_cv, save_with_folds
from mhla_cli.solve.lstsq import fit
from mhla_cli.statistics.stream import Features, featurize


def np_features(X: np.ndarray) -> np.ndarray:
    """H(X) in plain numpy: S[j,k] * x_n[l], j <= k, l fastest."""
    d = X.shape[1]
    S = X.T @ X
    return np.array([S[j, k] * X[-1, l] for j in range(d) for k in range(j, d) for l in range(d)])


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, synthetic.Dataset]:
    ds, _ = synthetic.generate_teacher(3, 2, 100, "2:7", noise=0.05, seed=6)
    path = tmp_path_factory.mktemp("folds") / "d.h5"
    ds.save(path, dtype="float64")
    return path, ds


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max())


@pytest.mark.parametrize("K", [2, 3, 7])
def test_folds_equal_plain_numpy_sums(data: tuple[Path, synthetic.Dataset], K: int) -> None:
    path, ds = data
    total, folds = featurize_folds(path, K)
    assert len(folds) == K
    F = np.stack([np_features(ds.sequence(i)) for i in range(ds.n_samples)])
    ranges = [fold.sample_range for fold in folds]
    assert ranges[0][0] == 0 and ranges[-1][1] == ds.n_samples
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous: every sample once
    assert all(hi - lo in (ds.n_samples // K, -(-ds.n_samples // K)) for lo, hi in ranges)  # nearly equal
    for fold, (lo, hi) in zip(folds, ranges):
        Fk, Yk = F[lo:hi], ds.targets[lo:hi]
        Xk = ds.tokens[ds.offsets[lo]:ds.offsets[hi]]
        last = ds.tokens[ds.offsets[lo + 1:hi + 1] - 1]
        assert fold.n_samples == hi - lo and fold.n_tokens == len(Xk)
        for got, want in ((fold.gram, Fk.T @ Fk), (fold.moments, Fk.T @ Yk), (fold.target_gram, Yk.T @ Yk),
                          (fold.token_gram, Xk.T @ Xk), (fold.last_token_gram, last.T @ last)):
            close(got, want)
    Y = ds.targets
    close(total.gram, F.T @ F)
    close(total.moments, F.T @ Y)
    close(total.target_gram, Y.T @ Y)
    assert total.n_samples == ds.n_samples and total.n_tokens == ds.tokens.shape[0]
    assert total.sample_range == (0, ds.n_samples)


def test_save_and_load_folds_round_trip(data: tuple[Path, synthetic.Dataset], tmp_path: Path) -> None:
    path, _ = data
    total, folds = featurize_folds(path, 3)
    out = tmp_path / "f.h5"
    save_with_folds(total, folds, out, inputs=(path,))
    back_total = Features.load(out)
    back = load_folds(out, back_total)
    assert back is not None and len(back) == 3
    for a, b in zip(folds, back):
        assert (a.n_samples, a.n_tokens, a.sample_range) == (b.n_samples, b.n_tokens, b.sample_range)
        for k in Features.SUMS:
            np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
    with h5py.File(out, "r") as f:
        assert int(f.attrs["n_folds"]) == 3 and f["fold_gram"].shape == (3, 18, 18)
    # a features file without folds has none; load_for_cv refuses it and featurizes a tokens file
    plain = tmp_path / "p.h5"
    featurize(path).save(plain)
    assert load_folds(plain) is None
    with pytest.raises(InputError, match="no per-fold statistics"):
        load_for_cv(plain)
    t2, f2 = load_for_cv(out)
    assert len(f2) == 3 and np.array_equal(t2.gram, back_total.gram)
    t3, f3 = load_for_cv(path, n_folds=4)
    assert len(f3) == 4


def test_folds_file_keeps_the_solver_basis_and_fits_the_same(data: tuple[Path, synthetic.Dataset],
                                                             tmp_path: Path) -> None:
    path, _ = data
    total, folds = featurize_folds(path, 3)
    with_folds, without = tmp_path / "with.h5", tmp_path / "without.h5"
    save_with_folds(total, folds, with_folds)
    featurize(path).save(without)
    with h5py.File(with_folds, "r") as f, h5py.File(without, "r") as g:
        assert int(f.attrs["mhla_format_version"]) == formats.FORMAT_VERSION >= 3
        for k in ("basis", "basis_gram", "basis_moments", "basis_token_gram", "basis_last_token_gram"):
            assert k in f and k in g, k
    a, b = fit(Features.load(with_folds)), fit(Features.load(without))
    assert np.linalg.norm(a.coef - b.coef) <= 1e-10 * np.linalg.norm(b.coef)


def _corrupt(src: Path, dst: Path, name: str, fn) -> Path:
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        arr = fn(f[name][()])
        del f[name]
        f[name] = arr
    return dst


def test_load_folds_refuses_inconsistent_folds(data: tuple[Path, synthetic.Dataset], tmp_path: Path) -> None:
    path, _ = data
    total, folds = featurize_folds(path, 3)
    good = tmp_path / "good.h5"
    save_with_folds(total, folds, good)

    def bump(g: np.ndarray) -> np.ndarray:
        g = g.copy()
        g[1] *= 1.01  # fold 1's gram no longer sums to 'gram'
        return g

    cases = {
        "gram_sum": ("fold_gram", bump, "do not sum to 'gram'"),
        "n_sum": ("fold_n_samples", lambda n: n + np.array([1, 0, 0]), "do not sum to n_samples"),
        "n_zero": ("fold_n_samples", lambda n: np.array([n[0] + n[1], 0, n[2]]), "do not sum to n_samples"),
        "shape": ("fold_moments", lambda m: m[:2], r"'fold_moments' has shape"),
        "nan": ("fold_token_gram", lambda t: t * np.nan, "NaN"),
        "one_fold": (None, None, "needs >= 2"),
    }
    for name, (ds, fn, msg) in cases.items():
        if ds is None:  # a file with a single fold
            t1, f1 = featurize_folds(path, 2)
            bad = tmp_path / "one.h5"
            save_with_folds(t1, [t1], bad)
        else:
            bad = _corrupt(good, tmp_path / f"{name}.h5", ds, fn)
        with pytest.raises(InputError, match=msg):
            load_folds(bad)


def test_featurize_folds_argument_rules(data: tuple[Path, synthetic.Dataset], tmp_path: Path) -> None:
    path, ds = data
    with pytest.raises(InputError, match=">= 2"):
        featurize_folds(path, 1)
    with pytest.raises(InputError, match="more than the"):
        featurize_folds(path, ds.n_samples + 1)
    notargets = tmp_path / "nt.h5"
    with h5py.File(notargets, "w") as f:
        f["tokens"] = ds.tokens
        f["offsets"] = ds.offsets
    with pytest.raises(InputError, match="need targets"):
        featurize_folds(notargets, 2)
