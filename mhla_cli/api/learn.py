"""Which certificate, fit and head export to run: the library side of `mhla certify`, `fit` and `export-heads`.

`certify` and `fit` are the one entry point of each verb: they take statistics of any storage (a `Features` record,
dense or pairs; statistics tiled on a Dask cluster; a features file, a Zarr store or a tokens file, with `scheduler`
on a cluster), with or without the affine block of the wide tokens, or the joint statistics of a sum of blocks
(`BlockStatistics`), and pick the solver (mhla_cli.solve.certificate, mhla_cli.solve.affine_block,
mhla_cli.solve.cluster, mhla_cli.solve.lstsq, mhla_cli.solve.lowrank, mhla_cli.solve.blocks).

`fit` is least squares (Algorithm 1) by default, a factorised fit with `heads` heads, or a
nuclear-norm fit with weight `nuclear`; "auto" chooses H or the weight by K-fold cross-validation
over per-fold statistics. `export_heads` is the SVD of W (optionally truncated), the spectrum's
outliers (`max_heads="auto"`), or the fewest heads computing the same function (`fewest=True`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from typing import Any, Union, overload

import numpy as np

from mhla_cli.io import formats
from mhla_cli.io.tokens import inspect_tokens
from mhla_cli.model import canonical
from mhla_cli.model import heads as heads_mod
from mhla_cli.solve import lowrank
from mhla_cli.solve import ridge_cv
from mhla_cli.model import scores
from mhla_cli.solve import affine_block, certificate, cluster, domains, lstsq
from mhla_cli.solve.blocks import BlockStatistics, certify_blocks, fit_blocks
from mhla_cli.model.heads_sum import HeadsSum
from mhla_cli.solve import spectrum
from mhla_cli.errors import REMEDY_WORDS, InputError
from mhla_cli.numerics import TARGET_SQUARES_FLOOR
from mhla_cli.bias_terms import token_mean
from mhla_cli.model.heads import Heads
from mhla_cli.statistics.basis import feature_scale
from mhla_cli.model.model import Model, affine_of
from mhla_cli.samples import ReadSpec, layout_info
from mhla_cli.statistics.folds import load_folds
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.stream import check_solve_memory, data_kind, load_features
from mhla_cli.statistics.distributed.tiled_statistics import TiledStatistics
from mhla_cli.statistics.files.store_location import is_store


class RequestError(InputError):
    """A request `fit` or `export_heads` refuses before any work; `rule` names the rule it breaks
    (`RULES`), so that a caller can word it in its own options (the CLI in its flags)."""

    def __init__(self, rule: str, path: str | os.PathLike | None = None) -> None:
        super().__init__(RULES[rule], path)
        self.rule = rule


# The rules of a fit / export request, in the library's words (keyword names).
RULES = {
    "ridge_with_lowrank": "the ridge penalty applies to the least-squares fit; the low-rank fits take weight_decay",
    "auto_without_folds": "has no per-fold statistics, which 'auto' needs (write them with featurize_folds and "
                          "save_with_folds, or fit the tokens file directly)",
    "auto_with_normalize": "'auto' with a normalisation: featurize the folds with it first (featurize_folds(..., "
                           "normalize=...)), then fit those statistics",
    "fewest_with_max_heads": "fewest and max_heads cannot be combined",
    "affine_least_squares": "the affine block of the wide tokens is fitted by least squares (a given ridge or "
                            "'auto'; no heads or nuclear)",
    "lowrank_width": "the low-rank fits (heads, nuclear) need targets as wide as the tokens; fit targets of another "
                     "width by least squares (any ridge, or 'auto')",
    "fewest_width": "fewest needs a model whose outputs are as wide as its tokens; export the heads of a model of "
                    "another output width by the SVD of W (tol, max_heads)",
    "affine_domain": "the certificate of the affine block of the wide tokens is of the full domain: certify without "
                     "a domain",
    "blocks_least_squares": "a sum of blocks is fitted by least squares over the blocks' joint features (a given "
                            "ridge or 'auto'; no heads, nuclear or folds: its statistics hold their own folds)",
    "blocks_in_memory": "the joint statistics of a sum of blocks are certified and fitted in memory on the CPU, on "
                        "the full domain (no scheduler, device, domain, read, chunk_size or affine_from: they were "
                        "given to block_statistics)",
}


Statistics = Union[Features, TiledStatistics, BlockStatistics, str, os.PathLike]  # what `certify` and `fit` take


def certify(data: Statistics, min_eig: float = 0.0, domain: str | domains.Domain = "full", device: str | None = None,
            scheduler: Any = None, *, read: ReadSpec | None = None, chunk_size: int | None = None,
            affine_from: str | os.PathLike | None = None) -> certificate.Certificate:
    """Certify that the data determine the learned function (Lemma 2.3): the one `certify` of every storage.

    `data`: statistics in memory (a `Features` record, dense or pairs; with the affine block of the wide tokens its
    extended features are certified, mhla_cli.solve.affine_block, on the full domain), statistics tiled on a cluster
    (mhla_cli.statistics.distributed.tiled_statistics.TiledStatistics), or a file: a features file or a tokens file
    (read as `read` says, mhla_cli.samples.ReadSpec, in chunks of `chunk_size`, with the wide tokens
    `affine_from`), or, with `scheduler` (a Dask scheduler address, "local[:K]" or a dask.distributed Client), a
    tokens file or a Zarr features store whose Gram is tiled on the cluster's workers (mhla_cli.solve.cluster;
    docs/cluster.md): the verdict is then a Cholesky over the tiles, lambda_min and lambda_max Lanczos estimates,
    `rank` None unless identifiable and `tasks` the tasks submitted.

    The eigenvalues are those of the canonical Lambda~ (mhla_cli.solve.certificate.certify_features: unit-free);
    `domain`: "full", "observed" or a mhla_cli.solve.domains.Domain; `device`: where the factorization runs
    (mhla_cli.linalg.device). Returns a `Certificate`: `identifiable`, `lambda_min`, `lambda_max`, `rank`,
    `reasons`, `to_dict()`; `min_eig` is in the units of lambda_min.

    The joint statistics of a sum of blocks (mhla_cli.solve.blocks.block_statistics) are certified by the Cholesky
    of their joint Lambda~ (mhla_cli.solve.blocks.certify_blocks; overlapping blocks are named in `reasons`).
    """
    if min_eig < 0 or not np.isfinite(min_eig):
        raise InputError(f"min_eig must be a finite number >= 0, got {min_eig}")
    if isinstance(data, BlockStatistics):
        _check_blocks_request(domain=domain, device=device, scheduler=scheduler, read=read, chunk_size=chunk_size,
                              affine_from=affine_from)
        return certify_blocks(data, min_eig=float(min_eig))
    if scheduler is not None or isinstance(data, TiledStatistics):
        _check_tiled(data, affine_from, domain=domain, device=device)
        with _tiled(data, scheduler, read, chunk_size) as stats:
            return certificate.certify_tiled(stats, float(min_eig))
    feats = _in_memory(data, read, chunk_size, device, affine_from)
    if feats.affine is None:
        return certificate.certify_features(feats, min_eig=min_eig, domain=domain, device=device)
    if domains.get_domain(domain).name != "full":
        raise RequestError("affine_domain")
    return affine_block.certify_extended(feats, min_eig=min_eig, device=device)


def _check_blocks_request(heads: Any = None, nuclear: Any = None, folds: Any = None, domain: Any = "full",
                          **in_memory: Any) -> None:
    """What `certify` and `fit` refuse of a sum of blocks' statistics, before any work (RequestError): the
    low-rank fits and folds given apart ("blocks_least_squares"), and any option of another storage
    ("blocks_in_memory": `in_memory` all None, the domain the full one)."""
    if heads is not None or nuclear is not None or folds:
        raise RequestError("blocks_least_squares")
    if domains.get_domain(domain).name != "full" or any(v is not None for v in in_memory.values()):
        raise RequestError("blocks_in_memory")


def _check_tiled(data: Any, affine_from: Any, domain: str | domains.Domain = "full", device: str | None = None
                 ) -> None:
    """What a cluster's certificate or fit refuses before any work (mhla_cli.solve.cluster.ClusterRefused)."""
    if isinstance(data, Features):
        raise cluster.ClusterRefused("affine" if data.affine is not None else "in_memory")
    if affine_from is not None:
        raise cluster.ClusterRefused("affine", affine_from)
    if domains.get_domain(domain).name != "full":
        raise cluster.ClusterRefused("domain")
    if device is not None:
        raise cluster.ClusterRefused("device")


