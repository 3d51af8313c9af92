"""Fewest heads, factorised and nuclear-norm fits on the statistics, per-fold CV (issue 5, items 1-2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mhla_cli.solve import lowrank
from mhla_cli.solve.lowrank._gauss_newton import _normal_parts
from mhla_cli.solve.lowrank._params import _jacobians, _p_of
from mhla_cli.model import synthetic
from mhla_cli.cli import run
from mhla_cli.feature_map import n_features, pair_index
from mhla_cli.statistics.folds import load_folds
from mhla_cli.model.heads import Heads, W_from_p, p_from_W
from mhla_cli.model.model import Model
from mhla_cli.solve.lstsq import fit
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.accumulate import chunk_features


def _np_features(X: np.ndarray) -> np.ndarray:
    """H(X) from its definition in plain numpy: S[j,k] * x_n[l], j <= k, l fastest."""
    S = np.einsum("tj,tk->jk", X, X)
    j, k = np.triu_indices(X.shape[1])
    return np.einsum("p,l->pl", S[j, k], X[-1]).ravel()


def _feats(ds: synthetic.Dataset, d: int) -> Features:
    return chunk_features(ds.tokens, ds.offsets, ds.targets, d)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _rel_b(a: np.ndarray, b: np.ndarray) -> float:
    """_rel in the orthonormal pair coordinates p / D (D = 1 on S[j,j], sqrt 2 on S[j,k], j < k): the
    coefficient change that fewest_heads reports for a bare coef (mhla_cli.model.canonical)."""
    d = b.shape[0]
    D = np.repeat([1.0 if j == k else np.sqrt(2.0) for j in range(d) for k in range(j, d)], d)
    return _rel(a / D, b / D)


def test_adjoint_and_projection() -> None:
    rng = np.random.default_rng(0)
    d = 4
    W = rng.standard_normal((d * d, d * d))
    R = rng.standard_normal((d, n_features(d)))
    assert abs(np.sum(p_from_W(W) * R) - np.sum(W * lowrank.p_adjoint(R))) < 1e-10
    target = rng.standard_normal((d, n_features(d)))
    Wp = lowrank.project_affine(W, target)
    assert _rel(p_from_W(Wp), target) < 1e-14
    # the projection is orthogonal: W - Wp is in the row space of A (orthogonal to the kernel)
    N = W - Wp
    K = rng.standard_normal((d * d, d * d))
    K = K - W_from_p(p_from_W(K))  # a kernel element (antisymmetric in (j, k))
    assert np.abs(p_from_W(K)).max() < 1e-12
    assert abs(np.sum(N * K)) < 1e-10


def test_normal_parts_match_dense_jacobian() -> None:
    rng = np.random.default_rng(1)
    d, H = 3, 2
    ds, _ = synthetic.generate_teacher(d, 2, 60, 5, noise=0.1, seed=1)
    feats = _feats(ds, d)
    Vm, Qm = rng.standard_normal((H, d * d)), rng.standard_normal((H, d * d))
    p = _p_of(Vm, Qm)
    JV, JQ = _jacobians(Vm, Qm)
    J = np.hstack([JV, JQ])
    Gb = np.kron(np.eye(d), feats.gram)
    Hd = (2 / feats.n_samples) * J.T @ Gb @ J
    gd = (2 / feats.n_samples) * J.T @ (p @ feats.gram - feats.moments.T).ravel()
    HVV, HQQ, HVQ, gV, gQ = _normal_parts(feats, Vm, Qm, p @ feats.gram - feats.moments.T)
    Hf = np.block([[HVV, HVQ], [HVQ.T, HQQ]])
    assert np.abs(Hf - Hd).max() <= 1e-12 * np.abs(Hd).max()
    assert np.abs(np.concatenate([gV, gQ]) - gd).max() <= 1e-12 * np.abs(gd).max()
    # p is linear in each factor: J_V v = J_Q q = p
    assert _rel(JV @ Vm.ravel(), p.ravel()) < 1e-13 and _rel(JQ @ Qm.ravel(), p.ravel()) < 1e-13


@pytest.mark.parametrize("d", [3, 4, 6])
@pytest.mark.parametrize("H", [1, 2, 3])
def test_fit_then_fewest_heads_recovers_teacher(d: int, H: int) -> None:
    ds, teacher = synthetic.generate_teacher(d, H, n_features(d) + 40, 8, seed=10 * d + H)
    model = fit(_feats(ds, d))
    heads = lowrank.fewest_heads(model.coef)
    assert heads.n_heads <= H
    assert _rel(heads.coef, teacher.coef) <= 1e-8
    assert heads.info["coef_change"] <= 1e-8 and heads.info["coordinates"] == "own"
    assert abs(heads.info["coef_change"] - _rel_b(heads.coef, model.coef)) < 1e-12
    # the model itself (its data's Lambda~): the change of the outputs on the training data
    on_data = lowrank.fewest_heads(model)
    assert on_data.n_heads <= H and on_data.info["function_change"] <= 1e-8
    assert on_data.info["coordinates"] == "canonical"


def test_min_nuclear_w_is_feasible_and_low_rank() -> None:
    rng = np.random.default_rng(2)
    t = synthetic.random_teacher(5, 2, rng)
    W = lowrank.min_nuclear_W(t.coef)
    s = np.linalg.svd(W, compute_uv=False)
    assert _rel(p_from_W(W), t.coef) < 1e-13
    assert s[2] < 1e-9 * s[0]
    # never more nuclear norm than the teacher's own (rank-2) W nor the min-norm W
    from mhla_cli.model.heads import W_from_heads, W_from_p
    assert s.sum() <= lowrank.nuclear_norm(W_from_heads(t.V, t.Q)) * (1 + 1e-9)
    assert s.sum() < lowrank.nuclear_norm(W_from_p(t.coef))


def test_factorised_fit_from_30_samples_d6() -> None:
    """The issue's check: rank-1 d = 6 teacher from N = 30 < psi = 126 samples, p error ~1e-12."""
    ds, teacher = synthetic.generate_teacher(6, 1, 30, 20, seed=1)
    feats = _feats(ds, 6)
    res = lowrank.fit_factorised(feats, 1, seed=0)
    assert _rel(res.coef, teacher.coef) < 1e-10
    assert _rel(fit(feats).coef, teacher.coef) > 0.5  # least squares cannot
    assert res.heads is not None and res.heads.n_heads == 1
    assert _rel(res.heads.coef, res.coef) < 1e-12


