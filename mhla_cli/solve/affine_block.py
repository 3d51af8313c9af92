"""The certificate and the least-squares fit of the MHLA's features extended by the token-wise affine block of the
wide tokens (mhla_cli.statistics.affine_sums; docs/bias_terms.md, "The affine map of the wide token").

The features of a sample are [Ht, f~]: the MHLA's canonical features Ht (whitened tokens, orthonormal coordinates:
mhla_cli.statistics.basis) and the affine block f~ = A_f^T f of f = (x_wide, 1), whitened by the wide tokens' own
second moment (A_f^T (sum w f f^T / sum w) A_f = I, basis.whitening). Both blocks are unit-free: an invertible map of
the reduced tokens changes Ht orthogonally, an invertible affine map of the wide tokens changes f~ orthogonally, so
the spectrum of

    Lambda~ = [[ sum w Ht Ht^T, sum w Ht f~^T ], [ sum w f~ Ht^T, sum w f~ f~^T ]] / sum w

does not depend on the units of either. The verdict is proven as the MHLA's (a Cholesky of Lambda~ - t I,
mhla_cli.linalg.factorization), on the block of the MHLA's features on the data's spans (the rest are exact nulls)
beside the affine block. With the bias terms and normalize="length" the bias terms hold the constant already (n / n):
the affine block is then x_wide alone (no column of ones twice).

Wide tokens on a hyperplane a^T x = c (a layer norm's output: centred, so 1^T x = 0 before its gain and shift) make
(x_wide, 1) collinear: the function (a, -c)^T f vanishes on every token, and no data can tell the affine maps that
differ by it apart. The block is then whitened on the range of f's second moment only (`affine_hull`): its features
are those of the function restricted to the wide tokens' affine hull, the certificate names each such hyperplane
(`Hyperplane`) and proves the rest by the same Cholesky, and the fit's condition number is that of the restriction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError
from ..linalg.factorization import Factorization
from ..model.heads import W_from_p
from ..model.model import Model
from ..numerics import affine_hull_tol, lambda_min_of_verdict, mse_resolution, numerical_tolerance
from ..statistics import basis as basis_mod
from ..statistics.features import Features
from .certificate import Certificate
from .domains import FULL

__all__ = ["Extended", "Hyperplane", "affine_hull", "block_map", "certify_extended", "extended", "fit_extended",
           "held_elsewhere", "held_out_sums",
           "extended_moments", "hull_note"]


@dataclass
class Extended:
    """The extended canonical Lambda~ (module docstring), factorized once per Features (cached on its
    factor_cache): `fac` of the (n + k) block, the MHLA block's structure (`fac0.structure`), and `B` (D + 1, k),
    the map of the accumulated f_b to the affine block's features B^T f_b (`block_map`)."""

    fac: Factorization
    fac0: Factorization
    B: np.ndarray
    # the hyperplanes the wide tokens lie on (`affine_hull`): the directions the block leaves out
    hull: list[Hyperplane] = field(default_factory=list)

    @property
    def n(self) -> int:
        """The MHLA block's size (its features on the data's spans)."""
        return int(self.fac0.n)

    @property
    def n_full(self) -> int:
        """Every feature: psi of the MHLA and the affine block's k."""
        return int(self.fac0.n_full + self.B.shape[1])


@dataclass
class Hyperplane:
    """A hyperplane a^T x = c (|a| = 1) that every query's wide token lies on: the function (a, -c)^T (x_wide, 1)
    vanishes on the data, so the affine map is determined only up to a multiple of it."""

    normal: np.ndarray
    offset: float

    def to_dict(self) -> dict[str, object]:
        return {"normal": [float(v) for v in self.normal], "offset": float(self.offset)}

    def describe(self, shown: int = 4) -> str:
        """'a^T x = c (a: [...])' with the largest `shown` entries of a."""
        top = np.argsort(-np.abs(self.normal), kind="stable")[:shown]
        entries = ", ".join(f"a[{i}] = {self.normal[i]:.4g}" for i in sorted(top))
        more = ", ..." if self.normal.size > shown else ""
        return f"a^T x = {self.offset:.6g} (|a| = 1; {entries}{more})"


