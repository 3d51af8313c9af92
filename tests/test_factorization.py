"""One factorization per statistics (mhla_cli.linalg.factorization): the Cholesky + Lanczos path gives the
dense eigendecomposition's verdict, rank, lambda_min / lambda_max (1e-10 relative), p and probe
verdicts, on identifiable, singular, observed-domain and near-threshold data; both equal plain numpy
on the materialised canonical features (tests/_reference.py); the ridge is the spectral ridge for every
r >= 0; and the factorization is reused."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli.linalg import factorization
from mhla_cli.model import synthetic

import _reference
from mhla_cli.solve.probes import certify_probes
from mhla_cli import certify
from mhla_cli.solve.domains import factorize
from mhla_cli.solve.lstsq import fit
from mhla_cli.statistics.accumulate import chunk_features


def _cases() -> dict[str, tuple]:
    rng = np.random.default_rng(0)
    d = 4  # psi = 40: above the dense-only size, so both paths can run
    ds, _ = synthetic.generate_teacher(d, 2, 300, "2:9", seed=1)
    one = np.arange(301)
    subspace = rng.standard_normal((ds.tokens.shape[0], 3)) @ rng.standard_normal((3, d))
    return {
        "identifiable": (ds.tokens, ds.offsets, ds.targets),
        "length-1 (singular)": (ds.tokens[:300], one, ds.targets),
        "few samples": (ds.tokens[:ds.offsets[30]], ds.offsets[:31], ds.targets[:30]),
        "tokens in a 3-d subspace": (subspace, ds.offsets, ds.targets),
        "badly scaled": (ds.tokens * np.array([1.0, 1e-3, 1.0, 30.0]), ds.offsets, ds.targets),
    }


def _run(tokens, offsets, targets, min_eig: float = 0.0) -> dict:
    feats = chunk_features(tokens, offsets, targets, tokens.shape[1])
    out = {}
    for domain in ("full", "observed"):
        c = certify(feats, min_eig=min_eig, domain=domain)
        out[domain] = (c.identifiable, c.rank, c.lambda_min, c.lambda_max, c.threshold)
    m = fit(feats)
    out["p"] = m.coef
    out["fit"] = (m.info["identifiable"], m.info["rank"], m.info["lambda_min"])
    out["ridge"] = fit(feats, ridge=1e-3 * out["full"][3]).coef
    return out


@pytest.mark.parametrize("name", list(_cases()))
def test_cholesky_path_equals_the_dense_eigendecomposition(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = _cases()[name]
    dense = _run(*case)
    monkeypatch.setattr(factorization, "DENSE_MAX", 0)
    fast = _run(*case)
    for key in ("full", "observed"):
        a, b = fast[key], dense[key]
        assert a[:2] == b[:2], (key, a, b)  # verdict and rank
        assert abs(a[3] - b[3]) <= 1e-10 * b[3]
        assert abs(a[2] - b[2]) <= 1e-10 * (abs(b[2]) if b[0] else b[3]), (key, a[2], b[2])
    assert fast["fit"][:2] == dense["fit"][:2]
    scale = np.abs(dense["p"]).max()
    assert np.abs(fast["p"] - dense["p"]).max() <= 1e-9 * scale
    assert np.abs(fast["ridge"] - dense["ridge"]).max() <= 1e-9 * np.abs(dense["ridge"]).max()
    # and both against plain numpy on the materialised canonical features (tests/_reference.py)
    tokens, offsets, targets = case
    A = chunk_features(tokens, offsets, targets, tokens.shape[1]).basis
    ref = _reference.canonical(tokens, offsets, targets, A=A)
    w = ref["eigenvalues"]
    tol = w.size * np.finfo(np.float64).eps * w[-1]
    seqs = [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    want_p = _reference.predict_canonical(_reference.min_norm_function(ref), A, seqs)
    want_r = _reference.predict_canonical(_reference.ridge_function(ref, 1e-3 * w[-1]), A, seqs)
    for out in (dense, fast):
        ident, rank, lmin, lmax, _ = out["full"]
        assert ident is bool(w[0] > tol) and rank == int((w > tol).sum()), (name, ident, rank)
        assert abs(lmax - w[-1]) <= 1e-10 * w[-1]
        assert abs(lmin - w[0]) <= (1e-9 * w[0] if ident else tol)
        assert _reference.ratio(_reference.predict_own(out["p"], seqs), want_p) <= 1e-8
        assert _reference.ratio(_reference.predict_own(out["ridge"], seqs), want_r) <= 1e-10


def test_near_threshold_margin_gives_the_same_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, offsets, targets = _cases()["identifiable"]
    lmin = certify(chunk_features(tokens, offsets, targets, 4)).lambda_min
    for margin in (0.999, 1.001):
        dense = _run(tokens, offsets, targets, min_eig=margin * lmin)
        monkeypatch.setattr(factorization, "DENSE_MAX", 0)
        fast = _run(tokens, offsets, targets, min_eig=margin * lmin)
        monkeypatch.setattr(factorization, "DENSE_MAX", 4096)
        assert fast["full"][0] == dense["full"][0] == (margin < 1)


def test_probe_verdicts_are_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    probes = tmp_path / "p.h5"
    with h5py.File(probes, "w") as f:
        f["tokens"], f["offsets"] = rng.standard_normal((60, 4)), np.arange(0, 61, 3)
    for name, case in _cases().items():
        a = certify_probes(chunk_features(case[0], case[1], case[2], 4), probes).undetermined
        monkeypatch.setattr(factorization, "DENSE_MAX", 0)
        b = certify_probes(chunk_features(case[0], case[1], case[2], 4), probes).undetermined
        monkeypatch.setattr(factorization, "DENSE_MAX", 4096)
        assert np.array_equal(a, b), name


def test_one_factorization_is_shared_and_dropped_when_the_sums_change(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, offsets, targets = _cases()["identifiable"]
    feats = chunk_features(tokens, offsets, targets, 4)
    monkeypatch.setattr(factorization, "DENSE_MAX", 0)
    calls = {"cho": 0, "eigh": 0}
    import scipy.linalg

    real_cho, real_eigh = scipy.linalg.cho_factor, scipy.linalg.eigh

    def cho(*a, **k):
        calls["cho"] += 1
        return real_cho(*a, **k)

    def eigh(*a, **k):
        # the structure's partial traces (q x q, d x d) are small, and block Lanczos asks only for the
        # top pair of its projected matrix (psi x psi once its basis spans the whole space at this
        # tiny psi): count only the psi x psi decompositions that want more
        one_pair = k.get("subset_by_index") is not None and k["subset_by_index"][0] == k["subset_by_index"][1]
        calls["eigh"] += int(np.shape(a[0])[0] == feats.n_features and not one_pair)
        return real_eigh(*a, **k)

    monkeypatch.setattr(scipy.linalg, "cho_factor", cho)
    monkeypatch.setattr(scipy.linalg, "eigh", eigh)
    certify(feats)
    fit(feats)
    certify(feats)
    assert calls == {"cho": 1, "eigh": 0}  # identifiable: one Cholesky, no eigendecomposition
    fac = factorize(feats)
    feats.add(chunk_features(tokens, offsets, targets, 4))  # the sums change: the factorization goes
    assert factorize(feats) is not fac


def test_the_seconds_of_each_step_are_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    import json

    from mhla_cli.cli import run

    tokens, offsets, targets = _cases()["identifiable"]
    cert = certify(chunk_features(tokens, offsets, targets, 4))
    # the dense eigenvalues, and the verdict's proof: a Cholesky of Lambda~ - t I
    assert set(cert.seconds) == {"eigenvalues", "cholesky"} and cert.seconds["eigenvalues"] >= 0
    monkeypatch.setattr(factorization, "DENSE_MAX", 0)
    feats = chunk_features(tokens, offsets, targets, 4)
    cert = certify(feats)
    assert set(cert.seconds) == {"cholesky", "lanczos"}  # no eigendecomposition when identifiable
    assert {"cholesky", "lanczos", "solve"} <= set(fit(feats).info["seconds"])
    data = tmp_path / "d.h5"
    with h5py.File(data, "w") as f:
        f["tokens"], f["offsets"], f["targets"] = tokens, offsets, targets
    assert run(["certify", str(data), "--json", "-q"]) == 0
    assert {"pass", "cholesky", "lanczos"} <= set(json.loads(capsys.readouterr().out)["seconds"])


# --------------------------------------------------------------------------------------------
# ridge for every r >= 0 against the spectral ridge solution on materialised canonical features
# --------------------------------------------------------------------------------------------


def _singular_cases() -> dict[str, tuple]:
    rng = np.random.default_rng(11)
    d = 4  # psi = 40
    lens = rng.integers(2, 9, size=33)
    off = np.concatenate([[0], np.cumsum(lens)])
    X = rng.standard_normal((int(off[-1]), d))
    y = rng.standard_normal((33, d))  # noisy targets: nothing realisable
    few = (X[:off[33 - 6]], off[:28], y[:27])  # N = 27 < psi = 40
    seqs = [X[off[i]:off[i + 1]] for i in range(22)] * 3  # 22 sequences, each 3 times: rank <= 22
    rep_off = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    return {"few samples": few, "repeated": (np.concatenate(seqs), rep_off, np.tile(y[:22], (3, 1)))}


def _spectral_ridge_fitted(tokens, offsets, targets, r: float) -> np.ndarray:
    """Fitted values of V diag(1 / (lambda + r)) V^T m~ over the eigenvalues above psi eps lambda_max."""
    ref = _reference.canonical(tokens, offsets, targets)
    w, V = np.linalg.eigh(ref["lambda"])
    keep = w > w.size * np.finfo(np.float64).eps * w[-1]
    Vk = V[:, keep]
    pb = (Vk @ ((Vk.T @ ref["moments"]) / (w[keep] + r)[:, None])).T
    return ref["Ht"] @ pb.T


@pytest.mark.parametrize("dense_max", [4096, 0], ids=["dense", "cholesky-lanczos"])
@pytest.mark.parametrize("name", ["few samples", "repeated"])
@pytest.mark.parametrize("r", [0.0, 1e-30, 1e-20, 1e-14, 1e-12, 1e-8, 1e-3, 1.0, "1e-2 tol", "0.3 tol", "3 tol",
                               "1e2 tol"])
def test_ridge_equals_the_spectral_ridge_for_every_r(name: str, r: float | str, dense_max: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(factorization, "DENSE_MAX", dense_max)
    tokens, offsets, targets = _singular_cases()[name]
    if isinstance(r, str):  # a multiple of the certificate's tolerance psi eps lambda_max
        w = _reference.canonical(tokens, offsets, targets)["eigenvalues"]
        r = float(r.split()[0]) * w.size * np.finfo(np.float64).eps * w[-1]
    m = fit(chunk_features(tokens, offsets, targets, 4), ridge=r)
    assert not m.info["identifiable"]
    seqs = [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    got = _reference.predict_own(m.coef, seqs)
    want = _spectral_ridge_fitted(tokens, offsets, targets, r)
    assert _reference.ratio(got, want) <= 1e-8, (r, _reference.ratio(got, want))


@pytest.mark.parametrize("dense_max", [4096, 0], ids=["dense", "cholesky-lanczos"])
def test_the_verdict_is_proven_by_a_shifted_cholesky(dense_max: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """--min-eig at 0.5 x and 2 x the reference lambda_min: a Cholesky of Lambda~ - t I succeeds (proof)
    or fails, on both paths; lambda_min through the shifted factor is the reference's."""
    monkeypatch.setattr(factorization, "DENSE_MAX", dense_max)
    tokens, offsets, targets = _cases()["identifiable"]
    w = _reference.canonical(tokens, offsets, targets)["eigenvalues"]
    for factor in (0.5, 2.0):
        feats = chunk_features(tokens, offsets, targets, 4)
        c = certify(feats, min_eig=factor * w[0])
        assert c.identifiable is (factor < 1)
        assert c.proof == ("cholesky of Lambda~ - t I" if factor < 1 else "cholesky of Lambda~ - t I failed")
        assert c.to_dict()["proof"] == c.proof
        assert c.estimated == ([] if dense_max else ["lambda_min", "lambda_max"])
        assert abs(c.lambda_min - w[0]) <= 1e-9 * w[0]
        m = fit(feats)  # the fit reuses (or, near the shift, avoids) the proof's factor: the same p
        ref = _reference.canonical(tokens, offsets, targets)
        seqs = [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        want = _reference.predict_canonical(_reference.min_norm_function(ref), ref["A"], seqs)
        assert _reference.ratio(_reference.predict_own(m.coef, seqs), want) <= 1e-9


def test_a_singular_block_costs_one_failed_cholesky(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not identifiable (N < psi) on the Lanczos path: the proof's Cholesky fails once, and lambda_min
    comes from the eigendecomposition the null space needs anyway (no second Cholesky of Lambda~)."""
    import scipy.linalg

    monkeypatch.setattr(factorization, "DENSE_MAX", 0)
    calls = {"cho": 0}
    real = scipy.linalg.cho_factor

    def cho(*a, **k):
        calls["cho"] += 1
        return real(*a, **k)

    monkeypatch.setattr(scipy.linalg, "cho_factor", cho)
    tokens, offsets, targets = _singular_cases()["repeated"]
    c = certify(chunk_features(tokens, offsets, targets, 4))
    assert not c.identifiable and c.proof == "cholesky of Lambda~ - t I failed"
    assert calls["cho"] == 1


# --------------------------------------------------------------------------------------------
# the Lanczos estimates above DENSE_MAX on hard spectra, against numpy.linalg.eigvalsh
# --------------------------------------------------------------------------------------------


def _hard_spectra(n: int = 300) -> dict[str, tuple[np.ndarray, str]]:
    """Symmetric PSD matrices with a hard bottom or top, and how close lambda_min / lambda_max must be."""
    rng = np.random.default_rng(40)

    def rotated(w: np.ndarray, seed: int) -> np.ndarray:
        Q = np.linalg.qr(np.random.default_rng(seed).standard_normal((w.size, w.size)))[0]
        a = (Q * w) @ Q.T
        return (a + a.T) / 2

    def bulk() -> np.ndarray:
        return np.sort(rng.uniform(1.0, 10.0, n))

    out = {}
    w = bulk()
    w[:4] = 0.5 * (1 + np.array([0.0, 1e-10, 2e-10, 3e-10]))  # unresolvable: within the cluster
    out["bottom cluster 1e-10"] = (rotated(w, 1), "cluster")
    w = bulk()
    w[:4] = 0.5 * (1 + np.array([0.0, 1e-4, 2e-4, 3e-4]))  # resolved: to ~1e-14
    out["bottom cluster 1e-4"] = (rotated(w, 2), "relative")
    w = bulk()
    w[-3:] = 20 * (1 + np.array([0.0, 1e-9, 2e-9]))
    out["top cluster 1e-9"] = (rotated(w, 3), "cluster")
    out["graded 1e-6..1"] = (rotated(np.logspace(-6, 0, n), 4), "absolute")
    F = rng.standard_normal((2 * n, n))
    F[:, :5] *= 1e-3  # five small-variance directions, rotated
    F = F @ np.linalg.qr(rng.standard_normal((n, n)))[0]
    out["rotated small-variance"] = (F.T @ F / (2 * n), "absolute")
    return out


@pytest.mark.parametrize("name", list(_hard_spectra()))
def test_lanczos_estimates_on_hard_spectra_equal_eigvalsh(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """lambda_min (Lanczos on the inverse through the proof's factor) and lambda_max (Lanczos on the matrix):
    to 1e-13 relative where the spectrum separates them (LANCZOS_TOL's ~1e-14), within the cluster's width
    where it does not (a Ritz value of a cluster narrower than the residual is any of its members), and to
    the reference's own accuracy n eps lambda_max on an ill-conditioned bottom."""
    monkeypatch.setattr(factorization, "DENSE_MAX", 0)
    a, kind = _hard_spectra()[name]
    w = np.linalg.eigvalsh(a)
    n, scale = a.shape[0], 1 / 7
    fac = factorization.Factorization(a, scale=scale)
    t = n * np.finfo(np.float64).eps * w[-1] * scale  # the certificate's threshold
    assert fac.proves_above(t)
    lmin, lmax = fac.lambda_min() / scale, fac.lambda_max() / scale
    assert fac.known_eigenvalues() is None  # estimated, not the dense eigenvalues
    bound_min = bound_max = 1e-13
    if kind == "cluster":
        bound_min = max(bound_min, (w[3] - w[0]) / w[0])
        bound_max = max(bound_max, (w[-1] - w[-3]) / w[-1])
    elif kind == "absolute":
        bound_min = max(bound_min, n * np.finfo(np.float64).eps * w[-1] / w[0])
    assert abs(lmin - w[0]) <= bound_min * w[0], (lmin, w[0])
    assert abs(lmax - w[-1]) <= bound_max * w[-1], (lmax, w[-1])


@pytest.mark.parametrize("cap", [None, 16], ids=["block Lanczos", "capped: ARPACK fallback"])
def test_each_estimate_says_how_it_was_found(cap: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """lambda_min / lambda_max above DENSE_MAX: block Lanczos (krylov), or ARPACK when its basis cap
    (MAX_BASIS_COLUMNS) is reached unconverged; either way the values equal eigvalsh's and the
    certificate's `estimates` record the method, the products and that it converged."""
    from mhla_cli.linalg import krylov

    monkeypatch.setattr(factorization, "DENSE_MAX", 0)
    if cap is not None:
        monkeypatch.setattr(krylov, "MAX_BASIS_COLUMNS", cap)
    a, _ = _hard_spectra()["bottom cluster 1e-4"]
    w = np.linalg.eigvalsh(a)
    fac = factorization.Factorization(a)
    t = a.shape[0] * np.finfo(np.float64).eps * w[-1]
    assert fac.proves_above(t)
    assert abs(fac.lambda_min() - w[0]) <= 1e-13 * w[0] and abs(fac.lambda_max() - w[-1]) <= 1e-13 * w[-1]
    for what in ("lambda_min", "lambda_max"):
        rec = fac.iterations[what]
        assert rec["converged"] is True
        if cap is None:
            assert rec["method"] == "block Lanczos" and rec["relative_residual"] <= rec["tolerance"]
            assert rec["block"] == krylov.BLOCK and rec["products"] >= 1
        else:
            assert rec["method"].startswith("ARPACK") and rec["block_lanczos"]["converged"] is False
            assert rec["block_lanczos"]["relative_residual"] > rec["tolerance"]


def test_the_certificate_reports_its_estimates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(factorization, "DENSE_MAX", 0)
    tokens, offsets, targets = _cases()["identifiable"]
    cert = certify(chunk_features(tokens, offsets, targets, 4))
    assert set(cert.estimates) == set(cert.estimated) == {"lambda_min", "lambda_max"}
    assert all(r["converged"] for r in cert.estimates.values())
    assert cert.to_dict()["estimates"] == cert.estimates
    monkeypatch.setattr(factorization, "DENSE_MAX", 4096)
    cert = certify(chunk_features(tokens, offsets, targets, 4))
    assert cert.estimated == [] and cert.estimates == {}


@pytest.mark.parametrize("side", [0.99, 1.01], ids=["rho just below sqrt(eps)", "rho just above sqrt(eps)"])
def test_the_refinement_stops_when_rho_to_the_k_plus_1_is_below_eps(side: float,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Factorization.solve through a factor of lam - s I: the first solve's error is rho = s / (lambda_min - s),
    k refinement steps leave rho^(k+1), so it takes the fewest k with rho^(k+1) <= eps: one step just below
    rho = sqrt(eps), two just above; the solution is numpy's to rounding either way."""
    a = _spd_for_refinement()
    w = np.linalg.eigvalsh(a)
    rho = side * np.sqrt(np.finfo(np.float64).eps)
    s = rho * w[0] / (1 + rho)  # rho = s / (lambda_min - s)
    fac = factorization.Factorization(a)
    assert fac.proves_above(s)
    solves = []
    real = factorization.Factorization._cho_solve
    monkeypatch.setattr(factorization.Factorization, "_cho_solve",
                        lambda self, c, r: solves.append(1) or real(self, c, r))
    rhs = np.random.default_rng(41).standard_normal((a.shape[0], 2))
    x = fac.solve(rhs)
    assert len(solves) == 1 + (1 if side < 1 else 2)
    ref = np.linalg.solve(a, rhs)
    assert np.abs(x - ref).max() <= 1e-13 * np.abs(ref).max()


def _spd_for_refinement(n: int = 60) -> np.ndarray:
    rng = np.random.default_rng(42)
    F = rng.standard_normal((3 * n, n))
    return F.T @ F / (3 * n)
