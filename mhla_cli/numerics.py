"""The numerics' constants: EPS once, and every tolerance of the certificate, the fit and the loaders.

Each cut is a named constant here, documented with the reason for its value; the other modules import
them from here (their one home: tests/test_numerics.py checks that no module assigns them again), the CLI
help and docs/certificate.md quote them from here (tests/test_docs.py checks the quotes), and
tests/test_numerics.py puts a case at 1e-2 x and at 1e2 x of each cut against plain numpy on materialised
features (tests/_reference.py).
"""

from __future__ import annotations

import math
import sys

# float64's unit roundoff (machine epsilon): 2^-52.
EPS = sys.float_info.epsilon  # float64's machine epsilon (no NumPy at import: the CLI's help quotes this module)

# The rank cut (`numerical_tolerance`): eigenvalues of Lambda~ at or below RANK_FACTOR * n * EPS *
# lambda_max are zero to float64 accumulation accuracy (numpy.linalg.matrix_rank's rule).
RANK_FACTOR = 1.0

# The structure cut (mhla_cli.statistics.structure.from_traces): a direction of the data's spans whose partial-trace
# energy is at most STRUCTURE_FACTOR * psi * EPS * (a lower bound of lambda_max) is left out of the block,
# i.e. the certificate's own rank cut, so dropping it changes no verdict.
STRUCTURE_FACTOR = 1.0

# The observed-span rule (solve.domains._observed_bases_b): a direction of the canonical token Gram (or the
# last-token Gram) of `count` summed outer products is in the observed span when its eigenvalue exceeds
# OBSERVED_SPAN_FACTOR * d * EPS * sqrt(count) of the largest (float64 rounding adds like a random walk),
# or d * eps_in^2 for tokens stored at precision eps_in.
OBSERVED_SPAN_FACTOR = 1.0

# A probe of `certify --on` is determined when the relative component of its canonical feature vector
# in the null space of Lambda~ is at most this.
DETERMINED_TOL = 1e-8

# `certify --on`: where the training data leave token directions that float64 does not resolve
# (UNRESOLVED_REL: the whitening keeps them at the largest scale, their true scale is unknown), a probe
# whose whitened tokens have a component z (A U) along them (U: those directions in the canonical
# coordinates) above UNRESOLVED_PROBE_FACTOR times its rounding bound d eps (|| |z| |A U| || + ||z A||)
# per token (the rounding of z along U and of the directions themselves), is "not resolvable in
# float64": its output depends on what the data cannot show. Below it the component is the rounding of
# a probe that lies in the resolved directions (about 1x the bound at most).
UNRESOLVED_PROBE_FACTOR = 16.0

# The relative residual tolerance of block Lanczos (mhla_cli.linalg.krylov) and of its ARPACK fallback
# (lambda_max, and lambda_min on the inverse through the shifted Cholesky factor): the Ritz value's
# error is about tol^2 lambda / gap, so 1e-7 still gives lambda to ~1e-14 relative when the gap is
# of the order of lambda.
LANCZOS_TOL = 1e-7

# The train MSE from the sums cancels: its resolution is MSE_RESOLUTION_FACTOR * psi * EPS *
# (tr(target_gram) + p Lambda p^T) / (N d); a train MSE below it is reported as ~ 0.
MSE_RESOLUTION_FACTOR = 8.0

# Sums of squares of targets hold their float64 precision while the targets' weighted mean square
# tr(target_gram) / sum w is at least TARGET_SQUARES_FLOOR, the smallest normal number over EPS (~1e-292,
# targets of RMS ~1e-146): below it the squares fall among the subnormal numbers (or to 0, targets of
# 1e-170), so fit's train MSE and R^2 from the statistics are not resolved (R^2 is null, with that
# reason, and the MSE's resolution is at least this over d); `mhla predict` scores such targets
# scale-free (mhla_cli.model.scores.Spread). Not a tolerance: float64's range.
TARGET_SQUARES_FLOOR = sys.float_info.min / EPS

# The wide tokens' affine hull (solve.affine_block.affine_hull): a direction of the nearly whitened second moment of
# f = (x_wide, 1) over `count` queries whose eigenvalue is at or below AFFINE_HULL_FACTOR * (D + 1) * EPS * sqrt(count)
# of the largest is a hyperplane the tokens lie on (float64 rounding of the sums adds like a random walk, as for
# OBSERVED_SPAN_FACTOR).
AFFINE_HULL_FACTOR = 1.0

# A stored or given token basis A with condition number above this is refused as singular.
SINGULAR_BASIS_COND = 1e12

# A stored psi x psi Gram is accepted when |a - a^T| <= SYMMETRY_TOL * max |a| (else: corrupted).
SYMMETRY_TOL = 1e-12

# A change of coordinates R is treated as orthogonal (the factorization shared between the full and the
# observed domain) when |R^T R - I| <= ORTHOGONAL_TOL.
ORTHOGONAL_TOL = 1e-12

