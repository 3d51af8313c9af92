"""Per-chunk kernels: per-sequence moments and prefix Grams equal their definitions, on every layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from conftest import relerr, write_tokens
from mhla_cli import featurize
from mhla_cli.feature_map import pair_index
from mhla_cli import kernels


def test_dense_and_ragged_layouts_agree(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    N, n, d = 40, 5, 4
    X = rng.standard_normal((N, n, d))
    y = rng.standard_normal((N, d))
    a = featurize(write_tokens(tmp_path / "dense.h5", X, None, y))
    b = featurize(write_tokens(tmp_path / "rag.h5", X.reshape(-1, d), np.arange(N + 1) * n, y))
    assert relerr(a.gram, b.gram) < 1e-13 and relerr(a.moments, b.moments) < 1e-13


def test_moments_equal_their_definitions() -> None:
    """S = X^T X and the last token of each sequence, and the prefix Grams S_t (divided by t with
    normalize="length"), for ragged float32 tokens and for equal lengths."""
    rng = np.random.default_rng(5)
    d = 3
    for lengths in (rng.integers(1, 30, size=23), np.full(9, 4)):
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = rng.standard_normal((int(offsets[-1]), d)).astype(np.float32)
        X = tokens.astype(np.float64)
        S, last = kernels.sequence_moments(tokens, offsets)
        seqs = [X[offsets[i]:offsets[i + 1]] for i in range(lengths.size)]
        assert relerr(S, np.stack([x.T @ x for x in seqs])) < 1e-14
        np.testing.assert_array_equal(last, X[offsets[1:] - 1])
        j, k = pair_index(d)
        upper, own = kernels.prefix_moments(tokens, offsets, "length")
        pos = kernels.position_numbers(offsets)
        ref = np.concatenate([np.cumsum(x[:, j] * x[:, k], axis=0) for x in seqs]) / pos[:, None]
        assert relerr(upper, ref) < 1e-14 and own.dtype == np.float64
        XY = kernels.window_products(X, 2.0 * X[:, :2], offsets)
        assert relerr(XY, np.stack([2.0 * x.T @ x[:, :2] for x in seqs])) < 1e-14
