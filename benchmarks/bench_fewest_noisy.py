"""Fewest exact heads of a noisy fit (docs/fewest_heads.md): a generic p needs ~r_gen(d) heads.

The example of docs/spectrum.md (and tests/test_spectrum.py): a 2-head random teacher, d = 6,
N = 3000 sequences of 20 tokens, label noise 0.02, seed 0; least-squares fit, then
`lowrank.fewest_heads` (what `mhla export-heads --fewest` runs). Prints the head count, the function
change on the training data (RMS output change / RMS output), r_gen(d) and the wall time.

Run: python benchmarks/bench_fewest_noisy.py
CLI: mhla generate teacher -o n.h5 --dim 6 --heads 2 --n-samples 3000 --seq-len 20 --noise 0.02 --seed 0
     mhla fit n.h5 -o m.h5 && mhla export-heads m.h5 -o h.h5 --fewest --json
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine  # noqa: E402

from mhla_cli.model import synthetic
from mhla_cli import fit  # noqa: E402
from mhla_cli.solve.lowrank import fewest_heads  # noqa: E402
from mhla_cli.solve.lowrank import generic_rank  # noqa: E402
from mhla_cli.statistics.accumulate import chunk_features  # noqa: E402


def main() -> None:
    d = 6
    ds, _ = synthetic.generate_teacher(d, 2, 3000, 20, noise=0.02, seed=0)
    model = fit(chunk_features(ds.tokens, ds.offsets, ds.targets, d))
    t = time.perf_counter()
    heads = fewest_heads(model)
    secs = time.perf_counter() - t
    print(machine() + "\n")
    print(f"noisy 2-head teacher, d = {d}: fewest_heads found {heads.n_heads} exact heads "
          f"(function change on the training data {heads.info['function_change']:.1e}; r_gen({d}) = "
          f"{generic_rank(d)}; min-norm SVD gives {d * d}) in {secs:.1f} s")


if __name__ == "__main__":
    main()
