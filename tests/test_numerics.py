"""certify's numerical trust: exact rank deficiency is rejected and full rank (even at
lambda_min / lambda_max ~ 1e-10) is accepted, at float32 and float64 storage and at any scale."""

from __future__ import annotations

import json
import re
from pathlib import Path

import h5py
import numpy as np

from mhla_cli.statistics import basis
from mhla_cli.linalg import factorization
import pytest

from mhla_cli.model import synthetic
from mhla_cli.cli import run
from mhla_cli.numerics import EPS, lambda_min_of_verdict, numerical_tolerance
from mhla_cli import certify
from mhla_cli.solve.certificate import Certificate
from mhla_cli.solve.lstsq import fit
from mhla_cli.statistics.stream import featurize
from mhla_cli.statistics.features import Features

DTYPES = ["float32", "float64"]
# One factor on every token, and a factor per coordinate (1e-3, 1, 1e3, ... over the d coordinates): a
# certificate on the raw Gram with a relative threshold passes the first kind alone.
SCALES = [1e-3, 1.0, 1e3, (1e-3, 1.0, 1e3)]


def _scaled(tokens: np.ndarray, scale: float | tuple) -> np.ndarray:
    return tokens * np.resize(np.asarray(scale, dtype=np.float64), tokens.shape[1])


def _certify(tmp: Path, tokens: np.ndarray, offsets: np.ndarray, dtype: str, scale: float | tuple = 1.0,
             domain: str = "full", targets: np.ndarray | None = None) -> Certificate:
    path = tmp / f"t_{dtype}_{'_'.join(f'{x:g}' for x in np.atleast_1d(scale))}.h5"
    with h5py.File(path, "w") as f:
        f["tokens"] = _scaled(tokens, scale).astype(dtype)
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
    X = _scaled(tokens, scale).astype(dtype).astype(np.float64)
    iu = np.triu_indices(3)
    F = np.stack([np.einsum("p,l->pl", (X[a:b].T @ X[a:b])[iu], X[b - 1]).ravel()
                  for a, b in zip(offsets[:-1], offsets[1:])])
    raw = np.linalg.svd(F, compute_uv=False) ** 2
    # ~1e-10 for one factor on every token, ~1e-28 with the per-coordinate factors: far beyond float64
    assert raw[-1] / raw[0] < 1e-9 and (np.ndim(scale) > 0 or raw[-1] / raw[0] > 1e-11), raw[-1] / raw[0]
    assert raw[-1] / raw[0] < np.sqrt(EPS) and raw[-1] / raw[0] < np.finfo(np.float32).eps
    ratio = c.lambda_min / c.lambda_max
    assert ratio > 1e-3 and c.basis == "canonical"
    assert c.lambda_min > 1e3 * c.threshold


def test_verdict_is_scale_invariant_at_every_margin(tmp_path: Path) -> None:
    """Tokens scaled by c, or by a factor per coordinate: the canonical lambda_min, lambda_max and threshold
    do not move at all."""
    tokens, offsets = _ragged(np.random.default_rng(5), 200, 2)
    rel = []
    for scale in SCALES:
        c = _certify(tmp_path, tokens, offsets, "float64", scale)
        rel.append((c.lambda_min, c.lambda_max, c.threshold))
    np.testing.assert_allclose(rel, [rel[1]] * len(SCALES), rtol=1e-9)


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


def test_lambda_min_of_verdict_cuts_at_the_threshold() -> None:
    """The estimate stands where it agrees with the proven verdict; just across the threshold it is the bound."""
    t = 3.24e-13
    above, below = np.nextafter(t, np.inf), np.nextafter(t, -np.inf)
    assert lambda_min_of_verdict(above, t, True) == (above, None)  # just inside: a passing verdict, above t
    assert lambda_min_of_verdict(t, t, True) == (t, "above")  # just outside: at t is no value of a passing one
    assert lambda_min_of_verdict(below, t, True) == (t, "above")
    assert lambda_min_of_verdict(t, t, False) == (t, None)  # just inside: at t agrees with a failing verdict
    assert lambda_min_of_verdict(above, t, False) == (t, "at_most")  # just outside
    assert lambda_min_of_verdict(3.68e-13, t, False) == (t, "at_most")  # the cluster's case of issue 43
    assert lambda_min_of_verdict(-1e-14, t, False) == (-1e-14, None)
    assert lambda_min_of_verdict(float("nan"), t, True) == (t, "above")


def _check_consistent(rep: dict) -> None:
    """lambda_min beside a failing verdict is never above the threshold, beside a passing one never below."""
    if rep["identifiable"]:
        assert rep["lambda_min"] >= rep["threshold"] and rep["margin"] >= 0, rep
    else:
        assert rep["lambda_min"] <= rep["threshold"] and rep["margin"] <= 0, rep
    assert (rep["lambda_min_bound"] is None) == ("lambda_min_estimate" not in rep)
    if rep["lambda_min_bound"] is not None:
        assert rep["lambda_min"] == rep["threshold"]
        assert rep["lambda_min_bound"] == ("above" if rep["identifiable"] else "at_most")
        assert (rep["lambda_min_estimate"] > rep["threshold"]) != rep["identifiable"]


def test_lambda_min_never_contradicts_the_verdict_at_the_threshold(tmp_path: Path, capsys) -> None:
    """--min-eig at the computed lambda_min, a few ulps either side: the Cholesky of Lambda~ - t I decides, the
    dense eigenvalue may fall on the other side of t; the reported lambda_min always agrees with the verdict
    (library and CLI), and the estimate is kept beside the bound."""
    tokens, offsets = _ragged(np.random.default_rng(5), 200, 3)
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["tokens"], f["offsets"] = tokens, offsets
    feats = featurize(path)
    lmin = certify(feats).lambda_min
    bounds = set()
    for k in range(-12, 13):
        t = lmin * (1 + k * EPS)
        cert = certify(feats, min_eig=t)
        rep = cert.to_dict()
        _check_consistent(rep)
        bounds.add(rep["lambda_min_bound"])
        assert run(["certify", str(path), "--json", "-q", "--min-eig", repr(t)]) == (0 if cert.identifiable else 1)
        _check_consistent(json.loads(capsys.readouterr().out))
    # the sweep crosses the threshold: both verdicts occur
    assert certify(feats, min_eig=lmin * (1 - 64 * EPS)).identifiable
    assert not certify(feats, min_eig=lmin * (1 + 64 * EPS)).identifiable


