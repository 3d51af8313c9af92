"""The memory budget check (mhla_cli.memory)."""

from __future__ import annotations

import pytest

from mhla_cli import memory
from mhla_cli.errors import InputError


def test_check_memory_names_the_largest_d() -> None:
    budget = 2 * 2**30
    with pytest.raises(InputError, match=r"largest d that fits is (\d+)") as exc:
        memory.check_memory(30, budget_bytes=budget)
    fits = int(exc.value.args[0].rsplit(" ", 1)[1])
    assert memory._stats_bytes(fits) <= budget < memory._stats_bytes(fits + 1)
    memory.check_memory(fits, budget_bytes=budget)  # no error
    # K worker processes hold K accumulators
    with pytest.raises(InputError, match="4 workers"):
        memory.check_memory(fits, budget_bytes=budget, copies=4)
