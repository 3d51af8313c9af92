"""Which fit and which head export to run: the library side of `mhla fit` and `mhla export-heads`.

`fit` is least squares (Algorithm 1) by default, a factorised fit with `heads` heads, or a
nuclear-norm fit with weight `nuclear`; "auto" chooses H or the weight by K-fold cross-validation
over per-fold statistics. `export_heads` is the SVD of W (optionally truncated), the spectrum's
outliers (`max_heads="auto"`), or the fewest heads computing the same function (`fewest=True`).
"""

from __future__ import annotations

from typing import Any

from ..model import heads as heads_mod
from ..solve import lowrank
from ..solve import ridge_cv
from ..model import scores
from ..solve import certificate, domains, lstsq
from ..solve import spectrum
from ..errors import InputError
from ..model.heads import Heads
from ..model.model import Model
from ..statistics.stream import Features


def fit(feats: Features, ridge: float | str = 0.0, heads: int | str | None = None,
        nuclear: float | str | None = None, weight_decay: float = 0.0, restarts: int = 10, seed: int = 0,
        folds: list[Features] | None = None, device: str | None = None) -> Model:
    """Fit a model from the statistics `feats`.

    heads=H (or "auto") and nuclear=LAMBDA (or "auto") select the low-rank fits (mhla_cli.solve.lowrank);
    ridge="auto" the least-squares ridge by cross-validation (mhla_cli.solve.ridge_cv, info["ridge_cv"]);
    "auto" needs `folds`, the statistics of K disjoint parts of the data (mhla_cli.statistics.folds). The model
    records the normalisation of the statistics. `device` (mhla_cli.linalg.device): where the least-squares
    factorization runs (the low-rank fits run on the CPU).
    """
    if ridge == "auto" and (heads is not None or nuclear is not None):
        raise InputError("the ridge penalty applies to the least-squares fit; the low-rank fits take "
                         "weight_decay")
    if heads is None and nuclear is None:
        cv = None
        if ridge == "auto":
            if not folds:
                raise InputError("ridge 'auto' needs per-fold statistics (cross-validation folds)")
            cv = ridge_cv.cv_ridge(feats, folds)
            ridge = cv["chosen"]
        model = lstsq.fit(feats, ridge=float(ridge), device=device)
        if cv is not None:
            model.info["ridge_cv"] = cv
        if not model.info["identifiable"]:
            # the data may still determine the function on the inputs they span (`fit_warnings` says so);
            # when their tokens and last tokens span R^d the observed domain is the full one
            B, C = domains.observed_bases(feats)
            model.info["identifiable_observed"] = (min(B.shape[1], C.shape[1]) < feats.d
                                                   and certificate.certify(feats, domain="observed", device=device).identifiable)
    else:
        if ridge > 0:
            raise InputError("the ridge penalty applies to the least-squares fit; the low-rank fits take "
                             "weight_decay")
        model = lowrank.fit_model(feats, heads=heads, nuclear=nuclear, weight_decay=weight_decay,
                                  restarts=restarts, seed=seed, folds=folds)
    model.info["normalize"] = feats.normalize
    model.info["train_r2"] = scores.train_r2(feats, model.info["train_mse"])
    return model


def fit_warnings(info: dict[str, Any], ridge_name: str = "a ridge penalty") -> list[str]:
    """The warnings a fit deserves (the CLI prints them, the estimator raises them with warnings.warn).

    Low-rank fits: their solver records; least squares: data that do not determine the function
    (the minimum-norm or ridge solution was returned; named when they do determine it on the observed
    domain, info["identifiable_observed"]) and an ill-conditioned solve.
    """
    if info.get("method", "lstsq") != "lstsq":
        return lowrank.solver_warnings(info)
    ridge = float(info.get("ridge", 0.0))
    if not info["identifiable"]:
        reason = (f"N = {info['n_samples']} < psi = {info['n_features']}" if info["n_samples"] < info["n_features"]
                  else "the canonical Lambda~ is singular")
        text = (f"the data do not determine the function ({reason}): this is the "
                + ("ridge-regularised" if ridge > 0 else "minimum-norm") + " solution")
        if info.get("identifiable_observed"):
            # every least-squares solution gives the same outputs on the observed domain
            return [text + "; they do determine it on the observed domain (inputs whose tokens lie in the span of "
                    "the data's tokens and whose last token lies in that of their last tokens; `mhla certify "
                    "--domain observed`): " + (f"without {ridge_name}, its predictions there would be exact (those "
                                               "of every least-squares fit)" if ridge > 0 else
                                               "its predictions there are exact (those of every least-squares "
                                               "fit); elsewhere the minimum norm picks one of many")]
        return [text + "; see `mhla certify`"]
    if info["condition_number"] > ILL_CONDITIONED:
        return [f"ill-conditioned solve (condition number {info['condition_number']:.4g})"
                + ("" if ridge > 0 else f"; consider {ridge_name}")]
    return []


# A least-squares solve whose condition number exceeds this is reported as ill-conditioned.
ILL_CONDITIONED = 1e10


def export_heads(model: Model, tol: float = 1e-12, max_heads: int | str | None = None,
                 fewest: bool = False) -> Heads:
    """Heads computing `model`'s function (or its strongest part).

    Default: the SVD of W, dropping singular values <= tol * s_max and keeping at most `max_heads`
    heads; max_heads="auto": the heads that stand out of the spectrum's noise; fewest=True: the fewest
    heads that compute the same function (verified to 1e-8; `info` says whether the count is proven).
    """
    if fewest and max_heads is not None:
        raise InputError("fewest and max_heads cannot be combined")
    if fewest:
        heads = lowrank.fewest_heads(model.coef)
    elif max_heads == "auto":
        heads = spectrum.outlier_heads(model)
    else:
        heads = heads_mod.export_heads(model, tol=tol, max_heads=max_heads)
    heads.info["normalize"] = model.info.get("normalize", "none")
    return heads
