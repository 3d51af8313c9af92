"""certify's numerical trust: exact rank deficiency is rejected and full rank (even at
lambda_min / lambda_max ~ 1e-10) is accepted, at float32 and float64 storage and at any scale."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np

from mhla_cli import basis
import pytest

from mhla_cli import synthetic
from mhla_cli.cli import run
from mhla_cli.solve import EPS, Certificate, certify, fit, numerical_tolerance
from mhla_cli.stream import featurize

DTYPES = ["float32", "float64"]
SCALES = [1e-3, 1.0, 1e3]


def _certify(tmp: Path, tokens: np.ndarray, offsets: np.ndarray, dtype: str, scale: float = 1.0,
             domain: str = "full", targets: np.ndarray | None = None) -> Certificate:
    path = tmp / f"t_{dtype}_{scale:g}.h5"
    with h5py.File(path, "w") as f:
        f["tokens"] = (tokens * scale).astype(dtype)
        f["offsets"] = offsets
        if targets is not None:
            f["targets"] = targets
    return certify(featurize(path, chunk_size=97), domain=domain)


def _ragged(rng: np.random.Generator, N: int, d: int, lo: int = 2, hi: int = 8) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.concatenate([[0], np.cumsum(rng.integers(lo, hi + 1, size=N))])
    return rng.standard_normal((int(offsets[-1]), d)), offsets


def _check(c: Certificate, identifiable: bool) -> None:
    assert c.identifiable is identifiable, (c.lambda_min, c.lambda_max, c.threshold, c.reasons)
    assert c.numerical_tolerance == pytest.approx(c.n_features * EPS * c.lambda_max, rel=1e-12)
    assert c.margin == pytest.approx(c.lambda_min - c.threshold)
    assert (c.margin > 0) is identifiable


# --------------------------------------------------------------------------------------------
# rank deficient in exact arithmetic: rejected at both storage precisions and every scale
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_duplicated_samples_beyond_psi(dtype: str, scale: float, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tok, off = _ragged(rng, 6, 3)  # 6 distinct samples, psi = 18
    seqs = [tok[off[i]:off[i + 1]] for i in range(6)] * 12  # N = 72 > psi
    tokens = np.concatenate(seqs)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    c = _certify(tmp_path, tokens, offsets, dtype, scale)
    _check(c, False)
    assert c.n_samples == 72 and c.rank == 6
    # well below: exact duplicates stay exact duplicates, only the eigensolver's rounding (~0.1x the
    # psi * eps * lambda_max bound) lifts the null eigenvalues
    assert abs(c.lambda_min) < 0.25 * c.threshold


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_zero_coordinate(dtype: str, scale: float, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    tokens, offsets = _ragged(rng, 300, 3)
    tokens[:, 1] = 0.0
    c = _certify(tmp_path, tokens, offsets, dtype, scale)
    _check(c, False)
    assert any("coordinate(s) 1 are always 0" in r for r in c.reasons)
    # on the observed domain (the plane the tokens span) the same data are identifiable
    _check(_certify(tmp_path, tokens, offsets, dtype, scale, domain="observed"), True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_orthogonal_assoc_keys(dtype: str, scale: float, tmp_path: Path) -> None:
    """sum_j k_j k_j^T = I for orthogonal keys makes features collinear: lambda_min = 0 exactly;
    storing the keys in float32 lifts it only to second order (~1e-16 relative)."""
    ds, _ = synthetic.generate_assoc(2, 1500, orthogonal_fraction=1.0, seed=3, dtype=dtype)
    c = _certify(tmp_path, ds.tokens, ds.offsets, dtype, scale, domain="observed")
    _check(c, False)
    assert c.lambda_min / c.lambda_max < 1e-3 * c.n_features * EPS
    # Gaussian keys: the same construction is identifiable on the observed domain
    ds, _ = synthetic.generate_assoc(2, 1500, orthogonal_fraction=0.0, seed=3, dtype=dtype)
    _check(_certify(tmp_path, ds.tokens, ds.offsets, dtype, scale, domain="observed"), True)


# --------------------------------------------------------------------------------------------
# full rank: accepted, down to lambda_min / lambda_max ~ 1e-10
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_well_conditioned(dtype: str, scale: float, tmp_path: Path) -> None:
    tokens, offsets = _ragged(np.random.default_rng(2), 300, 3)
    c = _certify(tmp_path, tokens, offsets, dtype, scale)
    _check(c, True)
    assert c.lambda_min / c.lambda_max > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_badly_conditioned_full_rank(dtype: str, scale: float, tmp_path: Path) -> None:
    """A strongly anisotropic token covariance (scales 1, 1, 1/33): cubic features spread the
    eigenvalues of the raw Lambda_D over ~10 decades, yet the data are full rank and must pass; in
    the whitened solver basis the spread is that of isotropic tokens."""
    tokens, offsets = _ragged(np.random.default_rng(2), 300, 3)
    tokens = tokens * np.array([1.0, 1.0, 1.0 / 33.0])
    c = _certify(tmp_path, tokens, offsets, dtype, scale)
    _check(c, True)
    # independent reference: the raw features materialised in plain numpy
    X = (tokens * scale).astype(dtype).astype(np.float64)
    iu = np.triu_indices(3)
    F = np.stack([np.einsum("p,l->pl", (X[a:b].T @ X[a:b])[iu], X[b - 1]).ravel()
                  for a, b in zip(offsets[:-1], offsets[1:])])
    raw = np.linalg.svd(F, compute_uv=False) ** 2
    assert 1e-11 < raw[-1] / raw[0] < 1e-9, raw[-1] / raw[0]
    assert raw[-1] / raw[0] < np.sqrt(EPS) and raw[-1] / raw[0] < np.finfo(np.float32).eps
    ratio = c.lambda_min / c.lambda_max
    assert ratio > 1e-3 and c.basis == "canonical"
    assert c.lambda_min > 1e3 * c.threshold


def test_verdict_is_scale_invariant_at_every_margin(tmp_path: Path) -> None:
    """Tokens scaled by c: the canonical lambda_min, lambda_max and threshold do not move at all."""
    tokens, offsets = _ragged(np.random.default_rng(5), 200, 2)
    rel = []
    for scale in SCALES:
        c = _certify(tmp_path, tokens, offsets, "float64", scale)
        rel.append((c.lambda_min, c.lambda_max, c.threshold))
    np.testing.assert_allclose(rel, [rel[1]] * 3, rtol=1e-9)


def test_observed_subspace_of_rank_3_float64(tmp_path: Path) -> None:
    """Tokens in a random 3-d subspace of R^6: float64 accumulation lifts the null directions of the
    token Gram to ~1.6e-15 relative, above d * eps; domain_map's tolerance must still see dim 3."""
    rng = np.random.default_rng(1)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(2, 8, size=1500))])
    A = rng.standard_normal((3, 6))
    tokens = rng.standard_normal((int(offsets[-1]), 3)) @ A
    for dtype in DTYPES:
        c = _certify(tmp_path, tokens, offsets, dtype, domain="observed")
        assert (c.dim_tokens, c.dim_last_tokens) == (3, 3)
        _check(c, True)


