"""A symmetric matrix held as its lower tiles, and its blocked Cholesky factor, as Dask task graphs.

`TiledMatrix` is a backend matrix of mhla_cli.linalg.factorization (the protocol of
backends.HostMatrix): products (`matmat`, `matvec`), a Cholesky factor of a shifted copy
(`cholesky`, `TiledFactor`: `solve`, `inverse_matvec`, `inverse_matmat`), the solve of a shifted
system (`shifted_solve`) and where a Cholesky failed (`failure`). It has no eigensolver
(`eigensolver = False`: dask.array.linalg has none), so a Factorization over it takes the identifiable
path only: the verdict by a Cholesky of Lambda~ - t I, lambda_max and lambda_min by block Lanczos
(krylov), the fit by triangular solves; whatever needs eigenvectors raises factorization.NoEigensolver.

Tile (i, j), i >= j, is the block of rows `offsets[i]..offsets[i+1]` and columns `offsets[j]..` (the
upper tiles are their transposes and are never formed). Every operation is a dict graph with
deterministic keys (mhla_cli.linalg.task_graph: the token of the tiles, the shift or the vectors, and
the tile indices) run by a Dask scheduler: a dask.distributed Client (the tiles futures on its workers,
the factor's tiles left there), or on one machine dask's threaded scheduler (the tiles arrays, or
references to a Zarr store that the tasks read). Every task reads and writes a few tiles:

- the Cholesky (`cholesky_graph`) is the right-looking blocked algorithm, one task per tile operation:
  potrf of the diagonal tile, trsm of the tiles below it, then syrk / gemm updates of the trailing lower
  tiles (nb potrf, nb (nb - 1) / 2 trsm and about nb^3 / 6 updates for nb tile rows; an update reads
  its tile and two factor tiles and makes a new tile). A failed potrf (LAPACK's info > 0) is the proof
  that the matrix is not positive definite: the task returns `NotPositiveDefinite`, passed on by the
  tasks after it, and `cholesky` returns None with the column where it failed.
  dask.array.linalg.cholesky (measured against it in benchmarks/bench_distributed.py) reads the upper tiles too,
  forms every product L_ip L_kp^T of a tile's update as its own tile and sums them in one task (up to nb + 1 tiles
  held at once), and writes the transposed factor beside the factor: docs/cluster.md gives the measurement;
- a product Lambda X reads each lower tile once for both of its blocks (A_ij X_j and A_ij^T X_i);
- a triangular solve with the factor is a chain of small gemm tasks down the tile rows and a trsm
  on each diagonal tile, forward and then backward.

Out of core (`spill`, a local directory): every tile a task makes is written to its own Zarr array
there and only its reference travels (the trailing tiles' working copies in place, removed after the
Cholesky; the factor's kept until the directory is removed), and input tiles in a store are read by the
task that needs them. A task then holds a few tiles (three read, BLAS's Fortran-ordered copies of them,
the shifted copy, the result), so dask's threaded scheduler holds a number of tiles per thread whatever
the order n (docs/cluster.md gives the measurement); the disk holds the lower triangle about twice
(working copies and factor). Only blocks of n x k
vectors (k = the Lanczos block, or d right-hand sides) come back to the caller: it never holds a tile.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import task_graph

__all__ = ["NotPositiveDefinite", "TiledFactor", "TiledMatrix", "tile_offsets"]


class NotPositiveDefinite(ArithmeticError):
    """A potrf of a diagonal tile failed: the leading minor of order `column` + 1 of the shifted matrix
    is not positive (LAPACK's info > 0), so the matrix has an eigenvalue at or below the shift."""

    def __init__(self, column: int, tile: int = -1, of: int = -1) -> None:
        super().__init__(column, tile, of)
        self.column = int(column)
        self.tile = int(tile)
        self.of = int(of)  # the tile rows of the matrix

    def __str__(self) -> str:
        return f"the Cholesky failed at column {self.column} (tile row {self.tile})"


def tile_offsets(sizes: Sequence[int]) -> np.ndarray:
    """The first row of every tile and n at the end: (nb + 1,) int64."""
    return np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))])


