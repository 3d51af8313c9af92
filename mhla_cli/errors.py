"""Exceptions raised by the mhla library.

`InputError` is a problem with what the user gave us (a file, a shape, an option); the CLI prints it
as one line ``mhla: error: ...`` and exits with status 2. Library users can catch it like any
``ValueError``.
"""

from __future__ import annotations

import os


class MhlaError(Exception):
    """Base class of all mhla errors."""


class InputError(MhlaError, ValueError):
    """Invalid input: a bad file, a bad shape, an inconsistent option."""

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None) -> None:
        self.path = None if path is None else str(path)
        super().__init__(f"{self.path}: {message}" if self.path else message)


class UnverifiedFileWarning(UserWarning):
    """An input read without a check of its integrity: a file written before mhla's manifests
    (mhla_cli.io.formats.manifest); the CLI prints it as one line ``mhla: warning: ...``."""
