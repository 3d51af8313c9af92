"""The cubic feature map H(X) and its index bookkeeping agree with plain loops (mhla_cli.feature_map)."""

from __future__ import annotations

import numpy as np
import pytest

from mhla_cli import feature_map as features


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
