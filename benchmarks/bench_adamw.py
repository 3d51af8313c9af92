"""Target 5: mhla (featurize + fit + export-heads) vs AdamW training of an MHLA with d^2 heads.

Two AdamW set-ups, both on Gaussian tokens, T = 100, (d, N) = (2, 512) and (4, 2048), AdamW with
d^2 heads, batch 64, lr 1e-2, weight decay 0, init RMS 0.1 (experiments/mhla_torch.py, float64):

  paper     the paper's Fig. 1 set-up as experiments/fig1_teacher.py runs it: a d^2-head random
            teacher (generic W), cosine learning-rate decay over --paper-epochs (600) epochs,
            seeds 0..--seeds-1 (data, teacher and initialisation seeded alike). A run stops when the
            training MSE reaches 1e-12 (the cosine schedule is fixed by the 600-epoch horizon, so
            the epochs before stopping are those of the full run).
  constant  a 1-head random teacher (seed 0), constant learning rate, until 1e-12 or --epochs
            (1000) epochs.

The mhla side (the baseline of the ratio) is measured in the same run on the same file: featurize +
fit + export-heads in-process, best of 3. Run: python benchmarks/bench_adamw.py [--seeds 3]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from _common import OUT, best_of, machine, table  # noqa: E402

from mhla_cli.model import synthetic  # noqa: E402
from mhla_cli import export_heads, featurize, fit, predict  # noqa: E402

SETUPS = ((2, 512), (4, 2048))


def closed_form(ds: synthetic.Dataset, d: int, name: str) -> tuple[float, float, int]:
    """(seconds, train MSE of the exported heads' predictions, heads exported) of featurize + fit + export-heads from a file."""
    path = OUT / name
    OUT.mkdir(parents=True, exist_ok=True)
    ds.save(path, dtype="float64", compression=None)
    out: dict = {}

    def run() -> None:
        out["heads"] = export_heads(fit(featurize(path)))

    secs = best_of(run, 3)
    mse = float(np.mean((predict(out["heads"], ds.tokens, ds.offsets) - ds.targets) ** 2))
    return secs, mse, int(out["heads"].n_heads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="paper set-up: seeds per (d, N) (default 3)")
    ap.add_argument("--paper-epochs", type=int, default=600, help="paper set-up: cosine horizon (default 600)")
    ap.add_argument("--epochs", type=int, default=1000, help="constant set-up: epoch budget (default 1000)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="constant set-up: seconds per run (default none: the epoch budget decides)")
    ap.add_argument("--only", choices=("paper", "constant"), default=None, help="run one set-up only")
    args = ap.parse_args()
    try:
        import torch
        from experiments.mhla_torch import train_mhla
    except ImportError as exc:
        sys.exit(f"needs torch and experiments/mhla_torch.py: pip install -e '.[bench]' in a clone ({exc})")
    torch.set_num_threads(1)
    header = ["set-up", "d", "N", "seed", "heads exported", "closed-form train MSE", "mhla s (file)",
              "AdamW epochs to 1e-8", "AdamW epochs to 1e-12", "AdamW s to 1e-12", "AdamW lowest MSE",
              "AdamW / mhla time"]
    rows: list[list[object]] = []
    summary: list[str] = []
    runs = []
    if args.only in (None, "paper"):
        runs += [("paper", d, N, s) for d, N in SETUPS for s in range(args.seeds)]
    if args.only in (None, "constant"):
        runs += [("constant", d, N, 0) for d, N in SETUPS]
    per_setup: dict[tuple[str, int], list[tuple[int | None, int | None]]] = {}
    for kind, d, N, seed in runs:
        if kind == "paper":
            ds, _ = synthetic.generate_teacher(d, d * d, N, 100, seed=seed)   # = fig1_teacher.make_data
            epochs, schedule, limit = args.paper_epochs, "cosine", None
        else:
            ds, _ = synthetic.generate_teacher(d, 1, N, 100, seed=seed)
            epochs, schedule, limit = args.epochs, "constant", args.time_limit
        t_cf, mse_cf, n_heads = closed_form(ds, d, f"adamw_{kind}_d{d}_N{N}_s{seed}.h5")
        X = ds.tokens.reshape(N, 100, d)
        res = train_mhla(X, ds.targets, n_heads=d * d, epochs=epochs, batch_size=64, lr=1e-2, seed=seed,
                         schedule=schedule, target_mse=1e-12, time_limit=limit)
        hist = res["history"]
        e8, e12 = res["epochs_to"][1e-8], res["epochs_to"][1e-12]
        per_epoch = res["seconds"] / max(1, len(hist))
        t12 = e12 * per_epoch if e12 else None
        t_adam = t12 if t12 else res["seconds"]
        budget = "" if e12 else f" (not in {len(hist)} epochs: {res['stopped']})"
        rows.append([kind, d, N, seed, n_heads, f"{mse_cf:.1e}", f"{t_cf:.4f}",
                     e8 if e8 else f"not in {len(hist)}", e12 if e12 else f"not in {len(hist)}",
                     f"{t12:.1f}" if t12 else "-", f"{min(hist):.1e}",
                     f"{t_adam / t_cf:.0f}x" + (" (lower bound)" if not e12 else "")])
        per_setup.setdefault((kind, d), []).append((e8, e12))
        print(f"{kind} d={d} seed={seed}: epochs to 1e-8 {e8}, to 1e-12 {e12}, {res['seconds']:.0f} s{budget}",
              file=sys.stderr)
    for (kind, d), es in per_setup.items():
        if kind != "paper":
            continue
        for i, t in ((0, "1e-8"), (1, "1e-12")):
            got = [e[i] for e in es if e[i] is not None]
            summary.append(f"- paper set-up, d = {d}: epochs to {t}: "
                           + (f"median {int(np.median(got))}, range {min(got)}-{max(got)}" if got else "never")
                           + f" ({len(got)}/{len(es)} runs)")
    print("## closed form vs AdamW with d^2 heads, T = 100\n")
    print(machine() + f"; torch {torch.__version__} ({torch.get_num_threads()} thread)\n")
    print(table(header, rows))
    print("\n" + "\n".join(summary))
    print(f"\npaper: d^2-head teacher, cosine decay over {args.paper_epochs} epochs; constant: 1-head teacher, "
          f"constant lr, at most {args.epochs} epochs"
          + (f" / {args.time_limit:.0f} s" if args.time_limit else "") + ". Both: AdamW with d^2 heads, "
          "batch 64, lr 1e-2, weight decay 0; runs stop at MSE 1e-12. mhla s = featurize + fit + export-heads "
          "from the float64 file, in-process, best of 3. AdamW s to 1e-12 = epochs x mean epoch time (training "
          "only; S = X^T X precomputed); the ratio divides it by mhla s.")


if __name__ == "__main__":
    main()
