"""A fitted MHLA function: `Model` (coef p and its minimum-norm W) and its file; loading models or heads."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..io import formats
from ..errors import InputError
from ..feature_map import n_features
from ..samples import check_attention, layout_info
from .export import load_heads
from .heads import Heads, W_from_p, d_of_coef, p_from_W
from ..numerics import CANONICAL_COEF_TOL, ORTHONORMAL_TOL, SINGULAR_BASIS_COND, W_COEF_TOL


# Fit results kept as attributes of a model file.
_SAVED_INFO = ("ridge", "train_mse", "train_r2", "lambda_min", "identifiable", "condition_number", "n_samples", "method",
               "n_heads", "weight_decay", "nuclear_lambda", "objective", "normalize", "attention", "bias_terms")


@dataclass
class Model:
    """A fitted MHLA function: coef p (d, psi) and its minimum-Frobenius-norm W (d^2, d^2).

    A least-squares fit (solve.lstsq.fit) also keeps the coefficients it solved for, `coef_b` (d, psi) on
    the canonical features Ht(X A) of the whitened tokens, and that basis A (d, d): predict evaluates
    the function there (`evaluation`), which keeps its accuracy where p = p_b M_A would lose it (a
    token direction far smaller than the others: M_A's condition number is cond(A)^3).

    `gram_pairs`: the training data's Lambda~ on Ht(X A), as its distinct entries (symgram), with which
    export-heads, spectrum and compare measure a change of the function on the data
    (mhla_cli.model.canonical); with `gram_spans` (E, F) those of the block on the data's spans (a fit of
    statistics held on them). `W_b`: a low-rank fit's W of the whitened tokens X A (the least-squares W
    there is W_from_p(p_b D), not stored).
    """

    coef: np.ndarray
    W: np.ndarray
    d: int
    info: dict[str, Any] = field(default_factory=dict)
    coef_b: np.ndarray | None = None
    basis: np.ndarray | None = None
    gram_pairs: np.ndarray | None = None
    gram_spans: tuple[np.ndarray, np.ndarray] | None = None
    W_b: np.ndarray | None = None
    # The token-wise affine map of the wide tokens (mhla_cli.solve.affine_block): y += affine_coef (x_wide, 1),
    # (d, D + 1) beside coef's rows; None without the affine block.
    affine_coef: np.ndarray | None = None

    def evaluation(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(c, A): the function is c . H(X A) on the tokens X (A None: c = coef on X itself).

        With the canonical coefficients c = p_b D (Ht = D H, mhla_cli.statistics.basis), so that the forward
        pass of the tokens X A with coefficients c is the fitted function, evaluated where it was solved.
        """
        if self.coef_b is None or self.basis is None:
            return self.coef, None
        from ..statistics.basis import feature_scale

        return self.coef_b * feature_scale(self.d)[None, :], self.basis

    def __repr__(self) -> str:  # what was fitted, not coef and W
        shown = {k: self.info[k] for k in ("method", "n_heads", "ridge", "normalize", "train_mse")
                 if self.info.get(k) is not None}
        extra = "".join(f", {k}={v:.4g}" if isinstance(v, float) else f", {k}={v!r}" for k, v in shown.items())
        return f"Model(d={self.d}, n_features={self.coef.shape[-1]}{extra})"

    def save(self, path: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = ()) -> None:
        """Write a model file atomically; refused (InputError, nothing written) when a reader would refuse
        it (`check_readable`: the same checks as `load`)."""
        self.check_readable()
        attrs: dict[str, Any] = {"d": self.d, "n_features": n_features(self.d)}
        for k in _SAVED_INFO:
            if k in self.info and self.info[k] is not None:
                attrs[k] = self.info[k]
        attrs.update(layout_info(self.info))  # the layout fitted on, with its parameters (mhla_cli.samples)
        data = {"coef": self.coef, "W": self.W}
        if self.coef_b is not None and self.basis is not None:
            data.update(canonical_coef=self.coef_b, canonical_basis=self.basis)
            if self.gram_pairs is not None:
                data["canonical_gram_pairs"] = self.gram_pairs
                if self.gram_spans is not None:
                    data.update(canonical_span_pairs=self.gram_spans[0], canonical_span_last=self.gram_spans[1])
            if self.W_b is not None:
                data["canonical_W"] = self.W_b
        if self.affine_coef is not None:
            data["affine_coef"] = self.affine_coef
            attrs["affine_width"] = int(self.affine_coef.shape[1] - 1)
            if self.info.get("affine_source") is not None:
                attrs["affine_source"] = json.dumps(self.info["affine_source"])
        if self.info.get("data_source") is not None:  # the training data's identity (formats.source_identity)
            attrs["data_source"] = json.dumps(self.info["data_source"])
        formats.write_file(path, "model", data, attrs, inputs)

    def check_readable(self, path: str | os.PathLike | None = None) -> None:
        """The checks `load` makes on a model file's arrays, on this model: finite coef and W describing
        the same function, and, when present, a finite canonical_coef in an invertible canonical_basis
        (row-scaled condition number <= SINGULAR_BASIS_COND, as features files) that is the same
        function as coef. InputError naming what fails."""
        if not formats.all_finite(self.coef):
            raise InputError("'coef' contains NaN or Inf", path)
        if not formats.all_finite(self.W):
            raise InputError("'W' contains NaN or Inf", path)
        _check_w(self.W, self.coef, path)
        if self.coef_b is not None and self.basis is not None:
            _check_canonical(self.coef, self.coef_b, self.basis, path)
        if self.affine_coef is not None:
            a = self.affine_coef
            if a.ndim != 2 or a.shape[0] != self.coef.shape[0] or a.shape[1] < 2 or not formats.all_finite(a):
                raise InputError(f"'affine_coef' has shape {a.shape} or non-finite values, expected finite "
                                 f"({self.coef.shape[0]}, D + 1)", path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Model:
        """Read and validate a model file (coef and W must describe the same function)."""
        with formats.open_input(path) as f:
            formats.expect_kind(f, path, "model")
            coef = formats.read_array(f, "coef", path).astype(np.float64)
            if coef.ndim != 2:
                raise InputError(f"'coef' has shape {coef.shape}, expected (d, psi)", path)
            d = formats.d_from_psi_shape(coef.shape, path, "coef")
            e = coef.shape[0]  # the outputs' width D_out (d, or a head's / layer's own output width)
            if e < 1:
                raise InputError(f"'coef' has shape {coef.shape}, expected (D_out, psi) = (D_out, {n_features(d)})",
                                 path)
            if not np.isfinite(coef).all():
                raise InputError("'coef' contains NaN or Inf", path)
            if "W" in f:
                W = formats.read_array(f, "W", path).astype(np.float64)
                if W.shape != (e * d, d * d):
                    raise InputError(f"'W' has shape {W.shape}, expected (D_out d, d^2) = ({e*d}, {d*d}) "
                                     f"to match coef", path)
                _check_w(W, coef, path)
            else:
                W = W_from_p(coef)
            info = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()
                    if k in _SAVED_INFO}
            info.update(layout_info(f.attrs))
            if formats.read_bias_terms(f.attrs, path):  # the function of the tokens (x, 1): mhla_cli.bias_terms
                info["bias_terms"] = True
            else:
                info.pop("bias_terms", None)
            coef_b, basis = _load_canonical(f, path, coef)
            gram_pairs, spans, W_b = _load_data_gram(f, path, coef_b)
            affine_coef = None
            if "affine_coef" in f:
                affine_coef = formats.read_array(f, "affine_coef", path).astype(np.float64)
                info["affine_width"] = int(affine_coef.shape[-1] - 1) if affine_coef.ndim == 2 else 0
                if "affine_source" in f.attrs:
                    with contextlib.suppress(ValueError):
                        src = f.attrs["affine_source"]
                        info["affine_source"] = json.loads(src.decode() if isinstance(src, bytes) else str(src))
            if "data_source" in f.attrs:
                with contextlib.suppress(ValueError):
                    src = f.attrs["data_source"]
                    info["data_source"] = json.loads(src.decode() if isinstance(src, bytes) else str(src))
        model = cls(coef=coef, W=W, d=d, info=info, coef_b=coef_b, basis=basis, gram_pairs=gram_pairs,
                    gram_spans=spans, W_b=W_b, affine_coef=affine_coef)
        if affine_coef is not None:
            model.check_readable(path)
        return model


