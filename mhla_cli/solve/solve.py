"""Algorithm 1 (least squares on the sufficient statistics) and the certificate of Lemma 2.3."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..statistics import basis as basis_mod
from ..linalg import device as device_mod
from ..statistics import structure as structure_mod
from ..statistics.basis import kron_congruence, orth_pair_map
from ..errors import InputError
from ..linalg.factorization import Factorization
from ..feature_map import feature_index, pair_index
from ..statistics.stats import Features
from ..model.heads import W_from_p
from ..model.model import Model
from ..statistics.structure import find_structure

# EPS and numerical_tolerance stay importable from here, their old home
from ..numerics import (DEAD_WEIGHT_TOL, EPS, ORTHOGONAL_TOL, mse_resolution,  # noqa: F401
                       numerical_tolerance, observed_span_tol)


def _eigh(a: np.ndarray, vectors: bool = True) -> Any:
    """LAPACK symmetric eigensolver (scipy is imported here, not at start-up: it costs ~0.2 s)."""
    import scipy.linalg

    return scipy.linalg.eigh(a, eigvals_only=not vectors)


def range_basis(gram: np.ndarray, rel_tol: float) -> np.ndarray:
    """Orthonormal basis (d, r) of the numerical range of a PSD matrix; the identity when full rank."""
    w, v = _eigh(gram)
    keep = w > rel_tol * max(w[-1], 0.0)
    if keep.all():
        return np.eye(gram.shape[0])
    return v[:, keep][:, ::-1]


def _basis_token_grams(feats: Features) -> tuple[np.ndarray, np.ndarray]:
    """token_gram and last_token_gram in the canonical basis (A^T G A, accumulated from X A)."""
    feats.canonical()
    return feats.basis_token_gram, feats.basis_last_token_gram


def _observed_bases_b(feats: Features) -> tuple[np.ndarray, np.ndarray]:
    """Orthonormal bases of U and U_n in the canonical (whitened) token coordinates."""
    d = feats.d
    eps_in = float(np.finfo(np.dtype(feats.token_dtype)).eps) if feats.token_dtype in ("float16", "float32", "float64") else EPS

    def rel(count: int) -> float:
        # A null direction of the token Gram is lifted (i) by rounding the stored tokens, only to
        # second order (~ d eps_in^2), and (ii) by the float64 accumulation of its sum of `count`
        # outer products: rounding errors add like a random walk, ~ sqrt(count) eps per entry, so
        # d sqrt(count) eps in norm. (d eps alone is exceeded by real rank-3 data of 1500 samples.)
        return observed_span_tol(d, count, eps_in)

    tg, lg = _basis_token_grams(feats)
    return range_basis(tg, rel(feats.n_tokens)), range_basis(lg, rel(feats.n_samples))


DOMAINS = ("full", "observed")


def check_domain(domain: str) -> str:
    """Validate a certificate domain: "full" (all inputs) or "observed" (tokens in the data's spans)."""
    if domain not in DOMAINS:
        raise InputError(f"unknown domain '{domain}', expected full or observed")
    return domain


def _domain_map_b(feats: Features, domain: str) -> tuple[np.ndarray | None, int, int]:
    """The map T_b from the canonical features to the domain's (None for the full domain).

    Observed domain: the canonical features of X B and C^T x_n for orthonormal bases B, C of the
    whitened spans U and U_n; T_b = kron(D P_B D^-1, C^T) has orthonormal rows, so the observed
    spectrum is as unit-free as the full one.
    """
    d = feats.d
    if domain == "full":
        return None, d, d
    check_domain(domain)
    B, C = _observed_bases_b(feats)
    return np.kron(orth_pair_map(B), C.T), B.shape[1], C.shape[1]


def domain_map(feats: Features, domain: str) -> tuple[np.ndarray | None, int, int]:
    """The map T from H (tokens' own coordinates) to the features the certificate of `domain` uses.

    Full domain: the canonical map M_A (Ht(X A) = M_A H(X)). Observed domain: the canonical
    features of X A B and C^T A^T x_n for orthonormal bases B, C of the whitened U and U_n.
    """
    T, r, s = _domain_map_b(feats, domain)
    A = feats.basis
    if T is None:
        return basis_mod.feature_map(A), r, s
    return basis_mod.coef_from_basis(A, T), r, s  # T_b @ M_A


def factorize(feats: Features, domain: str = "full", device: str | None = None) -> Factorization:
    """The factorization of the canonical Lambda~ (or its observed-domain restriction), computed once
    per Features and domain and shared by certify, fit, `certify --on` and the witness.

    `device` (mhla_cli.linalg.device): where a new factorization runs (torch.linalg; its free memory is
    checked first); one already computed is reused wherever it ran.

    Only the block of Lambda~ on the data's spans is factorized (mhla_cli.statistics.structure): `fac.structure`
    maps its coordinates to the domain's features, and the directions outside it are exact zeros.
    """
    check_domain(domain)
    device = device_mod.check_device(device)
    feats.canonical()
    cache = feats.factor_cache
    if domain in cache:
        return cache[domain]
    d = feats.d
    if "full" not in cache:
        # Lambda~ = basis_gram / sum w, held as the sums and the scale 1 / sum w (no psi x psi copy)
        gram_b, scale = feats.basis_gram, 1.0 / (feats.weight if feats.weight > 0 else 1.0)
        if feats.reduced:  # featurize held only the block on the data's spans
            st = structure_mod.Structure(_complete(feats.span_pairs), _complete(feats.span_last),
                                         feats.span_pairs.shape[1], feats.span_last.shape[1])
            fac = Factorization(gram_b, st.n_full, scale, device)
        else:
            st = find_structure(gram_b, d)
            fac = Factorization(st.compress(gram_b), st.n_full, scale, device)
        _check_device_memory(fac)
        fac.structure = st
        cache["full"] = fac
    full = cache["full"]
    if domain == "observed":
        B, C = _observed_bases_b(feats)
        if B.shape[1] == d and C.shape[1] == d:
            cache[domain] = full  # U = U_n = R^d: the observed domain is the full one
        else:
            pm, tm = orth_pair_map(B), C.T
            st_o, R1, R2 = structure_mod.observed(full.structure, pm, tm)
            if _orthogonal(R1) and _orthogonal(R2):
                # the spans lie in the observed domain isometrically: the same block, in the coordinates
                # (P_B E) (x) (C^T F); its decompositions are shared with the full domain's
                st_o = structure_mod.Structure(_complete(pm @ full.structure.E), _complete(tm @ full.structure.F),
                                               full.structure.a, full.structure.b)
                cache[domain] = full.share(st_o.n_full, st_o)
            else:
                fac = Factorization(kron_congruence(R1, R2, full.lam), st_o.n_full, full.scale, device)
                fac.structure = st_o
                _check_device_memory(fac)
                cache[domain] = fac
    return cache[domain]


# psi x psi float64 matrices a factorization holds on a device: the matrix, its Cholesky factor or
# eigenvectors, and torch.linalg's work (eigh: about one more)
DEVICE_COPIES = 3


def _check_device_memory(fac: Factorization) -> None:
    device_mod.check_device_memory(fac.device, DEVICE_COPIES * 8 * fac.n ** 2, f"the factorization of {fac.n} features")


def _orthogonal(R: np.ndarray) -> bool:
    """R is square and orthogonal to ORTHOGONAL_TOL."""
    return R.shape[0] == R.shape[1] and float(np.abs(R.T @ R - np.eye(R.shape[0])).max(initial=0.0)) <= ORTHOGONAL_TOL


def _complete(E: np.ndarray) -> np.ndarray:
    """[E, E_perp]: orthonormal columns E (n, a) completed to an orthogonal matrix (E kept as it is)."""
    Q = np.linalg.qr(E, mode="complete")[0]
    return np.hstack([E, Q[:, E.shape[1]:]])


def observed_bases(feats: Features) -> tuple[np.ndarray, np.ndarray]:
    """Orthonormal bases B (d, r) of U = span of all tokens and C (d, s) of U_n = span of last tokens.

    In the tokens' own coordinates (computed in the canonical basis, where the ranks are well resolved).
    """
    B, C = _observed_bases_b(feats)
    A = feats.basis
    # column vectors: x_b = A^T x, so a subspace spanned by B_b is spanned by A^-T B_b
    AinvT = np.linalg.inv(A).T
    return np.linalg.qr(AinvT @ B)[0], np.linalg.qr(AinvT @ C)[0]


@dataclass
class Certificate:
    """Identifiability certificate (Lemma 2.3): lambda_min(Lambda_D) > threshold."""

    identifiable: bool
    lambda_min: float
    lambda_max: float
    rank: int
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
    _null_fn: Callable[[], np.ndarray] | None = field(default=None, repr=False, compare=False)
    _null: np.ndarray | None = field(default=None, repr=False, compare=False)

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
            "seconds": dict(self.seconds),
        }


