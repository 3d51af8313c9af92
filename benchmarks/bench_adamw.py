"""Target 5: mhla (featurize + fit + export-heads) vs AdamW training of an MHLA with d^2 heads.

The paper's Fig. 1 set-ups: random teacher, Gaussian tokens, T = 100; (d, N) = (2, 512), (4, 2048).
AdamW (batch 64, lr 1e-2, no weight decay; experiments/mhla_torch.py) runs until the training MSE
reaches 1e-12 or the epoch / time budget ends. Run: python benchmarks/bench_adamw.py [--epochs E]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from _common import OUT, machine, table  # noqa: E402

from mhla_cli import export_heads, featurize, fit, synthetic  # noqa: E402
from mhla_cli.stream import chunk_features  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--epochs", type=int, default=3000)
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per AdamW run")
    args = ap.parse_args()
    try:
        import torch
        from experiments.mhla_torch import train_mhla
    except ImportError as exc:
        sys.exit(f"needs torch and experiments/mhla_torch.py: pip install 'mhla[bench]' ({exc})")
    torch.set_num_threads(1)
    rows = []
    for d, N in ((2, 512), (4, 2048)):
        ds, teacher = synthetic.generate_teacher(d, 1, N, 100, seed=0)
        path = OUT / f"adamw_d{d}_N{N}.h5"
        OUT.mkdir(parents=True, exist_ok=True)
        ds.save(path, dtype="float64", compression=None)
        X = ds.tokens.reshape(N, 100, d)
        # closed form, in-process: from the file, and from the in-memory arrays
        t = time.perf_counter()
        heads = export_heads(fit(featurize(path)))
        t_file = time.perf_counter() - t
        t = time.perf_counter()
        model = fit(chunk_features(ds.tokens, ds.offsets, ds.targets, d))
        export_heads(model)
        t_mem = time.perf_counter() - t
        mse_cf = model.info["train_mse"]
        t = time.perf_counter()
        res = train_mhla(X, ds.targets, n_heads=d * d, epochs=args.epochs, batch_size=64, lr=1e-2,
                         target_mse=1e-12, time_limit=args.time_limit)
        t_adam = time.perf_counter() - t
        hist = res["history"]
        e8, e12 = res["epochs_to"].get(1e-8), res["epochs_to"].get(1e-12)
        # wall time to each threshold, assuming equal-cost epochs
        per_epoch = t_adam / max(1, len(hist))
        t8 = e8 * per_epoch if e8 else None
        t12 = e12 * per_epoch if e12 else None
        best = min(hist) if hist else float("nan")
        rows.append([d, N, len(heads.V), f"{mse_cf:.1e}", f"{t_file * 1e3:.1f}", f"{t_mem * 1e3:.1f}",
                     e8 if e8 else f"not in {len(hist)}", f"{t8:.2f}" if t8 else "-",
                     e12 if e12 else f"not in {len(hist)}", f"{t12:.2f}" if t12 else "-", f"{best:.1e}",
                     f"{(t12 or t_adam) / t_file:.0f}x" + ("" if t12 else " (budget)")])
    print("## closed form vs AdamW with d^2 heads (paper Fig. 1 set-ups, T = 100)\n")
    print(machine() + f"; torch {torch.__version__} ({torch.get_num_threads()} thread)\n")
    print(table(["d", "N", "heads exported", "closed-form train MSE", "featurize+fit+export ms (file)",
                 "fit+export ms (in memory)", "AdamW epochs to 1e-8", "AdamW s to 1e-8",
                 "AdamW epochs to 1e-12", "AdamW s to 1e-12", "AdamW best MSE", "AdamW / mhla time"], rows))
    print(f"\nAdamW: batch 64, lr 1e-2, weight decay 0, {args.epochs} epochs or {args.time_limit:.0f} s at most; "
          "time to a threshold = epochs x mean epoch time (training only; S = X^T X precomputed).")


if __name__ == "__main__":
    main()
