"""The tiled matrix (mhla_cli.linalg.tiled_matrix): its blocked Cholesky, products and triangular solves
against numpy on the dense matrix, the proof by inertia at the threshold, and the Factorization over it
(identifiable path only). The graphs run on dask's threaded scheduler; one test runs them on a
dask.distributed LocalCluster (the cluster path: the factor's tiles stay there as futures)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mhla_cli.linalg.factorization import Factorization, NoEigensolver
from mhla_cli.linalg.tiled_matrix import TiledMatrix, tile_offsets
from conftest import gather_factor as factor_dense

pytest.importorskip("dask")


def spd(n: int, seed: int = 0, floor: float = 0.0) -> np.ndarray:
    """A symmetric positive semidefinite matrix with a spread spectrum (eigenvalues from `floor` up)."""
    rng = np.random.default_rng(seed)
    Q = np.linalg.qr(rng.standard_normal((n, n)))[0]
    w = np.sort(np.concatenate([[floor], floor + np.geomspace(1e-3, 10.0, n - 1)]))
    return (Q * w) @ Q.T


def tiled(client, A: np.ndarray, sizes: list[int]) -> TiledMatrix:
    """A's lower tiles: futures of `client`, or (None) arrays for dask's threaded scheduler."""
    off = tile_offsets(sizes)
    tiles = {(i, j): np.ascontiguousarray(A[off[i]:off[i + 1], off[j]:off[j + 1]])
             for i in range(len(sizes)) for j in range(i + 1)}
    if client is not None:
        tiles = {ij: client.scatter(t) for ij, t in tiles.items()}
    return TiledMatrix(client, tiles, sizes)


@pytest.mark.parametrize("sizes", [[40], [10, 10, 10, 10], [13, 7, 11, 9]])
def test_blocked_cholesky_products_and_solves_equal_numpy(sizes: list[int]) -> None:
    n = sum(sizes)
    A = spd(n, 1, floor=0.05)
    m = tiled(None, A, sizes)
    X = np.random.default_rng(2).standard_normal((n, 3))
    assert np.abs(m.matmat(X) - A @ X).max() <= 1e-13 * np.abs(A @ X).max()
    assert np.abs(m.matvec(X[:, 0]) - A @ X[:, 0]).max() <= 1e-13 * np.abs(A @ X[:, 0]).max()
    s = 0.01
    f = m.cholesky(s)
    assert f is not None
    Lref = np.linalg.cholesky(A - s * np.eye(n))
    assert np.abs(factor_dense(f, sizes) - Lref).max() <= 1e-12 * np.abs(Lref).max()
    x = f.solve(X)
    assert np.abs(x - np.linalg.solve(A - s * np.eye(n), X)).max() <= 1e-10 * np.abs(x).max()
    nb = len(sizes)
    updates = sum((nb - k - 1) * (nb - k) // 2 for k in range(nb))  # the trailing lower tiles at each step k
    counts = {"potrf": nb, "trsm": nb * (nb - 1) // 2, "update": updates}
    assert {k: m.tasks.get(k, 0) for k in counts} == counts  # one task per tile operation, nothing more


def test_cholesky_fails_exactly_where_the_dense_one_does() -> None:
    """The verdict is the inertia: a shift just below lambda_min factors, just above it fails, and the
    failing column is the first leading minor of A - s I that is not positive definite."""
    n, sizes = 36, [9, 9, 9, 9]
    A = spd(n, 3, floor=0.2)
    lmin = float(np.linalg.eigvalsh(A)[0])
    m = tiled(None, A, sizes)
    assert m.cholesky(lmin * (1 - 1e-6)) is not None
    s = lmin * (1 + 1e-6)
    assert m.cholesky(s) is None
    col = m.failures[s].column
    minors = [k for k in range(1, n + 1) if np.linalg.eigvalsh(A[:k, :k] - s * np.eye(k))[0] <= 0]
    assert col == minors[0] - 1 and m.failures[s].tile == col // 9


def test_factorization_over_tiles_takes_the_identifiable_path_only() -> None:
    n = 48
    A = spd(n, 4, floor=0.3)
    w = np.linalg.eigvalsh(A)
    fac = Factorization(None, n, 0.5, matrix=tiled(None, A, [12] * 4))
    assert not fac.dense and not fac.has_eigensolver
    assert abs(fac.lambda_max() - 0.5 * w[-1]) <= 1e-7 * 0.5 * w[-1]
    assert fac.proves_above(1e-3) and not fac.proves_above(0.5 * w[0] * 1.001)
    assert abs(fac.lambda_min() - 0.5 * w[0]) <= 1e-8 * 0.5 * w[0]
    assert fac.iterations["lambda_min"]["converged"] and fac.iterations["lambda_max"]["converged"]
    b = np.arange(n, dtype=float)
    assert np.abs(fac.solve(b) - np.linalg.solve(0.5 * A, b)).max() <= 1e-10 * np.abs(np.linalg.solve(0.5 * A, b)).max()
    assert np.abs(fac.ridge_solve(b, 0.1, 1e-12) - np.linalg.solve(0.5 * A + 0.1 * np.eye(n), b)).max() <= 1e-10
    for what in (fac.eigenvalues, fac.eigh, lambda: fac.null_space(1.0)):
        with pytest.raises(NoEigensolver, match="no distributed form"):
            what()


def test_lambda_min_without_a_factor_is_a_lanczos_estimate() -> None:
    """A singular matrix: every Cholesky at or below the tolerance fails, and lambda_min comes from
    lambda_max I - A (an estimate with its record), near 0 within the residual."""
    n = 40
    A = spd(n, 5, floor=0.0)
    fac = Factorization(None, n, 1.0, matrix=tiled(None, A, [10] * 4))
    lmax = fac.lambda_max()
    assert not fac.proves_above(1e-14 * lmax)
    lmin = fac.lambda_min()
    rec = fac.iterations["lambda_min"]
    assert abs(lmin) <= 10 * rec["relative_residual"] * lmax + 1e-12 * lmax


def test_blocked_cholesky_on_a_distributed_client_is_the_threaded_one(client) -> None:
    """The one LocalCluster test of the tiled factorization: the same graph on a dask.distributed Client
    (the factor's tiles left there as futures under the same deterministic keys), its factor and solve
    numpy's; dask.array.linalg.cholesky gives the same factor."""
    distributed = pytest.importorskip("dask.distributed")
    sizes = [8, 8, 8]
    A = spd(24, 6, floor=0.1)
    m = tiled(client, A, sizes)
    mine = m.cholesky(0.05)
    assert all(isinstance(f, distributed.Future) for f in mine.tiles.values())
    here = tiled(None, A, sizes).cholesky(0.05)
    assert {f.key for f in mine.tiles.values()} == set(m.cholesky_graph(0.05)[1].values())
    assert np.abs(factor_dense(mine, sizes) - factor_dense(here, sizes)).max() <= 1e-13
    b = np.linspace(-1, 1, 24)
    assert np.abs(mine.solve(b) - np.linalg.solve(A - 0.05 * np.eye(24), b)).max() <= 1e-10
    assert m.cholesky(float(np.linalg.eigvalsh(A)[0]) * 1.001) is None
    import dask.array as da

    lib = da.linalg.cholesky(da.from_array(A - 0.05 * np.eye(24), chunks=8), lower=True).compute(scheduler="sync")
    assert np.abs(factor_dense(mine, sizes) - lib).max() <= 1e-13 * np.abs(lib).max()
    assert tile_offsets(sizes)[-1] == 24


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=4), seed=st.integers(0, 2**16),
       side=st.sampled_from([-1, 1]))
def test_any_tiling_proves_what_the_inertia_says(sizes: list[int], seed: int, side: int) -> None:
    """Whatever the tiles, the blocked Cholesky of A - s I succeeds exactly when every eigenvalue of A
    exceeds s (s just below or just above lambda_min), and its solve is numpy's."""
    n = sum(sizes)
    A = spd(n, seed, floor=0.1) if n > 1 else np.array([[0.7]])
    lmin = float(np.linalg.eigvalsh(A)[0])
    s = lmin * (1 - side * 1e-6)
    f = tiled(None, A, sizes).cholesky(s)
    assert (f is not None) == (side == 1)
    if f is not None:
        b = np.linspace(-1, 1, n)
        x = np.linalg.solve(A - s * np.eye(n), b)
        assert np.abs(f.solve(b) - x).max() <= 1e-6 * np.abs(x).max()  # A - s I is near singular: cond ~ 1e7