def certify(feats: Features, min_eig: float = 0.0, domain: str = "full", device: str | None = None) -> Certificate:
    """Certify that the data determine the learned function (on R^d, or on the observed subspaces).

    The eigenvalues are those of the canonical Lambda~ = sum w Ht Ht^T / sum w: the features of the
    whitened tokens X A (A^T G A = I, G = sum w S / sum w n, n the sample's token count: for
    last-token data without weights the second moment of all tokens; for weighted or per-position
    data each token counted with the weights of the samples that contain it) in orthonormal
    coordinates (mhla_cli.statistics.basis), so that the numbers and the verdict depend neither on the units of
    the tokens nor on those of the weights.
    `null_vectors` span the null space: for the full domain in the tokens' own feature coordinates
    (orthonormal columns), for the observed domain in the observed-domain coordinates (map them with
    `domain_map(feats, "observed")[0].T`). `device`: where the factorization runs (mhla_cli.linalg.device).
    """
    if min_eig < 0 or not np.isfinite(min_eig):
        raise InputError(f"min_eig must be a finite number >= 0, got {min_eig}")
    A, _, _ = feats.solver_stats()
    fac = factorize(feats, domain, device)
    full = domain == "full"
    r, s = (feats.d, feats.d) if full else tuple(b.shape[1] for b in _observed_bases_b(feats))
    m = fac.n_full
    lmax = fac.lambda_max()
    tol = numerical_tolerance(lmax, m)
    threshold = max(tol, float(min_eig))
    # The verdict is proven by inertia: a Cholesky of Lambda~ - t I (t = threshold) that succeeds shows
    # that no eigenvalue lies at or below t, on every path (dense, Lanczos, device). lambda_min is then
    # Lanczos on the inverse through that same factor (the identifiable case costs one factorization,
    # n^3 / 3) or the dense eigenvalues; 0 when the data's spans leave directions out
    # (mhla_cli.statistics.structure); eigenvectors only when needed to explain a failure
    if lmax <= 0:
        proof = "all features are zero"
    elif fac.n < m:
        proof = "exact null directions outside the data's spans"
    elif feats.n_samples < m:
        proof = "N < psi samples"
    else:
        proof = "cholesky of Lambda~ - t I" if fac.proves_above(threshold) else "cholesky of Lambda~ - t I failed"
    identifiable = proof == "cholesky of Lambda~ - t I"
    lmin = fac.lambda_min()
    rank = fac.rank(tol)
    cert = Certificate(identifiable, lmin, lmax, rank, m, feats.n_samples, threshold, tol, float(min_eig),
                       domain, r, s, eigenvalues=fac.full_eigenvalues(), span_features=fac.n,
                       span_pairs=fac.structure.a, span_last_tokens=fac.structure.b, proof=proof,
                       estimated=[] if fac.known_eigenvalues() is not None else ["lambda_min", "lambda_max"])
    if not identifiable:
        cert._null_fn = lambda: _null_vectors(A, _current(feats, domain, fac), threshold, full)
        weight, k = _null_weights(A, fac, threshold, full)
        cert.reasons, cert.null_features = _explain(feats, cert, weight, k, full)
    cert.seconds = dict(fac.seconds)
    return cert


