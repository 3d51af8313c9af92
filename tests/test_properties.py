"""Property tests (hypothesis) over random ragged shapes, dtypes, chunk sizes and scales."""

from __future__ import annotations

import tempfile
from pathlib import Path

import h5py
import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mhla_cli.feature_map import cubic_features, n_features
from mhla_cli.model.heads import p_from_heads
from mhla_cli.model.forward import predict
from mhla_cli.numerics import EPS
from mhla_cli import certify
from mhla_cli.solve.lstsq import fit
from mhla_cli.statistics.stream import featurize
from mhla_cli.model.synthetic import random_teacher

def np_features(X: np.ndarray) -> np.ndarray:
    """H(X) from its definition in plain numpy: S[j,k] * x_n[l], j <= k, l fastest."""
    S = np.einsum("tj,tk->jk", X, X)
    j, k = np.triu_indices(X.shape[1])
    return np.einsum("p,l->pl", S[j, k], X[-1]).ravel()


SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def datasets(draw: st.DrawFn, min_n: int = 1, max_n: int = 60) -> dict:
    d = draw(st.integers(1, 4))
    N = draw(st.integers(min_n, max_n))
    max_len = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(st.sampled_from(["float32", "float64", "int16"]))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(1, max_len + 1, size=N))]).astype(np.int64)
    if dtype == "int16":
        tokens = rng.integers(-9, 10, size=(int(offsets[-1]), d)).astype(np.int16)
    else:
        tokens = (rng.standard_normal((int(offsets[-1]), d)) * scale).astype(dtype)
    targets = rng.standard_normal((N, d))
    return {"d": d, "tokens": tokens, "offsets": offsets, "targets": targets, "dtype": dtype, "scale": scale}


def _write(dir_: str, name: str, data: dict, tokens: np.ndarray | None = None,
           targets: np.ndarray | None = None) -> Path:
    path = Path(dir_) / name
    with h5py.File(path, "w") as f:
        f["tokens"] = data["tokens"] if tokens is None else tokens
        f["offsets"] = data["offsets"]
        f["targets"] = data["targets"] if targets is None else targets
    return path


@SETTINGS
@given(data=datasets(), chunk=st.integers(1, 70))
def test_gram_symmetric_psd_and_chunk_invariant(data: dict, chunk: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(tmp, "t.h5", data)
        whole = featurize(path, chunk_size=10**6)
        parts = featurize(path, chunk_size=chunk)
    psi = n_features(data["d"])
    G = whole.gram
    assert G.shape == (psi, psi) and whole.n_samples == len(data["offsets"]) - 1
    scale = max(float(np.abs(G).max()), 1e-300)
    np.testing.assert_array_equal(G, G.T)
    w = np.linalg.eigvalsh(G)
    assert w[0] >= -psi * EPS * max(w[-1], 0) * 10, (w[0], w[-1])
    # chunking only reorders float64 sums
    for name in ("gram", "moments", "target_gram", "token_gram", "last_token_gram"):
        a, b = getattr(whole, name), getattr(parts, name)
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-12 * max(float(np.abs(a).max()), 1e-300))
    # the statistics are the sums of the per-sequence cubic features
    X = data["tokens"].astype(np.float64)
    H = np.stack([cubic_features(X[a:b]) for a, b in zip(data["offsets"][:-1], data["offsets"][1:])])
    np.testing.assert_allclose(G, H.T @ H, rtol=0, atol=1e-12 * scale)


@SETTINGS
@given(data=datasets(max_n=80))
def test_certify_verdict_invariant_to_scaling(data: dict) -> None:
    """Multiplying the tokens by 1e-3 or 1e3 scales Lambda_D and the threshold by c^6 alike."""
    X = data["tokens"].astype(np.float64)
    verdicts, ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for c in (1e-3, 1.0, 1e3):
            path = _write(tmp, f"s{c:g}.h5", data, tokens=X * c)  # float64: the scaling is exact
            cert = certify(featurize(path))
            verdicts.append(cert.identifiable)
            ratios.append(cert.lambda_min / cert.lambda_max if cert.lambda_max > 0 else 0.0)
    assert verdicts[0] == verdicts[1] == verdicts[2], ratios
    event(f"identifiable={verdicts[0]}")
    # and the verdict is numpy's: the materialised features have full column rank
    F = np.stack([np_features(X[a:b]) for a, b in zip(data["offsets"][:-1], data["offsets"][1:])])
    assert verdicts[1] == (np.linalg.matrix_rank(F) == F.shape[1]), ratios
    psi = n_features(data["d"])
    if len(data["offsets"]) - 1 < psi:
        assert verdicts == [False] * 3  # N >= psi is necessary


@SETTINGS
@given(d=st.integers(1, 3), heads=st.integers(1, 3), extra=st.integers(5, 40), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from(["float32", "float64", "int16"]), scale=st.sampled_from([1e-3, 1.0, 1e3]),
       chunk=st.integers(1, 50))
def test_recovery_when_identifiable(d: int, heads: int, extra: int, seed: int, dtype: str, scale: float,
                                   chunk: int) -> None:
    """Realisable data: with a certificate fit recovers the teacher's p (to the conditioning); without one,
    numpy confirms the features are rank deficient."""
    rng = np.random.default_rng(seed)
    psi = n_features(d)
    N = psi + extra
    offsets = np.concatenate([[0], np.cumsum(rng.integers(1, 8, size=N))]).astype(np.int64)
    if dtype == "int16":
        stored = rng.integers(-5, 6, size=(int(offsets[-1]), d)).astype(np.int16)
    else:
        stored = (rng.standard_normal((int(offsets[-1]), d)) * scale).astype(dtype)
    teacher = random_teacher(d, heads, rng)
    y = np.asarray(predict(teacher, stored.astype(np.float64), offsets))  # exact labels of the stored data
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(tmp, "t.h5", {"tokens": stored, "offsets": offsets, "targets": y})
        feats = featurize(path, chunk_size=chunk)
    cert = certify(feats)
    event(f"identifiable={cert.identifiable}")
    model = fit(feats)
    assert model.info["train_mse"] <= 10 * model.info["mse_resolution"]  # realisable: interpolates either way
    if not cert.identifiable:
        # e.g. integer tokens that happen to be degenerate. The verdict must be right: numpy finds the
        # materialised features rank deficient.
        X = stored.astype(np.float64)
        F = np.stack([np_features(X[a:b]) for a, b in zip(offsets[:-1], offsets[1:])])
        assert np.linalg.matrix_rank(F) < psi
        return
    p_true = p_from_heads(teacher.V, teacher.Q)
    cond = cert.lambda_max / cert.lambda_min
    err = np.linalg.norm(model.coef - p_true) / np.linalg.norm(p_true)
    assert err < max(1e-9, 1e3 * cond * EPS), (err, cond)
