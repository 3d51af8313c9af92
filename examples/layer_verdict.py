"""Which attention layers of a real model can be replaced without training: the verdict rows of head_survey.py.

For one layer of the captured model (head_survey.Split: its input tokens, its 12 heads' outputs before W_O and its
attention output W_O (heads' outputs) at every position), fitted on the training windows and scored on the held-out
ones, side by side:

- `blocks`: the layer as the sum of its heads' MHLAs, head h on d token directions of its own (P_h by
  mhla_cli.model.directions: `supervised` on the head's own 32-dim output z_h, and `weights` on the head's rows of
  W_Q, W_K, W_V stacked), each fitted at the head's full output width (what `mhla reduce --keep-targets` writes),
  ridge by CV, and the reduction of each head chosen by its CV error on the training folds; the layer's output is
  sum_h W_O[:, 32h:32h+32] zhat_h (`layer_of_heads`: mhla_cli.sum_of_blocks, a HeadsSum).
- `layer`: one MHLA on the whole layer's 384-dim output, the best by CV of pca / supervised / weights.
- `blocks_affine`: `blocks` plus the affine map of the full token [x_t, 1] fitted (closed form, ridge by CV) on the
  training residual of the block sum.
- `affine` (NBL's affine map of [x_t, 1] to the layer's output), `mean` (the training mean), `zero` (deletion).

Each row records its held-out R^2 of the layer's full 384-dim output at every position, the seconds of its fits
(reductions, featurize and fit, wall clock) and the training positions it read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from real_model import accumulate, affine_features, predict_rows, r2, ridge_cv

from mhla_cli import HeadsSum, export_heads, fit, sum_of_blocks, write_tokens
from mhla_cli.model import directions
from mhla_cli.model.forward import predict_file
from mhla_cli.model.heads import Heads
from mhla_cli.model.reduce import Reduction, top_eigenvectors, unreduce_heads
from mhla_cli.statistics.folds import featurize_folds

# The reductions a head's block is fitted with (the better by CV is kept), and those of the one-block layer.
HEAD_METHODS = ("supervised", "weights")
LAYER_METHODS = ("pca", "supervised", "weights")
# A layer is safe to replace when the sentence embeddings keep at least this mean cosine to the original model's
# (an angle of 8 degrees on average) ...
SAFE_MEAN_COSINE = 0.99
# ... and the pairwise similarities of held-out texts keep at least this Spearman correlation (retrieval and
# clustering read only their order).
SAFE_SPEARMAN = 0.95
# The rows of the verdict: key, name.
VERDICT_ROWS = (("blocks", "MHLA, per-head blocks"), ("layer", "MHLA, one block on the layer"),
                ("blocks_affine", "per-head blocks + affine map"), ("affine", "NBL's affine map"),
                ("mean", "the mean output"), ("zero", "deletion (zero)"))
# The rows that are mhla's (a layer is safe only when one of them clears the threshold).
MHLA_ROWS = ("blocks", "layer", "blocks_affine")
# Rows of tokens per chunk of the moments and projections.
CHUNK = 1 << 15


@dataclass
class Part:
    """One fitted MHLA on reduced tokens: its reduction, CV error and the outputs it predicts."""
    method: str
    P: np.ndarray            # (384, d)
    heads: Heads             # factored: P, U = I (the targets kept at full width)
    cv_mse: float
    r2: float                # held-out R^2 of its own targets
    pred_te: np.ndarray      # (T_te, e)
    pred_tr: np.ndarray | None
    seconds: float
    model_path: Path


def layer_of_heads(parts: list[Heads], W_O: np.ndarray) -> HeadsSum:
    """The layer as the sum of its heads' blocks (mhla_cli.sum_of_blocks): head h's factored heads (outputs z_h,
    32-dim) through W_O[:, 32h:32h+32], so that the sum is sum_h W_O_h zhat_h; `predict` at every position,
    `to_torch()` the module mhla_cli.model.splice puts in the model."""
    dh = W_O.shape[1] // len(parts)
    return sum_of_blocks(parts, [W_O[:, h * dh:(h + 1) * dh] for h in range(len(parts))])


def moments(X: np.ndarray, Y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sum x x^T, sum x y^T) over every position, float64, in chunks."""
    Gx, Cxy = np.zeros((X.shape[1], X.shape[1])), np.zeros((X.shape[1], Y.shape[1]))
    for a in range(0, X.shape[0], CHUNK):
        x, y = np.asarray(X[a:a + CHUNK], dtype=np.float64), np.asarray(Y[a:a + CHUNK], dtype=np.float64)
        Gx += x.T @ x
        Cxy += x.T @ y
    return Gx, Cxy


