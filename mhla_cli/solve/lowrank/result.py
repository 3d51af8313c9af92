"""The result of a factorised or nuclear-norm fit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...model.heads import Heads


@dataclass
class LowRankFit:
    """Result of a factorised or nuclear-norm fit: coef, W, and what happened."""

    coef: np.ndarray
    W: np.ndarray
    info: dict[str, Any] = field(default_factory=dict)
    heads: Heads | None = None
