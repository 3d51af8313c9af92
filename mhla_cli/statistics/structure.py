"""The data's structure: the spans that hold the range of the Gram, found exactly and cheaply.

Every feature vector is a Kronecker product h = s (x) x_n (s = the distinct entries of S in
orthonormal pair coordinates, x_n the last token; features pair-major, l fastest), so the Gram
Lambda = (1/N) sum w h h^T has its range in P (x) U_n, P = span{s_i}, U_n = span{x_n,i}
(docs/formats_features.md, "Features on the data's spans"). Both spans are read off the two partial
traces of Lambda, a q x q and a d x d matrix (q = d(d+1)/2):

    Tr_l Lambda = (1/N) sum w ||x_n||^2 s s^T,     Tr_s Lambda = (1/N) sum w ||s||^2 x_n x_n^T.

If v^T (Tr_l Lambda) v = 0 then (v (x) e_l)^T Lambda (v (x) e_l) = 0 for every l, so Lambda kills
v (x) R^d (Lambda is PSD): outside E (x) F (orthonormal bases of the two ranges) every direction is an
exact null direction, known without factorizing psi x psi. With Q = E (x) F orthonormal,

    Lambda = Q Lambda_r Q^T,   Lambda_r = Q^T Lambda Q   (a b x a b),

so the eigenvalues of Lambda are those of Lambda_r and psi - a b zeros, and least squares, the
minimum-norm solution and ridge (all on moments in the range of Q) are taken on Lambda_r exactly.
The spans are basis-free, so this composes with the canonical basis (mhla_cli.statistics.basis).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mhla_cli.statistics.basis import kron_apply, kron_congruence

from mhla_cli.numerics import EPS, STRUCTURE_FACTOR


@dataclass
class Structure:
    """Orthogonal bases of the pair and last-token coordinates whose leading a and b columns span
    the ranges of the two partial traces; the features outside the first a (x) b block are null."""

    pairs: np.ndarray  # (q, q) orthogonal
    last: np.ndarray  # (d, d) orthogonal
    a: int
    b: int
    is_identity: bool = False  # pairs and last are identity matrices (nothing to rotate)

    @classmethod
    def identity(cls, q: int, d: int) -> "Structure":
        """No structure: the block is everything, in the given coordinates."""
        return cls(np.eye(q), np.eye(d), q, d, is_identity=True)

    @property
    def n_full(self) -> int:
        return int(self.pairs.shape[0] * self.last.shape[0])

    @property
    def n(self) -> int:
        return self.a * self.b

    @property
    def on_spans(self) -> bool:
        return self.n < self.n_full

    @property
    def E(self) -> np.ndarray:
        return self.pairs[:, :self.a]

    @property
    def F(self) -> np.ndarray:
        return self.last[:, :self.b]

    def compress(self, lam: np.ndarray) -> np.ndarray:
        """Q^T lam Q (a b x a b) of a full (n_full x n_full) matrix, through the Kronecker structure."""
        if self.is_identity:
            return lam
        return kron_congruence(self.E.T, self.F.T, lam)

    def restrict(self, x: np.ndarray) -> np.ndarray:
        """Q^T x for x (n_full, m)."""
        if self.is_identity:
            return x
        return kron_apply(self.E.T, self.F.T, x)

    def embed(self, x: np.ndarray) -> np.ndarray:
        """Q x for x (n, m): reduced coordinates -> full ones."""
        if self.is_identity:
            return x
        return kron_apply(self.E, self.F, x)

    def outside(self) -> np.ndarray:
        """Orthonormal columns (n_full, n_full - n) spanning the complement of Q (the exact nulls)."""
        q, d = self.pairs.shape[0], self.last.shape[0]
        keep = np.zeros((q, d), dtype=bool)
        keep[:self.a, :self.b] = True
        cols = np.flatnonzero(~keep.ravel())
        out = np.empty((self.n_full, cols.size))
        for j0 in range(0, cols.size, 4096):  # bounded temporaries: one block of unit columns at a time
            c = cols[j0:j0 + 4096]
            unit = np.zeros((self.n_full, c.size))
            unit[c, np.arange(c.size)] = 1.0
            out[:, j0:j0 + c.size] = kron_apply(self.pairs, self.last, unit)
        return out

    def split_rows(self, s: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For rows h = s (x) x: (Q^T h rows (R, n), ||h - Q Q^T h||^2, ||h||^2), without forming h.

        h - Q Q^T h = s_perp (x) x + s_par (x) x_perp, two orthogonal terms; each norm is taken from
        the components themselves (no cancellation).
        """
        if self.is_identity:
            ns, nx = np.einsum("ij,ij->i", s, s), np.einsum("ij,ij->i", x, x)
            return (s[:, :, None] * x[:, None, :]).reshape(s.shape[0], self.n), np.zeros(s.shape[0]), ns * nx
        sp, so = s @ self.E, s @ self.pairs[:, self.a:]
        xp, xo = x @ self.F, x @ self.last[:, self.b:]
        ns_par, ns_out = np.einsum("ij,ij->i", sp, sp), np.einsum("ij,ij->i", so, so)
        nx_par, nx_out = np.einsum("ij,ij->i", xp, xp), np.einsum("ij,ij->i", xo, xo)
        inside = (sp[:, :, None] * xp[:, None, :]).reshape(s.shape[0], self.n)
        out = ns_out * (nx_par + nx_out) + ns_par * nx_out
        return inside, out, (ns_par + ns_out) * (nx_par + nx_out)