def project(X: np.ndarray, P: np.ndarray) -> np.ndarray:
    """X P in float64, in chunks."""
    return np.concatenate([np.asarray(X[a:a + CHUNK], dtype=np.float64) @ P for a in range(0, X.shape[0], CHUNK)])


def head_reads(model, layer: int, head: int | None, dh: int) -> np.ndarray:
    """[W_Q; W_K; W_V] rows of head `head` (None: every head) of the layer: the matrices it reads the token through."""
    att = model.encoder.layer[layer].attention.self
    rows = slice(None) if head is None else slice(head * dh, (head + 1) * dh)
    return np.vstack([m.weight.detach().double().numpy()[rows] for m in (att.query, att.key, att.value)])


def token_map(method: str, Gx: np.ndarray, Cxy: np.ndarray, n: int, W: np.ndarray, d: int) -> np.ndarray:
    """P (384, d) by `method` from the moments (the maps fit_reduction computes from a file)."""
    if method == "pca":
        return top_eigenvectors(Gx, d)[0]
    if method == "supervised":
        return directions.supervised(Gx / n, Cxy / n, d)[0]
    return directions.weight_directions(W, Gx / n, d)[0]


def fit_part(wd: Path, tag: str, P: np.ndarray, Ztr: np.ndarray, Zte: np.ndarray, Ytr: np.ndarray, Yte: np.ndarray,
             offsets: tuple[np.ndarray, np.ndarray], method: str, args, train_pred: bool) -> Part:
    """Write the reduced files (tokens X P, targets at full width), featurize with folds, fit (ridge by CV),
    predict held out (and the training positions when `train_pred`)."""
    t0 = time.perf_counter()
    att = dict(attention="bidirectional")
    tr, te = wd / f"train_{tag}.h5", wd / f"heldout_{tag}.h5"
    write_tokens(tr, Ztr, offsets[0], Ytr, **att)
    total, folds = featurize_folds(tr, args.folds, normalize=args.normalize)
    model = fit(total, ridge="auto", folds=folds)
    seconds = time.perf_counter() - t0
    path = wd / f"model_cv_{tag}.h5"
    model.save(path, inputs=(tr,))
    write_tokens(te, Zte, offsets[1], Yte, **att)
    pred = predict_file(model, te).outputs
    pred_tr = predict_file(model, tr).outputs if train_pred else None
    heads = unreduce_heads(export_heads(model), Reduction(P, None, keep_targets=True))
    return Part(method, P, heads, float(model.info["ridge_cv"]["cv_mse"]), r2(Yte, pred), pred, pred_tr, seconds,
                path)


def best_part(wd: Path, tag: str, methods: tuple[str, ...], maps: dict, Xtr, Xte, Ytr, Yte, offsets, args,
              train_pred: bool) -> tuple[Part, dict[str, Part]]:
    """Each method's fit and the one of the lowest CV error on the training folds."""
    parts = {}
    for m in methods:
        t0 = time.perf_counter()
        P = maps[m]()
        Ztr = project(Xtr, P)
        reduce_s = time.perf_counter() - t0
        part = fit_part(wd, f"{tag}_{m}", P, Ztr, project(Xte, P), Ytr, Yte, offsets, m, args, train_pred)
        part.seconds += reduce_s  # the reduction, then the reduced file, featurize and fit
        parts[m] = part
    return min(parts.values(), key=lambda p: p.cv_mse), parts


@dataclass
class LayerData:
    """One layer's capture, its moments over the training positions and its weights."""
    layer: int
    Xtr: np.ndarray          # (T, D) float32 memory maps
    Xte: np.ndarray
    Ytr: np.ndarray          # (T, 2 D): the heads' outputs side by side, then the layer's output
    Yte: np.ndarray
    offsets: tuple[np.ndarray, np.ndarray]
    windows: tuple[list[np.ndarray], list[np.ndarray]]
    Gx: np.ndarray
    Cxy: np.ndarray
    W_O: np.ndarray
    reads: list[np.ndarray]  # per head: [W_Q; W_K; W_V] rows
    moments_seconds: float

    @property
    def n(self) -> int:
        return int(self.offsets[0][-1])

    @property
    def D(self) -> int:
        return int(self.Xtr.shape[1])

    def targets(self, cols: slice) -> tuple[np.ndarray, np.ndarray]:
        return (np.asarray(self.Ytr[:, cols], dtype=np.float64), np.asarray(self.Yte[:, cols], dtype=np.float64))


