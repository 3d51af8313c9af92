"""The backends of the psi x psi work, one class each, resolved once from a `device` spelling (`get_backend`).

- `NumpyBackend` ("cpu" / None, the default): NumPy / SciPy on the host; its matrix is `HostMatrix`
  (LAPACK's eigensolvers, Cholesky and triangular solves), its Gram `HostGram` (one syrk per chunk, or
  the Gram's distinct entries, mhla_cli.linalg.symgram);
- `TorchBackend` ("cuda", "cuda:I", "torch:cpu"; mhla_cli.linalg.device): torch on a device; its matrix is
  `device.DeviceMatrix`, its Gram `device.DeviceGram` / `device.DevicePairs`, its free memory torch's.

What the factorization (mhla_cli.linalg.factorization) asks of a backend's matrix: eigvalsh, eigh, the
selected eigenvectors below a threshold (`selects_eigenvectors`: the host's LAPACK dsyevr; torch has
none, the factorization then takes every eigenvector once), matvec, a Cholesky factor of a shifted copy
(whose `solve` and `inverse_matvec` are the triangular solves), the solve of a shifted system, and the
Cholesky solve on the range (`solves_on_range`). What the accumulator (mhla_cli.statistics.accumulate)
asks: `gram(...)`, whose `add` takes a chunk's factors and whose result `gram_parts` turns into the
Gram, moments and target Gram. Every result is float64 numpy on the host.
A new backend (ROCm, MPS, CuPy) is one class here and its spelling in `get_backend`.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import numpy as np

from ..errors import Refused
from . import device as device_mod
from ..feature_map import features_from_moments, pair_index
from . import symgram

__all__ = ["Backend", "HostFactor", "HostGram", "HostMatrix", "LP64_MAX_N", "MIN_THREADED_WIDTH", "NumpyBackend",
           "PANEL_BYTES", "POTRF_THREADED_MAX", "SCIPY_LARGE_POTRF", "TorchBackend", "check_lapack_indexing", "cholesky",
           "get_backend", "gram_parts", "lapack_indexing"]

# OpenBLAS's threaded dsyrk and dpotrf (0.3.30 / 0.3.31) segfault for n >= ~16000 with 2 threads (a
# Cholesky even of the identity at n = 16896 crashes, n = 12000 does not; OpenMathLib/OpenBLAS issues
# #1413, #2821 report the crash in dpotrf_L_parallel / dsyrk_thread): above this size every
# decomposition here runs on one BLAS thread.
POTRF_THREADED_MAX = 12000


def _scipy_linalg() -> Any:
    import scipy.linalg  # imported here, not at start-up (docs/performance_startup.md)

    return scipy.linalg


def lapack_threads(n: int) -> Any:
    """Context: one BLAS thread for a decomposition of order n > POTRF_THREADED_MAX, else nothing."""
    if n <= POTRF_THREADED_MAX:
        return contextlib.nullcontext()
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")


def _fortran_view(a: np.ndarray) -> tuple[np.ndarray, bool]:
    """(a symmetric a as an F-ordered array without a copy, whether a was C-ordered): a C-ordered array's
    transpose is an F-ordered view of the same matrix, whose upper triangle is a's lower one."""
    c_order = bool(a.flags.c_contiguous) and not a.flags.f_contiguous
    return (a.T if c_order else a), c_order


def _blas_ready(a: np.ndarray) -> bool:
    """Whether scipy's BLAS takes a as it lies: a non-empty float64 array in C or F order."""
    return a.shape[0] > 0 and a.dtype == np.float64 and bool(a.flags.c_contiguous or a.flags.f_contiguous)


# The largest order n whose n x n matrix 32-bit integers index (46340^2 < 2^31 <= 46341^2): a larger
# Cholesky needs an LAPACK with 64-bit indexing (ILP64), or SciPy's LP64 wrappers from SCIPY_LARGE_POTRF
# on, which index the factor in 64 bits (their flat indexing overflowed before: scipy/scipy#17436,
# fixed by #20229 in SciPy 1.13).
LP64_MAX_N = 46340
SCIPY_LARGE_POTRF = (1, 13)