def _tiled(data: Any, scheduler: Any, read: ReadSpec | None, chunk_size: int | None
           ) -> contextlib.AbstractContextManager[TiledStatistics]:
    """The statistics of `data` tiled on the cluster of `scheduler`, released on exit (cluster.open_statistics)."""
    read = read or ReadSpec(normalize=None)
    return cluster.open_statistics(data, scheduler, chunk_size=chunk_size, normalize=read.normalize,
                                   attention=read.attention, bias_terms=read.bias_terms)


def _in_memory(data: Any, read: ReadSpec | None, chunk_size: int | None, device: str | None,
               affine_from: str | os.PathLike | None) -> Features:
    """`data` as statistics in memory: a Features record as it is, a file loaded (statistics.stream.load_features)."""
    if isinstance(data, Features):
        if affine_from is not None and data.affine is None:
            raise InputError("the statistics have no affine block: featurize them with the wide tokens (affine_from)")
        return data
    return load_features(data, chunk_size=chunk_size, device=device, affine_from=affine_from,
                         read=read or ReadSpec(normalize=None))


def block_maps(paths: Sequence[str | os.PathLike], data: str | os.PathLike) -> list[np.ndarray]:
    """The token maps P_b (D, d_b) of a sum of blocks over the tokens file `data`: each the token map a reduced
    file records (mhla_cli.model.reduce.load_reduction), refused (naming that file) when it takes tokens of
    another width than the data's."""
    from mhla_cli.model.reduce import load_reduction

    D = inspect_tokens(data).d
    maps = []
    for path in paths:
        P = load_reduction(path).P
        if P.shape[0] != D:
            raise InputError(f"its token map takes {P.shape[0]}-dim tokens but {data} has {D}-dim tokens: give the "
                             "reduced files of these tokens (their maps P are D x d_b)", path)
        maps.append(P)
    return maps