def affine_hull(feats: Features, W: float) -> tuple[np.ndarray | None, list[Hyperplane]]:
    """(R, planes): where the wide tokens lie on hyperplanes, R (D + 1, r) whitens the accumulated f_b's
    second moment on its range (R^T (sum w f_b f_b^T / sum w) R = I: the eigenvalues above affine_hull_tol of the
    largest); the eigenvectors u below it are the functions u^T f_b = (A_w u)^T f that vanish on the data, each
    named as the hyperplane a^T x = c of v = A_w u = (a, -c) (orthonormalised in f's coordinates first). (None, [])
    where they lie on none."""
    aff = feats.affine
    assert aff is not None  # statistics with the affine block
    G = aff.gram / W
    w, V = np.linalg.eigh(0.5 * (G + G.T))
    top = float(w[-1])
    if not np.isfinite(top) or top <= 0.0:
        return None, []
    null = w <= affine_hull_tol(G.shape[0], feats.n_samples) * top
    if not null.any():
        return None, []
    Nf = np.linalg.qr(aff.f_basis @ V[:, null])[0]
    planes = []
    for v in Nf.T:
        a, c = v[:-1], -float(v[-1])
        norm = float(np.linalg.norm(a))
        sign = -1.0 if a[int(np.argmax(np.abs(a)))] < 0 else 1.0
        planes.append(Hyperplane(sign * a / norm, sign * c / norm))
    return V[:, ~null] / np.sqrt(w[~null]), planes


def held_elsewhere(feats: Features) -> np.ndarray | None:
    """L (D + 1, r): the linear functions L^T f of f = (x_wide, 1) that the MHLA's block holds already, or None. With
    the bias terms and normalize="length" its features n x_t / n and n / n are x_t = P^T x_wide (the reduced tokens
    are x_wide P, `mhla reduce`) and 1: L = [[P, 0], [0, 1]] (the constant alone when P is unknown)."""
    aff = feats.affine
    assert aff is not None  # statistics with the affine block
    if not (feats.bias_terms and feats.normalize == "length"):
        return None
    a = aff.width + 1
    if aff.P is None:
        return np.eye(a)[:, -1:]
    L = np.zeros((a, aff.P.shape[1] + 1))
    L[:-1, :-1], L[-1, -1] = aff.P, 1.0
    return L


def block_map(feats: Features, W: float, hull: tuple[np.ndarray | None, list[Hyperplane]] | None = None
              ) -> np.ndarray:
    """B (D + 1, k): the affine block's features f~ = B^T f_b of the accumulated f_b = A_w^T f
    (mhla_cli.statistics.affine_sums). B = A_f, the whitening of f_b's second moment (A_f^T (sum w f_b f_b^T / sum w)
    A_f = I: well conditioned, A_w whitens f nearly), restricted to the orthogonal complement there of the functions
    the MHLA's block holds already (`held_elsewhere`: no direction twice), so that f~ keeps the identity Gram and
    changes orthogonally under an invertible affine map of the wide tokens (and a map of the reduced ones). Where the
    wide tokens lie on hyperplanes A_f whitens f_b on the range of its moment (`affine_hull`, computed unless given)."""
    aff = feats.affine
    assert aff is not None  # statistics with the affine block
    R = (affine_hull(feats, W) if hull is None else hull)[0]
    Af = basis_mod.whitening(aff.gram, W, round32=False) if R is None else R
    L = held_elsewhere(feats)
    if L is None:
        return Af
    # the functions L^T f = (A_f^+ A_w^-1 L)^T f~_all on the data: their directions in the whitened coordinates, and
    # the complement (A_f^+ = A_f^-1 without hyperplanes; on the hull, the pseudo-inverse maps f_b to the range)
    Lb = np.linalg.solve(aff.f_basis, L)
    U = np.linalg.solve(Af, Lb) if R is None else np.linalg.pinv(Af) @ Lb
    Q = np.linalg.qr(U, mode="complete")[0][:, U.shape[1]:]
    return Af @ Q


def extended(feats: Features, device: str | None = None) -> Extended:
    """The factorization of the extended canonical Lambda~ (cached on feats.factor_cache["affine"])."""
    if feats.affine is None:
        raise InputError("the statistics have no affine block: featurize them with the wide tokens (affine_from)")
    feats.canonical()
    cached = feats.factor_cache.get("affine")
    fac0 = FULL.factorize(feats, device)
    if cached is not None and cached.fac0 is fac0:
        return cached
    W = feats.weight if feats.weight > 0 else 1.0
    st = fac0.structure
    G = np.asarray(fac0.lam) * fac0.scale
    aff = feats.affine
    hull = affine_hull(feats, W)
    B = block_map(feats, W, hull)
    cross = aff.cross @ B / W
    CA = cross if feats.on_spans else st.restrict(cross)
    Gf = B.T @ (aff.gram / W) @ B
    n, k = G.shape[0], B.shape[1]
    M = np.empty((n + k, n + k))
    M[:n, :n] = G
    M[:n, n:] = CA
    M[n:, :n] = CA.T
    M[n:, n:] = 0.5 * (Gf + Gf.T)
    fac = Factorization(M, n + k, 1.0, device)
    ext = Extended(fac, fac0, B, hull[1])
    feats.factor_cache["affine"] = ext
    return ext


