"""A scikit-learn-style estimator over the library: `MHLA().fit(sequences, targets).predict(...)`.

No scikit-learn dependency; the estimator follows its conventions (constructor parameters only,
`get_params` / `set_params`, fitted attributes with a trailing underscore, `score` = R^2) and its
protocol (`__sklearn_tags__`, `n_features_in_`), so that scikit-learn's `clone`, `cross_val_score`,
`GridSearchCV` and `Pipeline` (as the last step) take it, with sequences given as a list of (n_i, d)
arrays or an (N, n, d) array (what they slice); it pickles.
The statistics are sums over samples, so `partial_fit` on chunks equals one `fit` on all of
them: each chunk is featurized in the whitening of its own tokens, and the sum of the chunks is
changed exactly to the whitening of all the tokens seen (mhla_cli.statistics.algebra.add_into; each change is
well conditioned whatever the first chunk holds), where the canonical certificate and the fit are
computed (`fit` is a reset and one `partial_fit`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np

from . import learn
from ..model import scores
from ..io.formats import value_text
from ..errors import InputError
from ..feature_map import check_normalize
from ..model.forward import predict as forward_predict
from ..model.forward import predict_samples
from ..samples import CAUSAL, ReadSpec, Samples, check_attention, samples_of
from ..model.model import Model, token_dim
from ..solve.certificate import Certificate
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.accumulate import chunk_features
from mhla_cli.numerics import MAX_EXACT_INT

_PARAMS = ("ridge", "heads", "nuclear", "domain", "normalize", "per_position", "weight_decay", "restarts", "seed",
           "min_eig", "cv", "device", "attention", "bias_terms")


def _as_tokens(sequences: Any, offsets: Any = None, what: str = "sequences") -> tuple[np.ndarray, np.ndarray]:
    """(tokens (T, d) float64, offsets (N+1,) int64) from a list of (n_i, d) arrays, an (N, n, d)
    array, or tokens (T, d) with offsets."""
    if isinstance(sequences, (list, tuple)):
        if offsets is not None:
            raise InputError(f"offsets= is only for {what} given as one (T, d) tokens array, not a list")
        if not sequences:
            raise InputError(f"{what}: the list is empty")
        arrs = [_real(s, f"{what}[{i}]") for i, s in enumerate(sequences)]
        for i, a in enumerate(arrs):
            if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
                raise InputError(f"{what}[{i}] has shape {a.shape}, expected (n_i, d) with n_i >= 1 and d >= 1")
        d = arrs[0].shape[1]
        bad = next((i for i, a in enumerate(arrs) if a.shape[1] != d), None)
        if bad is not None:
            raise InputError(f"{what}[{bad}] has d = {arrs[bad].shape[1]} but {what}[0] has d = {d}")
        tokens = np.concatenate(arrs, axis=0)
        off = np.concatenate([[0], np.cumsum([a.shape[0] for a in arrs])]).astype(np.int64)
    else:
        tokens = _real(sequences, what)
        if tokens.ndim == 3:
            if offsets is not None:
                raise InputError(f"offsets= is only for {what} of shape (T, d), got shape {tokens.shape}")
            N, n, d = tokens.shape
            if N < 1 or n < 1 or d < 1:
                raise InputError(f"{what} has shape {tokens.shape}: need N >= 1 sequences of n >= 1 tokens, d >= 1")
            off = np.arange(N + 1, dtype=np.int64) * n
            tokens = tokens.reshape(N * n, d)
        elif tokens.ndim == 2:
            if offsets is None:
                raise InputError(f"{what} of shape (T, d) = {tokens.shape} need offsets= (N+1,) marking the "
                                 "sequences (or pass a list of (n_i, d) arrays, or an (N, n, d) array)")
            off = np.asarray(offsets)
            if off.ndim != 1 or off.size < 2 or not np.issubdtype(off.dtype, np.integer):
                raise InputError(f"offsets must be integers of shape (N+1,) with N >= 1, got {off.dtype} {off.shape}")
            off = off.astype(np.int64)
            if off[0] != 0 or off[-1] != tokens.shape[0] or (np.diff(off) < 1).any():
                raise InputError(f"offsets must start at 0, end at T = {tokens.shape[0]} and increase strictly "
                                 "(every sequence has at least one token)")
            if tokens.shape[1] < 1:
                raise InputError(f"{what} has shape {tokens.shape}: d must be >= 1")
        else:
            raise InputError(f"{what} has shape {tokens.shape}: expected a list of (n_i, d) arrays, an (N, n, d) "
                             "array, or (T, d) tokens with offsets=")
    if not np.isfinite(tokens).all():
        raise InputError(f"{what} contain NaN or Inf")
    return tokens, off


def _check_normal_weights(w: np.ndarray) -> None:
    """Positive weights below float64's smallest normal number are refused (io.tokens.check_weights)."""
    from ..io.tokens import MIN_WEIGHT

    tiny = (w > 0) & (w < MIN_WEIGHT)
    if tiny.any():
        raise InputError(f"sample_weight {float(w[tiny][0]):.3g} is below float64's smallest normal number "
                         f"{MIN_WEIGHT:.3g} (its products in the sums would lose their digits); weights carry no "
                         "units: multiply them all by the same factor")


