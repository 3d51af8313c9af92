"""Per-fold sufficient statistics for K-fold cross-validation (``mhla featurize --folds K``).

Fold k is the k-th contiguous sample range (stream.shard_range); its statistics are computed with
stream.featurize(shard=(k, K)) and the folds sum to the whole-file statistics. A features file
with folds holds, next to the usual datasets, fold_gram (K, psi, psi), fold_moments (K, psi, D_out),
fold_target_gram (K, D_out, D_out), fold_token_gram (K, d, d), fold_last_token_gram (K, d, d),
fold_n_samples (K,), fold_n_tokens (K,), fold_weight_sum (K,), fold_token_weight_sum (K,) (the weight
totals, features.Features) and fold_ranges (K, 2), plus the attribute n_folds.

Each fold's canonical sums are stored as featurize computed them, in the fold's own whitening:
fold_basis (K, d, d), fold_basis_gram (K, psi, psi), fold_basis_moments (K, psi, D_out),
fold_basis_token_gram and fold_basis_last_token_gram (K, d, d) (FOLD_BASIS). Cross-validation trains on
total - fold k; those sums change to the total's basis by a well-conditioned change (both bases whiten
the same data), so a folds file gives the folds' canonical statistics exactly as the tokens file does,
in any units of the tokens. The own-coordinate fold sums alone (files written before FOLD_BASIS) are
accepted only where the change from them is itself well conditioned (`check_own_folds`,
numerics.OWN_FOLDS_COND).

Statistics with the affine block of the wide tokens (mhla_cli.statistics.affine_sums) store each fold's block beside
its canonical sums: fold_affine_cross (K, psi, D + 1) (rows in the fold's basis, as fold_basis_moments),
fold_affine_gram (K, D + 1, D + 1), fold_affine_moments (K, D + 1, d) and fold_affine_sum (K, D + 1) (FOLD_AFFINE),
all in the total's f_basis (the one estimate of the wide file every fold is accumulated in).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from mhla_cli.io import formats
from mhla_cli.errors import InputError, Refused
from mhla_cli.samples import ReadSpec, Samples
from mhla_cli.feature_map import n_features
from mhla_cli.numerics import FOLD_SUM_TOL, OWN_FOLDS_COND, SINGULAR_BASIS_COND
from mhla_cli.statistics import basis as basis_mod
from mhla_cli.statistics.storage.gram_dense import is_symmetric as _is_symmetric
from mhla_cli.statistics.affine_sums import AffineSums
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.stream import check_attention_of, check_bias_terms_of, featurize
from mhla_cli.io.tokens import inspect_tokens

FOLD_DATASETS = (*(f"fold_{k}" for k in Features.SUMS), "fold_n_samples", "fold_n_tokens", "fold_ranges")
# The per-fold weight totals (format version >= features_file.WEIGHTS_FORMAT; older files: the counts).
FOLD_WEIGHTS = ("fold_weight_sum", "fold_token_weight_sum")
# Each fold's canonical sums and their basis (written by save_with_folds; older files lack them).
FOLD_BASIS = ("fold_basis", *(f"fold_{k}" for k in Features.BASIS_SUMS))
# Each fold's affine block (with --affine-from): its sums, AffineSums' fields.
FOLD_AFFINE = ("fold_affine_cross", "fold_affine_gram", "fold_affine_moments", "fold_affine_sum")


def featurize_folds(path: str | os.PathLike, n_folds: int, chunk_size: int | None = None,
                    progress: Callable[[int], None] | None = None, **parallel: Any
                    ) -> tuple[Features, list[Features]]:
    """Statistics of each of `n_folds` contiguous sample ranges of a tokens file, and their sum.

    Each fold is stream.featurize(shard=(k, n_folds)); `parallel` (workers, scheduler, map, read, affine_from) is
    passed on.
    """
    info = inspect_tokens(path)
    if n_folds < 2:
        raise InputError(f"the number of folds must be >= 2, got {n_folds}")
    if n_folds > info.n_samples:
        raise InputError(f"{n_folds} folds are more than the {info.n_samples} samples", path)
    if not info.has_targets:
        raise InputError("folds need targets (cross-validation scores predictions)", path)
    # every feature (spans="off"): folds are compared and summed feature by feature
    folds = [featurize(path, chunk_size=chunk_size, shard=(k, n_folds), progress=progress, spans="off", **parallel)
             for k in range(n_folds)]
    total = folds[0]
    for f in folds[1:]:
        total = total + f
    if total.n_samples == 0:
        raise InputError(f"every weight of samples 0..{info.n_samples} is 0: there is no sample to learn from", path)
    total.source = folds[0].source
    total.sample_range = (0, info.n_samples)
    total.extra_attrs = {}
    return total, folds


def save_with_folds(total: Features, folds: list[Features], path: str | os.PathLike,
                    inputs: tuple[str | os.PathLike, ...] = ()) -> None:
    """Write a features file (same layout as Features.save) with the per-fold datasets added."""
    data = {f"fold_{k}": np.stack([getattr(f, k) for f in folds]) for k in Features.SUMS}
    data.update(fold_n_samples=np.array([f.n_samples for f in folds], dtype=np.int64),
                fold_n_tokens=np.array([f.n_tokens for f in folds], dtype=np.int64),
                fold_ranges=np.array([f.sample_range or (0, 0) for f in folds], dtype=np.int64),
                fold_weight_sum=np.array([f.weight for f in folds]),
                fold_token_weight_sum=np.array([f.token_weight for f in folds]))
    canon = [f.canonical() if not f.on_spans else f.copy().expand().canonical() for f in folds]
    bases = []
    for f in canon:
        assert f.basis is not None, "canonical gives the record its basis"
        bases.append(f.basis)
    data["fold_basis"] = np.stack(bases)
    data.update({f"fold_{k}": np.stack([getattr(f, k) for f in canon]) for k in Features.BASIS_SUMS})
    if total.affine is not None:
        data.update(_affine_folds(total, canon))
    total.save(path, inputs, extra=data, extra_attrs={"n_folds": len(folds)})


def _affine_folds(total: Features, canon: list[Features]) -> dict[str, np.ndarray]:
    """The folds' affine blocks (FOLD_AFFINE) in the total's f_basis, their rows in each fold's canonical basis."""
    assert total.affine is not None  # statistics with the affine block
    blocks = []
    for f in canon:
        if f.affine is None or f.affine.moments is None:
            raise InputError("every fold needs the affine block of the wide tokens and targets")
        aff = f.affine.copy()
        aff.to_f_basis(total.affine.f_basis)
        blocks.append(aff)
    return {"fold_affine_cross": np.stack([a.cross for a in blocks]),
            "fold_affine_gram": np.stack([a.gram for a in blocks]),
            "fold_affine_moments": np.stack([a.moments for a in blocks if a.moments is not None]),
            "fold_affine_sum": np.stack([a.total for a in blocks])}


