"""`inspect`: what kind of mhla file a path is, its shapes, attributes and validity."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mhla_cli.io import formats
from mhla_cli.io.formats import manifest
from mhla_cli.errors import InputError
from mhla_cli.model.export import load_heads
from mhla_cli.model.heads import Heads
from mhla_cli.model.model import Model
from mhla_cli.statistics.files import store_location, zarr_store
from mhla_cli.statistics.storage import gram_storage
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.ranges import default_chunk_size
from mhla_cli.io.tokens import TokensInfo, check_finite, check_weights, inspect_tokens, iter_chunks


def _attr_value(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v


def inspect_file(path: str | os.PathLike) -> dict[str, Any]:
    """Describe an mhla file and validate it with the same checks the commands use.

    Returns {path, kind, valid, datasets: {name: {shape, dtype}}, attrs, provenance, error, ...}
    plus kind-specific fields (d, n_samples, ...); `error` is the message the commands would give
    (``<path>: <what is wrong>``) and `valid` is False when there is one.
    """
    if store_location.is_store(path):  # a features store tiled by a cluster
        try:
            store_location.require_zarr()
        except InputError as exc:
            return {"path": str(path), "kind": None, "valid": False, "datasets": {}, "attrs": {}, "error": str(exc)}
        return zarr_store.inspect(path)
    rep: dict[str, Any] = {"path": str(path), "kind": None, "valid": False, "datasets": {}, "attrs": {},
                           "error": None}
    if Path(path).suffix.lower() in formats.FOREIGN_SUFFIXES:  # heads exported for other frameworks
        try:
            heads = load_heads(path)
        except InputError as exc:
            rep["error"] = str(exc)
            return rep
        rep.update(kind="heads", valid=True, format=Path(path).suffix.lower().lstrip("."), d=heads.d,
                   d_out=heads.d_out, n_heads=heads.n_heads, normalize=heads.info.get("normalize", "none"),
                   datasets={k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in (("V", heads.V),
                                                                                        ("Q", heads.Q))})
        return rep
    try:
        with formats.open_input(path) as f:
            for name, obj in f.items():
                if isinstance(obj, h5py.Dataset):
                    rep["datasets"][name] = {"shape": list(obj.shape), "dtype": str(obj.dtype)}
                else:
                    rep["datasets"][name] = {"group": True}
            for k in f.attrs.keys():
                try:
                    rep["attrs"][k] = _attr_value(f.attrs[k])
                except (OSError, TypeError, ValueError) as exc:  # unreadable attribute type
                    rep["attrs"][k] = f"<unreadable: {exc}>"
            rep["kind"] = formats.file_kind(f, path, check=False)
        if isinstance(rep["attrs"].get("mhla_inputs"), str):
            try:
                rep["provenance"] = {"inputs": json.loads(rep["attrs"]["mhla_inputs"]),
                                     "command": rep["attrs"].get("mhla_command"),
                                     "mhla_version": rep["attrs"].get("mhla_version"),
                                     "created": rep["attrs"].get("mhla_created")}
            except ValueError:
                pass
        rep.update(_validate(path, rep["kind"]))
        with formats.open_input(path) as f:
            formats.file_kind(f, path)  # the header and the datasets' names and shapes
            manifest.verify_file(f, path)  # every dataset as written, also those no command reads
        rep["valid"] = True
    except InputError as exc:
        rep["error"] = str(exc)
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        rep["error"] = str(InputError(f"cannot read ({' '.join(str(exc).split())}); the file may be "
                                      "truncated or corrupted", path))
    return rep


def gram_form(path: str | os.PathLike) -> str:
    """How a features file stores its Gram: "full" ('gram' and 'basis_gram', psi x psi each), "compact"
    (the distinct entries only, `featurize --compact`) or another registered storage's form (its `form`,
    mhla_cli.statistics.storage.gram_storage), and "block" / "compact block" / "<form> block" for the block
    on the data's spans."""
    with formats.open_input(path) as f:
        found = gram_storage.file_storages(f)
        form = found[0].form if found and found[0].form is not None else "full"
        if "span_pairs" in f:
            form = "block" if form == "full" else f"{form} block"
    return form


def _validate(path: str | os.PathLike, kind: str) -> dict[str, Any]:
    if kind == "tokens":
        info = inspect_tokens(path)
        _scan_finite(path, info)
        return {"layout": info.layout, "n_samples": info.n_samples, "d": info.d, "n_tokens": info.n_tokens,
                "dtype": info.dtype, "has_targets": info.has_targets, "per_position": info.per_position,
                "attention": info.attention, "has_weights": info.has_weights, "d_out": info.out_dim}
    if kind == "features":
        feats = Features.load(path, part=True)  # an empty part (a shard of no weight) is a valid file
        return {"d": feats.d, "n_samples": feats.n_samples, "n_features": feats.n_features,
                "n_tokens": feats.n_tokens, "has_targets": feats.has_targets,
                "sample_range": list(feats.sample_range) if feats.sample_range else None,
                "per_position": feats.per_position, "attention": feats.samples.attention, "normalize": feats.normalize,
                "gram_form": gram_form(path)}
    if kind == "model":
        model = Model.load(path)
        return {"d": model.d, "n_features": int(model.coef.shape[1]), "attention": model.info.get("attention")}
    if kind == "heads":
        heads = Heads.load(path)
        return {"d": heads.d, "d_out": heads.d_out, "n_heads": heads.n_heads}
    if kind == "probes":
        with formats.open_input(path) as f:
            res = formats.read_array(f, "residual", path)
            und = formats.read_array(f, "undetermined", path)
            if res.ndim != 1 or und.ndim != 1 or (und.size and (und.min() < 0 or und.max() >= res.size)):
                raise InputError("'residual' (n_probes,) and 'undetermined' (indices into it) do not match", path)
        return {"n_samples": int(res.size), "n_undetermined": int(und.size)}
    with formats.open_input(path) as f:
        pred = formats.read_array(f, "predictions", path)
        if pred.ndim != 2:
            raise InputError(f"'predictions' has shape {pred.shape}, expected (N, d)", path)
        out = {"n_samples": int(pred.shape[0]), "d": int(pred.shape[1])}
        if "outputs" in f:
            outputs = formats.read_array(f, "outputs", path)
            off = formats.read_array(f, "offsets", path)
            if outputs.ndim != 2 or outputs.shape[1] != pred.shape[1]:
                raise InputError(f"'outputs' has shape {outputs.shape}, expected (T, {pred.shape[1]})", path)
            if off.shape != (pred.shape[0] + 1,) or off[0] != 0 or off[-1] != outputs.shape[0] \
                    or (np.diff(off) <= 0).any():
                raise InputError("'offsets' do not describe 'outputs' (need N+1 strictly increasing "
                                 "integers from 0 to T)", path)
            out["n_tokens"] = int(outputs.shape[0])
    return out


def _scan_finite(path: str | os.PathLike, info: TokensInfo) -> None:
    for a, _b, tokens, offsets, targets, weights in iter_chunks(info, (0, info.n_samples), default_chunk_size(info),
                                                               with_weights=True):
        check_finite(tokens, offsets, targets, a, path)
        check_weights(weights, offsets, a, info.per_position, path)
