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


# How the library words the remedy of a refusal (`Refused`); the CLI words the same remedies in its options
# (mhla_cli.cli.options.REMEDY_OPTIONS).
REMEDY_WORDS = {
    "reduce": "mhla_cli.reduce_tokens({tokens}, REDUCED, dim={dim})",
    "cluster": "the scheduler argument (docs/cluster.md)",
    "no_cluster": "without a scheduler",
    "cpu": "device 'cpu'",
    "bias_terms": "bias_terms=True",
    "affine_from": "affine_from",
    "attention": "the same attention",
    "folds": "featurize_folds and save_with_folds",
    "like": "mhla_cli.reduce_tokens({wide}, NEW.h5, like={reduced})",
}


class Refused(InputError):
    """An input refused with remedies that a caller may word in its own terms: the message is `template` with each
    `{name}` slot filled by REMEDY_WORDS[name] formatted with its parameters `remedies[name]`; `worded(words)`
    fills the slots from another table (the CLI's: its options). `remedies` is the machine-readable remedy."""

    def __init__(self, template: str, path: str | os.PathLike[str] | None = None,
                 **remedies: dict[str, object]) -> None:
        self.template, self.remedies = template, remedies
        super().__init__(self.worded(REMEDY_WORDS), path)

    def worded(self, words: dict[str, str]) -> str:
        """The message (without the path) with its remedies in `words`."""
        text = self.template
        for name, params in self.remedies.items():
            text = text.replace("{" + name + "}", words[name].format(**params))
        return text


class UnverifiedFileWarning(UserWarning):
    """An input read without a check of its integrity: a file written before mhla's manifests
    (mhla_cli.io.formats.manifest); the CLI prints it as one line ``mhla: warning: ...``."""
