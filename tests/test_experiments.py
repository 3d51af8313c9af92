"""The paper-reproduction experiments (experiments/): each core function in a tiny setting, with a
property that fails if the reproduction breaks. Torch-dependent parts are skipped without torch."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

EXP = Path(__file__).resolve().parent.parent / "experiments"
sys.path.insert(0, str(EXP))

import causal_teacher  # noqa: E402
import dfa_executor  # noqa: E402
import fig1_teacher  # noqa: E402
import fig2_assoc  # noqa: E402
import icl_regression  # noqa: E402
import sample_complexity  # noqa: E402
from mhla_cli import forward_heads, n_features  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny problems: one BLAS thread avoids oversubscription on the shared 2-core machine."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        yield


def test_fig1_closed_form_reaches_float64_precision() -> None:
    ds, _ = fig1_teacher.make_data(2, 512, seed=0)  # the paper's Fig. 1a setup
    res = fig1_teacher.closed_form(ds)
    assert res["rel_mse"] < 1e-20
    assert res["n_heads"] <= 4  # at most d^2 heads


def test_fig2_certificate_separates_orthogonal_from_mixed_keys() -> None:
    mixed = fig2_assoc.convex_point(0.95, 2048, seed=0)
    orth = fig2_assoc.convex_point(1.0, 2048, seed=0)
    # Full domain: the query's value part is 0, so lambda_min = 0 for both.
    assert not mixed["identifiable_full"] and not orth["identifiable_full"]
    # Observed domain: orthogonal keys leave exact null directions; 5 % Gaussian keys lift them.
    assert mixed["identifiable_observed"] and mixed["lambda_min_observed"] > 1e-8 * mixed["lambda_max_observed"]
    assert not orth["identifiable_observed"]
    assert abs(orth["lambda_min_observed"]) < 1e-12 * orth["lambda_max_observed"]
    # Where the observed domain is identifiable the fit equals the truth there; on orthogonal keys the
    # minimum-norm fit (in the canonical coordinates) is one of many zero-loss solutions ...
    assert mixed["fit_distance_observed"] < 1e-9 and orth["fit_train_mse"] < 1e-20
    # ... but on orthogonal keys another zero-loss solution exists far from it, and it disagrees off the data.
    assert "witness" not in mixed
    w = orth["witness"]
    assert w["train_mse"] < 1e-20
    assert w["distance"] > 1.0
    # (the minimum-norm fit is taken in the canonical coordinates: off the data it need not be the
    # teacher, whose p happens to have no null component in the tokens' own coordinates)


def test_sample_complexity_certifies_exactly_at_psi() -> None:
    r = sample_complexity.run_dim(3, 1, (0.5, 1.0, 2.0))
    psi = n_features(3)
    assert r["smallest_n"] == [psi]
    assert r["length_one_rank"] == r["length_one_bound"] == 10 < psi
    assert np.median(r["curve"][0.5]["clean"]) > 1e-4    # under-determined: the min-norm fit is off
    assert np.median(r["curve"][2.0]["clean"]) < 1e-16   # certified: exact recovery
    assert np.median(r["curve"][2.0]["noisy"]) < 0.1


def test_linear_attention_stack_matches_reference() -> None:
    torch = pytest.importorskip("torch")
    import mhla_torch

    rng = np.random.default_rng(0)
    X = rng.standard_normal((5, 7, 3))
    layers = [(rng.standard_normal((3, 3)) * 0.1, rng.standard_normal((3, 3)) * 0.1) for _ in range(2)]
    tl = [(torch.from_numpy(V), torch.from_numpy(Q)) for V, Q in layers]
    # One layer is the 1-head MHLA.
    one = mhla_torch.linear_attention_forward(tl[:1], torch.from_numpy(X)).numpy()
    ref = np.array([forward_heads(layers[0][0][None], layers[0][1][None], x) for x in X])
    np.testing.assert_allclose(one, ref, rtol=1e-12)
    # Two layers: residual update at every position, then the last layer's last-token output.
    two = mhla_torch.linear_attention_forward(tl, torch.from_numpy(X)).numpy()
    Z = np.array([x + forward_heads(layers[0][0][None], layers[0][1][None], x, all_positions=True) for x in X])
    ref2 = np.array([forward_heads(layers[1][0][None], layers[1][1][None], z) for z in Z])
    np.testing.assert_allclose(two, ref2, rtol=1e-12)


def test_adamw_with_d2_heads_fits_and_one_head_cannot() -> None:
    pytest.importorskip("torch")
    import mhla_torch

    ds, teacher = fig1_teacher.make_data(2, 128, seed=1, seq_len=20)
    X = ds.tokens.reshape(128, 20, 2)
    full = mhla_torch.train_mhla(X, ds.targets, 4, 200, batch_size=32, seed=0, schedule="cosine")
    one = mhla_torch.train_mhla(X, ds.targets, 1, 60, batch_size=32, seed=0, schedule="cosine")
    assert full["epochs_to"][1e-8] is not None and min(full["history"]) < 1e-8
    assert min(one["history"]) > 1e-4  # a 1-head model cannot express a generic 4-head teacher
    # The learned function is the teacher's (data certify it): coef close to the truth.
    assert np.linalg.norm(full["coef"] - teacher.coef) < 1e-2 * np.linalg.norm(teacher.coef)


def _features_numpy(X: np.ndarray) -> np.ndarray:
    """H(X) in plain numpy: S[j,k] * x_n[l] for j <= k, l fastest (docs/formats.md, "Math")."""
    S = X.T @ X
    d = X.shape[1]
    return np.array([S[j, k] * X[-1, l] for j in range(d) for k in range(j, d) for l in range(d)])


def test_fig2_observed_distance_when_tokens_span_a_proper_subspace() -> None:
    # Tokens in a tilted 2-dim subspace U of R^3, last tokens in a 1-dim U_n inside U: the observed
    # domain is a proper subspace, where the row space of the map T is not the span of the features.
    rng = np.random.default_rng(3)
    d, N, n = 3, 60, 6
    Bu = np.linalg.qr(np.array([[1.0, 1.0, 0.0], [0.0, 1.0, 2.0]]).T)[0]     # (3, 2)
    cn = Bu @ np.array([0.6, 0.8])                                           # U_n in U
    seqs = []
    for _ in range(N):
        X = rng.standard_normal((n, 2)) @ Bu.T
        X[-1] = rng.standard_normal() * cn
        seqs.append(X)
    tokens = np.concatenate(seqs)
    offsets = np.arange(N + 1) * n
    targets = rng.standard_normal((N, d))
    from mhla_cli.statistics.accumulate import chunk_features

    feats = chunk_features(tokens, offsets, targets, d)
    P = fig2_assoc.observed_projector(feats)
    # Reference: the span of the features of fresh random inputs of the observed domain (plain numpy).
    probes = []
    for _ in range(40):
        X = rng.standard_normal((4, 2)) @ Bu.T
        X[-1] = rng.standard_normal() * cn
        probes.append(_features_numpy(X))
    F = np.array(probes)
    # A coefficient difference orthogonal to that span: the two functions agree on the observed domain ...
    _, s, Vt = np.linalg.svd(F, full_matrices=True)
    rank = int((s > 1e-10 * s[0]).sum())
    assert rank == 3  # u(S) spans 3 dims (S symmetric on a 2-dim U) times 1 dim of last tokens
    null = Vt[rank:]
    dp = rng.standard_normal((d, null.shape[0])) @ null
    assert np.abs(dp @ F.T).max() < 1e-10 * np.linalg.norm(dp) * np.abs(F).max()
    # ... so their observed distance must be 0 (the old row-space-of-T projector gave O(1) here) ...
    assert np.linalg.norm(dp @ P) < 1e-10 * np.linalg.norm(dp)
    # ... and a difference inside the span keeps its full norm.
    dq = rng.standard_normal((d, rank)) @ Vt[:rank]
    assert abs(np.linalg.norm(dq @ P) - np.linalg.norm(dq)) < 1e-10 * np.linalg.norm(dq)
    np.testing.assert_allclose(P @ P, P, atol=1e-12)
    assert round(float(np.trace(P))) == rank


def test_dfa_embedding_has_an_exact_single_layer_solution() -> None:
    """Plain numpy: y_next(q') = sum_pair S_t[pair, next(q')] x_t[pair] reproduces every trace target."""
    ds, delta, words = dfa_executor.make(3, 2, 7, 24, seed=3)
    qs, d = 6, dfa_executor.dims(3, 2)
    for i in range(ds.n_samples):
        X = ds.sequence(i)
        Y = ds.targets[ds.offsets[i]:ds.offsets[i + 1]]
        w = ds.weights[ds.offsets[i]:ds.offsets[i + 1]]
        S = np.zeros((d, d))
        for t in range(X.shape[0]):
            S += np.outer(X[t], X[t])
            if w[t] > 0:
                y = np.zeros(d)
                y[qs:] = S[:qs, qs:].T @ X[t, :qs]
                np.testing.assert_array_equal(y, Y[t])
    # the trace really is the DFA's run (independent loop)
    q = 0
    for t, s in enumerate(words[0]):
        q = delta[0, q, s]
        assert int(np.argmax(ds.targets[ds.offsets[0] + qs + t, qs:])) == q


def test_dfa_executor_80_traces_execute_unseen_dfas_exactly(tmp_path: Path) -> None:
    r = dfa_executor.run_point(3, 2, 80, 6, 30, 0, tmp_path)
    assert r["train"]["accuracy"] == 1.0 and r["train"]["max_error"] < 1e-9
    # new DFAs, words 4x longer: every position exact, closed loop exact, every position determined
    assert r["heldout"]["n_positions"] == 720
    assert r["heldout"]["accuracy"] == 1.0 and r["heldout"]["max_error"] < 1e-9
    assert r["closed_loop"]["exact_runs"] == 30
    assert r["probes"]["n_undetermined"] == 0 and r["probes"]["n_probes"] == 720
    # ... although neither domain certificate holds (one-hot tokens never excite most features)
    assert not r["cert_full"]["identifiable"] and not r["cert_observed"]["identifiable"]


def _prefix_features(ds) -> np.ndarray:
    """Materialised features H(X[:t]) of every weighted position, plain loops (independent of mhla)."""
    rows = []
    for i in range(ds.n_samples):
        X = ds.sequence(i)
        w = ds.weights[ds.offsets[i]:ds.offsets[i + 1]]
        S = np.zeros((X.shape[1], X.shape[1]))
        for t in range(X.shape[0]):
            S += np.outer(X[t], X[t])
            if w[t] > 0:
                j, k = np.triu_indices(X.shape[1])
                rows.append((S[j, k][:, None] * X[t][None, :]).reshape(-1))
    return np.array(rows)


def test_dfa_executor_20_traces_leave_heldout_undetermined(tmp_path: Path) -> None:
    r = dfa_executor.run_point(3, 2, 20, 6, 30, 0, tmp_path)
    assert r["probes"]["n_undetermined"] > 100
    # independent range test on materialised features: same count (issue: within 2 %)
    train, _, _ = dfa_executor.make(3, 2, 20, 6, 0)
    test, _, _ = dfa_executor.make(3, 2, 30, 24, 10_000)
    Htr, Hte = _prefix_features(train), _prefix_features(test)
    _, sv, Vt = np.linalg.svd(Htr, full_matrices=False)
    B = Vt[sv > sv[0] * 1e-10]
    res = np.linalg.norm(Hte - (Hte @ B.T) @ B, axis=1) / np.linalg.norm(Hte, axis=1)
    n_ref = int((res > 1e-8).sum())
    assert abs(n_ref - r["probes"]["n_undetermined"]) <= 0.02 * 720
    assert r["cert_full"]["rank"] == B.shape[0]
    assert r["heldout"]["accuracy"] < 1.0  # and the min-norm fit is indeed wrong somewhere
    assert r["closed_loop"]["exact_runs"] < 30


def test_icl_regression_mhla_is_one_step_of_preconditioned_gd(tmp_path: Path) -> None:
    r = icl_regression.run(3, 500, 20, 200, 0, tmp_path)
    mse = {k: np.array(v) for k, v in r["mse"].items()}
    assert np.all(mse["ols"][3:] < 1e-20)  # OLS baseline exact once the context has k examples
    # GD-1 is a sub-class of the MHLA's features: in-sample MHLA cannot be worse
    assert r["train_mse"]["mhla"] <= r["train_mse"]["gd1"] * (1 + 1e-9)
    # it learns in context: far below the zero predictor, also beyond the training length (20)
    assert mse["mhla"][10:20].mean() < 0.5 * mse["zero"][10:20].mean()
    assert mse["mhla"][20:].mean() < 0.3 * mse["zero"][20:].mean()
    assert r["mhla_vs_gd1"] < 0.05
    # the query's y coordinate is always 0: full domain fails, observed domain certifies
    assert not r["cert_full"]["identifiable"] and r["cert_observed"]["identifiable"]


def test_causal_teacher_recovered_from_fewer_sequences_than_features() -> None:
    r = causal_teacher.run_dim(4, 0, "none")
    assert r["n_min"] is not None and r["n_min"] < r["psi"] <= r["T"]
    assert r["n_min"] == r["n_first_T_ge_psi"]  # Gaussian prefixes certify as soon as T >= psi
    assert r["p_error"] < 1e-8 and r["test_rel_mse"] < 1e-16
    assert not r["control_identifiable"]  # the same sequences as last-token data cannot certify
    f = r["fixed"]
    assert f["N"] == 10 and f["identifiable"] and f["p_error"] < 1e-8


def test_autonomous_dfa_rollout_with_snap_runs_unseen_maps(tmp_path: Path) -> None:
    r = dfa_executor.run_autonomous(3, 20, 6, 30, 0, tmp_path)  # rollout --snap, 24 steps, 30 new maps
    assert r["probes"]["n_undetermined"] == 0 and r["exact_runs"] == 30
    few = dfa_executor.run_autonomous(3, 5, 6, 30, 0, tmp_path)
    assert few["probes"]["n_undetermined"] > 100 and few["exact_runs"] < 30
