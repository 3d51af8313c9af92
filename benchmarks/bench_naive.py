"""Target 4: mhla featurize + fit vs the naive route (materialise the N x psi features, numpy lstsq).

d = 16, n = 32, float32 tokens, N = 20000 (and 2N to show how memory grows). Each side runs in a
fresh process; wall time and peak RSS (getrusage) are reported, and all d x psi coefficients of the
two solutions are compared (written to .npy files after the timing stops).
Run: python benchmarks/bench_naive.py [--n-samples N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
from _common import OUT, machine, table, tokens_file  # noqa: E402

NAIVE = r"""
import json, resource, sys, time
t = time.perf_counter()
import h5py, numpy as np
from mhla_cli.feature_map import features_from_moments
with h5py.File(sys.argv[1], "r") as f:
    X = f["tokens"][()].astype(np.float64)
    Y = f["targets"][()]
S = np.matmul(X.transpose(0, 2, 1), X)
H = features_from_moments(S, X[:, -1, :])          # the N x psi design matrix
coef, *_ = np.linalg.lstsq(H, Y, rcond=None)
wall = time.perf_counter() - t
np.save(sys.argv[2], coef.T)                        # (d, psi), all coefficients, after the timing
print(json.dumps({"wall": wall, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""

MHLA = r"""
import json, resource, sys, time
t = time.perf_counter()
from mhla_cli import featurize, fit
model = fit(featurize(sys.argv[1]))
wall = time.perf_counter() - t
import numpy as np
np.save(sys.argv[2], model.coef)                    # (d, psi), all coefficients, after the timing
print(json.dumps({"wall": wall, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def run(code: str, data: str, coef_path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, data, coef_path], check=True, capture_output=True, text=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["coef"] = np.load(coef_path)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n-samples", type=int, default=20000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    rows = []
    for N in (args.n_samples, 2 * args.n_samples):
        data = str(tokens_file(N, 32, args.dim))
        naive = min((run(NAIVE, data, str(OUT / "coef_naive.npy")) for _ in range(args.repeat)),
                    key=lambda r: r["wall"])
        ours = min((run(MHLA, data, str(OUT / "coef_mhla.npy")) for _ in range(args.repeat)),
                   key=lambda r: r["wall"])
        a, b = naive["coef"], ours["coef"]
        assert a.shape == b.shape, (a.shape, b.shape)
        diff = np.abs(a - b)
        rows.append([N, naive["wall"], ours["wall"], f"{ours['wall'] / naive['wall']:.2f}",
                     f"{naive['maxrss_kib'] / 1024:.0f}", f"{ours['maxrss_kib'] / 1024:.0f}",
                     f"{ours['maxrss_kib'] / naive['maxrss_kib']:.2f}", a.size,
                     f"{diff.max() / np.abs(a).max():.1e}", f"{(diff / np.abs(a)).max():.1e}",
                     f"{np.linalg.norm(a - b) / np.linalg.norm(a):.1e}"])
    print(f"## featurize + fit vs materialised features + numpy.linalg.lstsq: d = {args.dim}, n = 32\n")
    print(machine() + "\n")
    print(table(["N", "naive wall s", "mhla wall s", "mhla / naive time", "naive peak MiB", "mhla peak MiB",
                 "mhla / naive memory", "coefficients compared", "max abs diff / max abs coef", "max relative diff per coefficient",
                 "norm of diff / norm of coef"], rows))
    print(f"\nEach side is a fresh Python process (imports included), best of {args.repeat}. Target: "
          "time ratio <= 0.3, mhla memory not growing with N.")


if __name__ == "__main__":
    main()
