"""mhla_cli.statistics.stats: the former home of Features re-exports the record, its algebra and its file.

The tests of what it re-exports: test_features.py, test_algebra.py, test_features_file.py.
"""

from __future__ import annotations

import mhla_cli
from mhla_cli.statistics import algebra, features, features_file, stats, stream


def test_the_old_names_are_the_new_objects() -> None:
    assert stats.Features is features.Features is stream.Features is mhla_cli.Features
    assert stats.add_into is algebra.add_into and stats.check_overflow is features.check_overflow
    for name in ("PAIRS_DATASET", "PAIRS_FORMAT", "WEIGHTS_FORMAT", "CANONICAL_FORMAT", "EXTRA_ATTRS", "StoredGram"):
        assert getattr(stats, name) is getattr(features_file, name)


def test_the_record_has_its_algebra_and_its_file() -> None:
    F = features.Features
    assert issubclass(F, algebra.FeaturesAlgebra) and issubclass(F, features_file.FeaturesFile)
    f = F.zeros(2, True)
    assert f.gram.shape == (f.n_features, f.n_features) and f._gram_raw is f.gram  # the field, held