def _rhs(feats: Features, ext: Extended) -> np.ndarray:
    """The extended canonical moments [m~; A_f^T sum w f y^T / sum w] (n + k, e) in the block's coordinates."""
    W = feats.weight if feats.weight > 0 else 1.0
    _, _, moments_b = feats.solver_stats()
    assert moments_b is not None and feats.affine is not None and feats.affine.moments is not None  # targets
    st = ext.fac0.structure
    mc = moments_b / W if feats.on_spans else st.restrict(moments_b / W)
    mf = ext.B.T @ feats.affine.moments / W
    return np.vstack([mc, mf])


def held_out_sums(val: Features, ext: Extended) -> tuple[np.ndarray, np.ndarray]:
    """(G, M): the extended Gram and moments of the held-out statistics `val` (raw sums, not divided by their weight)
    in the coordinates of a training fit's `ext`: `val` in the training basis (to_basis), its affine sums in the
    training's f_b (the same estimate for every fold: affine_sums.WideSource.estimate_basis) mapped by ext.B."""
    aff = val.affine
    assert aff is not None and aff.moments is not None and val.basis_gram is not None  # the block, with targets
    assert val.basis_moments is not None  # in a basis, with targets
    st, B = ext.fac0.structure, ext.B
    cross = aff.cross @ B
    CA = cross if val.on_spans else st.restrict(cross)
    G11 = st.compress(val.basis_gram)
    G22 = B.T @ aff.gram @ B
    G = np.block([[G11, CA], [CA.T, 0.5 * (G22 + G22.T)]])
    M = np.vstack([st.restrict(val.basis_moments), B.T @ aff.moments])
    return G, M


def extended_moments(feats: Features, ext: Extended) -> np.ndarray:
    """The right-hand side of the extended normal equations (`_rhs`)."""
    return _rhs(feats, ext)


def certify_extended(feats: Features, min_eig: float = 0.0, device: str | None = None) -> Certificate:
    """The certificate of the extended features (module docstring) on the full domain: every input of the reduced
    tokens and every wide token. Its reasons, when the data do not certify, say how the null directions split
    between the MHLA's features and the affine block."""
    if min_eig < 0 or not np.isfinite(min_eig):
        raise InputError(f"min_eig must be a finite number >= 0, got {min_eig}")
    ext = extended(feats, device)
    fac = ext.fac
    m = ext.n_full
    lmax = fac.lambda_max()
    tol = numerical_tolerance(lmax, m)
    threshold = max(tol, float(min_eig))
    st = ext.fac0.structure
    if lmax <= 0:
        proof = "all features are zero"
    elif st.n < st.n_full:
        proof = "exact null directions outside the data's spans"
    elif feats.n_samples < m:
        proof = "N < psi samples"
    else:
        proof = "cholesky of Lambda~ - t I" if fac.proves_above(threshold) else "cholesky of Lambda~ - t I failed"
    identifiable = proof == "cholesky of Lambda~ - t I"
    lmin = fac.lambda_min() if st.n == st.n_full else 0.0
    w = fac.known_eigenvalues()
    if w is not None and st.n < st.n_full:
        w = np.sort(np.concatenate([np.zeros(st.n_full - st.n), w]))
    cert = Certificate(identifiable, lmin, lmax, fac.rank(tol), m, feats.n_samples, threshold, tol, float(min_eig),
                       "full", feats.d, feats.d, eigenvalues=w,
                       span_features=st.n + ext.B.shape[1], span_pairs=st.a, span_last_tokens=st.b, proof=proof,
                       estimated=[] if fac.known_eigenvalues() is not None else ["lambda_min", "lambda_max"],
                       device=fac.device).bound_lambda_min()
    if ext.hull:
        cert.hyperplanes = [h.to_dict() for h in ext.hull]
        cert.notes = [hull_note(ext.hull)]
    if not identifiable:
        cert.reasons = _reasons(feats, cert, ext, threshold)
    cert.seconds = dict(fac.seconds)
    return cert


def hull_note(hull: list[Hyperplane]) -> str:
    """What the hyperplanes of the wide tokens mean for the certificate (module docstring)."""
    planes = "; ".join(h.describe() for h in hull)
    which = "that direction" if len(hull) == 1 else f"those {len(hull)} directions"
    return (f"the wide tokens lie on {'the hyperplane' if len(hull) == 1 else 'the hyperplanes'} {planes}: the affine "
            f"map is determined up to {which} (a multiple of a^T x - c, zero on every such token); the verdict is of "
            "the function on the tokens' affine hull")