def layer_data(train, test, li: int, model, W_O: np.ndarray) -> LayerData:
    """The layer's capture (head_survey.Split) with the moments every reduction reads (one pass)."""
    n_heads = model.config.num_attention_heads
    dh = train.tokens[li].shape[1] // n_heads
    t0 = time.perf_counter()
    Gx, Cxy = moments(train.tokens[li], train.targets[li])
    return LayerData(li, train.tokens[li], test.tokens[li], train.targets[li], test.targets[li],
                     (train.offsets, test.offsets), (train.windows(li), test.windows(li)), Gx, Cxy, W_O,
                     [head_reads(model, li, h, dh) for h in range(n_heads)], time.perf_counter() - t0)


def fit_blocks(wd: Path, L: LayerData, d: int, args, train_pred: bool) -> tuple[list[Part], dict[str, list[Part]]]:
    """Every head's block at d (each method of HEAD_METHODS; the head's own 32-dim output kept): the chosen parts and
    the parts of each method."""
    n_heads = len(L.reads)
    dh = L.D // n_heads
    methods = tuple(getattr(args, "head_methods", HEAD_METHODS))
    chosen, every = [], {m: [] for m in methods}
    for h in range(n_heads):
        cols = slice(h * dh, (h + 1) * dh)
        maps = {m: (lambda m=m, cols=cols, W=L.reads[h]: token_map(m, L.Gx, L.Cxy[:, cols], L.n, W, d))
                for m in methods}
        Ytr, Yte = L.targets(cols)
        best, parts = best_part(wd, f"L{L.layer}_h{h}_d{d}", methods, maps, L.Xtr, L.Xte, Ytr, Yte, L.offsets,
                                args, train_pred)
        chosen.append(best)
        for m in methods:
            every[m].append(parts[m])
    return chosen, every


def sum_through(parts: list[Part], W_O: np.ndarray, which: str = "pred_te") -> np.ndarray:
    """sum_h W_O[:, 32h:32h+32] zhat_h of the parts' predictions (held out, or 'pred_tr')."""
    dh = W_O.shape[1] // len(parts)
    return sum(getattr(p, which) @ W_O[:, h * dh:(h + 1) * dh].T for h, p in enumerate(parts))


def fit_layer_block(wd: Path, L: LayerData, d: int, args) -> tuple[Part, dict[str, Part]]:
    """One MHLA on the whole layer's output at d, each method of LAYER_METHODS (W: every head's reads)."""
    W = np.vstack(L.reads)
    cols = slice(L.D, 2 * L.D)
    maps = {m: (lambda m=m: token_map(m, L.Gx, L.Cxy[:, cols], L.n, W, d)) for m in LAYER_METHODS}
    Ytr, Yte = L.targets(cols)
    return best_part(wd, f"L{L.layer}_layer_d{d}", LAYER_METHODS, maps, L.Xtr, L.Xte, Ytr, Yte, L.offsets, args,
                     False)


def affine_of(L: LayerData, Y: np.ndarray, folds: int):
    """The affine map of [x_t, 1] to Y (T, e) at every training position (ridge by CV) and its held-out outputs."""
    lin = ridge_cv(accumulate(affine_features(L.windows[0]), Y, L.offsets[0], folds))
    return lin, predict_rows(lin, affine_features(L.windows[1]), len(L.offsets[1]) - 1)


