"""Dask task graphs with deterministic keys (mhla_cli.linalg.task_graph) and the tiled factorization built
on them (mhla_cli.linalg.tiled_matrix), on dask's threaded and synchronous schedulers, no cluster: the
factor is numpy's, the verdict the inertia's just inside and outside the threshold, the keys a function of
the inputs, and the out-of-core path (tiles in a local Zarr store, every tile made spilled there) gives
the same factor, verdict and certificate as one machine's dense path."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from mhla_cli.linalg import task_graph
from mhla_cli.linalg.factorization import Factorization
from mhla_cli.linalg.task_graph import Stored, TaskGraph
from mhla_cli.linalg.tiled_matrix import TiledMatrix, tile_offsets
from conftest import gather_factor as dense_factor

pytest.importorskip("dask")
# spilled tiles live in local Zarr arrays (the `cluster` extra)
SPILL = pytest.mark.skipif(importlib.util.find_spec("zarr") is None, reason="spilling tiles needs zarr")

SIZES = [7, 5, 6, 6]


def spd(n: int, seed: int, floor: float) -> np.ndarray:
    """A symmetric positive definite matrix, eigenvalues from `floor` up (spread over four decades)."""
    rng = np.random.default_rng(seed)
    Q = np.linalg.qr(rng.standard_normal((n, n)))[0]
    w = np.sort(np.concatenate([[floor], floor + np.geomspace(1e-3, 10.0, n - 1)]))
    return (Q * w) @ Q.T


def lower_tiles(A: np.ndarray, sizes: list[int]) -> dict[tuple[int, int], np.ndarray]:
    o = tile_offsets(sizes)
    return {(i, j): np.ascontiguousarray(A[o[i]:o[i + 1], o[j]:o[j + 1]]) for i in range(len(sizes)) for j in range(i + 1)}


@pytest.mark.parametrize("spill", [False, pytest.param(True, marks=SPILL)])
def test_the_blocked_cholesky_graph_equals_numpy(tmp_path: Path, spill: bool) -> None:
    n = sum(SIZES)
    A = spd(n, 1, 0.05)
    m = TiledMatrix(None, lower_tiles(A, SIZES), SIZES, spill=tmp_path if spill else None)
    s = 0.01
    f = m.cholesky(s)
    Lref = np.linalg.cholesky(A - s * np.eye(n))
    assert np.abs(dense_factor(f, SIZES) - Lref).max() <= 1e-12 * np.abs(Lref).max()
    # spilled, the factor's tiles are references to Zarr arrays: nothing of the factor stays in memory
    assert all(isinstance(h, Stored) for h in f.tiles.values()) == spill
    X = np.random.default_rng(2).standard_normal((n, 2))
    assert np.abs(f.solve(X) - np.linalg.solve(A - s * np.eye(n), X)).max() <= 1e-10 * np.abs(f.solve(X)).max()
    assert np.abs(m.matmat(X) - A @ X).max() <= 1e-13 * np.abs(A @ X).max()
    if spill:  # the working copies of the trailing tiles are gone, the factor's are there
        (d,) = list(tmp_path.iterdir())
        assert sorted(p.name for p in d.iterdir()) == sorted(f"l-{i}-{j}" for i, j in f.tiles)


@pytest.mark.parametrize("spill", [False, pytest.param(True, marks=SPILL)])
def test_the_verdict_is_the_inertia_just_inside_and_outside(tmp_path: Path, spill: bool) -> None:
    """potrf of Lambda - t I fails exactly when t reaches lambda_min (a relative 1e-6 either side), at the
    first leading minor that is not positive definite, as numpy's eigenvalues of the minors say."""
    n = sum(SIZES)
    A = spd(n, 3, 0.2)
    lmin = float(np.linalg.eigvalsh(A)[0])
    m = TiledMatrix(None, lower_tiles(A, SIZES), SIZES, spill=tmp_path if spill else None)
    assert m.cholesky(lmin * (1 - 1e-6)) is not None
    t = lmin * (1 + 1e-6)
    assert m.cholesky(t) is None
    exc = m.failure(t)
    minors = [k for k in range(1, n + 1) if np.linalg.eigvalsh(A[:k, :k] - t * np.eye(k))[0] <= 0]
    assert exc.column == minors[0] - 1 and exc.tile == int(np.searchsorted(tile_offsets(SIZES), exc.column, "right")) - 1
    assert exc.of == len(SIZES)
    fac = Factorization(None, n, 1.0, matrix=m)
    assert fac.proves_above(lmin * (1 - 1e-6)) and not fac.proves_above(t)
    assert fac.cholesky_failure(t).column == exc.column and fac.cholesky_failure(lmin * (1 - 1e-6)) is None


