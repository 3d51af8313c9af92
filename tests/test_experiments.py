"""The paper-reproduction experiments (experiments/): each core function in a tiny setting, with a
property that fails if the reproduction breaks. Torch-dependent parts are skipped without torch."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

EXP = Path(__file__).resolve().parent.parent / "experiments"
sys.path.insert(0, str(EXP))

import fig1_teacher  # noqa: E402
import fig2_assoc  # noqa: E402
import sample_complexity  # noqa: E402
from mhla_cli import forward_heads, n_features, synthetic  # noqa: E402


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
    # The minimum-norm fit equals the truth in both cases (the truth has no null-space component) ...
    assert mixed["fit_distance"] < 1e-9 and orth["fit_distance"] < 1e-9
    # ... but on orthogonal keys another zero-loss solution exists far from it, and it disagrees off the data.
    assert "witness" not in mixed
    w = orth["witness"]
    assert w["train_mse"] < 1e-20
    assert w["distance"] > 1.0
    test, _ = synthetic.generate_assoc(4, 256, 0.0, seed=7)
    assert fig2_assoc.mse_on(orth["_fit"], test) < 1e-20


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
    """H(X) in plain numpy: S[j,k] * x_n[l] for j <= k, l fastest (BACKGROUND.md order)."""
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
    from mhla_cli.stream import chunk_features

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
