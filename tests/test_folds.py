"""Per-fold statistics for cross-validation (mhla_cli.statistics.folds) against plain-numpy sums over materialised features."""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mhla_cli.io import formats
from mhla_cli.model import synthetic
from mhla_cli.cli.options import in_options
from mhla_cli.errors import InputError, Refused
from mhla_cli.statistics.folds import featurize_folds, load_folds, load_for_cv, save_with_folds
from mhla_cli.solve.lstsq import fit
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.stream import featurize
from conftest import unseal


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
        for k in (*Features.SUMS, "basis", *Features.BASIS_SUMS):  # the canonical sums too, as featurize made them
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
        unseal(f)
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
        # a fold of no sample with weight: an empty fold has weight totals 0
        "n_zero": ("fold_n_samples", lambda n: np.array([n[0] + n[1], 0, n[2]]), r"0 for a fold of no sample"),
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


# --------------------------------------------------------------------------------------------
# Folds as canonical as the whole file: `fit FEATS --ridge auto` from a folds file equals the tokens
# file's choice and numpy's K-fold CV, in any units of the tokens
# --------------------------------------------------------------------------------------------


def _units(d: int, kind: str, cond: float, seed: int) -> np.ndarray:
    """T: diagonal scales spread over [1/sqrt(cond), sqrt(cond)], or rotated with condition `cond`."""
    rng = np.random.default_rng(seed)
    scales = np.logspace(-0.5 * np.log10(cond), 0.5 * np.log10(cond), d)
    if kind == "diagonal":
        return np.diag(rng.permutation(scales))
    U = np.linalg.qr(rng.standard_normal((d, d)))[0]
    V = np.linalg.qr(rng.standard_normal((d, d)))[0]
    return U @ np.diag(scales) @ V.T


def _noisy_teacher(d: int, N: int, seed: int) -> synthetic.Dataset:
    ds, _ = synthetic.generate_teacher(d, 2, N, seq_len=(2, 6), seed=seed, noise=1.0)
    return ds


def _cv_three_ways(ds: synthetic.Dataset, T: np.ndarray, tmp: Path, K: int = 5) -> tuple[dict, dict, np.ndarray]:
    """(cv of `fit FEATS --ridge auto` from a folds file, cv of `fit TOKENS --ridge auto`, numpy's held-out
    MSE on the grid for the tokens X (units cannot change it))."""
    from _reference import ridge_cv_path
    from mhla_cli.solve.ridge_cv import cv_ridge

    data = tmp / "t.h5"
    with h5py.File(data, "w") as f:
        f["tokens"], f["offsets"], f["targets"] = ds.tokens @ T, ds.offsets, ds.targets
    feats = tmp / "f.h5"
    save_with_folds(*featurize_folds(data, K), feats)
    from_file = cv_ridge(*load_for_cv(feats))
    from_tokens = cv_ridge(*load_for_cv(data, n_folds=K))
    grid = np.array([row["ridge"] for row in from_tokens["table"]])
    ref = ridge_cv_path(ds.tokens, ds.offsets, ds.targets, K, grid).mean(axis=1)
    return from_file, from_tokens, ref


def _same_choice(got: dict, ref: np.ndarray, rel: float) -> None:
    """The CV path equals numpy's to `rel`, and the choice is numpy's minimum (or ties it to `rel`)."""
    path = np.array([row["cv_mse"] for row in got["table"]])
    assert np.abs(path - ref).max() <= rel * ref.max(), np.abs(path / ref - 1).max()
    i = int(np.argmin(ref))
    assert got["chosen"] == got["table"][i]["ridge"] or abs(got["cv_mse"] - ref[i]) <= rel * ref[i]


