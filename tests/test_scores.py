"""R^2 wherever a fit is scored (mhla_cli.model.scores): `fit` (train, from the statistics), `predict` (human line
and JSON) and `MHLA.score`, all 1 - SSE / SST over all outputs, SST about the weighted mean vector, against
plain numpy on materialised features."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _reference as ref
from mhla_cli.model import scores, synthetic
from mhla_cli.cli import run
from mhla_cli.api.estimator import MHLA
from conftest import unseal
from mhla_cli.model.forward import Predictions
from mhla_cli.numerics import SST_RESOLUTION
from mhla_cli.model.scores import Spread, r2, r2_of, sst_from_sums
from mhla_cli.statistics.features import Features
from mhla_cli.samples import ReadSpec, samples_of


def np_r2(pred: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> float:
    """1 - sum w ||e||^2 / sum w ||y - ybar||^2, ybar the weighted mean vector (plain numpy)."""
    w = np.ones(y.shape[0]) if w is None else w
    ybar = (w[:, None] * y).sum(0) / w.sum()
    return float(1 - (w * ((pred - y) ** 2).sum(1)).sum() / (w * ((y - ybar) ** 2).sum(1)).sum())


def np_H(X: np.ndarray) -> np.ndarray:
    """H(X) from its definition: S[j,k] * x_n[l], j <= k, l fastest."""
    S = X.T @ X
    j, k = np.triu_indices(X.shape[1])
    return np.einsum("p,l->pl", S[j, k], X[-1]).ravel()


def write(path: Path, **data: np.ndarray) -> Path:
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f[k] = v
    return path


def cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    capsys.readouterr()
    assert run([*args, "--json", "-q"]) == 0, args
    return json.loads(capsys.readouterr().out)


def _data(rng: np.random.Generator, N: int = 80, d: int = 2, offset: float = 0.5):
    lengths = rng.integers(1, 7, size=N)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    X = rng.standard_normal((int(off[-1]), d))
    H = np.array([np_H(X[off[i]:off[i + 1]]) for i in range(N)])
    p = rng.standard_normal((d, H.shape[1])) * 0.3
    Y = H @ p.T + 0.7 * rng.standard_normal((N, d)) + offset  # noisy, with a mean far from 0
    return X, off, H, Y


# ------------------------------------------------------------------------------------------- the module
def test_spread_merges_exactly_and_r2_is_numpy() -> None:
    rng = np.random.default_rng(0)
    y = rng.standard_normal((50, 3)) * [1, 5, 0.1] + [100.0, -3.0, 7.0]
    pred = y + 0.3 * rng.standard_normal(y.shape)
    w = rng.random(50) * 2
    w[::4] = 0.0
    whole = Spread.of(y, w)
    parts = Spread()
    for a, b in ((0, 7), (7, 8), (8, 31), (31, 50)):
        parts = parts.merge(Spread.of(y[a:b], w[a:b]))
    assert parts.weight == pytest.approx(whole.weight, rel=1e-14)
    assert parts.m2 == pytest.approx(whole.m2, rel=1e-12)
    sse = float(w @ ((pred - y) ** 2).sum(1))
    assert parts.r2(sse) == pytest.approx(np_r2(pred, y, w), rel=1e-12)
    assert r2_of(pred, y, w) == pytest.approx(np_r2(pred, y, w), rel=1e-12)
    assert r2_of(pred, y) == pytest.approx(np_r2(pred, y), rel=1e-12)
    # the sums' form: tr(T) - ||s||^2 / W
    T = (w[:, None] * y).T @ y
    sst, energy = sst_from_sums(T, w @ y, float(w.sum()))
    assert sst == pytest.approx(whole.sst, rel=1e-9) and energy == pytest.approx(float(w @ (y ** 2).sum(1)), rel=1e-12)


def test_scikit_learn_r2_is_the_variance_weighted_one() -> None:
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(1)
    y = rng.standard_normal((40, 3)) * [1, 4, 0.5]
    pred = y + 0.5 * rng.standard_normal(y.shape)
    w = rng.random(40)
    want = metrics.r2_score(y, pred, sample_weight=w, multioutput="variance_weighted")
    assert r2_of(pred, y, w) == pytest.approx(want, rel=1e-12)


def test_sst_resolution_cut() -> None:
    """R^2 is None at or below SST_RESOLUTION times the energy, a number just above it."""
    energy = 1.0
    assert r2(0.0, 10 * SST_RESOLUTION * energy, energy) == 1.0
    assert r2(0.0, 0.1 * SST_RESOLUTION * energy, energy) is None
    assert r2(1.0, 0.0, 0.0) is None
    # constant targets in a stream: the spread is exactly 0 -> None
    assert Spread.of(np.full((5, 2), 3.0)).r2(0.0) is None
    # a spread 1e-5 of the magnitude is still scored (SST / energy = 1e-10 > the cut)
    y = 1.0 + 1e-5 * np.random.default_rng(2).standard_normal((200, 1))
    assert r2_of(y, y) == 1.0


# ---------------------------------------------------------------------------- statistics: target_sum
@pytest.mark.parametrize("weighted", [False, True])
def test_features_target_sum_and_fit_train_r2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              weighted: bool) -> None:
    rng = np.random.default_rng(3)
    X, off, H, Y = _data(rng)
    N, d = Y.shape
    w = None
    extra = {}
    if weighted:
        w = rng.random(N) * 3
        w[::5] = 0.0
        extra["weights"] = w
    data = write(tmp_path / "x.h5", tokens=X, offsets=off, targets=Y, **extra)
    feats_path = tmp_path / "f.h5"
    assert run(["featurize", str(data), "-o", str(feats_path), "-q", "--chunk-size", "9"]) == 0
    feats = Features.load(feats_path)
    ww = np.ones(N) if w is None else w
    assert np.allclose(feats.target_sum, ww @ Y, rtol=1e-12, atol=0)
    assert feats.weight == pytest.approx(ww.sum(), rel=1e-14)
    for src in (data, feats_path):
        model = tmp_path / "m.h5"
        fit = cli_json(capsys, "fit", str(src), "-o", str(model))
        with h5py.File(model) as f:
            coef = f["coef"][()]
            assert f.attrs["train_r2"] == pytest.approx(fit["train_r2"], rel=1e-15)
        want = np_r2(H @ coef.T, Y, w)
        assert 0.1 < want < 0.99
        assert fit["train_r2"] == pytest.approx(want, rel=1e-10)
        pred = cli_json(capsys, "predict", str(model), str(data), "-o", str(tmp_path / "p.h5"), "--chunk-size", "7")
        assert pred["r2"] == pytest.approx(want, rel=1e-12)
    # the human lines
    capsys.readouterr()
    assert run(["fit", str(data), "-o", str(model)]) == 0
    assert f"train R^2 = {fit['train_r2']:.4g}" in capsys.readouterr().err
    assert run(["predict", str(model), str(data), "-o", str(tmp_path / "p.h5")]) == 0
    assert f"R^2 = {pred['r2']:.4g}" in capsys.readouterr().err


def test_target_sum_merges_and_subtracts(tmp_path: Path) -> None:
    from mhla_cli.statistics.accumulate import chunk_features

    rng = np.random.default_rng(4)
    X, off, _, Y = _data(rng, N=40)
    a = chunk_features(X[:off[15]], off[:16], Y[:15], 2)
    b = chunk_features(X[off[15]:], off[15:] - off[15], Y[15:], 2)
    total = a + b
    assert np.allclose(total.target_sum, Y.sum(0), rtol=1e-13) and total.weight == 40
    rest = total - a
    assert np.allclose(rest.target_sum, Y[15:].sum(0), rtol=1e-12) and rest.weight == 25
    assert np.array_equal(total.copy().target_sum, total.target_sum)
    # a part without target_sum (an old file) makes the sum's unknown: R^2 None, not a wrong number
    old = b.copy()
    old.target_sum = None
    mixed = a + old
    assert mixed.target_sum is None and scores.train_r2(mixed, 1.0) is None


def test_old_features_file_reports_r2_null(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(5)
    X, off, _, Y = _data(rng, N=60)
    data = write(tmp_path / "x.h5", tokens=X, offsets=off, targets=Y)
    fp = tmp_path / "f.h5"
    assert run(["featurize", str(data), "-o", str(fp), "-q"]) == 0
    with h5py.File(fp, "a") as f:  # a file written before target_sum was accumulated
        unseal(f)
        del f["target_sum"]
    fit = cli_json(capsys, "fit", str(fp), "-o", str(tmp_path / "m.h5"))
    assert fit["train_r2"] is None and fit["train_mse"] > 0
    with h5py.File(fp, "a") as f:  # a target_sum that is not finite is refused
        unseal(f)
        f["target_sum"] = np.full(Y.shape[1], np.nan)
    assert run(["fit", str(fp), "-o", str(tmp_path / "m2.h5"), "-q"]) == 2


def test_causal_per_position_predict_r2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mhla_cli.model import synthetic

    ds, _ = synthetic.generate_teacher(2, 1, 60, seq_len=(2, 6), seed=6, noise=0.3, read=ReadSpec(samples_of(True)))
    data = tmp_path / "ar.h5"
    ds.save(data, dtype="float64")
    model = tmp_path / "m.h5"
    fit = cli_json(capsys, "fit", str(data), "-o", str(model))
    res = forward_predict_file(model, data)
    want = np_r2(res.outputs, ds.targets)
    assert res.r2 == pytest.approx(want, rel=1e-12)
    assert fit["train_r2"] == pytest.approx(want, rel=1e-9)


def forward_predict_file(model: Path, data: Path) -> Predictions:
    from mhla_cli.model.forward import predict_file
    from mhla_cli.model.model import load_function

    return predict_file(load_function(model), data, causal=True, chunk_size=11)


def test_estimator_score_is_the_same_number() -> None:
    rng = np.random.default_rng(7)
    X, off, H, Y = _data(rng, N=120)
    seqs = [X[off[i]:off[i + 1]] for i in range(len(off) - 1)]
    est = MHLA().fit(seqs, Y)
    pred = est.predict(seqs)
    assert est.score(seqs, Y) == pytest.approx(np_r2(pred, Y), rel=1e-12)
    assert est.score(seqs, Y) == pytest.approx(est.model_.info["train_r2"], rel=1e-9)
    w = rng.random(len(seqs))
    assert est.score(seqs, Y, sample_weight=w) == pytest.approx(np_r2(pred, Y, w), rel=1e-12)
    # constant targets: 1 when predicted exactly, else 0 (scikit-learn's convention)
    assert est.score(seqs, np.full_like(Y, 2.0)) == 0.0


def test_merged_shards_keep_target_sum(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`featurize --shard` parts merged by `mhla merge` carry target_sum: the same train R^2 as one featurize."""
    rng = np.random.default_rng(8)
    X, off, H, Y = _data(rng, N=70)
    data = write(tmp_path / "x.h5", tokens=X, offsets=off, targets=Y)
    for k in (0, 1):
        assert run(["featurize", str(data), "--shard", f"{k}/2", "-o", str(tmp_path / f"p{k + 1}.h5"), "-q"]) == 0
    assert run(["merge", str(tmp_path / "p1.h5"), str(tmp_path / "p2.h5"), "-o", str(tmp_path / "m.h5"), "-q"]) == 0
    merged = Features.load(tmp_path / "m.h5")
    assert np.allclose(merged.target_sum, Y.sum(0), rtol=1e-12) and merged.weight == 70
    a = cli_json(capsys, "fit", str(tmp_path / "m.h5"), "-o", str(tmp_path / "a.h5"))
    b = cli_json(capsys, "fit", str(data), "-o", str(tmp_path / "b.h5"))
    assert a["train_r2"] == pytest.approx(b["train_r2"], rel=1e-10)


