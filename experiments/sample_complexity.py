"""Sample complexity: when does certify pass, and how does held-out error fall with N?

For d in {2, ..., 6}: random 2-head MHLA teachers, Gaussian tokens, T = 100 tokens per sequence.
(1) The smallest N at which `certify` (full domain, default threshold) passes, against
    psi = d^2 (d+1)/2, the number of features (N >= psi is necessary). Side check: with sequences
    of length 1 the features are the cubic monomials x_j x_k x_l, so rank <= d(d+1)(d+2)/6 < psi and
    no N ever certifies.
(2) Held-out relative MSE of mhla's minimum-norm least-squares fit vs N, noise-free and with label
    noise 0.1 (targets have RMS 1), on 1000 fresh sequences of the same teacher.

    python experiments/sample_complexity.py            # full run, ~20 s on 2 cores
    python experiments/sample_complexity.py --quick    # tiny version, seconds

Equivalent CLI for one point (d = 4, N = 40 = psi):
    mhla generate teacher -o s4.h5 --dim 4 --heads 2 --n-samples 40 --seq-len 100 --dtype float64
    mhla certify s4.h5 --json
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from _common import add_doc_image_flag, doc_images, Timer, env_note, features_of, fmt, limit_threads, markdown_table, savefig, subset, write_json
from mhla_cli.model import synthetic
from mhla_cli import certify, fit, n_features, predict

DIMS = (2, 3, 4, 5, 6)
RATIOS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.5, 2.0, 4.0, 8.0)
TEACHER_HEADS = 2
N_TEST = 1000


def smallest_certified_n(ds: synthetic.Dataset, start: int, stop: int) -> tuple[int | None, list[tuple[int, float, bool]]]:
    """Smallest prefix length N in [start, stop] whose statistics certify (full domain), and the scan."""
    scan = []
    for N in range(max(1, start), stop + 1):
        cert = certify(features_of(ds, 0, N))
        scan.append((N, cert.lambda_min / cert.lambda_max if cert.lambda_max > 0 else 0.0, cert.identifiable))
        if cert.identifiable:
            return N, scan
    return None, scan


def length_one_rank(d: int, seed: int) -> tuple[int, int]:
    """Rank of the certificate's Lambda_D for 4 psi sequences of length 1, and d(d+1)(d+2)/6."""
    ds, _ = synthetic.generate_teacher(d, 1, 4 * n_features(d), 1, seed=seed)
    cert = certify(features_of(ds))
    return cert.rank, d * (d + 1) * (d + 2) // 6


def run_dim(d: int, seeds: int, ratios: tuple[float, ...], noise: float = 0.1) -> dict[str, Any]:
    """Certificate threshold and held-out error vs N for token dimension d."""
    psi = n_features(d)
    n_train = int(max(ratios) * psi) + 1
    out: dict[str, Any] = {"d": d, "psi": psi, "smallest_n": [], "rel_lambda_at_psi": [], "curve": {}}
    for seed in range(seeds):
        ds, _ = synthetic.generate_teacher(d, TEACHER_HEADS, n_train + N_TEST, 100, seed=seed)
        train, test = subset(ds, 0, n_train), subset(ds, n_train, n_train + N_TEST)
        n_min, scan = smallest_certified_n(train, psi - 2, n_train)
        out["smallest_n"].append(n_min)
        out["rel_lambda_at_psi"].append(next((r for N, r, _ in scan if N == psi), None))
        rng = np.random.default_rng(1000 + seed)
        noisy = synthetic.Dataset(train.tokens, train.offsets, train.targets + noise * rng.standard_normal(train.targets.shape))
        y2 = float(np.mean(test.targets**2))
        for ratio in ratios:
            N = max(1, int(round(ratio * psi)))
            row = out["curve"].setdefault(ratio, {"N": N, "clean": [], "noisy": []})
            for key, data in (("clean", train), ("noisy", noisy)):
                model = fit(features_of(data, 0, N))
                pred = predict(model, test.tokens, test.offsets)
                row[key].append(float(np.mean((pred - test.targets) ** 2)) / y2)
    out["length_one_rank"], out["length_one_bound"] = length_one_rank(d, 0)
    out["noise"] = noise
    return out