def partial_traces(lam: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """(Tr_l lam (q x q), Tr_s lam (d x d)) of a (q d x q d) matrix, features pair-major, l fastest."""
    q = lam.shape[0] // d
    v = lam.reshape(q, d, q, d)
    return np.einsum("aibi->ab", v), np.einsum("aiaj->ij", v)


def _eig_desc(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues (descending) and eigenvectors (an orthogonal matrix) of a symmetric matrix.

    numpy's LAPACK (dsyevd), not scipy's: featurize on K (from symgram.SYMGRAM_MIN_D) needs nothing
    else of scipy.linalg, so it does not pay that import (docs/performance_symmetry.md, "Where the time
    goes")."""
    w, v = np.linalg.eigh((t + t.T) / 2)
    return w[::-1], np.ascontiguousarray(v[:, ::-1])


def find_structure(lam: np.ndarray, d: int) -> Structure:
    """The spans of a canonical Gram `lam` (features of d-dimensional tokens), from its partial traces."""
    if lam.shape[0] == 0:
        return Structure.identity(0, d)
    return from_traces(*partial_traces(lam, d))


def from_traces(tp: np.ndarray, tl: np.ndarray, margin: float = 1.0) -> Structure:
    """The spans from the two partial traces (any common scale: sums or means).

    A direction is dropped when its partial-trace energy is at most psi eps lambda_max(lam) (bounded
    below by lambda_max(Tr) / (number of blocks summed)), the certificate's numerical tolerance
    (numerics.numerical_tolerance): the features it spans have Rayleigh quotients the certificate already
    counts as zero, so dropping them changes no verdict. Exact nulls sit ~q times below that cut.
    `margin` multiplies the cut (a probe of part of the data asks for room: spans.SPANS_PROBE_MARGIN).
    """
    q, d = tp.shape[0], tl.shape[0]
    psi = q * d
    wp, pairs = _eig_desc(tp)
    wl, last = _eig_desc(tl)
    # lambda_max(lam) >= lambda_max(Tr_l lam) / d and >= lambda_max(Tr_s lam) / q
    cut = margin * STRUCTURE_FACTOR * psi * EPS * max(float(wp[0]) / d, float(wl[0]) / q, 0.0)
    a, b = int((wp > cut).sum()), int((wl > cut).sum())
    if a == q and b == d:
        return Structure.identity(q, d)  # nothing to drop: keep the canonical coordinates
    return Structure(pairs, last, a, b)


def change(E: np.ndarray, F: np.ndarray, pair_map: np.ndarray, token_map: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Spans E, F under s -> pair_map s, x -> token_map x (a change of basis): (E', F', R1, R2) with
    pair_map E = E' R1 and token_map F = F' R2 (QR); block coordinates change by R1 (x) R2."""
    E2, R1 = np.linalg.qr(pair_map @ E)
    F2, R2 = np.linalg.qr(token_map @ F)
    return E2, F2, R1, R2


def observed(st: Structure, pair_map: np.ndarray, token_map: np.ndarray) -> tuple[Structure, np.ndarray, np.ndarray]:
    """The structure in the coordinates z = kron(pair_map, token_map) h of a restricted domain.

    With K = (pair_map E) (x) (token_map F) = (U1 R1) (x) (U2 R2) (QR), the restricted Gram is
    (U1 (x) U2) (R1 (x) R2) Lambda_r (R1 (x) R2)^T (U1 (x) U2)^T: returns the structure of U1, U2
    completed to orthogonal bases, and R1, R2 (the reduced Gram is kron_congruence(R1, R2, Lambda_r)).
    """
    U1, R1 = np.linalg.qr(pair_map @ st.E, mode="complete")
    U2, R2 = np.linalg.qr(token_map @ st.F, mode="complete")
    a1, b1 = min(U1.shape[0], st.a), min(U2.shape[0], st.b)
    return Structure(U1, U2, a1, b1), R1[:a1], R2[:b1]
