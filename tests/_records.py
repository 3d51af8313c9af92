"""Shared data of the Features tests (test_features, test_algebra, test_features_file): ragged
sequences with targets, and weighted statistics."""

from __future__ import annotations

import numpy as np

from mhla_cli.statistics.features import Features
from mhla_cli.statistics.accumulate import chunk_features
from mhla_cli.samples import ReadSpec, samples_of


def ragged_data(seed: int, n: int = 60, d: int = 3, scale: np.ndarray | float = 1.0):
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(2, 7, size=n))])
    X = rng.standard_normal((int(offsets[-1]), d)) * scale
    y = rng.standard_normal((n, d))
    return X, offsets, y


def weighted_features(seed: int, per_position: bool = False) -> Features:
    X, off, y = ragged_data(seed, n=40)
    rng = np.random.default_rng(seed + 100)
    rows = int(off[-1]) if per_position else off.size - 1
    if per_position:
        y = rng.standard_normal((rows, 3))
    w = rng.uniform(0.0, 3.0, rows)
    w[::5] = 0.0
    return chunk_features(X, off, y, 3, weights=w, read=ReadSpec(samples_of(per_position)))
