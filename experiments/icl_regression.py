"""In-context linear regression with a causal, length-normalised single-layer MHLA (issue 11).

Each sequence is a regression task w ~ N(0, I_k) with examples x_i ~ N(0, I_k), y_i = <w, x_i>
(noise-free), written as interleaved tokens (d = k + 1):
    x token of example i:  (x_i, 0)     target (0, y_i), weight 1: predict y_i from the context
    y token of example i:  (x_i, y_i)   weight 0 (its "next token" is the next random x)
A single layer multiplies the prefix Gram by the last token, so for sum_i y_i x_i to appear in S the
pair must share a token: the y token repeats its x (with y tokens (0, y_i) the cross block of S is 0
and nothing can be learned). Trained on every x position with `--normalize length` (S_t / t, t =
tokens in the prefix), so at the query of example i (i - 1 examples of context, t = 2i - 1 tokens)
the class contains one step of preconditioned gradient descent from w = 0,
    yhat = x_i^T Gamma (1/t) sum_{j<i} y_j x_j,
and more (every cubic feature of the prefix). Reported against context length i - 1, on fresh tasks:
    MHLA   Algorithm 1 (mhla featurize --normalize length, fit) on the per-position tokens file
    GD-1   one step of preconditioned GD with the best Gamma (k x k, least squares on the same
           training positions and normalisation; a sub-class of the MHLA, so it cannot beat it in-sample)
    OLS    minimum-norm least squares on the context (exact once the context has >= k examples)
and what `certify` says (full and observed domain) about the training data.

    python experiments/icl_regression.py            # full run
    python experiments/icl_regression.py --quick    # smaller N

Equivalent CLI (the script writes its training file to experiments/out/icl_train.h5):
    mhla certify experiments/out/icl_train.h5 --normalize length --domain observed --json
    mhla fit experiments/out/icl_train.h5 --normalize length -o icl_model.h5
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    env_note,
    fmt,
    limit_threads,
    markdown_table,
    out_dir,
    savefig,
    write_json,
)

from mhla_cli import certify, featurize, fit, n_features
from mhla_cli.model.forward import predict_causal
from mhla_cli.model.synthetic import Dataset


def make_tasks(k: int, n_seq: int, n_ex: int, seed: int) -> tuple[Dataset, np.ndarray, np.ndarray]:
    """Interleaved tokens (n_seq, 2 n_ex, k + 1), per-position targets and 0/1 weights; also x, y."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_seq, k))
    x = rng.standard_normal((n_seq, n_ex, k))
    y = np.einsum("nik,nk->ni", x, w)
    d = k + 1
    X = np.zeros((n_seq, 2 * n_ex, d))
    X[:, 0::2, :k] = x
    X[:, 1::2, :k] = x
    X[:, 1::2, k] = y
    Y = np.zeros_like(X)
    Y[:, 0::2, k] = y
    wts = np.zeros((n_seq, 2 * n_ex))
    wts[:, 0::2] = 1.0
    n_tok = 2 * n_ex
    return Dataset(X.reshape(-1, d), np.arange(n_seq + 1) * n_tok, Y.reshape(-1, d), wts.reshape(-1)), x, y


