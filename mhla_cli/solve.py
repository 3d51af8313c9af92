"""Algorithm 1 (least squares on the sufficient statistics) and the certificate of Lemma 2.3."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import formats
from .errors import InputError
from .features import feature_index, n_features, pair_index
from .stream import Features

EPS = float(np.finfo(np.float64).eps)


def numerical_tolerance(lambda_max: float, n: int) -> float:
    """Eigenvalues at or below n * eps64 * lambda_max are zero to float64 accumulation accuracy.

    This is the rule of numpy.linalg.matrix_rank: rounding a sum of float64 products perturbs the
    psi x psi matrix by about eps * its norm per entry, i.e. at most ~ psi * eps * lambda_max in
    spectral norm; an exact null direction lifted by rounding stays below it, while real data with
    lambda_min / lambda_max down to ~1e-10 stay far above it.
    """
    return n * EPS * max(lambda_max, 0.0)


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


def pair_map(B: np.ndarray) -> np.ndarray:
    """Matrix A with upper(B^T S B) = A upper(S) for symmetric S, in feature pair order."""
    d, r = B.shape
    j, k = pair_index(d)
    jr, kr = pair_index(r)
    # (B^T S B)[j',k'] = sum_{j<=k} c S[j,k], c = B[j,j']B[k,k'] + B[k,j']B[j,k'] (j<k), B[j,j']B[j,k'] (j=k)
    A = B[j][:, jr] * B[k][:, kr] + B[k][:, jr] * B[j][:, kr]
    A[j == k] *= 0.5
    return A.T


def domain_map(feats: Features, domain: str) -> tuple[np.ndarray | None, int, int]:
    """The map T from H to the features of the observed domain (None for the full domain)."""
    d = feats.d
    if domain == "full":
        return None, d, d
    if domain != "observed":
        raise InputError(f"unknown domain '{domain}', expected full or observed")
    B, C = observed_bases(feats)
    T = np.kron(pair_map(B), C.T)
    return T, B.shape[1], C.shape[1]


def observed_bases(feats: Features) -> tuple[np.ndarray, np.ndarray]:
    """Orthonormal bases B (d, r) of U = span of all tokens and C (d, s) of U_n = span of last tokens."""
    d = feats.d
    eps_in = float(np.finfo(np.dtype(feats.token_dtype)).eps) if feats.token_dtype in ("float16", "float32", "float64") else EPS

    def rel(count: int) -> float:
        # A null direction of the token Gram is lifted (i) by rounding the stored tokens, only to
        # second order (~ d eps_in^2), and (ii) by the float64 accumulation of its sum of `count`
        # outer products: rounding errors add like a random walk, ~ sqrt(count) eps per entry, so
        # d sqrt(count) eps in norm. (d eps alone is exceeded by real rank-3 data of 1500 samples.)
        return max(d * EPS * float(np.sqrt(max(count, 1))), d * eps_in**2)

    return range_basis(feats.token_gram, rel(feats.n_tokens)), range_basis(feats.last_token_gram, rel(feats.n_samples))


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
    null_vectors: np.ndarray | None = None

    @property
    def margin(self) -> float:
        return self.lambda_min - self.threshold

    def to_dict(self) -> dict[str, Any]:
        return {
            "identifiable": self.identifiable, "lambda_min": self.lambda_min, "lambda_max": self.lambda_max,
            "rank": self.rank, "n_features": self.n_features, "n_samples": self.n_samples,
            "threshold": self.threshold, "numerical_tolerance": self.numerical_tolerance,
            "min_eig": self.min_eig, "margin": self.margin, "domain": self.domain,
            "condition_number": (self.lambda_max / self.lambda_min) if self.lambda_min > 0 else None,
            "dim_tokens": self.dim_tokens, "dim_last_tokens": self.dim_last_tokens,
            "reasons": list(self.reasons), "null_features": list(self.null_features),
        }


def certify(feats: Features, min_eig: float = 0.0, domain: str = "full") -> Certificate:
    """Certify that the data determine the learned function (on R^d, or on the observed subspaces)."""
    if min_eig < 0 or not np.isfinite(min_eig):
        raise InputError(f"--min-eig must be a finite number >= 0, got {min_eig}")
    T, r, s = domain_map(feats, domain)
    lam = feats.lambda_d
    if T is not None:
        lam = T @ lam @ T.T
    m = lam.shape[0]
    w = _eigh(lam, vectors=False)  # eigenvectors only when needed to explain a failure
    lmin, lmax = float(w[0]), float(w[-1])
    tol = numerical_tolerance(lmax, m)
    threshold = max(tol, float(min_eig))
    rank = int((w > tol).sum())
    identifiable = bool(lmin > threshold and feats.n_samples >= m and lmax > 0)
    cert = Certificate(identifiable, lmin, lmax, rank, m, feats.n_samples, threshold, tol, float(min_eig),
                       domain, r, s, eigenvalues=w)
    if not identifiable:
        w, v = _eigh(lam)
        null = v[:, w <= threshold]
        cert.null_vectors = null
        cert.reasons, cert.null_features = _explain(feats, cert, null, T is None)
    return cert


def _explain(feats: Features, cert: Certificate, null: np.ndarray, full: bool
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
    if null.shape[1] and cert.lambda_min > cert.numerical_tolerance and cert.min_eig > 0:
        reasons.append(f"lambda_min = {cert.lambda_min:.3g} is full rank but below the demanded "
                       f"--min-eig {cert.min_eig:.3g}")
    if full:
        zt = np.flatnonzero(np.diag(feats.token_gram) <= EPS * max(np.trace(feats.token_gram), 0.0))
        zl = np.flatnonzero(np.diag(feats.last_token_gram) <= EPS * max(np.trace(feats.last_token_gram), 0.0))
        if zt.size:
            reasons.append(f"token coordinate(s) {', '.join(map(str, zt))} are always 0: features "
                           "S[j,k] touching them vanish (try --domain observed)")
        if zl.size:
            reasons.append(f"last-token coordinate(s) {', '.join(map(str, zl))} are always 0: features "
                           "S[j,k]*x_n[l] with those l vanish (try --domain observed)")
    weight = (null**2).sum(axis=1)  # diagonal of the projector onto the null space
    order = np.argsort(-weight)
    names = _feature_names(d, cert, full)
    dead = [int(i) for i in order if weight[i] > 1 - 1e-6]
    mixed = [int(i) for i in order if 1e-6 < weight[i] <= 1 - 1e-6]
    top = [{"feature": names[i], "index": i, "null_weight": float(weight[i])} for i in (dead + mixed)[:20]]
    k = null.shape[1]
    if k:
        desc = f"{k} feature direction(s) are never excited by the data"
        if dead:
            desc += (f"; {len(dead)} single feature(s) are identically zero, e.g. "
                     + ", ".join(names[i] for i in dead[:3]))
        if k > len(dead) and mixed:
            desc += ("; the other directions mix features such as "
                     + ", ".join(names[i] for i in mixed[:4]))
        reasons.append(desc)
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


# Fit results kept as attributes of a model file.
_SAVED_INFO = ("ridge", "train_mse", "lambda_min", "identifiable", "condition_number", "n_samples", "method",
               "n_heads", "weight_decay", "nuclear_lambda", "objective", "normalize")


@dataclass
class Model:
    """A fitted MHLA function: coef p (d, psi) and its minimum-Frobenius-norm W (d^2, d^2)."""

    coef: np.ndarray
    W: np.ndarray
    d: int
    info: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = ()) -> None:
        """Write a model file atomically."""
        attrs = {"d": self.d, "n_features": n_features(self.d)}
        for k in _SAVED_INFO:
            if k in self.info and self.info[k] is not None:
                attrs[k] = self.info[k]
        formats.write_file(path, "model", {"coef": self.coef, "W": self.W}, attrs, inputs)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Model:
        """Read and validate a model file (coef and W must describe the same function)."""
        from .heads import p_from_W

        with formats.open_input(path) as f:
            formats.expect_kind(f, path, "model")
            coef = formats.read_array(f, "coef", path).astype(np.float64)
            if coef.ndim != 2:
                raise InputError(f"'coef' has shape {coef.shape}, expected (d, psi)", path)
            d = formats.d_from_psi_shape(coef.shape, path, "coef")
            if coef.shape[0] != d:
                raise InputError(f"'coef' has shape {coef.shape}, expected (d, psi) = ({d}, {n_features(d)})", path)
            if not np.isfinite(coef).all():
                raise InputError("'coef' contains NaN or Inf", path)
            if "W" in f:
                W = formats.read_array(f, "W", path).astype(np.float64)
                if W.shape != (d * d, d * d):
                    raise InputError(f"'W' has shape {W.shape}, expected (d^2, d^2) = ({d*d}, {d*d}) "
                                     f"to match coef", path)
                scale = max(float(np.abs(coef).max()), 1e-300)
                if not np.allclose(p_from_W(W), coef, rtol=0, atol=1e-8 * scale):
                    raise InputError("'W' and 'coef' describe different functions; the file is inconsistent", path)
            else:
                from .heads import W_from_p

                W = W_from_p(coef)
            info = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()
                    if k in _SAVED_INFO}
        return cls(coef=coef, W=W, d=d, info=info)


def fit(feats: Features, ridge: float = 0.0) -> Model:
    """Least squares over p on the sufficient statistics (Algorithm 1, step 1).

    Solves (gram / N + ridge I) p^T = moments / N; with ridge = 0 and a singular gram it returns
    the minimum-norm solution (pseudo-inverse with the certificate's numerical tolerance).
    """
    from .heads import W_from_p

    if not feats.has_targets:
        raise InputError("the data have no 'targets': fit needs (X, y) pairs")
    if ridge < 0 or not np.isfinite(ridge):
        raise InputError(f"--ridge must be a finite number >= 0, got {ridge}")
    N = feats.n_samples
    psi = feats.n_features
    lam = feats.gram / N
    w = _eigh(lam, vectors=False)
    lmin, lmax = float(w[0]), float(w[-1])
    tol = numerical_tolerance(lmax, psi)
    coef = None
    if ridge > 0 or lmin > tol:
        # Positive definite: a Cholesky solve (~10x cheaper than the eigenvectors).
        import scipy.linalg

        try:
            factor = scipy.linalg.cho_factor(lam + ridge * np.eye(psi), lower=True, check_finite=False)
            coef = scipy.linalg.cho_solve(factor, feats.moments / N, check_finite=False).T
        except scipy.linalg.LinAlgError:
            coef = None
    if coef is None:
        # Singular (or numerically so): the minimum-norm solution, pseudo-inverse with the
        # certificate's tolerance.
        w, v = _eigh(lam)
        rhs = v.T @ (feats.moments / N)
        if ridge > 0:
            inv = 1.0 / (w + ridge)
        else:
            inv = np.where(w > tol, 1.0 / np.where(w > tol, w, 1.0), 0.0)
        coef = (v @ (inv[:, None] * rhs)).T
    identifiable = bool(lmin > tol and N >= psi)
    mse, resolution = train_mse(feats, coef)
    # Condition number of the system actually solved (regularised when ridge > 0).
    if ridge > 0:
        cond = (lmax + ridge) / (max(lmin, 0.0) + ridge)
    else:
        cond = (lmax / lmin) if lmin > tol else float("inf")
    info = {
        "ridge": float(ridge), "train_mse": mse, "mse_resolution": resolution, "lambda_min": lmin,
        "lambda_max": lmax, "identifiable": identifiable, "condition_number": cond,
        "rank": int((w > tol).sum()), "n_features": psi, "n_samples": N, "method": "lstsq",
    }
    return Model(coef=coef, W=W_from_p(coef), d=feats.d, info=info)


def train_mse(feats: Features, coef: np.ndarray) -> tuple[float, float]:
    """Mean squared error over the N*d outputs from the statistics alone, and its float64 resolution.

    sum_i ||p H_i - y_i||^2 = tr(p gram p^T) - 2 tr(p moments) + tr(target_gram); cancellation limits
    the accuracy to about eps * tr(target_gram).
    """
    N, d = feats.n_samples, feats.d
    pm = coef @ feats.moments
    sse = float(np.einsum("ij,jk,ik->", coef, feats.gram, coef) - 2 * np.trace(pm) + np.trace(feats.target_gram))
    scale = float(np.trace(feats.target_gram)) + float(np.einsum("ij,jk,ik->", coef, feats.gram, coef))
    resolution = 8 * feats.n_features * EPS * scale / (N * d)
    return max(sse, 0.0) / (N * d), resolution