def test_weight_decay_equals_nuclear_penalty() -> None:
    """(1/N) SSE + L (||V||^2 + ||Q||^2) / 2 at its optimum equals the nuclear fit's objective."""
    d = 3
    ds, _ = synthetic.generate_teacher(d, 1, 200, 6, noise=0.3, seed=4)
    feats = _feats(ds, d)
    lam = 0.3 * lowrank.nuclear_lambda_max(feats)
    nuc = lowrank.fit_nuclear(feats, lam, max_iter=20000, tol=1e-12)
    assert nuc.info["converged"] and 1 <= nuc.info["rank"] <= 2
    fac = lowrank.fit_factorised(feats, 2, weight_decay=lam, restarts=4, tol=1e-14)
    assert abs(fac.info["objective"] - nuc.info["objective"]) <= 1e-6 * nuc.info["objective"]
    assert _rel(fac.coef, nuc.coef) < 1e-3


def test_nuclear_lambda_max_is_the_zero_threshold() -> None:
    ds, _ = synthetic.generate_teacher(3, 2, 100, 6, noise=0.1, seed=5)
    feats = _feats(ds, 3)
    lmax = lowrank.nuclear_lambda_max(feats)
    assert np.abs(lowrank.fit_nuclear(feats, 1.01 * lmax).W).max() == 0
    assert np.abs(lowrank.fit_nuclear(feats, 0.9 * lmax).W).max() > 0


