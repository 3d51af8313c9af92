"""torch `.pt` / `.pth` inputs (the torch extra): a tensor (the tokens), a list of (n_i, d) tensors
(ragged sequences) or a dict of them, read with `torch.load(weights_only=True)`, memory-mapped.
On Linux the pages copied are handed back to the kernel as the copy proceeds (`_PageDropper`).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from ._source import Reader, _PageDropper, _Source
from ._values import _check_sequence_list, _tensor_source, _torch, _value_sources
from ...errors import InputError


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
        if not all(isinstance(k, str) for k in obj):
            raise InputError("a dict with keys that are not strings; name the tensors tokens, offsets, targets, "
                             "weights", path)
        return _value_sources(obj, label, release)
    raise InputError(f"holds a {type(obj).__name__}; mhla reads a tensor, a list of (n_i, d) tensors or a dict of "
                     "them", path)


TORCH = Reader("PyTorch", (".pt", ".pth"), torch_sources, extra="torch")
