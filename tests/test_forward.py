"""The forward pass (mhla_cli.forward): forward_heads, predict_chunk and `mhla rollout` against plain numpy loops."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli import features, forward, heads
from mhla_cli.cli import run
from mhla_cli.errors import InputError
from mhla_cli.heads import Heads
from mhla_cli.model import Model


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
    pred, outputs = forward.predict_chunk(heads.p_from_heads(V, Q), tokens, offsets, all_positions=True)
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
