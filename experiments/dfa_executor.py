"""A universal DFA executor learned by a single-layer autoregressive MHLA (issue 11, Appendix G of the paper).

Every sequence is the transition table of a fresh random DFA (Q states, alphabet of S symbols,
start state 0) followed by its execution trace on a random word; the model must output the next
state at every trace position, for a DFA it has never seen: it has to *read* the table in context.

Embedding (d = QS + Q; coordinates pair(q, s) = q S + s and next(q) = QS + q):
    table token for (q, s):   e_pair(q, s) + e_next(delta(q, s))      weight 0 (prompt)
    trace token t = 1..L:     e_pair(q_{t-1}, s_t)                      weight 1
    target at trace token t:  e_next(q_t)
The prefix Gram S = sum_s x_s x_s^T holds S[pair(q, s), next(q')] = [delta(q, s) = q'] (trace tokens
never touch the pair-next block), and the last token is one-hot at pair(q_{t-1}, s_t), so
    y_next(q') = sum_pair S[pair, next(q')] x_t[pair] = [delta(q_{t-1}, s_t) = q']
is one bilinear term per (pair, q'): an exact single-layer MHLA solution exists (p = 1 on the
features (pair, next(q'), pair) of output next(q')). Whether the data *determine* it is what the
certificates answer.

Pipeline per point, all through mhla: the traces are written as a per-position tokens file
(tokens (N, n, d), targets (N, n, d), weights (N, n)), then `featurize` (causal), `certify` (full
and observed domain), `fit`, `predict_file(causal=True)` (teacher-forced next state on training
and held-out traces) and `certify_probes` (= `mhla certify train.h5 --on heldout.h5`) on held-out
traces of NEW random DFAs with words 4x longer. Closed loop: the model's own decoded state is fed
back: token t+1 = e_pair(q_hat_t, s_{t+1}), q_hat_t = the nearest e_next row (`snap_to`) of the
model's output (`mhla rollout` cannot do this, it appends the output itself, but the next token
also carries the exogenous input symbol s_{t+1}).

Second table: autonomous DFAs (one-letter alphabet, q_{t+1} = f(q_t)) embedded so that the target
IS the next token (table e_state(q) + e_next(f(q)), trace e_state(q_t), d = 2Q): there the closed
loop is `mhla rollout --snap` with the codebook of e_state rows, run from prompts table + e_state(0).

    python experiments/dfa_executor.py            # full run (up to Q = S = 5)
    python experiments/dfa_executor.py --large    # ... and Q = S = 6 (d = 42, psi = 37926)
    python experiments/dfa_executor.py --quick    # Q=3, S=2 only, two training sizes

Equivalent CLI for one point (files written by the script to experiments/out/dfa_*.h5):
    mhla certify experiments/out/dfa_train.h5 --json
    mhla certify experiments/out/dfa_train.h5 --on experiments/out/dfa_heldout.h5 --json
    mhla fit experiments/out/dfa_train.h5 -o dfa_model.h5
    mhla predict dfa_model.h5 experiments/out/dfa_heldout.h5 --causal -o pred.h5 --json
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    add_doc_image_flag,
    doc_images,
    env_note,
    fmt,
    limit_threads,
    markdown_table,
    out_dir,
    savefig,
    write_json,
)

from mhla_cli import certify, featurize, fit, n_features
from mhla_cli.model.forward import predict_file, snap_to
from mhla_cli.solve.probes import certify_probes
from mhla_cli.model.synthetic import Dataset

# Paper, Appendix G.4 / Fig. 4: a 4-layer, 16-head Llama-style Transformer (hidden 2048) trained with
# cross-entropy needs about 2^10 (Q = 2) to beyond 2^15 (Q = 16) training tokens N*L to reach 99 %
# next-token accuracy (the other two of Q, L, alphabet fixed at 4). Quoted, not rerun.
PAPER_FIG4 = "4-layer Transformer: ~2^10 (Q=2) .. >2^15 (Q=16) training tokens N*L for 99 % accuracy"


def dims(Q: int, S: int) -> int:
    return Q * S + Q


def random_dfas(n: int, Q: int, S: int, rng: np.random.Generator) -> np.ndarray:
    """n random transition tables delta (n, Q, S) with entries in 0..Q-1."""
    return rng.integers(0, Q, size=(n, Q, S))


def run_dfas(delta: np.ndarray, words: np.ndarray) -> np.ndarray:
    """States q_0 = 0, q_1, ..., q_L of every DFA on its word: (n, L + 1)."""
    n, L = words.shape
    q = np.zeros((n, L + 1), dtype=np.int64)
    idx = np.arange(n)
    for t in range(L):
        q[:, t + 1] = delta[idx, q[:, t], words[:, t]]
    return q


def encode(delta: np.ndarray, words: np.ndarray, states: np.ndarray | None = None) -> Dataset:
    """Per-position tokens file contents (dense, every sequence QS + L tokens).

    `states` (n, L + 1) are the states written into the trace tokens (the true ones by default;
    the closed loop passes the model's own). Targets are always the true next states.
    """
    n, Q, S = delta.shape
    L = words.shape[1]
    d = dims(Q, S)
    true = run_dfas(delta, words)
    states = true if states is None else states
    qs = Q * S
    X = np.zeros((n, qs + L, d))
    rows = np.arange(n)[:, None]
    pair = np.arange(qs)
    X[:, pair, pair] = 1.0
    X[rows, pair[None, :], qs + delta.reshape(n, qs)] = 1.0
    t = np.arange(L)
    X[rows, qs + t[None, :], states[:, :L] * S + words] = 1.0
    Y = np.zeros_like(X)
    Y[rows, qs + t[None, :], qs + true[:, 1:]] = 1.0
    w = np.zeros((n, qs + L))
    w[:, qs:] = 1.0
    n_tok = qs + L
    return Dataset(X.reshape(-1, d), np.arange(n + 1) * n_tok, Y.reshape(-1, d), w.reshape(-1))


def make(Q: int, S: int, n: int, L: int, seed: int) -> tuple[Dataset, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    delta = random_dfas(n, Q, S, rng)
    words = rng.integers(0, S, size=(n, L))
    return encode(delta, words), delta, words


def decode(outputs: np.ndarray, Q: int, S: int) -> np.ndarray:
    """Nearest e_next row (the codebook of states) of each output row: the predicted state."""
    qs = Q * S
    codebook = np.zeros((Q, qs + Q))
    codebook[np.arange(Q), qs + np.arange(Q)] = 1.0
    return snap_to(codebook, outputs)


def closed_loop(model: Any, delta: np.ndarray, words: np.ndarray) -> dict[str, Any]:
    """Execute every DFA with the model's own states fed back; compare with the true run.

    At step t the sequence is table + e_pair(q_hat_0, s_1) .. e_pair(q_hat_{t-1}, s_t); the model's
    causal output at its last token is decoded to q_hat_t. One `predict_causal` per step on the
    growing dense array (O(L^2) in total; fine at these lengths).
    """
    from mhla_cli.model.forward import predict_causal

    n, Q, S = delta.shape
    L = words.shape[1]
    qs = Q * S
    true = run_dfas(delta, words)
    qhat = np.zeros_like(true)
    for t in range(L):
        ds = encode(delta, words[:, :t + 1], qhat[:, :t + 1])
        out = predict_causal(model, ds.tokens.reshape(n, qs + t + 1, -1))
        last = out.reshape(n, qs + t + 1, -1)[:, -1]
        qhat[:, t + 1] = decode(last, Q, S)
    step_ok = qhat[:, 1:] == true[:, 1:]
    return {"step_accuracy": float(step_ok.mean()), "exact_runs": int(step_ok.all(axis=1).sum()),
            "n_runs": n, "first_error_step": int(np.argmin(step_ok.all(axis=0))) if not step_ok.all() else None}


def position_metrics(outputs: np.ndarray, ds: Dataset, Q: int, S: int) -> dict[str, float]:
    keep = ds.weights > 0
    out, y = outputs[keep], ds.targets[keep]
    acc = float(np.mean(decode(out, Q, S) == decode(y, Q, S)))
    return {"accuracy": acc, "max_error": float(np.abs(out - y).max()), "n_positions": int(keep.sum())}


def run_point(Q: int, S: int, n_train: int, L: int, n_test: int, seed: int, workdir: Path,
              keep_files: bool = False) -> dict[str, Any]:
    """Train on n_train traces of words of length L; test on n_test new DFAs with words of length 4L."""
    d = dims(Q, S)
    train, _, _ = make(Q, S, n_train, L, seed)
    test, delta_t, words_t = make(Q, S, n_test, 4 * L, 10_000 + seed)
    ftrain, ftest = workdir / "dfa_train.h5", workdir / "dfa_heldout.h5"
    train.save(ftrain, dtype="float64", compression=None)
    test.save(ftest, dtype="float64", compression=None)
    t0 = time.perf_counter()
    feats = featurize(ftrain)
    t_feat = time.perf_counter() - t0
    t0 = time.perf_counter()
    cert_full = certify(feats)
    cert_obs = certify(feats, domain="observed")
    t_cert = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = fit(feats)
    t_fit = time.perf_counter() - t0
    tr = predict_file(model, ftrain, causal=True)
    te = predict_file(model, ftest, causal=True)
    t0 = time.perf_counter()
    probes = certify_probes(feats, ftest)
    t_probe = time.perf_counter() - t0
    t0 = time.perf_counter()
    loop = closed_loop(model, delta_t, words_t)
    t_loop = time.perf_counter() - t0
    if keep_files:
        for f in (ftrain, ftest):
            shutil.copy(f, out_dir() / f.name)
    return {
        "Q": Q, "S": S, "d": d, "psi": n_features(d), "n_train": n_train, "L": L, "L_test": 4 * L,
        "n_test": n_test, "train_tokens": n_train * L, "n_samples": feats.n_samples,
        "train": position_metrics(tr.outputs, train, Q, S), "train_mse": tr.mse,
        "heldout": position_metrics(te.outputs, test, Q, S), "heldout_mse": te.mse,
        "closed_loop": loop,
        "cert_full": {"identifiable": cert_full.identifiable, "rank": cert_full.rank, "n_features": cert_full.n_features,
                      "span_features": cert_full.span_features},
        "reduced": bool(feats.on_spans),
        "cert_observed": {"identifiable": cert_obs.identifiable, "rank": cert_obs.rank,
                          "n_features": cert_obs.n_features},
        "probes": {"n_probes": probes.n_probes, "n_undetermined": int(probes.undetermined.size),
                   "null_dim": probes.null_dim, "max_residual": float(probes.residual.max())},
        "seconds": {"featurize": t_feat, "certify": t_cert, "fit": t_fit, "probes": t_probe, "closed_loop": t_loop},
        "gram_mib": n_features(d) ** 2 * 8 / 2**20,
    }


# --------------------------------------------------------------------------------------------
# Autonomous DFAs (a one-letter alphabet: q_{t+1} = f(q_t)): the closed loop through `mhla rollout --snap`
# --------------------------------------------------------------------------------------------


def encode_autonomous(f: np.ndarray, L: int) -> Dataset:
    """Table e_state(q) + e_next(f(q)) (weight 0), then trace tokens e_state(q_t), t = 0..L-1, whose
    target is the NEXT TOKEN e_state(q_{t+1}) (weight 1); d = 2Q. The output is the next token, so
    `mhla rollout --snap` (codebook: the e_state rows) runs the machine by itself."""
    n, Q = f.shape
    d = 2 * Q
    q = np.zeros((n, L + 1), dtype=np.int64)
    for t in range(L):
        q[:, t + 1] = f[np.arange(n), q[:, t]]
    X = np.zeros((n, Q + L, d))
    rows = np.arange(n)[:, None]
    X[:, np.arange(Q), np.arange(Q)] = 1.0
    X[rows, np.arange(Q)[None, :], Q + f] = 1.0
    X[rows, Q + np.arange(L)[None, :], q[:, :L]] = 1.0
    Y = np.zeros_like(X)
    Y[rows, Q + np.arange(L)[None, :], q[:, 1:]] = 1.0
    w = np.zeros((n, Q + L))
    w[:, Q:] = 1.0
    return Dataset(X.reshape(-1, d), np.arange(n + 1) * (Q + L), Y.reshape(-1, d), w.reshape(-1))


def run_autonomous(Q: int, n_train: int, L: int, n_test: int, seed: int, workdir: Path,
                   keep_files: bool = False) -> dict[str, Any]:
    """Fit on n_train traces of length L; `rollout_file(..., codebook=...)` (= `mhla rollout --snap`)
    from prompts table + e_state(0) of n_test new maps for 4L steps; compare with the true orbit."""
    import h5py

    from mhla_cli.model.forward import rollout_file

    rng = np.random.default_rng(seed)
    f_tr = rng.integers(0, Q, size=(n_train, Q))
    f_te = np.random.default_rng(20_000 + seed).integers(0, Q, size=(n_test, Q))
    steps = 4 * L
    train, test = encode_autonomous(f_tr, L), encode_autonomous(f_te, steps)
    prompts = encode_autonomous(f_te, 1)  # table + e_state(q_0 = 0)
    paths = {k: workdir / f"auto_{k}.h5" for k in ("train", "heldout", "prompts", "codebook", "rollout")}
    train.save(paths["train"], dtype="float64", compression=None)
    test.save(paths["heldout"], dtype="float64", compression=None)
    Dataset(prompts.tokens, prompts.offsets, prompts.tokens[prompts.offsets[1:] - 1]).save(
        paths["prompts"], dtype="float64", compression=None)
    with h5py.File(paths["codebook"], "w") as fh:
        fh["codebook"] = np.eye(2 * Q)[:Q]
    feats = featurize(paths["train"])
    model = fit(feats)
    probes = certify_probes(feats, paths["heldout"])
    rollout_file(model, paths["prompts"], paths["rollout"], steps, codebook=paths["codebook"])
    with h5py.File(paths["rollout"], "r") as fh:
        tok = fh["tokens"][()]
        off = fh["offsets"][()] if "offsets" in fh else np.arange(n_test + 1) * (Q + 1 + steps)
    gen = np.stack([tok[off[i + 1] - steps:off[i + 1]] for i in range(n_test)])  # (n_test, steps, d)
    states = np.argmax(gen[:, :, :Q], axis=2)
    q = np.zeros((n_test, steps + 1), dtype=np.int64)
    for t in range(steps):
        q[:, t + 1] = f_te[np.arange(n_test), q[:, t]]
    ok = states == q[:, 1:]
    if keep_files:
        for k in ("train", "heldout", "prompts", "codebook"):
            shutil.copy(paths[k], out_dir() / paths[k].name)
    return {"Q": Q, "d": 2 * Q, "psi": n_features(2 * Q), "n_train": n_train, "L": L, "steps": steps,
            "n_test": n_test, "exact_runs": int(ok.all(axis=1).sum()), "step_accuracy": float(ok.mean()),
            "probes": {"n_probes": probes.n_probes, "n_undetermined": int(probes.undetermined.size)},
            "rank": certify(feats).rank}


def autonomous_table(results: list[dict[str, Any]]) -> str:
    header = ["Q", "d = 2Q", "psi", "train traces N", "L", "rollout steps (4L)", "exact rollouts (--snap)",
              "step accuracy", "rank", "certify --on: undetermined / probes"]
    return markdown_table(header, [[r["Q"], r["d"], r["psi"], r["n_train"], r["L"], r["steps"],
                                    f"{r['exact_runs']}/{r['n_test']}", f"{r['step_accuracy']:.3f}", r["rank"],
                                    f"{r['probes']['n_undetermined']} / {r['probes']['n_probes']}"]
                                   for r in results])


def table(results: list[dict[str, Any]]) -> str:
    header = ["Q", "S", "d", "psi", "train traces N", "tokens N*L", "train acc", "held-out acc (4L)",
              "held-out max err", "closed-loop exact runs", "full cert (rank/psi)", "observed cert (rank/dim)",
              "certify --on: undetermined / probes"]
    rows = []
    for r in results:
        cf, co, pr = r["cert_full"], r["cert_observed"], r["probes"]
        rows.append([r["Q"], r["S"], r["d"], r["psi"], r["n_train"], r["train_tokens"],
                     f"{r['train']['accuracy']:.3f}", f"{r['heldout']['accuracy']:.3f}",
                     fmt(r["heldout"]["max_error"]),
                     f"{r['closed_loop']['exact_runs']}/{r['closed_loop']['n_runs']}",
                     f"{'yes' if cf['identifiable'] else 'no'} ({cf['rank']}/{cf['n_features']})",
                     f"{'yes' if co['identifiable'] else 'no'} ({co['rank']}/{co['n_features']})",
                     f"{pr['n_undetermined']} / {pr['n_probes']}"])
    return markdown_table(header, rows)


def cost_table(results: list[dict[str, Any]]) -> str:
    header = ["Q", "S", "d", "psi", "span features (block)", "block (MiB)", "N", "featurize (s)",
              "certify full+obs (s)", "fit (s)", "certify --on (s)", "closed loop (s)", "total (s)"]
    rows = []
    for r in results:
        s = r["seconds"]
        n = r["cert_full"]["span_features"]
        rows.append([r["Q"], r["S"], r["d"], r["psi"], f"{n}{'' if r['reduced'] else ' (all stored)'}",
                     fmt(n * n * 8 / 2**20), r["n_train"], fmt(s["featurize"]), fmt(s["certify"]), fmt(s["fit"]),
                     fmt(s["probes"]), fmt(s["closed_loop"]), fmt(sum(s.values()))])
    return markdown_table(header, rows)


def smallest_determined(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (Q, S): the smallest N tried at which every held-out position was determined."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for r in results:
        key = (r["Q"], r["S"])
        out.setdefault(key, {"Q": r["Q"], "S": r["S"], "d": r["d"], "psi": r["psi"], "n_min": None, "tried": []})
        out[key]["tried"].append(r["n_train"])
        if r["probes"]["n_undetermined"] == 0 and out[key]["n_min"] is None:
            out[key]["n_min"] = r["n_train"]
            out[key]["tokens"] = r["train_tokens"]
            out[key]["samples"] = r["n_samples"]
    return list(out.values())


def plot(results: list[dict[str, Any]], path_name: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({(r["Q"], r["S"]) for r in results}):
        rs = sorted((r for r in results if (r["Q"], r["S"]) == key), key=lambda r: r["n_train"])
        tok = [r["train_tokens"] for r in rs]
        lab = f"Q={key[0]}, S={key[1]} (psi={rs[0]['psi']})"
        axes[0].plot(tok, [r["heldout"]["accuracy"] for r in rs], "o-", label=lab)
        axes[1].plot(tok, [max(r["probes"]["n_undetermined"] / r["probes"]["n_probes"], 1e-4) for r in rs], "o-",
                     label=lab)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.axvspan(2**10, 2**15, color="grey", alpha=0.15, label="paper Fig. 4: 4-layer Transformer, 2^10..2^15")
        ax.set_xlabel("training tokens N*L (trace symbols)")
    axes[0].set_ylabel("held-out next-state accuracy\n(new DFAs, words 4L)")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("held-out positions undetermined\n(fraction; plotted at 1e-4 when 0)")
    axes[0].legend(fontsize=7)
    fig.suptitle("Single-layer MHLA as a universal DFA executor (Algorithm 1, causal)", y=1.02)
    fig.tight_layout()
    path = savefig(fig, path_name)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="Q=3, S=2 only, N in {20, 80}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--point", type=int, nargs=3, metavar=("Q", "S", "N"), action="append",
                    help="run only these points (repeatable), e.g. --point 4 4 320")
    ap.add_argument("--large", action="store_true",
                    help="also Q = S = 6 (d = 42, psi = 37926) at N = 1000 and 3000 (minutes)")
    add_doc_image_flag(ap)
    args = ap.parse_args()
    doc_images(args.doc_image)
    limit_threads(1)
    L, n_test = 6, 30
    if args.point:
        grid = [(q, s, (n,)) for q, s, n in args.point]
    elif args.quick:
        grid = [(3, 2, (20, 80))]
    else:
        grid = [(3, 2, (10, 20, 40, 80, 160)), (3, 3, (20, 40, 80, 160)), (4, 3, (80, 160, 320)),
                (4, 4, (320,)), (5, 4, (400, 800)), (5, 5, (500, 1000))]
        if args.large:
            grid.append((6, 6, (1000, 3000)))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for Q, S, ns in grid:
            for n in ns:
                keep = (Q, S, n) == (3, 2, 80)
                r = run_point(Q, S, n, L, n_test, args.seed, Path(tmp), keep_files=keep)
                results.append(r)
                r["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # so far
                print(f"# Q={Q} S={S} N={n}: held-out acc {r['heldout']['accuracy']:.3f}, "
                      f"undetermined {r['probes']['n_undetermined']}/{r['probes']['n_probes']}, "
                      f"{sum(r['seconds'].values()):.1f} s, peak RSS so far {r['peak_rss_mib']:.0f} MiB", flush=True)
    auto_grid = [] if args.point else [(3, (5, 20))] if args.quick else [(3, (5, 10, 20, 40)), (5, (20, 40, 80, 160))]
    auto = []
    with tempfile.TemporaryDirectory() as tmp:
        for Q, ns in auto_grid:
            for n in ns:
                auto.append(run_autonomous(Q, n, L, n_test, args.seed, Path(tmp), keep_files=(Q, n) == (3, 20)))
    name = ("dfa_executor_points" if args.point else "dfa_executor_quick" if args.quick else "dfa_executor")
    print(f"\nDFA executor: words of L = {L} symbols in training, {4 * L} on {n_test} new random DFAs "
          f"per point (seed {args.seed}); {env_note()}\n")
    print(table(results))
    print("\nSmallest N tried with every held-out position determined (certify --on):\n")
    sm = smallest_determined(results)
    print(markdown_table(["Q", "S", "d", "psi", "N tried", "smallest N determined", "tokens N*L", "weighted positions"],
                         [[s["Q"], s["S"], s["d"], s["psi"], ",".join(map(str, s["tried"])), fmt(s["n_min"]),
                           fmt(s.get("tokens")), fmt(s.get("samples"))] for s in sm]))
    print(f"\nPaper, Fig. 4 (quoted, not rerun): {PAPER_FIG4}\n")
    print("Cost (seconds, 1 BLAS thread):\n")
    print(cost_table(results))
    if auto:
        print(f"\nAutonomous DFAs (one-letter alphabet, q_t+1 = f(q_t)), closed loop by `mhla rollout --snap` "
              f"from table + e_state(0) on {n_test} new maps:\n")
        print(autonomous_table(auto))
    path = plot(results, f"{name}.png")
    write_json(out_dir() / f"{name}.json", {"results": results, "smallest": sm, "paper_fig4": PAPER_FIG4,
                                            "autonomous": auto})
    print(f"\nwrote {path} and {out_dir() / (name + '.json')}")


if __name__ == "__main__":
    main()