# --------------------------------------------------------------------------------------------
# tasks (run on the workers; module-level so that they pickle by reference)
# --------------------------------------------------------------------------------------------


def _shifted(a: np.ndarray, shift: float) -> np.ndarray:
    """A new F-ordered float64 copy of the tile a with `shift` subtracted from its diagonal."""
    out = np.array(a, dtype=np.float64, order="F")
    if shift:
        out[np.diag_indices(out.shape[0])] -= shift
    return out


def _potrf(a: Any, shift: float, column0: int, tile: int) -> Any:
    """The lower Cholesky factor of the diagonal tile a - shift I (upper part zero); a NotPositiveDefinite
    (returned, not raised: the outcome of a proof, not an error) with the global column where LAPACK's
    dpotrf stopped, or the one of an earlier tile passed on."""
    from scipy.linalg import lapack

    if isinstance(a, NotPositiveDefinite):
        return a
    c, info = lapack.dpotrf(_shifted(a, shift), lower=1, clean=1, overwrite_a=1)
    if info < 0:
        raise ValueError(f"dpotrf: argument {-info} is invalid")
    if info > 0 or not np.isfinite(np.diagonal(c)).all():
        return NotPositiveDefinite(column0 + max(int(info), 1) - 1, tile)
    return c


def _trsm(lkk: Any, a: Any) -> Any:
    """L_ik = A_ik L_kk^-T (BLAS dtrsm from the right); a failure passed on."""
    from scipy.linalg import blas

    if isinstance(lkk, NotPositiveDefinite):
        return lkk
    return blas.dtrsm(1.0, lkk, np.array(a, dtype=np.float64, order="F"), side=1, lower=1, trans_a=1)


def _update(c: Any, li: Any, lj: Any, diagonal: bool, shift: float) -> Any:
    """The tile C - shift I - L_i L_j^T, a new array: dsyrk on a diagonal tile (its lower triangle, the
    one potrf reads), dgemm elsewhere; a failure passed on."""
    from scipy.linalg import blas

    for x in (c, li, lj):
        if isinstance(x, NotPositiveDefinite):
            return x
    out = _shifted(c, shift)
    if diagonal:
        return blas.dsyrk(-1.0, li, beta=1.0, c=out, lower=1, overwrite_c=1)
    return blas.dgemm(-1.0, li, lj, beta=1.0, c=out, trans_b=1, overwrite_c=1)


def _failure(lkk: Any) -> NotPositiveDefinite | None:
    """The failure a diagonal factor tile holds, else None (gathered instead of the tile)."""
    return lkk if isinstance(lkk, NotPositiveDefinite) else None