def _current(feats: Features, domain: str, fac: Factorization) -> Factorization:
    """fac, if it is still the factorization of feats' sums (they are summed and changed in place)."""
    if feats.factor_cache.get(domain) is not fac:
        raise InputError("the statistics changed after this certificate was made: certify them again")
    return fac


def _null_vectors(A: np.ndarray, fac: Factorization, threshold: float, full: bool) -> np.ndarray:
    """Orthonormal basis of the eigenvalues <= threshold: the exact nulls outside the data's spans and
    the block's own; for the full domain in the tokens' own feature coordinates."""
    st = fac.structure
    null = np.hstack([st.outside(), st.embed(fac.null_space(threshold)[1])])
    if full and null.shape[1]:
        # v^T H_b = v^T M_A H: the same direction in the tokens' own feature coordinates
        null = np.linalg.qr(basis_mod.coef_from_basis(A, null.T).T)[0]
    return null


def _null_weights(A: np.ndarray, fac: Factorization, threshold: float, full: bool) -> tuple[np.ndarray, int]:
    """(diagonal of the projector onto the null space, in the coordinates of `_null_vectors`; its dim).

    The range is Y = K V (V: the block's eigenvectors above threshold, K = E' (x) F' the block's
    embedding: E (x) F, times M_A^-1 = kron(P_A^-1 D^-1, A^-T) in own coordinates). With K = (U1 (x) U2)
    (R1 (x) R2) (QR), range(K) = range(Y) (+) Z, Z = (U1 (x) U2) orth((R1 (x) R2)^-T N) (N: the block's
    null eigenvectors), so diag P_Y = |U1_j|^2 |U2_l|^2 - diag P_Z: O(psi n) and small QRs, no psi x rank
    orthogonalisation.
    """
    st = fac.structure
    E, F = st.E, st.F
    if full:  # M_A^-1 (E (x) F) = (P_A^-1 D^-1 E) (x) (A^-T F)
        P, R = basis_mod.from_basis_factors(A)
        E, F = P @ E, R @ F
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


