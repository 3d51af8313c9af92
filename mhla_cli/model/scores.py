"""The coefficient of determination R^2 of a fit, everywhere a fit is scored (`fit`, `predict`, `score`).

R^2 = 1 - SSE / SST over all d outputs together, weighted like the MSE: SSE = sum_i w_i ||yhat_i - y_i||^2
and SST = sum_i w_i ||y_i - ybar||^2 about the scored data's weighted mean vector ybar = sum w y / sum w
(scikit-learn's r2_score with multioutput="variance_weighted"). It is None (JSON null) when the targets
do not vary beyond rounding (SST <= SST_RESOLUTION times the targets' energy), where it is not defined.

On the statistics (fit's train R^2) SST = tr(target_gram) - ||target_sum||^2 / weight_sum; while
predicting, `Spread` accumulates (sum w, mean, sum w ||y - mean||^2, SSE) chunk by chunk and merges the
chunks' spreads exactly (Chan et al.'s pairwise update: no cancellation against the mean), with the
squares in units of the targets' own scale (a power of 2), so that R^2 is scale-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..statistics.features import Features

# SST at or below SST_RESOLUTION (mhla_cli.numerics) times the targets' energy sum w ||y||^2 is rounding
# (of the sums, or of ||s||^2 / W against tr(target_gram)): R^2 is then not defined and reported as None.
from ..numerics import EPS, SST_RESOLUTION, TARGET_SQUARES_FLOOR  # noqa: E402, F401  (old homes)


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
    # (s / W) . s, not ||s||^2 / W: no overflow of the square for weights of any scale (they carry no units)
    return max(energy - float((s / float(weight)) @ s), 0.0), energy


def targets_underflow(feats: Features) -> bool:
    """The targets are too small for float64's sums of squares: their weighted mean square
    tr(target_gram) / sum w is below TARGET_SQUARES_FLOOR while they are not all 0 (their sums or
    moments are not), so the train MSE and R^2 from the statistics are not resolved."""
    if feats.target_gram is None:
        return False
    mean_square = float(np.trace(feats.target_gram)) / (feats.weight if feats.weight > 0 else 1.0)
    if mean_square >= TARGET_SQUARES_FLOOR:
        return False
    sums = [a for a in (feats.target_sum, feats.basis_moments, feats.moments) if a is not None]
    return any(bool(np.any(a != 0)) for a in sums)


def train_r2(feats: Features, train_mse: float) -> float | None:
    """R^2 of a fit on its statistics from its train MSE (solve.lstsq.train_mse: SSE / (d sum_i w_i)); None
    when the statistics hold no target_sum (files written before it was accumulated), the targets
    do not vary, or their squares underflow float64 (`targets_underflow`)."""
    if feats.target_sum is None or feats.target_gram is None or targets_underflow(feats):
        return None
    sst, energy = sst_from_sums(feats.target_gram, feats.target_sum, feats.weight)
    return r2(float(train_mse) * feats.weight * feats.n_outputs, sst, energy)


@dataclass
class Spread:
    """The weighted spread of a set of target rows: total weight, mean vector, sum w ||y - mean||^2 and
    the energy sum w ||y||^2, and the weighted squared error sum w ||yhat - y||^2 of predictions of
    them (`of(..., err=...)`); `merge` combines two disjoint sets exactly.

    The squares are kept in units of 4^exp (2^exp: the largest |y| rounded to a power of 2, an exact
    scaling), so that R^2 = 1 - SSE / SST is resolved at any scale of the targets (targets of 1e-170,
    whose squares underflow float64, score as targets of 1) and `mse` is the correctly rounded value.
    """

    weight: float = 0.0
    mean: np.ndarray | None = None
    m2: float = 0.0  # in units of 4^exp
    energy: float = 0.0  # in units of 4^exp
    sse: float = 0.0  # in units of 4^exp
    exp: int = 0

    @classmethod
    def of(cls, y: np.ndarray, weights: np.ndarray | None = None, err: np.ndarray | None = None) -> Spread:
        """The spread of the rows of y (B, d), with weights (B,) >= 0 (None: all 1), and the squared error
        of predictions yhat = y + err (B, d) of them (None: 0)."""
        y = np.asarray(y, dtype=np.float64)
        w = np.ones(y.shape[0]) if weights is None else np.asarray(weights, dtype=np.float64)
        W = float(w.sum())
        if W <= 0:
            return cls()
        top = float(np.abs(y).max()) if y.size else 0.0
        exp = int(np.frexp(top)[1]) if top > 0 and np.isfinite(top) else 0
        ys = np.ldexp(y, -exp)
        mean = (w @ y) / W
        dev = ys - np.ldexp(mean, -exp)
        sse = 0.0 if err is None else float(w @ (np.ldexp(np.asarray(err, dtype=np.float64), -exp) ** 2).sum(axis=1))
        return cls(W, mean, float(w @ (dev**2).sum(axis=1)), float(w @ (ys**2).sum(axis=1)), sse, exp)

    def _at(self, exp: int) -> tuple[float, float, float]:
        """(m2, energy, sse) in units of 4^exp (exp >= self.exp: exact, or underflow far below the rest)."""
        k = 2 * (self.exp - exp)
        return float(np.ldexp(self.m2, k)), float(np.ldexp(self.energy, k)), float(np.ldexp(self.sse, k))

    def merge(self, other: Spread) -> Spread:
        """The spread of the union of two disjoint sets of rows."""
        if other.weight <= 0:
            return self
        if self.weight <= 0:
            return other
        exp = max(self.exp, other.exp)
        (m2a, ea, sa), (m2b, eb, sb) = self._at(exp), other._at(exp)
        W = self.weight + other.weight
        assert self.mean is not None and other.mean is not None  # a spread of weight > 0 has its mean
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.weight / W)
        ds = np.ldexp(delta, -exp)
        m2 = m2a + m2b + float(ds @ ds) * self.weight * other.weight / W
        return Spread(W, mean, m2, ea + eb, sa + sb, exp)

    def r2(self, sse: float | None = None) -> float | None:
        """R^2 of the predictions `of` was given (or of predictions with weighted squared error `sse`,
        in the targets' own units) on these rows."""
        s = self.sse if sse is None else float(np.ldexp(sse, -2 * self.exp))
        return r2(s, self.m2, self.energy)

    @property
    def sst(self) -> float:
        """sum w ||y - mean||^2 in the targets' own units (0 where it underflows float64)."""
        return float(np.ldexp(self.m2, 2 * self.exp))

    def mse(self, d: int) -> float:
        """The weighted MSE per output, sum w ||yhat - y||^2 / (d sum w)."""
        return float(np.ldexp(self.sse / ((self.weight if self.weight > 0 else 1.0) * d), 2 * self.exp))


def r2_of(pred: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> float | None:
    """R^2 of predictions pred (B, d) of targets y (B, d), weights (B,) or None (scale-free: `Spread`)."""
    y = np.asarray(y, dtype=np.float64)
    return Spread.of(y, weights, err=np.asarray(pred, dtype=np.float64) - y).r2()
