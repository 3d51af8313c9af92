"""Fig. 1 of the paper: training MSE vs epoch for AdamW-trained models against mhla's closed-form fit.

Random MHLA teacher with d^2 heads (a generic, full-rank W), Gaussian tokens, T = 100 tokens per
sequence, (N, d) = (512, 2) and (2048, 4). Models: AdamW MHLA with m in {1, 2, 4, d^2, 2 d^2} heads,
single-head linear attention with 2 and 4 residual layers (experiments/mhla_torch.py), and mhla's
closed form (statistics + least squares + heads: Algorithm 1), drawn as a horizontal line.

    python experiments/fig1_teacher.py            # full run (2 seeds, 600 epochs), ~8 min on 2 cores
    python experiments/fig1_teacher.py --seeds 3  # what docs/reproduction.md reports
    python experiments/fig1_teacher.py --quick    # tiny version, < 1 min
    python experiments/fig1_teacher.py --seeds 3 --closed-form-only   # closed form only: p errors, fewest heads

Equivalent CLI for the closed form (d = 4):
    mhla generate teacher -o t4.h5 --dim 4 --heads 16 --n-samples 2048 --seq-len 100 --dtype float64
    mhla fit t4.h5 -o m4.h5 --json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from _common import add_doc_image_flag, doc_images, Timer, env_note, features_of, fmt, limit_threads, markdown_table, savefig, write_json
from mhla_cli.model import synthetic
from mhla_cli import export_heads, fit, predict
from mhla_cli.model.heads import Heads

SETUPS = ((2, 512), (4, 2048))
PAPER = {  # what the paper's Fig. 1 shows (read off the plots; see docs/reproduction.md)
    "closed form": "~1e-16 (float precision)",
    "m=d^2": "~1e-16 after ~300-350 epochs",
    "m<d^2": "plateaus well above",
    "layers": "more layers do not help",
}


def make_data(d: int, N: int, seed: int, seq_len: int = 100) -> tuple[synthetic.Dataset, Heads]:
    """Teacher data of Fig. 1: a d^2-head random teacher (generic W), Gaussian tokens, float64 in memory."""
    return synthetic.generate_teacher(d, d * d, N, seq_len, seed=seed)


def closed_form(ds: synthetic.Dataset, teacher: Heads | None = None,
                fewest: bool = False) -> dict[str, Any]:
    """Algorithm 1 in-process: statistics, least squares, heads; MSE of the exported heads on the data.

    With the teacher: `p_error` = ||coef - p_teacher||_F / ||p_teacher||_F. With `fewest`: the head
    count of `lowrank.fewest_heads` on the fitted model and its function change on the training data
    (RMS output change / RMS output; not timed).
    """
    with Timer() as t:
        feats = features_of(ds)
        model = fit(feats)
        heads = export_heads(model)
    pred = predict(heads, ds.tokens, ds.offsets)
    mse = float(np.mean((pred - ds.targets) ** 2))
    out = {"mse": mse, "rel_mse": mse / float(np.mean(ds.targets**2)), "seconds": t.seconds,
           "stats_mse": model.info["train_mse"], "stats_resolution": model.info["mse_resolution"],
           "n_heads": heads.n_heads}
    if teacher is not None:
        out["p_error"] = float(np.linalg.norm(model.coef - teacher.coef) / np.linalg.norm(teacher.coef))
    if fewest:
        from mhla_cli.solve.lowrank import fewest_heads

        fh_heads = fewest_heads(model)
        out["fewest_n_heads"] = int(fh_heads.n_heads)
        out["fewest_error"] = float(fh_heads.info["function_change"])
    return out


def models_for(d: int) -> list[dict[str, Any]]:
    """The gradient-trained models of Fig. 1 for token dimension d."""
    ms = sorted({1, 2, 4, d * d, 2 * d * d})
    out = [{"name": f"MHLA m={m}" + (" (=d^2)" if m == d * d else ""), "kind": "mhla", "m": m,
            "schedule": "cosine"} for m in ms]
    out.append({"name": f"MHLA m={d * d}, constant lr", "kind": "mhla", "m": d * d, "schedule": "constant"})
    out += [{"name": f"1-head linear attn, {L} layers", "kind": "layers", "L": L, "schedule": "cosine"}
            for L in (2, 4)]
    return out


def run_setup(d: int, N: int, epochs: int, seeds: int, lr: float = 1e-2, batch_size: int = 64,
              seq_len: int = 100, only: set[str] | None = None) -> dict[str, Any]:
    """All models of one Fig. 1 panel; per model the per-seed histories and summary numbers.

    `only=set()` runs the closed form alone (no torch needed)."""
    if only != set():
        from mhla_torch import train_linear_attention, train_mhla

    results: dict[str, Any] = {"d": d, "N": N, "epochs": epochs, "seeds": seeds, "closed_form": [], "models": {}}
    for seed in range(seeds):
        ds, teacher = make_data(d, N, seed, seq_len)
        results["closed_form"].append(closed_form(ds, teacher, fewest=d == 2))
        X = ds.tokens.reshape(N, seq_len, d)
        for spec in models_for(d):
            if only is not None and spec["kind"] not in only:
                continue
            if spec["kind"] == "mhla":
                r = train_mhla(X, ds.targets, spec["m"], epochs, batch_size=batch_size, lr=lr, seed=seed,
                               schedule=spec["schedule"])
            else:
                r = train_linear_attention(X, ds.targets, spec["L"], epochs, batch_size=batch_size, lr=lr,
                                           seed=seed, schedule=spec["schedule"])
            entry = results["models"].setdefault(spec["name"], {"spec": spec, "runs": []})
            entry["runs"].append({"history": r["history"], "epochs_to": r["epochs_to"], "seconds": r["seconds"]})
    return results


def summarize(res: dict[str, Any]) -> list[list[str]]:
    """Table rows: model, final MSE (median, min..max), epochs to 1e-8 / 1e-12, seconds per run."""
    d = res["d"]
    rows = []
    cf = res["closed_form"]
    rows.append([f"d={d}, N={res['N']}", "mhla closed form (Algorithm 1)",
                 fmt(float(np.median([c["mse"] for c in cf]))), "1 solve", "1 solve",
                 fmt(float(np.median([c["seconds"] for c in cf])), 2), PAPER["closed form"]])
    for name, entry in res["models"].items():
        runs = entry["runs"]
        finals = [r["history"][-1] for r in runs]
        best = [min(r["history"]) for r in runs]

        def reach(t: float) -> str:
            es = [r["epochs_to"][t] for r in runs if r["epochs_to"][t] is not None]
            if not es:
                return f"never (0/{len(runs)})"
            return f"{int(np.median(es))} [{min(es)}-{max(es)}] ({len(es)}/{len(runs)})"

        spec = entry["spec"]
        if spec["kind"] == "layers":
            paper = PAPER["layers"]
        elif spec["m"] == d * d and spec["schedule"] == "cosine":
            paper = PAPER["m=d^2"]
        elif spec["m"] < d * d:
            paper = PAPER["m<d^2"]
        else:
            paper = ""
        rows.append(["", name, f"{fmt(float(np.median(finals)))} [{fmt(min(finals))}..{fmt(max(finals))}] "
                     f"(best {fmt(float(np.min(best)))})",
                     reach(1e-8), reach(1e-12), fmt(float(np.median([r['seconds'] for r in runs])), 2), paper])
    return rows


HEADER = ["setup", "model", "final train MSE, median [range] (lowest seen)",
          "epoch reaching 1e-8, median [range] (runs)", "epoch reaching 1e-12, median [range] (runs)",
          "seconds/run", "paper"]


def closed_form_lines(all_res: list[dict[str, Any]]) -> list[str]:
    """One line per setup: the closed form's relative p error against the teacher, and fewest heads."""
    lines = []
    for res in all_res:
        cf = res["closed_form"]
        errs = [c["p_error"] for c in cf if "p_error" in c]
        line = f"- d={res['d']}, N={res['N']}: closed form relative p error vs the teacher"
        line += f" {', '.join(fmt(e) for e in errs)} (per seed)" if errs else " (not recorded)"
        fw = [(c["fewest_n_heads"], c["fewest_error"]) for c in cf if "fewest_n_heads" in c]
        if fw:
            line += ("; lowrank.fewest_heads on the fit (export-heads --fewest): "
                     + ", ".join(f"{h} heads (function change {fmt(e)})" for h, e in fw))
        lines.append(line)
    return lines


