"""One factorization of the certificate's matrix, computed once per statistics and reused.

certify (full and observed domains), fit, `certify --on` and the witness all need the spectrum or a
factor of the same canonical Lambda~ (mhla_cli.statistics.basis). `solve.domains.factorize` returns a `Factorization`
cached on the Features object, which computes only what is asked, once:

- small matrices (n <= DENSE_MAX): LAPACK's eigenvalues (eigvalsh), the vectors only when asked;
- the matrix may be the nonzero block of a larger one (mhla_cli.statistics.structure): `n_full - n` further
  eigenvalues are exact zeros, counted by `lambda_min`, `full_eigenvalues` and the certificate;
- the verdict, on every path: a Cholesky of Lambda~ - t I (n^3 / 3 flops, t the certificate's
  threshold) that succeeds proves that no eigenvalue is at or below t (`proves_above`, Sylvester's
  inertia); the dense eigenvalues are only reported, never the proof;
- large ones: lambda_max by block Lanczos on Lambda~ (mhla_cli.linalg.krylov: 8 vectors a product);
  lambda_min is block Lanczos on (Lambda~ - t I)^-1 through the proof's factor (tens of block
  triangular solves, each reading the factor once), and fit is a solve with the same factor
  (iterative refinement undoes the shift). The eigendecomposition (~9 n^3; the block on the data's spans,
  docs/formats_features.md) is computed only when the data are not identifiable and the null space
  is needed;
- the ridge (`ridge_solve`) is the spectral ridge solution for every r >= 0: a Cholesky of
  Lambda~ + r I when r exceeds the numerical tolerance, else a solve on the range of Lambda~;
- every decomposition runs on the backend of `device=` (mhla_cli.linalg.backends, resolved once): LAPACK on
  the host, or torch.linalg on one copy of the matrix on a device (the null space from every
  eigenvector there: torch has no selected ones).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..errors import Refused
from ..numerics import EPS, LANCZOS_TOL, REFINE_MAX_RHO, numerical_tolerance
from . import krylov
from .backends import POTRF_THREADED_MAX, lapack_threads, cholesky, get_backend

__all__ = ["DENSE_MAX", "Factorization", "NoEigensolver", "POTRF_THREADED_MAX", "cholesky"]

# Matrices up to this size are decomposed densely: below a few thousand features all the eigenvalues
# (eigvalsh) cost less than Lanczos on the inverse through the Cholesky factor, whose ~80 triangular
# solves are memory-bound. Above it Lanczos (O(iterations n^2)) beats the O(n^3) eigenvalues, and the
# factorization's reuse avoids every repeated one.
DENSE_MAX = 4096


class NoEigensolver(Refused):
    """What needs an eigendecomposition, asked of a matrix whose backend has none (a matrix on a Dask
    cluster: mhla_cli.linalg.tiled_matrix); `what` names it."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} needs an eigendecomposition of Lambda~, which has no distributed form; "
                         "run it on one machine ({no_cluster})", no_cluster={})
        self.what = what


