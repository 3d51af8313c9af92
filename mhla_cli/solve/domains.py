"""Certificate domains: the inputs a certificate speaks about, each one class.

A domain owns its map (from the canonical features to the domain's), its dimensions (dim U, dim U_n),
its feature names, its part of a failed certificate's explanation, and its factorization of the
canonical Lambda~ (mhla_cli.statistics.basis), computed once per Features and domain and cached there
(`factorize`), shared by certify, fit, `certify --on` and the witness.

- `Full` ("full", the paper's): every input of R^d; the features are all psi canonical features.
- `Observed` ("observed"): inputs whose tokens lie in U = span of the data's tokens and whose last
  token lies in U_n = span of their last tokens; the features of X B and C^T x_n for orthonormal bases
  B, C of the whitened U, U_n.

A new domain is one subclass of `Domain` with a `name`: it is registered in `DOMAINS` (what
`--domain NAME` / `domain=` look up through `get_domain`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .. import bias_terms as bias_mod
from ..errors import InputError
from ..feature_map import feature_index, pair_index
from ..linalg import device as device_mod
from ..linalg.factorization import Factorization
from ..numerics import EPS, ORTHOGONAL_TOL, observed_span_tol
from ..statistics import basis as basis_mod
from ..statistics import structure as structure_mod
from ..statistics.basis import kron_congruence, orth_pair_map
from ..statistics.features import Features
from ..statistics.structure import find_structure

# psi x psi float64 matrices a factorization holds on a device: the matrix, its Cholesky factor or
# eigenvectors, and torch.linalg's work (eigh: about one more)
DEVICE_COPIES = 3

# name -> the domain (filled by Domain.__init_subclass__)
DOMAINS: dict[str, Domain] = {}


class Domain:
    """A certificate domain (module docstring). Subclasses set `name` and override the hooks."""

    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            DOMAINS[cls.name] = cls()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ------------------------------------------------------------------ the map and the dimensions
    def dims(self, feats: Features) -> tuple[int, int]:
        """(dim U, dim U_n): the dimensions of the domain's tokens and last tokens."""
        raise NotImplementedError

    def map_b(self, feats: Features) -> np.ndarray | None:
        """T_b: the canonical features -> the domain's features (orthonormal rows; None: the identity)."""
        raise NotImplementedError

    def map(self, feats: Features) -> np.ndarray:
        """T: H (tokens' own feature coordinates) -> the domain's features (T = T_b M_A)."""
        T, A = self.map_b(feats), feats.basis
        assert A is not None  # factorized: the statistics are in their basis
        return basis_mod.feature_map(A) if T is None else basis_mod.coef_from_basis(A, T)

    def row_maps(self, feats: Features) -> tuple[np.ndarray, np.ndarray] | None:
        """(P, C) with T_b (s (x) x) = (P s) (x) (C^T x) for canonical pair rows s and tokens x (None: identity)."""
        return None

    def inputs(self, feats: Features) -> tuple[np.ndarray, np.ndarray] | None:
        """Orthonormal bases (own coordinates) of the domain's tokens and last tokens (None: all of R^d)."""
        return None

    # ------------------------------------------------------------------ the factorization
    def factorize(self, feats: Features, device: str | None = None) -> Factorization:
        """The factorization of the domain's Lambda~ (cached on feats.factor_cache under `name`)."""
        device = device_mod.check_device(device)
        feats.canonical()
        cache = feats.factor_cache
        if self.name not in cache:
            cache[self.name] = self._factorize(feats, device)
        return cache[self.name]

    def _factorize(self, feats: Features, device: str | None) -> Factorization:
        raise NotImplementedError

    # ------------------------------------------------------------------ the explanation
    def feature_names(self, feats: Features, r: int, s: int) -> list[str]:
        """The names of the domain's features, in their order."""
        raise NotImplementedError

    def null_vectors(self, A: np.ndarray, fac: Factorization, threshold: float) -> np.ndarray:
        """Orthonormal basis of the eigenvalues <= threshold in the certificate's coordinates: the exact
        nulls outside the data's spans and the block's own (the domain's features)."""
        st = fac.structure
        return np.hstack([st.outside(), st.embed(fac.null_space(threshold)[1])])

    def to_features(self, feats: Features, null: np.ndarray) -> np.ndarray:
        """Null vectors of the certificate -> directions in the tokens' own feature coordinates."""
        return null

    def block_factors(self, A: np.ndarray, E: np.ndarray, F: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The block's embedding E (x) F in the coordinates of `null_vectors` (as two Kronecker factors)."""
        return E, F

    def zero_coordinates(self, feats: Features) -> tuple[list[str], Any]:
        """(reasons naming token coordinates that are always 0, a predicate: feature i identically zero)."""
        return [], None

    def unresolved(self, feats: Features) -> int:
        """Token directions whose variance float64 cannot tell from zero (basis.unresolved), if it matters here."""
        return 0

    def probe_description(self) -> str:
        """How the witness draws its probe input from this domain."""
        return "standard Gaussian tokens"


class Full(Domain):
    """Every input in R^d (the paper's domain): all psi canonical features."""

    name = "full"

    def dims(self, feats: Features) -> tuple[int, int]:
        return feats.d, feats.d

    def map_b(self, feats: Features) -> np.ndarray | None:
        return None

    def _factorize(self, feats: Features, device: str | None) -> Factorization:
        # Lambda~ = basis_gram / sum w, held as the sums and the scale 1 / sum w (no psi x psi copy)
        gram_b, scale = feats.basis_gram, 1.0 / (feats.weight if feats.weight > 0 else 1.0)
        assert gram_b is not None  # in their basis (solver_stats)
        if feats.on_spans:  # featurize held only the block on the data's spans
            assert feats.span_pairs is not None and feats.span_last is not None
            st = structure_mod.Structure(_complete(feats.span_pairs), _complete(feats.span_last),
                                         feats.span_pairs.shape[1], feats.span_last.shape[1])
            fac = Factorization(gram_b, st.n_full, scale, device)
        else:
            st = find_structure(gram_b, feats.d)
            fac = Factorization(st.compress(gram_b), st.n_full, scale, device)
        _check_device_memory(fac)
        fac.structure = st
        return fac

    def feature_names(self, feats: Features, r: int, s: int) -> list[str]:
        if feats.bias_terms:  # the tokens (x, 1): S, m = sum_i x_i and n by name (mhla_cli.bias_terms)
            return bias_mod.feature_names(feats.d - 1)
        return [f"S[{j},{k}]*x_n[{l}]" for j, k, l in feature_index(feats.d)]

    def null_vectors(self, A: np.ndarray, fac: Factorization, threshold: float) -> np.ndarray:
        null = super().null_vectors(A, fac, threshold)
        if null.shape[1]:
            # v^T H_b = v^T M_A H: the same direction in the tokens' own feature coordinates
            null = np.linalg.qr(basis_mod.coef_from_basis(A, null.T).T)[0]
        return null

    def block_factors(self, A: np.ndarray, E: np.ndarray, F: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # M_A^-1 (E (x) F) = (P_A^-1 D^-1 E) (x) (A^-T F)
        P, R = basis_mod.from_basis_factors(A)
        return P @ E, R @ F

    def zero_coordinates(self, feats: Features) -> tuple[list[str], Any]:
        # token_gram / last_token_gram are sums of squares in the tokens' own coordinates: a zero
        # diagonal entry means that coordinate is exactly 0 in every token (or last token).
        zt = np.flatnonzero(np.diag(feats.token_gram) == 0.0)
        zl = np.flatnonzero(np.diag(feats.last_token_gram) == 0.0)
        reasons = []
        if zt.size:
            reasons.append(f"token coordinate(s) {', '.join(map(str, zt))} are always 0: features "
                           "S[j,k] touching them vanish (the observed domain leaves them out)")
        if zl.size:
            reasons.append(f"last-token coordinate(s) {', '.join(map(str, zl))} are always 0: features "
                           "S[j,k]*x_n[l] with those l vanish (the observed domain leaves them out)")
        idx = feature_index(feats.d)
        zero_t, zero_l = set(zt.tolist()), set(zl.tolist())

        def exactly_zero(i: int) -> bool:
            j, k, l = idx[i]
            return int(j) in zero_t or int(k) in zero_t or int(l) in zero_l

        return reasons, exactly_zero

    def unresolved(self, feats: Features) -> int:
        # counted where the whitening left them, in the canonical coordinates (as certify --on counts them)
        assert feats.basis_token_gram is not None  # in their basis
        return basis_mod.unresolved_canonical(feats.basis_token_gram)


class Observed(Domain):
    """Inputs like the data: tokens in U (span of the data's tokens), last token in U_n (of their last tokens)."""

    name = "observed"

    def dims(self, feats: Features) -> tuple[int, int]:
        B, C = _observed_bases_b(feats)
        return B.shape[1], C.shape[1]

    def map_b(self, feats: Features) -> np.ndarray | None:
        # T_b = kron(D P_B D^-1, C^T) has orthonormal rows, so the observed spectrum is as unit-free as the full one
        B, C = _observed_bases_b(feats)
        return np.kron(orth_pair_map(B), C.T)

    def row_maps(self, feats: Features) -> tuple[np.ndarray, np.ndarray] | None:
        B, C = _observed_bases_b(feats)
        return orth_pair_map(B), C

    def inputs(self, feats: Features) -> tuple[np.ndarray, np.ndarray] | None:
        return observed_bases(feats)

    def _factorize(self, feats: Features, device: str | None) -> Factorization:
        full = FULL.factorize(feats, device)
        B, C = _observed_bases_b(feats)
        if B.shape[1] == feats.d and C.shape[1] == feats.d:
            return full  # U = U_n = R^d: the observed domain is the full one
        pm, tm = orth_pair_map(B), C.T
        st_o, R1, R2 = structure_mod.observed(full.structure, pm, tm)
        if _orthogonal(R1) and _orthogonal(R2):
            # the spans lie in the observed domain isometrically: the same block, in the coordinates
            # (P_B E) (x) (C^T F); its decompositions are shared with the full domain's
            st_o = structure_mod.Structure(_complete(pm @ full.structure.E), _complete(tm @ full.structure.F),
                                           full.structure.a, full.structure.b)
            return full.share(st_o.n_full, st_o)
        assert full.lam is not None  # the full domain's factorization holds its matrix
        fac = Factorization(kron_congruence(R1, R2, full.lam), st_o.n_full, full.scale, device)
        fac.structure = st_o
        _check_device_memory(fac)
        return fac

    def feature_names(self, feats: Features, r: int, s: int) -> list[str]:
        # S' = B^T S B and x_n' = C^T x_n in orthonormal bases of U and U_n
        jr, kr = pair_index(r)
        return [f"S'[{a},{b}]*x_n'[{c}]" for a, b in zip(jr, kr) for c in range(s)]

    def to_features(self, feats: Features, null: np.ndarray) -> np.ndarray:
        # v' null for Lambda' = T Lambda_D T^T  =>  T^T v' is null for Lambda_D (PSD), and it changes
        # the function on inputs of the observed domain (tokens in U, last token in U_n)
        return self.map(feats).T @ null

    def probe_description(self) -> str:
        return ("tokens standard Gaussian in the span U of the data's tokens, last token in the span U_n of "
                "their last tokens")


FULL, OBSERVED = DOMAINS["full"], DOMAINS["observed"]


def get_domain(domain: str | Domain) -> Domain:
    """The domain of a name ("full", "observed", ...: `--domain` / `domain=`) or the domain itself."""
    if isinstance(domain, Domain):
        return domain
    if domain not in DOMAINS:
        raise InputError(f"unknown domain '{domain}', expected {' or '.join(DOMAINS)}")
    return DOMAINS[domain]


def check_domain(domain: str) -> str:
    """Validate a certificate domain: "full" (all inputs) or "observed" (tokens in the data's spans)."""
    return get_domain(domain).name


def domain_map(feats: Features, domain: str | Domain) -> tuple[np.ndarray, int, int]:
    """The map T from H (tokens' own coordinates) to the features the certificate of `domain` uses,
    and the domain's dimensions (Full: the canonical map M_A, Ht(X A) = M_A H(X); Observed: the
    canonical features of X A B and C^T A^T x_n for orthonormal bases B, C of the whitened U and U_n)."""
    dom = get_domain(domain)
    return (dom.map(feats), *dom.dims(feats))


def factorize(feats: Features, domain: str | Domain = "full", device: str | None = None) -> Factorization:
    """The factorization of the canonical Lambda~ (or its restriction to `domain`), computed once
    per Features and domain and shared by certify, fit, `certify --on` and the witness.

    `device` (mhla_cli.linalg.device): where a new factorization runs (torch.linalg; its free memory is
    checked first); one already computed is reused wherever it ran.

    Only the block of Lambda~ on the data's spans is factorized (mhla_cli.statistics.structure): `fac.structure`
    maps its coordinates to the domain's features, and the directions outside it are exact zeros.
    """
    return get_domain(domain).factorize(feats, device)


def _eigh(a: np.ndarray, vectors: bool = True) -> Any:
    """LAPACK symmetric eigensolver (scipy is imported here, not at start-up: docs/performance_startup.md)."""
    import scipy.linalg

    return scipy.linalg.eigh(a, eigvals_only=not vectors)


def range_basis(gram: np.ndarray, rel_tol: float) -> np.ndarray:
    """Orthonormal basis (d, r) of the numerical range of a PSD matrix; the identity when full rank."""
    w, v = _eigh(gram)
    keep = w > rel_tol * max(w[-1], 0.0)
    if keep.all():
        return np.eye(gram.shape[0])
    return v[:, keep][:, ::-1]


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

    feats.canonical()  # token_gram and last_token_gram in the canonical basis (A^T G A, accumulated from X A)
    tg, lg = feats.basis_token_gram, feats.basis_last_token_gram
    assert tg is not None and lg is not None  # canonical()
    return range_basis(tg, rel(feats.n_tokens)), range_basis(lg, rel(feats.n_samples))


def observed_bases(feats: Features) -> tuple[np.ndarray, np.ndarray]:
    """Orthonormal bases B (d, r) of U = span of all tokens and C (d, s) of U_n = span of last tokens.

    In the tokens' own coordinates (computed in the canonical basis, where the ranks are well resolved).
    """
    B, C = _observed_bases_b(feats)
    A = feats.basis
    assert A is not None  # canonical()
    # column vectors: x_b = A^T x, so a subspace spanned by B_b is spanned by A^-T B_b
    AinvT = np.linalg.inv(A).T
    return np.linalg.qr(AinvT @ B)[0], np.linalg.qr(AinvT @ C)[0]


def _check_device_memory(fac: Factorization) -> None:
    device_mod.check_device_memory(fac.backend, DEVICE_COPIES * 8 * fac.n ** 2,
                                   f"the factorization of {fac.n} features")


def _orthogonal(R: np.ndarray) -> bool:
    """R is square and orthogonal to ORTHOGONAL_TOL."""
    return R.shape[0] == R.shape[1] and float(np.abs(R.T @ R - np.eye(R.shape[0])).max(initial=0.0)) <= ORTHOGONAL_TOL


def _complete(E: np.ndarray) -> np.ndarray:
    """[E, E_perp]: orthonormal columns E (n, a) completed to an orthogonal matrix (E kept as it is)."""
    Q = np.linalg.qr(E, mode="complete")[0]
    return np.hstack([E, Q[:, E.shape[1]:]])