def _read_affine_folds(f: Any, total: Features, K: int, path: str | os.PathLike) -> list[AffineSums] | None:
    """The folds' affine blocks of an open features file (None when the total has none), validated."""
    aff = total.affine
    if aff is None:
        return None
    if not all(k in f for k in FOLD_AFFINE) or "fold_basis" not in f:
        raise InputError("holds the affine block of the wide tokens but not its per-fold sums (featurize the folds "
                         "with the wide tokens)", path)
    a, psi, e = aff.width + 1, n_features(total.d), total.n_outputs
    shapes = {"fold_affine_cross": (K, psi, a), "fold_affine_gram": (K, a, a), "fold_affine_moments": (K, a, e),
              "fold_affine_sum": (K, a)}
    arrs = {k: formats.read_array(f, k, path).astype(np.float64) for k in FOLD_AFFINE}
    for k, shape in shapes.items():
        if arrs[k].shape != shape or not np.isfinite(arrs[k]).all():
            raise InputError(f"'{k}' has shape {arrs[k].shape} or is not finite, expected {shape}", path)
    return [AffineSums(arrs["fold_affine_cross"][k], arrs["fold_affine_gram"][k], arrs["fold_affine_moments"][k],
                       arrs["fold_affine_sum"][k], aff.width, aff.source, aff.P, aff.basis) for k in range(K)]


