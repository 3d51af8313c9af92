"""The forward pass (mhla_cli.model.forward): forward_heads, predict_chunk, snap_to, `mhla rollout` and the MSE of
`mhla predict` against plain numpy loops."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mhla_cli import feature_map as features
from mhla_cli.model import forward
from mhla_cli.model import heads
from mhla_cli.cli import run
from mhla_cli.errors import InputError
from mhla_cli.model.heads import Heads
from mhla_cli.model.model import Model
from mhla_cli.samples import BIDIRECTIONAL


def write(path: Path, **data: np.ndarray) -> Path:
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f[k] = v
    return path


def plain_rollout(V: np.ndarray, Q: np.ndarray, X: np.ndarray, steps: int, normalize: str,
                  codebook: np.ndarray | None) -> np.ndarray:
    """Recompute the last-token output of the whole sequence at every step (no running sums)."""
    X = X.copy()
    for _ in range(steps):
        S = X.T @ X / (X.shape[0] if normalize == "length" else 1)
        y = sum(V[h] @ S @ Q[h] @ X[-1] for h in range(V.shape[0]))
        if codebook is not None:
            y = codebook[int(np.argmin(np.linalg.norm(codebook - y, axis=1)))]
        X = np.vstack([X, y])
    return X


@pytest.mark.parametrize("normalize", ["none", "length"])
@pytest.mark.parametrize("snap", [False, True])
def test_rollout_equals_plain_loop(tmp_path: Path, capsys: pytest.CaptureFixture[str], normalize: str,
                                   snap: bool) -> None:
    rng = np.random.default_rng(0)
    d, steps = 3, 4
    V = rng.standard_normal((2, d, d)) * 0.3
    Q = rng.standard_normal((2, d, d)) * 0.3
    hp = tmp_path / "h.h5"
    Heads(V=V, Q=Q, info={"normalize": normalize}).save(hp)
    lengths = rng.integers(1, 7, size=9)
    off = np.concatenate([[0], np.cumsum(lengths)])
    X = rng.standard_normal((int(off[-1]), d)) * 0.7
    data = write(tmp_path / "x.h5", tokens=X.astype(np.float32), offsets=off)
    X = X.astype(np.float32).astype(np.float64)
    C = rng.standard_normal((11, d)) if snap else None
    args = ["rollout", str(hp), str(data), "--steps", str(steps), "-o", str(tmp_path / "o.h5"), "--json",
            "--chunk-size", "4"]
    if snap:
        args += ["--snap", str(write(tmp_path / "cb.h5", codebook=C))]
    capsys.readouterr()
    assert run(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["n_tokens"] == X.shape[0] + 9 * steps
    with h5py.File(tmp_path / "o.h5") as f:
        assert f.attrs["mhla_kind"] == "tokens"
        tok, noff = f["tokens"][()], f["offsets"][()]
    assert np.array_equal(noff, off + steps * np.arange(10))
    for i in range(9):
        ref = plain_rollout(V, Q, X[off[i]:off[i + 1]], steps, normalize, C)
        got = tok[noff[i]:noff[i + 1]]
        if snap:
            assert np.array_equal(got, ref)
        else:
            assert np.allclose(got, ref, rtol=1e-10, atol=1e-12 * np.abs(ref).max())
    # the output feeds back into mhla
    assert run(["predict", str(hp), str(tmp_path / "o.h5"), "-o", str(tmp_path / "p.h5"), "--causal", "-q"]) == 0


def test_rollout_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(1)
    hp = tmp_path / "h.h5"
    Heads(V=rng.standard_normal((1, 2, 2)), Q=rng.standard_normal((1, 2, 2))).save(hp)
    data = write(tmp_path / "x.h5", tokens=rng.standard_normal((3, 4, 2)))
    big = write(tmp_path / "big.h5", tokens=rng.standard_normal((3, 4, 2)) * 1e30)
    out = tmp_path / "o.h5"
    cbs = {"wrong_d": dict(codebook=np.ones((3, 3))), "empty": dict(codebook=np.ones((0, 2))),
           "nan": dict(codebook=np.array([[np.nan, 0.0]])), "missing": dict(vocab=np.ones((3, 2)))}
    cases = [["rollout", str(hp), str(data), "--steps", "0", "-o", str(out)],
             ["rollout", str(hp), str(data), "-o", str(out)],  # --steps is required
             ["rollout", str(hp), str(big), "--steps", "30", "-o", str(out)],  # diverges
             ["rollout", str(data), str(data), "--steps", "2", "-o", str(out)],  # not a model
             ["rollout", str(hp), str(data), "--steps", "2", "-o", str(data)]]  # overwrites an input
    for name, cb in cbs.items():
        cases.append(["rollout", str(hp), str(data), "--steps", "2", "-o", str(out), "--snap",
                      str(write(tmp_path / f"{name}.h5", **cb))])
    for args in cases:
        capsys.readouterr()
        assert run(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("mhla: error:") and err.count("\n") == 1, err
        assert not out.exists()


def plain_forward(V: np.ndarray, Q: np.ndarray, X: np.ndarray, t: int) -> np.ndarray:
    H, d, _ = V.shape
    S = X.T @ X
    y = np.zeros(d)
    for h in range(H):
        y += V[h] @ (S @ (Q[h] @ X[t]))
    return y


@pytest.mark.parametrize("d,H", [(2, 1), (3, 2), (4, 5)])
def test_p_of_heads_reproduces_forward(d: int, H: int) -> None:
    rng = np.random.default_rng(d + H)
    V = rng.standard_normal((H, d, d))
    Q = rng.standard_normal((H, d, d))
    p = heads.p_from_heads(V, Q)
    for n in (1, 3, 17):
        X = rng.standard_normal((n, d))
        expect = plain_forward(V, Q, X, n - 1)
        np.testing.assert_allclose(p @ features.cubic_features(X), expect, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(forward.forward_heads(V, Q, X), expect, rtol=1e-12, atol=1e-12)
        allpos = forward.forward_heads(V, Q, X, all_positions=True)
        np.testing.assert_allclose(allpos, [plain_forward(V, Q, X, t) for t in range(n)], rtol=1e-12, atol=1e-12)


def test_predict_chunk_all_positions_matches_reference() -> None:
    rng = np.random.default_rng(7)
    d, H = 3, 2
    V = rng.standard_normal((H, d, d))
    Q = rng.standard_normal((H, d, d))
    lengths = np.array([1, 5, 2, 9])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.standard_normal((offsets[-1], d))
    pred, outputs = forward.predict_chunk(heads.p_from_heads(V, Q), tokens, offsets, BIDIRECTIONAL)
    assert pred.shape == (lengths.size, d) and outputs.shape == (offsets[-1], d)
    for i in range(lengths.size):
        X = tokens[offsets[i]:offsets[i + 1]]
        n = X.shape[0]
        np.testing.assert_allclose(pred[i], plain_forward(V, Q, X, n - 1), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(outputs[offsets[i]:offsets[i + 1]],
                                   [plain_forward(V, Q, X, t) for t in range(n)], rtol=1e-12, atol=1e-12)


def test_predict_layouts_and_length_normalisation() -> None:
    """predict on (N, n, d) and on (T, d) + offsets, from heads, a Model and a p array, with and without
    normalize="length" (S / n), against the plain loop."""
    rng = np.random.default_rng(11)
    d, H, N, n = 3, 2, 5, 4
    V = rng.standard_normal((H, d, d))
    Q = rng.standard_normal((H, d, d))
    X = rng.standard_normal((N, n, d))
    p = heads.p_from_heads(V, Q)
    plain = np.stack([plain_forward(V, Q, X[i], n - 1) for i in range(N)])
    offsets = np.arange(N + 1) * n
    for fn in (Heads(V=V, Q=Q), Model(coef=p, W=heads.W_from_p(p), d=d), p):
        np.testing.assert_allclose(forward.predict(fn, X), plain, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(forward.predict(fn, X.reshape(-1, d), offsets), plain, rtol=1e-12, atol=1e-12)
    hn = Heads(V=V, Q=Q, info={"normalize": "length"})
    np.testing.assert_allclose(forward.predict(hn, X), plain / n, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(forward.forward_heads(V, Q, X[0], normalize="length"), plain[0] / n,
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(InputError):
        forward.predict(p, X.reshape(-1, d))  # (T, d) without offsets
    with pytest.raises(InputError):
        forward.predict(p, rng.standard_normal((N, n, d + 1)))  # wrong d


@pytest.mark.parametrize("normalize", ["none", "length"])
def test_predict_causal_is_the_last_token_output_of_every_prefix(normalize: str) -> None:
    rng = np.random.default_rng(12)
    d, H = 2, 3
    V = rng.standard_normal((H, d, d))
    Q = rng.standard_normal((H, d, d))
    lengths = np.array([3, 1, 6])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.standard_normal((offsets[-1], d))
    out = forward.predict_causal(Heads(V=V, Q=Q, info={"normalize": normalize}), tokens, offsets)
    want = []
    for i in range(lengths.size):
        X = tokens[offsets[i]:offsets[i + 1]]
        for t in range(1, X.shape[0] + 1):
            want.append(plain_forward(V, Q, X[:t], t - 1) / (t if normalize == "length" else 1))
    np.testing.assert_allclose(out, np.array(want), rtol=1e-11, atol=1e-12)


# --------------------------------------------------------------------------------------------
# snap_to: the nearest codebook row, exact at any magnitude
# --------------------------------------------------------------------------------------------


def brute_snap(C: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Nearest row by brute force, in coordinates shifted by the codebook's mean (well conditioned)."""
    m = C.mean(axis=0)
    return np.argmin((((y - m)[:, None, :] - (C - m)[None]) ** 2).sum(-1), axis=1)