def test_keys_are_a_function_of_the_inputs() -> None:
    n = sum(SIZES)
    A = spd(n, 4, 0.1)

    def keys(B: np.ndarray, sizes: list[int], s: float) -> set:
        return set(TiledMatrix(None, lower_tiles(B, sizes), sizes).cholesky_graph(s)[0].dsk)

    same = keys(A.copy(), SIZES, 0.01)
    assert same == keys(A, SIZES, 0.01)  # the same inputs, a copy: the same keys
    B = A.copy()
    B[0, 0] += 1e-15 * B[0, 0] or 1e-300
    for other in (keys(B, SIZES, 0.01), keys(A, [6, 6, 6, 6], 0.01)):
        assert not other & same  # another matrix: every key differs
    # another shift of the same matrix: the same keys for its tiles, others for every task
    assert {k for k in keys(A, SIZES, 0.02) & same} == {k for k in same if k.startswith("mhla-input-")}
    # every key names its kind, the token and the tile: "mhla-<kind>-<token>-<indices>"
    parts = [re.fullmatch(r"mhla-([a-z]+)-([0-9a-f]{32})((?:-\d+)+)", k) for k in same]
    assert all(parts) and {p[1] for p in parts} == {"input", "potrf", "trsm", "update", "failure"}
    assert sorted(p[3] for p in parts if p[1] == "potrf") == ["-0", "-1", "-2", "-3"]
    assert sorted(p[3] for p in parts if p[1] == "update") == sorted(
        f"-{i}-{j}-{k}" for k in range(4) for j in range(k + 1, 4) for i in range(j, 4))


def test_a_graph_runs_on_any_dask_get() -> None:
    """The same graph on the threaded and the synchronous scheduler, and on a `get` function passed as the
    matrix's scheduler."""
    import dask.local
    import dask.threaded

    g = TaskGraph("t")
    a = g.literal("x", np.arange(4.0), 0)
    b = g.submit("add", np.add, a, a, at=(0,))
    c = g.submit("sum", np.sum, b, raw=True)
    for get in (None, dask.threaded.get, dask.local.get_sync):
        values, kept = task_graph.run(get, g, [c], [b])
        assert values == [12.0] and np.array_equal(kept[0], 2 * np.arange(4.0))
    n = sum(SIZES)
    A = spd(n, 5, 0.3)
    f = TiledMatrix(dask.local.get_sync, lower_tiles(A, SIZES), SIZES).cholesky(0.0)
    assert np.abs(dense_factor(f, SIZES) - np.linalg.cholesky(A)).max() <= 1e-12 * np.abs(A).max() ** 0.5


def test_a_store_factors_out_of_core(tmp_path: Path) -> None:
    """A features store written without a cluster, its tiles read by the threaded scheduler's tasks from the
    store and every tile made spilled: certify gives the verdict and lambda_min of the dense path on the
    same statistics (statistics.stream.featurize on one machine)."""
    pytest.importorskip("zarr")
    from mhla_cli.model import synthetic
    from mhla_cli import certify
    from mhla_cli.statistics.files import zarr_store
    from mhla_cli.statistics.stream import featurize
    from mhla_cli.statistics.distributed.tiled_statistics import TiledStatistics

    ds, _ = synthetic.generate_teacher(3, 2, 120, "2:6", seed=7)
    ds.save(tmp_path / "data.h5", dtype="float64")
    one = featurize(tmp_path / "data.h5", spans="off")
    psi = one.n_features
    side = 2 * one.d  # two pairs a tile
    G = one.solver_stats()[1]  # the canonical Gram (basis_gram)
    sums = one.copy()
    sums.basis_gram = None
    stats = TiledStatistics(sums, TiledMatrix(None, lower_tiles(G, [side] * (psi // side)), [side] * (psi // side)), 2)
    url = zarr_store.save(stats, tmp_path / "f.zarr")
    local = zarr_store.load_tiled(url, None, spill=tmp_path / "spill")
    assert all(isinstance(h, Stored) for h in local.matrix.tiles.values())
    ref, got = certify(one), certify(local)
    assert got.identifiable == ref.identifiable
    assert abs(got.lambda_min - ref.lambda_min) <= 1e-8 * ref.lambda_min