def plot(all_res: list[dict[str, Any]], name: str = "fig1_teacher.png") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_res), figsize=(6.5 * len(all_res), 4.6), squeeze=False)
    for ax, res in zip(axes[0], all_res):
        for i, (name_, entry) in enumerate(res["models"].items()):
            H = np.array([r["history"] for r in entry["runs"]], dtype=float)
            H = np.maximum(H, 1e-34)
            med = np.median(H, axis=0)
            ep = np.arange(1, H.shape[1] + 1)
            ls = "--" if entry["spec"]["kind"] == "layers" else (":" if entry["spec"]["schedule"] == "constant" else "-")
            line, = ax.semilogy(ep, med, ls, lw=1.4, label=name_, color=f"C{i}")
            if H.shape[0] > 1:
                ax.fill_between(ep, H.min(axis=0), H.max(axis=0), color=line.get_color(), alpha=0.12)
        cf = float(np.median([max(c["mse"], 1e-34) for c in res["closed_form"]]))
        ax.axhline(cf, color="k", lw=2, label=f"mhla closed form ({fmt(cf)})")
        ax.set_title(f"d = {res['d']}, N = {res['N']}, T = 100 ({res['seeds']} seeds: median, min-max band)")
        ax.set_xlabel("epoch")
        ax.set_ylabel("training MSE")
        ax.set_ylim(1e-34, 10)
        ax.legend(fontsize=7, loc="lower left")
    path = savefig(fig, name)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny version (< 1 min)")
    ap.add_argument("--epochs", type=int, default=None, help="epochs per model (default 600; quick 40)")
    ap.add_argument("--seeds", type=int, default=None, help="independent runs per setup (default 2; quick 1)")
    ap.add_argument("--closed-form-only", action="store_true",
                    help="only mhla's closed form (MSE, p error vs the teacher, fewest heads); no torch")
    ap.add_argument("--json", default=None, help="also write the raw results to this JSON file")
    ap.add_argument("--from-json", default=None, help="only print the table and plot from a saved JSON file")
    add_doc_image_flag(ap)
    args = ap.parse_args(argv)
    doc_images(args.doc_image)
    limit_threads(1)
    if args.from_json:
        with open(args.from_json) as fh:
            all_res = json.load(fh)
        for res in all_res:  # JSON turned the float threshold keys into strings
            for entry in res["models"].values():
                for r in entry["runs"]:
                    r["epochs_to"] = {float(k): v for k, v in r["epochs_to"].items()}
        print(markdown_table(HEADER, [row for res in all_res for row in summarize(res)]))
        print("\n" + "\n".join(closed_form_lines(all_res)))
        print(f"\nplot: {plot(all_res)}")
        return 0
    epochs = args.epochs or (40 if args.quick else 600)
    seeds = args.seeds or (1 if args.quick else 2)
    setups = ((2, 128), (4, 256)) if args.quick else SETUPS
    all_res = []
    with Timer() as total:
        for d, N in setups:
            all_res.append(run_setup(d, N, epochs, seeds, only=set() if args.closed_form_only else None))
    rows = [row for res in all_res for row in summarize(res)]
    print(f"## Fig. 1: training MSE, AdamW vs mhla closed form ({epochs} epochs, batch 64, lr 1e-2, "
          f"{seeds} seed(s){', QUICK' if args.quick else ''})\n")
    print(markdown_table(HEADER, rows))
    print("\n" + "\n".join(closed_form_lines(all_res)))
    if not args.closed_form_only:
        print(f"\nplot: {plot(all_res, 'fig1_teacher_quick.png' if args.quick else 'fig1_teacher.png')}")
    print(f"total {total.seconds:.0f} s; {env_note()}")
    if args.json:
        write_json(args.json, all_res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
