"""Target 3: peak RSS of `mhla featurize` is flat in N (d = 8, n = 32, float32).

Each run is a fresh process; its peak RSS is read with getrusage in a wrapper process.
Run: python benchmarks/bench_memory.py [--small N] [--large N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import OUT, machine, mhla_cmd, table, tokens_file  # noqa: E402

from mhla_cli.feature_map import n_features  # noqa: E402
from mhla_cli.statistics.ranges import default_chunk_size  # noqa: E402
from mhla_cli.io.tokens import inspect_tokens

WRAP = ("import json, resource, subprocess, sys, time; t = time.perf_counter(); "
        "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
        "print(json.dumps({'wall': time.perf_counter() - t, "
        "'maxrss_kib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))")


def peak_rss(cmd: list[str]) -> dict:
    """Peak RSS (KiB) and wall time of `cmd` run in a fresh process."""
    out = subprocess.run([sys.executable, "-c", WRAP, *cmd], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small", type=int, default=20_000)
    ap.add_argument("--large", type=int, default=2_000_000)
    args = ap.parse_args()
    d, n = 8, 32
    psi = n_features(d)
    rows = []
    base = None
    for N in (args.small, args.large):
        data = tokens_file(N, n, d)
        info = inspect_tokens(data)
        chunk = default_chunk_size(info)
        out = OUT / f"mem_feats_{N}.h5"
        r = peak_rss(mhla_cmd("featurize", str(data), "-o", str(out), "-q"))
        r2 = peak_rss(mhla_cmd("featurize", str(data), "-o", str(out), "-q", "--workers", "2"))
        mib = r["maxrss_kib"] / 1024
        base = base or mib
        chunk_mib = chunk * (n * d * 4 + d * 8) / 2**20
        bound = (psi**2 * 8 * 3) / 2**20 + chunk_mib + 300
        rows.append([N, f"{N * n * d * 4 / 2**20:.0f}", f"{mib:.0f}", f"{mib / base:.2f}", f"{bound:.0f}",
                     f"{r['wall']:.1f}", f"{r2['maxrss_kib'] / 1024:.0f}"])
    print(f"## peak RSS vs N: d = {d} (psi = {psi}), n = {n}, float32 tokens\n")
    print(machine() + "\n")
    print(table(["N", "tokens MiB", "peak RSS MiB", "RSS / smallest", "bound psi^2*8*3 + chunk + 300 MiB",
                 "wall s", "peak RSS MiB, --workers 2 (largest process)"], rows))
    print("\nPeak RSS of the `mhla featurize` process (ru_maxrss). With --workers the worker processes "
          "are children of the measured process; getrusage reports the largest single process. "
          "Target: RSS(N=2e6) <= 1.3 RSS(N=2e4) and below the bound.")


if __name__ == "__main__":
    main()
