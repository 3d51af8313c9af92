"""Low-rank MHLA: the fewest heads computing a function, and low-rank fits from few samples.

Notation: A is the linear map W -> p (heads.p_from_W); its kernel is the part of W antisymmetric in
(j, k), so {W : A(W) = p} is an affine set and every W in it computes the same function. A rank-H
W = sum_h vec(V_h) vec(Q_h)^T is an H-head MHLA. Weight decay (||V||^2 + ||Q||^2) / 2 on the factors
equals ||W||_* at the balanced optimum, so the nuclear-norm fit is the convex relaxation of the
factorised one. Losses use the statistics only: sum_i ||p H_i - y_i||^2 = tr(p G p^T) - 2 tr(p M) +
tr(T) with G = gram, M = moments, T = target_gram.

The package, by job:

- `affine`: the map A, its adjoint, the projection onto {W : A(W) = p}, the minimum-nuclear-norm W;
- `losses`: the losses on the statistics;
- `factorised`: the fit of H heads by ALS then Levenberg-Marquardt;
- `nuclear`: the nuclear-norm fit (FISTA with singular-value thresholding);
- `cv`: H or LAMBDA by K-fold cross-validation;
- `fewest`: the fewest heads computing a p, a proven lower bound;
- `result`: the result of a factorised or nuclear-norm fit;
- `_params`: heads <-> parameters, p(V, Q) and its Jacobians;
- `_gauss_newton`: the Gauss-Newton normal equations and their damped solve;
- `_whitened`: the statistics of the whitened tokens, in which the fits run;
- `_solver`: the record every iterative solver returns, and its warning texts;
- `_numerics`: one BLAS thread for small solves (EPS lives in mhla_cli.numerics).
"""

from __future__ import annotations


# The package's public API: the names callers outside the package use, each defined in one of its modules;
# the private helpers stay in their modules (import them from there).
from ...errors import InputError
from ...model.model import Model
from ...statistics.basis import feature_scale
from ...statistics.features import Features
from ..lstsq import fit
from ._solver import convergence_warning, hit_limit, solver_warnings
from ._whitened import to_tokens, whitened
from .affine import min_nuclear_W, nuclear_norm, p_adjoint, project_affine
from .cv import cv_heads, cv_nuclear
from .factorised import fit_factorised
from .fewest import fewest_heads, fewest_message, generic_rank, head_lower_bound, polish_heads
from .losses import _need_targets, mse
from .nuclear import fit_nuclear, nuclear_lambda_max

__all__ = [
    "convergence_warning", "cv_heads", "cv_nuclear", "fewest_heads", "fewest_message", "fit_factorised", "fit_model",
    "fit_nuclear", "generic_rank", "head_lower_bound", "hit_limit", "min_nuclear_W", "mse", "nuclear_lambda_max",
    "nuclear_norm", "p_adjoint", "polish_heads", "project_affine", "solver_warnings",
]


def fit_model(feats: Features, heads: int | str | None = None, nuclear: float | str | None = None,
              weight_decay: float = 0.0, restarts: int = 10, seed: int = 0,
              folds: list[Features] | None = None) -> Model:
    """A factorised (`heads`) or nuclear-norm (`nuclear`) fit as a model.Model; 'auto' picks by K-fold CV.

    The fits run on the statistics of the whitened tokens X A (A the canonical basis of the least-squares
    fit; `_whitened`), so that they do not inherit the conditioning of the tokens' units, and the model
    keeps A, its canonical coefficients, the data's Lambda~ and the fit's W on X A (`W_b`; export-heads
    recovers the heads from it). Its W on the tokens has rank <= H for the factorised fit, up to rounding;
    info carries the base least-squares diagnostics plus the fit's own.
    """
    _need_targets(feats)
    if (heads is None) == (nuclear is None):
        raise InputError("give exactly one of heads and nuclear")
    if "auto" in (heads, nuclear) and not folds:
        raise InputError("'auto' needs per-fold statistics: pass folds, the statistics of K disjoint parts "
                         "of the data (mhla_cli.statistics.folds)")
    base = fit(feats)
    A = base.basis
    assert A is not None  # a least-squares fit has its basis
    wfeats = whitened(feats, A)
    wfolds = None if not folds else [whitened(f.copy(), A) for f in folds]
    info = dict(base.info)
    cv = None
    if heads is not None:
        if heads == "auto":
            cv = cv_heads(wfeats, wfolds, weight_decay=weight_decay, restarts=min(restarts, 2), seed=seed)
            heads = cv["chosen"]
        res = fit_factorised(wfeats, int(heads), weight_decay=weight_decay, restarts=restarts, seed=seed,
                             init_coef=base.coef_b * feature_scale(feats.d)[None, :])
    else:
        if nuclear == "auto":
            cv = cv_nuclear(wfeats, wfolds)
            nuclear = cv["chosen"]
        assert nuclear is not None  # exactly one of heads and nuclear
        res = fit_nuclear(wfeats, float(nuclear))
        res.info["n_heads"] = res.info["rank"]
    info.update(res.info)
    info["ridge"] = 0.0
    info["mse_resolution"] = base.info.get("mse_resolution")
    info["lstsq_train_mse"] = base.info["train_mse"]
    info["basis"] = "canonical"
    if cv is not None:
        info["cv"] = cv
        assert folds is not None  # a cv needs them
        info["n_folds"] = len(folds)
    coef, W, coef_b = to_tokens(res.coef, res.W, A)
    return Model(coef=coef, W=W, d=feats.d, info=info, coef_b=coef_b, basis=A, gram_pairs=base.gram_pairs,
                 gram_spans=base.gram_spans, W_b=res.W)
