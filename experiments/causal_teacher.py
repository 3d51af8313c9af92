"""Causal teacher: a random MHLA recovered exactly from fewer sequences than features (issue 11).

A random 2-head MHLA teacher labels every prefix of Gaussian sequences of ragged length 5..40
(`mhla generate teacher --per-position`, here its library function `generate_teacher(...,
per_position=True)`). Each sequence of n tokens is n samples, so N < psi = d^2(d+1)/2 sequences
can hold T >= psi samples. For each d we take the smallest N (scanning N = 1, 2, ...) whose
per-position statistics `certify` (full domain, default threshold), fit, and report the relative
p-distance to the teacher and the causal MSE on fresh sequences 5x longer. Control: the same N
sequences with only their last-token targets (N samples < psi) can never certify. Both
normalisations (`none`, and `length`: S_t / t) are run.

    python experiments/causal_teacher.py            # d = 2..7
    python experiments/causal_teacher.py --quick    # d = 2..4

Equivalent CLI for one point (d = 3, N = 10 sequences, as the issue's acceptance test):
    mhla generate teacher -o ar.h5 --dim 3 --heads 2 --n-samples 10 --seq-len 5:40 --per-position \
        --dtype float64 --teacher-out teacher.h5
    mhla certify ar.h5 --json
    mhla fit ar.h5 -o model.h5
    mhla compare model.h5 teacher.h5 --json
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
from _common import (
    env_note,
    features_of,
    fmt,
    limit_threads,
    markdown_table,
    out_dir,
    savefig,
    write_json,
)

from mhla_cli import certify, fit, n_features, p_from_heads
from mhla_cli.model.forward import predict_causal
from mhla_cli.statistics.accumulate import chunk_features
from mhla_cli.model.synthetic import Dataset, generate_teacher
from mhla_cli.samples import CAUSAL, ReadSpec, samples_of

SEQ_LEN = (5, 40)
HEADS = 2
N_FIXED = 10  # the acceptance case: 10 ragged sequences


def causal_features(ds: Dataset, n: int, normalize: str):
    """Per-position statistics of the first n sequences (what `mhla featurize` computes)."""
    b = int(ds.offsets[n])
    return chunk_features(ds.tokens[:b], ds.offsets[:n + 1], ds.targets[:b], ds.tokens.shape[1],
                          read=ReadSpec(CAUSAL, normalize))


def last_token_features(ds: Dataset, n: int):
    """Control: the same sequences with only their final target (N samples)."""
    b = int(ds.offsets[n])
    last = ds.targets[ds.offsets[1:n + 1] - 1]
    return features_of(Dataset(ds.tokens[:b], ds.offsets[:n + 1], last))


def run_dim(d: int, seed: int, normalize: str, n_max: int = 64) -> dict[str, Any]:
    psi = n_features(d)
    ds, teacher = generate_teacher(d, HEADS, n_max, SEQ_LEN, seed=seed,
                                   read=ReadSpec(samples_of(True), normalize=normalize))
    p_true = p_from_heads(teacher.V, teacher.Q)
    n_min, feats, cert = None, None, None
    for n in range(1, n_max + 1):
        if int(ds.offsets[n]) < psi:  # fewer samples than features: cannot certify
            continue
        feats = causal_features(ds, n, normalize)
        cert = certify(feats)
        if cert.identifiable:
            n_min = n
            break
    n_first = int(np.argmax(ds.offsets >= psi))  # first N with T >= psi samples (necessary)
    out: dict[str, Any] = {"d": d, "psi": psi, "normalize": normalize, "seed": seed, "n_min": n_min,
                           "n_first_T_ge_psi": n_first}
    if n_min is None:
        return out
    model = fit(feats)
    # fresh, 5x longer sequences from the same teacher
    rng = np.random.default_rng(seed + 777)
    n_test, L = 20, 5 * SEQ_LEN[1]
    Xt = rng.standard_normal((n_test, L, d))
    yt = predict_causal(teacher, Xt)
    ym = predict_causal(model, Xt)
    ctrl = certify(last_token_features(ds, n_min))
    f10 = causal_features(ds, N_FIXED, normalize)
    c10, m10 = certify(f10), fit(f10)
    out.update({
        "T": int(ds.offsets[n_min]), "n_samples": feats.n_samples,
        "lambda_ratio": cert.lambda_min / cert.lambda_max,
        "p_error": float(np.linalg.norm(model.coef - p_true) / np.linalg.norm(p_true)),
        "test_rel_mse": float(np.mean((ym - yt) ** 2) / np.mean(yt**2)), "test_len": L,
        "control_identifiable": ctrl.identifiable, "control_rank": ctrl.rank,
        "fixed": {"N": N_FIXED, "T": int(ds.offsets[N_FIXED]), "identifiable": c10.identifiable,
                  "lambda_ratio": c10.lambda_min / c10.lambda_max,
                  "p_error": float(np.linalg.norm(m10.coef - p_true) / np.linalg.norm(p_true))},
    })
    return out


def plot(results: list[dict[str, Any]], name: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for norm, mk in (("none", "o"), ("length", "s")):
        rs = [r for r in results if r["normalize"] == norm and r["n_min"] is not None]
        ax.plot([r["psi"] for r in rs], [r["n_min"] for r in rs], mk + "-", label=f"sequences N (normalize {norm})")
        ax.plot([r["psi"] for r in rs], [r["T"] for r in rs], mk + "--", label=f"positions T (normalize {norm})")
    ps = sorted({r["psi"] for r in results})
    ax.plot(ps, ps, "k:", label="psi = d^2(d+1)/2 (last-token data need N >= psi)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("psi")
    ax.set_ylabel("smallest certified size")
    ax.set_title("Causal teacher: certified from N < psi sequences")
    ax.legend(fontsize=7)
    path = savefig(fig, name)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="d = 2..4")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    limit_threads(1)
    dims = (2, 3, 4) if args.quick else (2, 3, 4, 5, 6, 7)
    results = [run_dim(d, args.seed, norm) for norm in ("none", "length") for d in dims]
    name = "causal_teacher_quick" if args.quick else "causal_teacher"
    print(f"Causal {HEADS}-head teacher, Gaussian tokens, sequence lengths {SEQ_LEN[0]}..{SEQ_LEN[1]} "
          f"(seed {args.seed}); {env_note()}\n")
    rows = []
    for r in results:
        if r["n_min"] is None:
            rows.append([r["normalize"], r["d"], r["psi"], r["n_first_T_ge_psi"], "not found"] + [""] * 7)
            continue
        rows.append([r["normalize"], r["d"], r["psi"], r["n_first_T_ge_psi"], r["n_min"], r["T"], fmt(r["lambda_ratio"]), fmt(r["p_error"]),
                     fmt(r["test_rel_mse"]),
                     f"{'yes' if r['control_identifiable'] else 'no'} (rank {r['control_rank']}/{r['psi']})",
                     f"{r['fixed']['T']}, {'yes' if r['fixed']['identifiable'] else 'no'}", fmt(r["fixed"]["p_error"])])
    print(markdown_table(["normalize", "d", "psi", "first N with T >= psi", "smallest certified N (sequences)", "T (positions)",
                          "lambda_min/lambda_max", "p error (relative, vs teacher)",
                          "causal rel. MSE, fresh length-200 sequences", "last-token control certifies?",
                          f"N = {N_FIXED}: T, certified?", f"N = {N_FIXED}: p error"], rows))
    path = plot(results, f"{name}.png")
    write_json(out_dir() / f"{name}.json", results)
    print(f"\nwrote {path} and {out_dir() / (name + '.json')}")


if __name__ == "__main__":
    main()
