"""The cubic feature map, the W <-> p <-> heads maps and the forward pass agree with plain loops."""

from __future__ import annotations

import numpy as np
import pytest

from mhla_cli import features, forward, heads


def plain_features(X: np.ndarray) -> np.ndarray:
    n, d = X.shape
    S = np.zeros((d, d))
    for t in range(n):
        for j in range(d):
            for k in range(d):
                S[j, k] += X[t, j] * X[t, k]
    out = []
    for j in range(d):
        for k in range(j, d):
            for l in range(d):
                out.append(S[j, k] * X[n - 1, l])
    return np.array(out)


def plain_forward(V: np.ndarray, Q: np.ndarray, X: np.ndarray, t: int) -> np.ndarray:
    H, d, _ = V.shape
    S = X.T @ X
    y = np.zeros(d)
    for h in range(H):
        y += V[h] @ (S @ (Q[h] @ X[t]))
    return y


@pytest.mark.parametrize("d", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [1, 4])
def test_feature_map_matches_plain_loop(d: int, n: int) -> None:
    X = np.random.default_rng(d * 10 + n).standard_normal((n, d))
    H = features.cubic_features(X)
    assert H.shape == (features.n_features(d),) == (d * d * (d + 1) // 2,)
    np.testing.assert_allclose(H, plain_features(X), rtol=1e-13, atol=1e-13)


def test_feature_order_is_j_then_k_then_l() -> None:
    idx = features.feature_index(3)
    assert [tuple(r) for r in idx[:4]] == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0)]
    assert tuple(idx[-1]) == (2, 2, 2)
    assert features.feature_name(3, 4) == "S[0,1]*x_n[1]"


@pytest.mark.parametrize("d,H", [(2, 1), (3, 2), (4, 5)])
def test_p_of_heads_reproduces_forward(d: int, H: int) -> None:
    rng = np.random.default_rng(d + H)
    V = rng.standard_normal((H, d, d))
    Q = rng.standard_normal((H, d, d))
    p = heads.p_from_heads(V, Q)
    for n in (1, 3, 17):
        X = rng.standard_normal((n, d))
        expect = plain_forward(V, Q, X, n - 1)
        np.testing.assert_allclose(p @ features.cubic_features(X), expect, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(forward.forward_heads(V, Q, X), expect, rtol=1e-12, atol=1e-12)
        allpos = forward.forward_heads(V, Q, X, all_positions=True)
        np.testing.assert_allclose(allpos, [plain_forward(V, Q, X, t) for t in range(n)], rtol=1e-12, atol=1e-12)


def test_W_p_heads_roundtrip_and_min_norm() -> None:
    rng = np.random.default_rng(0)
    d = 3
    W = rng.standard_normal((d * d, d * d))
    p = heads.p_from_W(W)
    Wmin = heads.W_from_p(p)
    np.testing.assert_allclose(heads.p_from_W(Wmin), p, rtol=1e-14, atol=1e-14)
    # The minimum-norm representative is no larger than any other W with the same p.
    assert np.linalg.norm(Wmin) <= np.linalg.norm(W) + 1e-12
    # Adding a part antisymmetric in (j, k) leaves p unchanged.
    N4 = rng.standard_normal((d, d, d, d))
    N4 = N4 - N4.transpose(0, 2, 1, 3)
    np.testing.assert_allclose(heads.p_from_W(Wmin + N4.reshape(d * d, d * d)), p, atol=1e-13)
    hs, s = heads.heads_from_W(Wmin, tol=0)
    assert hs.n_heads <= d * d
    np.testing.assert_allclose(hs.coef, p, rtol=1e-12, atol=1e-12)


def test_predict_chunk_all_positions_matches_reference() -> None:
    rng = np.random.default_rng(7)
    d, H = 3, 2
    V = rng.standard_normal((H, d, d))
    Q = rng.standard_normal((H, d, d))
    lengths = np.array([1, 5, 2, 9])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.standard_normal((offsets[-1], d))
    pred, outputs = forward.predict_chunk(heads.p_from_heads(V, Q), tokens, offsets, all_positions=True)
    for i in range(lengths.size):
        X = tokens[offsets[i]:offsets[i + 1]]
        np.testing.assert_allclose(pred[i], forward.forward_heads(V, Q, X), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(outputs[offsets[i]:offsets[i + 1]],
                                   forward.forward_heads(V, Q, X, all_positions=True), rtol=1e-12, atol=1e-12)
