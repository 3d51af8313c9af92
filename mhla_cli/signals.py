"""Interrupt handling: SIGINT / SIGTERM / SIGHUP become an exception so that outputs are cleaned up."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any


class Interrupted(BaseException):
    """Raised inside mhla when SIGINT, SIGTERM or SIGHUP arrives, so that `finally` blocks clean up.

    (Not a KeyboardInterrupt: typer would swallow that; the CLI maps it to exit 128 + signum.)
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_TERM_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


# The signal caught by `sigterm_as_exception`, kept in case the exception was swallowed (raised
# inside a destructor or a callback, where Python only prints it): outputs are then not committed.
_signal_received: int | None = None


def check_interrupted() -> None:
    """Raise `Interrupted` if a signal arrived (even if its exception was swallowed somewhere)."""
    if _signal_received is not None:
        raise Interrupted(_signal_received)


@contextlib.contextmanager
def sigterm_as_exception(sigint: bool = True) -> Iterator[None]:
    """Turn SIGTERM and SIGHUP (and SIGINT unless `sigint=False`) into `Interrupted` for the
    duration (main thread only).

    Only the first signal raises: another one arriving while `finally` blocks remove temporary
    files is ignored, so the cleanup finishes.
    """
    global _signal_received
    fired: list[int] = []
    _signal_received = None

    def handler(signum: int, frame: Any) -> None:  # noqa: ARG001
        global _signal_received
        if not fired:
            fired.append(signum)
            _signal_received = signum
            raise Interrupted(signum)

    sigs = (*_TERM_SIGNALS, signal.SIGINT) if sigint else _TERM_SIGNALS
    try:
        old = {s: signal.getsignal(s) for s in sigs}
        for s in sigs:
            signal.signal(s, handler)
    except ValueError:  # not in the main thread
        yield
        return
    old_hook = sys.unraisablehook

    def unraisable(u: Any) -> None:
        # Interrupted raised inside a destructor or generator finalizer cannot propagate; it is
        # re-raised by check_interrupted() instead, so do not print it.
        if u.exc_type is not None and issubclass(u.exc_type, Interrupted):
            return
        old_hook(u)

    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        sys.unraisablehook = old_hook
        _signal_received = None
        for s, h in old.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(s, h if h is not None else signal.SIG_DFL)


@contextlib.contextmanager
def shield_signals() -> Iterator[None]:
    """Ignore SIGINT/SIGTERM for a short cleanup (main thread only)."""
    sigs = (signal.SIGINT, *_TERM_SIGNALS)
    try:
        old = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        for s, h in old.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(s, h if h is not None else signal.SIG_DFL)