def lapack_indexing() -> dict[str, Any]:
    """What the LAPACK that scipy loads indexes with: {"scipy": its version, "ilp64": whether its LAPACK
    has 64-bit integers (scipy.show_config's "has ilp64"), "library": its name and version, "numpy_ilp64":
    the same of numpy's (USE64BITINT in its OpenBLAS configuration)}; None where a build does not say."""
    import scipy

    def deps(mod: Any) -> dict[str, Any]:
        try:
            return mod.show_config(mode="dicts").get("Build Dependencies", {}).get("lapack", {}) or {}
        except Exception:  # noqa: BLE001 (a build without the dict form: nothing is known)
            return {}

    sp, npy = deps(scipy), deps(np)
    conf = str(npy.get("openblas configuration", ""))
    return {"scipy": scipy.__version__, "ilp64": sp.get("has ilp64"),
            "library": f"{sp.get('name', '?')} {sp.get('version', '')}".strip(),
            "numpy_ilp64": ("USE64BITINT" in conf) if conf else None}


def check_lapack_indexing(n: int, info: dict[str, Any] | None = None) -> None:
    """Refuse (InputError) a Cholesky of order n > LP64_MAX_N that SciPy's LAPACK cannot index: an LP64
    LAPACK behind SciPy before SCIPY_LARGE_POTRF (32-bit flat indexing crashed there)."""
    if n <= LP64_MAX_N:
        return
    info = lapack_indexing() if info is None else info
    if info.get("ilp64"):
        return
    version = tuple(int(x) for x in re.findall(r"\d+", str(info.get("scipy", "0")))[:2])
    if version >= SCIPY_LARGE_POTRF:
        return
    raise Refused(f"a Cholesky of order n = {n} > {LP64_MAX_N} needs 64-bit indexing, which SciPy "
                  f"{info.get('scipy')} with an LP64 LAPACK ({info.get('library')}) lacks (its Cholesky crashed "
                  "there before SciPy 1.13); upgrade SciPy, or keep the Gram tiled on a Dask cluster's workers: "
                  "{cluster}", cluster={})


def cholesky(a: np.ndarray, overwrite_a: bool = False) -> Any:
    """scipy's cho_factor of a symmetric a (for cho_solve), on one BLAS thread above POTRF_THREADED_MAX;
    LinAlgError when a is not numerically positive definite; above LP64_MAX_N only with an LAPACK that
    indexes it (`check_lapack_indexing`)."""
    check_lapack_indexing(a.shape[0])
    # LAPACK factors a as it lies (a C-ordered a through its transpose: upper U, U^T U = a) instead of
    # after a transposing copy
    f, c_order = _fortran_view(a)
    with lapack_threads(a.shape[0]):
        return _scipy_linalg().cho_factor(f, lower=not c_order, overwrite_a=overwrite_a, check_finite=False)


def _inverse_matvec(factor: tuple[np.ndarray, bool]) -> Any:
    """x -> lam^-1 x through a cho_factor result, as two triangular solves (BLAS dtrsv), which for one
    right-hand side cost less than cho_solve's dpotrs; Lanczos needs one per step."""
    from scipy.linalg import blas

    c, lower = factor
    c = np.asfortranarray(c)
    if lower:  # lam = L L^T
        return lambda x: blas.dtrsv(c, blas.dtrsv(c, x, lower=1, trans=0), lower=1, trans=1)
    return lambda x: blas.dtrsv(c, blas.dtrsv(c, x, lower=0, trans=1), lower=0, trans=0)  # lam = U^T U


def _inverse_matmat(factor: tuple[np.ndarray, bool]) -> Any:
    """X -> lam^-1 X (X: n x k, F-ordered) through a cho_factor result, as two triangular solves (BLAS
    dtrsm, scipy's OpenBLAS: the block Lanczos of mhla_cli.linalg.krylov runs on the same library)."""
    from scipy.linalg import blas

    c, lower = factor
    c = np.asfortranarray(c)
    if lower:  # lam = L L^T
        return lambda X: blas.dtrsm(1.0, c, blas.dtrsm(1.0, c, X, lower=1, trans_a=0), lower=1, trans_a=1)
    return lambda X: blas.dtrsm(1.0, c, blas.dtrsm(1.0, c, X, lower=0, trans_a=1), lower=0, trans_a=0)


