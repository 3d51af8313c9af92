"""Target 1: `mhla featurize` (whole process) GFLOP/s vs a bare float64 dsyrk on (4096 x psi).

d = 16, N = 50000, n = 32, float32 tokens; flops counted as N * psi * (psi + 1) (the syrk of the
N x psi feature matrix). Run: python benchmarks/bench_gflops.py [--n-samples N] [--repeat R]

`--ratio D:N ...` (issue 24) instead prints same-run time ratios, in this process with all BLAS
threads: featurize (the Gram's distinct entries K = U^T V, mhla_cli.linalg.symgram) and featurize with the
syrk of the materialised block forced (symgram.SYMGRAM_MIN_D raised), each over the time of a bare
dsyrk of the materialised N x psi features (blocks of at most 4096 rows, timed and scaled to N).
Example: python benchmarks/bench_gflops.py --ratio 16:12000 24:2000 --repeat 2
`--kernel D ...`: one chunk's update alone, K against the dsyrk, one thread (the rule
symgram.SYMGRAM_MIN_D) or `--threads T`. Example: python benchmarks/bench_gflops.py --kernel 4 6 8 12 16;
python benchmarks/bench_gflops.py --kernel 16 24 --rows 4096 --threads 2
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
from _common import OUT, best_of, machine, mhla_cmd, run_timed, table, tokens_file  # noqa: E402

from mhla_cli.feature_map import n_features  # noqa: E402
from mhla_cli.statistics.stream import featurize  # noqa: E402


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


def bare_dsyrk_seconds(psi: int, N: int, repeat: int = 3, rows: int = 4096) -> float:
    """Seconds of a bare float64 dsyrk of N x psi materialised features: the best time of one (r x psi)
    block, r = min(N, rows), scaled by N / r (a syrk is linear in its rows)."""
    r = min(N, rows)
    rng = np.random.default_rng(0)
    F = np.asfortranarray(rng.standard_normal((r, psi)))
    C = np.zeros((psi, psi), order="F")
    sblas.dsyrk(1.0, F, beta=0.0, c=C, trans=1, lower=0, overwrite_c=1)  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        sblas.dsyrk(1.0, F, beta=1.0, c=C, trans=1, lower=0, overwrite_c=1)
        best = min(best, time.perf_counter() - t)
    return best * N / r


def ratio_rows(points: list[tuple[int, int]], seq_len: int, repeat: int) -> list[list[object]]:
    """Rows of the same-run ratio table (`--ratio`): featurize with K and with the syrk, over a bare dsyrk."""
    from mhla_cli.linalg import symgram

    rows = []
    for d, N in points:
        psi = n_features(d)
        data = tokens_file(N, seq_len, d)
        featurize(data)  # warm the page cache
        t_syrk_bare = bare_dsyrk_seconds(psi, N, repeat)
        rule = symgram.SYMGRAM_MIN_D
        try:
            t_k = best_of(lambda: featurize(data), repeat)
            symgram.SYMGRAM_MIN_D = 10**9  # the baseline: one syrk of the materialised block
            t_s = best_of(lambda: featurize(data), repeat)
        finally:
            symgram.SYMGRAM_MIN_D = rule
        rows.append([d, psi, N, f"{t_syrk_bare:.2f}", f"{t_k:.2f}", f"{t_s:.2f}", f"{t_k / t_syrk_bare:.2f}",
                     f"{t_s / t_syrk_bare:.2f}"])
    return rows


def kernel_rows(dims: list[int], rows: int, repeat: int, threads: int = 1) -> list[list[object]]:
    """Rows of `--kernel`: one chunk's update: the dsyrk of the materialised [H | Y] block on `threads`
    BLAS threads against symgram.SymGram.add (K = U^T V, the moments and the target Gram; its panels over
    `threads` Python threads of one BLAS thread each, as in a featurize pass), best of `repeat`."""
    from mhla_cli.linalg import symgram

    out = []
    rng = np.random.default_rng(0)
    for d in dims:
        q = d * (d + 1) // 2
        s, x, y = (rng.standard_normal((m, rows)) for m in (q, d, d))
        F = np.asfortranarray(np.vstack([(s[:, None, :] * x[None, :, :]).reshape(q * d, rows), y]).T)
        C = np.zeros((F.shape[1], F.shape[1]), order="F")
        sg = symgram.SymGram(q, d, d)
        with threadpool_limits(limits=threads):
            t_s = best_of(lambda: sblas.dsyrk(1.0, F, beta=1.0, c=C, trans=1, lower=0, overwrite_c=1), repeat)
        with threadpool_limits(limits=1):
            t_k = best_of(lambda: sg.add(s, x, y, threads=threads), repeat)
        out.append([d, q * d, rows, f"{t_s * 1e3:.2f}", f"{t_k * 1e3:.2f}", f"{t_k / t_s:.2f}"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kernel", nargs="+", type=int, metavar="D", default=None,
                    help="one chunk's update at these d (one thread unless --threads): K = U^T V against the dsyrk "
                         "(the measurement behind symgram.SYMGRAM_MIN_D)")
    ap.add_argument("--rows", type=int, default=2048, help="rows of the chunk of --kernel")
    ap.add_argument("--threads", type=int, default=1, help="threads of --kernel (BLAS threads of the dsyrk, "
                                                            "Python threads of K's panels)")
    ap.add_argument("--ratio", nargs="+", metavar="D:N", default=None,
                    help="same-run time ratios featurize / bare dsyrk at these (d, N) instead (issue 24)")
    ap.add_argument("--n-samples", type=int, default=50000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.kernel:
        print(f"## one chunk's update ({args.rows} rows, {args.threads} thread(s), best of {args.repeat}): K = U^T V "
              "(mhla_cli.linalg.symgram) against the dsyrk of the materialised block\n")
        print(machine() + "\n")
        print(table(["d", "psi", "rows", "dsyrk ms", "K ms", "K / dsyrk"],
                    kernel_rows(args.kernel, args.rows, max(args.repeat, 5), args.threads)))
        return
    if args.ratio:
        points = [tuple(int(v) for v in p.split(":")) for p in args.ratio]
        rows = ratio_rows(points, args.seq_len, args.repeat)  # type: ignore[arg-type]
        print(f"## featurize / bare dsyrk, same run (n = {args.seq_len}, float32 tokens, all BLAS threads, "
              f"in-process, best of {args.repeat})\n")
        print(machine() + "\n")
        print(table(["d", "psi", "N", "bare dsyrk s (N x psi)", "featurize s (K)", "featurize s (syrk forced)",
                     "featurize (K) / dsyrk", "featurize (syrk) / dsyrk"], rows))
        return
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
