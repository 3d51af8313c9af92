"""Memory budget: refuse up front a token dimension whose psi x psi statistics cannot fit."""

from __future__ import annotations

import os

from .errors import InputError
from .features import n_features


def check_memory(d: int, budget_bytes: int | None = None, copies: int = 1,
                 path: str | os.PathLike | None = None) -> None:
    """Refuse up front a d whose psi x psi statistics (and their solve) would not fit in memory.

    `copies` is the number of accumulators held at once (one per worker process on this machine).
    """
    if budget_bytes is None:
        budget_bytes = _available_memory()
    copies = max(1, int(copies))
    need = copies * _stats_bytes(d)
    if need > budget_bytes:
        fits = 0
        while copies * _stats_bytes(fits + 1) <= budget_bytes:
            fits += 1
        who = f" ({copies} workers)" if copies > 1 else ""
        raise InputError(
            f"d = {d} needs psi = {n_features(d)} features and about {need / 2**30:.1f} GiB{who} for "
            f"the psi x psi statistics, more than the {budget_bytes / 2**30:.1f} GiB of memory available; "
            + (f"the largest d that fits is {fits}" if fits else "not even d = 1 fits"), path)


def _stats_bytes(d: int) -> int:
    psi = n_features(d)
    # accumulator, per-chunk product, the sums in the tokens' own coordinates, solve workspace
    return 4 * 8 * (psi + d) ** 2


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**40