def test_snap_to_is_exact_near_1e8() -> None:
    """Issue: outputs near 1e8 snapped to a row 0.3 away instead of the one 0.2 away (the expanded
    |c|^2 - 2 y.c + |y|^2 cancels catastrophically)."""
    C = 1e8 + np.array([[0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [10.0, 0.0, 0.0], [0.0, 0.5, 0.0]])
    y = 1e8 + np.array([[0.3, 0.0, 0.0],  # 0.3 from row 0, 0.2 from row 1
                        [0.2, 0.0, 0.0],  # 0.2 from row 0, 0.3 from row 1
                        [9.5, 0.0, 0.0],  # row 2
                        [0.0, 0.3, 0.0],  # 0.3 from row 0, 0.2 from row 3
                        [0.25, 0.0, 0.0],  # tie of rows 0 and 1: the lowest index
                        [0.0, 0.25, 0.0]])  # tie of rows 0 and 3
    assert forward.snap_to(C, y).tolist() == [1, 0, 2, 3, 0, 0]
    assert forward.snap_to(C[::-1].copy(), y).tolist() == [2, 3, 1, 0, 2, 0]  # ties: lowest index again
    # many rows on a grid of 1e8 + k/4 (exact), several blocks of y and of pairs
    rng = np.random.default_rng(3)
    C = 1e8 + rng.integers(-40, 41, size=(3000, 5)) / 4.0
    y = 1e8 + rng.integers(-160, 161, size=(300, 5)) / 16.0
    exact = (((y - 1e8)[:, None, :] - (C - 1e8)[None]) ** 2).sum(-1)  # exact on this grid
    want = np.argmin(exact, axis=1)
    for block in (4096, 7, 1):
        assert np.array_equal(forward.snap_to(C, y, block=block), want)
    assert np.array_equal(brute_snap(C, y), want)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(n_c=st.integers(1, 40), n_y=st.integers(1, 30), d=st.integers(1, 6), seed=st.integers(0, 2**31 - 1),
       offset=st.sampled_from([0.0, 1.0, -3e4, 1e8, 2.0**40]), step=st.sampled_from([2.0**-4, 1.0, 2.0**5]),
       near=st.booleans())
def test_snap_to_matches_brute_force(n_c: int, n_y: int, d: int, seed: int, offset: float, step: float,
                                     near: bool) -> None:
    """snap_to = the exact nearest row (lowest index on ties) on a grid where exact distances are
    computable, = the mean-shifted brute force up to exact ties, and = it on generic floats."""
    rng = np.random.default_rng(seed)
    Ci = rng.integers(-6, 7, size=(n_c, d))
    yi = Ci[rng.integers(0, n_c, size=n_y)] + rng.integers(-2, 3, size=(n_y, d)) if near \
        else rng.integers(-12, 13, size=(n_y, d))
    C, y = offset + Ci * step, offset + yi * step  # exactly representable
    exact = ((yi[:, None, :] - Ci[None]) ** 2).sum(-1)  # integers: exact, ties included
    got = forward.snap_to(C, y, block=int(rng.integers(1, 9)))
    assert np.array_equal(got, np.argmin(exact, axis=1))
    ref = brute_snap(C, y)
    rows = np.arange(n_y)
    assert np.array_equal(exact[rows, got], exact[rows, ref])  # the brute force may break exact ties otherwise
    # generic floats (no exact ties): the well-conditioned brute force is the reference
    Cf = offset + rng.standard_normal((n_c, d)) * step
    yf = offset + rng.standard_normal((n_y, d)) * step * (0.1 if near else 3.0)
    assert np.array_equal(forward.snap_to(Cf, yf), brute_snap(Cf, yf))


# --------------------------------------------------------------------------------------------
# mhla predict: the weighted MSE of last-token data (the same as fit's and predict --causal's)
# --------------------------------------------------------------------------------------------


def np_H(X: np.ndarray, normalize: str) -> np.ndarray:
    """H(X) from its definition: S[j,k] * x_n[l], j <= k, l fastest (S / n with normalize="length")."""
    S = X.T @ X / (X.shape[0] if normalize == "length" else 1)
    j, k = np.triu_indices(X.shape[1])
    return np.einsum("p,l->pl", S[j, k], X[-1]).ravel()


def cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    capsys.readouterr()
    assert run([*args, "--json", "-q"]) == 0, args
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("layout", ["ragged", "dense"])
@pytest.mark.parametrize("normalize", ["none", "length"])
def test_plain_predict_mse_is_weighted(tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str,
                                       normalize: str) -> None:
    """Issue: plain `mhla predict` ignored the weights (N,) of last-token data (unweighted mean over
    every sequence, weight-0 ones included); fit and predict --causal report the weighted MSE."""
    rng = np.random.default_rng(21)
    d, N = 2, 60
    lengths = rng.integers(1, 7, size=N) if layout == "ragged" else np.full(N, 4)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    X = rng.standard_normal((int(off[-1]), d))
    Y = rng.standard_normal((N, d))  # noise: a large MSE, so fit's train_mse (from the statistics) is exact
    w = rng.random(N) * 3
    w[::3] = 0.0
    Y[::3] *= 50.0  # masked sequences with large errors: ignoring the weights is plain to see
    tokens = {"tokens": X, "offsets": off} if layout == "ragged" else {"tokens": X.reshape(N, 4, d)}
    data = write(tmp_path / "x.h5", **tokens, targets=Y, weights=w)
    model = tmp_path / "m.h5"
    fit = cli_json(capsys, "fit", str(data), "-o", str(model), "--normalize", normalize)
    plain = cli_json(capsys, "predict", str(model), str(data), "-o", str(tmp_path / "p.h5"), "--chunk-size", "7")
    par = cli_json(capsys, "predict", str(model), str(data), "-o", str(tmp_path / "q.h5"), "--chunk-size", "5",
                   "--workers", "2")
    causal = cli_json(capsys, "predict", str(model), str(data), "-o", str(tmp_path / "c.h5"), "--causal")
    with h5py.File(model) as f:
        coef = f["coef"][()]
    H = np.array([np_H(X[off[i]:off[i + 1]], normalize) for i in range(N)])
    err = ((H @ coef.T - Y) ** 2).sum(axis=1)
    want = float(w @ err / (w.sum() * d))  # sum w: the weights carry no units
    assert fit["n_samples"] == plain["n_scored"] == causal["n_scored"] == par["n_scored"] == int((w > 0).sum())
    for got in (fit["train_mse"], plain["mse"], par["mse"], causal["mse"]):
        assert abs(got - want) <= 1e-12 * want, (got, want)
    assert abs(plain["mse"] - err.mean() / d) > 0.5 * want  # not the unweighted mean of before
    with h5py.File(tmp_path / "p.h5") as f:
        assert f["predictions"].shape == (N, d)  # weight-0 sequences are still predicted
    # without weights: the plain mean over every sequence, as before
    nw = write(tmp_path / "nw.h5", **tokens, targets=Y)
    res = cli_json(capsys, "predict", str(model), str(nw), "-o", str(tmp_path / "nwp.h5"))
    assert abs(res["mse"] - err.mean() / d) <= 1e-12 * res["mse"] and res["n_scored"] == N


def test_plain_predict_checks_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Negative or NaN weights are an input error for plain predict too (as for --causal and fit)."""
    rng = np.random.default_rng(22)
    hp = tmp_path / "h.h5"
    Heads(V=rng.standard_normal((1, 2, 2)), Q=rng.standard_normal((1, 2, 2))).save(hp)
    X, Y = rng.standard_normal((5, 3, 2)), rng.standard_normal((5, 2))
    for name, w in {"neg": np.array([1.0, -1.0, 1.0, 1.0, 1.0]), "nan": np.r_[np.ones(4), np.nan]}.items():
        data = write(tmp_path / f"{name}.h5", tokens=X, targets=Y, weights=w)
        for extra in ([], ["--causal"]):
            capsys.readouterr()
            assert run(["predict", str(hp), str(data), "-o", str(tmp_path / "p.h5"), *extra]) == 2
            err = capsys.readouterr().err
            assert err.startswith("mhla: error:") and "weights" in err, err
            assert not (tmp_path / "p.h5").exists()


# ------------------------------------------------------------- heads evaluated directly (HeadsFn)


def _ragged(rng: np.random.Generator, d: int, lengths: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    X = rng.standard_normal((sum(lengths), d))
    return X, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


@pytest.mark.parametrize("normalize", ["none", "length"])
def test_rectangular_heads_against_the_reference_forward_pass(normalize: str) -> None:
    """Last-token, every-position and causal outputs of V (H, d_out, d) heads equal forward_heads."""
    rng = np.random.default_rng(4)
    V, Q = rng.standard_normal((3, 2, 5)), rng.standard_normal((3, 5, 5))
    X, off = _ragged(rng, 5, (1, 4, 2, 6))
    h = Heads.from_arrays(V, Q, normalize)
    fn = forward.direct(h)
    assert isinstance(fn, forward.HeadsFn) and fn.shape == (2, 5)
    pred, outs = forward.predict_chunk(fn, X, off, BIDIRECTIONAL, normalize=normalize)
    causal = forward.causal_chunk(fn, X, off, normalize=normalize)
    for i in range(off.size - 1):
        Xi = X[off[i]:off[i + 1]]
        assert np.allclose(pred[i], forward.forward_heads(V, Q, Xi, normalize=normalize), rtol=1e-12, atol=1e-12)
        assert np.allclose(outs[off[i]:off[i + 1]], forward.forward_heads(V, Q, Xi, True, normalize),
                           rtol=1e-12, atol=1e-12)
        for t in range(1, Xi.shape[0] + 1):
            assert np.allclose(causal[off[i] + t - 1], forward.forward_heads(V, Q, Xi[:t], normalize=normalize),
                               rtol=1e-12, atol=1e-12)
    assert np.allclose(forward.predict(h, X, off), pred, rtol=0, atol=0)


def test_wide_square_heads_are_evaluated_directly_as_the_coef_would(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    V, Q = rng.standard_normal((2, 4, 4)), rng.standard_normal((2, 4, 4))
    X, off = _ragged(rng, 4, (3, 1, 5))
    h = Heads.from_arrays(V, Q)
    assert forward.direct(h) is None  # small: through the coef
    want, want_all = forward.predict_chunk(h.coef, X, off, BIDIRECTIONAL)
    want_causal = forward.causal_chunk(h.coef, X, off)
    monkeypatch.setattr(forward.evaluate, "DIRECT_COEF_BYTES", 0)
    fn = forward.direct(h)
    assert fn is not None
    got, got_all = forward.predict_chunk(fn, X, off, BIDIRECTIONAL)
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12) and np.allclose(got_all, want_all, rtol=1e-12, atol=1e-12)
    assert np.allclose(forward.causal_chunk(fn, X, off), want_causal, rtol=1e-12, atol=1e-12)


def test_rollout_refuses_rectangular_heads(tmp_path: Path) -> None:
    from mhla_cli import write_tokens

    rng = np.random.default_rng(6)
    h = Heads.from_arrays(rng.standard_normal((1, 2, 3)), rng.standard_normal((1, 3, 3)))
    data = tmp_path / "t.h5"
    write_tokens(data, rng.standard_normal((4, 2, 3)))
    with pytest.raises(InputError, match="need equal widths"):
        forward.rollout_file(h, data, tmp_path / "o.h5", 2)


# --------------------------------------------------------------------------------------------
# the function at extreme conditioning: predict in the model's canonical coordinates
# --------------------------------------------------------------------------------------------


def _squashed(rng: np.random.Generator, R: np.ndarray, n: int, std: float) -> np.ndarray:
    """n length-1 sequences (tokens (n, d)) whose rotated last direction has standard deviation std."""
    Z = rng.standard_normal((n, R.shape[0]))
    Z[:, -1] *= std
    return Z @ R.T


@pytest.mark.parametrize("std", [1e-6, 1e-5, 1e-4])
def test_fit_predicts_the_teacher_at_extreme_conditioning(tmp_path: Path, std: float) -> None:
    """Length-1 sequences (d = 3, N = 420) with a rotated direction of std 1e-6..1e-4: fit + predict on
    40 fresh inputs like the data equal the teacher to 1e-8 (the coefficients on the tokens' own
    features lose ~cond(A)^3 eps; predict evaluates the canonical ones, Model.evaluation), in memory,
    through a model file and through predict_file; the file keeps `coef` = p_b M_A for h5py users."""
    from _reference import canonical, min_norm_function, predict_canonical, ratio
    from mhla_cli.model import synthetic
    from mhla_cli import certify
    from mhla_cli.solve.lstsq import fit
    from mhla_cli.statistics.accumulate import chunk_features

    rng = np.random.default_rng(41)
    d, N = 3, 420
    R = np.linalg.qr(rng.standard_normal((d, d)))[0]
    X = _squashed(rng, R, N, std)
    off = np.arange(N + 1)
    teacher = synthetic.random_teacher(d, 2, rng)
    y = forward.predict(teacher, X, off)
    feats = chunk_features(X, off, y, d)
    assert certify(feats).rank == 10  # length 1: S = x x^T, features x (x) x (x) x span 10 directions
    model = fit(feats)
    Z = _squashed(rng, R, 40, std)
    zoff = np.arange(41)
    want = forward.predict(teacher, Z, zoff)
    assert ratio(forward.predict(model, Z, zoff), want) < 1e-8
    # the reference: the minimum-norm fit on the materialised canonical features
    ref = canonical(X, off, y)
    assert ratio(predict_canonical(min_norm_function(ref), ref["A"], [Z[i:i + 1] for i in range(40)]), want) < 1e-8
    path = tmp_path / "m.h5"
    model.save(path)
    back = Model.load(path)
    assert ratio(forward.predict(back, Z, zoff), want) < 1e-8
    with h5py.File(path) as f:
        assert np.array_equal(f["coef"][()], model.coef) and "canonical_coef" in f and "canonical_basis" in f
    data = tmp_path / "z.h5"
    with h5py.File(data, "w") as f:
        f["tokens"], f["offsets"], f["targets"] = Z, zoff, want
    res = forward.predict_file(back, data)
    assert ratio(res.predictions, want) < 1e-8
    causal = forward.predict_file(back, data, causal=True)
    assert ratio(causal.outputs, want) < 1e-8  # length 1: every prefix is the sequence
    # the record: the arrays only when nothing was written, the scores when the data have targets
    assert list(res.to_dict()) == ["n_samples", "d", "normalize", "predictions", "mse", "r2", "n_scored", "scored_as"]
    assert list(causal.to_dict())[3:6] == ["predictions", "outputs", "offsets"] and res.mse < 1e-12
    written = forward.predict_file(back, data, tmp_path / "p.h5")
    assert written.predictions is None and list(written.to_dict()) == ["n_samples", "d", "normalize", "mse", "r2",
                                                                      "n_scored", "scored_as"]
    assert repr(written).startswith("Predictions(n_samples=")
    assert ratio(forward.predict_causal(back, Z, zoff), want) < 1e-8


def test_formats_md_gives_one_weighted_mse_and_predict_follows_it(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """docs/ gave two formulas for the weighted MSE (sum w r^2 / (d sum w) in "Weights",
    / (#{w > 0} d) in "predictions"); every weighted MSE formula in docs/ now divides by d sum w, and predict
    --causal on per-position weights follows it (numpy: sum_t w_t ||out_t - y_t||^2 / (d sum_t w_t))."""
    import re

    docs = Path(__file__).resolve().parent.parent / "docs"
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(docs.glob("*.md")))
    formulas = re.findall(r"sum_(\w) w_\1 \|\|[^|]*\|\|\^2\s*/\s*\(([^)]*)\)", text)
    assert len(formulas) >= 4, formulas
    for idx, denominator in formulas:
        assert re.sub(r"\s+", " ", denominator) == f"d sum_{idx} w_{idx}", denominator
    assert "#{i: w_i > 0} d" not in text and "#{t: w_t > 0} d" not in text
    rng = np.random.default_rng(5)
    d, N, n = 2, 30, 5
    X = rng.standard_normal((N * n, d))
    Y = rng.standard_normal((N * n, d))
    w = rng.random(N * n) * 2
    w[::4] = 0.0
    data = write(tmp_path / "x.h5", tokens=X, offsets=np.arange(N + 1) * n, targets=Y, weights=w)
    coef = rng.standard_normal((d, features.n_features(d)))
    model = tmp_path / "m.h5"
    Model(coef=coef, W=heads.W_from_p(coef), d=d).save(model)
    out = cli_json(capsys, "predict", str(model), str(data), "-o", str(tmp_path / "p.h5"), "--causal")
    H = np.array([np_H(X[i * n:i * n + t + 1], "none") for i in range(N) for t in range(n)])
    err = ((H @ coef.T - Y) ** 2).sum(axis=1)
    want = float(w @ err / (d * w.sum()))
    assert abs(out["mse"] - want) <= 1e-12 * want and out["n_scored"] == int((w > 0).sum())
    assert abs(out["mse"] - float(w @ err) / (d * (w > 0).sum())) > 1e-3 * want  # not the other formula


# Relative error of the scores of one function summed in different orders (float64).
SCORE_ROUNDING = 1e-10


def test_contradicting_output_layouts_are_refused(tmp_path: Path) -> None:
    """causal with all_positions, or a layout beside either, is an InputError naming both, before any output."""
    from mhla_cli import write_tokens
    from mhla_cli.samples import CAUSAL

    rng = np.random.default_rng(5)
    fn = Heads(V=rng.standard_normal((1, 2, 2)), Q=rng.standard_normal((1, 2, 2)), info={"normalize": "none"})
    data = tmp_path / "d.h5"
    write_tokens(data, [rng.standard_normal((3, 2))], targets=rng.standard_normal((1, 2)))
    with pytest.raises(InputError, match="causal and all_positions cannot be combined"):
        forward.predict_file(fn, data, causal=True, all_positions=True)
    with pytest.raises(InputError, match="beside causal or all_positions"):
        forward.predict_file(fn, data, all_positions=True, layout=CAUSAL)
    assert forward.predict_file(fn, data, causal=True, layout=CAUSAL).n_samples == 1  # the same layout twice


@pytest.mark.parametrize("attention", ["bidirectional", None, "causal"])
def test_all_positions_scores_per_position_targets(attention: str | None, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """predict --all-positions of a last-token function scores its outputs (the whole window's S) against
    per-position targets: MSE and R^2 of numpy on the windows (weighted positions, one masked out), for targets
    marked bidirectional or unmarked (then said so on stderr); targets marked causal are a decoder's prefixes:
    not scored, and the message names --causal. Without --all-positions nothing is scored and the message names
    the option that scores."""
    from mhla_cli import write_tokens
    from mhla_cli.model import synthetic

    rng = np.random.default_rng(11)
    d, lens = 3, [4, 2, 5]
    teacher = synthetic.random_teacher(d, 2, rng)
    fn = Heads(V=teacher.V + 0.1 * rng.standard_normal(teacher.V.shape), Q=teacher.Q, info={"normalize": "none"})
    wins = [rng.standard_normal((k, d)) for k in lens]

    def outputs(h: Heads, X: np.ndarray) -> np.ndarray:  # numpy: sum_h V_h X^T X Q_h x_t at every t
        return np.stack([sum(h.V[g] @ X.T @ X @ h.Q[g] @ x for g in range(h.V.shape[0])) for x in X])

    Y = np.concatenate([outputs(teacher, X) for X in wins]) + 0.05 * rng.standard_normal((sum(lens), d))
    w = rng.uniform(0.5, 2.0, sum(lens))
    w[3] = 0.0
    data = tmp_path / "d.h5"
    write_tokens(data, wins, targets=np.split(Y, np.cumsum(lens)[:-1]), weights=np.split(w, np.cumsum(lens)[:-1]),
                 attention=attention)
    hp = tmp_path / "h.h5"
    fn.save(hp)
    res = forward.predict_file(fn, data, all_positions=True)
    P = np.concatenate([outputs(fn, X) for X in wins])
    assert np.abs(res.outputs - P).max() <= SCORE_ROUNDING * np.abs(P).max()
    if attention == "causal":
        assert res.n_scored is None and res.mse is None
    else:
        mean = (w @ Y) / w.sum()
        sse, sst = float(w @ ((P - Y) ** 2).sum(1)), float(w @ ((Y - mean) ** 2).sum(1))
        assert res.n_scored == len(w) - 1 and res.scored_as == "bidirectional"
        assert res.mse == pytest.approx(sse / (d * w.sum()), rel=SCORE_ROUNDING)
        assert res.r2 == pytest.approx(1 - sse / sst, rel=SCORE_ROUNDING)
    capsys.readouterr()
    assert run(["predict", str(hp), str(data), "-o", str(tmp_path / "p.h5"), "--all-positions", "--json"]) == 0
    cap = capsys.readouterr()
    rec = json.loads(cap.out)
    if attention == "causal":
        assert "mse" not in rec and "--causal scores every prefix" in cap.err
    else:
        assert rec["mse"] == res.mse and rec["r2"] == res.r2 and rec["scored_as"] == "bidirectional"
        assert ("has no 'attention' attribute" in cap.err) == (attention is None)
    assert run(["predict", str(hp), str(data), "-o", str(tmp_path / "p2.h5"), "--json"]) == 0
    cap = capsys.readouterr()
    assert "mse" not in json.loads(cap.out)
    assert ("--causal" if attention == "causal" else "--all-positions") in cap.err