def load_folds(path: str | os.PathLike, total: Features | None = None) -> list[Features] | None:
    """The per-fold statistics of a features file, or None when it has none; validated against the total.

    With the folds' canonical sums (FOLD_BASIS) each fold is the record featurize made; without them
    (older files) the own-coordinate sums, where `check_own_folds` allows them.
    """
    total = (Features.load(path) if total is None else total).expand()
    d, psi, e = total.d, n_features(total.d), total.d_out  # e: the targets' width D_out
    with formats.open_input(path) as f:
        if "fold_gram" not in f:
            return None
        arrs = {}
        for name in FOLD_DATASETS:
            arrs[name] = formats.read_array(f, name, path)
        for name, counts in zip(FOLD_WEIGHTS, ("fold_n_samples", "fold_n_tokens")):
            # a file before the weight totals: Features.load accepted it as unweighted last-token data
            arrs[name] = formats.read_array(f, name, path) if name in f else arrs[counts].astype(np.float64)
        present = [k for k in FOLD_BASIS if k in f]
        if present and len(present) < len(FOLD_BASIS):
            missing = [k for k in FOLD_BASIS if k not in f]
            raise InputError(f"has {', '.join(present)} but no {', '.join(missing)}; the file is incomplete", path)
        for name in present:
            if name == "fold_basis_moments" and not total.has_targets:
                continue
            arrs[name] = formats.read_array(f, name, path)
        affine = _read_affine_folds(f, total, arrs["fold_gram"].shape[0], path)
    K = arrs["fold_gram"].shape[0]
    expect = {"fold_gram": (K, psi, psi), "fold_moments": (K, psi, e), "fold_target_gram": (K, e, e),
              "fold_token_gram": (K, d, d), "fold_last_token_gram": (K, d, d), "fold_n_samples": (K,),
              "fold_n_tokens": (K,), "fold_ranges": (K, 2), "fold_weight_sum": (K,), "fold_token_weight_sum": (K,)}
    if present:
        expect.update(fold_basis=(K, d, d), fold_basis_gram=(K, psi, psi), fold_basis_moments=(K, psi, e),
                      fold_basis_token_gram=(K, d, d), fold_basis_last_token_gram=(K, d, d))
    for name, shape in expect.items():
        if name not in arrs:
            continue
        if arrs[name].shape != shape:
            raise InputError(f"'{name}' has shape {arrs[name].shape}, expected {shape}", path)
        if not np.isfinite(arrs[name]).all():
            raise InputError(f"'{name}' contains NaN or Inf", path)
    if K < 2:
        raise InputError(f"{K} fold(s) stored; cross-validation needs >= 2", path)
    n = arrs["fold_n_samples"].astype(np.int64)
    if (n < 0).any() or int(n.sum()) != total.n_samples:
        raise InputError(f"fold_n_samples {n.tolist()} do not sum to n_samples = {total.n_samples}", path)
    for name in FOLD_WEIGHTS:  # > 0, or 0 for a fold without samples (its weights all 0: an empty fold)
        if ((arrs[name] < 0) | ((arrs[name] == 0) != (n == 0))).any():
            raise InputError(f"'{name}' {arrs[name].tolist()} must be > 0 (0 for a fold of no sample, "
                             f"fold_n_samples {n.tolist()})", path)
    gsum = arrs["fold_gram"].sum(axis=0)
    assert total.gram is not None  # read with the file
    scale = max(float(np.abs(total.gram).max()), 1e-300)
    if not np.allclose(gsum, total.gram, rtol=0, atol=FOLD_SUM_TOL * scale):
        raise InputError("the fold grams do not sum to 'gram'; the file is inconsistent", path)
    if present:
        _check_fold_bases(arrs, total, path)
    else:
        check_own_folds(total, path)
    folds = []
    for k in range(K):
        canonical = {} if not present else {
            "basis": arrs["fold_basis"][k].astype(np.float64),
            **{s: arrs[f"fold_{s}"][k].astype(np.float64) if f"fold_{s}" in arrs else None
               for s in Features.BASIS_SUMS}}
        folds.append(total.with_sums(n_samples=int(n[k]), n_tokens=int(arrs["fold_n_tokens"][k]),
                                     weight_sum=float(arrs["fold_weight_sum"][k]),
                                     token_weight_sum=float(arrs["fold_token_weight_sum"][k]),
                                     **{s: arrs[f"fold_{s}"][k].astype(np.float64) for s in Features.SUMS},
                                     sample_range=(int(arrs["fold_ranges"][k][0]), int(arrs["fold_ranges"][k][1])),
                                     n_sequences=None, **canonical))
        if affine is not None:
            folds[-1].affine = affine[k]
    return folds