def needs_folds(ridge: float | str = 0.0, heads: int | str | None = None, nuclear: float | str | None = None
                ) -> bool:
    """Whether a fit chooses by cross-validation ('auto' anywhere): it needs per-fold statistics."""
    return "auto" in (ridge, heads, nuclear)


def check_fit_options(ridge: float | str = 0.0, heads: int | str | None = None,
                      nuclear: float | str | None = None) -> None:
    """The ridge penalty belongs to least squares: RequestError("ridge_with_lowrank") with heads or nuclear."""
    if (heads is not None or nuclear is not None) and (ridge == "auto" or float(ridge) > 0):
        raise RequestError("ridge_with_lowrank")


def check_fit_targets(data: str | os.PathLike) -> None:
    """A tokens file must have targets to be fitted (a features file or Zarr store is checked by `fit`)."""
    if data_kind(data) == "tokens" and not inspect_tokens(data).has_targets:
        raise InputError("has no 'targets': fit needs (X, y) pairs", data)


def check_fit_file(data: str | os.PathLike, ridge: float | str = 0.0, heads: int | str | None = None,
                   nuclear: float | str | None = None, normalize: str | None = None,
                   chunk_size: int | None = None, attention: str | None = None, bias_terms: bool = False) -> None:
    """Refuse before any work a fit of the file `data` that cannot run: the options (`check_fit_options`),
    its memory (statistics.stream.check_solve_memory), and for 'auto' the folds it needs (a features file
    without them) and a normalisation that only a featurize with folds can apply."""
    check_fit_options(ridge, heads, nuclear)
    if (heads is not None or nuclear is not None) and data_kind(data) == "tokens":
        info = inspect_tokens(data)
        if info.has_targets and info.out_dim != info.d:  # refused before any work (`_fit_in_memory` again)
            raise RequestError("lowrank_width", data)
    # 'auto': the folds' eigendecompositions need about a ridge solve's memory
    check_solve_memory(data, "fit", ridge=1.0 if ridge == "auto" else float(ridge),
                       lowrank=heads is not None or nuclear is not None, chunk_size=chunk_size,
                       read=ReadSpec(attention, normalize, bias_terms))
    if needs_folds(ridge, heads, nuclear):
        # a Zarr store holds no per-fold statistics (featurize --folds writes an HDF5 features file)
        if data_kind(data) == "features" and (is_store(data) or load_folds(data) is None):
            raise RequestError("auto_without_folds", data)
        if normalize not in (None, "none"):
            raise RequestError("auto_with_normalize")


