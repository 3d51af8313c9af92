"""What the low-rank solvers share numerically: one BLAS thread for small solves."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from threadpoolctl import threadpool_limits


def _serial_blas(fn: Callable) -> Callable:
    """Run with one BLAS thread: these loops do many small (d^2 x d^2) solves, where threads only cost."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with threadpool_limits(limits=1, user_api="blas"):
            return fn(*args, **kwargs)
    return wrapper