def test_a_contradicting_estimate_is_reported_as_the_bound(tmp_path: Path, capsys, monkeypatch) -> None:
    """An estimate on the wrong side of the threshold (as Lanczos near 0 gave on a cluster, issue 43): certify and
    fit report the threshold with the bound the verdict proves, the text says so, the JSON keeps the estimate."""
    tokens, offsets = _ragged(np.random.default_rng(2), 300, 3)
    tokens[:, 2] = 0
    path = tmp_path / "bad.h5"
    with h5py.File(path, "w") as f:
        f["tokens"], f["offsets"], f["targets"] = tokens, offsets, np.ones((len(offsets) - 1, 3))
    cert = certify(featurize(path))
    assert not cert.identifiable and cert.lambda_min_bound is None and cert.lambda_min <= cert.threshold
    wrong = 1.1 * cert.threshold
    monkeypatch.setattr(factorization.Factorization, "lambda_min", lambda self: wrong)
    assert run(["certify", str(path), "--json"]) == 1
    out, err = capsys.readouterr()
    rep = json.loads(out.strip().splitlines()[-1])
    _check_consistent(rep)
    assert rep["lambda_min_bound"] == "at_most" and rep["lambda_min_estimate"] == wrong
    assert "lambda_min <= " in err and "is not resolved against the threshold" in err
    assert run(["fit", str(path), "-o", str(tmp_path / "m.h5"), "--json"]) == 0
    out, err = capsys.readouterr()
    info = json.loads(out.strip().splitlines()[-1])
    assert not info["identifiable"] and info["lambda_min_bound"] == "at_most" and "lambda_min <=" in err
    assert info["lambda_min"] == pytest.approx(info["n_features"] * EPS * info["lambda_max"], rel=1e-12)
    good = tmp_path / "good.h5"
    tokens[:, 2] = np.random.default_rng(3).standard_normal(len(tokens))
    with h5py.File(good, "w") as f:
        f["tokens"], f["offsets"] = tokens, offsets
    monkeypatch.setattr(factorization.Factorization, "lambda_min", lambda self: -1.0)
    assert run(["certify", str(good), "--json", "-q"]) == 0
    rep = json.loads(capsys.readouterr().out)
    _check_consistent(rep)
    assert rep["lambda_min_bound"] == "above" and rep["lambda_min"] == rep["threshold"]


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


# --------------------------------------------------------------------------------------------
# mhla_cli.numerics: one home for the constants, quoted from the code by the docs and the help
# --------------------------------------------------------------------------------------------


def test_the_constants_quoted_in_formats_md_are_the_code_s() -> None:
    from mhla_cli import numerics

    text = (Path(__file__).resolve().parent.parent / "docs" / "certificate.md").read_text(encoding="utf-8")
    rows = _documented_constants()
    assert set(rows) == set(numerics.QUOTED), set(rows) ^ set(numerics.QUOTED)
    for name, value in rows.items():
        assert value == numerics.QUOTED[name], name
    inline = re.findall(r"`([A-Z_]+)` \(([-+0-9.e]+)\)", text)
    assert inline  # the sentences that name a constant quote its value next to it
    for name, value in inline:
        assert float(value) == numerics.QUOTED[name], name
    assert numerics.EPS == 2.0 ** -52
    assert numerics.quote(1e-8) == "1e-8" and numerics.quote(1e12) == "1e12" and numerics.quote(8.0) == "8"


