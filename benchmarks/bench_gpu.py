"""Issue 17 ("A GPU path") benchmark: the device path against the device's own float64 matmul and
against the CPU path, all measured in the same run on the same machine (printed with the tables).

1. The Gram: the pass of `featurize --device DEV` (`ranges.accumulate_range`: reading, the per-sequence
   moments on the host, the transfers, the device's GEMMs and the Gram's way back) at d = 32
   (psi = 16896, the features' Gram 2.3 GB) in GFLOP/s (N psi (psi + 1) / wall, the flops of the
   syrk of the N x psi feature matrix; the device
   computes the lower triangle in mhla_cli.linalg.device.GRAM_PANELS row panels of GEMMs, (1 + 1/8) times
   those flops, so about 89 % of the matmul's rate is the ceiling), as a fraction of a bare float64
   torch matmul of the chunk's shape (rows x psi times its transpose). Goal: >= 70 % at d = 32.
   The whole `featurize` is timed too: after the pass it changes the sums exactly to the whitening of
   all the tokens and derives the own-coordinate gram on the host (O(psi^2 (q + d)) each).
2. certify + fit at d = 32 on the device against the CPU path (numpy / SciPy), same features file.
3. featurize of 1e6 sequences at d = 16 on the device (wall time, sequences / s).

Without torch or without a CUDA GPU it says so and exits 0 without a number (the library's device
path is tested on the CPU by tests/test_device.py with device="torch:cpu").

    python benchmarks/bench_gpu.py                # cuda, the defaults above
    python benchmarks/bench_gpu.py --quick        # d = 16 / N = 20000 / 1e5 sequences: a smoke run
    python benchmarks/bench_gpu.py --device torch:cpu --quick   # the same code on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, tokens_file  # noqa: E402


def _sync(torch, dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bare_matmul_gflops(torch, dev, rows: int, cols: int, repeat: int = 3) -> float:
    """float64 GFLOP/s of G += F^T F for F (rows, cols) on the device (best of `repeat`), counted as
    the GEMM's 2 rows cols^2 flops."""
    F = torch.randn(cols, rows, dtype=torch.float64, device=dev)
    G = torch.zeros(cols, cols, dtype=torch.float64, device=dev)
    G.addmm_(F, F.T)
    _sync(torch, dev)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        G.addmm_(F, F.T)
        _sync(torch, dev)
        best = min(best, time.perf_counter() - t)
    del F, G
    return 2 * rows * cols * cols / best / 1e9


def solve_times(feats, where: str) -> dict:
    """certify then fit (which reuses certify's factorization) of fresh statistics on `where`."""
    from mhla_cli.solve import certificate, lstsq

    cert, tc = timed(lambda: certificate.certify_features(feats, device=where))
    _, tf = timed(lambda: lstsq.fit(feats, device=where))
    return {"certify_s": tc, "fit_s": tf, "identifiable": cert.identifiable,
            "lambda_min": cert.lambda_min, "lambda_max": cert.lambda_max}


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda, cuda:I or torch:cpu (default cuda)")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run, minutes on a CPU)")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("bench_gpu: torch is not installed (the project's `gpu` extra): nothing measured")
        return 0
    from mhla_cli.linalg import device as device_mod
    from mhla_cli.io.tokens import inspect_tokens
    from mhla_cli.statistics import ranges, stream
    from mhla_cli.feature_map import n_features
    from mhla_cli.errors import InputError

    try:
        device_mod.check_device(args.device)
    except InputError as e:
        print(f"bench_gpu: {e}: nothing measured")
        return 0
    dev = device_mod.torch_device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (torch)"
    d_big, n_big = (16, 20000) if args.quick else (32, 20000)
    d_many, n_many = (16, 100_000) if args.quick else (16, 1_000_000)
    seq_len = 30
    res: dict = {"device": args.device, "device_name": name, "torch": torch.__version__, "machine": machine()}

    # 1. the Gram
    data = tokens_file(n_big, seq_len, d_big)
    info = inspect_tokens(data)
    psi = n_features(d_big)
    rows = ranges.default_chunk_size(info)
    peak = bare_matmul_gflops(torch, dev, rows, psi + d_big)
    A = ranges.estimate_basis(info)
    part, wall_pass = timed(lambda: ranges.accumulate_range(info, (0, n_big), basis=A, finalize=False,
                                                       device=args.device))
    del part
    gflops = n_big * psi * (psi + 1) / wall_pass / 1e9
    feats, wall = timed(lambda: stream.featurize(data, device=args.device, spans="off"))
    res["gram"] = {"d": d_big, "psi": psi, "N": n_big, "chunk_rows": rows, "pass_s": wall_pass,
                   "featurize_s": wall, "pass_gflops": gflops, "matmul_gflops": peak, "fraction": gflops / peak}

    # 2. certify + fit, device against CPU (fresh copies of the statistics: no shared factorization)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "feats.h5"
        feats.save(path)
        del feats
        times = {}
        for where in ("cpu", args.device):
            times[where] = solve_times(stream.load_features(path), where)
    res["solve"] = times
    res["solve"]["speedup"] = ((times["cpu"]["certify_s"] + times["cpu"]["fit_s"])
                               / (times[args.device]["certify_s"] + times[args.device]["fit_s"]))

    # 3. many sequences
    data = tokens_file(n_many, seq_len, d_many)
    _, wall = timed(lambda: stream.featurize(data, device=args.device))
    res["many"] = {"d": d_many, "N": n_many, "featurize_s": wall, "sequences_per_s": n_many / wall}

    g, s, m = res["gram"], res["solve"], res["many"]
    print(f"## bench_gpu ({args.device}: {name}, torch {torch.__version__})\n\n{res['machine']}\n")
    print("| d | psi | N | pass s | pass GFLOP/s | device float64 matmul GFLOP/s | fraction | goal >= 70 % "
          "| whole featurize s |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {g['d']} | {g['psi']} | {g['N']} | {g['pass_s']:.2f} | {g['pass_gflops']:.0f} | "
          f"{g['matmul_gflops']:.0f} | {g['fraction']:.0%} | {'PASS' if g['fraction'] >= 0.7 else 'FAIL'} "
          f"| {g['featurize_s']:.2f} |\n")
    print("| where | certify s | fit s | identifiable | lambda_min | lambda_max |")
    print("|---|---|---|---|---|---|")
    for where in ("cpu", args.device):
        t = s[where]
        print(f"| {where} | {t['certify_s']:.2f} | {t['fit_s']:.2f} | {t['identifiable']} | "
              f"{t['lambda_min']:.10g} | {t['lambda_max']:.10g} |")
    print(f"\ncertify + fit: the CPU path takes {s['speedup']:.2f} times as long as {args.device}\n")
    print(f"featurize of {m['N']} sequences at d = {m['d']} on {args.device}: {m['featurize_s']:.1f} s "
          f"({m['sequences_per_s']:.0f} sequences / s)")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
