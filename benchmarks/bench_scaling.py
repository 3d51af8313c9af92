"""Target 6: featurize time vs N (linear) and vs d (psi^2 ~ d^6 / 4 in the Gram step).

In-process `featurize` (library) on uncompressed float32 files, n = 32.
Run: python benchmarks/bench_scaling.py [--max-n N] [--dims 2,4,...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, table, tokens_file  # noqa: E402

from mhla_cli.feature_map import n_features  # noqa: E402
from mhla_cli.statistics.stream import featurize  # noqa: E402


def timed(path: str, **kw: object) -> float:
    featurize(path, **kw)  # page cache, buffers
    t = time.perf_counter()
    featurize(path, **kw)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-n", type=int, default=1_000_000)
    ap.add_argument("--dim-n", type=int, default=8, help="d of the N sweep")
    ap.add_argument("--dims", default="2,4,8,12,16,20,24")
    ap.add_argument("--n-for-d", type=int, default=10000, help="N of the d sweep")
    ap.add_argument("--workers", action="store_true", help="also time --workers 2 (threads and processes)")
    args = ap.parse_args()
    print(machine() + "\n")
    rows = []
    N = 1000
    prev = None
    d = args.dim_n
    while N <= args.max_n:
        t = timed(str(tokens_file(N, 32, d)))
        rows.append([N, t, N / t, f"{t / prev[1] / (N / prev[0]):.2f}" if prev else "-"])
        prev = (N, t)
        N *= 10
    print(f"## featurize time vs N (d = {d}, psi = {n_features(d)}, n = 32)\n")
    print(table(["N", "seconds", "samples / s", "time ratio / N ratio"], rows))
    rows = []
    prev = None
    N = args.n_for_d
    for d in (int(x) for x in args.dims.split(",")):
        psi = n_features(d)
        path = str(tokens_file(N, 32, d))
        t = timed(path)
        row = [d, psi, t, N * psi * (psi + 1) / t / 1e9,
               f"{(t / prev[1]) / ((psi / prev[0]) ** 2):.2f}" if prev else "-"]
        if args.workers:
            os.environ["MHLA_PARALLEL_BACKEND"] = "thread"
            row.append(timed(path, workers=2))
            os.environ["MHLA_PARALLEL_BACKEND"] = "process"
            row.append(timed(path, workers=2))
        rows.append(row)
        prev = (psi, t)
    print(f"\n## featurize time vs d (N = {N}, n = 32)\n")
    print(table(["d", "psi", "seconds", "GFLOP/s (N psi (psi+1))", "time ratio / psi^2 ratio"]
                + (["--workers 2 threads s", "--workers 2 processes s"] if args.workers else []), rows))


if __name__ == "__main__":
    main()
