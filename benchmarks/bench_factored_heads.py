"""Factored heads in a model's coordinates (`mhla export-heads --unreduce`) against their dense d x d form, in one
run: numpy predict at every position and the torch module (`Heads.to_torch()`), on the same windows.

Heads fitted in r reduced coordinates and put back in the D-dim coordinates of a model: factored, they keep the
r x r heads and the maps P (D, r), U (D_out, r) and take the tokens to x~ = P^T x first (cost of the reduced
heads plus one D x r product per token); dense (`Heads.dense()`), every head is D x D. The ratio
dense / factored is printed for the time of each pass and for the numbers the module holds, and the factored
heads' time against the reduced heads' own on the reduced tokens X P (mapped back by U). The dense pass needs
(rows, D, D) work arrays: at D = 384 and 64 heads it does not fit in a few GB, hence the default D = 128.

Run: python benchmarks/bench_factored_heads.py [--n-windows N] [--seq-len n] [--wide D] [--dim r] [--repeat R]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import best_of, machine, table  # noqa: E402

from mhla_cli.model import synthetic  # noqa: E402
from mhla_cli.model.forward import predict  # noqa: E402
from mhla_cli.model.reduce import Reduction, unreduce_heads  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-windows", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=12)
    ap.add_argument("--wide", type=int, default=128)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-dense", action="store_true", help="only the factored and reduced heads (large D)")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    D, r = a.wide, a.dim
    P = np.linalg.qr(rng.standard_normal((D, r)))[0]
    U = np.linalg.qr(rng.standard_normal((D, r)))[0]
    small = synthetic.random_teacher(r, r * r, rng)  # r^2 heads, as a full fit
    fac = unreduce_heads(small, Reduction(P, U))
    dense = fac.dense()
    X = rng.standard_normal((a.n_windows, a.seq_len, D))
    rows = []
    t_small = best_of(lambda: predict(small, X @ P, all_positions=True)[1] @ U.T, a.repeat)
    which = (("factored", fac),) if a.skip_dense else (("factored", fac), ("dense", dense))
    times = {name: best_of(lambda h=h: predict(h, X, all_positions=True), a.repeat) for name, h in which}
    times.setdefault("dense", float("nan"))
    rows.append(["numpy predict, every position (s)", f"{times['factored']:.3g}", f"{times['dense']:.3g}",
                 f"{times['dense'] / times['factored']:.1f}x"])
    rows.append(["the reduced heads on X P, then U (s)", f"{t_small:.3g}", "", f"factored / reduced "
                 f"{times['factored'] / t_small:.2f}x"])
    sizes = {name: sum(int(np.asarray(v).size) for v in (h.V, h.Q, h.P, h.U) if v is not None)
             for name, h in (("factored", fac), ("dense", dense))}
    rows.append(["numbers held", sizes["factored"], sizes["dense"], f"{sizes['dense'] / sizes['factored']:.0f}x"])
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        Xt = torch.from_numpy(X)
        mods = {"factored": fac.to_torch()} if a.skip_dense else {"factored": fac.to_torch(), "dense": dense.to_torch()}

        def run(m: object) -> None:
            with torch.no_grad():
                m(Xt, all_positions=True)
        tt = {k: best_of(lambda m=m: run(m), a.repeat) for k, m in mods.items()}
        tt.setdefault("dense", float("nan"))
        rows.append(["torch module, every position (s)", f"{tt['factored']:.3g}", f"{tt['dense']:.3g}",
                     f"{tt['dense'] / tt['factored']:.1f}x"])
    print(f"{a.n_windows} windows of {a.seq_len} tokens, D = {D}, r = {r}, {r * r} heads\n")
    print(table(["", "factored", "dense", "dense / factored"], rows))
    print("\n" + machine())


if __name__ == "__main__":
    main()
