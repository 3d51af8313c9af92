"""Synthetic data (mhla_cli.model.synthetic): teacher targets and the associative memory against plain numpy."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli.model import synthetic
from mhla_cli.errors import InputError
from mhla_cli.samples import ReadSpec, samples_of


def np_forward(V: np.ndarray, Q: np.ndarray, X: np.ndarray, length_norm: bool = False) -> np.ndarray:
    """Last-token output sum_h V_h X^T X Q_h x_n of one sequence, in plain numpy."""
    S = X.T @ X / (X.shape[0] if length_norm else 1)
    return sum(V[h] @ S @ Q[h] @ X[-1] for h in range(V.shape[0]))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_teacher_targets_are_the_teachers_outputs(dtype: str) -> None:
    ds, teacher = synthetic.generate_teacher(3, 2, 60, "2:9", seed=5, dtype=dtype)
    assert teacher.n_heads == 2 and teacher.d == 3
    # tokens are already rounded to the storage dtype, so the stored data are exactly realisable
    assert np.array_equal(ds.tokens.astype(dtype).astype(np.float64), ds.tokens)
    want = np.stack([np_forward(teacher.V, teacher.Q, ds.sequence(i)) for i in range(ds.n_samples)])
    assert ds.targets.shape == (60, 3)
    np.testing.assert_allclose(ds.targets, want, rtol=0, atol=1e-12 * np.abs(want).max())
    assert np.sqrt(np.mean(ds.targets ** 2)) == pytest.approx(1.0, rel=1e-12)  # outputs scaled to RMS 1


def test_teacher_lengths_within_range_and_noise() -> None:
    ds, _ = synthetic.generate_teacher(2, 1, 400, "3:7", seed=1)
    lengths = np.diff(ds.offsets)
    assert ds.offsets[0] == 0 and ds.offsets[-1] == ds.tokens.shape[0]
    assert lengths.min() == 3 and lengths.max() == 7  # both ends are drawn (400 samples of 5 values)
    fixed, _ = synthetic.generate_teacher(2, 1, 10, 4, seed=1)
    assert (np.diff(fixed.offsets) == 4).all()
    clean, _ = synthetic.generate_teacher(2, 1, 400, "3:7", seed=2)
    noisy, _ = synthetic.generate_teacher(2, 1, 400, "3:7", seed=2, noise=0.1)
    assert np.array_equal(clean.tokens, noisy.tokens)
    assert np.std(noisy.targets - clean.targets) == pytest.approx(0.1, rel=0.1)


def test_teacher_per_position_and_length_normalisation() -> None:
    ds, teacher = synthetic.generate_teacher(2, 2, 8, "1:5", seed=3,
                                             read=ReadSpec(samples_of(True), normalize="length"))
    assert teacher.info["normalize"] == "length"
    assert ds.targets.shape == ds.tokens.shape
    want = []
    for i in range(ds.n_samples):
        X = ds.sequence(i)
        want += [np_forward(teacher.V, teacher.Q, X[:t], length_norm=True) for t in range(1, X.shape[0] + 1)]
    np.testing.assert_allclose(ds.targets, np.array(want), rtol=0, atol=1e-12 * np.abs(want).max())


def test_assoc_structure_and_targets() -> None:
    k, N = 3, 50
    ds, teacher = synthetic.generate_assoc(k, N, orthogonal_fraction=0.4, seed=2)
    assert ds.tokens.shape == (N * (k + 1), 2 * k) and ds.targets.shape == (N, 2 * k)
    n_orth = 0
    for i in range(N):
        X = ds.sequence(i)
        assert X.shape == (k + 1, 2 * k)
        K, Vv, q = X[:k, :k], X[:k, k:], X[k, :k]
        assert not X[k, k:].any()  # the query row is (q, 0)
        want = np.zeros(2 * k)
        for j in range(k):
            want[k:] += np.dot(q, K[j]) * Vv[j]
        np.testing.assert_allclose(ds.targets[i], want, rtol=0, atol=1e-13)
        assert not ds.targets[i, :k].any()
        orth = np.allclose(K @ K.T, np.eye(k), atol=1e-12) and np.allclose(Vv @ Vv.T, np.eye(k), atol=1e-12)
        n_orth += orth
        # the 1-head teacher computes the target exactly
        np.testing.assert_allclose(np_forward(teacher.V, teacher.Q, X), want, rtol=0, atol=1e-13)
    assert n_orth == 20  # round(0.4 * 50); Gaussian samples are never orthogonal
    assert teacher.n_heads == 1


@pytest.mark.parametrize("frac,count", [(0.0, 0), (1.0, 30), (0.95, 28)])
def test_assoc_orthogonal_fraction(frac: float, count: int) -> None:
    ds, _ = synthetic.generate_assoc(2, 30, orthogonal_fraction=frac, seed=7, dtype="float32")
    assert np.array_equal(ds.tokens.astype(np.float32).astype(np.float64), ds.tokens)
    X = ds.tokens.reshape(30, 3, 4)
    K = X[:, :2, :2]
    orth = np.abs(K @ K.transpose(0, 2, 1) - np.eye(2)).max(axis=(1, 2)) < 1e-6  # float32-rounded
    assert int(orth.sum()) == count


def test_dataset_save_layouts(tmp_path: Path) -> None:
    dense, _ = synthetic.generate_teacher(2, 1, 5, 4, seed=0)
    ragged, _ = synthetic.generate_teacher(2, 1, 5, "1:6", seed=0)
    assert len(set(np.diff(ragged.offsets))) > 1
    dense.save(tmp_path / "d.h5", dtype="float32")
    ragged.save(tmp_path / "r.h5", dtype="float64")
    with h5py.File(tmp_path / "d.h5", "r") as f:
        assert "offsets" not in f and f["tokens"].shape == (5, 4, 2) and f["tokens"].dtype == np.float32
        np.testing.assert_array_equal(f["tokens"][()].reshape(-1, 2), dense.tokens.astype(np.float32))
        assert f["targets"].dtype == np.float64
        np.testing.assert_array_equal(f["targets"][()], dense.targets)
    with h5py.File(tmp_path / "r.h5", "r") as f:
        np.testing.assert_array_equal(f["offsets"][()], ragged.offsets)
        np.testing.assert_array_equal(f["tokens"][()], ragged.tokens)
        np.testing.assert_array_equal(f["targets"][()], ragged.targets)


def test_parse_seq_len() -> None:
    assert synthetic.parse_seq_len("7") == (7, 7)
    assert synthetic.parse_seq_len("2:9") == (2, 9)
    assert synthetic.parse_seq_len(4) == (4, 4)
    for bad in ("0", "5:3", "a", "3:", ":4", "0:2", "1.5", -1):
        with pytest.raises(InputError):
            synthetic.parse_seq_len(bad)


@pytest.mark.parametrize("call", [
    lambda: synthetic.generate_teacher(0, 1, 10),
    lambda: synthetic.generate_teacher(2, 0, 10),
    lambda: synthetic.generate_teacher(2, 1, 0),
    lambda: synthetic.generate_teacher(2, 1, 10, noise=-0.1),
    lambda: synthetic.generate_teacher(2, 1, 10, read=ReadSpec(normalize="rms")),
    lambda: synthetic.generate_teacher(2, 1, 10, seq_len="4:2"),
    lambda: synthetic.generate_assoc(0, 10),
    lambda: synthetic.generate_assoc(2, 0),
    lambda: synthetic.generate_assoc(2, 10, orthogonal_fraction=1.5),
    lambda: synthetic.generate_assoc(2, 10, orthogonal_fraction=-0.1),
])
def test_bad_arguments_raise_input_error(call) -> None:
    with pytest.raises(InputError):
        call()