class HostFactor:
    """A Cholesky factor on the host (scipy's cho_factor result `cf`): solves and inverse products."""

    def __init__(self, cf: tuple[np.ndarray, bool]) -> None:
        self.cf = cf
        self._inv: Any = None
        self._inv_block: Any = None

    def solve(self, rhs: np.ndarray) -> np.ndarray:
        """a^-1 rhs through the factor (LAPACK dpotrs)."""
        return _scipy_linalg().cho_solve(self.cf, rhs, check_finite=False)

    def inverse_matvec(self, x: np.ndarray) -> np.ndarray:
        """a^-1 x by two triangular solves (Lanczos on the inverse; `_inverse_matvec`)."""
        if self._inv is None:
            self._inv = _inverse_matvec(self.cf)
        return self._inv(x)

    def inverse_matmat(self, X: np.ndarray) -> np.ndarray:
        """a^-1 X for a block X (n x k) by two triangular solves (block Lanczos on the inverse)."""
        if self._inv_block is None:
            self._inv_block = _inverse_matmat(self.cf)
        return self._inv_block(np.asfortranarray(X, dtype=np.float64))


class HostMatrix:
    """A symmetric float64 matrix on the host (not copied, never written) and its LAPACK decompositions."""

    selects_eigenvectors = True  # LAPACK dsyevr: only the eigenpairs below a threshold
    solves_on_range = True  # a Cholesky of the matrix shifted on its null space (Factorization.range_solve)

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def eigvalsh(self) -> np.ndarray:
        """Every eigenvalue, ascending (LAPACK, no vectors)."""
        return _scipy_linalg().eigh(self.a, eigvals_only=True, check_finite=False)

    def eigh(self) -> tuple[np.ndarray, np.ndarray]:
        """Eigenvalues (ascending) and orthonormal eigenvectors."""
        return _scipy_linalg().eigh(self.a, check_finite=False)

    def eigh_below(self, upper: float) -> tuple[np.ndarray, np.ndarray]:
        """The eigenpairs with eigenvalue <= upper (dsyevr over (-inf, upper]: only those vectors)."""
        return _scipy_linalg().eigh(self.a, subset_by_value=(-np.inf, upper), check_finite=False)

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """a x: for a vector BLAS dsymv on a's lower triangle (the one the Cholesky reads), half the memory
        traffic of a GEMV; a block of vectors by GEMM (`matmat`; dsymm is slower than GEMM for a block)."""
        a = self.a
        if x.ndim != 1:
            return self.matmat(x)
        if not _blas_ready(a):
            return a @ x
        from scipy.linalg import blas

        f, c_order = _fortran_view(a)  # a's lower triangle is the F view's upper one when a is C-ordered
        return blas.dsymv(1.0, f, np.asarray(x, dtype=np.float64), lower=0 if c_order else 1)

    def matmat(self, X: np.ndarray) -> np.ndarray:
        """a X for a block X (n x k): scipy's dgemm on a as it lies (a C-ordered a is its F-ordered
        transpose), the BLAS of the triangular solves (mhla_cli.linalg.krylov: one thread pool, not two)."""
        a = self.a
        if not _blas_ready(a):
            return np.asarray(a @ X, dtype=np.float64)
        from scipy.linalg import blas

        return blas.dgemm(1.0, _fortran_view(a)[0], np.asfortranarray(X, dtype=np.float64))

    def cholesky(self, shift: float = 0.0) -> HostFactor | None:
        """The Cholesky factor of a - shift I (a copy of a when shift != 0: a is never written); None when
        that matrix is not numerically positive definite."""
        sl = _scipy_linalg()
        try:
            if shift == 0.0:
                f = cholesky(self.a)
            else:
                # a copy in a's own memory order (`cholesky` factors a C-ordered one through its transpose,
                # in place): an F-ordered copy of a C-ordered a would be a transposing copy, several times
                # slower than a plain one
                m = np.array(self.a, dtype=np.float64)
                m[np.diag_indices(m.shape[0])] -= shift
                f = cholesky(m, overwrite_a=True)
        except sl.LinAlgError:
            return None
        return HostFactor(f) if np.isfinite(f[0].diagonal()).all() else None

    def shifted_solve(self, scale: float, shift: float, rhs: np.ndarray) -> np.ndarray | None:
        """(scale a + shift I) x = rhs by a Cholesky of a new matrix; None when it is not numerically
        positive definite."""
        sl = _scipy_linalg()
        system = self.a * scale
        system[np.diag_indices(system.shape[0])] += shift
        try:
            return sl.cho_solve(cholesky(system, overwrite_a=True), rhs, check_finite=False)
        except sl.LinAlgError:
            return None

    def range_solve(self, N: np.ndarray, c: float, scale: float, ridge: float, rhs: np.ndarray) -> np.ndarray | None:
        """(scale a + ridge I)^-1 rhs on the range of a, N its (numerically) null eigenvectors: a Cholesky
        of scale a + ridge I + c N N^T (same eigenvectors; eigenvalues lambda + ridge on the range, which
        `c` >= lambda_max lifts the null space above), then the N part removed; None when it fails."""
        sl = _scipy_linalg()
        try:
            # N @ (a copy of N^T): a GEMM (numpy turns N @ N.T into a syrk, see POTRF_THREADED_MAX)
            shifted = N @ np.ascontiguousarray(N.T)
            shifted *= c / scale
            shifted += self.a
            shifted[np.diag_indices(shifted.shape[0])] += ridge / scale
            x = sl.cho_solve(cholesky(shifted, overwrite_a=True), rhs, check_finite=False) / scale
            del shifted
            return x - N @ (N.T @ x)
        except sl.LinAlgError:
            return None


