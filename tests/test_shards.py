"""Shards and work spans: contiguous sample ranges that cover the file and whose statistics add up."""

from __future__ import annotations

import pytest

from conftest import relerr
from mhla_cli import featurize
from mhla_cli.errors import InputError
from mhla_cli.statistics import shards
from test_stream import ragged  # noqa: F401 (the fixture)


def test_shards_add_up(ragged) -> None:
    path, *_ = ragged
    whole = featurize(path)
    parts = [featurize(path, shard=(i, 3)) for i in range(3)]
    total = parts[0] + parts[1] + parts[2]
    assert total.n_samples == whole.n_samples
    assert relerr(total.gram, whole.gram) < 1e-12
    assert [p.sample_range for p in parts] == [(0, 32), (32, 64), (64, 97)]


def test_shard_ranges_cover_the_samples() -> None:
    parts = [shards.shard_range(97, i, 3) for i in range(3)]
    assert parts == [(0, 32), (32, 64), (64, 97)]
    assert shards.shard_samples(97, None) == (0, 97) and shards.shard_samples(97, (2, 3)) == (64, 97)
    with pytest.raises(InputError, match="need 0 <= i < M"):
        shards.shard_samples(97, (3, 3))
    with pytest.raises(InputError, match="is empty"):
        shards.shard_samples(2, (0, 3))


def test_work_is_split_into_ranges() -> None:
    # several spans per worker, covering the range exactly, each at least a chunk
    sp = shards.work_ranges(10, 1010, 50, 3)
    assert len(sp) == 12 and sp[0][0] == 10 and sp[-1][1] == 1010
    assert all(a[1] == b[0] for a, b in zip(sp, sp[1:]))
    assert shards.work_ranges(0, 30, 50, 4) == [(0, 30)]