# certify's explanation: a feature with null_weight > 1 - DEAD_WEIGHT_TOL is "dead" (its direction lies in
# the null space), one above DEAD_WEIGHT_TOL mixes into it.
DEAD_WEIGHT_TOL = 1e-6

# spectrum: a singular value of W is nonzero when above NONZERO_REL * s_max.
NONZERO_REL = 1e-8

# Factorization.solve reuses the proof's factor of Lambda~ - s I with iterative refinement when the
# contraction rho = s / (lambda_min - s) is at most this (else a Cholesky of Lambda~ itself).
REFINE_MAX_RHO = 0.5

# The resolution of an equilibrated token Gram (basis.whitening, basis.unresolved): eigenvalues at or
# below d * UNRESOLVED_REL * its largest are not resolvable in float64 (numpy.linalg.matrix_rank's
# rule per token coordinate): a rotated direction of relative standard deviation below about
# sqrt(d eps) keeps the scale of the largest one.
UNRESOLVED_REL = EPS

# basis.whitening equilibrates the token Gram (G_e = R G R, a diagonal near 1) before its
# eigendecomposition when G's positive diagonal spans more than this ratio (largest / smallest variance
# of a token coordinate) and that resolves more directions; below it the symmetric whitening already
# resolves what equilibration would.
EQUILIBRATE_RATIO = 1e4

# A basis whose token Gram A^T G A is within this of the identity (2-norm) is already the whitening of
# the data: basis.correction applies no change (so canonicalising twice changes nothing).
CANONICAL_TOL = 1e-9

# A model file's coef and the p_b M_A of its canonical coefficients agree to this (relative to the
# largest coefficient; fit writes coef = p_b M_A, so they agree to rounding), else it is refused.
CANONICAL_COEF_TOL = 1e-8

# A model file's W and coef agree to this (relative to the largest coefficient: |p(W) - coef| <=
# W_COEF_TOL * max |coef|), else it is refused (the witness checks its own W the same way).
W_COEF_TOL = 1e-8

# Largest integer magnitude float64 holds exactly for every integer up to it (2^53): int64 / uint64
# tokens beyond it would be rounded when converted, so they are refused (not a tolerance: a cut).
MAX_EXACT_INT = 2**53

# R^2 is not defined (None) when SST is at or below SST_RESOLUTION times the targets' energy
# sum w ||y||^2 (rounding of the sums): targets whose spread is 1e-6 of their magnitude are still
# scored (SST / energy = 1e-12 there), at a cost of about 4 of float64's 16 digits.
SST_RESOLUTION = 1e-12

# A features file's stored spans (span_pairs, span_last) are accepted when |M^T M - I| <= ORTHONORMAL_TOL
# (orthonormal columns to far above rounding), else refused.
ORTHONORMAL_TOL = 1e-8

# A features file's fold grams must sum to its gram to FOLD_SUM_TOL * max |gram| (they are the same
# sums in another order: they agree to rounding), else it is refused as inconsistent.
FOLD_SUM_TOL = 1e-9

# A features file whose folds hold only their own-coordinate sums (written before the folds' canonical
# sums) is used for cross-validation only when the total's whitening A has a row-scaled condition number
# (basis.row_scaled_cond: a rescaling of the token coordinates is exact) of at most OWN_FOLDS_COND: the
# change of the own sums to canonical coordinates multiplies their rounding by about cond^6, and
# 16^6 eps ~ 4e-9 keeps the held-out errors to far below the CV's own spread; beyond it the file is
# refused (featurize --folds again writes the folds' canonical sums).
OWN_FOLDS_COND = 16.0

# spectrum: an unconverged W's head count is trusted when its k outliers stand this far above the
# rest, s_k / s_(k+1) >= RELIABLE_GAP (the noisy examples' heads stand 100-1000x above their bulk, an
# unconverged bulk cut by the threshold 1-1.5x).
RELIABLE_GAP = 10.0

# export-heads --fewest: heads are accepted when the function changes by at most this (RMS output change
# on the training data relative to the RMS output, mhla_cli.model.canonical; the coefficient change in
# the coordinates at hand for a model without its data's Lambda~).
FEWEST_TOL = 1e-8

# The lower bound of --fewest needs a number t <= lambda_min(Lambda~) that a Cholesky of Lambda~ - t I
# proves (it succeeds exactly when that matrix is positive definite): t = LAMBDA_FLOOR_FRACTION times the
# computed lambda_min (rounding moves a computed eigenvalue by ~ psi eps lambda_max; a factor 2 below it
# is proven whenever lambda_min is resolved at all, and weakens the bound's radius by sqrt 2 only).
LAMBDA_FLOOR_FRACTION = 0.5


def quote(x: float) -> str:
    """A constant as the help and the docs write it: 1e-8, 1e12, 0.5, 8."""
    return f"{x:g}".replace("e-0", "e-").replace("e+0", "e").replace("e+", "e")


# The rank cut as the CLI help and the docs write it.
RANK_RULE = ("" if RANK_FACTOR == 1 else f"{RANK_FACTOR:g}*") + "psi*eps*lambda_max"


