"""Target 1: `mhla featurize` (whole process) GFLOP/s vs a bare float64 dsyrk on (4096 x psi).

d = 16, N = 50000, n = 32, float32 tokens; flops counted as N * psi * (psi + 1) (the syrk of the
N x psi feature matrix). Run: python benchmarks/bench_gflops.py [--n-samples N] [--repeat R]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import scipy.linalg.blas as sblas
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import OUT, machine, mhla_cmd, run_timed, table, tokens_file  # noqa: E402

from mhla_cli.features import n_features  # noqa: E402
from mhla_cli.stream import featurize  # noqa: E402


def dsyrk_gflops(psi: int, rows: int = 4096, repeat: int = 5) -> tuple[float, float]:
    """Best GFLOP/s of scipy's dsyrk and of numpy's F.T @ F on a (rows x psi) float64 block."""
    rng = np.random.default_rng(0)
    F = np.asfortranarray(rng.standard_normal((rows, psi)))
    C = np.zeros((psi, psi), order="F")
    flops = rows * psi * (psi + 1)
    best_s = best_n = float("inf")
    Fc = np.ascontiguousarray(F)
    out = np.empty((psi, psi))
    sblas.dsyrk(1.0, F, beta=0.0, c=C, trans=1, lower=0, overwrite_c=1)
    np.matmul(Fc.T, Fc, out=out)
    for _ in range(repeat):
        t = time.perf_counter()
        sblas.dsyrk(1.0, F, beta=1.0, c=C, trans=1, lower=0, overwrite_c=1)
        best_s = min(best_s, time.perf_counter() - t)
    for _ in range(repeat):
        t = time.perf_counter()
        np.matmul(Fc.T, Fc, out=out)
        best_n = min(best_n, time.perf_counter() - t)
    return flops / best_s / 1e9, flops / best_n / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n-samples", type=int, default=50000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    d, N = args.dim, args.n_samples
    psi = n_features(d)
    data = tokens_file(N, args.seq_len, d)
    out = OUT / "gflops_feats.h5"
    flops = N * psi * (psi + 1)
    featurize(data)  # warm the page cache
    rows = []
    for threads in (None, 1):
        label = "default (all cores)" if threads is None else f"{threads}"
        with threadpool_limits(limits=threads):
            s_gf, n_gf = dsyrk_gflops(psi)
        env = dict(os.environ)
        if threads is not None:
            env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        t_cli = run_timed(mhla_cmd("featurize", str(data), "-o", str(out), "-q"), args.repeat, env)
        with threadpool_limits(limits=threads):
            t0 = time.perf_counter()
            featurize(data)
            t_lib = time.perf_counter() - t0
        rows.append([f"BLAS threads {label}", s_gf, n_gf, flops / t_cli / 1e9, flops / t_lib / 1e9,
                     f"{flops / t_cli / 1e9 / s_gf:.0%}", f"{t_cli:.2f}"])
    t_w = run_timed(mhla_cmd("featurize", str(data), "-o", str(out), "-q", "--workers", "2"), args.repeat)
    with threadpool_limits(limits=None):
        s_gf, n_gf = dsyrk_gflops(psi)
    rows.append(["--workers 2 (1 BLAS thread each)", s_gf, n_gf, flops / t_w / 1e9, float("nan"),
                 f"{flops / t_w / 1e9 / s_gf:.0%}", f"{t_w:.2f}"])
    print(f"## featurize vs bare dsyrk: d = {d}, psi = {psi}, N = {N}, n = {args.seq_len}, float32 tokens\n")
    print(machine() + "\n")
    print(table(["setting", "scipy dsyrk GFLOP/s (4096 x psi)", "numpy F.T@F GFLOP/s",
                 "mhla featurize process GFLOP/s", "featurize in-process GFLOP/s", "process / dsyrk",
                 "process wall s"], rows))
    print(f"\nGFLOP/s = N psi (psi+1) / wall time = {flops / 1e9:.1f} GFLOP / t; 'process' is the whole "
          f"`mhla featurize` command (interpreter start-up, imports, reading, writing), best of {args.repeat}. "
          "Target: process / dsyrk >= 75 %.")


if __name__ == "__main__":
    main()
