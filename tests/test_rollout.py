"""`mhla rollout` equals a plain autoregressive loop, with and without --snap."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli.cli import run
from mhla_cli.heads import Heads


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
