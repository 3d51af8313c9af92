"""Losses on the statistics: sum_i ||p H_i - y_i||^2 = tr(p G p^T) - 2 tr(p M) + tr(T)."""

from __future__ import annotations

import numpy as np

from ...errors import InputError
from ..lstsq import train_mse
from mhla_cli.statistics.features import Features


def sse(feats: Features, coef: np.ndarray) -> float:
    """sum_i ||p H_i - y_i||^2 from the statistics (solve.lstsq.train_mse, the one training error)."""
    return train_mse(feats, coef)[0] * feats.weight * feats.n_outputs


def mse(feats: Features, coef: np.ndarray) -> float:
    """Mean squared error per output, sum_i ||p H_i - y_i||^2 / (N d) (solve.lstsq.train_mse)."""
    return train_mse(feats, coef)[0]


def _need_targets(feats: Features) -> None:
    if not feats.has_targets:
        raise InputError("the data have no 'targets': fit needs (X, y) pairs")
