"""Certificate verdicts (Lemma 2.3) on the full and the observed domain, their explanation and repr (mhla_cli.solve.certificate)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from _reference import canonical, canonical_features, inv_sqrt
from conftest import write_tokens
from mhla_cli.model import synthetic
from mhla_cli import certify, featurize, fit


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


def _rotation(seed: int, d: int) -> np.ndarray:
    return np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))[0]


@pytest.mark.parametrize("change", ["coordinate scales (1, 1e-6)", "coordinate scales (1e4, 1)",
                                    "a rotation", "scales (1, 1e-3), then a rotation"])
def test_verdict_invariant_to_token_scale(tmp_path: Path, change: str) -> None:
    """Tokens X T for an invertible T (other units per coordinate, a rotation, both) give the certificate of
    X: the same verdict and the same lambda_min / lambda_max, which equal plain numpy's on the whitened
    features materialised (tests/_reference.py). One factor on every token would not tell: any relative
    threshold passes that; the raw (unwhitened) Gram of tokens X diag(1, 1e-6) has lambda_min / lambda_max
    ~ 1e-37 and is rejected, so certifying the raw Gram fails here."""
    ds, _ = synthetic.generate_teacher(2, 1, 100, "1:6", seed=4)
    T = {"coordinate scales (1, 1e-6)": np.diag([1.0, 1e-6]),
         "coordinate scales (1e4, 1)": np.diag([1e4, 1.0]),
         "a rotation": _rotation(1, 2),
         "scales (1, 1e-3), then a rotation": np.diag([1.0, 1e-3]) @ _rotation(2, 2)}[change]
    base = certify(feats_of(tmp_path, ds, name="base.h5"))
    w = canonical(ds.tokens, ds.offsets)["eigenvalues"]
    assert base.identifiable and base.lambda_min == pytest.approx(w[0], rel=1e-9)
    changed = certify(feats_of(tmp_path, synthetic.Dataset(ds.tokens @ T, ds.offsets, ds.targets), name="T.h5"))
    assert changed.identifiable and changed.rank == base.rank == 6
    # whitening X T takes out T up to an orthogonal matrix: float64 keeps ~ eps * cond(T)^2 of it
    rel = 1e-9 if change != "scales (1, 1e-3), then a rotation" else 1e-6
    assert changed.lambda_min == pytest.approx(w[0], rel=rel)
    assert changed.lambda_max == pytest.approx(w[-1], rel=rel)


def _np_features(X: np.ndarray) -> np.ndarray:
    """H(X) materialised in plain numpy (S[j,k] x_n[l], j <= k, l fastest)."""
    d = X.shape[1]
    S = X.T @ X
    return np.array([S[j, k] * X[-1, l] for j in range(d) for k in range(j, d) for l in range(d)])


@pytest.mark.parametrize("scaled", [False, True])
def test_eigenvalues_match_materialised_features(tmp_path: Path, scaled: bool) -> None:
    """lambda_min / lambda_max of the full domain and of the observed domain against eigvalsh of the
    canonical features materialised in plain numpy (tests/_reference.py: whitened tokens,
    orthonormal coordinates), whatever the token units."""
    rng = np.random.default_rng(8)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(2, 9, size=300))])
    tokens = rng.standard_normal((int(offsets[-1]), 3))
    if scaled:
        tokens = tokens * np.array([1.0, 1.0, 1 / 300])
    path = write_tokens(tmp_path / "t.h5", tokens, offsets)
    w = canonical(tokens, offsets)["eigenvalues"]
    cert = certify(featurize(path))
    assert cert.lambda_min == pytest.approx(w[0], rel=1e-8)
    assert cert.lambda_max == pytest.approx(w[-1], rel=1e-10)
    # observed domain: every token in a 2-d subspace of R^3; the reference whitens inside the span
    # (an orthonormal basis B of the whitened tokens) and takes the canonical features of X A B
    tokens2 = tokens[:, :2] @ rng.standard_normal((2, 3))
    if scaled:
        tokens2 = tokens2 * np.array([1.0, 1.0, 1 / 300])
    cert2 = certify(featurize(write_tokens(tmp_path / "t2.h5", tokens2, offsets)), domain="observed")
    G = tokens2.T @ tokens2 / tokens2.shape[0]
    U = np.linalg.svd(tokens2, full_matrices=False)[2][:2].T  # span of the tokens (own coordinates)
    Z = tokens2 @ U  # coordinates in the span, then whitened there
    A = inv_sqrt(U.T @ G @ U)
    Ht = np.stack([canonical_features(Z[a:b] @ A) for a, b in zip(offsets[:-1], offsets[1:])])
    w2 = np.linalg.eigvalsh(Ht.T @ Ht / len(Ht))
    assert (cert2.dim_tokens, cert2.dim_last_tokens, cert2.n_features) == (2, 2, 6)
    assert cert2.lambda_min == pytest.approx(w2[0], rel=1e-8)
    assert cert2.lambda_max == pytest.approx(w2[-1], rel=1e-10)


def test_certificate_repr_is_short_and_shows_no_arrays(tmp_path: Path) -> None:
    ds, _ = synthetic.generate_teacher(3, 2, 200, "8", seed=1)
    ds.save(tmp_path / "d.h5")
    cert = certify(featurize(tmp_path / "d.h5"))
    r = repr(cert)
    assert r.startswith("Certificate(identifiable=True, domain='full', lambda_min=") and "rank=18/18" in r
    assert "array" not in r and "\n" not in r and len(r) < 200


def test_a_domain_object_certifies_as_its_name(tmp_path: Path) -> None:
    """certify takes a domain by name or as the object (mhla_cli.solve.domains), and each gives its own
    domain's certificate, checked against plain numpy: the observed domain's spectrum on the whitened spans
    of the tokens (tests/_reference.py), the full domain's on all canonical features. The associative
    memory's queries (q, 0) leave half of the full domain's features unexcited, so the two disagree."""
    from mhla_cli.solve.certificate import Certificate
    from mhla_cli.solve.domains import FULL, OBSERVED

    from _reference import observed_eigenvalues

    ds, _ = synthetic.generate_assoc(3, 400, orthogonal_fraction=0.0, seed=0)
    feats = feats_of(tmp_path, ds)
    ref = canonical(ds.tokens, ds.offsets)
    w_obs, dim_u, dim_un = observed_eigenvalues(ds.tokens, ds.offsets, ref["A"])
    w_full = ref["eigenvalues"]
    assert w_obs[0] > 1e-6 * w_obs[-1] and w_full[0] < 1e-12 * w_full[-1]  # the case tells the domains apart
    for domain in ("observed", OBSERVED):
        cert = certify(feats, domain=domain)
        assert isinstance(cert, Certificate) and cert.domain == "observed" and cert.identifiable
        assert (cert.dim_tokens, cert.dim_last_tokens, cert.n_features) == (dim_u, dim_un, w_obs.size)
        assert cert.lambda_min == pytest.approx(w_obs[0], rel=1e-8)
        assert cert.lambda_max == pytest.approx(w_obs[-1], rel=1e-10)
    for domain in ("full", FULL):
        cert = certify(feats, domain=domain)
        assert cert.domain == "full" and not cert.identifiable and cert.n_features == w_full.size
        assert cert.lambda_max == pytest.approx(w_full[-1], rel=1e-10)
    by_object = certify(feats, domain=OBSERVED)
    assert by_object.device is None  # where the factorization ran (numpy), not in the JSON
    assert "device" not in by_object.to_dict()