_NotBlocks = Union[Features, TiledStatistics, str, os.PathLike]


@overload
def fit(data: BlockStatistics, ridge: float | str = ..., heads: int | str | None = ..., nuclear: float | str | None = ...,
        weight_decay: float = ..., restarts: int = ..., seed: int = ..., folds: list[Features] | None = ...,
        device: str | None = ..., scheduler: Any = ..., *, read: ReadSpec | None = ..., chunk_size: int | None = ...,
        affine_from: str | os.PathLike | None = ...) -> HeadsSum: ...
@overload
def fit(data: _NotBlocks, ridge: float | str = ..., heads: int | str | None = ..., nuclear: float | str | None = ...,
        weight_decay: float = ..., restarts: int = ..., seed: int = ..., folds: list[Features] | None = ...,
        device: str | None = ..., scheduler: Any = ..., *, read: ReadSpec | None = ..., chunk_size: int | None = ...,
        affine_from: str | os.PathLike | None = ...) -> Model: ...
def fit(data: Statistics, ridge: float | str = 0.0, heads: int | str | None = None,
        nuclear: float | str | None = None, weight_decay: float = 0.0, restarts: int = 10, seed: int = 0,
        folds: list[Features] | None = None, device: str | None = None, scheduler: Any = None, *,
        read: ReadSpec | None = None, chunk_size: int | None = None,
        affine_from: str | os.PathLike | None = None) -> Model | HeadsSum:
    """Fit a model from the statistics `data` (of any storage, as `certify` takes them): the one `fit`.

    heads=H (or "auto") and nuclear=LAMBDA (or "auto") select the low-rank fits (mhla_cli.solve.lowrank);
    ridge="auto" the least-squares ridge by cross-validation (mhla_cli.solve.ridge_cv, info["ridge_cv"]);
    "auto" needs `folds`, the statistics of K disjoint parts of the data (mhla_cli.statistics.folds). The model
    records the normalisation of the statistics. `device` (mhla_cli.linalg.device): where the least-squares
    factorization runs (the low-rank fits run on the CPU). Statistics with the affine block of the wide tokens
    are fitted by least squares over the extended features (mhla_cli.solve.affine_block).

    With `scheduler`, or statistics tiled on a cluster: least squares with the Gram tiled on its workers
    (mhla_cli.solve.cluster.fit_tiled; a ridge > 0 or none); data that do not determine the function raise
    mhla_cli.solve.cluster.ClusterRefused there without a ridge.

    Least squares (the default) is solved in the canonical coordinates: the minimum-norm solution of
    singular data and `ridge`, in the units of the certificate's `lambda_max`, are unit-free. Returns a
    `Model` (`coef` (d, psi) on the tokens' own features, `W` (d^2, d^2), `info`: "basis": "canonical" for
    least squares). It does not warn: `mhla fit` and `MHLA` turn `info` into warnings (`fit_warnings`).

    The joint statistics of a sum of blocks (mhla_cli.solve.blocks.block_statistics) are fitted by least squares
    over their joint features (mhla_cli.solve.blocks.fit_blocks; ridge "auto" over their own folds): a
    `HeadsSum`, whose info["identifiable"] is the joint certificate's verdict.
    """
    if isinstance(data, BlockStatistics):
        _check_blocks_request(heads, nuclear, folds, device=device, scheduler=scheduler, read=read,
                              chunk_size=chunk_size, affine_from=affine_from)
        return fit_blocks(data, ridge=ridge)
    check_fit_options(ridge, heads, nuclear)
    skipped: list[int] = []
    if folds:  # folds of no weight (every weight 0) are skipped: they hold no held-out error
        folds, skipped = ridge_cv.weighted_folds(folds)
        if len(folds) < 2:
            raise InputError(f"cross-validation needs at least 2 folds that hold samples; {len(skipped)} of the "
                             f"{len(folds) + len(skipped)} folds have every weight 0")
    if scheduler is not None or isinstance(data, TiledStatistics):
        if heads is not None or nuclear is not None or ridge == "auto" or device is not None:
            raise cluster.ClusterRefused("solver")
        _check_tiled(data, affine_from)
        with _tiled(data, scheduler, read, chunk_size) as stats:
            return cluster.fit_tiled(stats, float(ridge), data if isinstance(data, (str, os.PathLike)) else None)
    feats = _in_memory(data, read, chunk_size, device, affine_from)
    model = _fit_in_memory(feats, ridge, heads, nuclear, weight_decay, restarts, seed, folds, device)
    model.info["normalize"] = feats.normalize
    model.info.update(feats.samples.fit_attrs())  # per-position samples: how they read the window
    if feats.source is not None:  # the data's identity (with their reduction's maps: export-heads --unreduce)
        model.info["data_source"] = dict(feats.source)
    model.info["train_r2"] = scores.train_r2(feats, model.info["train_mse"])
    if skipped:
        model.info["skipped_folds"] = skipped  # fit_warnings says so
    if scores.targets_underflow(feats):
        model.info["targets_underflow"] = True  # fit_warnings says why the train R^2 is null
    check_representable(model, feats)
    return model