def _explain(feats: Features, cert: Certificate, weight: np.ndarray, k: int, full: bool
             ) -> tuple[list[str], list[dict[str, Any]]]:
    d = feats.d
    reasons: list[str] = []
    m = cert.n_features
    if cert.lambda_max <= 0:
        reasons.append("all features are zero: the data carry no information")
        return reasons, []
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
    # token_gram / last_token_gram are sums of squares in the tokens' own coordinates: a zero
    # diagonal entry means that coordinate is exactly 0 in every token (or last token).
    zt = np.flatnonzero(np.diag(feats.token_gram) == 0.0)
    zl = np.flatnonzero(np.diag(feats.last_token_gram) == 0.0)
    if full:
        if zt.size:
            reasons.append(f"token coordinate(s) {', '.join(map(str, zt))} are always 0: features "
                           "S[j,k] touching them vanish (the observed domain leaves them out)")
        if zl.size:
            reasons.append(f"last-token coordinate(s) {', '.join(map(str, zl))} are always 0: features "
                           "S[j,k]*x_n[l] with those l vanish (the observed domain leaves them out)")
    order = np.argsort(-weight)
    names = _feature_names(d, cert, full)
    idx = feature_index(d)
    zero_t, zero_l = set(zt.tolist()), set(zl.tolist())

    def exactly_zero(i: int) -> bool:
        j, k, l = idx[i]
        return int(j) in zero_t or int(k) in zero_t or int(l) in zero_l

    dead = [int(i) for i in order if weight[i] > 1 - DEAD_WEIGHT_TOL]
    zero = [i for i in dead if full and exactly_zero(i)]
    mixed = [int(i) for i in order if DEAD_WEIGHT_TOL < weight[i] <= 1 - DEAD_WEIGHT_TOL]
    top = [{"feature": names[i], "index": i, "null_weight": float(weight[i]),
            "identically_zero": bool(full and exactly_zero(i))} for i in (dead + mixed)[:20]]
    if k:
        below_margin = cert.lambda_min > cert.numerical_tolerance
        # token directions whose variance float64 cannot tell from zero (basis.unresolved): the
        # whitening keeps them at the largest scale, and the features along them are lost that way
        lost = basis_mod.unresolved(feats.token_gram) if full else 0
        if below_margin:
            desc = (f"{k} feature direction(s) are excited less than the demanded margin (eigenvalues <= "
                    f"{cert.threshold:.3g})")
        elif lost:
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
        reasons.append(desc)
    elif cert.proof == "cholesky of Lambda~ - t I failed":
        reasons.append(f"the Cholesky of Lambda~ - t I (t = {cert.threshold:.3g}) failed although lambda_min = "
                       f"{cert.lambda_min:.3g}: the smallest eigenvalue is within rounding of the threshold")
    return reasons, top


def _feature_names(d: int, cert: Certificate, full: bool) -> list[str]:
    if full:
        return [f"S[{j},{k}]*x_n[{l}]" for j, k, l in feature_index(d)]
    # Observed domain: S' = B^T S B and x_n' = C^T x_n in orthonormal bases of U and U_n.
    jr, kr = pair_index(cert.dim_tokens)
    return [f"S'[{a},{b}]*x_n'[{c}]" for a, b in zip(jr, kr) for c in range(cert.dim_last_tokens)]


# --------------------------------------------------------------------------------------------
# fit
# --------------------------------------------------------------------------------------------