# ------------------------------------------------------------------------- R^2 at any scale of the targets
@settings(max_examples=40, deadline=None, derandomize=True)
@given(log_scale=st.floats(-300.0, 99.0), seed=st.integers(0, 2**16))
def test_r2_is_scale_free(log_scale: float, seed: int) -> None:
    """R^2 of predictions c yhat of targets c y is numpy's R^2 of yhat and y (targets up to 1e100, the
    largest accepted, down to 1e-300, whose squares underflow float64), in one piece or merged."""
    rng = np.random.default_rng(seed)
    y = rng.standard_normal((60, 3)) + [2.0, 0.0, -1.0]
    pred = y + 0.3 * rng.standard_normal(y.shape)
    w = rng.random(60)
    c = 10.0 ** log_scale
    want = np_r2(pred, y, w)
    assert r2_of(c * pred, c * y, w) == pytest.approx(want, rel=1e-10)
    parts = Spread()
    for a, b in ((0, 13), (13, 14), (14, 60)):
        parts = parts.merge(Spread.of(c * y[a:b], w[a:b], err=c * (pred[a:b] - y[a:b])))
    assert parts.r2() == pytest.approx(want, rel=1e-10)
    assert parts.mse(3) == pytest.approx(c * c * float(w @ ((pred - y) ** 2).sum(1)) / (3 * w.sum()), rel=1e-10,
                                         abs=1e-300)


