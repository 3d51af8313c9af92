"""Heads files for other frameworks: HDF5 (mhla's own), .npz (numpy) and .safetensors, chosen by suffix.

Every format holds V (H, d_out, d) and Q (H, d, d) float64 exactly as computed, plus metadata: format
("mhla-heads"), mhla_version, d, n_heads, normalize (and d_out when it differs from d: heads put back
in a model's coordinates by `mhla export-heads --unreduce`), and what the export changed: function_change
(on the training data), coef_change and coordinates (mhla_cli.model.canonical). Heads with the bias terms
(docs/bias_terms.md) also hold the arrays value_bias (H, d_out), score_key (H, d), score_query (H, d),
score_bias (H,) and the metadata bias_terms = 1; heads with the token-wise affine map of the wide tokens
(mhla_cli.solve.affine_block) hold affine_weight (d_out, D) and affine_bias (d_out,) and the metadata
affine_width = D. Factored heads (`mhla export-heads --unreduce`: mhla_cli.model.heads.Heads) hold V (H, r, r) and
Q (H, r, r) of the reduced coordinates and the maps reduce_P (d, r), reduce_U (d_out, r), with the metadata
reduced_dim = r (d and d_out the widths of the tokens and outputs the function takes and gives). Writes are
atomic (a temporary file in the output's directory, renamed on success; nothing is left on failure).
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ..io import formats
from .._version import __version__
from ..errors import InputError
from ..samples import layout_info
from ..bias_terms import BIAS_ARRAYS
from .heads import AFFINE_ARRAYS, MAP_ARRAYS, Heads, check_widths, read_bias_arrays

# suffix -> format; a path without a suffix is an HDF5 heads file (the historic default)
SUFFIXES = {".h5": "hdf5", ".hdf5": "hdf5", ".hdf": "hdf5", "": "hdf5", ".npz": "npz",
            ".safetensors": "safetensors"}
FORMAT_NAME = "mhla-heads"


def heads_format(path: str | os.PathLike) -> str:
    """"hdf5", "npz" or "safetensors" from the path's suffix; InputError for any other suffix."""
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise InputError(f"unknown heads format '{suffix}': use .h5 / .hdf5 (HDF5), .npz (numpy) or "
                         ".safetensors", path)
    return SUFFIXES[suffix]


def _metadata(heads: Heads) -> dict[str, str]:
    meta = {"format": FORMAT_NAME, "mhla_version": __version__, "d": str(heads.d), "n_heads": str(heads.n_heads),
            "normalize": str(heads.info.get("normalize", "none"))}
    if heads.d_out != heads.d:
        meta["d_out"] = str(heads.d_out)
    if heads.factored:
        meta["reduced_dim"] = str(heads.reduced_dim)
    if heads.info.get("attention") is not None:  # the layout, and its parameters as JSON (samples.layout_info)
        meta.update({k: str(v) if k == "attention" else json.dumps(v) for k, v in layout_info(heads.info).items()})
    for key in ("function_change", "coef_change"):  # what the export changed (mhla_cli.model.canonical)
        if heads.info.get(key) is not None:
            meta[key] = repr(float(heads.info[key]))
    if heads.info.get("coordinates") is not None:
        meta["coordinates"] = str(heads.info["coordinates"])
    if heads.bias_terms:
        meta["bias_terms"] = "1"
    if heads.affine_weight is not None:
        meta["affine_width"] = str(heads.affine_weight.shape[1])
    return meta


def safetensors_module() -> Any:
    try:
        import safetensors.numpy as st
    except ImportError:
        raise InputError("reading or writing .safetensors needs the optional package safetensors: "
                         "pip install 'safetensors>=0.4' (mhla's [safetensors] extra)") from None
    return st