def test_folds_file_ridge_auto_in_rotated_units_of_condition_1e3(tmp_path: Path) -> None:
    """The issue's row: d = 3, rotated units of condition 1e3, `featurize --folds 5` then `fit FEATS
    --ridge auto` chose another ridge than numpy's CV from the folds' own-coordinate sums (here 0.28 for
    0.033 lambda_max); with the folds' canonical sums it is the tokens file's choice and numpy's CV."""
    from mhla_cli.cli import run

    ds = _noisy_teacher(3, 45, seed=6)
    T = _units(3, "rotated", 1e3, seed=6)
    from_file, from_tokens, ref = _cv_three_ways(ds, T, tmp_path)
    _same_choice(from_tokens, ref, 1e-6)
    _same_choice(from_file, ref, 1e-6)
    # the own-coordinate fold sums chose 0.28 lambda_max here (numpy's held-out MSE 1.669 for 1.616)
    assert from_file["chosen"] == from_tokens["chosen"] == from_tokens["table"][int(np.argmin(ref))]["ridge"]
    assert from_file["chosen"] < 0.1 * from_file["lambda_max"]
    # the CLI: `fit FEATS --ridge auto` and `fit TOKENS --ridge auto` write the same model
    outs = []
    for src in (tmp_path / "f.h5", tmp_path / "t.h5"):
        out = tmp_path / f"m_{src.stem}.h5"
        assert run(["fit", str(src), "-o", str(out), "--ridge", "auto", "-q"]) == 0
        with h5py.File(out) as f:
            outs.append((float(f.attrs["ridge"]), np.array(f["canonical_coef"])))
    assert outs[0][0] == outs[1][0] == from_file["chosen"]
    np.testing.assert_allclose(outs[0][1], outs[1][1], rtol=0, atol=1e-9 * np.abs(outs[1][1]).max())


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                   HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["diagonal", "rotated"]), log_cond=st.floats(0.0, 12.0), seed=st.integers(0, 2**16),
       d=st.sampled_from([2, 3]))
def test_folds_file_ridge_auto_is_unit_free(tmp_path_factory: pytest.TempPathFactory, kind: str, log_cond: float,
                                            seed: int, d: int) -> None:
    """Metamorphic: tokens X T (T diagonal with scales 1e-6..1e6, or rotated with condition up to 1e6):
    the folds file's CV path and choice equal the tokens file's and numpy's K-fold CV on X."""
    cond = 10.0 ** (log_cond if kind == "diagonal" else log_cond / 2)
    ds = _noisy_teacher(d, 40 if d == 2 else 45, seed)
    from_file, from_tokens, ref = _cv_three_ways(ds, _units(d, kind, cond, seed), tmp_path_factory.mktemp("u"))
    _same_choice(from_file, ref, 1e-6)
    _same_choice(from_tokens, ref, 1e-6)
    assert from_file["chosen"] == from_tokens["chosen"]


def _strip_fold_bases(path: Path) -> Path:
    """The file as written before the folds' canonical sums (own-coordinate fold sums only)."""
    from mhla_cli.statistics.folds import FOLD_BASIS

    with h5py.File(path, "a") as f:

        unseal(f)
        for name in FOLD_BASIS:
            del f[name]
    return path


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_cut_own_folds_cond(tmp_path: Path, factor: float) -> None:
    """A folds file without the folds' canonical sums (an older file): used at 0.5 x OWN_FOLDS_COND (its CV
    then agrees with the tokens file's), refused at 2 x, naming the remedy."""
    from mhla_cli.numerics import OWN_FOLDS_COND
    from mhla_cli.statistics.basis import row_scaled_cond
    from mhla_cli.solve.ridge_cv import cv_ridge

    ds = _noisy_teacher(2, 60, seed=5)
    want = factor * OWN_FOLDS_COND
    # units whose whitening has the wanted row-scaled condition number (a bisection on the condition of T)
    lo, hi = 0.0, 4.0
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        data = tmp_path / "t.h5"
        with h5py.File(data, "w") as f:
            f["tokens"], f["offsets"], f["targets"] = ds.tokens @ _units(2, "rotated", 10**mid, 1), ds.offsets, ds.targets
        cond = row_scaled_cond(featurize(data).basis)
        lo, hi = (mid, hi) if cond < want else (lo, mid)
    assert cond == pytest.approx(want, rel=0.05)
    feats = tmp_path / "f.h5"
    save_with_folds(*featurize_folds(data, 4), feats)
    _strip_fold_bases(feats)
    if factor < 1:
        got, want_cv = cv_ridge(*load_for_cv(feats)), cv_ridge(*load_for_cv(data, n_folds=4))
        assert got["chosen"] == want_cv["chosen"]
        assert abs(got["cv_mse"] - want_cv["cv_mse"]) <= 1e-6 * want_cv["cv_mse"]
    else:
        with pytest.raises(Refused, match="own coordinates only.*featurize_folds") as exc:
            load_for_cv(feats)
        assert "featurize DATA -o FEATS --folds K" in str(in_options(exc.value))  # the CLI's words


