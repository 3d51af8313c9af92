"""The Gram as tiles on a Dask cluster (mhla_cli.statistics.storage.gram_tiled): the storage interface over the
tiles, against numpy on the dense Gram of materialised features; nothing gathers the Gram (what would is
refused with one line), and the statistics accumulated on a cluster hand their tiles to the factorization
through it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from _records import ragged_data
from mhla_cli.errors import InputError
from mhla_cli.linalg.tiled_matrix import TiledMatrix, tile_offsets
from mhla_cli.statistics.storage import gram_storage
from mhla_cli.statistics.storage.gram_tiled import TiledGram
from conftest import gather_tiles

distributed = pytest.importorskip("dask.distributed")

SIZES = [6, 6, 6]  # d = 3: q = 6 pairs, psi = 18, 2 pairs a tile


def gram(seed: int) -> np.ndarray:
    """The canonical Gram of materialised features of random sequences (tests/_reference.py)."""
    import _reference as ref

    X, off, _ = ragged_data(seed, n=40, d=3)
    Ht = np.stack([ref.canonical_features(X[a:b]) for a, b in zip(off[:-1], off[1:])])
    return Ht.T @ Ht


def tiled(client, G: np.ndarray) -> TiledGram:
    """The Gram's lower tiles as a TiledGram: futures of `client`, or arrays run on dask's threaded
    scheduler when `client` is None (the storage is the same over both: mhla_cli.linalg.task_graph)."""
    o = tile_offsets(SIZES)
    tiles = {(i, j): np.ascontiguousarray(G[o[i]:o[i + 1], o[j]:o[j + 1]])
             for i in range(len(SIZES)) for j in range(i + 1)}
    if client is not None:
        tiles = {ij: client.scatter(t) for ij, t in tiles.items()}
    s = gram_storage.wrap(TiledMatrix(client, tiles, SIZES))
    assert isinstance(s, TiledGram)
    return s


def gathered(s: TiledGram) -> np.ndarray:
    """The tiles gathered (the test's only gather)."""
    return gather_tiles(s.held)


def test_sum_copy_and_zeros_run_on_the_tiles() -> None:
    client = None  # dask's threaded scheduler
    G1, G2 = gram(1), gram(2)
    a, b = tiled(client, G1), tiled(client, G2)
    total = a.add(b)
    assert isinstance(total, TiledGram) and total.n == 18
    assert np.abs(gathered(total) - (G1 + G2)).max() <= 1e-13 * np.abs(G1 + G2).max()
    assert np.array_equal(gathered(a), G1)  # tiles are never changed in place
    assert not gathered(a.zeros_like()).any() and np.array_equal(gathered(a.copy()), G1)
    assert a.all_finite()
    bad = G1.copy()
    bad[13, 2] = bad[2, 13] = np.nan
    assert not tiled(client, bad).all_finite()


def test_factorization_over_the_tiles_is_of_the_gram() -> None:
    client = None  # dask's threaded scheduler
    G = gram(3)
    fac = tiled(client, G).factorization(scale=1.0 / 40)
    w = np.linalg.eigvalsh(G / 40)
    assert not fac.has_eigensolver
    assert abs(fac.lambda_max() - w[-1]) <= 1e-8 * w[-1]
    assert fac.proves_above(0.5 * w[0]) and not fac.proves_above(2.0 * w[0])


def test_what_would_gather_or_mix_the_tiles_is_refused() -> None:
    client = None  # dask's threaded scheduler
    s = tiled(client, gram(4))
    for call, match in ((s.expand, "gathered into one process"), (lambda: s.pairs(6, 3), "gathered"),
                        (lambda: s.congruence(np.eye(6), np.eye(3)), "change of basis"),
                        (s.written, "Zarr store"),
                        (lambda: s.add(gram_storage.wrap(gram(4))), "on the cluster \\(the scheduler argument\\)"),
                        (lambda: s.factorization(device="cuda"), "on the workers")):
        with pytest.raises(InputError, match=match):
            call()
    other = TiledMatrix(client, {(0, 0): gram(4)}, [18])
    with pytest.raises(InputError, match="tiled differently"):
        s.add(TiledGram(other))


def test_accumulated_statistics_hand_their_tiles_over(client, tmp_path: Path) -> None:
    """statistics.distributed.tiled_statistics.accumulate: its `gram` is this storage over the same tiles, and the cluster
    factorization (solve.cluster) is that storage's."""
    from mhla_cli.model import synthetic
    from mhla_cli.solve import cluster
    from mhla_cli.statistics.distributed import tiled_statistics

    ds, _ = synthetic.generate_teacher(3, 2, 120, "2:7", seed=0)
    ds.save(tmp_path / "t.h5", dtype="float64")
    stats = tiled_statistics.accumulate(tmp_path / "t.h5", client, chunk_size=31, tile_features=6)
    try:
        assert isinstance(stats.gram, TiledGram) and stats.gram.held is stats.matrix
        fac = cluster.factorization(stats)
        assert fac._matrix() is stats.matrix and abs(fac.scale - 1.0 / stats.sums.weight) == 0.0
    finally:
        stats.release()
