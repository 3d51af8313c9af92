"""Do two models (or heads) compute the same function? On a dataset, on the training data, and in p-space.

The verdict is a change of outputs relative to the outputs of B (the reference): with `on` the RMS
difference of the two functions' predictions on that tokens file over the RMS of B's, at the samples the
models' layouts score (every position of a bidirectional model, every prefix of a causal one, the last
token of last-token ones: `scored_layouts`); else, when A or
B is a model that keeps its data's Lambda~ (mhla_cli.model.canonical), the same on that training data
(B's data first); else, with no data at all, ||p_A - p_B|| / ||p_B|| in the tokens' own coordinates,
which depends on their units and is named so (`judged_by`). Whatever judges, a function change on
the training data above the tolerance makes the functions different: the verdict never contradicts it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError, Refused
from ..feature_map import n_features
from .heads import Heads, coef_inner, coef_of_heads
from .canonical import coef_in_basis, data_gram
from .model import Model, affine_of, bias_terms_of, coef_of, normalize_of
from .forward import (DIRECT_COEF_BYTES, direct, evaluated, fitted_samples, in_basis, in_width, out_width,
                      predict_chunk, sample_outputs)
from mhla_cli.statistics.ranges import default_chunk_size
from ..io.tokens import check_finite, inspect_tokens, iter_chunks, with_bias_terms
from ..samples import LAST, LAYOUTS, Samples


@dataclass
class Distance:
    """||p_A - p_B||_F, the same over ||p_B||_F (the paper's Fig. 2 metric) and the two norms
    (`function_distance`)."""

    distance: float
    relative_distance: float  # inf when p_B = 0 != p_A, 0 when both are 0
    norm_a: float
    norm_b: float

    def __repr__(self) -> str:
        return (f"Distance(distance={self.distance:.4g}, relative_distance={self.relative_distance:.4g}, "
                f"norm_a={self.norm_a:.4g}, norm_b={self.norm_b:.4g})")

    def to_dict(self) -> dict[str, float]:
        return {"distance": self.distance, "relative_distance": self.relative_distance, "norm_a": self.norm_a,
                "norm_b": self.norm_b}

    @classmethod
    def of(cls, dist: float, norm_a: float, norm_b: float) -> Distance:
        """The record of ||p_A - p_B|| = dist and the two norms (the relative distance derived)."""
        rel = dist / norm_b if norm_b > 0 else (0.0 if dist == 0 else float("inf"))
        return cls(distance=dist, relative_distance=rel, norm_a=norm_a, norm_b=norm_b)


def _heads_distance(a: Model | Heads | np.ndarray, b: Model | Heads | np.ndarray) -> Distance:
    """function_distance of heads evaluated directly (forward.direct: rectangular, or too wide for a coef)."""
    if not (isinstance(a, Heads) and isinstance(b, Heads)):
        raise InputError("a model (d, psi) cannot be compared with heads too wide for a coef or with outputs of "
                         "another width: export the model's heads first")
    if (a.d_out, a.d) != (b.d_out, b.d):
        raise InputError(f"the heads map d = {a.d} to {a.d_out} and d = {b.d} to {b.d_out}: nothing to compare")
    (Va, Qa), (Vb, Qb) = a.augmented(), b.augmented()  # with the bias terms: the heads of the tokens (x, 1)
    if a.factored or b.factored or a.token_centre is not None or b.token_centre is not None:
        return _factored_distance(a, b)  # centred heads too: through their maps (x, 1) -> (x - c, 1)
    if 8 * a.d_out * n_features(Qa.shape[1]) <= DIRECT_COEF_BYTES:
        pa, pb = coef_of_heads(Va, Qa), coef_of_heads(Vb, Qb)
        return _distance(pa, pb)
    # ||p_A - p_B||^2 of the heads (V_A, -V_B) (Q_A, Q_B), in products of d x d matrices
    V = np.concatenate([Va, -Vb])
    Q = np.concatenate([Qa, Qb])
    dist = float(np.sqrt(max(coef_inner(V, Q, V, Q), 0.0)))
    na = float(np.sqrt(max(coef_inner(Va, Qa, Va, Qa), 0.0)))
    nb = float(np.sqrt(max(coef_inner(Vb, Qb, Vb, Qb), 0.0)))
    return Distance.of(dist, na, nb)


def _factors(h: Heads) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(V, Q, P, U) of heads with their bias terms (the heads of the tokens (x, 1)): the maps of factored heads,
    identities for the others."""
    V, Q = h.augmented_centred()
    maps = h.augmented_maps()
    P, U = maps if maps is not None else (np.eye(Q.shape[1]), None)
    return V, Q, P, np.eye(V.shape[1]) if U is None else U


def _factored_distance(a: Heads, b: Heads) -> Distance:
    """function_distance of factored heads (`mhla export-heads --unreduce`), in products of the reduced widths
    (heads.coef_inner with the maps). A - B is itself factored. With shared maps its W = sum_h vec(V_h) vec(Q_h)^T
    is W_A - W_B of the reduced heads, taken apart into heads again by a QR of each factor and an SVD of the small
    core (no head of A cancels one of B inside coef_inner: a difference far below the norms is resolved). With
    other maps the maps stand side by side ([P_A P_B], [U_A U_B]) and the heads in their blocks."""
    Va, Qa, Pa, Ua = _factors(a)
    Vb, Qb, Pb, Ub = _factors(b)
    na = float(np.sqrt(max(coef_inner(Va, Qa, Va, Qa, (Pa, Ua), (Pa, Ua)), 0.0)))
    nb = float(np.sqrt(max(coef_inner(Vb, Qb, Vb, Qb, (Pb, Ub), (Pb, Ub)), 0.0)))
    if Pa.shape == Pb.shape and Ua.shape == Ub.shape and np.array_equal(Pa, Pb) and np.array_equal(Ua, Ub):
        K, (ro, r) = Va.shape[0] + Vb.shape[0], Va.shape[1:]
        qa, ra = np.linalg.qr(np.concatenate([Va, -Vb]).reshape(K, -1).T)  # W_A - W_B = (qa ra) (qb rb)^T
        qb, rb = np.linalg.qr(np.concatenate([Qa, Qb]).reshape(K, -1).T)
        u, sv, vt = np.linalg.svd(ra @ rb.T)
        V, Q, maps = ((qa @ u) * sv).T.reshape(-1, ro, r), (qb @ vt.T).T.reshape(-1, r, r), (Pa, Ua)
    else:
        (Ha, oa, ra), (Hb, ob, rb) = Va.shape, Vb.shape
        V = np.zeros((Ha + Hb, oa + ob, ra + rb))
        Q = np.zeros((Ha + Hb, ra + rb, ra + rb))
        V[:Ha, :oa, :ra], V[Ha:, oa:, ra:] = Va, -Vb
        Q[:Ha, :ra, :ra], Q[Ha:, ra:, ra:] = Qa, Qb
        maps = (np.hstack([Pa, Pb]), np.hstack([Ua, Ub]))
    dist = float(np.sqrt(max(coef_inner(V, Q, V, Q, maps, maps), 0.0)))
    return Distance.of(dist, na, nb)


def _distance(pa: np.ndarray, pb: np.ndarray) -> Distance:
    return Distance.of(float(np.linalg.norm(pa - pb)), float(np.linalg.norm(pa)), float(np.linalg.norm(pb)))


def function_distance(a: Model | Heads | np.ndarray, b: Model | Heads | np.ndarray) -> Distance:
    """||p_A - p_B||_F and ||p_A - p_B||_F / ||p_B||_F (the paper's Fig. 2 metric).

    Heads of outputs wider or narrower than their tokens (d_out != d) are compared on their
    (d_out, psi) coef; heads too wide for one, through d x d products (heads.coef_inner). With the bias terms
    (both or neither), the coef of the tokens (x, 1) (mhla_cli.bias_terms)."""
    if bias_terms_of(a) != bias_terms_of(b):
        raise InputError("one function has the bias terms and the other not: their coef act on different "
                         "features, so they cannot be compared")
    fa, fb = affine_of(a), affine_of(b)
    if fa is not None or fb is not None:  # the MHLA's coef and the affine map of the wide tokens, together
        if fa is None or fb is None or fa.shape != fb.shape:
            raise InputError("one function has an affine map of the wide tokens and the other not (or of another "
                             "width): they cannot be compared")
        core = function_distance(_without_affine(a), _without_affine(b))
        dist = float(np.hypot(core.distance, np.linalg.norm(fa - fb)))
        return Distance.of(dist, float(np.hypot(core.norm_a, np.linalg.norm(fa))),
                           float(np.hypot(core.norm_b, np.linalg.norm(fb))))
    square = all(not isinstance(f, Heads) or f.d_out == f.d for f in (a, b))
    # a model (whose coef exists) beside unfactored heads of any output width: compared on their (D_out, psi) coef
    with_model = not all(isinstance(f, Heads) for f in (a, b)) and \
        not any(isinstance(f, Heads) and f.factored for f in (a, b))
    if (direct(a) is not None or direct(b) is not None) and not (bias_terms_of(a) and square) and not with_model:
        return _heads_distance(a, b)
    pa, pb = coef_of(a), coef_of(b)
    if pa.shape != pb.shape:
        raise InputError(f"the models have different d ({pa.shape[0]} and {pb.shape[0]}): nothing to compare")
    return _distance(pa, pb)


def training_data_change(a: Model | Heads | np.ndarray, b: Model | Heads | np.ndarray) -> dict[str, Any]:
    """The RMS difference of A's and B's outputs over the training inputs of B (or, when B keeps no Lambda~ of
    its data, of A) relative to the RMS of B's outputs there: {"function_change", "measured_on": "b" | "a",
    "training_data_identifiable": whether those data determine the function (the fit's certificate; when
    not, functions that agree there may differ elsewhere)}, all None when neither keeps one or a function
    has no coef on d x d features (wide heads)."""
    for name, ref in (("b", b), ("a", a)):
        if isinstance(ref, Model) and ref.gram_pairs is not None and ref.basis is not None:
            try:
                xa, xb = coef_in_basis(a, ref.basis), coef_in_basis(b, ref.basis)
            except InputError:
                break
            gram = data_gram(ref)
            assert gram is not None  # a model with its gram_pairs and basis
            diff, base = gram.sq(xa - xb), gram.sq(xb)
            change = float(np.sqrt(diff / base)) if base > 0 else (0.0 if diff == 0 else float("inf"))
            ident = ref.info.get("identifiable")
            return {"function_change": change, "measured_on": name,
                    "training_data_identifiable": None if ident is None else bool(ident)}
    return {"function_change": None, "measured_on": None, "training_data_identifiable": None}


def _without_affine(fn: Model | Heads | np.ndarray) -> Model | Heads | np.ndarray:
    """fn without its affine map of the wide tokens (a copy)."""
    if isinstance(fn, Model):
        return dataclasses.replace(fn, affine_coef=None)
    if isinstance(fn, Heads):
        return dataclasses.replace(fn, affine_weight=None, affine_bias=None)
    return fn


def scored_layouts(a: Model | Heads | np.ndarray, b: Model | Heads | np.ndarray) -> tuple[Samples, ...]:
    """The sample layouts `compare --on` scores: those A and B were fitted on (`fitted_samples`), every position
    of a bidirectional model and every prefix of a causal one; LAST only when both are last-token functions (a
    per-position layout's last row of a window is the last-token sample: it holds LAST's)."""
    layouts = {fitted_samples(a), fitted_samples(b)}
    per_position = [s for s in LAYOUTS.values() if s in layouts and s.per_position]
    return tuple(per_position) if per_position else (LAST,)


def prediction_difference(a: Model | Heads | np.ndarray, b: Model | Heads | np.ndarray,
                          data: str | os.PathLike, chunk_size: int | None = None,
                          progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """RMS over the outputs of (yhat_A - yhat_B) on a tokens file, streamed, the RMS of yhat_B and their
    ratio (`relative_rms_difference`), at every sample of the layouts the models score (`scored_layouts`:
    `scored_as`, `n_scored` rows of d_out outputs); each model evaluated as `predict` evaluates it
    (Model.evaluation)."""
    if affine_of(a) is not None or affine_of(b) is not None:
        raise Refused("comparing predictions of functions with the affine map of the wide tokens needs the wide "
                      "tokens: predict each ({predict_wide}) and compare the outputs", data, predict_wide={})
    (pa, basis_a), (pb, basis_b) = evaluated(a), evaluated(b)
    norm = normalize_of(a)
    layouts = scored_layouts(a, b)
    info = inspect_tokens(data)
    if bias_terms_of(a):  # the functions of the tokens (x, 1): the reader appends the constant
        info = with_bias_terms(info, pad_targets=False)
    if info.d != in_width(pa):
        raise InputError(f"the data have d = {info.d} but the models have d = {in_width(pa)}", data)
    size = chunk_size or default_chunk_size(info)
    ss_diff = ss_b = 0.0
    max_abs = 0.0
    rows = 0
    for lo, hi, tokens, offsets, _y in iter_chunks(info, (0, info.n_samples), size):
        check_finite(tokens, offsets, None, lo, data)
        ta, tb = in_basis(tokens, basis_a), in_basis(tokens, basis_b)
        for samples in layouts:
            if samples == LAST:
                ya, _ = predict_chunk(pa, ta, offsets, normalize=norm)
                yb, _ = predict_chunk(pb, tb, offsets, normalize=norm)
            else:  # every position (bidirectional) or every prefix (causal) of each window
                ya = sample_outputs(pa, ta, offsets, samples, norm)
                yb = sample_outputs(pb, tb, offsets, samples, norm)
            diff = ya - yb
            ss_diff += float((diff**2).sum())
            ss_b += float((yb**2).sum())
            max_abs = max(max_abs, float(np.abs(diff).max(initial=0.0)))
            rows += diff.shape[0]
        if progress is not None:
            progress(hi - lo)
    n = max(rows, 1) * out_width(pa)
    rms_diff, rms_b = float(np.sqrt(ss_diff / n)), float(np.sqrt(ss_b / n))
    rel = rms_diff / rms_b if rms_b > 0 else (0.0 if rms_diff == 0 else float("inf"))
    return {"rms_prediction_difference": rms_diff, "rms_prediction_b": rms_b, "relative_rms_difference": rel,
            "max_abs_prediction_difference": max_abs, "n_samples": info.n_samples,
            "scored_as": [s.name for s in layouts], "n_scored": rows}


def compare(a: Model | Heads | np.ndarray, b: Model | Heads | np.ndarray, tol: float = 1e-6,
            on: str | os.PathLike | None = None, chunk_size: int | None = None,
            progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Distance between two functions and the verdict `same` (module docstring): the relative RMS prediction
    difference on `on` <= tol (at every sample of the layouts the models score: `prediction_difference`);
    without `on`, the function change on the training data (`training_data_change`) <= tol; with neither,
    relative_distance <= tol. `judged_by` says which ("data", "training data", "coefficients"). A function
    change on the training data above tol makes them different in every case (`training_data_differ`)."""
    if not (tol >= 0 and np.isfinite(tol)):
        raise InputError(f"tol must be a finite number >= 0, got {tol}")
    if normalize_of(a) != normalize_of(b):
        raise InputError(f"the models use different normalisations ({normalize_of(a)} and "
                         f"{normalize_of(b)}): their coef act on different features, so they cannot be compared")
    out: dict[str, Any] = function_distance(a, b).to_dict()
    out.update(training_data_change(a, b))
    out["tol"] = tol
    if on is not None:
        out.update(prediction_difference(a, b, on, chunk_size, progress))
        out["judged_by"], rel = "data", out["relative_rms_difference"]
    elif out["function_change"] is not None:
        out["judged_by"], rel = "training data", out["function_change"]
    else:
        out["judged_by"], rel = "coefficients", out["relative_distance"]
    # the verdict never contradicts the function change it reports: functions whose outputs differ beyond tol on
    # the training data are different, whatever the data given did not excite
    out["training_data_differ"] = bool(out["function_change"] is not None and not out["function_change"] <= tol)
    out["same"] = bool(rel <= tol and not out["training_data_differ"])
    return out
