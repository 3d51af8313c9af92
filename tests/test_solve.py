"""Certificate verdicts (Lemma 2.3) on the full and the observed domain, and the least-squares fit (mhla_cli.solve)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import write_tokens
from mhla_cli import certify, featurize, fit, synthetic


def feats_of(tmp_path: Path, ds: synthetic.Dataset, dtype: str = "float64", name: str = "d.h5"):
    path = tmp_path / name
    ds.save(path, dtype=dtype)
    return featurize(path)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gaussian_teacher_with_many_samples_is_identifiable(tmp_path: Path, dtype: str) -> None:
    ds, _ = synthetic.generate_teacher(3, 2, 400, "2:10", seed=1)
    cert = certify(feats_of(tmp_path, ds, dtype))
    assert cert.identifiable and cert.rank == cert.n_features == 18
    assert cert.lambda_min > cert.threshold > 0
    assert cert.threshold == pytest.approx(18 * np.finfo(float).eps * cert.lambda_max)
    assert cert.reasons == []


def test_too_few_samples(tmp_path: Path) -> None:
    ds, _ = synthetic.generate_teacher(3, 1, 10, "5", seed=2)
    cert = certify(feats_of(tmp_path, ds))
    assert not cert.identifiable
    assert cert.rank <= 10
    assert any("N = 10 samples < 18 features" in r for r in cert.reasons)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_zero_coordinate_fails_full_passes_observed(tmp_path: Path, dtype: str) -> None:
    rng = np.random.default_rng(5)
    N, n, d = 300, 6, 3
    X = rng.standard_normal((N, n, d)).astype(dtype)
    X[:, :, 1] = 0
    path = write_tokens(tmp_path / "z.h5", X, None, rng.standard_normal((N, d)))
    feats = featurize(path)
    full = certify(feats)
    assert not full.identifiable
    assert any("coordinate(s) 1 are always 0" in r for r in full.reasons)
    assert all("1" in f["feature"] for f in full.null_features[:5])
    obs = certify(feats, domain="observed")
    assert obs.identifiable
    assert (obs.dim_tokens, obs.dim_last_tokens, obs.n_features) == (2, 2, 6)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_orthogonal_assoc_fails_on_both_domains(tmp_path: Path, dtype: str) -> None:
    ds, teacher = synthetic.generate_assoc(3, 2000, orthogonal_fraction=1.0, seed=0)
    feats = feats_of(tmp_path, ds, dtype)
    for domain in ("full", "observed"):
        cert = certify(feats, domain=domain)
        assert not cert.identifiable, domain
        assert cert.lambda_min / cert.lambda_max < 1e-13
    # The data still fit the teacher exactly (realisable): the certificate is about uniqueness.
    assert fit(feats).info["train_mse"] < 1e-12


def test_gaussian_assoc_fails_full_passes_observed(tmp_path: Path) -> None:
    ds, _ = synthetic.generate_assoc(3, 2000, orthogonal_fraction=0.0, seed=0)
    feats = feats_of(tmp_path, ds, "float32")
    full = certify(feats)
    assert not full.identifiable
    assert any("last-token coordinate(s) 3, 4, 5 are always 0" in r for r in full.reasons)
    obs = certify(feats, domain="observed")
    assert obs.identifiable
    assert obs.dim_tokens == 6 and obs.dim_last_tokens == 3


def test_min_eig_demands_a_margin(tmp_path: Path) -> None:
    ds, _ = synthetic.generate_teacher(2, 1, 200, "3:6", seed=9)
    feats = feats_of(tmp_path, ds)
    cert = certify(feats)
    assert cert.identifiable
    strict = certify(feats, min_eig=2 * cert.lambda_min)
    assert not strict.identifiable and strict.threshold == 2 * cert.lambda_min
    assert strict.margin == pytest.approx(-cert.lambda_min)


def test_verdict_invariant_to_token_scale(tmp_path: Path) -> None:
    ds, _ = synthetic.generate_teacher(2, 1, 100, "1:6", seed=4)
    verdicts = []
    for s in (1e-3, 1.0, 1e3):
        scaled = synthetic.Dataset(ds.tokens * s, ds.offsets, ds.targets)
        verdicts.append(certify(feats_of(tmp_path, scaled, name=f"s{s}.h5")).identifiable)
    assert verdicts == [True, True, True]


def _np_features(X: np.ndarray) -> np.ndarray:
    """H(X) materialised in plain numpy (S[j,k] x_n[l], j <= k, l fastest)."""
    d = X.shape[1]
    S = X.T @ X
    return np.array([S[j, k] * X[-1, l] for j in range(d) for k in range(j, d) for l in range(d)])


@pytest.mark.parametrize("scaled", [False, True])
def test_eigenvalues_match_materialised_features(tmp_path: Path, scaled: bool) -> None:
    """lambda_min / lambda_max of the full domain and of the observed domain's Lambda' against
    eigvalsh of the features materialised in plain numpy (of the tokens X A, A the stored basis)."""
    rng = np.random.default_rng(8)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(2, 9, size=300))])
    tokens = rng.standard_normal((int(offsets[-1]), 3))
    if scaled:
        tokens = tokens * np.array([1.0, 1.0, 1 / 300])
    path = write_tokens(tmp_path / "t.h5", tokens, offsets)
    feats = featurize(path)
    Xb = tokens @ feats.basis
    F = np.stack([_np_features(Xb[a:b]) for a, b in zip(offsets[:-1], offsets[1:])])
    w = np.linalg.eigvalsh(F.T @ F / len(F))
    cert = certify(feats)
    assert cert.lambda_min == pytest.approx(w[0], rel=1e-8)
    assert cert.lambda_max == pytest.approx(w[-1], rel=1e-10)
    # observed domain: tokens in a 2-d subspace, last tokens everywhere; reduced features of
    # X_b B and C^T x_n for orthonormal bases B, C of the spans of X_b and of the last tokens
    tokens2 = tokens[:, :2] @ rng.standard_normal((2, 3))
    last = offsets[1:] - 1
    tokens2[last] = rng.standard_normal((last.size, 3))
    path2 = write_tokens(tmp_path / "t2.h5", tokens2, offsets)
    feats2 = featurize(path2)
    cert2 = certify(feats2, domain="observed")
    from mhla_cli.solve import _observed_bases_b

    B, C = _observed_bases_b(feats2)
    assert (B.shape[1], C.shape[1]) == (3, 3)  # the last tokens span R^3, so U = R^3 too
    Xb2 = tokens2 @ feats2.basis
    Fr = []
    for a, b in zip(offsets[:-1], offsets[1:]):
        Z = Xb2[a:b] @ B
        S = Z.T @ Z
        xn = C.T @ Xb2[b - 1]
        r = B.shape[1]
        Fr.append([S[j, k] * xn[l] for j in range(r) for k in range(j, r) for l in range(C.shape[1])])
    Fr = np.array(Fr)
    w2 = np.linalg.eigvalsh(Fr.T @ Fr / len(Fr))
    assert cert2.lambda_min == pytest.approx(w2[0], rel=1e-8)
    assert cert2.lambda_max == pytest.approx(w2[-1], rel=1e-10)
