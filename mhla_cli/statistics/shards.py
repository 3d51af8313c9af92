"""Shards and work ranges: the contiguous sample ranges that shards (`--shard i/M`), folds and workers take."""

from __future__ import annotations

import math
import os

from mhla_cli.errors import InputError

__all__ = ["shard_range", "shard_samples", "work_ranges"]


def work_ranges(lo: int, hi: int, chunk_size: int, n_workers: int, per_worker: int = 4) -> list[tuple[int, int]]:
    """About `per_worker` sample ranges per worker (for load balance), each at least one chunk long."""
    n = hi - lo
    parts = max(1, min(math.ceil(n / max(1, chunk_size)), per_worker * max(1, n_workers)))
    return [(lo + (n * i) // parts, lo + (n * (i + 1)) // parts) for i in range(parts)]


def shard_samples(n: int, shard: tuple[int, int] | None, path: str | os.PathLike | None = None) -> tuple[int, int]:
    """The sample range [lo, hi) of shard (i, M) of n samples (all of them for None); validated here."""
    if shard is None:
        return 0, n
    i, m = shard
    if not (m >= 1 and 0 <= i < m):
        raise InputError(f"shard {i}/{m}: need 0 <= i < M")
    lo, hi = shard_range(n, i, m)
    if hi <= lo:
        raise InputError(f"shard {i}/{m} is empty: the file has only {n} samples", path)
    return lo, hi


def shard_range(n: int, i: int, m: int) -> tuple[int, int]:
    """The i-th of m contiguous, nearly equal ranges of [0, n)."""
    return (n * i) // m, (n * (i + 1)) // m
