"""Threads or processes for --workers? featurize serial vs 2 workers of each kind, same run.

Run: python benchmarks/bench_workers.py [--repeat R]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, table, tokens_file  # noqa: E402

from mhla_cli.statistics.stream import featurize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    cases = [(4, 100, 200_000), (8, 32, 200_000), (16, 32, 20_000)]
    rows = []
    for d, n, N in cases:
        path = str(tokens_file(N, n, d))
        featurize(path)
        best = {"serial": float("inf"), "thread": float("inf"), "process": float("inf")}
        for _ in range(args.repeat):  # interleaved, so that load changes hit all three alike
            for kind in best:
                os.environ["MHLA_PARALLEL_BACKEND"] = "thread" if kind == "serial" else kind
                t = time.perf_counter()
                featurize(path, workers=1 if kind == "serial" else args.workers)
                best[kind] = min(best[kind], time.perf_counter() - t)
        rows.append([d, n, N, best["serial"], best["thread"], best["process"],
                     f"{best['serial'] / best['thread']:.2f}", f"{best['serial'] / best['process']:.2f}"])
    print(f"## --workers {args.workers}: threads vs processes (library featurize, best of {args.repeat})\n")
    print(machine() + "\n")
    print(table(["d", "n", "N", "serial s", "threads s", "processes s", "speed-up threads",
                 "speed-up processes"], rows))


if __name__ == "__main__":
    main()