# Narrower [H | Y] blocks use one BLAS thread: on shared cores a second OpenBLAS thread waits for a core
# held by another process, which costs a narrow syrk far more than its flops; wider blocks amortise
# the wait.
MIN_THREADED_WIDTH = 1024
# Work array of one panel of the accumulator's update (`Accumulator._syrk`).
PANEL_BYTES = 32 * 2**20

_CONTROLLER: Any = None


def single_blas_thread() -> Any:
    """Context limiting BLAS to one thread (tiny per-sequence products gain nothing from more)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        from threadpoolctl import ThreadpoolController

        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER.limit(limits=1, user_api="blas")


def _blas_threads() -> int:
    """The number of threads BLAS uses now (threadpoolctl; 1 when unknown)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        from threadpoolctl import ThreadpoolController

        _CONTROLLER = ThreadpoolController()
    counts = [int(lib.num_threads) for lib in _CONTROLLER.select(user_api="blas").lib_controllers]
    return max(1, min(counts)) if counts else 1


class HostGram:
    """The Gram of a pass's [Ht | Y] block on the host, built chunk by chunk (the numpy backend's
    `gram`): from symgram.SYMGRAM_MIN_D on the Gram's distinct entries K = U^T V of the two factors s and
    x_n (mhla_cli.linalg.symgram.SymGram), else the block built transposed, Ft = [Ht | Y]^T (width, R), so
    that every elementwise loop runs over the R samples of the chunk (long, contiguous) instead of over d,
    then one syrk into G (lower triangle, mirrored in `gram_parts`)."""

    def __init__(self, q: int, r: int, n_targets: int, width: int, nf: int,
                 spans: tuple[np.ndarray, np.ndarray] | None = None, pairs: bool = False) -> None:
        self.width, self.nf, self.spans = int(width), int(nf), spans
        self.G: np.ndarray | None = None
        self._pairs = symgram.accumulator(q, r, n_targets, pairs)
        self._bufs: dict[str, np.ndarray] = {}

    def add(self, upper_t: np.ndarray, last_t: np.ndarray, targets_t: np.ndarray | None) -> None:
        """Add the rows' block: upper_t (q, R) canonical S entries, last_t (d, R) (sqrt(w) x for weighted
        rows), targets_t (d, R) or None (already weighted)."""
        if self._pairs is not None:
            if self.spans is not None:  # the block coordinates E^T s and F^T x_n
                upper_t, last_t = self.spans[0].T @ upper_t, self.spans[1].T @ last_t
            # a wide block shares its panels out over as many Python threads as BLAS has threads
            # (each panel's GEMM on one BLAS thread: symgram.SymGram.add); a narrow one runs on one
            wide = self.width >= MIN_THREADED_WIDTH
            with contextlib.nullcontext() if wide else single_blas_thread():
                self._pairs.add(upper_t, last_t, targets_t, threads=_blas_threads() if wide else 1)
            return
        R = upper_t.shape[1]
        with single_blas_thread():  # elementwise work and small products
            Ft = symgram.work_array(self._bufs, "F", self.width, R)
            if self.spans is not None:  # the block coordinates E^T s and F^T x_n
                upper_t, last_t = self.spans[0].T @ upper_t, self.spans[1].T @ last_t
            H = Ft[:self.nf].reshape(upper_t.shape[0], last_t.shape[0], R)
            # H_(j,k,l) = S[j,k] x_n[l] (docs/formats.md, "Math")
            np.multiply(upper_t[:, None, :], last_t[None, :, :], out=H)
            if targets_t is not None:
                Ft[self.nf:] = targets_t
        self._syrk(Ft)  # with the BLAS threads a wide block pays for

    def add_windows(self, upper_t: np.ndarray, xx: np.ndarray, xy: np.ndarray | None, yy: np.ndarray | None) -> None:
        """Add rows whose token factor is a second moment (a window's X^T W X and X^T W Y: samples.Rows.xx):
        upper_t (q, R) canonical S entries, xx (R, d, d), xy (R, d, n_targets) or None, yy the rows' target
        Gram or None; always into the Gram's distinct entries (made with `pairs`: symgram.SymGram.add_windows)."""
        if self._pairs is None:
            raise ValueError("rows with second-moment token factors need a HostGram made with pairs=True")
        if self.spans is not None:  # the block coordinates E^T s, F^T xx F and F^T xy
            E, F = self.spans
            upper_t, xx = E.T @ upper_t, F.T @ xx @ F
            xy = None if xy is None else F.T @ xy
        wide = self.width >= MIN_THREADED_WIDTH
        with contextlib.nullcontext() if wide else single_blas_thread():
            self._pairs.add_windows(upper_t, xx, xy, yy, threads=_blas_threads() if wide else 1)

    def pipeline(self) -> Any:
        """The pass's block around its loop over chunks (statistics.ranges.add_chunks): a wide block
        of K overlaps each chunk's GEMMs with the next chunk's preparation (symgram.SymGram.pipeline, on
        the BLAS threads there are now); otherwise nothing. Only on the main thread: passes on worker
        threads of one process (a Dask client's threads) would set and restore the process-wide BLAS limit
        over each other's pipelines."""
        import threading

        on_main = threading.current_thread() is threading.main_thread()
        if self._pairs is None or self.width < MIN_THREADED_WIDTH or not on_main:
            return contextlib.nullcontext()
        return self._pairs.pipeline(_blas_threads())

    def _syrk(self, Ft: np.ndarray) -> None:
        """G += Ft Ft^T on the lower triangle (mirrored in `gram_parts`), in place: one BLAS dsyrk into G,
        or (wider than POTRF_THREADED_MAX) panels of rows, each one GEMM Ft[a:b] Ft[:b]^T into a work
        array of about PANEL_BYTES added to G[a:b, :b]: the flops of a syrk, and no psi x psi product
        beside G. Several BLAS threads only pay off for a wide block.
        """
        W = self.width
        if W == 0:
            return
        with contextlib.nullcontext() if W >= MIN_THREADED_WIDTH else single_blas_thread():
            if self.G is None:
                self.G = np.zeros((W, W))
            if W <= POTRF_THREADED_MAX:
                # BLAS dsyrk straight into G (no work array): G's lower triangle (C order) is the upper
                # triangle of the F-ordered G^T, and Ft Ft^T = (Ft^T)^T (Ft^T) with Ft^T F-ordered
                from scipy.linalg import blas

                out = blas.dsyrk(1.0, Ft.T, beta=1.0, c=self.G.T, trans=1, lower=0, overwrite_c=1)
                if not np.shares_memory(out, self.G):  # a copy was made: keep its triangle
                    self.G[...] = np.tril(out.T)
                return
            # above it OpenBLAS's threaded syrk segfaults (backends.POTRF_THREADED_MAX): GEMM panels
            rows = max(1, min(W, PANEL_BYTES // (8 * W)))
            work = symgram.work_array(self._bufs, "P", rows, W)
            for a in range(0, W, rows):
                b = min(W, a + rows)
                w = work.reshape(-1)[:(b - a) * b].reshape(b - a, b)
                np.matmul(Ft[a:b], Ft[:b].T, out=w)
                self.G[a:b, :b] += w

    def result(self) -> np.ndarray | symgram.SymGram | None:
        """The sums: the SymGram of K, or G (its lower triangle; None when nothing was added); the work
        buffers released."""
        self._bufs.clear()
        if self._pairs is not None:
            self._pairs.join()
        out = self._pairs if self._pairs is not None else self.G
        self._pairs = self.G = None
        return out


def gram_parts(out: Any, width: int, nf: int, has_targets: bool
               ) -> tuple[np.ndarray | symgram.Pairs, np.ndarray | None, np.ndarray | None]:
    """(gram of the nf features, their moments, the target Gram) from a backend Gram's result: a
    symgram.SymGram (the gram held as its distinct entries, symgram.Pairs), or a (width, width) G of
    [Ht | Y] from its lower triangle (None: zeros), which is mirrored and compacted in place so that the
    gram is a C-contiguous nf x nf array at its start (moments and the target Gram are copied out first)."""
    if isinstance(out, symgram.SymGram):  # the Gram's distinct entries (mhla_cli.linalg.symgram)
        out.release_work()
        return symgram.Pairs(out.K, out.q, out.d), out.moments(), out.target_gram()
    G = out if out is not None else np.zeros((width, width))
    _mirror_lower(G)
    moments = G[:nf, nf:].copy() if has_targets else None
    target_gram = G[nf:, nf:].copy() if has_targets else None
    return _compact_leading(G, nf), moments, target_gram


def _mirror_lower(G: np.ndarray, tile: int = 256) -> None:
    """G[i, j] = G[j, i] for i < j, in place, tile by tile (G exactly symmetric from its lower triangle)."""
    n = G.shape[0]
    for i0 in range(0, n, tile):
        i1 = min(n, i0 + tile)
        D = G[i0:i1, i0:i1]
        D[np.triu_indices(i1 - i0, 1)] = D.T[np.triu_indices(i1 - i0, 1)]
        for j0 in range(i1, n, tile):
            j1 = min(n, j0 + tile)
            G[i0:i1, j0:j1] = G[j0:j1, i0:i1].T


def _compact_leading(G: np.ndarray, n: int, rows: int = 256) -> np.ndarray:
    """The leading n x n block of a C-contiguous square G, moved in place to G's first n^2 entries.

    Returns a C-contiguous (n, n) view of G's memory (G's other entries are overwritten).
    """
    W = G.shape[0]
    flat = G.reshape(-1)
    if W == n:
        return G
    # row i moves from i W to i n <= i W: rows done in increasing order never overwrite a row still
    # to be moved (numpy buffers the overlap within a block)
    for a in range(0, n, rows):
        b = min(n, a + rows)
        flat[a * n:b * n].reshape(b - a, n)[...] = G[a:b, :n]
    return flat[:n * n].reshape(n, n)


class Backend:
    """Where the psi x psi work runs: a factorization's matrix, a pass's Gram, the free memory."""

    device: str | None = None  # the spelling it was resolved from (None: the host)

    def matrix(self, a: np.ndarray) -> Any:
        """The backend's copy of a symmetric float64 matrix (HostMatrix / device.DeviceMatrix interface)."""
        raise NotImplementedError

    def gram(self, q: int, r: int, n_targets: int, width: int, nf: int,
             spans: tuple[np.ndarray, np.ndarray] | None = None, pairs: bool = False) -> Any:
        """An accumulator of a pass's Gram on the backend: `add(upper_t, last_t, targets_t)` per
        chunk (and, made with `pairs`, `add_windows(upper_t, xx, xy, yy)`: rows whose token factor is a
        second moment), `result()` a symgram.SymGram or G for `gram_parts` (HostGram, device.DeviceGram /
        DevicePairs)."""
        raise NotImplementedError

    def free_bytes(self) -> int | None:
        """The backend's free memory in bytes (None: the host's memory check applies)."""
        return None

    def last_outputs(self, coef: np.ndarray, S: np.ndarray, last: np.ndarray) -> np.ndarray:
        """The last-token outputs (B, d_out) = Ht(S_i, x_i) . p of a chunk: S (B, d, d) the sequences'
        X^T X (normalised as fitted), last (B, d) their last tokens, coef p (d_out, psi)."""
        raise NotImplementedError


class NumpyBackend(Backend):
    """NumPy / SciPy on the host (the default)."""

    def matrix(self, a: np.ndarray) -> HostMatrix:
        """a itself, not copied (`HostMatrix`)."""
        return HostMatrix(a)

    def gram(self, q: int, r: int, n_targets: int, width: int, nf: int,
             spans: tuple[np.ndarray, np.ndarray] | None = None, pairs: bool = False) -> HostGram:
        return HostGram(q, r, n_targets, width, nf, spans, pairs)

    def last_outputs(self, coef: np.ndarray, S: np.ndarray, last: np.ndarray) -> np.ndarray:
        """The chunk's features (B, psi) times p^T: one GEMM."""
        return features_from_moments(S, last) @ coef.T


class TorchBackend(Backend):
    """torch on a device ("cuda", "cuda:I", "torch:cpu": mhla_cli.linalg.device), float64 throughout."""

    def __init__(self, device: str) -> None:
        self.device: str = device

    def matrix(self, a: Any) -> Any:
        """One copy of a on the device (`device.DeviceMatrix`)."""
        return device_mod.DeviceMatrix(a, self.device)

    def gram(self, q: int, r: int, n_targets: int, width: int, nf: int,
             spans: tuple[np.ndarray, np.ndarray] | None = None, pairs: bool = False) -> Any:
        from .symgram import use_pairs

        if pairs or use_pairs(q, r):
            return device_mod.DevicePairs(self.device, q, r, n_targets, spans)
        return device_mod.DeviceGram(self.device, width, nf, spans)

    def free_bytes(self) -> int | None:
        """The GPU's free memory (None for torch on the CPU)."""
        return device_mod.free_bytes(self.device)

    def last_outputs(self, coef: np.ndarray, S: np.ndarray, last: np.ndarray) -> np.ndarray:
        """On the device from the pairs j <= k of S (`device.predict_last`), without the (B, psi) features."""
        j, k = pair_index(last.shape[1])  # the pairs of the tokens' coordinates
        return device_mod.predict_last(coef, S[:, j, k], last, self.device)


NUMPY = NumpyBackend()


def get_backend(device: str | Backend | None) -> Backend:
    """The backend of a checked `device` spelling (device.check_device): None / "cpu" numpy on the host,
    any other torch there; a Backend is returned as it is. A backend gives `matrix(a)` (what Factorization
    asks: eigenvalues, Cholesky, solves, products), `gram(...)` (the pass's Gram there) and `free_bytes()`."""
    if isinstance(device, Backend):
        return device
    if device is None or device == "cpu":
        return NUMPY
    return TorchBackend(device)