def _reasons(feats: Features, cert: Certificate, ext: Extended, threshold: float) -> list[str]:
    """Why the extended features do not certify: counts, exact nulls, and where the null directions lie."""
    reasons = []
    m, st = cert.n_features, ext.fac0.structure
    if feats.n_samples < m:
        reasons.append(f"N = {feats.n_samples} samples < {m} features: at least {m} samples are needed "
                       "(necessary, not sufficient)")
    if st.n < st.n_full:
        reasons.append(f"the data's S matrices and queries leave {st.n_full - st.n} of the MHLA's {st.n_full} "
                       "features outside their spans: exact null directions")
    if cert.lambda_max > 0:
        _, N = ext.fac.null_space(threshold)
        if N.shape[1]:
            on_affine = float(np.einsum("ij,ij->", N[ext.n:], N[ext.n:])) / N.shape[1]
            reasons.append(f"{N.shape[1]} direction(s) of the extended features are excited less than the threshold "
                           f"{threshold:.3g}: {100 * (1 - on_affine):.3g} % of their weight on the MHLA's features, "
                           f"{100 * on_affine:.3g} % on the affine block of the wide token (weight there: the block "
                           "collinear with the MHLA's terms, or its coordinates nearly collinear in the data; exact "
                           "hyperplanes of the wide tokens are left out already)")
        elif cert.proof == "cholesky of Lambda~ - t I failed":
            est = cert.lambda_min if cert.lambda_min_estimate is None else cert.lambda_min_estimate
            reasons.append(f"the Cholesky of Lambda~ - t I (t = {threshold:.3g}) failed although lambda_min is "
                           f"estimated at {est:.3g}: the smallest eigenvalue is within rounding of the threshold")
    return reasons


def fit_extended(feats: Features, ridge: float = 0.0, device: str | None = None) -> Model:
    """Least squares over the extended features (lstsq.fit's rules: ridge in the units of the reported lambda_max,
    the minimum norm in the canonical coordinates of both blocks). The model holds the MHLA's coef as lstsq.fit does
    and `affine_coef` (d, D + 1): the affine map y = affine_coef (x_wide, 1) in the wide tokens' own coordinates."""
    from .lstsq import solve_system as _solve

    if not feats.has_targets:
        raise InputError("the data have no 'targets': fit needs (X, y) pairs")
    if ridge < 0 or not np.isfinite(ridge):
        raise InputError(f"ridge must be a finite number >= 0, got {ridge}")
    A, _, _ = feats.solver_stats()
    assert feats.affine is not None and feats.target_gram is not None  # the affine block, has_targets
    ext = extended(feats, device)
    fac, st = ext.fac, ext.fac0.structure
    rhs = _rhs(feats, ext)
    m = ext.n_full
    lmax = fac.lambda_max()
    tol = numerical_tolerance(lmax, m)
    pd = lmax > 0 and fac.proves_above(tol)
    lmin = fac.lambda_min()
    t0 = time.perf_counter()
    sol = _solve(fac, rhs, ridge, tol, pd)
    seconds = {**fac.seconds, "solve": time.perf_counter() - t0}
    n = ext.n
    coef_b = st.embed(sol[:n]).T
    with np.errstate(over="ignore", invalid="ignore"):
        coef = basis_mod.coef_from_basis(A, coef_b)
    affine_coef = (feats.affine.f_basis @ ext.B @ sol[n:]).T  # y = sol_f^T B^T A_w^T f
    # the train MSE on the extended sums: sol^T Lambda~ sol - 2 sol . rhs + tr(target_gram) / sum w
    W = feats.weight if feats.weight > 0 else 1.0
    quad = float(np.sum((sol.T @ np.asarray(fac.lam)) * sol.T)) * fac.scale
    sse = quad - 2 * float(np.sum(sol * rhs)) + float(np.trace(feats.target_gram)) / W
    d_out = feats.n_outputs
    identifiable = bool(pd and st.n == st.n_full and feats.n_samples >= m)
    lmin, bound = lambda_min_of_verdict(lmin, tol, identifiable)  # never contradicting the verdict
    info = {
        "ridge": float(ridge), "train_mse": max(sse, 0.0) / d_out,
        "mse_resolution": mse_resolution(m, float(np.trace(feats.target_gram)) + quad * W, W, d_out),
        "lambda_min": lmin, "lambda_max": lmax, "identifiable": identifiable,
        "condition_number": ((lmax + ridge) / (max(lmin, 0.0) + ridge) if ridge > 0
                             else (lmax / lmin) if lmin > tol else float("inf")),
        "rank": fac.rank(tol), "n_features": m, "n_samples": feats.n_samples, "method": "lstsq",
        "basis": "canonical", "normalize": feats.normalize, "seconds": seconds,
        "affine_width": int(feats.affine.width),
    }
    if bound is not None:
        info["lambda_min_bound"] = bound
    if feats.bias_terms:
        info["bias_terms"] = True
    if ext.hull:
        info["affine_hyperplanes"] = [h.to_dict() for h in ext.hull]
    if feats.affine.source is not None:
        info["affine_source"] = dict(feats.affine.source)
    return Model(coef=coef, W=W_from_p(coef), d=feats.d, info=info, coef_b=coef_b, basis=np.array(A),
                 affine_coef=affine_coef)