def fit(feats: Features, ridge: float = 0.0, device: str | None = None) -> Model:
    """Least squares over p on the sufficient statistics (Algorithm 1, step 1), in the canonical basis.

    Solves (Lambda~ + ridge I) p_b^T = m~ with Lambda~ = gram_b / sum w and m~ = moments_b / sum w the
    canonical sums (mhla_cli.statistics.basis), and maps p = p_b M_A back to the tokens' own features. With
    ridge = 0 and a singular Lambda~ it returns the minimum-norm p_b (pseudo-inverse with the
    certificate's numerical tolerance). The ridge and the minimum norm are taken in the canonical
    coordinates, so the learned function does not depend on the units of the tokens, and `ridge` is
    in the units of the certificate's lambda_max. `device`: where the factorization runs (mhla_cli.linalg.device).
    """
    if not feats.has_targets:
        raise InputError("the data have no 'targets': fit needs (X, y) pairs")
    if ridge < 0 or not np.isfinite(ridge):
        raise InputError(f"ridge must be a finite number >= 0, got {ridge}")
    A, _, moments_b = feats.solver_stats()
    N = feats.n_samples
    W = feats.weight if feats.weight > 0 else 1.0  # sum w: the normaliser of Lambda~ and m~
    psi = feats.n_features
    fac = factorize(feats, "full", device)
    st = fac.structure
    # the factorized block on the data's spans (mhla_cli.statistics.structure): the moments lie in its range
    rhs = moments_b / W if feats.reduced else st.restrict(moments_b / W)
    lmax = fac.lambda_max()
    tol = numerical_tolerance(lmax, psi)
    # proven as the certificate's: a Cholesky of the block's Lambda~ - tol I (reused by the solve)
    block_pd = lmax > 0 and fac.proves_above(tol)
    lmin = fac.lambda_min()
    t_solve = time.perf_counter()
    sol = None
    if ridge > 0:
        sol = fac.ridge_solve(rhs, ridge, tol)
    elif block_pd:
        # The block is positive definite: a solve with the certificate's Cholesky factor.
        sol = fac.solve(rhs)
    if sol is None:
        # Singular (or numerically so): the pseudo-inverse with the certificate's tolerance, i.e.
        # the minimum-norm p_b (no component along the null directions of Lambda~).
        sol = fac.pinv_solve(rhs, tol)
    coef_b = st.embed(sol).T
    coef = basis_mod.coef_from_basis(A, coef_b)
    seconds = {**fac.seconds, "solve": time.perf_counter() - t_solve}
    identifiable = bool(block_pd and fac.n == psi and N >= psi)
    mse, resolution = _train_mse_b(feats, coef_b)
    # Condition number of the system actually solved (regularised when ridge > 0).
    if ridge > 0:
        cond = (lmax + ridge) / (max(lmin, 0.0) + ridge)
    else:
        cond = (lmax / lmin) if lmin > tol else float("inf")
    info = {
        "ridge": float(ridge), "train_mse": mse, "mse_resolution": resolution, "lambda_min": lmin,
        "lambda_max": lmax, "identifiable": identifiable, "condition_number": cond,
        "rank": fac.rank(tol), "n_features": psi, "n_samples": N, "method": "lstsq",
        "basis": "canonical", "normalize": getattr(feats, "normalize", "none"), "seconds": seconds,
    }
    # the canonical coefficients and their basis: predict evaluates the function there (Model.evaluation)
    return Model(coef=coef, W=W_from_p(coef), d=feats.d, info=info, coef_b=coef_b, basis=np.array(A))


def train_mse(feats: Features, coef: np.ndarray) -> tuple[float, float]:
    """Mean squared error sum_i w_i ||p H_i - y_i||^2 / (d sum_i w_i) from the statistics alone, and
    its float64 resolution.

    sum_i w_i ||p H_i - y_i||^2 = tr(p_b gram_b p_b^T) - 2 tr(p_b moments_b) + tr(target_gram), evaluated
    on the canonical sums (p_b = p M_A^-1); cancellation limits the accuracy to about
    eps * tr(target_gram).
    """
    A, _, _ = feats.solver_stats()
    return _train_mse_b(feats, basis_mod.coef_to_basis(A, coef))


def _train_mse_b(feats: Features, pb: np.ndarray) -> tuple[float, float]:
    """`train_mse` of the canonical coefficients p_b.

    With only the block on the data's spans held (gram_b = Q G_r Q^T, moments_b = Q M_r), p_b enters
    through p_b Q alone, exactly (mhla_cli.statistics.structure).
    """
    N, d = (feats.weight if feats.weight > 0 else 1.0), feats.d  # sum w: the weighted mean
    _, gram_b, moments_b = feats.solver_stats()
    if feats.reduced:
        pb = basis_mod.kron_apply(feats.span_pairs.T, feats.span_last.T, np.ascontiguousarray(pb.T)).T
    quad = float(np.sum((pb @ gram_b) * pb))
    sse = quad - 2 * float(np.einsum("ij,ji->", pb, moments_b)) + float(np.trace(feats.target_gram))
    scale = float(np.trace(feats.target_gram)) + quad
    resolution = mse_resolution(feats.n_features, scale, N, d)
    return max(sse, 0.0) / (N * d), resolution
