"""Each attention layer of a real transformer as one sum of per-head MHLA blocks, fitted jointly on the layer's output.

The model, texts, windows and split are those of examples/real_model.py and examples/head_survey.py (whose capture
this imports): all-MiniLM-L6-v2 (6 layers of 12 heads of 32 dimensions, hidden size 384) on the licence texts of
/usr/share/common-licenses. For each layer, block h of the sum reads the layer's input tokens through the d
directions that keep head h's own W_Q x, W_K x and W_V x over the training tokens (`mhla reduce --method weights`
with that head's 3 x 32 rows of the model's weights: mhla_cli.model.directions.weight_directions); the 12 blocks and
the affine map of the full token [x_t, 1] are fitted jointly, in closed form, on the layer's full 384-dim attention
output (W_O times the 12 heads, before b_O, the residual and LayerNorm) at every position of the training windows:
`mhla_cli.block_statistics(..., affine=True, folds=5)`, `mhla_cli.certify`, `mhla_cli.fit(..., ridge="auto")`
(what `mhla fit DATA --blocks ... --affine --ridge auto` does). Beside it, on the same windows: NBL's affine map of
the full token alone (numpy, the ridge by CV). Both are scored by held-out R^2 of the layer's output at every
position of the held-out texts and, spliced into the model in place of the layer's attention output
(mhla_cli.model.splice, judged by mhla_cli.model.judge), by the mean and worst cosine of the sentence embeddings
and the Spearman of the pair similarities on held-out windows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/: the other examples beside this file

from head_survey import capture_layers  # noqa: E402
from real_model import (  # noqa: E402
    HELDOUT_TEXTS, LICENSES, N_FOLDS, QUICK_STRIDE, TRAIN_TEXTS, accumulate, affine_features, affine_fn,
    length_batches, load_model, numpy_replacement, predict_rows, r2, read_texts, replace, replacement_windows,
    ridge_cv, text_windows)

import mhla_cli  # noqa: E402
from mhla_cli.model.directions import weight_directions  # noqa: E402
from mhla_cli.samples import ReadSpec  # noqa: E402

ROWS = (("blocks", "12 per-head MHLA blocks + affine map, fitted jointly"), ("nbl", "NBL's affine map"))


def head_maps(model, layer: int, X: np.ndarray, d: int) -> list[np.ndarray]:
    """Head h's d token directions: those that keep [W_Q; W_K; W_V] x of its rows in mean square over the tokens."""
    att = model.encoder.layer[layer].attention.self
    n_heads = model.config.num_attention_heads
    dh = model.config.hidden_size // n_heads
    C = np.zeros((X.shape[1], X.shape[1]))
    for a in range(0, X.shape[0], 1 << 15):
        x = np.asarray(X[a:a + (1 << 15)], dtype=np.float64)
        C += x.T @ x
    C /= X.shape[0]
    maps = []
    for h in range(n_heads):
        rows = slice(h * dh, (h + 1) * dh)
        W = np.vstack([m.weight.detach().double().numpy()[rows] for m in (att.query, att.key, att.value)])
        maps.append(weight_directions(W, C, d)[0])
    return maps


def layer_rows(wd: Path, model, train, test, li: int, d: int, folds: int) -> tuple[dict, dict]:
    """The joint fit of the layer's blocks and NBL's affine map: held-out R^2, seconds, positions; the fitted
    functions (a HeadsSum and the affine map)."""
    D = model.config.hidden_size
    Ytr = np.asarray(train.targets[li][:, D:], dtype=np.float64)
    Yte = np.asarray(test.targets[li][:, D:], dtype=np.float64)
    path = wd / f"train_L{li}.h5"
    t0 = time.perf_counter()
    mhla_cli.write_tokens(path, np.asarray(train.tokens[li], dtype=np.float64), offsets=train.offsets, targets=Ytr,
                          attention="bidirectional")
    maps = head_maps(model, li, train.tokens[li], d)
    stats = mhla_cli.block_statistics(path, maps, ReadSpec(normalize="length"), affine=True, folds=folds)
    cert = mhla_cli.certify(stats)
    fn = mhla_cli.fit(stats, ridge="auto")
    seconds = time.perf_counter() - t0
    path.unlink()
    pred = fn.predict(np.asarray(test.tokens[li], dtype=np.float64), test.offsets)
    t1 = time.perf_counter()
    lin = ridge_cv(accumulate(affine_features(train.windows(li)), Ytr, train.offsets, folds))
    nbl_seconds = time.perf_counter() - t1
    nbl = predict_rows(lin, affine_features(test.windows(li)), len(test.offsets) - 1)
    n = int(train.offsets[-1])
    rows = {"blocks": {"r2": r2(Yte, pred), "seconds": seconds, "positions": n, "features": stats.n_features,
                       "identifiable": bool(cert.identifiable), "ridge": float(fn.info["ridge"])},
            "nbl": {"r2": r2(Yte, nbl), "seconds": nbl_seconds, "positions": n, "features": D + 1,
                    "identifiable": None, "ridge": float(lin.ridge)}}
    return rows, {"blocks": fn, "nbl": numpy_replacement(affine_fn(lin, None, np.zeros(D)))}