def _real(a: Any, what: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)
                                   or arr.dtype == np.bool_):
        raise InputError(f"{what} must be real numbers (an array of floats or integers), got dtype {arr.dtype}")
    if arr.dtype.kind in "iu" and arr.size and (int(arr.max()) > MAX_EXACT_INT or int(arr.min()) < -MAX_EXACT_INT):
        raise InputError(f"{what} hold {arr.dtype} values beyond 2^53 = {MAX_EXACT_INT}: float64 cannot hold them "
                         "exactly (pass float64, or rescale)")
    return arr.astype(np.float64)


def _as_targets(targets: Any, n_rows: int, d: int | None, per_position: bool) -> np.ndarray:
    """Targets (rows, d) float64: one row per sequence, or per token with per_position; d None: of any width
    D_out >= 1 (a first chunk: its width is then the model's output width)."""
    unit = "token (per_position=True)" if per_position else "sequence"
    if isinstance(targets, (list, tuple)) and targets and np.ndim(targets[0]) == 2:
        y = np.concatenate([_real(t, f"targets[{i}]") for i, t in enumerate(targets)], axis=0)
    else:
        y = _real(targets, "targets")
    if y.ndim == 3:
        y = y.reshape(-1, y.shape[-1])
    if y.ndim != 2 or y.shape[0] != n_rows or y.shape[1] < 1 or (d is not None and y.shape[1] != d):
        want = "D_out" if d is None else d
        raise InputError(f"targets have shape {y.shape}, expected ({n_rows}, {want}): one {want}-vector per {unit}")
    if not np.isfinite(y).all():
        raise InputError("targets contain NaN or Inf")
    return y