def verdict_layer(wd: Path, L: LayerData, args) -> tuple[dict, dict]:
    """The verdict rows of one layer: ({"rows": {key: {r2, seconds, positions}}, ...}, {key: replacement})."""
    from real_model import affine_fn, const_fn, numpy_replacement

    from mhla_cli.model.splice import Replacement

    Ytr, Yte = L.targets(slice(L.D, 2 * L.D))
    chosen, every = fit_blocks(wd, L, args.head_d, args, train_pred=True)
    blocks = layer_of_heads([p.heads for p in chosen], L.W_O)
    pred_b = blocks.predict(np.concatenate(L.windows[1]), L.offsets[1])
    blocks_s = L.moments_seconds + sum(p.seconds for ps in every.values() for p in ps)
    t0 = time.perf_counter()
    resid = Ytr - sum_through(chosen, L.W_O, "pred_tr")
    lin_r, pred_r = affine_of(L, resid, args.folds)
    resid_s = time.perf_counter() - t0
    best_l, layer_parts = fit_layer_block(wd, L, args.layer_d, args)
    t0 = time.perf_counter()
    lin_a, pred_a = affine_of(L, Ytr, args.folds)
    affine_s = time.perf_counter() - t0
    mean = Ytr.mean(axis=0)
    n, zero = L.n, np.zeros_like(mean)
    rows = {"blocks": (r2(Yte, pred_b), blocks_s, n),
            "layer": (best_l.r2, L.moments_seconds + sum(p.seconds for p in layer_parts.values()), n),
            "blocks_affine": (r2(Yte, pred_b + pred_r), blocks_s + resid_s, n),
            "affine": (r2(Yte, pred_a), affine_s, n), "mean": (r2(Yte, Yte * 0 + mean), 0.0, n),
            "zero": (r2(Yte, Yte * 0), 0.0, 0)}
    out = {"layer": L.layer, "head_d": args.head_d, "layer_d": args.layer_d,
           "rows": {k: {"r2": v[0], "seconds": v[1], "positions": v[2]} for k, v in rows.items()},
           "head_methods": [p.method for p in chosen], "head_r2": [p.r2 for p in chosen],
           "blocks_by_method": {m: r2(Yte, sum_through(ps, L.W_O)) for m, ps in every.items()},
           "layer_method": best_l.method, "layer_by_method": {m: p.r2 for m, p in layer_parts.items()},
           "blocks_check": float(np.abs(pred_b - sum_through(chosen, L.W_O)).max())}
    if args.keep_wide:  # what the test recomputes in numpy
        np.savez(wd / f"verdict_L{L.layer}.npz", pred_blocks=pred_b, P=np.stack([p.P for p in chosen]),
                 methods=np.array(out["head_methods"]))
    blocks_mod = blocks.to_torch()
    aff_r = numpy_replacement(affine_fn(lin_r, None, 0.0))
    fns = {"blocks": blocks_mod, "layer": Replacement(best_l.heads, layout="bidirectional"),
           "blocks_affine": lambda X, mask=None: blocks_mod(X, mask) + aff_r(X, mask),
           "affine": numpy_replacement(affine_fn(lin_a, None, 0.0)), "mean": numpy_replacement(const_fn(mean)),
           "zero": numpy_replacement(const_fn(zero))}
    return out, fns


def r2_curve(wd: Path, L: LayerData, ds: list[int], args, verdict: dict) -> list[dict]:
    """Held-out R^2 of the layer's output against d: one block per method, and the per-head blocks per method and
    with the reduction chosen by CV (the verdict's own fits where d is its --head-d and --layer-d)."""
    Yte = L.targets(slice(L.D, 2 * L.D))[1]
    out = []
    for d in ds:
        if d == args.head_d == args.layer_d:
            out.append({"d": d, **{f"layer_{m}": r for m, r in verdict["layer_by_method"].items()},
                        **{f"blocks_{m}": r for m, r in verdict["blocks_by_method"].items()},
                        "blocks_cv": verdict["rows"]["blocks"]["r2"]})
            continue
        chosen, every = fit_blocks(wd, L, d, args, train_pred=False)
        _, layer_parts = fit_layer_block(wd, L, d, args)
        out.append({"d": d, **{f"layer_{m}": p.r2 for m, p in layer_parts.items()},
                    **{f"blocks_{m}": r2(Yte, sum_through(ps, L.W_O)) for m, ps in every.items()},
                    "blocks_cv": r2(Yte, sum_through(chosen, L.W_O))})
    return out


def safe(rep: dict) -> tuple[bool, list[str]]:
    """(whether an mhla row keeps the embeddings by the threshold, the rows that do) of one layer's judged rows."""
    ok = [k for k, _ in VERDICT_ROWS
          if rep[k]["mean_cosine"] >= SAFE_MEAN_COSINE and rep[k]["spearman"] >= SAFE_SPEARMAN]
    return any(k in MHLA_ROWS for k in ok), ok