def table(result: dict) -> str:
    lines = ["| layer | replaced by | features | held-out R^2 | mean cosine | worst cosine | Spearman | fit seconds |"
             " training positions |", "|---|---|---|---|---|---|---|---|---|"]
    for lay in result["layers"]:
        for key, name in ROWS:
            r = lay[key]
            j = r.get("judged", {})
            cells = [str(lay["layer"]), name, str(r["features"]), f"{r['r2']:.4f}"]
            cells += [f"{j[k]:.4f}" if j.get(k) is not None else "-" for k in ("mean_cosine", "min_cosine", "spearman")]
            cells += [f"{r['seconds']:.1f}", str(r["positions"])]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Each attention layer of a real transformer as one sum of per-head "
                                             "MHLA blocks (and the affine map), fitted jointly on its output.")
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="encoder layers (default: all)")
    ap.add_argument("--d", type=int, default=8, help="token directions of each head's block (default: 8)")
    ap.add_argument("--folds", type=int, default=N_FOLDS, help="cross-validation folds of the ridge (default: 5)")
    ap.add_argument("--stride", type=int, default=None, help="word pieces between window starts (default: 4; "
                                                             f"--quick: {QUICK_STRIDE})")
    ap.add_argument("--max-windows", type=int, default=None, help="at most this many windows per split")
    ap.add_argument("--quick", action="store_true", help="a short run: fewer windows, d = 2, layer 1")
    ap.add_argument("--texts", type=Path, default=LICENSES, help="folder of the licence texts")
    ap.add_argument("--replace-windows", type=int, default=300,
                    help="held-out windows the layer is replaced on in the model (default: 300)")
    ap.add_argument("--no-replace", action="store_true", help="only R^2: no replacement in the model")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.quick:
        args.d = 2 if args.d == 8 else args.d
        args.layers = args.layers or [1]
        args.max_windows = args.max_windows or 120
        args.replace_windows = min(args.replace_windows, 20)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    stride = args.stride if args.stride is not None else (QUICK_STRIDE if args.quick else 4)
    t0 = time.perf_counter()
    tokenizer, model = load_model()
    layers = args.layers if args.layers is not None else list(range(model.config.num_hidden_layers))
    grab = dict(stride=stride, min_len=8, max_len=32, max_windows=args.max_windows)
    result: dict = {"d": args.d, "layers": []}
    with tempfile.TemporaryDirectory(prefix="mhla_layer_blocks_") as tmp:
        wd = Path(tmp)
        train = capture_layers(tokenizer, model, text_windows(tokenizer, read_texts(TRAIN_TEXTS, args.texts), **grab),
                               wd, "train")
        test = capture_layers(tokenizer, model, text_windows(tokenizer, read_texts(HELDOUT_TEXTS, args.texts), **grab),
                              wd, "heldout")
        picked = replacement_windows(len(test.window_ids), args.replace_windows)
        batches = length_batches(tokenizer, [test.window_ids[i] for i in picked])
        for li in layers:
            rows, fns = layer_rows(wd, model, train, test, li, args.d, args.folds)
            if not args.no_replace:
                judged = replace(model, batches, li, None, fns)
                for key in fns:
                    rows[key]["judged"] = judged[key]
            result["layers"].append({"layer": li, **rows})
            print(f"  layer {li}: {rows['blocks']['seconds'] + rows['nbl']['seconds']:.0f} s", file=sys.stderr)
        result.update({"n_train_windows": len(train.window_ids), "n_heldout_windows": len(test.window_ids),
                       "n_replaced_windows": 0 if args.no_replace else len(picked),
                       "seconds": time.perf_counter() - t0})
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"all-MiniLM-L6-v2, each layer's attention output (384-dim) at every position of "
              f"{result['n_heldout_windows']} held-out windows; {result['n_train_windows']} training windows; blocks "
              f"of d = {args.d} on each head's W_Q, W_K, W_V directions; back in the model: "
              f"{result['n_replaced_windows']} held-out windows")
        print(table(result))
        print(f"{result['seconds']:.0f} s")
    return result


if __name__ == "__main__":
    main()