def table_certify(results: list[dict[str, Any]]) -> str:
    header = ["d", "psi = d^2(d+1)/2", "smallest certified N (per seed)", "lambda_min/lambda_max at N = psi (median)",
              "rank with length-1 sequences (bound d(d+1)(d+2)/6)"]
    rows = [[r["d"], r["psi"], ", ".join(fmt(n) for n in r["smallest_n"]),
             fmt(float(np.median([x for x in r["rel_lambda_at_psi"] if x is not None]))),
             f"{r['length_one_rank']} / {r['psi']} ({r['length_one_bound']}): never certifies"] for r in results]
    return markdown_table(header, rows)


def table_error(results: list[dict[str, Any]]) -> str:
    ratios = list(results[0]["curve"].keys())
    header = ["d", "labels"] + [f"N = {r:g} psi" for r in ratios]
    rows = []
    for r in results:
        for key, label in (("clean", "noise-free"), ("noisy", f"noise {r['noise']:g}")):
            rows.append([r["d"], label] + [fmt(float(np.median(r["curve"][q][key]))) for q in ratios])
    return markdown_table(header, rows)


def plot(results: list[dict[str, Any]], name: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    psis = np.array([r["psi"] for r in results])
    for r in results:
        ns = [n for n in r["smallest_n"] if n is not None]
        ax1.plot([r["psi"]] * len(ns), ns, "o", color="C0", alpha=0.6)
    ax1.plot(psis, psis, "k--", label="N = psi")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("psi = d^2 (d+1) / 2")
    ax1.set_ylabel("smallest N where certify passes")
    ax1.set_title("certificate threshold (T = 100, Gaussian tokens)")
    ax1.legend()
    for i, r in enumerate(results):
        ratios = np.array(list(r["curve"].keys()))
        for key, ls in (("clean", "-"), ("noisy", "--")):
            med = [max(float(np.median(r["curve"][q][key])), 1e-32) for q in ratios]
            ax2.loglog(ratios, med, ls + "o", color=f"C{i}", ms=3,
                       label=f"d={r['d']} " + ("noise-free" if key == "clean" else f"noise {r['noise']:g}"))
    ax2.axvline(1.0, color="k", lw=0.8)
    ticks = list(results[0]["curve"].keys())
    ax2.minorticks_off()
    ax2.set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=7)
    ax2.set_xlabel("N / psi")
    ax2.set_ylabel("held-out relative MSE (min-norm fit)")
    ax2.set_title("held-out error vs N")
    ax2.legend(fontsize=6, ncol=2)
    path = savefig(fig, name)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny version (seconds)")
    ap.add_argument("--seeds", type=int, default=None, help="teachers per d (default 5; quick 2)")
    ap.add_argument("--json", default=None, help="also write the raw results to this JSON file")
    add_doc_image_flag(ap)
    args = ap.parse_args(argv)
    doc_images(args.doc_image)
    limit_threads(1)
    dims = (2, 3) if args.quick else DIMS
    seeds = args.seeds or (2 if args.quick else 5)
    ratios = (0.5, 1.0, 2.0) if args.quick else RATIOS
    with Timer() as total:
        results = [run_dim(d, seeds, ratios) for d in dims]
    print(f"## Sample complexity: smallest certified N ({seeds} teachers per d, {TEACHER_HEADS}-head teachers, "
          f"T = 100){', QUICK' if args.quick else ''}\n")
    print(table_certify(results))
    print(f"\n## Held-out relative MSE of the min-norm fit vs N (median over {seeds} teachers, {N_TEST} test sequences)\n")
    print(table_error(results))
    print(f"\nplot: {plot(results, 'sample_complexity_quick.png' if args.quick else 'sample_complexity.png')}")
    print(f"total {total.seconds:.0f} s; {env_note()}")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
