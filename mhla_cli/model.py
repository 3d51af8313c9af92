"""A fitted MHLA function: `Model` (coef p and its minimum-norm W) and its file; loading models or heads."""

from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import formats
from .errors import InputError
from .features import n_features
from .export import load_heads
from .heads import Heads, W_from_p, p_from_W


# Fit results kept as attributes of a model file.
_SAVED_INFO = ("ridge", "train_mse", "train_r2", "lambda_min", "identifiable", "condition_number", "n_samples", "method",
               "n_heads", "weight_decay", "nuclear_lambda", "objective", "normalize")


@dataclass
class Model:
    """A fitted MHLA function: coef p (d, psi) and its minimum-Frobenius-norm W (d^2, d^2)."""

    coef: np.ndarray
    W: np.ndarray
    d: int
    info: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:  # what was fitted, not coef and W
        shown = {k: self.info[k] for k in ("method", "n_heads", "ridge", "normalize", "train_mse")
                 if self.info.get(k) is not None}
        extra = "".join(f", {k}={v:.4g}" if isinstance(v, float) else f", {k}={v!r}" for k, v in shown.items())
        return f"Model(d={self.d}, n_features={self.coef.shape[-1]}{extra})"

    def save(self, path: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = ()) -> None:
        """Write a model file atomically."""
        attrs = {"d": self.d, "n_features": n_features(self.d)}
        for k in _SAVED_INFO:
            if k in self.info and self.info[k] is not None:
                attrs[k] = self.info[k]
        formats.write_file(path, "model", {"coef": self.coef, "W": self.W}, attrs, inputs)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Model:
        """Read and validate a model file (coef and W must describe the same function)."""
        with formats.open_input(path) as f:
            formats.expect_kind(f, path, "model")
            coef = formats.read_array(f, "coef", path).astype(np.float64)
            if coef.ndim != 2:
                raise InputError(f"'coef' has shape {coef.shape}, expected (d, psi)", path)
            d = formats.d_from_psi_shape(coef.shape, path, "coef")
            if coef.shape[0] != d:
                raise InputError(f"'coef' has shape {coef.shape}, expected (d, psi) = ({d}, {n_features(d)})", path)
            if not np.isfinite(coef).all():
                raise InputError("'coef' contains NaN or Inf", path)
            if "W" in f:
                W = formats.read_array(f, "W", path).astype(np.float64)
                if W.shape != (d * d, d * d):
                    raise InputError(f"'W' has shape {W.shape}, expected (d^2, d^2) = ({d*d}, {d*d}) "
                                     f"to match coef", path)
                scale = max(float(np.abs(coef).max()), 1e-300)
                if not np.allclose(p_from_W(W), coef, rtol=0, atol=1e-8 * scale):
                    raise InputError("'W' and 'coef' describe different functions; the file is inconsistent", path)
            else:
                W = W_from_p(coef)
            info = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()
                    if k in _SAVED_INFO}
        return cls(coef=coef, W=W, d=d, info=info)


def load_function(path: str | os.PathLike) -> Model | Heads:
    """Load a model or heads file (HDF5; heads also from .npz or .safetensors, mhla_cli.export)."""
    if Path(path).suffix.lower() in formats.FOREIGN_SUFFIXES:
        return load_heads(path)
    kind = formats.kind_of(path)
    if kind == "model":
        fn: Model | Heads = Model.load(path)
    elif kind == "heads":
        fn = Heads.load(path)
    else:
        raise InputError(f"is a {kind} file, expected a model or heads file", path)
    norm = normalize_of(fn)
    if norm not in ("none", "length"):
        raise InputError(f"attribute 'normalize' is '{norm}', expected none or length", path)
    return fn


def coef_of(fn: Model | Heads | np.ndarray) -> np.ndarray:
    """The coef p (d, psi) of a model, heads or a p array."""
    if isinstance(fn, np.ndarray):
        return np.asarray(fn, dtype=np.float64)
    return fn.coef


def normalize_of(fn: Model | Heads | np.ndarray) -> str:
    """The normalisation ("none" or "length") a model or heads file was fitted with."""
    if isinstance(fn, np.ndarray):
        return "none"
    return str(fn.info.get("normalize", "none"))
