"""Per-position (causal) data: statistics, fit, predict --causal, normalisation, against plain numpy.

The references materialise the features of every prefix with explicit loops and einsum; they never
call mhla_cli.feature_map or mhla_cli.statistics.stream.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli.model import synthetic
from mhla_cli.cli import run
from mhla_cli.model.heads import p_from_heads
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.stream import featurize
from mhla_cli.samples import ReadSpec, samples_of


def ref_H(X: np.ndarray, normalize: str = "none") -> np.ndarray:
    """Plain-numpy H(X): S[j,k] * x_n[l] for j <= k (j, then k, then l fastest)."""
    d = X.shape[1]
    S = np.einsum("ti,tj->ij", X, X)
    if normalize == "length":
        S = S / X.shape[0]
    out = []
    for j in range(d):
        for k in range(j, d):
            for l in range(d):
                out.append(S[j, k] * X[-1, l])
    return np.array(out)


def ref_causal_stats(X: np.ndarray, off: np.ndarray, Y: np.ndarray, w: np.ndarray | None,
                     normalize: str = "none") -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """gram, moments, target_gram and the weighted count over every prefix of every sequence."""
    G = M = TG = 0.0
    n = 0
    for i in range(off.size - 1):
        for t in range(off[i], off[i + 1]):
            wt = 1.0 if w is None else w[t]
            h = ref_H(X[off[i]:t + 1], normalize)
            G = G + wt * np.outer(h, h)
            M = M + wt * np.outer(h, Y[t])
            TG = TG + wt * np.outer(Y[t], Y[t])
            n += wt > 0
    return G, M, TG, n


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def write(path: Path, **data: np.ndarray) -> Path:
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f[k] = v
    return path


def ragged(rng: np.random.Generator, n_seq: int, d: int, lo: int = 1, hi: int = 9
           ) -> tuple[np.ndarray, np.ndarray]:
    lengths = rng.integers(lo, hi + 1, size=n_seq)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return rng.standard_normal((int(off[-1]), d)), off


@pytest.mark.parametrize("normalize", ["none", "length"])
@pytest.mark.parametrize("weighted", [False, True])
def test_causal_stats_match_reference(tmp_path: Path, normalize: str, weighted: bool) -> None:
    rng = np.random.default_rng(1)
    d = 3
    X, off = ragged(rng, 25, d)
    Y = rng.standard_normal((X.shape[0], d))
    w = None
    data = {"tokens": X, "offsets": off, "targets": Y}
    if weighted:
        w = rng.random(X.shape[0]) * 2
        w[rng.random(X.shape[0]) < 0.3] = 0.0
        data["weights"] = w
    path = write(tmp_path / "c.h5", **data)
    G, M, TG, n = ref_causal_stats(X, off, Y, w, normalize)
    for chunk in (3, None):  # several chunks, one chunk
        f = featurize(path, chunk_size=chunk, normalize=normalize)
        assert f.per_position and f.normalize == normalize
        assert f.n_samples == n and f.n_sequences == 25 and f.n_tokens == X.shape[0]
        assert rel(f.gram, G) < 1e-10 and rel(f.moments, M) < 1e-10 and rel(f.target_gram, TG) < 1e-10
    # last_token_gram: weighted positions only; token_gram: sum of w S_t (unnormalised)
    ww = np.ones(X.shape[0]) if w is None else w
    assert rel(f.last_token_gram, np.einsum("t,ti,tj->ij", ww, X, X)) < 1e-12
    TGk = sum(ww[t] * X[off[i]:t + 1].T @ X[off[i]:t + 1] for i in range(25) for t in range(off[i], off[i + 1]))
    assert rel(f.token_gram, TGk) < 1e-12


def test_weighted_last_token_and_normalized(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    d = 2
    X, off = ragged(rng, 30, d, 1, 6)
    Y = rng.standard_normal((30, d))
    w = rng.random(30)
    w[::4] = 0
    path = write(tmp_path / "l.h5", tokens=X, offsets=off, targets=Y, weights=w)
    f = featurize(path, chunk_size=7, normalize="length")
    assert not f.per_position and f.n_samples == int((w > 0).sum())
    Hs = np.array([ref_H(X[off[i]:off[i + 1]], "length") for i in range(30)])
    assert rel(f.gram, np.einsum("i,ia,ib->ab", w, Hs, Hs)) < 1e-10
    assert rel(f.moments, np.einsum("i,ia,ib->ab", w, Hs, Y)) < 1e-10


def test_dense_and_ragged_per_position_agree(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    N, n, d = 12, 5, 3
    X = rng.standard_normal((N, n, d))
    Y = rng.standard_normal((N, n, d))
    w = (rng.random((N, n)) > 0.3).astype(float)
    dense = write(tmp_path / "d.h5", tokens=X, targets=Y, weights=w)
    flat = write(tmp_path / "r.h5", tokens=X.reshape(-1, d), offsets=np.arange(N + 1) * n,
                 targets=Y.reshape(-1, d), weights=w.reshape(-1))
    dense_t = write(tmp_path / "dt.h5", tokens=X, targets=Y, weights=w.reshape(-1))  # (T,) weights, dense
    a, b, c = (featurize(p, chunk_size=5, normalize="length") for p in (dense, flat, dense_t))
    for k in ("gram", "moments", "target_gram", "token_gram", "last_token_gram"):
        assert rel(getattr(a, k), getattr(b, k)) < 1e-13 and rel(getattr(c, k), getattr(b, k)) < 1e-13
    assert a.n_samples == b.n_samples == int(w.sum())


def test_shards_merge_and_workers_agree(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    X, off = ragged(rng, 40, 2)
    Y = rng.standard_normal((X.shape[0], 2))
    w = (rng.random(X.shape[0]) > 0.2).astype(float)
    path = write(tmp_path / "s.h5", tokens=X, offsets=off, targets=Y, weights=w)
    whole = featurize(path, normalize="length")
    parts = []
    for i in range(3):
        p = tmp_path / f"part{i}.h5"
        assert run(["featurize", str(path), "--shard", f"{i}/3", "-o", str(p), "--normalize", "length", "-q"]) == 0
        parts.append(str(p))
    merged = tmp_path / "m.h5"
    assert run(["merge", *parts, "-o", str(merged), "-q"]) == 0
    m = Features.load(merged)
    assert m.n_samples == whole.n_samples and m.normalize == "length" and m.per_position
    assert rel(m.gram, whole.gram) < 1e-12 and rel(m.moments, whole.moments) < 1e-12
    par = featurize(path, normalize="length", workers=2, chunk_size=4)
    assert rel(par.gram, whole.gram) < 1e-12 and par.n_samples == whole.n_samples
    # mixed normalisations are refused by merge
    other = tmp_path / "other.h5"
    assert run(["featurize", str(path), "--shard", "2/3", "-o", str(other), "-q"]) == 0
    assert run(["merge", parts[0], parts[1], str(other), "-o", str(tmp_path / "bad.h5"), "-q"]) == 2
    assert not (tmp_path / "bad.h5").exists()


def test_fit_recovers_causal_teacher_from_few_sequences(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """10 ragged sequences (N < psi = 18), T >= psi positions: certified, p recovered to 1e-8."""
    d = 3
    ds, teacher = synthetic.generate_teacher(d, 2, 10, "3:12", seed=5, read=ReadSpec(samples_of(True)))
    assert ds.n_samples < 18 <= ds.tokens.shape[0]
    data = tmp_path / "ar.h5"
    ds.save(data, dtype="float64")
    # the saved targets are the teacher's outputs on every prefix (plain loop)
    p_true = p_from_heads(teacher.V, teacher.Q)
    for i in (0, 7):
        for t in range(ds.offsets[i], ds.offsets[i + 1]):
            y = np.einsum("hab,bc,hcl,l->a", teacher.V, ds.tokens[ds.offsets[i]:t + 1].T @
                          ds.tokens[ds.offsets[i]:t + 1], teacher.Q, ds.tokens[t])
            assert np.allclose(ds.targets[t], y, rtol=1e-12, atol=1e-12)
    assert run(["certify", str(data), "-q"]) == 0
    model = tmp_path / "m.h5"
    assert run(["fit", str(data), "-o", str(model), "-q"]) == 0
    from mhla_cli.model.model import Model

    m = Model.load(model)
    assert np.linalg.norm(m.coef - p_true) / np.linalg.norm(p_true) < 1e-8
    # the same from the CLI generator, with normalisation, through a features file
    g = tmp_path / "g.h5"
    th = tmp_path / "th.h5"
    assert run(["generate", "teacher", "-o", str(g), "--dim", "3", "--heads", "2", "--n-samples", "10",
                "--seq-len", "3:12", "--per-position", "--normalize", "length", "--dtype", "float64",
                "--teacher-out", str(th), "-q"]) == 0
    feats = tmp_path / "f.h5"
    assert run(["featurize", str(g), "-o", str(feats), "--normalize", "length", "-q"]) == 0
    assert run(["fit", str(feats), "-o", str(model), "-q"]) == 0
    capsys.readouterr()
    assert run(["compare", str(model), str(th), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["relative_distance"] < 1e-8
    # a features file of another normalisation is refused
    assert run(["fit", str(feats), "-o", str(tmp_path / "x.h5"), "--normalize", "none", "-q"]) == 2


@pytest.mark.parametrize("normalize", ["none", "length"])
def test_predict_causal_matches_plain_loop(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           normalize: str) -> None:
    rng = np.random.default_rng(6)
    d, Hh = 3, 2
    V, Q = rng.standard_normal((Hh, d, d)), rng.standard_normal((Hh, d, d))
    from mhla_cli.model.heads import Heads

    heads = Heads(V=V, Q=Q, info={"normalize": normalize})
    hp = tmp_path / "h.h5"
    heads.save(hp)
    X, off = ragged(rng, 15, d)
    Y = rng.standard_normal((X.shape[0], d))
    w = (rng.random(X.shape[0]) > 0.4).astype(float) * 2.0
    data = write(tmp_path / "x.h5", tokens=X, offsets=off, targets=Y, weights=w)
    out = tmp_path / "p.h5"
    capsys.readouterr()
    assert run(["predict", str(hp), str(data), "-o", str(out), "--causal", "--json", "--chunk-size", "4"]) == 0
    res = json.loads(capsys.readouterr().out)
    ref = np.empty_like(X)
    for i in range(15):
        for t in range(off[i], off[i + 1]):
            P = X[off[i]:t + 1]
            S = P.T @ P / (P.shape[0] if normalize == "length" else 1)
            ref[t] = sum(V[h] @ S @ Q[h] @ X[t] for h in range(Hh))
    with h5py.File(out) as f:
        outputs, pred, offsets = f["outputs"][()], f["predictions"][()], f["offsets"][()]
    assert rel(outputs, ref) < 1e-10
    assert np.array_equal(offsets, off) and rel(pred, ref[off[1:] - 1]) < 1e-10
    mse = float((w * ((ref - Y) ** 2).sum(axis=1)).sum() / (w.sum() * d))  # sum w: the weights carry no units
    assert abs(res["mse"] - mse) < 1e-10 * mse and res["n_scored"] == int((w > 0).sum())
    # workers give the same
    out2 = tmp_path / "p2.h5"
    assert run(["predict", str(hp), str(data), "-o", str(out2), "--causal", "-q", "--workers", "2",
                "--chunk-size", "3"]) == 0
    with h5py.File(out2) as f:
        assert np.array_equal(f["outputs"][()], outputs)


def test_causal_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(7)
    X, off = ragged(rng, 6, 2, 2, 5)
    T = X.shape[0]
    Y = rng.standard_normal((T, 2))
    cases = {
        "neg": dict(tokens=X, offsets=off, targets=Y, weights=-np.ones(T)),
        "nan": dict(tokens=X, offsets=off, targets=Y, weights=np.r_[np.ones(T - 1), np.nan]),
        "wshape": dict(tokens=X, offsets=off, targets=Y, weights=np.ones(T + 1)),
        "wseq": dict(tokens=X, offsets=off, targets=Y, weights=np.ones(6)),  # per-sequence weights, per-position y
        "wpos": dict(tokens=X, offsets=off, targets=Y[:6], weights=np.ones(T)),  # the converse
        "tshape": dict(tokens=X, offsets=off, targets=Y[:-1]),
        "zero": dict(tokens=X, offsets=off, targets=Y, weights=np.zeros(T)),
        "w2d": dict(tokens=X, offsets=off, targets=Y, weights=np.ones((T, 1))),
        "wstr": dict(tokens=X, offsets=off, targets=Y, weights=np.array([b"a"] * T)),
        "dense_t": dict(tokens=X[:6].reshape(3, 2, 2), targets=rng.standard_normal((6, 2))),  # (T, d) w/ dense
    }
    for name, data in cases.items():
        p = write(tmp_path / f"{name}.h5", **data)
        out = tmp_path / f"{name}.out.h5"
        capsys.readouterr()
        assert run(["featurize", str(p), "-o", str(out)]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("mhla: error:") and err.count("\n") == 1, (name, err)
        assert "weight" in err or "targets" in err, (name, err)
        assert not out.exists()
    good = write(tmp_path / "good.h5", tokens=X, offsets=off, targets=Y)
    for args in (["featurize", str(good), "-o", str(tmp_path / "o.h5"), "--normalize", "sqrt"],
                 ["predict", str(good), str(good), "-o", str(tmp_path / "o.h5"), "--causal"]):
        assert run(args) == 2 and not (tmp_path / "o.h5").exists()
    model = tmp_path / "m.h5"
    assert run(["fit", str(good), "-o", str(model), "-q"]) == 0
    assert run(["predict", str(model), str(good), "-o", str(tmp_path / "o.h5"), "--causal",
                "--all-positions"]) == 2
    assert run(["certify", str(good), "--witness", str(tmp_path / "w.h5")]) == 2
    # compare refuses models of different normalisations
    m2 = tmp_path / "m2.h5"
    assert run(["fit", str(good), "-o", str(m2), "--normalize", "length", "-q"]) == 0
    assert run(["compare", str(model), str(m2)]) == 2


def test_folds_keep_normalisation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A features file with stored folds records --normalize; a fit from it predicts with it."""
    ds, teacher = synthetic.generate_teacher(2, 1, 40, "2:6", seed=8,
                                             read=ReadSpec(samples_of(True), normalize="length"))
    data = tmp_path / "ar.h5"
    ds.save(data, dtype="float64")
    feats = tmp_path / "f.h5"
    assert run(["featurize", str(data), "-o", str(feats), "--folds", "3", "--normalize", "length", "-q"]) == 0
    f = Features.load(feats)
    assert f.normalize == "length" and f.per_position and f.n_sequences == 40
    model = tmp_path / "m.h5"
    assert run(["fit", str(feats), "-o", str(model), "--heads", "auto", "-q"]) == 0
    capsys.readouterr()
    assert run(["predict", str(model), str(data), "-o", str(tmp_path / "p.h5"), "--causal", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mse"] < 1e-12
