"""The former home of the statistics record: re-exports only (no code of its own).

`Features` is mhla_cli.statistics.features (the record), its algebra mhla_cli.statistics.algebra
(`add_into`, the change of basis) and its file mhla_cli.statistics.features_file (`save` / `load`,
format versions 1-5, the compact form). Why this module stays: the layout that named it
(`mhla_cli.statistics.stats.Features`) landed just before the split, and modules being rewritten
in parallel with it (the solve and stream splits of issue 23) import from here. New code imports
from the three modules; delete this module and tests/test_stats.py once
`grep -rn "statistics.stats\\|from .stats import" mhla_cli tests` finds nothing.
"""

from __future__ import annotations

from .algebra import add_into
from .features import Features, check_overflow
from .features_file import (CANONICAL_FORMAT, EXTRA_ATTRS, PAIRS_DATASET, PAIRS_FORMAT, WEIGHT_ATTRS, WEIGHTS_FORMAT,
                            StoredGram)

__all__ = ["CANONICAL_FORMAT", "EXTRA_ATTRS", "PAIRS_DATASET", "PAIRS_FORMAT", "WEIGHT_ATTRS", "WEIGHTS_FORMAT",
           "Features", "StoredGram", "add_into", "check_overflow"]