def _check_fold_bases(arrs: dict[str, np.ndarray], total: Features, path: str | os.PathLike) -> None:
    """The folds' canonical sums: invertible bases, symmetric Grams, and token Grams that, changed to the
    total's basis, sum to the total's (FOLD_SUM_TOL of its largest entry)."""
    total.ensure_basis()
    acc = np.zeros((total.d, total.d))
    assert total.basis is not None and total.basis_token_gram is not None  # read with the file
    for k, A in enumerate(arrs["fold_basis"]):
        if basis_mod.row_scaled_cond(A) > SINGULAR_BASIS_COND:
            raise InputError(f"'fold_basis' of fold {k} is singular; the file is corrupted", path)
        if not _is_symmetric(arrs["fold_basis_gram"][k]):
            raise InputError(f"'fold_basis_gram' of fold {k} is not symmetric; the file is corrupted", path)
        C = basis_mod.transition(A, total.basis)
        acc += C.T @ arrs["fold_basis_token_gram"][k] @ C
    want = total.basis_token_gram
    if not np.abs(acc - want).max() <= FOLD_SUM_TOL * max(float(np.abs(want).max()), 1e-300):
        raise InputError("the folds' 'fold_basis_token_gram' do not sum to 'basis_token_gram'; the file is "
                         "inconsistent", path)


def check_own_folds(total: Features, path: str | os.PathLike | None = None) -> None:
    """Folds known only by their own-coordinate sums (files written before FOLD_BASIS): their canonical
    sums come from a change of basis to the total's whitening A, which multiplies the sums' rounding by
    about cond^6 of its row-scaled condition number (a rescaling of the token coordinates is exact).
    Accepted up to OWN_FOLDS_COND (mhla_cli.numerics), else refused: such units need the folds'
    canonical sums, which `featurize --folds` writes."""
    total.ensure_basis()
    assert total.basis is not None  # ensure_basis
    cond = basis_mod.row_scaled_cond(total.basis)
    if not cond <= OWN_FOLDS_COND:
        raise Refused(f"holds the folds' sums in the tokens' own coordinates only (written before the folds' "
                      f"canonical sums): in these token units (whitening of condition {cond:.3g} > "
                      f"{OWN_FOLDS_COND:g}, rows scaled alike) they cannot give each fold's canonical "
                      "statistics exactly; run {folds} again", path, folds={})


def load_for_cv(path: str | os.PathLike, n_folds: int = 5, chunk_size: int | None = None,
                progress: Callable[[int], None] | None = None, attention: str | Samples | None = None,
                bias_terms: bool = False, read: ReadSpec | None = None,
                affine_from: str | os.PathLike | None = None) -> tuple[Features, list[Features]]:
    """Whole-file and per-fold statistics: from a features file's stored folds, or computed from a tokens file
    (its per-position samples read with `attention`, which a features file's must match; with the bias terms
    when asked, which a features file must hold; with the affine block of the wide tokens `affine_from`, a tokens
    file's folds alone). `read` (mhla_cli.samples.ReadSpec), given, replaces `attention` and `bias_terms` (its
    normalisation is not applied here)."""
    if read is not None:
        attention, bias_terms = read.layout, read.bias_terms
    kind = formats.kind_of(path)
    if kind == "features":
        total = Features.load(path)
        check_attention_of(total, attention, path)
        check_bias_terms_of(total, bias_terms, path)
        if affine_from is not None and total.affine is None:
            raise InputError("holds no affine block of the wide tokens: featurize them with the wide tokens", path)
        folds = load_folds(path, total)
        if folds is None:
            raise InputError("has no per-fold statistics, which 'auto' needs (write them with "
                             "featurize_folds and save_with_folds)", path)
        return total, folds
    if kind == "tokens":
        return featurize_folds(path, n_folds, chunk_size=chunk_size, progress=progress,
                               read=ReadSpec(attention, "none", bias_terms), affine_from=affine_from)
    raise InputError(f"is a {kind} file, expected a tokens or features file", path)
