"""The identifiability certificate of Lemma 2.3 and its explanation.

`certify_features` factorizes the canonical Lambda~ of statistics in memory restricted to a certificate domain
(mhla_cli.solve.domains: the full one, the observed one, ...), proves the verdict by a Cholesky of Lambda~ - t I,
and, when the data do not certify, explains why: which features the null space holds and what leaves them free.
`certify_tiled` does the same over statistics tiled on a cluster (mhla_cli.solve.cluster). The public `certify`
(mhla_cli.api.learn) picks one of them, or the affine block's (mhla_cli.solve.affine_block).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mhla_cli.errors import InputError
from mhla_cli.linalg.factorization import Factorization
from mhla_cli.numerics import DEAD_WEIGHT_TOL, lambda_min_of_verdict, numerical_tolerance
from mhla_cli.statistics import basis as basis_mod
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.distributed.tiled_statistics import TiledStatistics
from mhla_cli.solve import cluster
from mhla_cli.solve.domains import Domain, get_domain


@dataclass
class Certificate:
    """Identifiability certificate (Lemma 2.3): lambda_min(Lambda_D) > threshold.

    `identifiable`, `lambda_min`, `lambda_max`, `rank` and `reasons` are the verdict and its numbers, of the
    canonical Lambda~ (`basis` and `to_dict()["basis"]` are "canonical"); `span_features`: the size of the
    block on the data's spans that is factorized (the other features are exact nulls); `null_vectors`: the
    null space, computed on first use."""

    identifiable: bool
    lambda_min: float
    lambda_max: float
    rank: int | None  # None on a cluster when not identifiable (solve.cluster)
    n_features: int
    n_samples: int
    threshold: float
    numerical_tolerance: float
    min_eig: float
    domain: str
    dim_tokens: int
    dim_last_tokens: int
    reasons: list[str] = field(default_factory=list)
    null_features: list[dict[str, Any]] = field(default_factory=list)
    eigenvalues: np.ndarray | None = None
    basis: str = "canonical"
    seconds: dict[str, float] = field(default_factory=dict)  # the factorization's steps (wall time)
    # the data's spans (mhla_cli.statistics.structure): features in span{S_i} (x) U_n, and the two dimensions
    span_features: int = 0
    span_pairs: int = 0
    span_last_tokens: int = 0
    # what the verdict rests on (PROOFS) and which reported numbers are estimates (Lanczos Ritz values)
    proof: str = ""
    estimated: list[str] = field(default_factory=list)
    # how each estimate was found (mhla_cli.linalg.krylov): method, products, relative residual, converged
    estimates: dict[str, dict[str, Any]] = field(default_factory=dict)
    # where the factorization ran (mhla_cli.linalg.device; None: numpy): the witness's re-certification runs there too
    device: str | None = field(default=None, repr=False, compare=False)
    _null_fn: Callable[[], np.ndarray] | None = field(default=None, repr=False, compare=False)
    _null: np.ndarray | None = field(default=None, repr=False, compare=False)
    # on a cluster (mhla_cli.solve.cluster): the tasks submitted by kind (the rank is then None unless
    # identifiable: counting the eigenvalues at or below t needs an eigendecomposition)
    tasks: dict[str, int] = field(default_factory=dict)
    # lambda_min where its estimate contradicted the proven verdict (numerics.lambda_min_of_verdict): the
    # threshold as the bound the verdict proves ("at_most" when it failed, "above" when it passed; None: the
    # estimate agrees and is lambda_min), and the estimate itself
    lambda_min_bound: str | None = None
    lambda_min_estimate: float | None = None
    # the hyperplanes a^T x = c the wide tokens lie on (solve.affine_block.affine_hull: the affine map is certified on
    # their affine hull, up to these directions) and what they mean, said beside the verdict
    hyperplanes: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def null_vectors(self) -> np.ndarray | None:
        """Orthonormal columns spanning the null space (computed on first use; None when identifiable)."""
        if self._null is None and self._null_fn is not None:
            self._null = self._null_fn()
        return self._null

    @property
    def margin(self) -> float:
        return self.lambda_min - self.threshold

    def __repr__(self) -> str:  # the verdict and its numbers, not the eigenvalues and null vectors
        return (f"Certificate(identifiable={self.identifiable}, domain={self.domain!r}, lambda_min={self.lambda_min:.4g}, "
                f"lambda_max={self.lambda_max:.4g}, threshold={self.threshold:.4g}, rank={self.rank}/{self.n_features}, "
                f"n_samples={self.n_samples})")

    def to_dict(self) -> dict[str, Any]:
        return {
            "identifiable": self.identifiable, "lambda_min": self.lambda_min, "lambda_max": self.lambda_max,
            "rank": self.rank, "n_features": self.n_features, "n_samples": self.n_samples,
            "threshold": self.threshold, "numerical_tolerance": self.numerical_tolerance,
            "min_eig": self.min_eig, "margin": self.margin, "domain": self.domain,
            "condition_number": (self.lambda_max / self.lambda_min) if self.lambda_min > 0 else None,
            "dim_tokens": self.dim_tokens, "dim_last_tokens": self.dim_last_tokens,
            "reasons": list(self.reasons), "null_features": list(self.null_features), "basis": self.basis,
            "span_features": self.span_features, "span_pairs": self.span_pairs,
            "span_last_tokens": self.span_last_tokens, "proof": self.proof, "estimated": list(self.estimated),
            "estimates": {k: dict(v) for k, v in self.estimates.items()}, "seconds": dict(self.seconds),
            "lambda_min_bound": self.lambda_min_bound,
            **({"lambda_min_estimate": self.lambda_min_estimate} if self.lambda_min_bound else {}),
            **({"tasks": dict(self.tasks)} if self.tasks else {}),
            **({"hyperplanes": list(self.hyperplanes), "notes": list(self.notes)} if self.hyperplanes else {}),
        }

    def bound_lambda_min(self) -> Certificate:
        """Make lambda_min agree with the verdict (numerics.lambda_min_of_verdict); returns self."""
        value, bound = lambda_min_of_verdict(self.lambda_min, self.threshold, self.identifiable)
        if bound is not None:
            self.lambda_min_estimate, self.lambda_min, self.lambda_min_bound = self.lambda_min, value, bound
        return self


def certify_features(feats: Features, min_eig: float = 0.0, domain: str | Domain = "full", device: str | None = None
                     ) -> Certificate:
    """Certify that the statistics in memory (the MHLA's features, dense or pairs) determine the learned function
    (on R^d, or on the observed subspaces).

    The eigenvalues are those of the canonical Lambda~ = sum w Ht Ht^T / sum w: the features of the
    whitened tokens X A (A^T G A = I, G = sum w S / sum w n, n the sample's token count: for
    last-token data without weights the second moment of all tokens; for weighted or per-position
    data each token counted with the weights of the samples that contain it) in orthonormal
    coordinates (mhla_cli.statistics.basis), so that the numbers and the verdict depend neither on the units of
    the tokens nor on those of the weights. `domain`: a name ("full", "observed") or a
    mhla_cli.solve.domains.Domain.
    `null_vectors` span the null space: for the full domain in the tokens' own feature coordinates
    (orthonormal columns), for the observed domain in the observed-domain coordinates (map them with
    `domain_map(feats, "observed")[0].T`). `device`: where the factorization runs (mhla_cli.linalg.device).

    Returns a `Certificate`: `identifiable`, `lambda_min`, `lambda_max` (the eigenvalues of the canonical
    Lambda~, the same for tokens in any units: docs/certificate.md), `rank`, `reasons`, `to_dict()`;
    `min_eig` is in the same units.
    """
    if min_eig < 0 or not np.isfinite(min_eig):
        raise InputError(f"min_eig must be a finite number >= 0, got {min_eig}")
    if feats.affine is not None:  # a certificate of the MHLA's features alone would leave the block out
        raise InputError("the statistics hold the affine block of the wide tokens: certify the extended features "
                         "(mhla_cli.certify)")
    dom = get_domain(domain)
    A, _, _ = feats.solver_stats()
    fac = dom.factorize(feats, device)
    r, s = dom.dims(feats)
    m = fac.n_full
    lmax = fac.lambda_max()
    tol = numerical_tolerance(lmax, m)
    threshold = max(tol, float(min_eig))
    proof = _proof(feats, fac, lmax, threshold)
    identifiable = proof == "cholesky of Lambda~ - t I"
    lmin = fac.lambda_min()
    rank = fac.rank(tol)
    cert = Certificate(identifiable, lmin, lmax, rank, m, feats.n_samples, threshold, tol, float(min_eig),
                       dom.name, r, s, eigenvalues=fac.full_eigenvalues(), span_features=fac.n,
                       span_pairs=fac.structure.a, span_last_tokens=fac.structure.b, proof=proof,
                       estimated=[] if fac.known_eigenvalues() is not None else ["lambda_min", "lambda_max"],
                       device=fac.device).bound_lambda_min()
    if not identifiable:
        cert._null_fn = lambda: dom.null_vectors(A, _current(feats, dom.name, fac), threshold)
        weight, k = _null_weights(A, fac, threshold, dom)
        cert.reasons, cert.null_features = _explain(feats, cert, weight, k, dom)
    cert.seconds = dict(fac.seconds)
    cert.estimates = {k: dict(v) for k, v in fac.iterations.items() if k in cert.estimated}
    return cert


def certify_tiled(stats: TiledStatistics, min_eig: float = 0.0) -> Certificate:
    """The certificate of the full domain of statistics tiled on a cluster (mhla_cli.solve.cluster): the verdict
    by a Cholesky of Lambda~ - t I over the tiles, lambda_min and lambda_max estimated by Lanczos; the explanation
    of a failure is its column. Its `rank` is None unless identifiable, and `tasks` holds the tasks submitted, by
    kind (docs/cluster.md, "The Gram on the cluster")."""
    if min_eig < 0 or not np.isfinite(min_eig):
        raise InputError(f"min_eig must be a finite number >= 0, got {min_eig}")
    min_eig = float(min_eig)
    feats = stats.sums
    fac = cluster.factorization(stats)
    d, m = feats.d, fac.n_full
    lmax, tol, threshold = cluster.threshold_of(fac, min_eig)
    proof = _proof(feats, fac, lmax, threshold)
    identifiable = proof == "cholesky of Lambda~ - t I"
    lmin = fac.lambda_min()
    cert = Certificate(identifiable, lmin, lmax, m if identifiable else None, m, feats.n_samples, threshold, tol,
                       min_eig, "full", d, d, span_features=m, span_pairs=m // d, span_last_tokens=d, proof=proof, estimated=["lambda_min", "lambda_max"]).bound_lambda_min()
    if not identifiable:
        cert.reasons = _count_reasons(feats, cert, 0)
        if proof == "cholesky of Lambda~ - t I failed":
            cert.reasons.append(cluster.failure_reason(fac, threshold, below_margin=threshold > tol and lmin > tol))
        elif proof == "all features are zero":
            cert.reasons = ["all features are zero: the data carry no information"]
    cert.seconds = {**fac.seconds, **stats.matrix.seconds}
    cert.estimates = {k: dict(v) for k, v in fac.iterations.items() if k in cert.estimated}
    cert.tasks = dict(stats.matrix.tasks)
    return cert


def _proof(feats: Features, fac: Factorization, lmax: float, threshold: float) -> str:
    """What the verdict rests on; "cholesky of Lambda~ - t I" alone proves identifiability.

    The verdict is proven by inertia: a Cholesky of Lambda~ - t I (t = threshold) that succeeds shows
    that no eigenvalue lies at or below t, on every path (dense, Lanczos, device). lambda_min is then
    Lanczos on the inverse through that same factor (the identifiable case costs one factorization,
    n^3 / 3) or the dense eigenvalues; 0 when the data's spans leave directions out
    (mhla_cli.statistics.structure); eigenvectors only when needed to explain a failure.
    """
    if lmax <= 0:
        return "all features are zero"
    if fac.n < fac.n_full:
        return "exact null directions outside the data's spans"
    if feats.n_samples < fac.n_full:
        return "N < psi samples"
    return "cholesky of Lambda~ - t I" if fac.proves_above(threshold) else "cholesky of Lambda~ - t I failed"


def _current(feats: Features, domain: str, fac: Factorization) -> Factorization:
    """fac, if it is still the factorization of feats' sums (they are summed and changed in place)."""
    cached: Factorization | None = feats.factor_cache.get(domain)
    if cached is not fac:
        raise InputError("the statistics changed after this certificate was made: certify them again")
    return fac


def _null_weights(A: np.ndarray, fac: Factorization, threshold: float, dom: Domain) -> tuple[np.ndarray, int]:
    """(diagonal of the projector onto the null space, in the coordinates of `Domain.null_vectors`; its dim).

    The range is Y = K V (V: the block's eigenvectors above threshold, K = E' (x) F' the block's
    embedding: E (x) F, times M_A^-1 = kron(P_A^-1 D^-1, A^-T) in own coordinates). With K = (U1 (x) U2)
    (R1 (x) R2) (QR), range(K) = range(Y) (+) Z, Z = (U1 (x) U2) orth((R1 (x) R2)^-T N) (N: the block's
    null eigenvectors), so diag P_Y = |U1_j|^2 |U2_l|^2 - diag P_Z: O(psi n) and small QRs, no psi x rank
    orthogonalisation.
    """
    st = fac.structure
    E, F = dom.block_factors(A, st.E, st.F)
    U1, R1 = np.linalg.qr(E)
    U2, R2 = np.linalg.qr(F)
    _, N = fac.null_space(threshold)
    k = fac.n_full - (fac.n - N.shape[1])
    inside = np.einsum("ja,ja->j", U1, U1)[:, None] * np.einsum("lb,lb->l", U2, U2)[None, :]
    weight = 1.0 - inside.ravel()
    if N.shape[1]:
        import scipy.linalg

        # (R1 (x) R2)^-T N = kron(R1^-T, R2^-T) N, orthonormalised, in U1 (x) U2 coordinates
        Zb = basis_mod.kron_apply(scipy.linalg.inv(R1).T, scipy.linalg.inv(R2).T, N)
        Z = basis_mod.kron_apply(U1, U2, np.linalg.qr(Zb)[0])
        weight += np.einsum("ij,ij->i", Z, Z)
    return np.clip(weight, 0.0, 1.0), k


def _explain(feats: Features, cert: Certificate, weight: np.ndarray, k: int, dom: Domain
             ) -> tuple[list[str], list[dict[str, Any]]]:
    """(reasons, the top null features) of a certificate that failed."""
    if cert.lambda_max <= 0:
        return ["all features are zero: the data carry no information"], []
    reasons = _count_reasons(feats, cert, k)
    zero_reasons, exactly_zero = dom.zero_coordinates(feats)
    reasons += zero_reasons
    names = dom.feature_names(feats, cert.dim_tokens, cert.dim_last_tokens)

    def is_zero(i: int) -> bool:
        return exactly_zero is not None and exactly_zero(i)

    order = np.argsort(-weight)
    dead = [int(i) for i in order if weight[i] > 1 - DEAD_WEIGHT_TOL]
    zero = [i for i in dead if is_zero(i)]
    mixed = [int(i) for i in order if DEAD_WEIGHT_TOL < weight[i] <= 1 - DEAD_WEIGHT_TOL]
    top = [{"feature": names[i], "index": i, "null_weight": float(weight[i]),
            "identically_zero": bool(is_zero(i))} for i in (dead + mixed)[:20]]
    if k:
        reasons.append(_null_reason(feats, cert, k, dom, names, dead, zero, mixed))
    elif cert.proof == "cholesky of Lambda~ - t I failed":
        est = cert.lambda_min if cert.lambda_min_estimate is None else cert.lambda_min_estimate
        reasons.append(f"the Cholesky of Lambda~ - t I (t = {cert.threshold:.3g}) failed although lambda_min is "
                       f"estimated at {est:.3g}: the smallest eigenvalue is within rounding of the threshold")
    return reasons, top


def _count_reasons(feats: Features, cert: Certificate, k: int) -> list[str]:
    """The reasons told by counts: too few samples, the data's spans, a margin above lambda_min."""
    reasons = []
    m = cert.n_features
    if feats.n_samples < m:
        reasons.append(f"N = {feats.n_samples} samples < {m} features: at least {m} samples are needed "
                       "(necessary, not sufficient)")
    if cert.span_features < m:
        q = (cert.dim_tokens * (cert.dim_tokens + 1)) // 2
        reasons.append(f"the data's S matrices span {cert.span_pairs} of {q} dimensions and their last tokens "
                       f"{cert.span_last_tokens} of {cert.dim_last_tokens}: at most {cert.span_features} of the "
                       f"{m} features carry information, the other {m - cert.span_features} directions are "
                       "exact nulls")
    if k and cert.lambda_min > cert.numerical_tolerance and cert.min_eig > 0:
        reasons.append(f"lambda_min = {cert.lambda_min:.3g} is full rank but below the demanded "
                       f"margin min_eig = {cert.min_eig:.3g}")
    return reasons


def _null_reason(feats: Features, cert: Certificate, k: int, dom: Domain, names: list[str], dead: list[int],
                 zero: list[int], mixed: list[int]) -> str:
    """The reason that describes the k null directions and the single features in them."""
    if cert.lambda_min > cert.numerical_tolerance:  # below the margin
        desc = (f"{k} feature direction(s) are excited less than the demanded margin (eigenvalues <= "
                f"{cert.threshold:.3g})")
    # token directions whose variance float64 cannot tell from zero (basis.unresolved): the
    # whitening keeps them at the largest scale, and the features along them are lost that way
    elif lost := dom.unresolved(feats):
        desc = (f"{k} feature direction(s) are not resolvable in float64: {lost} token direction(s) have a "
                f"variance of at most {feats.d} eps64 of the largest (after equilibration), zero or too "
                "small for float64 to tell from rounding")
    else:
        desc = f"{k} feature direction(s) are never excited by the data"
    if zero:
        desc += (f"; {len(zero)} single feature(s) are identically zero in the data, e.g. "
                 + ", ".join(names[i] for i in zero[:3]))
    other = [i for i in dead if i not in set(zero)]
    if other:
        desc += (f"; {len(other)} single feature(s) are zero to within the numerical threshold "
                 "(not exactly 0 in the data), e.g. "
                 + ", ".join(names[i] for i in other[:3]))
    if k > len(dead) and mixed:
        desc += ("; the other directions mix features such as "
                 + ", ".join(names[i] for i in mixed[:4]))
    return desc