def test_load_folds_refuses_inconsistent_fold_bases(data: tuple[Path, synthetic.Dataset], tmp_path: Path) -> None:
    path, _ = data
    total, folds = featurize_folds(path, 3)
    good = tmp_path / "good.h5"
    save_with_folds(total, folds, good)
    assert all(f.basis is not None for f in load_folds(good))

    def bump(t: np.ndarray) -> np.ndarray:
        t = t.copy()
        t[1] *= 1.01
        return t

    def asym(g: np.ndarray) -> np.ndarray:
        g = g.copy()
        g[0, 0, 1] += 1e-3 * np.abs(g[0]).max()
        return g

    cases = {"token_sum": ("fold_basis_token_gram", bump, "do not sum to 'basis_token_gram'"),
             "asym": ("fold_basis_gram", asym, "not symmetric"),
             "singular": ("fold_basis", lambda a: a * np.array([1.0, 1.0, 0.0])[None, :, None], "singular"),
             "shape": ("fold_basis_moments", lambda m: m[:, :4], "'fold_basis_moments' has shape")}
    for name, (ds, fn, msg) in cases.items():
        with pytest.raises(InputError, match=msg):
            load_folds(_corrupt(good, tmp_path / f"{name}.h5", ds, fn))
    partial = _corrupt(good, tmp_path / "partial.h5", "fold_basis", lambda a: a)
    with h5py.File(partial, "a") as f:
        unseal(f)
        del f["fold_basis_gram"]
    with pytest.raises(InputError, match="incomplete"):
        load_folds(partial)


def test_an_empty_fold_is_skipped_and_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 43 row 8: fold 1 of 5 holds only weight-0 samples. `featurize --folds 5` writes it (zero sums), and
    `fit --ridge auto` (from the folds file and from the tokens file) skips it with a warning: its CV path is
    numpy's 4-fold CV of the data without those samples (the same four folds)."""
    import json

    from _reference import ridge_cv_path
    from mhla_cli.cli import run

    ds = _noisy_teacher(2, 100, 41)
    w = np.ones(100)
    w[20:40] = 0.0
    data = tmp_path / "t.h5"
    with h5py.File(data, "w") as f:
        f["tokens"], f["offsets"], f["targets"], f["weights"] = ds.tokens, ds.offsets, ds.targets, w
    feats = tmp_path / "f.h5"
    assert run(["featurize", str(data), "--folds", "5", "-o", str(feats), "-q"]) == 0
    folds = load_folds(feats)
    assert [f.n_samples for f in folds] == [20, 0, 20, 20, 20] and folds[1].weight == 0
    keep = np.r_[0:20, 40:100]
    seqs = [ds.tokens[ds.offsets[i]:ds.offsets[i + 1]] for i in keep]
    off = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    for src in (feats, data):
        capsys.readouterr()
        assert run(["fit", str(src), "--ridge", "auto", "-o", str(tmp_path / "m.h5"), "--json"]) == 0
        out = capsys.readouterr()
        cv = json.loads(out.out)
        assert cv["skipped_folds"] == [1] and cv["ridge_cv"]["n_folds"] == 4
        assert "fold(s) 1 (0-based) have every weight 0" in out.err
        grid = np.array([row["ridge"] for row in cv["ridge_cv"]["table"]])
        ref = ridge_cv_path(np.concatenate(seqs), off, ds.targets[keep], 4, grid).mean(axis=1)
        _same_choice(cv["ridge_cv"], ref, 1e-8)
    # folds of which fewer than 2 hold samples: refused (exit 2)
    w[20:] = 0.0
    with h5py.File(data, "r+") as f:
        f["weights"][...] = w
    assert run(["fit", str(data), "--ridge", "auto", "-o", str(tmp_path / "m2.h5")]) == 2
    assert "at least 2 folds that hold samples" in capsys.readouterr().err
