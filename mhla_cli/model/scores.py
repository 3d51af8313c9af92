"""The coefficient of determination R^2 of a fit, everywhere a fit is scored (`fit`, `predict`, `score`).

R^2 = 1 - SSE / SST over all d outputs together, weighted like the MSE: SSE = sum_i w_i ||yhat_i - y_i||^2
and SST = sum_i w_i ||y_i - ybar||^2 about the scored data's weighted mean vector ybar = sum w y / sum w
(scikit-learn's r2_score with multioutput="variance_weighted"). It is None (JSON null) when the targets
do not vary beyond rounding (SST <= SST_RESOLUTION times the targets' energy), where it is not defined.

On the statistics (fit's train R^2) SST = tr(target_gram) - ||target_sum||^2 / weight_sum; while
predicting, `Spread` accumulates (sum w, mean, sum w ||y - mean||^2) chunk by chunk and merges the
chunks' spreads exactly (Chan et al.'s pairwise update: no cancellation against the mean).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..statistics.features import Features

# SST at or below SST_RESOLUTION (mhla_cli.numerics) times the targets' energy sum w ||y||^2 is rounding
# (of the sums, or of ||s||^2 / W against tr(target_gram)): R^2 is then not defined and reported as None.
from ..numerics import EPS, SST_RESOLUTION  # noqa: E402, F401  (old homes)


def r2(sse: float, sst: float, energy: float) -> float | None:
    """1 - sse / sst, or None when sst <= SST_RESOLUTION * energy (targets without spread)."""
    if not (np.isfinite(sse) and np.isfinite(sst)) or sst <= SST_RESOLUTION * max(energy, 0.0) or sst <= 0:
        return None
    return 1.0 - float(sse) / float(sst)


def sst_from_sums(target_gram: np.ndarray, target_sum: np.ndarray, weight: float) -> tuple[float, float]:
    """(SST, energy) from the sums: tr(sum w y y^T) - ||sum w y||^2 / sum w, and tr(sum w y y^T)."""
    energy = float(np.trace(target_gram))
    if weight <= 0:
        return 0.0, energy
    s = np.asarray(target_sum, dtype=np.float64)
    return max(energy - float(s @ s) / float(weight), 0.0), energy


def train_r2(feats: Features, train_mse: float) -> float | None:
    """R^2 of a fit on its statistics from its train MSE (solve.train_mse: SSE / (d sum_i w_i)); None
    when the statistics hold no target_sum (files written before it was accumulated) or the targets
    do not vary."""
    if feats.target_sum is None or feats.target_gram is None:
        return None
    sst, energy = sst_from_sums(feats.target_gram, feats.target_sum, feats.weight)
    return r2(float(train_mse) * feats.weight * feats.d, sst, energy)


@dataclass
class Spread:
    """The weighted spread of a set of target rows: total weight, mean vector, sum w ||y - mean||^2 and
    the energy sum w ||y||^2; `merge` combines two disjoint sets exactly."""

    weight: float = 0.0
    mean: np.ndarray | None = None
    m2: float = 0.0
    energy: float = 0.0

    @classmethod
    def of(cls, y: np.ndarray, weights: np.ndarray | None = None) -> Spread:
        """The spread of the rows of y (B, d), with weights (B,) >= 0 (None: all 1)."""
        y = np.asarray(y, dtype=np.float64)
        w = np.ones(y.shape[0]) if weights is None else np.asarray(weights, dtype=np.float64)
        W = float(w.sum())
        if W <= 0:
            return cls()
        mean = (w @ y) / W
        return cls(W, mean, float(w @ ((y - mean) ** 2).sum(axis=1)), float(w @ (y**2).sum(axis=1)))

    def merge(self, other: Spread) -> Spread:
        """The spread of the union of two disjoint sets of rows."""
        if other.weight <= 0:
            return self
        if self.weight <= 0:
            return other
        W = self.weight + other.weight
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.weight / W)
        m2 = self.m2 + other.m2 + float(delta @ delta) * self.weight * other.weight / W
        return Spread(W, mean, m2, self.energy + other.energy)

    def r2(self, sse: float) -> float | None:
        """R^2 of predictions with weighted squared error `sse` on these rows."""
        return r2(sse, self.m2, self.energy)


def r2_of(pred: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> float | None:
    """R^2 of predictions pred (B, d) of targets y (B, d), weights (B,) or None."""
    err = ((np.asarray(pred, dtype=np.float64) - y) ** 2).sum(axis=1)
    sse = float(err.sum()) if weights is None else float(np.asarray(weights, dtype=np.float64) @ err)
    return Spread.of(y, weights).r2(sse)
