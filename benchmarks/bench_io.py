"""Target 2: small d is I/O-bound. featurize (d = 4, n = 100, float32) vs h5py reading `tokens`.

Baselines measured in the same run on the same (page-cached) file: h5py reading the whole
`tokens` dataset into memory, and h5py reading it chunk by chunk into one reused buffer (the
fastest way h5py can read it). Run: python benchmarks/bench_io.py [--n-samples N]
"""

from __future__ import annotations

import argparse
import os
import sys

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import OUT, best_of, drop_cache_note, machine, mhla_cmd, run_timed, table, tokens_file  # noqa: E402

from mhla_cli.statistics.ranges import default_chunk_size  # noqa: E402
from mhla_cli.statistics.stream import featurize  # noqa: E402
from mhla_cli.io.tokens import inspect_tokens


def read_whole(path: str) -> None:
    with h5py.File(path, "r") as f:
        f["tokens"][()]


def read_chunked(path: str, rows: int) -> None:
    with h5py.File(path, "r") as f:
        ds = f["tokens"]
        buf = np.empty((rows, *ds.shape[1:]), dtype=ds.dtype)
        n = ds.shape[0]
        for a in range(0, n, rows):
            b = min(n, a + rows)
            ds.read_direct(buf, np.s_[a:b], np.s_[0:b - a])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n-samples", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    N, n, d = args.n_samples, 100, 4
    data = str(tokens_file(N, n, d))
    info = inspect_tokens(data)
    rows = default_chunk_size(info)
    out = str(OUT / "io_feats.h5")
    read_chunked(data, rows)  # warm the page cache
    t_whole = best_of(lambda: read_whole(data), args.repeat)
    t_chunk = best_of(lambda: read_chunked(data, rows), args.repeat)
    t_lib = best_of(lambda: featurize(data), args.repeat)
    t_cli = run_timed(mhla_cmd("featurize", data, "-o", out, "-q"), args.repeat)
    t_w = run_timed(mhla_cmd("featurize", data, "-o", out, "-q", "--workers", "2"), args.repeat)
    gb = N * n * d * 4 / 1e9
    rows_t = [["h5py: whole dataset `f['tokens'][()]`", t_whole, gb / t_whole, 1.0, t_whole / t_chunk],
              [f"h5py: chunks of {rows} samples into one buffer", t_chunk, gb / t_chunk, t_chunk / t_whole, 1.0],
              ["featurize (library, in-process)", t_lib, gb / t_lib, t_lib / t_whole, t_lib / t_chunk],
              ["`mhla featurize` (whole process)", t_cli, gb / t_cli, t_cli / t_whole, t_cli / t_chunk],
              ["`mhla featurize --workers 2`", t_w, gb / t_w, t_w / t_whole, t_w / t_chunk]]
    print(f"## featurize vs reading: d = {d}, n = {n}, N = {N}, float32 tokens ({gb:.2f} GB)\n")
    print(machine() + "\n")
    print(table(["what", "wall s", "GB/s of tokens", "/ whole read", "/ chunked read"], rows_t))
    print(f"\nBest of {args.repeat}. {drop_cache_note()} Target: featurize <= 2x the h5py read.")


if __name__ == "__main__":
    main()
