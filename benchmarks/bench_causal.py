"""Causal (per-position) featurize at d = 16 vs a bare float64 dsyrk of the same block width.

Every position of every sequence is a sample, so featurize does one syrk of the (T x psi) block of
all prefix features (built from running prefix Grams). Both rates are measured in this one run,
and the ratio is the figure of merit (target >= 60 %). Flops are counted as T * psi * (psi + 1),
the syrk of the feature block (the d target columns and the feature construction are overhead).

Run: python benchmarks/bench_causal.py [--n-samples N] [--seq-len n] [--dim d] [--repeat R]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import OUT, machine, table  # noqa: E402
from bench_gflops import dsyrk_gflops  # noqa: E402

from mhla_cli.feature_map import n_features  # noqa: E402
from mhla_cli.statistics.stream import featurize  # noqa: E402


def causal_file(N: int, n: int, d: int, seed: int = 0) -> str:
    """Dense float32 tokens (N, n, d) with per-position targets (N, n, d)."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"causal_{N}x{n}x{d}.h5"
    if not path.exists():
        rng = np.random.default_rng(seed)
        with h5py.File(path, "w") as f:
            f["tokens"] = rng.standard_normal((N, n, d)).astype(np.float32)
            f["targets"] = rng.standard_normal((N, n, d))
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n-samples", type=int, default=512, help="sequences N")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    d, N, n = args.dim, args.n_samples, args.seq_len
    psi = n_features(d)
    T = N * n
    data = causal_file(N, n, d)
    flops = T * psi * (psi + 1)
    featurize(data)  # warm the page cache and the BLAS
    best = float("inf")
    for _ in range(args.repeat):
        t = time.perf_counter()
        feats = featurize(data)
        best = min(best, time.perf_counter() - t)
    assert feats.per_position and feats.n_samples == T
    syrk_s, syrk_n = dsyrk_gflops(psi, repeat=args.repeat)
    base = max(syrk_s, syrk_n)
    rate = flops / best / 1e9
    print(machine())
    print()
    print(f"d = {d}, psi = {psi}, N = {N} sequences of n = {n} -> T = {T} positions (samples), float32 tokens; "
          f"best of {args.repeat}")
    print()
    print(table(["what", "time (s)", "GFLOP/s", "share of dsyrk"],
                [["causal featurize (in process)", f"{best:.3f}", f"{rate:.1f}", f"{100 * rate / base:.0f} %"],
                 ["bare dsyrk (4096 x psi, scipy)", "", f"{syrk_s:.1f}", ""],
                 ["bare F.T @ F (4096 x psi, numpy)", "", f"{syrk_n:.1f}", ""]]))
    print()
    print(f"ratio = {rate / base:.3f} (target >= 0.60)")


if __name__ == "__main__":
    main()