def numerical_tolerance(lambda_max: float, n: int) -> float:
    """Eigenvalues at or below RANK_FACTOR * n * EPS * lambda_max are zero to float64 accumulation accuracy.

    This is the rule of numpy.linalg.matrix_rank: rounding a sum of float64 products perturbs the
    psi x psi matrix by about eps * its norm per entry, i.e. at most ~ psi * eps * lambda_max in
    spectral norm; an exact null direction lifted by rounding stays below it, while real data with
    lambda_min / lambda_max down to ~1e-10 stay far above it.
    """
    return RANK_FACTOR * n * EPS * max(lambda_max, 0.0)


def lambda_min_of_verdict(estimate: float, threshold: float, proven_above: bool) -> tuple[float, str | None]:
    """(lambda_min as reported beside a verdict, the bound it is): the estimate (dense eigenvalues or Lanczos)
    where it agrees with the verdict, else the threshold t with the bound the verdict proves.

    The verdict is proven (a Cholesky of Lambda~ - t I, or a count: N < psi, exact nulls); the estimate is
    not. A passing verdict proves every eigenvalue > t: an estimate at or below t is reported as t, a lower
    bound ("above"). A failing one proves an eigenvalue at or below t: an estimate above t (Lanczos or
    rounding near t) is reported as t, an upper bound ("at_most"). None: the estimate agrees and stands.
    """
    estimate, threshold = float(estimate), float(threshold)
    if proven_above and not estimate > threshold:
        return threshold, "above"
    if not proven_above and estimate > threshold:
        return threshold, "at_most"
    return estimate, None


def observed_span_tol(d: int, count: int, eps_in: float) -> float:
    """The relative eigenvalue cut of the observed spans: OBSERVED_SPAN_FACTOR * d * EPS * sqrt(count),
    at least d * eps_in^2 (see OBSERVED_SPAN_FACTOR)."""
    return max(OBSERVED_SPAN_FACTOR * d * EPS * math.sqrt(max(count, 1)), d * eps_in**2)


def affine_hull_tol(k: int, count: int) -> float:
    """The relative eigenvalue cut of the wide tokens' hyperplanes: AFFINE_HULL_FACTOR * k * EPS * sqrt(count)."""
    return AFFINE_HULL_FACTOR * k * EPS * math.sqrt(max(count, 1))


def mse_resolution(n_features: int, scale: float, n_samples: float, d: int) -> float:
    """The float64 resolution of the train MSE from the sums (see MSE_RESOLUTION_FACTOR), at least
    TARGET_SQUARES_FLOOR / d (the squares' own floor)."""
    return max(MSE_RESOLUTION_FACTOR * n_features * EPS * scale / (max(n_samples, 1) * d), TARGET_SQUARES_FLOOR / d)


# The constants that docs/certificate.md quotes (tests/test_docs.py checks each quote against this table).
QUOTED = {
    "RANK_FACTOR": RANK_FACTOR, "STRUCTURE_FACTOR": STRUCTURE_FACTOR, "OBSERVED_SPAN_FACTOR": OBSERVED_SPAN_FACTOR,
    "AFFINE_HULL_FACTOR": AFFINE_HULL_FACTOR,
    "DETERMINED_TOL": DETERMINED_TOL, "UNRESOLVED_PROBE_FACTOR": UNRESOLVED_PROBE_FACTOR, "LANCZOS_TOL": LANCZOS_TOL, "MSE_RESOLUTION_FACTOR": MSE_RESOLUTION_FACTOR,
    "SINGULAR_BASIS_COND": SINGULAR_BASIS_COND, "SYMMETRY_TOL": SYMMETRY_TOL, "ORTHOGONAL_TOL": ORTHOGONAL_TOL,
    "DEAD_WEIGHT_TOL": DEAD_WEIGHT_TOL, "NONZERO_REL": NONZERO_REL, "REFINE_MAX_RHO": REFINE_MAX_RHO,
    "UNRESOLVED_REL": UNRESOLVED_REL, "EQUILIBRATE_RATIO": EQUILIBRATE_RATIO, "CANONICAL_TOL": CANONICAL_TOL,
    "CANONICAL_COEF_TOL": CANONICAL_COEF_TOL, "W_COEF_TOL": W_COEF_TOL, "MAX_EXACT_INT": MAX_EXACT_INT,
    "SST_RESOLUTION": SST_RESOLUTION, "TARGET_SQUARES_FLOOR": TARGET_SQUARES_FLOOR, "RELIABLE_GAP": RELIABLE_GAP,
    "ORTHONORMAL_TOL": ORTHONORMAL_TOL, "FOLD_SUM_TOL": FOLD_SUM_TOL, "OWN_FOLDS_COND": OWN_FOLDS_COND,
    "FEWEST_TOL": FEWEST_TOL, "LAMBDA_FLOOR_FRACTION": LAMBDA_FLOOR_FRACTION,
}
