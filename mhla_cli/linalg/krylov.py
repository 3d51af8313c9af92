"""The largest eigenvalue of a symmetric PSD operator by block Lanczos: several vectors per product.

The certificate's lambda_max is the top eigenvalue of Lambda~ and its lambda_min comes from the top
eigenvalue of (Lambda~ - s I)^-1 through the proof's Cholesky factor (mhla_cli.linalg.factorization).
Both products are memory-bound at the sizes where they are estimated (psi > DENSE_MAX): a product with
a block of BLOCK vectors reads the matrix or the factor once, as one vector does, and costs little more
(a few times one vector's product, not BLOCK times), while the block Krylov space converges to the top eigenvalue in far fewer products when the top of the spectrum
is clustered (its rate is set by the gap to the (BLOCK + 1)-th eigenvalue, not to the second).

`top_eigenvalue` is Rayleigh-Ritz on the block Krylov space span{Q0, op Q0, op^2 Q0, ...}: every block
is orthonormalised against all earlier ones (two passes of classical Gram-Schmidt by GEMM, then a QR),
the products op Q are kept, so that the projected matrix Q^T op Q and the top Ritz pair's residual
||op y - theta y|| are exact to rounding, not a recurrence's estimate. It stops at the first block whose
residual is <= tol * theta (`converged`) or when the basis reaches its cap (`MAX_BASIS_COLUMNS`,
memory bounded: `basis_bytes`), and says which. By Rayleigh's principle theta <= the top eigenvalue, and
some eigenvalue lies within the residual of theta.

Every product and every small factorization goes through scipy's BLAS / LAPACK: numpy and scipy each
bundle an OpenBLAS with its own thread pool, and a numpy BLAS call (a GEMM, or the dot inside
numpy.linalg.norm) between two scipy triangular solves leaves numpy's threads spinning on the cores that
scipy's need, which slows the solves by a factor of two or more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..numerics import LANCZOS_TOL

__all__ = ["BLOCK", "MAX_BASIS_COLUMNS", "TopEigenvalue", "basis_bytes", "top_eigenvalue"]

# Vectors per product: with 8, lambda_min and lambda_max of a dense Gram take a third or less of the
# products ARPACK's single vectors take, in about half the time or less; 16 or 24 vectors take fewer products
# but no less time.
BLOCK = 8
# The basis holds at most this many columns (and the products as many): 2 * 8 * n * 512 bytes, 59 MB at
# n = 7200; the clustered spectra of dense Grams converge in under half of it.
MAX_BASIS_COLUMNS = 512
# A new block's column whose norm after orthogonalisation is at most this times the block's product
# norm lies (to rounding) in the space already spanned: it is replaced by a random direction.
BREAKDOWN = 1e-10


@dataclass(frozen=True)
class TopEigenvalue:
    """The top Ritz value of an operator and how it was found."""

    value: float  # theta: the top eigenvalue of Q^T op Q (<= the operator's top eigenvalue)
    residual: float  # ||op y - theta y|| of the unit Ritz vector y: an eigenvalue lies within it of theta
    products: int  # blocks multiplied by the operator
    vectors: int  # vectors multiplied (products times the block width)
    converged: bool  # residual <= tol * |theta|
    tol: float = LANCZOS_TOL  # the cut on the relative residual
    block: int = BLOCK  # vectors per product

    def record(self) -> dict[str, float | int | bool | str | None]:
        """How it was found, for the certificate's JSON (`estimates`): the residual relative to theta is
        the number that `tol` bounds."""
        rel = self.residual / abs(self.value) if self.value else (0.0 if self.residual == 0 else None)
        return {"method": "block Lanczos", "block": self.block,
                "products": self.products, "relative_residual": rel, "tolerance": self.tol,
                "converged": self.converged}


def _columns(n: int, block: int, max_columns: int | None = None) -> int:
    """The basis's columns for an n x n operator (its last block may be narrower than `block`)."""
    return min(n, max(block, MAX_BASIS_COLUMNS if max_columns is None else max_columns))


def basis_bytes(n: int, block: int = BLOCK) -> int:
    """Bytes `top_eigenvalue` holds for an n x n operator: the basis and the products."""
    return 8 * n * (2 * _columns(n, block) + block)


