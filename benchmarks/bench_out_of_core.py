"""The tiled Cholesky out of core on one machine (mhla_cli.linalg.tiled_matrix with `spill`, dask's threaded
scheduler): this process's peak RSS against the Gram's size, and against the same graph in memory.

One run per process (the peak RSS, VmHWM, is the process's): a symmetric positive definite matrix of order
--n in tiles of --tile (R + R^T + n I, R random: benchmarks/bench_distributed.py's), written tile by tile to
a local Zarr store (out of core: never whole in memory) or kept as arrays (in memory), then its blocked
Cholesky and one solve. Prints one line: the sizes, the seconds, the peak RSS before and after.

  python benchmarks/bench_out_of_core.py spill 8192 1024
  python benchmarks/bench_out_of_core.py memory 8192 1024
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mhla_cli.linalg.task_graph import Spill, write_tile  # noqa: E402
from mhla_cli.linalg.tiled_matrix import TiledMatrix  # noqa: E402


def tile(i: int, j: int, ts: int, n: int, seed: int = 0) -> np.ndarray:
    """Tile (i, j) of R + R^T + n I with R random in [0, 1): symmetric, diagonally dominant (PD)."""
    r = np.random.default_rng([seed, i, j]).random((ts, ts))
    if i != j:
        return r + np.random.default_rng([seed, j, i]).random((ts, ts)).T
    return r + r.T + n * np.eye(ts)


def peak_mib() -> float:
    """This process's peak RSS (VmHWM), MiB."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmHWM:"))


def main(mode: str, n: int, ts: int) -> None:
    nb = n // ts
    d = tempfile.mkdtemp()
    try:
        if mode == "spill":
            tiles = {(i, j): write_tile(Spill(os.path.join(d, "in", f"{i}-{j}")), tile(i, j, ts, n))
                     for i in range(nb) for j in range(i + 1)}
            m = TiledMatrix(None, tiles, [ts] * nb, spill=os.path.join(d, "spill"))
        else:
            m = TiledMatrix(None, {(i, j): tile(i, j, ts, n) for i in range(nb) for j in range(i + 1)}, [ts] * nb)
        before = peak_mib()
        t = time.perf_counter()
        f = m.cholesky(0.0)
        seconds = time.perf_counter() - t
        assert f is not None
        f.solve(np.ones(n))
        print(f"{mode} n={n} tile={ts}: lower triangle {8 * n * n / 2 / 2**20:.0f} MiB, tile {8 * ts * ts / 2**20:.0f} "
              f"MiB; cholesky {seconds:.1f} s; peak RSS before {before:.0f} MiB, after the Cholesky and a solve "
              f"{peak_mib():.0f} MiB")
    finally:
        shutil.rmtree(d)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