def test_numerical_tolerance_rule() -> None:
    assert numerical_tolerance(2.0, 10) == 10 * EPS * 2.0
    assert numerical_tolerance(-1.0, 10) == 0.0


# --------------------------------------------------------------------------------------------
# what the CLI reports
# --------------------------------------------------------------------------------------------


def test_certify_json_reports_threshold_and_margin(tmp_path: Path, capsys) -> None:
    tokens, offsets = _ragged(np.random.default_rng(2), 300, 3)
    good = tmp_path / "good.h5"
    bad = tmp_path / "bad.h5"
    with h5py.File(good, "w") as f:
        f["tokens"], f["offsets"] = tokens.astype(np.float32), offsets
    tokens[:, 2] = 0
    with h5py.File(bad, "w") as f:
        f["tokens"], f["offsets"] = tokens.astype(np.float32), offsets
    for path, code in ((good, 0), (bad, 1)):
        assert run(["certify", str(path), "--json", "-q"]) == code
        rep = json.loads(capsys.readouterr().out)
        assert rep["numerical_tolerance"] == pytest.approx(rep["n_features"] * EPS * rep["lambda_max"])
        assert rep["threshold"] == rep["numerical_tolerance"]
        assert rep["margin"] == pytest.approx(rep["lambda_min"] - rep["threshold"])
        assert (rep["margin"] > 0) == (code == 0) == rep["identifiable"]
        assert rep["input_identity"]["fingerprint"] and rep["input_identity"]["size"] == path.stat().st_size
    # --min-eig raises the threshold above the numerical tolerance
    assert run(["certify", str(good), "--json", "-q", "--min-eig", "1e6"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["threshold"] == 1e6 and rep["margin"] < 0


def test_fit_reports_condition_and_ridge(tmp_path: Path, capsys) -> None:
    """fit reports the condition number, warns when ill-conditioned or singular; --ridge shrinks."""
    ds, _ = synthetic.generate_teacher(2, 1, 200, "2:6", seed=4)
    data = tmp_path / "d.h5"
    ds.save(data, dtype="float64")
    out = tmp_path / "m.h5"
    assert run(["fit", str(data), "-o", str(out), "--json", "-q"]) == 0
    cap = capsys.readouterr()
    rep = json.loads(cap.out)
    assert 1 < rep["condition_number"] < 1e6 and "warning" not in cap.err
    # a coordinate in other units is no longer badly conditioned (the solver whitens the tokens)
    scaled = tmp_path / "scaled.h5"
    with h5py.File(scaled, "w") as f:
        f["tokens"] = ds.tokens * np.array([1.0, 1e-2])
        f["offsets"] = ds.offsets
        f["targets"] = ds.targets
    assert run(["fit", str(scaled), "-o", str(tmp_path / "s.h5"), "--json", "-q"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["condition_number"] < 1e6 and "warning" not in cap.err
    # badly conditioned data whatever the units (5 distinct samples < psi = 6, repeated with jitter):
    # a warning naming the condition number
    rng = np.random.default_rng(0)
    seqs = [ds.tokens[ds.offsets[i]:ds.offsets[i + 1]] for i in range(5)] * 14
    tokens = np.concatenate(seqs)
    tokens = tokens + 1e-6 * rng.standard_normal(tokens.shape)
    bad = tmp_path / "bad.h5"
    with h5py.File(bad, "w") as f:
        f["tokens"] = tokens
        f["offsets"] = np.concatenate([[0], np.cumsum([len(q) for q in seqs])])
        f["targets"] = np.concatenate([ds.targets[:5]] * 14)
    assert run(["fit", str(bad), "-o", str(tmp_path / "b.h5"), "--json", "-q"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["condition_number"] > 1e10
    assert "ill-conditioned" in cap.err and "--ridge" in cap.err
    # ridge: the penalised normal equations (Lambda~ + l I) p_b^T = m~ hold on the canonical sums
    # (p_b = p M_A^-1), and the canonical norm shrinks
    feats = featurize(data)
    A, gb, mb = feats.solver_stats()
    p0 = basis.coef_to_basis(A, fit(feats).coef)
    p1 = basis.coef_to_basis(A, fit(feats, ridge=0.1).coef)
    lhs = (gb / feats.n_samples + 0.1 * np.eye(feats.n_features)) @ p1.T
    np.testing.assert_allclose(lhs, mb / feats.n_samples, atol=1e-10 * np.abs(lhs).max())
    assert np.linalg.norm(p1) < np.linalg.norm(p0)
    assert run(["fit", str(data), "-o", str(out), "--ridge", "-1"]) == 2
    assert capsys.readouterr().err.startswith("mhla: error: ")