def test_the_help_quotes_the_constants(capsys) -> None:
    from mhla_cli import numerics

    assert run(["certify", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert f"component <= {numerics.quote(numerics.DETERMINED_TOL)}" in out
    assert f"tolerance {numerics.RANK_RULE} (eps = {numerics.EPS:.4g})" in out


def test_constants_have_one_home() -> None:
    """Every constant of mhla_cli.numerics is assigned there only: the modules that use one import it."""
    import ast
    from pathlib import Path

    from mhla_cli import numerics

    names = {n for n in vars(numerics) if n.isupper()}
    assert {"DETERMINED_TOL", "LANCZOS_TOL", "EPS", "EQUILIBRATE_RATIO", "MAX_EXACT_INT"} <= names
    package = Path(numerics.__file__).parent
    again = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "numerics.py" and path.parent == package:
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            again += [f"{path.relative_to(package)}: {t.id}" for t in targets
                      if isinstance(t, ast.Name) and t.id in names]
    assert not again, again


# --------------------------------------------------------------------------------------------
# every cut of mhla_cli.numerics, with a case at 1e-2 x and at 1e2 x of it, against plain numpy on
# materialised canonical features (tests/_reference.py); tests/test_mutations.py shows that a x1e4 or
# x1e-4 change of each constant (and the review's mutations) fails one of them
# --------------------------------------------------------------------------------------------

import _reference  # noqa: E402

from mhla_cli import numerics  # noqa: E402, F401
from mhla_cli.statistics.accumulate import chunk_features  # noqa: E402
from conftest import unseal  # noqa: E402

EPS64 = float(np.finfo(np.float64).eps)


def _documented_constants() -> dict[str, float]:
    """The constants' values as docs/certificate.md's table states them (the cases below sit at 1e-2 x and
    1e2 x of these, so that a changed constant in the code moves its cut away from its cases)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "certificate.md").read_text(encoding="utf-8")
    table = text[text.index("**The numerics' constants**"):]
    table = table[:table.index("\n\n", table.index("|---"))]
    return {k: float(v) for k, v in re.findall(r"^\| `([A-Z_]+)` \| ([^|]+?) \|", table, flags=re.M)}


DOC = _documented_constants()


def _off_plane(rng: np.random.Generator, N: int, s: float, d: int = 3) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gaussian tokens (lengths 3..7) whose last tokens lie s off a fixed 2-d plane (a rotated one)."""
    off = np.concatenate([[0], np.cumsum(rng.integers(3, 8, size=N))])
    X = rng.standard_normal((int(off[-1]), d))
    Q = np.linalg.qr(rng.standard_normal((d, d)))[0]
    last = X[off[1:] - 1] @ Q
    last[:, 2] *= s
    X[off[1:] - 1] = last @ Q.T
    return X, off, rng.standard_normal((N, d))


def _partial_traces(lam: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Tr over the last token (q x q) and over the pairs (d x d) of a (q d) x (q d) matrix, l fastest."""
    q = lam.shape[0] // d
    L = lam.reshape(q, d, q, d)
    return np.einsum("albl->ab", L), np.einsum("ajak->jk", L)


def _structure_energy(s: float, seed: int, N: int = 600) -> float:
    """The reference's smallest last-token partial-trace energy over the structure cut."""
    ref = _reference.canonical(*_off_plane(np.random.default_rng(seed), N, s))
    tp, tl = _partial_traces(ref["lambda"], 3)
    wp, wl = np.linalg.eigvalsh(tp), np.linalg.eigvalsh(tl)
    psi, q = ref["lambda"].shape[0], tp.shape[0]
    cut = DOC["STRUCTURE_FACTOR"] * EPS64 * psi * max(wp[-1] / 3, wl[-1] / q)
    return float(wl[0] / cut)


@pytest.mark.parametrize("factor", [1e2, 1e-2])
def test_cut_structure(factor: float) -> None:
    seed, N = 21, 600
    # the energy scales as s^2: calibrate s where it is resolved, then aim at factor x the cut
    s0 = 1e-4
    s = s0 * np.sqrt(factor / _structure_energy(s0, seed, N))
    if factor > 1:  # (below the cut the reference's own rounding hides the energy: s^2 extrapolates it)
        assert factor / 3 < _structure_energy(s, seed, N) < 3 * factor
    X, off, y = _off_plane(np.random.default_rng(seed), N, s)
    ref = _reference.canonical(X, off, y)
    w = ref["eigenvalues"]
    tol = DOC["RANK_FACTOR"] * w.size * EPS64 * w[-1]
    c = certify(chunk_features(X, off, y, 3))
    # above the cut the direction is in the factorized block, below it is an exact null
    assert c.span_last_tokens == (3 if factor > 1 else 2)
    assert c.identifiable is bool(w[0] > tol) and c.rank == int((w > tol).sum())
    assert c.lambda_max == pytest.approx(w[-1], rel=1e-10, abs=0)


def _observed_ratio(X: np.ndarray, off: np.ndarray) -> float:
    """The whitened last tokens' smallest eigenvalue over the observed-span cut d eps sqrt(N)."""
    ref = _reference.canonical(X, off)
    L = X[off[1:] - 1] @ ref["A"]
    w = np.linalg.eigvalsh(L.T @ L)
    return float(w[0] / w[-1] / (DOC["OBSERVED_SPAN_FACTOR"] * 3 * EPS64 * np.sqrt(len(off) - 1)))


@pytest.mark.parametrize("factor", [1e2, 1e-2])
def test_cut_observed_span(factor: float) -> None:
    seed, N = 22, 600
    s0 = 1e-4
    r0 = _observed_ratio(*_off_plane(np.random.default_rng(seed), N, s0)[:2])
    s = s0 * np.sqrt(factor / r0)
    X, off, y = _off_plane(np.random.default_rng(seed), N, s)
    assert factor / 3 < _observed_ratio(X, off) < 3 * factor
    c = certify(chunk_features(X, off, y, 3), domain="observed")
    assert c.dim_tokens == 3 and c.dim_last_tokens == (3 if factor > 1 else 2)
    assert c.n_features == 6 * c.dim_last_tokens


def _null_component(ref: dict, Z: np.ndarray) -> float:
    """||Z0^T h|| / ||h|| for the reference null space Z0 of Lambda~ and h = Ht(Z A)."""
    w, V = np.linalg.eigh(ref["lambda"])
    Z0 = V[:, w <= DOC["RANK_FACTOR"] * w.size * EPS64 * w[-1]]
    h = _reference.canonical_features(Z @ ref["A"])
    return float(np.linalg.norm(Z0.T @ h) / np.linalg.norm(h))


def test_cut_probe_tolerance(tmp_path: Path) -> None:
    from mhla_cli.solve.probes import certify_probes

    rng = np.random.default_rng(23)
    X, off, y = _off_plane(rng, 400, 0.0)  # last tokens exactly in a plane: exact nulls
    ref = _reference.canonical(X, off, y)
    n_plane = np.linalg.svd(X[off[1:] - 1])[2][2]  # the plane's normal
    Z = rng.standard_normal((4, 3))
    Z[-1] -= (Z[-1] @ n_plane) * n_plane
    assert _null_component(ref, Z) < 1e-12
    probes, want = [], []
    for target in (1e2 * DOC["DETERMINED_TOL"], 1e-2 * DOC["DETERMINED_TOL"]):
        e0 = 1e-3
        Ze = Z.copy()
        Ze[-1] += e0 * n_plane
        e = e0 * target / _null_component(ref, Ze)
        Ze = Z.copy()
        Ze[-1] += e * n_plane
        want.append(_null_component(ref, Ze))
        assert target / 2 < want[-1] < 2 * target
        probes.append(Ze)
    path = tmp_path / "probes.h5"
    with h5py.File(path, "w") as f:
        f["tokens"], f["offsets"] = np.concatenate(probes), np.array([0, 4, 8])
    rep = certify_probes(chunk_features(X, off, y, 3), path)
    assert rep.residual == pytest.approx(want, rel=1e-3, abs=0)
    assert list(rep.undetermined) == [0]  # 1e2 x the tolerance: undetermined; 1e-2 x: determined


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_cut_unresolved_probe_factor(tmp_path: Path, factor: float) -> None:
    """Training tokens exactly in a rotated plane (the normal direction is not resolvable in float64) and
    a probe in the plane plus factor x UNRESOLVED_PROBE_FACTOR x the rounding bound d eps (|| |z| |A| ||
    + ||z A||) along that direction (numpy's eigenvector of the canonical token Gram): determined at
    0.5 x, not resolvable at 2 x."""
    from mhla_cli.solve.probes import certify_probes

    rng = np.random.default_rng(31)
    d = 3
    Q = np.linalg.qr(rng.standard_normal((d, d)))[0]
    X = rng.standard_normal((1200, 2)) @ Q[:, :2].T
    off = np.arange(401) * 3
    feats = chunk_features(X, off, rng.standard_normal((400, d)), d)
    A = feats.solver_stats()[0]
    G = (X @ A).T @ (X @ A) / X.shape[0]  # the canonical token Gram, from the tokens (numpy)
    u = np.linalg.eigh(G)[1][:, 0]  # the unresolved direction, canonical coordinates
    w = np.linalg.solve(A.T, u)  # z = z0 + t w has z A = z0 A + t u
    z = rng.standard_normal(2) @ Q[:, :2].T
    zA = z @ A
    assert abs(zA @ u) <= d * EPS64 * (np.linalg.norm(np.abs(z) @ np.abs(A)) + np.linalg.norm(zA))
    t = factor * DOC["UNRESOLVED_PROBE_FACTOR"] * d * EPS64 * (np.linalg.norm(np.abs(z) @ np.abs(A))
                                                             + np.linalg.norm(zA))
    probe = np.stack([rng.standard_normal(2) @ Q[:, :2].T, z + t * w])
    path = tmp_path / "p.h5"
    with h5py.File(path, "w") as f:
        f["tokens"], f["offsets"] = probe, np.array([0, 2])
    rep = certify_probes(feats, path)
    assert rep.unresolved_dim == 1
    if factor < 1:
        assert rep.determined and rep.unresolvable.size == 0
    else:
        assert list(rep.unresolvable) == [0] and not rep.determined


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_cut_target_squares_floor(factor: float) -> None:
    """Targets scaled so that their weighted mean square tr(target_gram) / sum w is factor x
    TARGET_SQUARES_FLOOR: fit's train R^2 is numpy's at 2 x, null (targets_underflow) at 0.5 x."""
    from mhla_cli.api.learn import fit as learn_fit

    ds, _ = synthetic.generate_teacher(2, 1, 120, "2:5", seed=47, noise=0.1)
    y = ds.targets
    c = np.sqrt(factor * DOC["TARGET_SQUARES_FLOOR"] / float((y**2).sum(1).mean()))
    feats = chunk_features(ds.tokens, ds.offsets, y * c, 2)
    assert float(np.trace(feats.target_gram)) / feats.weight == pytest.approx(factor * DOC["TARGET_SQUARES_FLOOR"],
                                                                             rel=1e-6)
    model = learn_fit(feats)
    if factor > 1:
        ref = learn_fit(chunk_features(ds.tokens, ds.offsets, y, 2))
        assert model.info["train_r2"] == pytest.approx(ref.info["train_r2"], rel=1e-8)
        assert "targets_underflow" not in model.info
    else:
        assert model.info["train_r2"] is None and model.info["targets_underflow"] is True


def _threshold_case(s: float, seed: int = 24) -> tuple:
    return _off_plane(np.random.default_rng(seed), 300, s)


@pytest.mark.parametrize("dense_max", [4096, 0], ids=["dense", "cholesky-lanczos"])
@pytest.mark.parametrize("factor", [10.0, 0.1])
def test_cut_rank(factor: float, dense_max: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An eigenvalue of Lambda~ at 10 x and at 0.1 x the numerical tolerance (last tokens s off a
    plane: lambda_min ~ s^2), and --min-eig at 10 x and 0.1 x a resolved lambda_min."""
    monkeypatch.setattr(factorization, "DENSE_MAX", dense_max)
    s0 = 1e-3

    def ratio(s: float) -> float:
        w = _reference.canonical(*_threshold_case(s))["eigenvalues"]
        return float(w[0] / (DOC["RANK_FACTOR"] * w.size * EPS64 * w[-1]))

    s = s0 * np.sqrt(factor / ratio(s0))
    X, off, y = _threshold_case(s)
    feats = chunk_features(X, off, y, 3)
    c = certify(feats)
    assert c.span_last_tokens == 3  # the structure cut keeps the direction: the rank cut decides
    assert c.identifiable is (factor > 1)
    assert c.proof == ("cholesky of Lambda~ - t I" if factor > 1 else "cholesky of Lambda~ - t I failed")
    # --min-eig on resolved data: proven above 0.1 x lambda_min, refused at 10 x
    Xr, offr, yr = _threshold_case(1.0)
    ref = _reference.canonical(Xr, offr, yr)["eigenvalues"]
    featr = chunk_features(Xr, offr, yr, 3)
    assert certify(featr, min_eig=factor * ref[0]).identifiable is (factor < 1)


def test_cut_rank_uses_every_feature_on_reduced_data() -> None:
    """On data whose spans leave features out (a factorized block of n < psi), the tolerance is still
    psi eps lambda_max (n_full, not the block's n), and the rank is the reference's."""
    X, off, y = _off_plane(np.random.default_rng(25), 300, 0.0)
    ref = _reference.canonical(X, off, y)["eigenvalues"]
    c = certify(chunk_features(X, off, y, 3))
    assert c.span_features < c.n_features == ref.size
    assert c.numerical_tolerance == pytest.approx(DOC["RANK_FACTOR"] * ref.size * EPS64 * ref[-1], rel=1e-10, abs=0)
    assert c.rank == int((ref > c.numerical_tolerance).sum())


def test_cut_lanczos_tolerance_at_psi_288(monkeypatch: pytest.MonkeyPatch) -> None:
    ds, _ = synthetic.generate_teacher(8, 2, 1500, "2:7", seed=26)
    ref = _reference.canonical(ds.tokens, ds.offsets)["eigenvalues"]
    monkeypatch.setattr(factorization, "DENSE_MAX", 0)
    c = certify(chunk_features(ds.tokens, ds.offsets, ds.targets, 8))
    assert c.estimated == ["lambda_min", "lambda_max"] and c.identifiable
    # LANCZOS_TOL = 1e-7 gives ~1e-14 (1e-3: ~1e-8, 1e-1: ~1e-5)
    assert abs(c.lambda_min - ref[0]) <= 1e-11 * ref[0], (c.lambda_min, ref[0])
    assert abs(c.lambda_max - ref[-1]) <= 1e-11 * ref[-1]


def test_cut_observed_domain_of_merged_parts_in_unlike_bases() -> None:
    rng = np.random.default_rng(27)
    P = np.linalg.qr(rng.standard_normal((3, 2)))[0]
    parts = []
    for scale in (np.ones(3), np.array([1.0, 1e-2, 30.0])):
        off = np.concatenate([[0], np.cumsum(rng.integers(2, 7, size=250))])
        X = rng.standard_normal((int(off[-1]), 3)) * scale
        X[off[1:] - 1] = (X[off[1:] - 1] @ P) @ P.T  # last tokens in a fixed plane
        parts.append((X, off, rng.standard_normal((250, 3))))
    a, b = (chunk_features(X, off, y, 3) for X, off, y in parts)
    c = certify(a + b, domain="observed")
    # the reference on the concatenation: whitened by all tokens, the observed features materialised
    X = np.concatenate([p[0] for p in parts])
    off = np.concatenate([parts[0][1], parts[0][1][-1] + parts[1][1][1:]])
    w, r, s = _reference.observed_eigenvalues(X, off, _reference.canonical(X, off)["A"])
    assert (r, s, w.size) == (3, 2, 12)
    assert (c.dim_tokens, c.dim_last_tokens, c.n_features) == (3, 2, 12)
    assert c.identifiable and c.lambda_min == pytest.approx(w[0], rel=1e-8, abs=0)
    assert c.lambda_max == pytest.approx(w[-1], rel=1e-8, abs=0)


def test_cut_null_weight_is_the_diagonal_of_the_null_projector() -> None:
    """null_features[].null_weight = diag(N N^T) of the null space, in the tokens' own feature
    coordinates (the null space of the own Lambda_D = (1/N) sum H H^T)."""
    rng = np.random.default_rng(28)
    off = np.concatenate([[0], np.cumsum(rng.integers(2, 8, size=22))])
    X = rng.standard_normal((int(off[-1]), 4)) * np.array([1.0, 2.0, 0.5, 1.0])
    seqs = [X[off[i]:off[i + 1]] for i in range(22)] * 2  # 44 samples of rank 22 < psi = 40
    H = np.array([_reference.features(s) for s in seqs])
    w, V = np.linalg.eigh(H.T @ H / len(seqs))
    N0 = V[:, w <= 1e-9 * w[-1]]
    assert N0.shape[1] == 40 - 22
    want = np.einsum("ij,ij->i", N0, N0)
    tokens = np.concatenate(seqs)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    c = certify(chunk_features(tokens, offsets, None, 4))
    assert not c.identifiable and c.null_features
    listed = sorted(want[want > DOC["DEAD_WEIGHT_TOL"]], reverse=True)[:20]
    got = [f["null_weight"] for f in c.null_features]
    assert got == pytest.approx(listed, abs=1e-9)
    for f in c.null_features:
        assert f["null_weight"] == pytest.approx(want[f["index"]], abs=1e-9)


@pytest.mark.parametrize("factor", [1e2, 1e-2])
def test_cut_train_mse_resolution(factor: float) -> None:
    """Noisy targets whose train MSE is 1e2 x and 1e-2 x the MSE resolution: above it the train MSE is
    the MSE of the model's predictions (reference forward pass), below it both are under it."""
    ds, _ = synthetic.generate_teacher(3, 2, 400, "2:6", seed=29)
    rng = np.random.default_rng(29)
    y0 = ds.targets
    res0 = DOC["MSE_RESOLUTION_FACTOR"] * 18 * EPS64 * 2 * float(np.sum(y0 ** 2)) / y0.size
    noise = rng.standard_normal(y0.shape)
    sigma = np.sqrt(factor * res0 / (1 - 18 / 400))
    y = y0 + sigma * noise
    m = fit(chunk_features(ds.tokens, ds.offsets, y, 3))
    seqs = [ds.tokens[a:b] for a, b in zip(ds.offsets[:-1], ds.offsets[1:])]
    mse = float(np.mean((_reference.predict_own(m.coef, seqs) - y) ** 2))
    res = m.info["mse_resolution"]
    assert res == pytest.approx(res0, rel=0.05, abs=0)
    assert factor / 3 < mse / res < 3 * factor
    assert abs(m.info["train_mse"] - mse) <= res
    assert (m.info["train_mse"] > res) is (factor > 1)


def test_cut_singular_basis_cond(tmp_path: Path) -> None:
    from mhla_cli.errors import InputError

    ds, _ = synthetic.generate_teacher(3, 1, 50, 4, seed=30)
    # a rotated basis: a diagonal one is only a scaling of the token coordinates, which the rule
    # (basis.row_scaled_cond) takes out exactly and never calls singular
    Q = np.linalg.qr(np.random.default_rng(30).standard_normal((3, 3)))[0]
    for factor in (1e-2, 1e2):
        A = (Q * [1.0, 1.0, 1.0 / (factor * DOC["SINGULAR_BASIS_COND"])]) @ Q.T
        if factor < 1:
            chunk_features(ds.tokens, ds.offsets, ds.targets, 3, basis=A)
        else:
            with pytest.raises(InputError, match="invertible"):
                chunk_features(ds.tokens, ds.offsets, ds.targets, 3, basis=A)
    path = tmp_path / "f.h5"
    chunk_features(ds.tokens, ds.offsets, ds.targets, 3).save(path)
    for factor in (1e-2, 1e2):
        with h5py.File(path, "a") as f:
            unseal(f)
            B = np.array(f["basis"])
            u, sv, vt = np.linalg.svd(B)
            sv[-1] = sv[0] / (factor * DOC["SINGULAR_BASIS_COND"])
            f["basis"][...] = (u * sv) @ vt
        if factor < 1:
            Features.load(path)
        else:
            with pytest.raises(InputError, match="singular"):
                Features.load(path)


def test_cut_symmetry_on_load(tmp_path: Path) -> None:
    from mhla_cli.errors import InputError

    ds, _ = synthetic.generate_teacher(3, 1, 80, 4, seed=31)
    path = tmp_path / "f.h5"
    chunk_features(ds.tokens, ds.offsets, ds.targets, 3).save(path)
    with h5py.File(path, "r") as f:
        g0 = np.array(f["basis_gram"])
    for factor in (1e-2, 1e2):
        g = g0.copy()
        g[0, 1] += factor * DOC["SYMMETRY_TOL"] * np.abs(g0).max()
        with h5py.File(path, "a") as f:
            unseal(f)
            f["basis_gram"][...] = g
        if factor < 1:
            Features.load(path)
        else:
            with pytest.raises(InputError, match="symmetric"):
                Features.load(path)


def test_cut_nonzero_singular_value() -> None:
    from mhla_cli.solve.spectrum import spectrum

    rng = np.random.default_rng(32)
    d = 3
    U = np.linalg.qr(rng.standard_normal((d * d, d * d)))[0]
    V = np.linalg.qr(rng.standard_normal((d * d, d * d)))[0]
    s = np.zeros(d * d)
    s[:3] = [1.0, 1e2 * DOC["NONZERO_REL"], 1e-2 * DOC["NONZERO_REL"]]
    W = (U * s) @ V.T
    from mhla_cli.model.heads import p_from_W

    spec = spectrum(p_from_W(W), W=W)
    assert spec.nonzero_rank == 2, spec.nonzero_rank


def test_cut_refinement_of_the_proof_factor() -> None:
    """certify --min-eig close to lambda_min leaves a factor of Lambda~ - t I with t / (lambda_min - t)
    far above REFINE_MAX_RHO: the fit must not refine with it (it would diverge); at 1e-2 x it may."""
    ds, _ = synthetic.generate_teacher(3, 2, 300, "2:7", noise=0.1, seed=33)
    ref = _reference.canonical(ds.tokens, ds.offsets, ds.targets)
    want = _reference.predict_canonical(_reference.min_norm_function(ref), ref["A"],
                                        [ds.tokens[a:b] for a, b in zip(ds.offsets[:-1], ds.offsets[1:])])
    lmin = ref["eigenvalues"][0]
    for rho in (1e2 * DOC["REFINE_MAX_RHO"], 1e-2 * DOC["REFINE_MAX_RHO"]):
        feats = chunk_features(ds.tokens, ds.offsets, ds.targets, 3)
        t = lmin * rho / (1 + rho)  # t / (lambda_min - t) = rho
        assert certify(feats, min_eig=t).identifiable
        m = fit(feats)
        got = _reference.predict_own(m.coef, [ds.tokens[a:b] for a, b in zip(ds.offsets[:-1], ds.offsets[1:])])
        assert _reference.ratio(got, want) <= 1e-9, rho


@pytest.mark.parametrize("case", ["listed", "dead"])
def test_cut_dead_and_listed_null_weights(case: str) -> None:
    """Last tokens orthogonal to a unit n: the null space is R^q (x) n, so null_weight(j,k,l) = n_l^2.
    "listed": n^2 = (1 - a - b, a, b) with a = 1e2 x and b = 1e-2 x DEAD_WEIGHT_TOL: the features with
    l = 0 and 1 are listed, none is dead (1 - a is 1e2 x the tolerance below 1); "dead": n^2 =
    (1 - c, c, 0) with c = 1e-2 x the tolerance: the l = 0 features are dead."""
    tolw = DOC["DEAD_WEIGHT_TOL"]
    n2 = np.array([1 - 1e2 * tolw - 1e-2 * tolw, 1e2 * tolw, 1e-2 * tolw]) if case == "listed" else \
        np.array([1 - 1e-2 * tolw, 1e-2 * tolw, 0.0])
    n = np.sqrt(n2)
    rng = np.random.default_rng(34)
    off = np.concatenate([[0], np.cumsum(rng.integers(3, 8, size=300))])
    X = rng.standard_normal((int(off[-1]), 3))
    last = X[off[1:] - 1]
    X[off[1:] - 1] = last - np.outer(last @ n, n)
    c = certify(chunk_features(X, off, None, 3))
    assert not c.identifiable
    idx = {f["index"]: f["null_weight"] for f in c.null_features}
    want = {i: float(n2[i % 3]) for i in range(18) if n2[i % 3] > tolw}
    assert set(idx) == set(want)
    for i, v in want.items():
        assert idx[i] == pytest.approx(v, rel=1e-6, abs=1e-12)
    said = " ".join(c.reasons)
    assert ("6 single feature(s) are zero to within" in said) is (case == "dead"), said


# --------------------------------------------------------------------------------------------
# the cuts that moved into mhla_cli.numerics later (whitening, model files, integer tokens, R^2,
# the head count of an unconverged W), each at 1e-2 x and 1e2 x of its documented value
# --------------------------------------------------------------------------------------------


def _rotated_gram(rng: np.random.Generator, w: list[float]) -> np.ndarray:
    Q = np.linalg.qr(rng.standard_normal((len(w), len(w))))[0]
    return (Q * np.asarray(w)) @ Q.T


@pytest.mark.parametrize("factor", [1e2, 1e-2])
def test_cut_unresolved_rel(factor: float) -> None:
    """A rotated direction of the token Gram at factor x the cut d UNRESOLVED_REL of the largest: numpy's
    matrix_rank (tolerance d eps s_max, the same rule at UNRESOLVED_REL = eps) counts it at 1e2 x and not
    at 1e-2 x; whitening resolves it (A^T G A = I) exactly when it is counted."""
    d = 3
    G = _rotated_gram(np.random.default_rng(40), [1.0, 0.5, factor * d * DOC["UNRESOLVED_REL"]])
    want = d - int(np.linalg.matrix_rank(G, tol=d * DOC["UNRESOLVED_REL"] * np.linalg.norm(G, 2)))
    assert want == (0 if factor > 1 else 1)
    assert basis.unresolved(G) == want
    A = basis.whitening(G, 1.0, round32=False)
    w = np.linalg.eigvalsh(A.T @ G @ A)
    if want == 0:
        np.testing.assert_allclose(w, 1.0, atol=0.05)
    else:  # the unresolved direction keeps the scale of the largest one: it is not blown up to 1
        assert w[0] < 1e-3 and np.allclose(w[1:], 1.0, atol=1e-6)


@pytest.mark.parametrize("factor", [1e2, 1e-2])
def test_cut_equilibrate_ratio(factor: float) -> None:
    """G = D C D: a correlation C whose smallest eigenvalue c = 10 d eps is resolved, and a diagonal
    D^2 = diag(1, 1, s) that hides it from the symmetric whitening (c / s < d eps). With s at 1e2 x
    EQUILIBRATE_RATIO, G is equilibrated and the direction resolved (numpy: the rank of C); at 1e-2 x it
    is not (numpy: the rank of G)."""
    d, c = 3, 10 * 3 * EPS64
    s = factor * DOC["EQUILIBRATE_RATIO"]
    C = np.array([[1.0, 1.0 - c, 0.0], [1.0 - c, 1.0, 0.0], [0.0, 0.0, 1.0]])
    D = np.diag([1.0, 1.0, np.sqrt(s)])
    G = D @ C @ D
    ref = C if s > DOC["EQUILIBRATE_RATIO"] else G
    want = d - int(np.linalg.matrix_rank(ref, tol=d * EPS64 * np.linalg.norm(ref, 2)))
    assert want == (0 if factor > 1 else 1)
    assert basis.unresolved(G) == want


@pytest.mark.parametrize("factor", [1e2, 1e-2])
def test_cut_canonical_tol(factor: float) -> None:
    """A basis whose token Gram is I up to factor x CANONICAL_TOL (numpy eigvalsh): at 1e-2 x it is the
    whitening already (no change), at 1e2 x a change is made, and it whitens the Gram."""
    delta = factor * DOC["CANONICAL_TOL"]
    G = _rotated_gram(np.random.default_rng(41), [1.0 + delta, 1.0, 1.0 - delta / 2])
    assert np.abs(np.linalg.eigvalsh(G) - 1.0).max() == pytest.approx(delta, rel=1e-3)
    C, cond = basis.correction(G, 1.0)
    if factor < 1:
        assert C is None and cond == 1.0
    else:
        assert C is not None
        np.testing.assert_allclose(C.T @ G @ C, np.eye(3), atol=1e-13)


def _model_file(tmp_path: Path) -> Path:
    ds, _ = synthetic.generate_teacher(3, 1, 200, "2:6", seed=42)
    path = tmp_path / "m.h5"
    fit(chunk_features(ds.tokens, ds.offsets, ds.targets, 3)).save(path)
    return path


@pytest.mark.parametrize("name", ["canonical_coef", "W"])
def test_cut_model_file_agreement(name: str, tmp_path: Path) -> None:
    """A model file whose canonical_coef (mapped back by the basis) or W (p(W)) differs from coef by
    factor x CANONICAL_COEF_TOL / W_COEF_TOL of max |coef| (measured in numpy): loaded at 1e-2 x, refused
    at 1e2 x."""
    from mhla_cli.statistics.basis import coef_from_basis
    from mhla_cli.errors import InputError
    from mhla_cli.model.heads import p_from_W
    from mhla_cli.model.model import Model

    path = _model_file(tmp_path)
    with h5py.File(path, "r") as f:
        coef, A, pb, W = (np.array(f[k]) for k in ("coef", "canonical_basis", "canonical_coef", "W"))
    tol = DOC["CANONICAL_COEF_TOL" if name == "canonical_coef" else "W_COEF_TOL"]
    scale = np.abs(coef).max()
    for factor in (1e-2, 1e2):
        if name == "canonical_coef":
            # move one canonical coefficient so that its image moves by factor x tol x scale
            e = np.zeros_like(pb)
            e[0, 0] = 1.0
            step = np.abs(coef_from_basis(A, e)).max()
            new = pb + e * factor * tol * scale / step
            dev = np.abs(coef_from_basis(A, new) - coef).max() / scale
        else:
            new = W.copy()
            new[0, 0] += factor * tol * scale
            dev = np.abs(p_from_W(new) - coef).max() / scale
        assert factor / 3 < dev / tol < 3 * factor
        with h5py.File(path, "a") as f:
            unseal(f)
            f[name][...] = new
        if factor < 1:
            Model.load(path)
        else:
            with pytest.raises(InputError, match="describe different functions"):
                Model.load(path)


def test_cut_max_exact_int(tmp_path: Path) -> None:
    """int64 tokens up to 2^53 = MAX_EXACT_INT are accepted (float64 holds them exactly: numpy's round
    trip), 2^53 + 2 (past the cut, though itself representable) is refused; so is -(2^53 + 2)."""
    from mhla_cli.errors import InputError

    cut = int(DOC["MAX_EXACT_INT"])
    assert cut == 2**53 and int(np.float64(cut - 1)) == cut - 1 and int(np.float64(cut + 1)) != cut + 1
    rng = np.random.default_rng(43)
    for value, ok in ((cut, True), (-cut, True), (cut + 2, False), (-(cut + 2), False)):
        X = rng.integers(0, 50, size=(30, 3, 2)).astype(np.int64)
        X[5, 1, 0] = value
        path = tmp_path / f"t{value}.h5"
        with h5py.File(path, "w") as f:
            f["tokens"], f["targets"] = X, rng.standard_normal((30, 2))
        if ok:
            assert featurize(path).n_samples == 30
        else:
            with pytest.raises(InputError, match=r"beyond 2\^53"):
                featurize(path)


@pytest.mark.parametrize("factor", [1e2, 1e-2])
def test_cut_sst_resolution(factor: float) -> None:
    """Targets c + delta z whose spread SST / energy (numpy) is factor x SST_RESOLUTION: R^2 is numpy's
    1 - SSE / SST at 1e2 x, and None at 1e-2 x (from the rows and from the sums)."""
    from mhla_cli.model import scores

    rng = np.random.default_rng(44)
    z = rng.standard_normal((500, 2))
    delta = np.sqrt(factor * DOC["SST_RESOLUTION"] * 2 * 500 / np.sum((z - z.mean(0)) ** 2))
    y = 1.0 + delta * z
    sst, energy = float(np.sum((y - y.mean(0)) ** 2)), float(np.sum(y ** 2))
    assert factor / 2 < sst / energy / DOC["SST_RESOLUTION"] < 2 * factor
    pred = y.mean(0) + 0.5 * (y - y.mean(0))
    want = 1 - float(np.sum((pred - y) ** 2)) / sst
    got = scores.r2_of(pred, y)
    s2, e2 = scores.sst_from_sums(y.T @ y, y.sum(0), 500.0)
    from_sums = scores.r2(float(np.sum((pred - y) ** 2)), s2, e2)
    if factor > 1:
        assert got == pytest.approx(want, rel=1e-9) and want == pytest.approx(0.75, rel=1e-2)
        assert from_sums == pytest.approx(want, rel=1e-2)
    else:
        assert got is None and from_sums is None


@pytest.mark.parametrize("gap", [1e2, 0.2])
def test_cut_reliable_gap(gap: float) -> None:
    """An unconverged W's count of k outliers is kept when s_k / s_(k+1) is 1e2 x RELIABLE_GAP, not at
    0.2 x (1e-2 x is below 1, where no sorted gap lies); a converged W's count is always kept."""
    from mhla_cli.solve.spectrum import count_reliability, outlier_gap

    ratio = gap * DOC["RELIABLE_GAP"]
    s = np.array([3.0, 2.0, 2.0 / ratio, 1.5 / ratio, 1.0 / ratio])
    assert outlier_gap(s, 2) == pytest.approx(s[1] / s[2])
    kept, reason = count_reliability(s, 2, converged=False)
    assert kept is (gap > 1) and (reason is None) is (gap > 1)
    assert count_reliability(s, 2, converged=True) == (True, None)


def test_cut_orthonormal_spans_on_load(tmp_path: Path) -> None:
    """A reduced features file whose stored span_last column is off unit length by factor x
    ORTHONORMAL_TOL (|M^T M - I| in numpy): loaded at 1e-2 x, refused at 1e2 x."""
    from mhla_cli.errors import InputError

    X, off, y = _off_plane(np.random.default_rng(45), 300, 0.0)  # last tokens in a plane: reduced spans
    src, path = tmp_path / "t.h5", tmp_path / "f.h5"
    with h5py.File(src, "w") as f:
        f["tokens"], f["offsets"], f["targets"] = X, off, y
    red = featurize(src, spans="on")
    assert red.on_spans
    red.save(path)
    with h5py.File(path, "r") as f:
        F0 = np.array(f["span_last"])
    assert F0.shape == (3, 2)
    for factor in (1e-2, 1e2):
        F = F0.copy()
        F[:, 0] *= np.sqrt(1 + factor * DOC["ORTHONORMAL_TOL"])
        dev = np.abs(F.T @ F - np.eye(2)).max()
        assert dev == pytest.approx(factor * DOC["ORTHONORMAL_TOL"], rel=1e-3)
        with h5py.File(path, "a") as f:
            unseal(f)
            f["span_last"][...] = F
        if factor < 1:
            Features.load(path)
        else:
            with pytest.raises(InputError, match="orthonormal columns"):
                Features.load(path)


def test_cut_fold_sums(tmp_path: Path) -> None:
    """A features file whose fold grams (numpy's sum) miss its gram by factor x FOLD_SUM_TOL of max
    |gram| on one diagonal entry: the folds load at 1e-2 x, and are refused at 1e2 x."""
    from mhla_cli.errors import InputError
    from mhla_cli.statistics.folds import featurize_folds, load_folds, save_with_folds

    ds, _ = synthetic.generate_teacher(2, 1, 120, "2:5", seed=46)
    data = tmp_path / "d.h5"
    ds.save(data, dtype="float64")
    total, folds = featurize_folds(data, 3)
    path = tmp_path / "f.h5"
    save_with_folds(total, folds, path)
    with h5py.File(path, "r") as f:
        g0 = np.array(f["fold_gram"])
    scale = np.abs(g0.sum(axis=0)).max()
    for factor in (1e-2, 1e2):
        g = g0.copy()
        g[0, 0, 0] += factor * DOC["FOLD_SUM_TOL"] * scale
        with h5py.File(path, "a") as f:
            unseal(f)
            f["fold_gram"][...] = g
        if factor < 1:
            assert len(load_folds(path)) == 3
        else:
            with pytest.raises(InputError, match="do not sum"):
                load_folds(path)


@pytest.mark.parametrize("factor,n_heads", [(1e-2, 2), (1e2, 3)])
def test_cut_fewest_tol(factor: float, n_heads: int) -> None:
    """--fewest's cut on the function change: a 2-head teacher plus a third head whose outputs on the data
    are factor x FEWEST_TOL of the outputs (relative RMS) is fitted by 2 heads at 1e-2 x, needs 3 at 1e2 x;
    the reported change is numpy's RMS difference of the heads' and the model's outputs."""
    from mhla_cli import export_heads
    from mhla_cli.model import synthetic
    from mhla_cli.model.forward import predict
    from mhla_cli.solve.lstsq import fit

    rng = np.random.default_rng(8)
    d, length, n_seq = 3, 6, 150
    off = np.arange(0, n_seq * length + 1, length)
    X = rng.standard_normal((n_seq * length, d))
    y2 = np.asarray(predict(synthetic.random_teacher(d, 2, rng), X, off))
    y1 = np.asarray(predict(synthetic.random_teacher(d, 1, rng), X, off))
    eps = factor * DOC["FEWEST_TOL"] * np.sqrt(np.mean(y2**2) / np.mean(y1**2))
    model = fit(chunk_features(X, off, y2 + eps * y1, d))
    heads = export_heads(model, fewest=True)
    assert heads.n_heads == n_heads
    seqs = [X[a:b] for a, b in zip(off[:-1], off[1:])]
    yh = np.stack([sum(heads.V[h] @ Z.T @ Z @ heads.Q[h] @ Z[-1] for h in range(heads.n_heads)) for Z in seqs])
    ym = np.stack([model.coef_b @ _reference.canonical_features(Z @ model.basis) for Z in seqs])
    ref = np.sqrt(np.mean((yh - ym) ** 2) / np.mean(ym**2))
    assert heads.info["function_change"] <= DOC["FEWEST_TOL"]
    assert abs(heads.info["function_change"] - ref) <= 1e-6 * ref + 1e-12


def test_cut_lambda_floor_fraction() -> None:
    """--fewest's lower bound proves t = LAMBDA_FLOOR_FRACTION x lambda_min (a Cholesky of Lambda~ - t I) and
    counts the singular values of B(x) above tol ||p_b||_L / sqrt(t): a 3-head function whose third head's
    singular values stand 10x above that radius gets the bound 3; with t 1e-4 x smaller (radius 100x)
    they fall below it (bound 2), and at 1e4 x the Cholesky fails (no t: bound 1)."""
    from mhla_cli.linalg import symgram
    from mhla_cli.model.canonical import canonical_function
    from mhla_cli.model.heads import W_from_p, coef_of_heads
    from mhla_cli.model.model import Model
    from mhla_cli.solve.lowrank import head_lower_bound

    rng = np.random.default_rng(12)
    d, psi, tol, lam0 = 3, 18, 1e-8, 0.1
    D = np.repeat([1.0 if j == k else np.sqrt(2.0) for j in range(d) for k in range(j, d)], d)
    lam = rng.uniform(0.5, 2.0, psi)
    lam[0] = lam0
    V, Q = rng.standard_normal((2, 3, d, d))
    xs = [np.eye(d)[j] for j in range(d)]
    xr = np.random.default_rng(0).standard_normal((4, d))  # head_lower_bound's directions (seed 0)
    xs += [x / np.linalg.norm(x) for x in xr]

    def model_of(e: float) -> Model:
        c = coef_of_heads(V * np.array([1.0, 1.0, e])[:, None, None], Q)
        return Model(coef=c, W=W_from_p(c), d=d, coef_b=c / D, basis=np.eye(d),
                     gram_pairs=symgram.pairs_from_gram(np.diag(lam), 6, 3),
                     info={"identifiable": True, "lambda_min": lam0})

    def third(e: float) -> float:  # the largest third singular value of B(x) = sum_h (V_h x)(Q_h^T x)^T (numpy)
        Ve = V * np.array([1.0, 1.0, e])[:, None, None]
        return max(np.linalg.svd(sum(np.outer(Ve[h] @ x, Q[h].T @ x) for h in range(3)), compute_uv=False)[2]
                   for x in xs)

    e = 1.0
    for _ in range(3):  # third(e) = 10 x the radius (the radius moves a little with e)
        cf = canonical_function(model_of(e))
        radius = cf.radius(tol) * cf.scale
        e *= 10 * radius / third(e)
    cf = canonical_function(model_of(e))
    radius = cf.radius(tol) * cf.scale
    assert third(e) == pytest.approx(10 * radius, rel=1e-3)
    assert cf.gram.floor() == pytest.approx(DOC["LAMBDA_FLOOR_FRACTION"] * lam0, rel=1e-12)
    pb_l = np.sqrt(np.sum((cf.coef * cf.scale / D) ** 2 * lam))  # ||p_b||_L, numpy
    assert radius == pytest.approx(tol * pb_l / np.sqrt(DOC["LAMBDA_FLOOR_FRACTION"] * lam0), rel=1e-9)
    c = cf.coef * cf.scale
    assert head_lower_bound(c, radius=radius)["lower_bound"] == 3
    assert head_lower_bound(c, radius=100 * radius)["lower_bound"] == 2  # t 1e-4 x smaller
    with pytest.raises(np.linalg.LinAlgError):  # t 1e4 x larger: not proven
        np.linalg.cholesky(np.diag(lam) - 1e4 * DOC["LAMBDA_FLOOR_FRACTION"] * lam0 * np.eye(psi))