def _chosen_ridge(feats: Features, ridge: float | str, folds: list[Features] | None
                  ) -> tuple[float, dict[str, Any] | None]:
    """The ridge of a least-squares fit: `ridge` itself, or for 'auto' the one K-fold CV chooses (with its record)."""
    if ridge != "auto":
        return float(ridge), None
    if not folds:
        raise InputError("ridge 'auto' needs per-fold statistics (cross-validation folds)")
    cv = ridge_cv.cv_ridge(feats, folds)
    return float(cv["chosen"]), cv


def _fit_in_memory(feats: Features, ridge: float | str, heads: int | str | None, nuclear: float | str | None,
                   weight_decay: float, restarts: int, seed: int, folds: list[Features] | None,
                   device: str | None) -> Model:
    """The fit of statistics in memory: of the extended features, least squares (ridge 'auto' by CV) or low rank."""
    if feats.affine is not None:  # the extended features (mhla_cli.solve.affine_block)
        if heads is not None or nuclear is not None:
            raise RequestError("affine_least_squares")
        ridge, cv = _chosen_ridge(feats, ridge, folds)
        model = affine_block.fit_extended(feats, ridge=ridge, device=device)
        if cv is not None:
            model.info["ridge_cv"] = cv
        return model
    if heads is not None or nuclear is not None:
        if feats.d_out != feats.d:  # the low-rank solvers factor square W (mhla_cli.solve.lowrank)
            raise RequestError("lowrank_width")
        return lowrank.fit_model(feats, heads=heads, nuclear=nuclear, weight_decay=weight_decay,
                                 restarts=restarts, seed=seed, folds=folds)
    ridge, cv = _chosen_ridge(feats, ridge, folds)
    model = lstsq.fit(feats, ridge=ridge, device=device)
    if cv is not None:
        model.info["ridge_cv"] = cv
    if not model.info["identifiable"]:
        # the data may still determine the function on the inputs they span (`fit_warnings` says so);
        # when their tokens and last tokens span R^d the observed domain is the full one
        B, C = domains.observed_bases(feats)
        model.info["identifiable_observed"] = (
            min(B.shape[1], C.shape[1]) < feats.d
            and certificate.certify_features(feats, domain="observed", device=device).identifiable)
    return model