# CANONICAL_COEF_TOL (mhla_cli.numerics): coef and p_b M_A of a model file agree to it.


def _load_canonical(f: Any, path: str | os.PathLike, coef: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The optional `canonical_coef` (p_b) and `canonical_basis` (A) of a model file (files before them have
    neither: coef is used)."""
    have = [k for k in ("canonical_coef", "canonical_basis") if k in f]
    if not have:
        return None, None
    if len(have) == 1:
        missing = "canonical_basis" if have[0] == "canonical_coef" else "canonical_coef"
        raise InputError(f"has '{have[0]}' but no '{missing}'; the file is incomplete", path)
    coef_b = formats.read_array(f, "canonical_coef", path).astype(np.float64)
    basis = formats.read_array(f, "canonical_basis", path).astype(np.float64)
    _check_canonical(coef, coef_b, basis, path)
    return coef_b, basis


def _check_w(W: np.ndarray, coef: np.ndarray, path: str | os.PathLike | None) -> None:
    """W and coef describe the same function (W_COEF_TOL of the largest coefficient)."""
    scale = max(float(np.abs(coef).max()), 1e-300)
    if not np.allclose(p_from_W(W), coef, rtol=0, atol=W_COEF_TOL * scale):
        raise InputError("'W' and 'coef' describe different functions; the file is inconsistent", path)


def _check_canonical(coef: np.ndarray, coef_b: np.ndarray, basis: np.ndarray, path: str | os.PathLike | None
                     ) -> None:
    """canonical_coef (finite, coef's shape) in canonical_basis (finite, row-scaled condition number <=
    SINGULAR_BASIS_COND: a rescaling of the token coordinates, however large, is no singularity) is
    the function coef (CANONICAL_COEF_TOL of its largest entry)."""
    from ..statistics.basis import coef_from_basis, row_scaled_cond

    d = d_of_coef(coef)
    if coef_b.shape != coef.shape or not np.isfinite(coef_b).all():
        raise InputError(f"'canonical_coef' has shape {coef_b.shape} or non-finite values, expected finite "
                         f"{coef.shape}", path)
    if basis.shape != (d, d) or not row_scaled_cond(basis) <= SINGULAR_BASIS_COND:
        raise InputError(f"'canonical_basis' has shape {basis.shape} or is singular, expected an invertible "
                         f"({d}, {d})", path)
    scale = max(float(np.abs(coef).max()), 1e-300)
    with np.errstate(over="ignore", invalid="ignore"):
        back = coef_from_basis(basis, coef_b)
    if not (np.abs(back - coef) <= CANONICAL_COEF_TOL * scale).all():
        raise InputError("'canonical_coef' in 'canonical_basis' and 'coef' describe different functions; the "
                         "file is inconsistent", path)


def _load_data_gram(f: Any, path: str | os.PathLike, coef_b: np.ndarray | None
                    ) -> tuple[np.ndarray | None, tuple[np.ndarray, np.ndarray] | None, np.ndarray | None]:
    """The optional `canonical_gram_pairs` (Lambda~ of the training data on Ht(X A), distinct entries; with
    `canonical_span_pairs` and `canonical_span_last`, those of its block on the data's spans) and
    `canonical_W` (a low-rank fit's W of X A) of a model file; all need the canonical coefficients."""
    names = ("canonical_gram_pairs", "canonical_span_pairs", "canonical_span_last", "canonical_W")
    have = [k for k in names if k in f]
    if not have:
        return None, None, None
    if coef_b is None:
        raise InputError(f"has '{have[0]}' but no 'canonical_coef' and 'canonical_basis'; the file is incomplete", path)
    d, e = d_of_coef(coef_b), coef_b.shape[0]
    pairs, spans = _load_gram_pairs(f, path, d) if "canonical_gram_pairs" in f else (None, None)
    if spans is None and any(k in f for k in names[1:3]):
        raise InputError("has 'canonical_span_pairs' or 'canonical_span_last' without the other or without "
                         "'canonical_gram_pairs'; the file is incomplete", path)
    W_b = None
    if "canonical_W" in f:
        W_b = formats.read_array(f, "canonical_W", path).astype(np.float64)
        if W_b.shape != (e * d, d * d) or not np.isfinite(W_b).all():
            raise InputError(f"'canonical_W' has shape {W_b.shape} or non-finite values, expected finite "
                             f"({e * d}, {d * d})", path)
        from ..statistics.basis import feature_scale

        c = coef_b * feature_scale(d)[None, :]
        scale = max(float(np.abs(c).max()), 1e-300)
        if not (np.abs(p_from_W(W_b) - c) <= W_COEF_TOL * scale).all():
            raise InputError("'canonical_W' and 'canonical_coef' describe different functions; the file is "
                             "inconsistent", path)
    return pairs, spans, W_b


def _load_gram_pairs(f: Any, path: str | os.PathLike, d: int
                     ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """`canonical_gram_pairs` and, when present, the spans of its block, validated."""
    q = d * (d + 1) // 2
    spans = None
    a, b = q, d
    if "canonical_span_pairs" in f and "canonical_span_last" in f:
        E = formats.read_array(f, "canonical_span_pairs", path).astype(np.float64)
        F = formats.read_array(f, "canonical_span_last", path).astype(np.float64)
        for name, M, rows in (("canonical_span_pairs", E, q), ("canonical_span_last", F, d)):
            if M.ndim != 2 or M.shape[0] != rows or M.shape[1] > rows or not np.isfinite(M).all() \
                    or np.abs(M.T @ M - np.eye(M.shape[1])).max() > ORTHONORMAL_TOL:
                raise InputError(f"'{name}' must have orthonormal columns of length {rows}, got shape {M.shape}", path)
        spans, a, b = (E, F), E.shape[1], F.shape[1]
    pairs = formats.read_array(f, "canonical_gram_pairs", path).astype(np.float64)
    shape = (a * (a + 1) // 2, b * (b + 1) // 2)
    if pairs.shape != shape or not np.isfinite(pairs).all():
        raise InputError(f"'canonical_gram_pairs' has shape {pairs.shape} or non-finite values, expected finite "
                         f"{shape}", path)
    return pairs, spans


def load_function(path: str | os.PathLike) -> Model | Heads:
    """Load a model or heads file (HDF5; heads also from .npz or .safetensors, mhla_cli.model.export)."""
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
    check_attention(attention_of(fn), "attribute 'attention'", path)
    return fn


def evaluation_of(fn: Model | Heads | np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(c, A): predict evaluates c . H(X A) (A None: the tokens' own coordinates; Model.evaluation)."""
    if isinstance(fn, Model):
        return fn.evaluation()
    return coef_of(fn), None


def coef_of(fn: Model | Heads | np.ndarray) -> np.ndarray:
    """The coef p (d, psi) of a model, heads or a p array."""
    if isinstance(fn, np.ndarray):
        return np.asarray(fn, dtype=np.float64)
    return fn.coef


def attention_of(fn: Model | Heads | np.ndarray) -> str | None:
    """The attention of the per-position samples a model or heads were fitted on ("causal" or
    "bidirectional", mhla_cli.samples); None for last-token fits and files that do not record it."""
    if isinstance(fn, np.ndarray):
        return None
    att = fn.info.get("attention")
    return None if att is None else str(att.decode() if isinstance(att, bytes) else att)


def bias_terms_of(fn: Model | Heads | np.ndarray) -> bool:
    """Whether a model or heads hold the bias terms (mhla_cli.bias_terms): a model's coef is then of the
    tokens (x, 1) with the padded output last; heads carry their bias arrays."""
    if isinstance(fn, np.ndarray):
        return False
    if isinstance(fn, Heads):
        return fn.bias_terms
    return bool(fn.info.get("bias_terms", False))


def token_dim(fn: Model | Heads | np.ndarray) -> int:
    """The width d of the tokens a model or heads take (a bias-terms model's coef is of the tokens (x, 1): d + 1
    wide, mhla_cli.bias_terms)."""
    if isinstance(fn, np.ndarray):
        return int(fn.shape[0])
    return int(fn.d) - int(isinstance(fn, Model) and bias_terms_of(fn))


def affine_of(fn: Model | Heads | np.ndarray) -> np.ndarray | None:
    """The token-wise affine map of the wide tokens of a model or heads (mhla_cli.solve.affine_block): (d_out, D + 1)
    on (x_wide, 1), without a bias-terms model's padded output; None without one."""
    if isinstance(fn, Model):
        a = fn.affine_coef
        return None if a is None else (a[:-1] if bias_terms_of(fn) else a)
    if isinstance(fn, Heads) and fn.affine_weight is not None:
        assert fn.affine_bias is not None  # set with affine_weight
        return np.hstack([fn.affine_weight, fn.affine_bias[:, None]])
    return None


def normalize_of(fn: Model | Heads | np.ndarray) -> str:
    """The normalisation ("none" or "length") a model or heads file was fitted with."""
    if isinstance(fn, np.ndarray):
        return "none"
    return str(fn.info.get("normalize", "none"))