class MHLA:
    """Single-layer multi-head linear attention learned exactly (Algorithm 1), scikit-learn style.

    Parameters: `ridge` (least-squares penalty, as `mhla fit --ridge`, or "auto" by cross-validation),
    `heads` (H: a factorised fit with H heads, or "auto" by cross-validation), `nuclear` (LAMBDA: a nuclear-norm fit, or "auto"),
    `domain` ("full" or "observed": the certificate's domain), `normalize` ("none" or "length"),
    `per_position` (targets per token: every position is a sample), `attention` (how per-position samples
    read the window, mhla_cli.samples: "causal", the default, S of the prefix X[:t]; "bidirectional", S of
    the whole window, an encoder's positions), `weight_decay`, `restarts`, `seed`
    (factorised fit), `min_eig` (certificate threshold), `cv` (folds for "auto": sample i of the
    data goes to fold i mod cv, counted across `partial_fit` calls), `device` ("cpu": numpy, the
    default; "cuda", "cuda:I" or "torch:cpu": the features, the factorization and the last-token
    predictions through torch there, float64; mhla_cli.linalg.device), `bias_terms` (the terms a head's
    biases add, docs/bias_terms.md: the MHLA of the tokens (x, 1); `coef_` and `W_` are then of those tokens).

    Fitted attributes: `coef_` (d, psi), `W_` (d^2, d^2), `heads_` (Heads), `certificate_`
    (Certificate), `n_samples_`, `n_features_in_` (d), `features_` (the summed Features, in the
    whitening of all the tokens seen), `model_` (Model, with `info`).
    """

    # the parameters (_PARAMS), set by __init__ and set_params
    ridge: float | str
    heads: int | str | None
    nuclear: float | str | None
    domain: str
    normalize: str
    per_position: bool
    weight_decay: float
    restarts: int
    seed: int
    min_eig: float
    cv: int
    device: str
    attention: str | Samples
    bias_terms: bool

    def __init__(self, ridge: float = 0.0, heads: int | str | None = None, nuclear: float | str | None = None,
                 domain: str = "full", normalize: str = "none", per_position: bool = False,
                 weight_decay: float = 0.0, restarts: int = 10, seed: int = 0, min_eig: float = 0.0,
                 cv: int = 5, device: str = "cpu", attention: str | Samples = CAUSAL.name,
                 bias_terms: bool = False) -> None:
        given = locals()
        for name in _PARAMS:  # scikit-learn's convention: every parameter stored as given, under its name
            setattr(self, name, given[name])

    # ------------------------------------------------------------------ parameters
    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The constructor parameters (`deep` is accepted for scikit-learn compatibility)."""
        return {k: getattr(self, k) for k in _PARAMS}

    def set_params(self, **params: Any) -> MHLA:
        """Set constructor parameters; unknown names raise ValueError. Returns self."""
        unknown = sorted(set(params) - set(_PARAMS))
        if unknown:
            raise ValueError(f"unknown parameter(s) {', '.join(unknown)} for MHLA; valid: {', '.join(_PARAMS)}")
        for k, v in params.items():
            setattr(self, k, v)
        return self

    def __repr__(self) -> str:
        defaults = MHLA().get_params()
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items() if v != defaults[k])
        return f"MHLA({args})"

    # ------------------------------------------------------------------ fitting
    def _check_params(self) -> None:
        if self.heads is not None and self.nuclear is not None:
            raise InputError("give at most one of heads= and nuclear=")
        if self.heads is not None and self.heads != "auto" and (
                isinstance(self.heads, bool) or not isinstance(self.heads, (int, np.integer)) or self.heads < 1):
            raise InputError(f"heads must be an integer >= 1, 'auto' or None, got {value_text(self.heads)}")
        if self.nuclear is not None and self.nuclear != "auto" and (
                isinstance(self.nuclear, (bool, str)) or not np.isfinite(self.nuclear) or self.nuclear < 0):
            raise InputError(f"nuclear must be a finite number >= 0, 'auto' or None, got {value_text(self.nuclear)}")
        if (self.heads is not None or self.nuclear is not None) and self.ridge:
            raise InputError("ridge applies to the least-squares fit; with heads= use weight_decay=")
        if self.ridge != "auto" and (isinstance(self.ridge, (bool, str)) or not np.isfinite(self.ridge)
                                     or self.ridge < 0):
            raise InputError(f"ridge must be a finite number >= 0 or 'auto', got {value_text(self.ridge)}")
        if self.domain not in ("full", "observed"):
            raise InputError(f"unknown domain {value_text(self.domain)}, expected 'full' or 'observed'")
        check_normalize(self.normalize)
        check_attention(self.attention)
        self._samples  # noqa: B018  (a per-position layout without per_position=True is refused)
        if self._auto and (isinstance(self.cv, bool) or not isinstance(self.cv, (int, np.integer)) or self.cv < 2):
            raise InputError(f"cv must be an integer >= 2 (folds for 'auto'), got {value_text(self.cv)}")

    @property
    def _samples(self) -> Samples:
        """The sample layout of the parameters (mhla_cli.samples)."""
        return samples_of(bool(self.per_position), self.attention)

    @property
    def _read(self) -> ReadSpec:
        """The parameters normalize, per_position, attention and bias_terms as one read specification."""
        return ReadSpec(self._samples, self.normalize, bool(self.bias_terms))

    @property
    def _auto(self) -> bool:
        return any(isinstance(v, str) and v == "auto" for v in (self.heads, self.nuclear, self.ridge))

    def _reset(self) -> None:
        for k in ("coef_", "W_", "heads_", "certificate_", "n_samples_", "n_features_in_", "features_", "model_"):
            self.__dict__.pop(k, None)
        self._folds: list[Features | None] | None = None  # per CV fold (None: no sample in it yet)
        self._total: Features | None = None  # the sums of all chunks seen
        self._config: tuple[Any, ...] | None = None
        self._n_seen = 0

    def fit(self, sequences: Any, targets: Any, offsets: Any = None, sample_weight: Any = None) -> MHLA:
        """Fit on all the data (a reset, then one `partial_fit`). Returns self.

        sequences: a list of (n_i, d) arrays, an (N, n, d) array, or tokens (T, d) with offsets= (N+1,).
        targets: (N, d) (one per sequence), or with per_position=True one per token ((T, d), (N, n, d)
        or a list of (n_i, d)). sample_weight: (N,) (or (T,) per token), >= 0.
        """
        self._reset()
        return self.partial_fit(sequences, targets, offsets=offsets, sample_weight=sample_weight)

    def partial_fit(self, sequences: Any, targets: Any, offsets: Any = None, sample_weight: Any = None) -> MHLA:
        """Add a chunk of data to the statistics and refit on everything seen so far. Returns self.

        Several chunks give the same fit as one `fit` on their concatenation, to rounding, whatever the
        first chunk holds (the statistics are sums: each chunk is featurized in the whitening of its own
        tokens and the running sum is changed exactly into the whitening of all the tokens seen).
        Changing normalize, per_position, attention, heads/nuclear 'auto' or cv between chunks is refused:
        call `fit` to start over.
        """
        self._check_params()
        if getattr(self, "_total", None) is None:
            self._reset()
        config = (self.normalize, self._samples, self._auto, self.cv if self._auto else None, bool(self.bias_terms))
        if self._config is not None and config != self._config:
            raise InputError("normalize, per_position, attention, bias_terms, 'auto' or cv changed since the first "
                             "chunk: call fit() to start over")
        tokens, off = _as_tokens(sequences, offsets)
        d = tokens.shape[1]
        seen = getattr(self, "features_", None)
        if seen is not None and d != seen.d - int(seen.bias_terms):
            raise InputError(f"this chunk has d = {d} but the earlier chunks have d = {seen.d - int(seen.bias_terms)}")
        per_pos = bool(self.per_position)
        n_rows = tokens.shape[0] if per_pos else off.size - 1
        # the targets' width: any for a first chunk, that of the earlier chunks after it
        y = _as_targets(targets, n_rows, None if seen is None else seen.n_outputs, per_pos)
        w = None
        if sample_weight is not None:
            w = _real(sample_weight, "sample_weight").reshape(-1)
            if w.shape != (n_rows,) or not np.isfinite(w).all() or (w < 0).any():
                raise InputError(f"sample_weight must be {n_rows} finite numbers >= 0 (one per "
                                 f"{'token' if per_pos else 'sequence'}), got shape {w.shape}")
            _check_normal_weights(w)
        parts = self._featurize(tokens, off, y, w, d)
        total = self._total
        empty: list[Features | None] = [None] * int(self.cv)
        folds = None if not self._auto else list(self._folds or empty)
        for k, part in parts:  # `+` makes new objects: nothing fitted so far is changed in place
            if folds is not None:
                held = folds[k]
                folds[k] = part if held is None else held + part
            total = part if total is None else total + part
        if total is None or total.n_samples == 0:
            raise InputError("every sample weight is 0: there is no sample to learn from")
        self._solve(total, folds)
        # committed only once the solve succeeded (a refused chunk leaves the estimator as it was)
        self._folds, self._config, self._total = folds, config, total
        self._n_seen += off.size - 1
        return self

    def _featurize(self, tokens: np.ndarray, off: np.ndarray, y: np.ndarray, w: np.ndarray | None, d: int
                   ) -> list[tuple[int, Features]]:
        """Features of the chunk, each part in its own whitening (one part; with 'auto', one part per CV
        fold: sequence i of all those seen -> fold i mod cv)."""
        kw: dict[str, Any] = {"read": self._read, "basis": "auto", "device": self.device}
        if not self._auto:
            return [(0, chunk_features(tokens, off, y, d, weights=w, **kw))]
        K = int(self.cv)
        B = off.size - 1
        fold = (self._n_seen + np.arange(B)) % K
        lengths = np.diff(off)
        out = []
        for k in range(K):
            seqs = np.flatnonzero(fold == k)
            if not seqs.size:
                continue
            rows = np.concatenate([np.arange(off[i], off[i + 1]) for i in seqs])
            sub_off = np.concatenate([[0], np.cumsum(lengths[seqs])]).astype(np.int64)
            idx = rows if self.per_position else seqs
            out.append((k, chunk_features(tokens[rows], sub_off, y[idx], d,
                                          weights=None if w is None else w[idx], **kw)))
        return out

    def _solve(self, total: Features, fold_feats: list[Features | None] | None) -> None:
        feats = total.canonical()
        folds = None
        if self._auto:
            folds = [f for f in (fold_feats or []) if f is not None and f.n_samples > 0]
            if len(folds) < 2:
                raise InputError(f"'auto' needs at least 2 non-empty cross-validation folds; the data have "
                                 f"{len(folds)} (give more sequences, or a fixed heads= / nuclear=)")
        # the same dispatch as `mhla fit` (mhla_cli.api.learn)
        ridge = self.ridge if isinstance(self.ridge, str) else float(self.ridge)
        model = learn.fit(feats, ridge=ridge, heads=self.heads, nuclear=self.nuclear,
                          weight_decay=float(self.weight_decay), restarts=int(self.restarts), seed=int(self.seed),
                          folds=folds, device=self.device)
        for message in learn.fit_warnings(model.info):
            warnings.warn(message, UserWarning, stacklevel=3)
        heads = learn.export_heads(model)
        self.features_ = feats
        self.model_ = model
        self.coef_ = model.coef
        self.W_ = model.W
        self.heads_ = heads
        self.certificate_: Certificate = learn.certify(feats, min_eig=float(self.min_eig), domain=self.domain,
                                                      device=self.device)
        self.n_samples_ = int(feats.n_samples)
        self.n_features_in_ = int(feats.d) - int(feats.bias_terms)  # scikit-learn's name: the token dimension d

    # ------------------------------------------------------------------ prediction
    def _fitted(self) -> Model:
        model: Model | None = getattr(self, "model_", None)
        if model is None:
            raise InputError("this MHLA is not fitted yet: call fit() or partial_fit() first")
        return model

    def predict(self, sequences: Any, offsets: Any = None) -> np.ndarray:
        """Last-token outputs (N, d); with per_position=True the output at every token (T, d): the
        last-token output of its prefix (attention="causal"), or the output there with the whole
        window's S (attention="bidirectional")."""
        model = self._fitted()
        tokens, off = _as_tokens(sequences, offsets)
        if tokens.shape[1] != token_dim(model):
            raise InputError(f"the sequences have d = {tokens.shape[1]} but the model has d = {token_dim(model)}")
        if self.per_position:
            return predict_samples(model, tokens, off, self._samples)
        return forward_predict(model, tokens, off, device=self.device)  # type: ignore[return-value]  # no layout: the last-token outputs

    def score(self, sequences: Any, targets: Any, offsets: Any = None, sample_weight: Any = None) -> float:
        """Coefficient of determination R^2 = 1 - SSE / SST over all d outputs, SST about the targets'
        weighted mean vector (mhla_cli.model.scores: `mhla predict`'s and `mhla fit`'s R^2; scikit-learn's
        r2_score with multioutput="variance_weighted"). Targets that do not vary score 1 when
        predicted exactly, else 0 (as scikit-learn's r2_score)."""
        pred = self.predict(sequences, offsets)
        y = _as_targets(targets, pred.shape[0], pred.shape[1], bool(self.per_position))
        w = None if sample_weight is None else _real(sample_weight, "sample_weight").reshape(-1)
        if w is not None and (w.shape != (y.shape[0],) or not np.isfinite(w).all() or (w < 0).any()):
            raise InputError(f"sample_weight must be {y.shape[0]} finite numbers >= 0, got shape {w.shape}")
        if w is not None:
            _check_normal_weights(w)
        r2 = scores.r2_of(pred, y, w)
        if r2 is None:
            return 1.0 if np.array_equal(pred, y) else 0.0
        return r2

    # ------------------------------------------------------------------ scikit-learn protocol
    def __sklearn_tags__(self) -> Any:
        """scikit-learn's estimator tags (a multi-output regressor on sequences: lists of (n_i, d) arrays
        or (N, n, d) arrays); sklearn.utils.Tags when scikit-learn is importable, else the same as a dict.
        mhla does not import scikit-learn otherwise. With these tags scikit-learn's `clone`,
        `cross_val_score`, `GridSearchCV` and `Pipeline` (as the last step) take `MHLA`, and it pickles
        (`pip install -e ".[sklearn]"` for those tools)."""
        fields = {"estimator_type": "regressor", "requires_fit": True, "non_deterministic": False}
        target = {"required": True, "two_d_labels": True, "multi_output": True, "single_output": False}
        inputs = {"two_d_array": False, "three_d_array": True}
        try:
            from sklearn.utils import InputTags, RegressorTags, Tags, TargetTags
        except ImportError:
            return {**fields, "target_tags": target, "input_tags": inputs, "regressor_tags": {}}
        return Tags(**fields, target_tags=TargetTags(**target), input_tags=InputTags(**inputs),
                    regressor_tags=RegressorTags())

    def __sklearn_is_fitted__(self) -> bool:
        return getattr(self, "model_", None) is not None

    def __getstate__(self) -> dict[str, Any]:
        """For pickle: the certificate's null vectors computed now (they were computed on first use)."""
        state = self.__dict__.copy()
        cert = state.get("certificate_")
        if cert is not None and cert._null_fn is not None:
            null = cert.null_vectors
            cert = dataclasses.replace(cert, _null_fn=None, _null=null)
            state["certificate_"] = cert
        return state

    def to_torch(self, dtype: Any = None) -> Any:
        """The fitted heads as a torch.nn.Module (see `Heads.to_torch`)."""
        self._fitted()
        return self.heads_.to_torch(dtype)


__all__ = ["MHLA"]