def test_cli_fit_heads_fewest_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, th = tmp_path / "d.h5", tmp_path / "t.h5"
    assert run(["generate", "teacher", "-o", str(data), "--dim", "6", "--heads", "1", "--n-samples", "30",
                "--seq-len", "20", "--seed", "1", "--teacher-out", str(th), "--dtype", "float64", "-q"]) == 0
    m = tmp_path / "m.h5"
    capsys.readouterr()
    assert run(["fit", str(data), "-o", str(m), "--heads", "1", "--json", "-q"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["method"] == "factorised" and info["n_heads"] == 1 and "objective" in info
    assert _rel(Model.load(m).coef, Heads.load(th).coef) < 1e-10
    # the stored W has rank 1, so plain export-heads gives one head
    h = tmp_path / "h.h5"
    assert run(["export-heads", str(m), "-o", str(h), "--fewest", "--json", "-q"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_heads"] == 1 and out["function_change"] <= 1e-8
    assert run(["fit", str(data), "-o", str(tmp_path / "x.h5"), "--heads", "two"]) == 2
    assert run(["fit", str(data), "-o", str(tmp_path / "x.h5"), "--heads", "1", "--nuclear", "1"]) == 2


def test_folds_and_auto(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`fit --heads auto` picks the teacher's head count by CV over a folds file (the fold sums
    themselves are checked against plain numpy in test_folds.py)."""
    ds, teacher = synthetic.generate_teacher(3, 2, 400, 6, noise=0.05, seed=6)
    data = tmp_path / "d.h5"
    ds.save(data, dtype="float64")
    feats = tmp_path / "f.h5"
    assert run(["featurize", str(data), "-o", str(feats), "--folds", "3", "-q"]) == 0
    folds = load_folds(feats)
    assert folds is not None and len(folds) == 3
    capsys.readouterr()
    assert run(["fit", str(feats), "-o", str(tmp_path / "m.h5"), "--heads", "auto", "--json", "-q"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["n_heads"] == 2 and info["cv"]["chosen"] == 2
    # a features file without folds cannot do 'auto'
    plain = tmp_path / "p.h5"
    assert run(["featurize", str(data), "-o", str(plain), "-q"]) == 0
    capsys.readouterr()
    assert run(["fit", str(plain), "-o", str(tmp_path / "m2.h5"), "--nuclear", "auto"]) == 2
    assert "--folds" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# fewest heads: counts against known truths, the lower bound against plain numpy (issue 9, item 2)
# --------------------------------------------------------------------------------------------


def _check_fewest(coef: np.ndarray, n_heads: int, proven: bool) -> Heads:
    heads = lowrank.fewest_heads(coef)
    assert heads.n_heads == n_heads
    # verified independently: the heads' own p (p_from_W of sum_h vec(V_h) vec(Q_h)^T) against coef
    assert _rel(heads.coef, coef) <= 1e-8
    assert heads.info["coef_change"] <= 1e-8 and heads.info["function_change"] is None
    assert heads.info["proven_minimal"] is proven
    assert heads.info["proven_minimal"] == (heads.info["lower_bound"] == n_heads)
    return heads


@pytest.mark.parametrize("seed", range(20))
def test_fewest_d2_four_head_teachers_give_two_proven(seed: int) -> None:
    """Issue 9: 7 of these 20 gave 3 heads. For d = 2 the B_j bound proves 2."""
    _, teacher = synthetic.generate_teacher(2, 4, 10, 4, seed=seed)
    heads = _check_fewest(teacher.coef, 2, proven=True)
    assert heads.info["lower_bound"] == 2 and lowrank.fewest_message(heads.info).endswith("proven minimal (lower bound 2)")


@pytest.mark.parametrize("seed", [3, 5, 6])
def test_fewest_d2_from_fitted_data(seed: int) -> None:
    """The issue's failing seeds, through a fit on featurized data."""
    ds, teacher = synthetic.generate_teacher(2, 4, n_features(2) + 40, 8, seed=seed)
    model = fit(_feats(ds, 2))
    heads = _check_fewest(model.coef, 2, proven=True)
    assert _rel(heads.coef, teacher.coef) <= 1e-8


@pytest.mark.parametrize("seed", [0, 1])
def test_fewest_d3_four_head_teachers_give_four_found(seed: int) -> None:
    """d = 3 four-head teachers: 4 heads (issue 9 saw 5). The bound is 3, so the count is "found"."""
    ds, teacher = synthetic.generate_teacher(3, 4, n_features(3) + 40, 8, seed=seed)
    heads = _check_fewest(fit(_feats(ds, 3)).coef, 4, proven=False)
    assert _rel(heads.coef, teacher.coef) <= 1e-8
    info = heads.info
    assert info["lower_bound"] == 3
    # every start was tried at H = 3 before moving on, and none reached the tolerance
    assert info["starts_tried"] == {3: 18, 4: info["starts_tried"][4]}
    assert info["starts_per_head_count"] == {3: 18, 4: 18} and info["best_error"][3] > 1e-8
    assert lowrank.fewest_message(info) == "4 heads: fewest found (18 starts per head count tried; lower bound 3)"


@pytest.mark.slow
def test_fewest_wide_sweep() -> None:
    for seed in range(100):
        ds, _ = synthetic.generate_teacher(2, 4, n_features(2) + 40, 8, seed=seed)
        _check_fewest(fit(_feats(ds, 2)).coef, 2, proven=True)
    for seed in range(20):
        ds, _ = synthetic.generate_teacher(3, 4, n_features(3) + 40, 8, seed=seed)
        _check_fewest(fit(_feats(ds, 3)).coef, 4, proven=False)


def _b_rank(V: np.ndarray, Q: np.ndarray, x: np.ndarray, thr: float) -> int:
    """rank of B(x) = sum_h (V_h x)(Q_h^T x)^T, from the heads (no p involved)."""
    B = sum(np.outer(V[h] @ x, Q[h].T @ x) for h in range(V.shape[0]))
    return int((np.linalg.svd(B, compute_uv=False) > thr).sum())


@pytest.mark.parametrize("d,H", [(2, 4), (3, 1), (3, 2), (4, 2), (4, 3), (5, 7)])
def test_lower_bound_matches_numpy_block_ranks(d: int, H: int) -> None:
    rng = np.random.default_rng(10 * d + H)
    t = synthetic.random_teacher(d, H, rng)
    coef = t.coef
    lb = lowrank.head_lower_bound(coef, tol=1e-8)
    thr = 1e-8 * np.linalg.norm(coef)
    # B_j[a, l] = W[a*d+j, j*d+l] of the teacher's own W (sum_h vec(V_h) vec(Q_h)^T)
    Wt = np.einsum("hr,hc->rc", t.V.reshape(H, -1), t.Q.reshape(H, -1))
    ranks = [int((np.linalg.svd(Wt[j::d, j * d:(j + 1) * d], compute_uv=False) > thr).sum()) for j in range(d)]
    assert lb["block_ranks"] == ranks
    assert ranks == [_b_rank(t.V, t.Q, np.eye(d)[j], thr) for j in range(d)]
    assert lb["lower_bound"] == min(H, d) <= H  # generic heads: rank min(H, d)
    assert lb["lower_bound"] == max(ranks + lb["direction_ranks"])


def test_lower_bound_is_about_the_tolerance() -> None:
    """A perturbation below tol ||p|| may not raise the bound (a 2-head model is within tol);
    a larger one must (no 2-head model is within tol then)."""
    rng = np.random.default_rng(3)
    coef = synthetic.random_teacher(4, 2, rng).coef
    E = rng.standard_normal(coef.shape)
    E /= np.linalg.norm(E)
    n = np.linalg.norm(coef)
    assert lowrank.head_lower_bound(coef + 1e-10 * n * E, tol=1e-8)["lower_bound"] == 2
    assert lowrank.head_lower_bound(coef + 1e-5 * n * E, tol=1e-8)["lower_bound"] == 4
    # off-diagonal-only p: every B_j is 0, a random direction still sees it
    P = np.zeros_like(coef).reshape(4, -1, 4)
    j, k = pair_index(4)
    P[:, j < k, :] = rng.standard_normal((4, int((j < k).sum()), 4))
    lb = lowrank.head_lower_bound(P.reshape(4, -1))
    assert lb["block_ranks"] == [0] * 4 and lb["lower_bound"] == 4


# --------------------------------------------------------------------------------------------
# convergence records (issue 9, item 4)
# --------------------------------------------------------------------------------------------


def test_min_nuclear_w_reports_convergence() -> None:
    t = synthetic.random_teacher(4, 2, np.random.default_rng(4))
    W, info = lowrank.min_nuclear_W(t.coef, return_info=True)
    assert info["converged"] and info["iterations"] < info["max_iter"] and info["final_residual"] <= 1e-11
    assert np.linalg.svd(W, compute_uv=False)[2] < 1e-9 * np.linalg.norm(W)  # rank 2, as the teacher
    W3, info3 = lowrank.min_nuclear_W(t.coef, max_iter=3, return_info=True)
    assert not info3["converged"] and info3["iterations"] == 3 and info3["final_residual"] > 1e-11
    assert lowrank.hit_limit(info3) and not lowrank.hit_limit(info)
    assert _rel(p_from_W(W3), t.coef) < 1e-12  # feasible even when unconverged


def test_nuclear_and_factorised_fits_report_convergence() -> None:
    ds, _ = synthetic.generate_teacher(3, 1, 200, 6, noise=0.3, seed=4)
    feats = _feats(ds, 3)
    lam = 0.3 * lowrank.nuclear_lambda_max(feats)
    short = lowrank.fit_nuclear(feats, lam, max_iter=2)
    assert short.info["converged"] is False and short.info["solver"]["iterations"] == 2
    assert "did not converge after 2 iterations" in lowrank.solver_warnings(short.info)[0]
    full = lowrank.fit_nuclear(feats, lam)
    assert full.info["converged"] and full.info["final_residual"] <= 1e-9 and not lowrank.solver_warnings(full.info)
    fac = lowrank.fit_factorised(feats, 1, restarts=2, max_iter=1, als_sweeps=0)
    assert fac.info["solver"]["converged"] is False and fac.info["solver"]["stop"] == "max_iter"
    fac = lowrank.fit_factorised(feats, 1, restarts=2)
    assert fac.info["converged"] and fac.info["solver"]["stop"] in ("tolerance", "no-descent")


def test_cli_warns_when_nuclear_fit_stops_at_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import functools

    ds, _ = synthetic.generate_teacher(3, 1, 200, 6, noise=0.3, seed=4)
    data = tmp_path / "d.h5"
    ds.save(data, dtype="float64")
    capsys.readouterr()
    assert run(["fit", str(data), "-o", str(tmp_path / "m.h5"), "--nuclear", "0.01", "--json"]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert out["converged"] is True and out["solver"]["converged"] is True and "did not converge" not in cap.err
    monkeypatch.setattr(lowrank, "fit_nuclear", functools.partial(lowrank.fit_nuclear, max_iter=3))
    assert run(["fit", str(data), "-o", str(tmp_path / "m2.h5"), "--nuclear", "0.01", "--json", "-q"]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert out["converged"] is False and out["solver"]["iterations"] == 3
    assert "warning: FISTA (nuclear-norm fit) did not converge after 3 iterations" in cap.err


def test_cli_fewest_json_and_message(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    ds, _ = synthetic.generate_teacher(2, 4, n_features(2) + 40, 8, seed=3)
    m = tmp_path / "m.h5"
    fit(_feats(ds, 2)).save(m)
    capsys.readouterr()
    assert run(["export-heads", str(m), "-o", str(tmp_path / "h.h5"), "--fewest", "--json"]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert out["n_heads"] == 2 == out["lower_bound"] and out["proven_minimal"] is True
    assert out["function_change"] <= 1e-8 and out["starts_tried"]["2"] >= 1 and out["converged"] is True
    assert "proven minimal" in cap.err and "did not converge" not in cap.err
    assert _rel(Heads.load(tmp_path / "h.h5").coef, Model.load(m).coef) <= 1e-8
    # an unconverged min-nuclear W only seeds the search: warned, and the heads are still verified
    orig = lowrank.min_nuclear_W
    monkeypatch.setattr(lowrank.fewest, "min_nuclear_W", lambda coef, **kw: orig(coef, **{**kw, "max_iter": 2}))
    assert run(["export-heads", str(m), "-o", str(tmp_path / "h2.h5"), "--fewest", "--json", "-q"]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert out["converged"] is False and out["n_heads"] == 2 and out["function_change"] <= 1e-8
    assert "did not converge after 2 iterations" in cap.err