def _tile_products(a: np.ndarray, xi: np.ndarray, xj: np.ndarray, diagonal: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """(A_ij X_j, A_ij^T X_i) of a lower tile (the second None on the diagonal): one read of the tile
    for both blocks of the symmetric product."""
    if diagonal:
        return a @ xj, None
    return a @ xj, a.T @ xi


def _row_sum(parts: list[tuple[np.ndarray, np.ndarray | None]], sides: list[int]) -> np.ndarray:
    """The sum of the contributions to one block row: parts[k][sides[k]]."""
    total = None
    for part, side in zip(parts, sides):
        block = part[side]
        total = np.array(block) if total is None else total + block
    assert total is not None  # every block row has its diagonal tile
    return total


def _gemm_sub(acc: np.ndarray, l: np.ndarray, y: np.ndarray, transpose: bool) -> np.ndarray:
    """acc - L y (or acc - L^T y): one step of a blocked triangular solve."""
    return acc - (l.T @ y if transpose else l @ y)


def _trsm_left(l: np.ndarray, b: np.ndarray, transpose: bool) -> np.ndarray:
    """L^-1 b (or L^-T b) on a diagonal factor tile (BLAS dtrsm from the left)."""
    from scipy.linalg import blas

    return blas.dtrsm(1.0, l, np.array(b, dtype=np.float64, order="F"), lower=1, trans_a=1 if transpose else 0)


# --------------------------------------------------------------------------------------------
# the matrix and its factor (graphs built here, run by a Dask scheduler: mhla_cli.linalg.task_graph)
# --------------------------------------------------------------------------------------------


class TiledMatrix:
    """A symmetric n x n matrix as its lower tiles (module docstring): a backend matrix of
    mhla_cli.linalg.factorization without an eigensolver.

    `tiles[(i, j)]` (i >= j) are the tiles' handles: futures of a dask.distributed `client`, or, with
    `client` None (dask's threaded scheduler) or a dask `get` function, arrays or task_graph.Stored
    references to tiles in a store. `spill`: a local directory where every tile a graph makes is written
    (a Zarr array each; the out-of-core path). `sizes` the tile sides. `tasks` counts the tasks by kind;
    `failures[shift]` the NotPositiveDefinite of a Cholesky that failed."""

    eigensolver = False  # the factorization takes the identifiable path only (factorization.NoEigensolver)
    selects_eigenvectors = False
    solves_on_range = False

    def __init__(self, client: Any, tiles: dict[tuple[int, int], Any], sizes: Sequence[int],
                 spill: str | os.PathLike | None = None) -> None:
        self.client = client
        self.tiles = dict(tiles)
        self.sizes = [int(s) for s in sizes]
        self.spill = spill
        self.offsets = tile_offsets(self.sizes)
        self.nb = len(self.sizes)
        self.n = int(self.offsets[-1])
        self.shape = (self.n, self.n)
        self.tasks: dict[str, int] = {}
        self.failures: dict[float, NotPositiveDefinite] = {}
        self.seconds: dict[str, float] = {}
        self._token: str | None = None
        missing = [(i, j) for i in range(self.nb) for j in range(i + 1) if (i, j) not in self.tiles]
        if missing:
            raise ValueError(f"tiles {missing[:3]} of the lower triangle are missing")

    # ------------------------------------------------------------------ graphs
    @property
    def token(self) -> str:
        """dask.base.tokenize of the tile sides and every tile's handle (task_graph.handle_token)."""
        if self._token is None:
            from dask.base import tokenize

            self._token = tokenize(self.sizes, [(ij, task_graph.handle_token(h)) for ij, h in sorted(self.tiles.items())])
        return self._token

    def graph(self, kind: str, *inputs: Any) -> tuple[task_graph.TaskGraph, dict[tuple[int, int], Any]]:
        """A new graph whose token is that of the matrix, `kind` and `inputs`, and the keys of the tiles in it."""
        from dask.base import tokenize

        g = task_graph.TaskGraph(tokenize(self.token, kind, *inputs), self.spill)
        return g, {ij: g.literal("input", h, *ij, token=self.token) for ij, h in self.tiles.items()}

    def blocks(self, g: task_graph.TaskGraph, X: np.ndarray) -> list[Any]:
        """X (n x k) split into the tiles' row blocks, as values in the graph."""
        X = np.asarray(X, dtype=np.float64)
        return [g.literal("block", np.ascontiguousarray(X[a:b]), i)
                for i, (a, b) in enumerate(zip(self.offsets[:-1], self.offsets[1:]))]

    def run(self, g: task_graph.TaskGraph, gather: Sequence[Any], keep: Sequence[Any] = ()
            ) -> tuple[list[Any], list[Any]]:
        """The graph run on the matrix's scheduler (task_graph.run), its tasks counted."""
        for kind, n in g.counts.items():
            self.tasks[kind] = self.tasks.get(kind, 0) + n
        return task_graph.run(self.client, g, gather, keep)

    def tilewise(self, kind: str, fn: Callable[..., Any], *others: TiledMatrix) -> TiledMatrix:
        """The matrix of fn(tile, the other matrices' tiles...) per tile (tiled alike)."""
        g, T = self.graph(kind, *(o.token for o in others))
        ins = [{ij: g.literal("input", h, *ij, token=o.token) for ij, h in o.tiles.items()} for o in others]
        ijs = sorted(T)
        keys = [g.submit(kind, fn, T[ij], *(x[ij] for x in ins), at=ij, tile=f"{kind}-{ij[0]}-{ij[1]}") for ij in ijs]
        _, handles = self.run(g, [], keys)
        return TiledMatrix(self.client, dict(zip(ijs, handles)), self.sizes, self.spill)

    def per_tile(self, kind: str, fn: Callable[..., Any], *args: Any, index: bool = False) -> list[Any]:
        """fn(*args, tile), or fn(*args, i, j, tile) with `index`, of every tile (i, j) in sorted order: a
        small result each (only those come back, not the tiles)."""
        g, T = self.graph(kind, *args)
        return self.run(g, [g.submit(kind, fn, *args, *(ij if index else ()), t, at=ij) for ij, t in sorted(T.items())])[0]

    # ------------------------------------------------------------------ products
    def matmat(self, X: np.ndarray) -> np.ndarray:
        """A X for a block X (n x k): every lower tile read once (`_tile_products`), then a sum per block row."""
        X = np.asarray(X, dtype=np.float64)
        vec = X.ndim == 1
        g, T = self.graph("product", X)
        Xb = self.blocks(g, X[:, None] if vec else X)
        parts: dict[int, list[tuple[Any, int]]] = {i: [] for i in range(self.nb)}
        for (i, j), tile in T.items():
            p = g.submit("product", _tile_products, tile, Xb[i], Xb[j], i == j, at=(i, j))
            parts[i].append((p, 0))
            if i != j:
                parts[j].append((p, 1))
        rows = [g.submit("product-sum", _row_sum, [p for p, _ in parts[i]], [s for _, s in parts[i]], at=(i,))
                for i in range(self.nb)]
        Y = np.concatenate(self.run(g, rows)[0], axis=0)
        return Y[:, 0] if vec else Y

    def matvec(self, x: np.ndarray) -> np.ndarray:
        return self.matmat(x)

    # ------------------------------------------------------------------ factorizations
    def cholesky_graph(self, shift: float = 0.0) -> tuple[task_graph.TaskGraph, dict[tuple[int, int], Any], list[Any]]:
        """The graph of the blocked Cholesky of the matrix - shift I (module docstring): (the graph, the
        keys of the factor's tiles, the keys of the diagonal tiles' failures: None or NotPositiveDefinite)."""
        g, A = self.graph("cholesky", float(shift))
        fresh = set(A)  # tiles not updated yet: the shift is applied at their first touch
        L: dict[tuple[int, int], Any] = {}
        nb = self.nb
        for k in range(nb):
            s = shift if (k, k) in fresh else 0.0
            L[k, k] = g.submit("potrf", _potrf, A[k, k], s, int(self.offsets[k]), k, at=(k,), tile=f"l-{k}-{k}")
            for i in range(k + 1, nb):
                L[i, k] = g.submit("trsm", _trsm, L[k, k], A[i, k], at=(i, k), tile=f"l-{i}-{k}")
            for j in range(k + 1, nb):
                for i in range(j, nb):
                    s = shift if (i == j and (i, j) in fresh) else 0.0
                    # spilled in place: the one task that reads a version writes the next
                    A[i, j] = g.submit("update", _update, A[i, j], L[i, k], L[j, k], i == j, s, at=(i, j, k),
                                       tile=f"a-{i}-{j}")
                    fresh.discard((i, j))
        return g, L, [g.submit("failure", _failure, L[k, k], at=(k,), raw=True) for k in range(nb)]

    def cholesky(self, shift: float = 0.0) -> TiledFactor | None:
        """The blocked Cholesky factor of the matrix - shift I (module docstring), its tiles left where
        the scheduler keeps them (on the cluster, or in the spill directory); None when a potrf fails
        (the reason kept in `failures[shift]`)."""
        t0 = time.perf_counter()
        g, L, checks = self.cholesky_graph(shift)
        # the factor's tiles stay where they are made: only whether each diagonal tile failed comes back
        failures, handles = self.run(g, checks, list(L.values()))
        failed = [f for f in failures if f is not None]
        if g.spill is not None and os.path.isdir(g.spill):  # the working copies of the trailing tiles; all when failed
            for name in ([""] if failed else [n for n in os.listdir(g.spill) if n.startswith("a-")]):
                shutil.rmtree(os.path.join(g.spill, name), ignore_errors=True)
        self.seconds["cholesky"] = self.seconds.get("cholesky", 0.0) + time.perf_counter() - t0
        if failed:
            first = min(failed, key=lambda f: f.column)
            self.failures[float(shift)] = NotPositiveDefinite(first.column, first.tile, self.nb)
            task_graph.release(handles)
            return None
        return TiledFactor(self, dict(zip(L, handles)), g.token)

    def failure(self, shift: float) -> NotPositiveDefinite | None:
        """Why the Cholesky of the matrix - shift I failed (where), None when it did not or was not tried."""
        return self.failures.get(float(shift))

    def shifted_solve(self, scale: float, shift: float, rhs: np.ndarray) -> np.ndarray | None:
        """(scale A + shift I) x = rhs by a Cholesky of A + (shift / scale) I (released after the solve);
        None when that matrix is not numerically positive definite."""
        f = self.cholesky(-shift / scale)
        if f is None:
            return None
        try:
            return f.solve(rhs) / scale
        finally:
            f.release()

    def eigvalsh(self) -> np.ndarray:
        from .factorization import NoEigensolver

        raise NoEigensolver("the eigenvalues")

    eigh = eigh_below = eigvalsh

    def release(self) -> None:
        """Drop the references to the tiles (a cluster frees them)."""
        task_graph.release(self.tiles.values())
        self.tiles = {}


class TiledFactor:
    """The lower Cholesky factor of a TiledMatrix (minus a shift): its tiles' handles, the token of the
    graph that made them, and the blocked triangular solves with it (module docstring)."""

    def __init__(self, matrix: TiledMatrix, tiles: dict[tuple[int, int], Any], token: str) -> None:
        self.matrix = matrix
        self.tiles = tiles
        self.token = token

    def _forward(self, m: task_graph.TaskGraph, F: dict[tuple[int, int], Any], B: list[Any]) -> list[Any]:
        """y with L y = b, block by block down the rows (F: the factor's keys in the graph m)."""
        Y: list[Any] = []
        for i in range(self.matrix.nb):
            acc = B[i]
            for j in range(i):
                acc = m.submit("solve", _gemm_sub, acc, F[i, j], Y[j], False)
            Y.append(m.submit("solve", _trsm_left, F[i, i], acc, False))
        return Y

    def _backward(self, m: task_graph.TaskGraph, F: dict[tuple[int, int], Any], Y: list[Any]) -> list[Any]:
        """x with L^T x = y, block by block up the rows."""
        nb = self.matrix.nb
        X: list[Any] = [None] * nb
        for i in reversed(range(nb)):
            acc = Y[i]
            for j in range(i + 1, nb):
                acc = m.submit("solve", _gemm_sub, acc, F[j, i], X[j], True)
            X[i] = m.submit("solve", _trsm_left, F[i, i], acc, True)
        return X

    def solve_graph(self, rhs: np.ndarray) -> tuple[task_graph.TaskGraph, list[Any]]:
        """The graph of (L L^T)^-1 rhs (rhs n x k): the forward and backward sweeps; the keys of x's blocks."""
        from dask.base import tokenize

        g = task_graph.TaskGraph(tokenize(self.token, "solve", rhs), self.matrix.spill)
        F = {ij: g.literal("factor", h, *ij, token=self.token) for ij, h in self.tiles.items()}
        return g, self._backward(g, F, self._forward(g, F, self.matrix.blocks(g, rhs)))

    def solve(self, rhs: np.ndarray) -> np.ndarray:
        """(L L^T)^-1 rhs: the shifted matrix's inverse applied to rhs (n or n x k)."""
        rhs = np.asarray(rhs, dtype=np.float64)
        vec = rhs.ndim == 1
        g, X = self.solve_graph(rhs[:, None] if vec else rhs)
        x = np.concatenate(self.matrix.run(g, X)[0], axis=0)
        return x[:, 0] if vec else x

    inverse_matmat = inverse_matvec = solve

    def release(self) -> None:
        task_graph.release(self.tiles.values())
        self.tiles = {}