def top_eigenvalue(matmat: Callable[[np.ndarray], np.ndarray], n: int, block: int = BLOCK,
                   tol: float = LANCZOS_TOL, max_columns: int | None = None) -> TopEigenvalue:
    """The largest eigenvalue of the symmetric n x n operator X -> matmat(X) (X: n x k float64,
    F-ordered), by block Lanczos with full reorthogonalisation (see the module's docstring).

    The start block is deterministic (the constant vector and a fixed-seed random block): the same
    operator gives the same value in every run. `max_columns`: the basis's cap (default
    MAX_BASIS_COLUMNS); the result is not `converged` when it is reached first."""
    import scipy.linalg as sl
    from scipy.linalg import blas

    if n <= 0:
        return TopEigenvalue(0.0, 0.0, 0, 0, True, tol, 0)
    k = max(1, min(block, n))
    cap = _columns(n, k, max_columns)
    rng = np.random.default_rng(0)
    start = rng.standard_normal((n, k))
    start[:, 0] = 1.0 / np.sqrt(n)
    Q = np.empty((n, cap), order="F")
    W = np.empty((n, cap), order="F")  # W[:, j] = op Q[:, j]
    H = np.zeros((cap, cap), order="F")  # Q^T op Q (its lower triangle is what eigh reads)
    Q[:, :k] = sl.qr(start, mode="economic", check_finite=False)[0]
    lo, hi, products = 0, k, 0
    while True:
        W[:, lo:hi] = matmat(Q[:, lo:hi])
        products += 1
        Hc = blas.dgemm(1.0, Q[:, :hi], W[:, lo:hi], trans_a=1)  # (hi x width): the new block column
        H[:hi, lo:hi] = Hc
        H[lo:hi, :hi] = Hc.T
        theta, y = sl.eigh(H[:hi, :hi], subset_by_index=[hi - 1, hi - 1], check_finite=False)
        theta = float(theta[0])
        r = blas.dgemm(1.0, W[:, :hi], y) - theta * blas.dgemm(1.0, Q[:, :hi], y)
        res = _norm(r)
        converged = res <= tol * abs(theta)
        if converged or hi >= cap:
            return TopEigenvalue(theta, res, products, hi, converged, tol, k)
        width = min(k, cap - hi)
        Z = np.array(W[:, lo:lo + width], order="F")
        Z = blas.dgemm(-1.0, Q[:, :hi], Hc[:, :width], beta=1.0, c=Z, overwrite_c=1)
        Z = blas.dgemm(-1.0, Q[:, :hi], blas.dgemm(1.0, Q[:, :hi], Z, trans_a=1), beta=1.0, c=Z, overwrite_c=1)
        Z = _orthonormal_block(Z, Q[:, :hi], _norm(W[:, lo:lo + width]), rng)
        Q[:, hi:hi + width] = Z
        lo, hi = hi, hi + width


def _norm(a: np.ndarray) -> float:
    """The 2-norm of an F-contiguous array's entries by scipy's dnrm2 (numpy's norm is a dot in numpy's
    OpenBLAS: its threads then spin on the cores the next product needs, see the module's docstring)."""
    from scipy.linalg import blas

    return float(blas.dnrm2(a.ravel(order="K")))


def _orthonormal_block(Z: np.ndarray, Q: np.ndarray, scale: float, rng: np.random.Generator) -> np.ndarray:
    """An orthonormal basis of Z's columns (already orthogonal to Q's), the columns that lie within
    rounding of span(Q) (R's diagonal <= BREAKDOWN * scale, after QR with pivoting) replaced by random
    directions orthogonal to Q and to the rest (the Krylov space is invariant there: any new direction
    keeps Rayleigh-Ritz exact, and the residual stays an exact test)."""
    import scipy.linalg as sl
    from scipy.linalg import blas

    q, R, _ = sl.qr(Z, mode="economic", pivoting=True, check_finite=False)
    good = int(np.sum(np.abs(np.diag(R)) > BREAKDOWN * max(scale, np.finfo(np.float64).tiny)))
    if good == Z.shape[1]:
        return q
    basis = np.hstack([Q, q[:, :good]])
    fill = rng.standard_normal((Z.shape[0], Z.shape[1] - good))
    for _ in range(2):
        fill -= blas.dgemm(1.0, basis, blas.dgemm(1.0, basis, fill, trans_a=1))
    return np.hstack([q[:, :good], sl.qr(fill, mode="economic", check_finite=False)[0]])