def score_on_data(model: Model, data: str | os.PathLike, chunk_size: int | None = None,
                  affine_from: str | os.PathLike | None = None) -> dict[str, Any]:
    """The train R^2 and MSE of `model` scored on its tokens file `data` by one prediction pass (predict's
    mhla_cli.model.scores.Spread: resolved at any scale of the targets), for statistics whose targets' squares
    underflow float64 (scores.targets_underflow); {"train_r2", "train_mse", "train_scored_on": "data"}, or {} when
    the pass scores nothing (no targets). The samples scored are those of the fit (its layout, weights)."""
    from mhla_cli.model.forward import fitted_samples, predict_file

    fitted = fitted_samples(model)
    res = predict_file(model, data, chunk_size=chunk_size, layout=fitted if fitted.per_position else None,
                       affine_from=affine_from)
    if res.n_scored is None or res.mse is None:
        return {}
    return {"train_r2": res.r2, "train_mse": float(res.mse), "train_scored_on": "data"}


def check_representable(model: Model, feats: Features) -> None:
    """Refuse (InputError) a fitted model that no reader could load (Model.check_readable): above all
    coefficients on the tokens' own features that overflow float64, where the message names the
    tokens' scales and the remedy (a coefficient of S[j,k] x_n[l] scales as the targets over three token
    scales: tokens of scale 1e-110 give ~1e330)."""
    import numpy as np

    try:
        model.check_readable()
    except InputError as exc:
        if formats.all_finite(model.coef):
            raise InputError(f"the fitted model would not be readable ({exc}); please report it") from None
        G = np.diagonal(feats.token_gram) / (feats.token_weight if feats.token_weight > 0 else 1.0)
        std = np.sqrt(G[G > 0]) if (G > 0).any() else np.ones(1)
        raise InputError(
            "the fitted function's coefficients on the tokens' own features overflow float64 (a coefficient of "
            "S[j,k]*x_n[l] scales as the targets over the product of three token scales; the token coordinates "
            f"have standard deviations from {float(std.min()):.3g} to {float(std.max()):.3g}): rescale the tokens "
            "toward 1 (e.g. divide each coordinate by its standard deviation) and fit again") from None


def fit_warnings(info: dict[str, Any], ridge_name: str = "a ridge penalty",
                 words: Mapping[str, str] = REMEDY_WORDS) -> list[str]:
    """The warnings a fit deserves (the CLI prints them, the estimator raises them with warnings.warn), their
    remedies in `words` (mhla_cli.errors.REMEDY_WORDS; the CLI's: its options).

    Low-rank fits: their solver records; least squares: data that do not determine the function
    (the minimum-norm or ridge solution was returned; named when they do determine it on the observed
    domain, info["identifiable_observed"]) and an ill-conditioned solve.
    """
    small = ([f"the targets are too small for float64's sums of squares (mean square below "
              f"{TARGET_SQUARES_FLOOR:.3g}: they underflow): the train MSE and R^2 from the statistics are not "
              "resolved (R^2 null); `mhla predict` scores the data scale-free, or rescale the targets"]
             if info.get("targets_underflow") and info.get("train_scored_on") != "data" else [])
    if info.get("skipped_folds"):
        small.append(f"fold(s) {', '.join(str(k) for k in info['skipped_folds'])} (0-based) have every weight 0: "
                     "the cross-validation skipped them")
    if info.get("method", "lstsq") != "lstsq":
        return small + lowrank.solver_warnings(info)
    ridge = float(info.get("ridge", 0.0))
    if not info["identifiable"]:
        reason = (f"N = {info['n_samples']} < psi = {info['n_features']}" if info["n_samples"] < info["n_features"]
                  else "the canonical Lambda~ is singular")
        text = (f"the data do not determine the function ({reason}): this is the "
                + ("ridge-regularised" if ridge > 0 else "minimum-norm") + " solution")
        if info.get("identifiable_observed"):
            # every least-squares solution gives the same outputs on the observed domain
            return small + [text + "; they do determine it on the observed domain (inputs whose tokens lie in the span of "
                    "the data's tokens and whose last token lies in that of their last tokens; "
                    + words["certify_observed"] + "): " + (f"without {ridge_name}, its predictions there would be exact (those "
                                               "of every least-squares fit)" if ridge > 0 else
                                               "its predictions there are exact (those of every least-squares "
                                               "fit); elsewhere the minimum norm picks one of many")]
        return small + [text + "; see `mhla certify`"]
    if info["condition_number"] > ILL_CONDITIONED:
        return small + [f"ill-conditioned solve (condition number {info['condition_number']:.4g})"
                + ("" if ridge > 0 else f"; consider {ridge_name}")]
    return small


