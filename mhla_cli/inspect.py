"""`inspect`: what kind of mhla file a path is, its shapes, attributes and validity."""

from __future__ import annotations

import os
from typing import Any

import h5py
import numpy as np

from . import formats
from .errors import InputError


def inspect_file(path: str | os.PathLike) -> dict[str, Any]:
    """Describe an mhla file and validate it with the same checks the commands use."""
    rep: dict[str, Any] = {"path": str(path), "kind": None, "valid": False, "datasets": {}, "attrs": {},
                           "error": None}
    try:
        with formats.open_input(path) as f:
            for name, obj in f.items():
                if isinstance(obj, h5py.Dataset):
                    rep["datasets"][name] = {"shape": list(obj.shape), "dtype": str(obj.dtype)}
            for k, v in f.attrs.items():
                if isinstance(v, bytes):
                    v = v.decode(errors="replace")
                elif isinstance(v, np.generic):
                    v = v.item()
                elif isinstance(v, np.ndarray):
                    v = v.tolist()
                rep["attrs"][k] = v
            rep["kind"] = formats.file_kind(f, path)
        rep.update(_validate(path, rep["kind"]))
        rep["valid"] = True
    except InputError as exc:
        rep["error"] = str(exc)
    return rep


def _validate(path: str | os.PathLike, kind: str) -> dict[str, Any]:
    if kind == "tokens":
        info = formats.inspect_tokens(path)
        _scan_finite(path, info)
        return {"layout": info.layout, "n_samples": info.n_samples, "d": info.d, "n_tokens": info.n_tokens,
                "dtype": info.dtype, "has_targets": info.has_targets}
    if kind == "features":
        from .stream import Features

        feats = Features.load(path)
        return {"d": feats.d, "n_samples": feats.n_samples, "n_features": feats.n_features,
                "has_targets": feats.has_targets}
    if kind == "model":
        from .solve import Model

        model = Model.load(path)
        return {"d": model.d}
    if kind == "heads":
        from .heads import Heads

        heads = Heads.load(path)
        return {"d": heads.d, "n_heads": heads.n_heads}
    with formats.open_input(path) as f:
        pred = formats.read_array(f, "predictions", path)
    if pred.ndim != 2:
        raise InputError(f"'predictions' has shape {pred.shape}, expected (N, d)", path)
    return {"n_samples": int(pred.shape[0]), "d": int(pred.shape[1])}


def _scan_finite(path: str | os.PathLike, info: formats.TokensInfo) -> None:
    from .stream import default_chunk_size, spans

    with formats.open_input(path) as f:
        for a, b in spans(0, info.n_samples, default_chunk_size(info)):
            tokens, offsets, targets = formats.read_tokens_span(f, info, a, b)
            formats.check_finite(tokens, offsets, targets, a, path)
