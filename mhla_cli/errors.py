"""Exceptions raised by the mhla library.

`InputError` is a problem with what the user gave us (a file, a shape, an option); the CLI prints it
as one line ``mhla: error: ...`` and exits with status 2. Library users can catch it like any
``ValueError``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping


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
    "keys": "keys",
    "key": "keys=['{}']",
    "mask": "mask='{}'",
    "compat_on": "compatibility_mode=True",
    "compat_off": "compatibility_mode=False",
    "compat_either": "compatibility_mode=True or False",
    "attention_opt": "attention",
    "attention_is": "attention='{}'",
    "bias_terms_opt": "bias_terms",
    "affine_file": "affine_from='{}'",
    "wide": "wide=",
    "causal_flag": "causal=True",
    "dim_opt": "dim",
    "dim": "dim={}",
    "method_opt": "method",
    "method": "method='{}'",
    "weights": "weights",
    "weights_file": "weights=FILE",
    "like_opt": "like",
    "like_reduced": "mhla_cli.reduce_tokens(..., like=REDUCED)",
    "like_it": "mhla_cli.reduce_tokens(..., like=...)",
    "unreduce_opt": "unreduce",
    "unreduced": "mhla_cli.model.reduce.unreduce_heads",
    "unreduced_heads": "mhla_cli.model.reduce.unreduce_heads",
    "predict_wide": "mhla_cli.predict(..., wide=)",
    "scheduler": "the scheduler argument",
    "device": "device '{}'",
    "tiled_store": "mhla_cli.featurize(..., scheduler=...) into FEATS.zarr",
    "certify_observed": "mhla_cli.certify(..., domain='observed')",
}

# A slot of a template: `{name}`, or `{name:arg}` whose `arg` fills the word's `{}` (an option's value, which may
# hold braces one deep: a user's `--key t={x}`).
_SLOT = re.compile(r"\{(\w+)(?::((?:[^{}]|\{[^{}]*\})*))?\}")


class Refused(InputError):
    """An input refused with remedies that a caller may word in its own terms: the message is `template` with each
    `{name}` (or `{name:arg}`: an option's value) slot filled by REMEDY_WORDS[name] formatted with `arg` and its
    parameters `remedies[name]`; `worded(words)` fills the slots from another table (the CLI's: its options).
    `remedies` is the machine-readable remedy."""

    def __init__(self, template: str, path: str | os.PathLike[str] | None = None,
                 **remedies: dict[str, object]) -> None:
        self.template, self.remedies = template, remedies
        super().__init__(self.worded(REMEDY_WORDS), path)

    def __reduce__(self) -> tuple[object, ...]:  # pickled (a worker's refusal) with its template and remedies
        return _refused, (self.template, self.path, self.remedies)

    def worded(self, words: Mapping[str, str]) -> str:
        """The message (without the path) with its remedies in `words`."""
        def fill(m: re.Match[str]) -> str:
            if m[1] not in self.remedies:
                return m[0]
            return words[m[1]].format(m[2] or "", **self.remedies[m[1]])

        return _SLOT.sub(fill, self.template)


def _refused(template: str, path: str | None, remedies: dict[str, dict[str, object]]) -> Refused:
    return Refused(template, path, **remedies)


class UnverifiedFileWarning(UserWarning):
    """An input read without a check of its integrity: a file written before mhla's manifests
    (mhla_cli.io.formats.manifest); the CLI prints it as one line ``mhla: warning: ...``."""