# A least-squares solve whose condition number exceeds this is reported as ill-conditioned.
ILL_CONDITIONED = 1e10


def check_export_options(max_heads: int | str | None = None, fewest: bool = False) -> None:
    """fewest=True finds its own count: RequestError("fewest_with_max_heads") with max_heads."""
    if fewest and max_heads is not None:
        raise RequestError("fewest_with_max_heads")


def export_heads(model: Model, tol: float = 1e-12, max_heads: int | str | None = None,
                 fewest: bool = False) -> Heads:
    """Heads computing `model`'s function (or its strongest part), found in the canonical coordinates of its
    data and returned in the tokens' (mhla_cli.model.canonical).

    Default: the SVD of W there, dropping singular values <= tol * s_max and keeping at most `max_heads`
    heads; max_heads="auto": the heads that stand out of the spectrum's noise; fewest=True: the fewest
    heads that compute the same function (a change <= FEWEST_TOL, verified; `info` says whether the count
    is proven). info["function_change"]: the RMS change of the outputs on the training data relative to
    the RMS output (None for a model without its data's Lambda~: then info["coef_change"] is all there is);
    info["coordinates"]: where the heads were found. Returns `Heads` (`V`, `Q` (H, d, d), `coef`).
    """
    check_export_options(max_heads, fewest)
    fn = canonical.canonical_function(model)
    bias = bool(model.info.get("bias_terms"))
    if bias and fn.basis is not None:  # centred heads: float64 accuracy however far the tokens are from 0
        fn.centre = token_mean(fn.basis)
    heads: Heads
    if fewest:
        if fn.coef.shape[0] != fn.d:  # the fewest-heads search factors square W (mhla_cli.solve.lowrank)
            raise RequestError("fewest_width")
        heads = lowrank.fewest_heads(fn)
    elif max_heads == "auto":
        heads = spectrum.outlier_heads(fn)
    else:
        assert not isinstance(max_heads, str)  # check_export_options refused every string but "auto"
        heads = canonical.truncated_heads(fn, tol=tol, max_heads=max_heads)
    if bias:  # heads of the tokens (x, 1): the heads of x and their bias terms
        heads = heads_mod.with_bias_terms(heads, centre=fn.centre)
        # the change of the function measured on the heads as written (the arrays, in the form predict evaluates)
        assert fn.basis is not None  # a fitted model holds the basis of its data
        c = canonical.coef_in_basis(heads, fn.basis) * feature_scale(fn.d)[None, :] / fn.scale
        heads.info.update(fn.record(c))
    affine = affine_of(model)
    if affine is not None:  # the token-wise affine map of the wide tokens beside them (solve.affine_block)
        heads.affine_weight, heads.affine_bias = np.ascontiguousarray(affine[:, :-1]), np.array(affine[:, -1])
    heads.info["normalize"] = model.info.get("normalize", "none")
    heads.info.update(layout_info(model.info))
    source = model.info.get("data_source")
    if isinstance(source, dict) and source.get("compatibility_mode") is not None:  # TransformerLens's mode: kept
        heads.info[formats.COMPAT_ATTR] = source["compatibility_mode"]
    return heads