class Factorization:
    """Lazily computed, cached decompositions of one symmetric PSD matrix scale * lam (lam not copied,
    never written: it may be the statistics' own sums, scale = 1 / N); every eigenvalue, solve and
    lambda reported is of scale * lam.

    `lam` is the block of a (n_full x n_full) matrix outside which every direction is an exact null
    direction (n_full = n when there is no such structure). `matrix`: a backend matrix made already
    (e.g. mhla_cli.linalg.tiled_matrix.TiledMatrix, whose tiles live on a cluster) in place of `lam`; one
    without an eigensolver (`eigensolver = False`) takes the identifiable path only (NoEigensolver).
    """

    def __init__(self, lam: np.ndarray | None, n_full: int | None = None, scale: float = 1.0,
                 device: str | None = None, matrix: Any = None) -> None:
        self.lam = lam  # the matrix is scale * lam (lam may be the statistics' own array: never written)
        self.scale = float(scale)
        # device (mhla_cli.linalg.backends): where the decompositions run (on a device lam is copied once)
        self.device = device
        self.backend = get_backend(device)
        source = lam if matrix is None else matrix
        assert source is not None, "a Factorization of lam or of a backend matrix"
        self.n = int(source.shape[0])
        self.n_full = self.n if n_full is None else int(n_full)
        self.structure: Any = None  # mhla_cli.statistics.structure.Structure of the block, set by solve.domains.factorize
        self._c = _Cache()  # the decompositions, shared by `share`
        self._c._dm = matrix
        self.seconds = self._c.seconds  # wall time of each decomposition computed
        self.iterations = self._c.iterations  # how each estimate was found (krylov.TopEigenvalue.record)

    @property
    def has_eigensolver(self) -> bool:
        """Whether the backend's matrix can be eigendecomposed (not one on a cluster; a matrix made from
        `lam` by the backend always can)."""
        return getattr(self._c._dm, "eigensolver", True)

    def _eigensolver(self, what: str) -> None:
        """Refuse `what` (NoEigensolver) on a matrix without an eigensolver."""
        if not self.has_eigensolver:
            raise NoEigensolver(what)

    def share(self, n_full: int, structure: Any) -> Factorization:
        """The same block (and its decompositions, computed once) inside another domain of n_full
        features, whose coordinates `structure` maps it to (an orthogonal change of the block's)."""
        out = Factorization(self.lam, n_full, self.scale, self.device, matrix=self._c._dm if self.lam is None else None)
        out.structure = structure
        out._c = self._c
        out.seconds = self._c.seconds
        out.iterations = self._c.iterations
        return out

    @contextmanager
    def _timed(self, what: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self._c.seconds[what] = self._c.seconds.get(what, 0.0) + time.perf_counter() - t

    def _matrix(self) -> Any:
        """The backend's matrix of lam (backends.HostMatrix, device.DeviceMatrix), made once."""
        if self._c._dm is None:
            assert self.lam is not None  # a Factorization of a backend matrix has _dm from the start
            self._c._dm = self.backend.matrix(self.lam)
        return self._c._dm

    @property
    def dense(self) -> bool:
        # ARPACK needs room for its Krylov basis: tiny matrices are always decomposed densely
        return (self.n <= DENSE_MAX or self.n < 32) and self.has_eigensolver

    def eigenvalues(self) -> np.ndarray:
        """Every eigenvalue, ascending: eigvalsh, computed once (those of `eigh` if it came first)."""
        if self._c._w is None:
            if self._c._we is not None:
                return self._c._we
            self._eigensolver("every eigenvalue")
            with self._timed("eigenvalues"), lapack_threads(self.n):
                self._c._w = self._matrix().eigvalsh() * self.scale
        return self._c._w

    def known_eigenvalues(self) -> np.ndarray | None:
        """The block's eigenvalues if they are computed anyway (dense path) or were (eigh), else None."""
        known = self.dense or self._c._we is not None or self._c._w is not None
        return self.eigenvalues() if known else None

    def full_eigenvalues(self) -> np.ndarray | None:
        """`known_eigenvalues` with the n_full - n exact zeros outside the block, ascending."""
        w = self.known_eigenvalues()
        if w is None or self.n_full == self.n:
            return w
        return np.sort(np.concatenate([np.zeros(self.n_full - self.n), w]))

    def eigh(self) -> tuple[np.ndarray, np.ndarray]:
        """Eigenvalues and orthonormal eigenvectors (computed once)."""
        if self._c._v is None:
            self._eigensolver("the eigenvectors")
            with self._timed("eigenvectors"), lapack_threads(self.n):
                w, self._c._v = self._matrix().eigh()
                self._c._we = w * self.scale
        return self._c._we, self._c._v  # type: ignore[return-value]  # both set together

    def null_space(self, threshold: float) -> tuple[np.ndarray, np.ndarray]:
        """The eigenpairs with eigenvalue <= threshold (ascending): LAPACK's selected eigenvectors
        (dsyevr over (-inf, threshold]: the tridiagonal reduction and only those vectors, not all).
        A smaller threshold than one computed before is served from it."""
        if self._c._v is not None:
            assert self._c._we is not None  # set with _v
            keep = self._c._we <= threshold
            return self._c._we[keep], self._c._v[:, keep]
        if self.n == 0 or (self._c._lmin is not None and self._c._lmin > threshold) or (
                self._c._w is not None and self._c._w[0] > threshold):
            return np.zeros(0), np.zeros((self.n, 0))  # the block is positive definite beyond threshold
        self._eigensolver("the null space")
        if not self._matrix().selects_eigenvectors:  # (torch.linalg has none): all of them, once
            w, v = self.eigh()
            keep = w <= threshold
            return w[keep], v[:, keep]
        done = [t for t in self._c._null if t >= threshold]
        if done:
            w, v = self._c._null[min(done)]
            keep = w <= threshold
            return w[keep], v[:, keep]
        with self._timed("null space"), lapack_threads(self.n):
            w, v = self._matrix().eigh_below(threshold / self.scale)
            w = w * self.scale
        self._c._null[threshold] = (w, v)
        return w, v

    def pinv_solve(self, rhs: np.ndarray, tol: float) -> np.ndarray:
        """The minimum-norm least-squares solution of (scale lam) x = rhs with eigenvalues <= tol
        dropped (the pseudo-inverse): `range_solve` with no ridge."""
        return self.range_solve(rhs, tol, 0.0)

    def range_solve(self, rhs: np.ndarray, tol: float, ridge: float = 0.0) -> np.ndarray:
        """V+ diag(1 / (lambda + ridge)) V+^T rhs over the eigenpairs with lambda > tol (those at or below
        it taken as exact zeros: their part of rhs is rounding, dropped), for every ridge >= 0.

        A Cholesky solve of scale lam + ridge I + c N N^T (N: the eigenvectors <= tol, c = lambda_max),
        which has the same eigenvectors and eigenvalues lambda + ridge >= tol on the range, then the N
        part removed (backends.HostMatrix.range_solve); the full eigh when that Cholesky fails (and always
        on a backend without it, e.g. torch, whose null space took every eigenvector already)."""
        rhs = np.asarray(rhs)
        if rhs.ndim == 1:  # one right-hand side: as a column (the eigh path's division broadcasts by columns)
            return self.range_solve(rhs[:, None], tol, ridge)[:, 0]
        _, N = self.null_space(tol)
        c = max(self.lambda_max(), tol, 1e-300)
        m = self._matrix()
        if m.solves_on_range:
            with self._timed("solve"):
                x = m.range_solve(N, c, self.scale, ridge, rhs)
            if x is not None:
                return x
        w, v = self.eigh()
        keep = w > tol
        return v[:, keep] @ ((v[:, keep].T @ rhs) / (w[keep] + ridge)[:, None])

    def lambda_max(self) -> float:
        if self._c._lmax is None:
            if self.dense or self._c._we is not None:
                self._c._lmax = float(self.eigenvalues()[-1]) if self.n else 0.0
            else:
                m = self._matrix()
                self._c._lmax = self._top("lambda_max", m.matmat, m.matvec) * self.scale
        return self._c._lmax

    def _top(self, what: str, matmat: Any, matvec: Any) -> float:
        """The top eigenvalue of an operator by block Lanczos (mhla_cli.linalg.krylov), ARPACK's restarted
        Lanczos when that did not converge within its basis (which raises when it does not either);
        how it was found is kept in `iterations[what]`."""
        with self._timed("lanczos"):
            top = krylov.top_eigenvalue(matmat, self.n)
            rec: dict[str, Any] = top.record()
            value = top.value
            if not top.converged:
                value = _lanczos_top(matvec, self.n)
                # ARPACK raises when it does not converge: here it did, to LANCZOS_TOL
                rec = {"method": "ARPACK Lanczos (block Lanczos did not converge within its basis)", "block": 1,
                       "products": None, "relative_residual": None, "tolerance": LANCZOS_TOL, "converged": True,
                       "block_lanczos": rec}
        self._c.iterations[what] = rec
        return value

    def cholesky(self, shift: float = 0.0) -> Any:
        """The Cholesky factor of lam - (shift / scale) I, i.e. of the matrix scale * lam - shift I up to
        the factor scale (backends.HostFactor, or a device.DeviceFactor: `solve`, `inverse_matvec`), computed
        once per shift; None when that matrix is not numerically positive definite."""
        shift = float(shift)
        if shift not in self._c._chol:
            with self._timed("cholesky"):
                self._c._chol[shift] = self._matrix().cholesky(shift / self.scale)
        return self._c._chol[shift]

    def cholesky_failure(self, shift: float) -> Any:
        """Where the Cholesky of scale lam - shift I failed, as the backend's matrix reports it (its
        `failure`: a tiled_matrix.NotPositiveDefinite, with the column and the tile row), else None (it did
        not fail, was not tried, or the backend does not say)."""
        report = getattr(self._matrix(), "failure", None)
        return None if report is None else report(float(shift) / self.scale)

    def proves_above(self, t: float) -> bool:
        """Proof by inertia that every eigenvalue of the block exceeds t: a Cholesky of scale lam - t I
        that succeeds (Sylvester: no eigenvalue at or below t). One already tried is reused: a success
        at a shift >= t proves it, a failure at a shift <= t refutes it."""
        t = float(t)
        if self.n == 0:
            return False
        for s, f in self._c._chol.items():
            if f is not None and s >= t:
                return True
            if f is None and s <= t:
                return False
        return self.cholesky(t) is not None

    def _best_factor(self) -> tuple[float, Any]:
        """(shift, factor) of the successful Cholesky with the largest shift (the closest to lambda_min:
        Lanczos on its inverse converges fastest), else (0, the unshifted one or None)."""
        good = [s for s, f in self._c._chol.items() if f is not None]
        if good:
            s = max(good)
            return s, self._c._chol[s]
        tol = numerical_tolerance(self.lambda_max(), self.n_full)
        if any(f is None and s <= tol for s, f in self._c._chol.items()):
            return 0.0, None  # an eigenvalue within rounding of 0: a Cholesky of lam itself is no better
        return 0.0, self.cholesky(0.0)

    def lambda_min(self) -> float:
        """The smallest eigenvalue of the full matrix: 0 when the block is smaller, else `block_lambda_min`."""
        return 0.0 if self.n < self.n_full else self.block_lambda_min()

    def block_lambda_min(self) -> float:
        """The block's smallest eigenvalue: dense, or Lanczos on (scale lam - s I)^-1 through a shifted
        Cholesky factor (s + 1 / its top eigenvalue: an estimate, the Ritz value), or eigh."""
        if self._c._lmin is None:
            if self.dense or self._c._we is not None:
                self._c._lmin = float(self.eigenvalues()[0]) if self.n else 0.0
            else:
                s, chol = self._best_factor()
                if chol is not None:
                    top = self._top("lambda_min", chol.inverse_matmat, chol.inverse_matvec)
                    self._c._lmin = s + self.scale / top if top > 0 else float(self.eigh()[0][0])
                elif not self.has_eigensolver:
                    self._c._lmin = self._bottom()
                else:
                    # not positive definite: the null space will be wanted too, and one eigh with vectors
                    # (divide and conquer) costs less than the eigenvalues and then the selected vectors
                    self._c._lmin = float(self.eigh()[0][0])
        return self._c._lmin

    def _bottom(self) -> float:
        """lambda_min without a factor or an eigensolver: c - the top eigenvalue of c I - scale lam by
        block Lanczos (c = lambda_max, so that the operator is PSD); an estimate, its record kept as
        `iterations["lambda_min"]` (its residual is relative to lambda_max - lambda_min, not to lambda_min)."""
        c = self.lambda_max() / self.scale
        m = self._matrix()
        top = self._top("lambda_min", lambda X: c * X - m.matmat(X), lambda x: c * x - m.matvec(x))
        return self.scale * (c - top)

    def rank(self, tol: float) -> int:
        """Eigenvalues above `tol` (none outside the block): all of the block's when its lambda_min > tol,
        else counted (eigh if needed)."""
        if self.block_lambda_min() > tol:
            return self.n
        w = self.known_eigenvalues()
        return self.n - self.null_space(tol)[0].size if w is None else int((w > tol).sum())

    def _cho_solve(self, chol: Any, rhs: np.ndarray) -> np.ndarray:
        """(lam - s I)^-1 rhs through a factor of `cholesky` (unscaled)."""
        return chol.solve(rhs)

    def solve(self, rhs: np.ndarray) -> np.ndarray | None:
        """(scale lam)^-1 rhs through a Cholesky factor (None when lam is not positive definite).

        A factor of scale lam - s I already computed (the certificate's proof) is reused when s is at
        most half of lambda_min - s, with iterative refinement x += (scale lam - s I)^-1 (rhs - scale lam x),
        which contracts the error by rho = s / (lambda_min - s) per step, until rho^(k+1) < eps."""
        s, c = self._best_factor()
        if c is not None and s > 0:
            lmin = self.block_lambda_min()
            rho = s / (lmin - s) if lmin > s else np.inf
            if rho > REFINE_MAX_RHO:
                s, c = 0.0, self.cholesky(0.0)
        if c is None:
            return None
        x = self._cho_solve(c, rhs) / self.scale
        if s > 0:
            mv = self._matrix().matvec
            # the first solve's error is rho (relative), k steps leave rho^(k+1): the fewest k with
            # rho^(k+1) <= eps (one solve and one product fewer than the k with rho^k <= eps, at the same
            # accuracy: rho = 6e-8 takes 2 steps instead of 3)
            steps = int(min(60, max(0.0, np.ceil(np.log(EPS) / np.log(rho)) - 1))) if rho > 0 else 0
            for _ in range(steps):
                x = x + self._cho_solve(c, rhs - self.scale * mv(x)) / self.scale
        return x

    def ridge_solve(self, rhs: np.ndarray, ridge: float, tol: float) -> np.ndarray:
        """The ridge solution V diag(1 / (lambda + ridge)) V^T rhs with the eigenvalues <= tol (the
        certificate's numerical tolerance) taken as exact zeros, for every ridge >= 0.

        ridge > tol: a Cholesky of scale lam + ridge I (positive definite beyond rounding: the shift
        alone lifts every eigenvalue above tol). ridge <= tol, or when that Cholesky fails: on the
        range (`range_solve`), so ridge -> 0 gives the minimum-norm solution (dividing rounding-level
        components of rhs by a tiny ridge is what a least-squares fallback with a default cutoff did)."""
        if ridge > tol:
            x = self._matrix().shifted_solve(self.scale, ridge, rhs)
            if x is not None:
                return x
        return self.range_solve(rhs, tol, ridge)


class _Cache:
    """The decompositions of one matrix, computed lazily (Factorization)."""

    def __init__(self) -> None:
        self._w: np.ndarray | None = None  # eigvalsh
        self._we: np.ndarray | None = None  # eigh: values and vectors
        self._v: np.ndarray | None = None
        # shift -> the factor of lam - (shift / scale) I (backends.HostFactor, device.DeviceFactor); None: failed
        self._chol: dict[float, Any] = {}
        self._dm: Any = None  # the backend's matrix of lam (backends.HostMatrix, device.DeviceMatrix)
        self._lmax: float | None = None
        self._lmin: float | None = None
        self._null: dict[float, tuple[np.ndarray, np.ndarray]] = {}  # threshold -> eigenpairs <= it
        self.seconds: dict[str, float] = {}
        self.iterations: dict[str, dict[str, Any]] = {}  # "lambda_max" / "lambda_min" -> how it was found


# The fallback when block Lanczos (mhla_cli.linalg.krylov) does not converge within its basis: ARPACK's
# restarted Lanczos, one vector a step, memory flat (ncv = 20), residual LANCZOS_TOL; it raises
# ArpackNoConvergence when it does not converge either. The block method replaced it as the first
# choice: the earlier measurement here that block solves of 8 vectors cost 3-5x one was most likely
# taken beside numpy GEMMs, whose OpenBLAS threads spin on the cores scipy's need (krylov's docstring).


def _lanczos_top(matvec: Any, n: int) -> float:
    """The largest eigenvalue of a symmetric PSD operator (ARPACK Lanczos, residual LANCZOS_TOL): the
    fallback of `Factorization._top`."""
    from scipy.sparse.linalg import LinearOperator, eigsh

    op = LinearOperator((n, n), matvec=matvec, dtype=np.float64)
    v0 = np.ones(n) / np.sqrt(n)  # deterministic start
    w = eigsh(op, k=1, which="LA", v0=v0, tol=LANCZOS_TOL, return_eigenvectors=False)
    return float(w[0])