def save_heads(heads: Heads, path: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = ()) -> None:
    """Write heads in the format named by the suffix of `path` (.h5/.hdf5, .npz, .safetensors), atomically.

    `inputs` are recorded as provenance in HDF5 and safetensors files (names, sizes, fingerprints).
    """
    fmt = heads_format(path)
    if fmt == "hdf5":
        heads.save(path, inputs=inputs)
        return
    st = safetensors_module() if fmt == "safetensors" else None
    formats.check_output_path(path, inputs, "heads")
    arrays = {k: np.ascontiguousarray(v, dtype=np.float64)
              for k, v in {"V": heads.V, "Q": heads.Q, **heads.bias_arrays(), **heads.affine_arrays(),
                           **heads.map_arrays()}.items()}
    meta = _metadata(heads)
    with formats.atomic_path(path) as tmp:
        if fmt == "npz":
            with open(tmp, "wb") as f:  # a file object: np.savez would append .npz to a name
                named: dict[str, Any] = {**arrays, **{k: np.array(v) for k, v in meta.items()}}
                np.savez(f, **named)
        else:
            if inputs:
                meta["mhla_inputs"] = json.dumps([formats.source_identity(i) for i in inputs])
            assert st is not None  # fmt == "safetensors"
            st.save_file(arrays, str(tmp), metadata=meta)


def _check_meta(meta: dict[str, str], path: str | os.PathLike) -> str:
    if meta.get("format") != FORMAT_NAME:
        raise InputError(f"not an mhla heads file (metadata 'format' is {meta.get('format')!r}, "
                         f"expected '{FORMAT_NAME}')", path)
    return meta.get("normalize", "none")


def load_heads(path: str | os.PathLike) -> Heads:
    """Read and validate heads written by `save_heads` (any of its formats, by suffix)."""
    fmt = heads_format(path)
    if fmt == "hdf5":
        return Heads.load(path)
    if not Path(path).is_file():
        raise InputError("no such file", path)
    if fmt == "npz":
        if not zipfile.is_zipfile(path):
            raise InputError("not a .npz archive (a zip file of arrays); the file may be truncated or corrupted", path)
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError) as exc:
            raise InputError(f"cannot read as .npz ({exc})", path) from None
        meta = {k: str(v) for k, v in arrays.items()
                if k not in ("V", "Q", *BIAS_ARRAYS, *AFFINE_ARRAYS, *MAP_ARRAYS) and v.ndim == 0}
    else:
        safetensors_module()  # a clear message when the optional package is missing
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="np") as f:
                meta = dict(f.metadata() or {})
                arrays = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
        except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types)
            raise InputError(f"cannot read as .safetensors ({exc})", path) from None
    normalize = _check_meta(meta, path)
    missing = [k for k in ("V", "Q") if k not in arrays]
    if missing:
        raise InputError(f"has no {' or '.join(repr(m) for m in missing)} array", path)
    if meta.get("bias_terms", "0") not in ("0", "1"):
        raise InputError(f"metadata 'bias_terms' = {meta['bias_terms']}, expected 0 or 1", path)
    bias = read_bias_arrays(arrays, meta.get("bias_terms") == "1", path)
    affine = {k: arrays[k] for k in AFFINE_ARRAYS if k in arrays}
    maps = {k: arrays[k] for k in MAP_ARRAYS if k in arrays}
    heads = Heads.from_arrays(arrays["V"], arrays["Q"], normalize, path, bias=bias, affine=affine or None,
                              maps=maps or None)
    for key in ("d", "n_heads", "d_out", "reduced_dim"):
        if key in meta and not meta[key].isdigit():
            raise InputError(f"metadata '{key}' = {meta[key]}, expected a whole number", path)
    check_widths(heads, {k: int(meta[k]) for k in ("d", "d_out") if k in meta}, path)
    for key, value in (("n_heads", heads.n_heads), ("reduced_dim", heads.reduced_dim if heads.factored else None)):
        if key in meta and meta[key] != str(value):
            raise InputError(f"metadata '{key}' = {meta[key]} but the arrays have {key} = {value}", path)
    for key in ("function_change", "coef_change"):
        if key in meta:
            heads.info[key] = float(meta[key])
    if "coordinates" in meta:
        heads.info["coordinates"] = meta["coordinates"]
    if "attention" in meta:
        try:
            heads.info.update({k: v if k == "attention" else json.loads(v) for k, v in layout_info(meta).items()})
        except json.JSONDecodeError:
            raise InputError("metadata of the heads' layout parameters is not JSON", path) from None
    return heads