def verdict_table(verdicts: list[dict], judged: list[dict] | None) -> str:
    """Markdown: per layer the six rows side by side (held-out R^2; back in the model when judged; the cost)."""
    head = ("layer", "replaced by", "held-out R^2", "mean cosine", "worst cosine", "Spearman", "fit seconds",
            "training positions")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, v in enumerate(verdicts):
        for key, name in VERDICT_ROWS:
            row = v["rows"][key]
            j = judged[i][key] if judged else None
            emb = (f"{j['mean_cosine']:.4f} | {j['min_cosine']:.4f} | {j['spearman']:.4f}" if j else "- | - | -")
            lines.append(f"| {v['layer']} | {name} | {row['r2']:.4f} | {emb} | {row['seconds']:.1f} | "
                         f"{row['positions']} |")
    return "\n".join(lines)


def safe_lines(verdicts: list[dict], judged: list[dict]) -> list[str]:
    """One line per layer: safe to replace (an mhla row clears the threshold), and whether the affine map does."""
    names = dict(VERDICT_ROWS)
    out = []
    for v, j in zip(verdicts, judged):
        ok, rows = safe(j)
        mh = [names[k] for k in rows if k in MHLA_ROWS]
        line = f"layer {v['layer']}: safe to replace: {'yes' if ok else 'no'}"
        line += f" ({', '.join(mh)})" if ok else ""
        if "affine" in rows and not ok:
            line += "; NBL's affine map clears it and mhla does not"
        elif "affine" in rows:
            line += "; NBL's affine map clears it too"
        out.append(line)
    return out


def reductions_table(verdicts: list[dict]) -> str:
    """Markdown: held-out R^2 of the layer's output per reduction, and the reductions the CV chose."""
    methods = list(verdicts[0]["blocks_by_method"]) if verdicts else []
    head = ("layer", *(f"blocks, {m}" for m in methods), "blocks, chosen by CV",
            *(f"one block, {m}" for m in LAYER_METHODS), "one block chosen by CV")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in verdicts:
        counts = ", ".join(f"{v['head_methods'].count(m)} {m}" for m in methods)
        cells = [f"{v['blocks_by_method'][m]:.4f}" for m in methods]
        cells += [f"{v['rows']['blocks']['r2']:.4f} ({counts})"]
        cells += [f"{v['layer_by_method'][m]:.4f}" for m in LAYER_METHODS] + [v["layer_method"]]
        lines.append(f"| {v['layer']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curve_table(curve: list[dict]) -> str:
    keys = [*(f"blocks_{m}" for m in HEAD_METHODS if f"blocks_{m}" in curve[0]), "blocks_cv",
            *(f"layer_{m}" for m in LAYER_METHODS)]
    lines = ["| d | " + " | ".join(k.replace("_", ", ") for k in keys) + " |", "|---|" + "---|" * len(keys)]
    for r in curve:
        lines.append(f"| {r['d']} | " + " | ".join(f"{r[k]:.4f}" for k in keys) + " |")
    return "\n".join(lines)


def curve_axes(ax, curve: list[dict], affine: float, layer: int) -> None:
    """Held-out R^2 of the layer's output against d, one line per reduction; NBL's affine map as a level."""
    ds = [r["d"] for r in curve]
    for key, style in [*((f"layer_{m}", "--") for m in LAYER_METHODS),
                       *((f"blocks_{m}", "-") for m in HEAD_METHODS if f"blocks_{m}" in curve[0]), ("blocks_cv", "-")]:
        kind, m = key.split("_")
        label = f"{'per-head blocks' if kind == 'blocks' else 'one block'}, {'CV choice' if m == 'cv' else m}"
        ax.plot(ds, [r[key] for r in curve], style, marker="o", ms=3, lw=2.2 if m == "cv" else 1.2, label=label)
    ax.axhline(affine, color="black", lw=1, ls=":", label="NBL's affine map")
    ax.set_xlabel("d (token directions per block)")
    ax.set_ylabel("held-out R$^2$ of the layer's output")
    ax.set_title(f"layer {layer}", fontsize=9)
    ax.legend(fontsize=6)
