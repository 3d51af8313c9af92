"""torch `.pt` / `.pth` inputs (the torch extra): a tensor (the tokens), a list of (n_i, d) tensors
(ragged sequences) or a dict of them, read with `torch.load(weights_only=True)`, memory-mapped.
On Linux the pages copied are handed back to the kernel as the copy proceeds (`_PageDropper`).

The entries of nested dicts are named by their dotted keys ({"acts": {"x": t}} holds 'acts.x'), the
spelling of a TransformerLens cache (`torch.save(cache.cache_dict)`: 'blocks.3.hook_resid_pre').
Its entry `compatibility_mode` (a bool: `bridge.compatibility_mode` of TransformerLens 4) is the record
`_roles.compat_record` reads, not an array.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from ._roles import COMPAT_KEY
from ._source import Reader, _PageDropper, _Source, _array_source
from ._values import _check_sequence_list, _tensor_source, _torch, _value_sources
from ...errors import InputError


def _flatten(obj: dict[Any, Any], path: Path, prefix: str = "") -> dict[str, Any]:
    """A dict whose values may be dicts, as one dict named by dotted keys."""
    out: dict[str, Any] = {}
    for k, v in obj.items():
        if not isinstance(k, str):
            raise InputError(f"a dict with a key that is not a string ({k!r}{' in ' + prefix[:-1] if prefix else ''}); "
                             "name the tensors tokens, offsets, targets, weights", path)
        if isinstance(v, dict):
            out.update(_flatten(v, path, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _compat(value: Any, path: Path) -> _Source:
    """The `compatibility_mode` entry (a bool, 0 / 1, or a tensor of one of them) as a spare array of one value."""
    v = value.item() if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1 else value
    if isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
        return dataclasses.replace(_array_source(COMPAT_KEY, np.array([int(v)]), str(path)), spare=True)
    raise InputError(f"'{COMPAT_KEY}' is {str(value)[:60]!r}: it records whether TransformerLens's compatibility "
                     "mode was on, True or False (bridge.compatibility_mode)", path)


def torch_sources(path: Path, stack: ExitStack | None = None) -> list[_Source]:
    """The tensors of a torch.save file: one tensor is the tokens, a list the ragged tokens, a dict
    names its tensors by its keys."""
    torch = _torch(path)
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            release: _PageDropper | None = _PageDropper(path)
        except RuntimeError as exc:
            if "mmap" not in str(exc).lower() and "zip" not in str(exc).lower():
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)  # a legacy (non-zip) file: in memory
            release = None
    except Exception as exc:  # noqa: BLE001 (torch and pickle raise many types)
        reason = " ".join(str(exc).split())
        if "ActivationCache" in reason:
            raise InputError("holds a TransformerLens ActivationCache object, which mhla does not unpickle: save its "
                             "dict of tensors, torch.save(cache.cache_dict, PATH)", path) from None
        if "weights only load failed" in reason.lower():  # torch's advice to unpickle anything is not ours
            reason = "not a torch.save file of tensors, lists and dicts"
        raise InputError(f"cannot read as a torch file ({reason[:200]}); mhla reads a tensor, a list of (n_i, d) "
                         "tensors or a dict of them (torch.save, loaded with weights_only=True)", path) from None
    label = str(path)
    if isinstance(obj, torch.Tensor):
        return [_tensor_source("tokens", obj, label, release)]
    if isinstance(obj, (list, tuple)):
        _check_sequence_list(obj, "the file", path)
        return _value_sources({"tokens": obj}, label, release)
    if isinstance(obj, dict):
        flat = _flatten(obj, path)
        record = [_compat(flat.pop(COMPAT_KEY), path)] if COMPAT_KEY in flat else []
        return _value_sources(flat, label, release) + record
    raise InputError(f"holds a {type(obj).__name__}; mhla reads a tensor, a list of (n_i, d) tensors or a dict of "
                     "them", path)


TORCH = Reader("PyTorch", (".pt", ".pth"), torch_sources)
