"""Algorithm 1 recovers random teachers exactly, in both layouts and both float dtypes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from _reference import canonical, predict_canonical, predict_own, ridge_function
from mhla_cli.statistics import basis
import pytest

from conftest import write_tokens
from mhla_cli.model import synthetic
from mhla_cli import certify, export_heads, featurize, fit, predict
from mhla_cli.model.heads import p_from_heads


def np_features(X: np.ndarray) -> np.ndarray:
    """H(X) from its definition in plain numpy: S[j,k] * x_n[l], j <= k, l fastest."""
    S = np.einsum("tj,tk->jk", X, X)
    j, k = np.triu_indices(X.shape[1])
    return np.einsum("p,l->pl", S[j, k], X[-1]).ravel()


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def teacher_data(d: int, H: int, N: int, lengths: tuple[int, int], seed: int, dtype: str):
    """Tokens rounded to `dtype`, targets computed exactly (float64) from the rounded tokens."""
    rng = np.random.default_rng(seed)
    teacher = synthetic.random_teacher(d, H, rng)
    L = rng.integers(lengths[0], lengths[1] + 1, size=N)
    offsets = np.concatenate([[0], np.cumsum(L)])
    tokens = rng.standard_normal((offsets[-1], d)).astype(dtype)
    y = predict(teacher, tokens.astype(np.float64), offsets)
    return tokens, offsets, y, teacher


@pytest.mark.parametrize("d", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_exact_recovery_ragged(tmp_path: Path, d: int, dtype: str) -> None:
    psi = d * d * (d + 1) // 2
    tokens, offsets, y, teacher = teacher_data(d, 2, 4 * psi + 20, (1, 8), seed=d, dtype=dtype)
    assert (np.diff(offsets) == 1).any()  # includes sequences of length 1
    path = write_tokens(tmp_path / "data.h5", tokens, offsets, y)
    feats = featurize(path, chunk_size=29)
    assert certify(feats).identifiable
    model = fit(feats)
    assert rel(model.coef, teacher.coef) < 1e-8
    heads = export_heads(model)
    # Predictions on longer, unseen sequences (lengths 20..60) match the teacher's.
    rng = np.random.default_rng(100 + d)
    for n in (20, 60):
        X = rng.standard_normal((5, n, d))
        np.testing.assert_allclose(predict(heads, X), predict(teacher, X), rtol=1e-7,
                                   atol=1e-7 * np.abs(predict(teacher, X)).max())


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_exact_recovery_dense_layout(tmp_path: Path, dtype: str) -> None:
    d, n, N = 3, 6, 120
    tokens, offsets, y, teacher = teacher_data(d, 1, N, (n, n), seed=11, dtype=dtype)
    path = write_tokens(tmp_path / "dense.h5", tokens.reshape(N, n, d), None, y)
    model = fit(featurize(path))
    assert rel(model.coef, teacher.coef) < 1e-8
    assert model.info["train_mse"] <= 10 * model.info["mse_resolution"]


def test_noisy_labels_give_least_squares_solution(tmp_path: Path) -> None:
    """With label noise the fit is the least-squares solution of the explicit design matrix, and its
    error against the teacher is exactly the least-squares image of the (known) noise."""
    ds, teacher = synthetic.generate_teacher(2, 1, 200, "1:5", noise=0.1, seed=4)
    path = tmp_path / "noisy.h5"
    ds.save(path, dtype="float64")
    model = fit(featurize(path))
    F = np.stack([np_features(ds.sequence(i)) for i in range(ds.n_samples)])
    ref, *_ = np.linalg.lstsq(F, ds.targets, rcond=None)
    np.testing.assert_allclose(model.coef, ref.T, rtol=1e-9, atol=1e-9 * np.abs(ref).max())
    mse = float(np.mean((F @ ref - ds.targets) ** 2))
    assert abs(model.info["train_mse"] - mse) <= 1e-9 * mse
    p_true = p_from_heads(teacher.V, teacher.Q)
    noise = ds.targets - F @ p_true.T  # the label noise, known exactly
    e, *_ = np.linalg.lstsq(F, noise, rcond=None)
    np.testing.assert_allclose(model.coef - p_true, e.T, rtol=0, atol=1e-9 * np.linalg.norm(p_true))
    # ... of the size least squares predicts, sigma * sqrt(d tr((F^T F)^-1)) (a chi variable, 12 dof)
    expected = 0.1 * np.sqrt(ds.targets.shape[1] * np.trace(np.linalg.inv(F.T @ F)))
    assert 0.3 < np.linalg.norm(model.coef - p_true) / expected < 3


def test_ridge_shrinks_and_matches_closed_form(tmp_path: Path, teacher_file) -> None:
    data, _, ds = teacher_file
    feats = featurize(data)
    lam = 0.5
    model = fit(feats, ridge=lam)
    # the ridge acts on the canonical coefficients (in the units of the certificate's lambda_max):
    # the same function as the closed form on the materialised canonical features
    ref = canonical(ds.tokens, ds.offsets, ds.targets)
    rng = np.random.default_rng(0)
    Zs = [rng.standard_normal((n, ds.tokens.shape[1])) for n in (1, 2, 5, 9)]
    want = predict_canonical(ridge_function(ref, lam), ref["A"], Zs)
    np.testing.assert_allclose(predict_own(model.coef, Zs), want, rtol=0, atol=1e-9 * np.abs(want).max())
    pb = lambda m: basis.coef_to_basis(feats.basis, m.coef)  # noqa: E731
    assert np.linalg.norm(pb(model)) < np.linalg.norm(pb(fit(feats)))