def test_tiny_targets_predict_and_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's row: targets x 1e-170 (their squares underflow float64). predict's R^2 was null ("targets do
    not vary") for numpy's 0.99: it is numpy's now. fit's statistics hold those squares as 0: its train R^2
    is null with that reason (a warning), not "do not vary", and its MSE is not claimed below the floor."""
    ds, _ = synthetic.generate_teacher(3, 2, 200, seq_len=(2, 6), seed=3, noise=0.1)
    data, small = tmp_path / "t.h5", tmp_path / "s.h5"
    for path, c in ((data, 1.0), (small, 1e-170)):
        with h5py.File(path, "w") as f:
            f["tokens"], f["offsets"], f["targets"] = ds.tokens, ds.offsets, ds.targets * c
    outs = {}
    for path in (data, small):
        assert run(["fit", str(path), "-o", str(tmp_path / f"m_{path.stem}.h5"), "-q"]) == 0
        capsys.readouterr()
        assert run(["predict", str(tmp_path / f"m_{path.stem}.h5"), str(path), "-o", str(tmp_path / "p.h5"),
                    "--json"]) == 0
        outs[path.stem] = json.loads(capsys.readouterr().out)
    assert outs["s"]["r2"] == pytest.approx(outs["t"]["r2"], rel=1e-12) and 0.9 < outs["t"]["r2"] < 1
    # a features file holds those squares as 0: its train R^2 is null with that reason (a warning)
    assert run(["featurize", str(small), "-o", str(tmp_path / "fs.h5"), "-q"]) == 0
    assert run(["fit", str(tmp_path / "fs.h5"), "-o", str(tmp_path / "m2.h5"), "--json"]) == 0
    cap = capsys.readouterr()
    fit = json.loads(cap.out)
    assert fit["train_r2"] is None and fit["targets_underflow"] is True
    assert "too small for float64's sums of squares" in cap.err and "R^2 null" in cap.err
    assert fit["mse_resolution"] >= 1e-293
    # fit on the tokens file scores them as predict does (issue 43 row 9): predict's R^2, no warning
    assert run(["fit", str(small), "-o", str(tmp_path / "m3.h5"), "--json"]) == 0
    cap = capsys.readouterr()
    fit = json.loads(cap.out)
    assert fit["train_r2"] == pytest.approx(outs["t"]["r2"], rel=1e-10) and fit["train_scored_on"] == "data"
    assert "too small" not in cap.err


@pytest.mark.parametrize("scale", [1e-160, 1.0, 1e98])  # 1e98: targets below the 1e100 mhla accepts
@pytest.mark.parametrize("layout", ["last", "causal"])
def test_fit_r2_at_any_target_scale(tmp_path: Path, capsys: pytest.CaptureFixture[str], scale: float,
                                    layout: str) -> None:
    """Issue 43 row 9: `fit --json`'s train R^2 is numpy's R^2 of the written model's outputs at targets x 1e-160
    (whose squares underflow the statistics: scored on the data), x 1 and x 1e98 (targets above 1e100 are refused),
    weighted, last-token and
    per-position (causal) samples."""
    rng = np.random.default_rng(9)
    lengths = rng.integers(2, 6, 150)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    X = rng.standard_normal((int(off[-1]), 2)) + 0.2
    per = layout == "causal"
    smp = ref.samples(X, off, per_position=per)
    H = np.stack([np_H(Z) for Z, _, _ in smp])
    Y = (H @ rng.standard_normal((H.shape[1], 2)) * 0.3 + rng.standard_normal((H.shape[0], 2))) * scale
    w = rng.uniform(0.2, 2.0, H.shape[0])
    data = tmp_path / "x.h5"
    with h5py.File(data, "w") as f:
        f["tokens"], f["offsets"], f["targets"], f["weights"] = X, off, Y, w
        if per:
            f.attrs["attention"] = "causal"
    fit = cli_json(capsys, "fit", str(data), "-o", str(tmp_path / "m.h5"))
    with h5py.File(tmp_path / "m.h5") as f:
        coef = f["coef"][()]
    want = np_r2(H @ coef.T / scale, Y / scale, w)  # in units of the scale: numpy's squares do not underflow
    assert 0.5 < want < 0.99
    assert fit["train_r2"] == pytest.approx(want, rel=1e-9)