def gd_features(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Features of one-step preconditioned GD at every query i: outer(x_i, (1/t_i) sum_{j<i} y_j x_j), flattened."""
    n_seq, n_ex, k = x.shape
    c = np.cumsum(y[:, :, None] * x, axis=1)
    c = np.concatenate([np.zeros((n_seq, 1, k)), c[:, :-1]], axis=1)  # sum over j < i
    t = 2 * np.arange(n_ex) + 1.0  # prefix length in tokens at the x token of example i
    g = c / t[None, :, None]
    return (x[:, :, :, None] * g[:, :, None, :]).reshape(n_seq, n_ex, k * k)


def ols_predictions(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Minimum-norm least squares on the previous examples, evaluated at each query (0 with no context)."""
    n_seq, n_ex, _ = x.shape
    out = np.zeros((n_seq, n_ex))
    for i in range(1, n_ex):
        W = np.stack([np.linalg.lstsq(x[s, :i], y[s, :i], rcond=None)[0] for s in range(n_seq)])
        out[:, i] = np.einsum("nk,nk->n", x[:, i], W)
    return out


def run(k: int, n_train: int, n_ex: int, n_test: int, seed: int, workdir: Path, keep: bool = False) -> dict[str, Any]:
    d = k + 1
    train, xtr, ytr = make_tasks(k, n_train, n_ex, seed)
    test, xte, yte = make_tasks(k, n_test, 2 * n_ex, 10_000 + seed)  # contexts up to 2x the training length
    path = workdir / "icl_train.h5"
    train.save(path, dtype="float64", compression=None)
    feats = featurize(path, normalize="length")
    cert_full, cert_obs = certify(feats), certify(feats, domain="observed")
    model = fit(feats)
    out = predict_causal(model, test.tokens, test.offsets).reshape(n_test, 4 * n_ex, d)
    yhat_mhla = out[:, 0::2, k]
    # GD-1: the best preconditioner on the training positions (same normalisation).
    Ftr = gd_features(xtr, ytr).reshape(-1, k * k)
    gamma = np.linalg.lstsq(Ftr, ytr.reshape(-1), rcond=None)[0]
    yhat_gd = gd_features(xte, yte) @ gamma
    yhat_ols = ols_predictions(xte, yte)
    # in-sample: GD-1's features are a subset of the MHLA's (S[x_j, y] / t * x_l), so MHLA <= GD-1
    out_tr = predict_causal(model, train.tokens, train.offsets).reshape(n_train, 2 * n_ex, d)
    train_mhla = float(np.mean((out_tr[:, 0::2, k] - ytr) ** 2))
    train_gd = float(np.mean((Ftr @ gamma - ytr.reshape(-1)) ** 2))
    err = {name: np.mean((yh - yte) ** 2, axis=0) for name, yh in
           (("mhla", yhat_mhla), ("gd1", yhat_gd), ("ols", yhat_ols), ("zero", np.zeros_like(yte)))}
    if keep:
        shutil.copy(path, out_dir() / path.name)
    return {
        "k": k, "d": d, "psi": n_features(d), "n_train": n_train, "n_examples": n_ex, "n_test": n_test,
        "n_samples": feats.n_samples, "mse": {n: v.tolist() for n, v in err.items()},
        "gamma": gamma.reshape(k, k).tolist(), "train_mse": {"mhla": train_mhla, "gd1": train_gd},
        "mhla_vs_gd1": float(np.mean((yhat_mhla - yhat_gd) ** 2) / np.mean(yte**2)),
        "cert_full": {"identifiable": cert_full.identifiable, "rank": cert_full.rank, "n_features": cert_full.n_features,
                      "lambda_min": cert_full.lambda_min, "reasons": cert_full.reasons[:2]},
        "cert_observed": {"identifiable": cert_obs.identifiable, "rank": cert_obs.rank,
                          "n_features": cert_obs.n_features, "lambda_min": cert_obs.lambda_min,
                          "lambda_max": cert_obs.lambda_max},
    }


def plot(r: dict[str, Any], name: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    ctx = np.arange(len(r["mse"]["mhla"]))
    for key, lab in (("zero", "predict 0"), ("gd1", "one step of preconditioned GD (best Gamma)"),
                     ("mhla", "MHLA, Algorithm 1 (causal, --normalize length)"), ("ols", "OLS on the context")):
        ax.plot(ctx, r["mse"][key], "o-", ms=3, label=lab)
    ax.axvline(r["n_examples"] - 0.5, color="grey", ls=":", label="longest training context")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("context length (examples before the query)")
    ax.set_ylabel("test MSE (E y^2 = k; OLS is exactly 0 from k examples on)")
    ax.set_title(f"In-context linear regression, k = {r['k']}, N = {r['n_train']} training tasks")
    ax.legend(fontsize=7)
    path = savefig(fig, name)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer training tasks and test tasks")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    limit_threads(1)
    k, n_ex = 3, 20
    n_train, n_test = (500, 200) if args.quick else (20_000, 2000)
    with tempfile.TemporaryDirectory() as tmp:
        r = run(k, n_train, n_ex, n_test, args.seed, Path(tmp), keep=not args.quick)
    name = "icl_regression_quick" if args.quick else "icl_regression"
    print(f"In-context linear regression: k = {k}, d = {r['d']}, psi = {r['psi']}, N = {n_train} training tasks "
          f"of {n_ex} examples ({r['n_samples']} weighted positions), {n_test} test tasks of {2 * n_ex} examples "
          f"(seed {args.seed}); {env_note()}\n")
    rows = []
    show = sorted(set(list(range(8)) + list(range(8, 2 * n_ex, 4)) + [n_ex - 1, n_ex, 2 * n_ex - 1]))
    for i in show:
        m = {key: r["mse"][key][i] for key in ("mhla", "gd1", "ols", "zero")}
        rows.append([i, fmt(m["mhla"]), fmt(m["gd1"]), fmt(m["ols"]), fmt(m["zero"]),
                     "" if i < n_ex else "beyond training"])
    print(markdown_table(["context (examples)", "MHLA (Alg. 1)", "GD-1 (best Gamma)", "OLS", "predict 0", ""], rows))
    cf, co = r["cert_full"], r["cert_observed"]
    print(f"\ncertify (full domain):     identifiable = {cf['identifiable']}, rank {cf['rank']}/{cf['n_features']}")
    print(f"certify (observed domain): identifiable = {co['identifiable']}, rank {co['rank']}/{co['n_features']}, "
          f"lambda_min/lambda_max = {fmt(co['lambda_min'] / co['lambda_max'])}")
    print(f"training MSE (y, every x position): MHLA {fmt(r['train_mse']['mhla'], 4)}, "
          f"GD-1 {fmt(r['train_mse']['gd1'], 4)}; test: mean (yhat_MHLA - yhat_GD1)^2 / mean y^2 = "
          f"{fmt(r['mhla_vs_gd1'])}")
    print(f"best GD-1 preconditioner Gamma (k x k):\n{np.array2string(np.array(r['gamma']), precision=3)}")
    path = plot(r, f"{name}.png")
    write_json(out_dir() / f"{name}.json", r)
    print(f"\nwrote {path} and {out_dir() / (name + '.json')}")


if __name__ == "__main__":
    main()
