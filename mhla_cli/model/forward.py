"""The MHLA forward pass: last-token and all-position outputs, from coef p or from heads.

Above ~500 lines because the in-memory pass and `predict_file` (the same pass streamed over a tokens
file: chunks, workers, the device, the scores) are one job with one set of evaluation rules (the
canonical coordinates, normalisation, causal outputs); split, each half would import the other's
private helpers.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import h5py
import numpy as np

from ..io import formats
from ..linalg.backends import get_backend
from ..linalg.device import check_device, worker_device
from ..errors import InputError
from ..feature_map import check_normalize, d_of_psi, features_from_moments
from .heads import Heads
from ..numerics import EPS
from .model import Model, affine_of, attention_of, bias_terms_of, coef_of, evaluation_of, normalize_of
from ..statistics.affine_sums import WideSource, affine_rows
from ..statistics.parallel import SerialMap, ThreadMap, make_map
from .scores import Spread
from ..samples import BIDIRECTIONAL, CAUSAL, LAST, Samples, samples_of
from ..statistics.stream import default_chunk_size, sequence_moments
from ..io.tokens import (
    TokensInfo,
    check_finite,
    check_weights,
    inspect_tokens,
    iter_chunks,
    read_as,
    spans,
    with_bias_terms,
)
from ..bias_terms import with_constant


def forward_heads(V: np.ndarray, Q: np.ndarray, X: np.ndarray, all_positions: bool = False,
                  normalize: str = "none") -> np.ndarray:
    """Reference forward pass of one sequence X (n, d): sum_h V_h X^T X Q_h x_t (t = n, or every t).

    normalize="length" uses S = X^T X / n.
    """
    X = np.asarray(X, dtype=np.float64)
    S = X.T @ X
    if normalize == "length":
        S = S / X.shape[0]
    if all_positions:
        return np.einsum("hab,bc,hcl,tl->ta", V, S, Q, X, optimize=True)
    return np.einsum("hab,bc,hcl,l->a", V, S, Q, X[-1], optimize=True)


class HeadsFn(tuple):
    """Heads (V (H, d_out, d), Q (H, d, d)) evaluated directly, sum_h V_h S Q_h x (O(H d^2) per
    sequence after S), instead of through coef (d_out, psi): for heads whose outputs have another
    width than the tokens (mhla export-heads --unreduce), or whose coef would not fit (`direct`)."""

    @property
    def shape(self) -> tuple[int, int]:  # (outputs, tokens) widths, like coef's (d, psi) first axis
        return int(self[0].shape[1]), int(self[0].shape[2])


# Heads whose coef (d_out, psi) would exceed this are evaluated directly (HeadsFn).
DIRECT_COEF_BYTES = 256 << 20
# Bytes of the per-sequence S (B, d, d) of a chunk evaluated directly (predict_file's default chunk).
DIRECT_CHUNK_BYTES = 32 << 20


def direct(fn: Model | Heads | np.ndarray) -> HeadsFn | None:
    """`fn` as a HeadsFn when it is heads that are rectangular (d_out != d) or too wide for a coef."""
    if not isinstance(fn, Heads):
        return None
    V, Q = (np.asarray(a, dtype=np.float64) for a in fn.augmented())  # with bias terms: of the tokens (x, 1)
    d_out, d = V.shape[1], Q.shape[1]
    if fn.bias_terms or d_out != d or 8 * d_out * (d * d * (d + 1) // 2) > DIRECT_COEF_BYTES:
        return HeadsFn((V, Q))
    return None


def function_of(fn: Model | Heads | np.ndarray) -> np.ndarray | HeadsFn:
    """What the chunk kernels evaluate: coef (d, psi), or the heads themselves (`direct`); with the bias
    terms, of the tokens (x, 1) and without the padded output (`_outputs`)."""
    h = direct(fn)
    return _outputs(fn, coef_of(fn)) if h is None else h


def evaluated(fn: Model | Heads | np.ndarray) -> tuple[np.ndarray | HeadsFn, np.ndarray | None]:
    """(what the kernels evaluate, A): a model's canonical coef with its basis A (tokens X A;
    Model.evaluation), or the heads themselves (`direct`, A None)."""
    h = direct(fn)
    if h is not None:
        return h, None
    coef, A = evaluation_of(fn)
    return _outputs(fn, coef), A


def _outputs(fn: Model | Heads | np.ndarray, coef: np.ndarray) -> np.ndarray:
    """coef without the bias terms' padded output (its last row, exactly 0: mhla_cli.bias_terms), for a model
    fitted with them; coef itself otherwise."""
    return coef[:-1] if bias_terms_of(fn) else coef


def out_width(fn: np.ndarray | HeadsFn) -> int:
    """Width of the outputs of a coef or HeadsFn."""
    return int(fn.shape[0])


def in_width(fn: np.ndarray | HeadsFn) -> int:
    """Width of the tokens a coef (d_out, psi) or HeadsFn takes."""
    return int(fn.shape[1]) if isinstance(fn, HeadsFn) else d_of_psi(int(fn.shape[1]))


def _chunk_moments(tokens: np.ndarray, offsets: np.ndarray, d: int, normalize: str) -> tuple[np.ndarray, np.ndarray]:
    """(S (B, d, d), last tokens (B, d)) of a chunk for a model of width d (S / n with normalize="length")."""
    if tokens.shape[1] != d:
        raise InputError(f"the model has d = {d} but the data have d = {tokens.shape[1]}")
    S, last = sequence_moments(tokens, offsets)
    if normalize == "length":
        S /= np.diff(np.asarray(offsets, dtype=np.int64)).astype(np.float64)[:, None, None]
    return S, last


def heads_chunk(fn: HeadsFn, tokens: np.ndarray, offsets: np.ndarray, all_positions: bool = False,
                normalize: str = "none") -> tuple[np.ndarray, np.ndarray | None]:
    """`predict_chunk` of heads evaluated directly: last-token outputs (B, d_out), every position's (t, d_out)."""
    V, Q = fn
    d = Q.shape[1]
    S, last = _chunk_moments(tokens, offsets, d, normalize)
    # sum_h V_h (S (Q_h x)): per head, matrix-vector products
    qx = np.einsum("hcl,bl->bhc", Q, last, optimize=True)
    sqx = np.einsum("bjc,bhc->bhj", S, qx, optimize=True)
    pred = np.einsum("haj,bhj->ba", V, sqx, optimize=True)
    outputs = sample_outputs(fn, tokens, offsets, BIDIRECTIONAL, normalize) if all_positions else None
    return pred, outputs


def predict_chunk(coef: np.ndarray | HeadsFn, tokens: np.ndarray, offsets: np.ndarray,
                  all_positions: bool = False, normalize: str = "none",
                  device: str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Predictions for a chunk: last-token outputs (B, d) and, if asked, every position's (t, d).

    normalize="length" divides each sequence's S by its length (as the model was fitted). `device`
    (mhla_cli.linalg.device): the last-token outputs computed there (every position's stay on the CPU).
    `coef` may be a HeadsFn (heads evaluated directly, on the CPU: `heads_chunk`).
    """
    if isinstance(coef, HeadsFn):
        return heads_chunk(coef, tokens, offsets, all_positions, normalize)
    S, last = _chunk_moments(tokens, offsets, in_width(coef), normalize)
    pred = get_backend(device).last_outputs(coef, S, last)
    outputs = sample_outputs(coef, tokens, offsets, BIDIRECTIONAL, normalize) if all_positions else None
    return pred, outputs


def sample_outputs(coef: np.ndarray | HeadsFn, tokens: np.ndarray, offsets: np.ndarray, samples: Samples,
                   normalize: str = "none", progress: Callable[[int], None] | None = None) -> np.ndarray:
    """The output at every sample of a chunk (R, d_out) for the layout `samples` (mhla_cli.samples): sample r
    reads its (S, x) pair (`Samples.queries`) and outputs M(S) x, M(S)[a, l] = sum_{j<=k} p[a,(j,k,l)] S[j,k]
    (heads: sum_h V_h S Q_h). CAUSAL: row t is the last-token output p . H(X[:t]) of its prefix;
    BIDIRECTIONAL: the output at position t with the whole window's S; LAST: one row per sequence.

    In blocks of whole sequences (about OUTPUT_BLOCKS per chunk, at most OUTPUT_BLOCK_ROWS tokens each
    unless one sequence is longer: every row is its own sample's, so the blocks change no value and bound
    the (rows, d, d) work arrays). `progress(k)`, if given, is told the number k of sequences done after
    each block."""
    d = in_width(coef)
    if tokens.shape[1] != d:
        raise InputError(f"the model has d = {d} but the data have d = {tokens.shape[1]}")
    offsets = np.asarray(offsets, dtype=np.int64)
    B = offsets.size - 1
    npairs = d * (d + 1) // 2
    heads = isinstance(coef, HeadsFn)
    d_out = out_width(coef)
    if not heads:
        P = np.asarray(coef, dtype=np.float64).reshape(d_out, npairs, d).transpose(1, 0, 2).reshape(npairs, d_out * d)
    else:
        from ..linalg.symgram import pair_positions

        V, Q = coef
        full = pair_positions(d)  # S[j, k] from its upper entries
    outs = []
    for s, e in _blocks(offsets):
        r0, r1 = int(offsets[s]), int(offsets[e])
        q = samples.queries(tokens[r0:r1], offsets[s:e + 1] - r0, normalize)
        if heads:  # sum_h V_h (S (Q_h x)) row by row: no (rows, d_out, d) array
            S = q.sample_upper()[:, full]
            qx = np.einsum("hcl,rl->rhc", Q, q.x, optimize=True)
            outs.append(np.einsum("haj,rhj->ra", V, np.einsum("rjc,rhc->rhj", S, qx, optimize=True), optimize=True))
        else:
            M = (q.upper @ P).reshape(-1, d_out, d)
            outs.append(np.einsum("tal,tl->ta", M if q.group is None else M[q.group], q.x))
        if progress is not None:
            progress(e)
    return np.concatenate(outs) if outs else np.empty((0, out_width(coef)))


def _blocks(offsets: np.ndarray) -> list[tuple[int, int]]:
    """`sample_outputs`'s blocks of whole sequences [s, e): about OUTPUT_BLOCKS, each at most
    OUTPUT_BLOCK_ROWS tokens unless one sequence is longer."""
    B = offsets.size - 1
    ends = np.searchsorted(offsets, np.linspace(0, offsets[-1], OUTPUT_BLOCKS + 1)[1:-1], side="right") - 1
    cut = [0]
    for e in [*np.unique(ends[(ends > 0) & (ends < B)]).tolist(), B]:
        while offsets[e] - offsets[cut[-1]] > OUTPUT_BLOCK_ROWS and cut[-1] + 1 < e:
            nxt = int(np.searchsorted(offsets, offsets[cut[-1]] + OUTPUT_BLOCK_ROWS, side="right")) - 1
            cut.append(max(nxt, cut[-1] + 1))
        if e > cut[-1]:
            cut.append(e)
    return list(zip(cut[:-1], cut[1:]))


def causal_chunk(coef: np.ndarray | HeadsFn, tokens: np.ndarray, offsets: np.ndarray, normalize: str = "none",
                 progress: Callable[[int], None] | None = None) -> np.ndarray:
    """Causal outputs (t, d) of a chunk: row t is the last-token output p . H(X[:t]) of its prefix
    (`sample_outputs` of CAUSAL samples)."""
    return sample_outputs(coef, tokens, offsets, CAUSAL, normalize, progress)


# sample_outputs' blocks: about this many per chunk (a progress bar's steps), and at most this many
# tokens each unless one sequence is longer (its (rows, d, d) work array: 32 MiB at d = 16)
OUTPUT_BLOCKS = 16
OUTPUT_BLOCK_ROWS = 1 << 14


def as_ragged(tokens: np.ndarray, offsets: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """tokens (N, n, d) -> ((N n, d), offsets); tokens (T, d) need `offsets` (N+1,)."""
    tokens = np.asarray(tokens)
    if tokens.ndim == 3:
        N, n, d = tokens.shape
        return tokens.reshape(-1, d), np.arange(N + 1, dtype=np.int64) * n
    if offsets is None:
        raise InputError("tokens of shape (T, d) need offsets")
    return tokens, np.asarray(offsets, dtype=np.int64)


def predict_causal(fn: Model | Heads | np.ndarray, tokens: np.ndarray, offsets: np.ndarray | None = None
                   ) -> np.ndarray:
    """In-memory causal outputs (T, d) (tokens (N, n, d), or (T, d) with offsets); the model's normalisation."""
    return predict_samples(fn, tokens, offsets, CAUSAL)


def predict_samples(fn: Model | Heads | np.ndarray, tokens: np.ndarray, offsets: np.ndarray | None = None,
                    samples: Samples | None = None, wide: np.ndarray | None = None) -> np.ndarray:
    """In-memory outputs at every sample of `samples` (mhla_cli.samples; None: the layout `fn` was fitted on,
    `fitted_samples`): (N, d) for LAST, (T, d) for CAUSAL and BIDIRECTIONAL (tokens (N, n, d), or (T, d)
    with offsets); the model's normalisation. `wide`: the wide tokens (T, D) (or (N, n, D)) of a function with
    the token-wise affine map of them (mhla_cli.solve.affine_block)."""
    tokens, offsets = as_ragged(_tokens_of(fn, tokens), offsets)
    coef, A = evaluated(fn)
    samples = samples or fitted_samples(fn)
    out = sample_outputs(coef, in_basis(tokens, A), offsets, samples, normalize_of(fn))
    return _with_affine(fn, out, wide, offsets, samples.per_position)


def _with_affine(fn: Model | Heads | np.ndarray, out: np.ndarray, wide: np.ndarray | None, offsets: np.ndarray,
                 per_position: bool) -> np.ndarray:
    """out plus the token-wise affine map of the wide tokens `wide` at every row's query (every token, or the last
    of each sequence), for a function that has one (`affine_of`); out itself otherwise (`wide` refused then)."""
    affine = affine_of(fn)
    if affine is None:
        if wide is not None:
            raise InputError("wide tokens were given but the function has no affine map of them")
        return out
    if wide is None:
        raise InputError(f"the function adds an affine map of the wide tokens (width {affine.shape[1] - 1}): give them "
                         "(wide=, or --affine-from)")
    wide = np.asarray(wide, dtype=np.float64)
    wide = wide.reshape(-1, wide.shape[-1])
    if wide.shape != (int(offsets[-1]), affine.shape[1] - 1):
        raise InputError(f"the wide tokens have shape {wide.shape}, expected "
                         f"({int(offsets[-1])}, {affine.shape[1] - 1})")
    return out + affine_rows(wide, offsets, CAUSAL if per_position else LAST) @ affine.T


def _tokens_of(fn: Model | Heads | np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The tokens `fn` evaluates: (x, 1) for a function with the bias terms (mhla_cli.bias_terms), else x."""
    return with_constant(tokens) if bias_terms_of(fn) else np.asarray(tokens)


def fitted_samples(fn: Model | Heads | np.ndarray) -> Samples:
    """The layout a model or heads were fitted on, as their `attention` records it: BIDIRECTIONAL or CAUSAL
    for per-position fits, LAST otherwise (files without it)."""
    att = attention_of(fn)
    return LAST if att is None else samples_of(True, att)


def predict(fn: Model | Heads | np.ndarray, tokens: np.ndarray, offsets: np.ndarray | None = None,
            all_positions: bool = False, device: str | None = None, wide: np.ndarray | None = None
            ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """In-memory prediction. tokens (N, n, d), or (T, d) with offsets (N+1,); the model's normalisation.
    `device` (mhla_cli.linalg.device): the last-token outputs computed there. `wide`: the wide tokens of a function
    with the affine map of them (`predict_samples`)."""
    coef, A = evaluated(fn)
    tokens, offsets = as_ragged(_tokens_of(fn, tokens), offsets)
    pred, outputs = predict_chunk(coef, in_basis(tokens, A), offsets, all_positions,
                                  normalize_of(fn), device=check_device(device))
    pred = _with_affine(fn, pred, wide, offsets, False)
    if outputs is not None:
        outputs = _with_affine(fn, outputs, wide, offsets, True)
    return (pred, outputs) if all_positions else pred


def in_basis(tokens: np.ndarray, A: np.ndarray | None) -> np.ndarray:
    """The tokens X A a model evaluates (Model.evaluation); X itself for A None."""
    if A is None:
        return tokens
    return np.asarray(tokens, dtype=np.float64) @ A


def scored(pred: np.ndarray, targets: np.ndarray, weights: np.ndarray | None) -> tuple[int, Spread]:
    """(#{i: w_i > 0}, the Spread of the targets with the squared error of `pred`: sum_i w_i ||pred_i -
    y_i||^2, scale-free) over the rows (B, d); w_i = 1 without weights."""
    count = targets.shape[0] if weights is None else int((weights > 0).sum())
    return count, Spread.of(targets, weights, err=np.asarray(pred, dtype=np.float64) - targets)


def positions_span(coef: np.ndarray | HeadsFn, info: Any, samples: Samples, normalize: str, span: tuple[int, int],
                   progress: Callable[[int], None] | None = None, basis: np.ndarray | None = None,
                   affine: tuple[WideSource, np.ndarray] | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, Spread]:
    """Outputs at every position of samples [lo, hi) in the layout `samples` (CAUSAL or BIDIRECTIONAL:
    `sample_outputs`): (pred (B, d), outputs (t, d), offsets, count, the scored targets' Spread: their
    weight, spread and weighted SSE, for the MSE and R^2). pred is the output at each sequence's last
    position (its last-token output in either layout).

    The SSE is sum_t w_t ||out_t - y_t||^2 over positions with w_t > 0 (per-position targets) or
    over sequences (last-token targets, pred vs y); count is the number of those samples, weight
    the sum of their weights. `basis`: the tokens X basis are evaluated (Model.evaluation).
    `progress(n)`, if given, is told the sequences done as the blocks of `sample_outputs` finish (they
    sum to hi - lo).
    """
    done = [0]

    def step(k: int) -> None:
        progress(k - done[0])  # type: ignore[misc]
        done[0] = k

    lo, hi = span
    for a, _b, tokens, offsets, targets, weights in iter_chunks(info, (lo, hi), hi - lo, prefetch=False,
                                                                with_weights=True):
        check_finite(tokens, offsets, targets, a, info.path)
        check_weights(weights, offsets, a, info.per_position, info.path)
        outputs = sample_outputs(coef, in_basis(tokens, basis), offsets, samples, normalize,
                                 progress=None if progress is None else step)
        if affine is not None:  # the affine map of the wide tokens at every position
            outputs = outputs + _affine_span(affine, a, offsets)
        pred = outputs[offsets[1:] - 1]
        count, spread = 0, Spread()
        if targets is not None:
            count, spread = scored((outputs if info.per_position else pred), targets, weights)
        return pred, outputs, offsets.copy(), count, spread
    raise ValueError("empty span")


def _affine_span(affine: tuple[WideSource, np.ndarray], a: int, offsets: np.ndarray) -> np.ndarray:
    """The affine map (d_out, D + 1) of the wide tokens at every token of the span starting at sample `a` with
    `offsets` (T, d_out), read from the wide source in lockstep."""
    wide, C = affine
    span = (a, a + offsets.size - 1)
    chunk = next(wide.chunks(span, span[1] - span[0], prefetch=False))
    return wide.rows(chunk, a, offsets, CAUSAL) @ C.T


def causal_span(coef: np.ndarray | HeadsFn, info: Any, normalize: str, span: tuple[int, int],
                progress: Callable[[int], None] | None = None, basis: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, Spread]:
    """`positions_span` of CAUSAL samples (the prefix outputs of `predict --causal`)."""
    return positions_span(coef, info, CAUSAL, normalize, span, progress, basis)


def _one_at_a_time(progress: Callable[[int], None]) -> Callable[[int], None]:
    """`progress` for worker threads: one call at a time, and never again once it raised (an interrupt)."""
    lock, raised = threading.Lock(), []

    def call(n: int) -> None:
        with lock:
            if raised:
                return
            try:
                progress(n)
            except BaseException:
                raised.append(True)
                raise
    return call


def _function_and_data(fn: Model | Heads, data: str | os.PathLike
                       ) -> tuple[np.ndarray | HeadsFn, str, TokensInfo]:
    """coef (own coordinates; or a HeadsFn) and normalisation of `fn`, and the layout of the tokens file
    `data` (same d checked, and the targets' width against the outputs')."""
    coef = function_of(fn)
    normalize = check_normalize(normalize_of(fn))
    info = inspect_tokens(data)
    if bias_terms_of(fn):  # the function of the tokens (x, 1): the reader appends the constant
        info = with_bias_terms(info, pad_targets=False)
    if info.d != in_width(coef):
        raise InputError(f"the data have d = {info.d} but the model has d = {in_width(coef)}", data)
    if info.has_targets and info.out_dim != out_width(coef):
        raise InputError(f"the targets are {info.out_dim} wide but the model's outputs {out_width(coef)}: map the "
                         "targets as the model's were (mhla reduce --like)", data)
    return coef, normalize, info


@dataclasses.dataclass
class Predictions:
    """What `predict_file` returns: the counts, and the MSE / R^2 when the data have targets it scores;
    the arrays only when nothing was written (`out` None). `to_dict` is the `mhla predict --json` record
    (without `output`)."""

    n_samples: int
    d: int
    normalize: str
    predictions: np.ndarray | None = dataclasses.field(default=None, repr=False)  # (N, d), without `out`
    outputs: np.ndarray | None = dataclasses.field(default=None, repr=False)  # (T, d): all_positions / causal
    offsets: np.ndarray | None = dataclasses.field(default=None, repr=False)  # (N + 1,) of `outputs`
    mse: float | None = None
    r2: float | None = None  # None also when the scored targets do not vary (mhla_cli.model.scores)
    n_scored: int | None = None  # None: no targets scored (and no mse / r2)

    def __repr__(self) -> str:
        score = "" if self.n_scored is None else f", mse={self.mse:.4g}, r2={self.r2}, n_scored={self.n_scored}"
        return f"Predictions(n_samples={self.n_samples}, d={self.d}, normalize={self.normalize!r}{score})"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"n_samples": self.n_samples, "d": self.d, "normalize": self.normalize}
        if self.predictions is not None:
            out["predictions"] = self.predictions
        if self.outputs is not None:
            out["outputs"], out["offsets"] = self.outputs, self.offsets
        if self.n_scored is not None:
            out.update(mse=self.mse, r2=self.r2, n_scored=self.n_scored)
        return out


def _predict_chunk_size(coef: np.ndarray | HeadsFn, info: TokensInfo, chunk_size: int | None) -> int:
    """The chunk of `predict_file`: the streaming default, or for heads evaluated directly one whose
    per-sequence S (B, d, d) and outputs stay within DIRECT_CHUNK_BYTES."""
    if chunk_size:
        return chunk_size
    if isinstance(coef, HeadsFn):
        mean_len = max(1.0, info.n_tokens / info.n_samples)
        return int(max(1, min(info.n_samples, DIRECT_CHUNK_BYTES // (8 * info.d * (info.d + mean_len)))))
    return default_chunk_size(info)


def _sinks(target: h5py.File | None, info: TokensInfo, d: int, with_outputs: bool) -> tuple[Any, Any, Any]:
    """Where the spans' (predictions, outputs, offsets) go: datasets of the output file `target`, or arrays
    (None for the outputs without `with_outputs`); both take slice assignment."""
    if target is None:
        return (np.empty((info.n_samples, d)), np.empty((info.n_tokens, d)) if with_outputs else None,
                np.zeros(info.n_samples + 1, dtype=np.int64) if with_outputs else None)
    dp = target.create_dataset("predictions", (info.n_samples, d), dtype="f8")
    if not with_outputs:
        return dp, None, None
    do = target.create_dataset("outputs", (info.n_tokens, d), dtype="f8")
    doff = target.create_dataset("offsets", (info.n_samples + 1,), dtype="i8")
    doff[0] = 0
    return dp, do, doff


def _predict_spans(task: Callable[[tuple[int, int]], tuple], todo: list[tuple[int, int]], pmap: Any,
                   sinks: tuple[Any, Any, Any], progress: Callable[[int], None] | None
                   ) -> tuple[int, Spread]:
    """Run `task` over the spans `todo` with `pmap`, writing each span's rows into `sinks` in order
    (`_sinks`); the summed count and merged Spread (with the SSE). `progress(n)` is told each span's samples."""
    count, spread = 0, Spread()
    dp, do, doff = sinks
    tok_pos = 0
    for (a, b), (pred, outputs, offsets, part_n, part_spread) in zip(todo, pmap(task, todo)):
        count += part_n
        spread = spread.merge(part_spread)
        dp[a:b] = pred
        if do is not None:
            do[tok_pos:tok_pos + outputs.shape[0]] = outputs
            doff[a + 1:b + 1] = tok_pos + offsets[1:]
        tok_pos += int(offsets[-1])
        if progress is not None:
            progress(b - a)
    return count, spread


def _span_task(coef: np.ndarray | HeadsFn, info: TokensInfo, pmap: Any, normalize: str, samples: Samples | None,
               device: str | None, basis: np.ndarray | None,
               progress: Callable[[int], None] | None, affine: tuple[WideSource, np.ndarray] | None = None
               ) -> tuple[Callable[[tuple[int, int]], tuple], bool]:
    """The per-span task of `predict_file` under `pmap` (outputs at every position of `samples`, or None:
    the last-token predictions only), and whether it tells `progress` itself (its blocks as they finish)
    rather than `_predict_spans` each span as it comes back."""
    # workers open the file themselves: give them an absolute path
    winfo = info if pmap.n_workers == 1 else dataclasses.replace(info, path=os.path.abspath(info.path))
    if affine is not None and pmap.n_workers > 1:
        w = affine[0]
        affine = (dataclasses.replace(w, info=dataclasses.replace(w.info, path=os.path.abspath(w.info.path))),
                  affine[1])
    if samples is None:
        return partial(predict_span, coef, winfo, False, normalize=normalize, device=device, basis=basis,
                       affine=affine), False
    # outputs at every position take long per span: in this process (serial or threads; `progress` None
    # for a caller's map) each span tells its blocks as they finish, one call at a time
    ticks = progress is not None and isinstance(pmap, (SerialMap, ThreadMap))
    return partial(positions_span, coef, winfo, samples, normalize,
                   progress=_one_at_a_time(progress) if ticks else None, basis=basis, affine=affine), ticks


def _write_predictions(out: str | os.PathLike, inputs: tuple[str | os.PathLike, ...], meta: dict[str, Any],
                       run: Callable[[h5py.File], Any]) -> Any:
    """`run(file)` on a new predictions file written atomically at `out` (its header naming `inputs`,
    the data first, and the attributes `meta`); what run returns."""
    formats.check_hdf5_suffix(out, "a predictions file")
    o = formats.check_output_path(out, inputs)
    with formats.atomic_path(o) as tmp:
        with formats.create_output(tmp) as fout:
            for k, v in {**formats.header("predictions", inputs), **meta}.items():
                fout.attrs[k] = v
            return run(fout)


def predict_file(fn: Model | Heads, data: str | os.PathLike, out: str | os.PathLike | None = None,
                 all_positions: bool = False, chunk_size: int | None = None,
                 progress: Callable[[int], None] | None = None,
                 inputs: tuple[str | os.PathLike, ...] = (), workers: int = 1,
                 map: Callable[..., Any] | None = None,  # noqa: A002
                 causal: bool = False, device: str | None = None,
                 affine_from: str | os.PathLike | None = None) -> Predictions:
    """Stream predictions over a tokens file; write them to `out` (atomically) if given.

    Returns a summary (n_samples, mse and r2 when the data have targets: mhla_cli.model.scores, weighted like
    the MSE, None when the targets do not vary); without `out` the summary also
    holds the `predictions` array (and `outputs`, `offsets` with `all_positions` or `causal`).
    `workers=K` predicts chunks in K local workers (or pass any ordered `map`); the output is the
    same as the serial one. The model's normalisation (attribute `normalize`) is applied.

    `causal`: `outputs` (T, d) holds the last-token output of every prefix X[:t] and `predictions`
    the one of every whole sequence; the MSE is over the weighted positions of per-position
    targets (sum w ||e||^2 / (d sum w)), or over the sequences of last-token targets. A model fitted
    on bidirectional samples (its `attention`, `fitted_samples`) writes `outputs` at every position
    with the whole window's S and scores them the same way (`causal` is then refused, and so are data
    whose `attention` attribute says causal); `all_positions` writes those outputs for any model
    (a model's own layout's, for a layout that `predicts_every_position`, mhla_cli.samples).
    Last-token targets with `weights` (N,) give the same weighted MSE with or without `causal`:
    sum_i w_i ||yhat_i - y_i||^2 / (d sum_i w_i) (fit's train_mse), `n_scored` = #{i: w_i > 0};
    weight-0 sequences are predicted but not scored. Without `causal`, per-position targets give no
    MSE (the predictions are per sequence; use `causal` to score every weighted position).
    `device` (mhla_cli.linalg.device): the last-token predictions on a torch device (float64).
    A function with the token-wise affine map of the wide tokens (mhla_cli.solve.affine_block) reads them from
    `affine_from`, the tokens file `mhla reduce` read to make `data` (checked), or from `data` itself when its
    tokens are that wide (heads put back in the model's coordinates by `export-heads --unreduce`).
    """
    device = check_device(device, data)
    affine = _affine_source(fn, data, affine_from)
    if all_positions and causal:
        raise InputError("causal and all_positions cannot be combined: causal is the masked (prefix) "
                         "output at every position, all_positions the unmasked one")
    fitted = fitted_samples(fn)
    if causal and fitted.predicts_every_position:
        raise InputError(f"the model was fitted on {fitted.name} samples ({fitted.words}): --causal would evaluate "
                         "it on prefixes; its outputs at every position are written without --causal")
    _, normalize, info = _function_and_data(fn, data)
    coef, A = evaluated(fn)  # evaluated where it was solved (Model.evaluation), or the heads directly
    d = out_width(coef)
    # the outputs at every position: of the prefixes (causal), with the whole window's S (all_positions), or
    # in the layout the model was fitted on
    samples = (CAUSAL if causal else BIDIRECTIONAL if all_positions and not fitted.predicts_every_position
               else fitted if fitted.predicts_every_position else None)
    scored = causal or fitted.predicts_every_position  # per-position targets are scored against those outputs
    if info.per_position and scored:
        info = read_as(info, samples.attention)  # data marked with the other attention: refused
    elif info.per_position:
        info = dataclasses.replace(info, has_targets=False)  # per-position targets: no per-sequence MSE
    if isinstance(coef, HeadsFn):
        device = None  # heads evaluated directly run on the CPU
    todo = spans(0, info.n_samples, _predict_chunk_size(coef, info, chunk_size))
    with_outputs = samples is not None

    def run(target: h5py.File | None) -> tuple[tuple[Any, Any, Any], tuple[int, Spread]]:
        sinks = _sinks(target, info, d, with_outputs)
        with make_map(workers=workers, map=map) as pmap:
            task, ticks = _span_task(coef, info, pmap, normalize, samples, device, A,
                                     progress if map is None else None, affine)
            return sinks, _predict_spans(task, todo, pmap, sinks, None if ticks else progress)

    if out is not None:
        meta = {"d": d, "n_samples": info.n_samples, "normalize": normalize, "causal": int(causal)}
        if samples is not None:
            meta["attention"] = samples.attention  # what the outputs at every position are
        _, (count, spread) = _write_predictions(out, (data, *inputs), meta, run)
        result = Predictions(info.n_samples, d, normalize)
    else:
        (pred, outs, offs), (count, spread) = run(None)
        result = Predictions(info.n_samples, d, normalize, predictions=pred, outputs=outs, offsets=offs)
    if info.has_targets:
        # weighted means over the scored samples' weights (sum w: units-free), the squares in the targets'
        # own scale (mhla_cli.model.scores.Spread: R^2 at any scale of the targets)
        result.mse = spread.mse(d)
        result.r2 = spread.r2()  # None when the scored targets do not vary (mhla_cli.model.scores)
        result.n_scored = count
    return result


def _affine_source(fn: Model | Heads, data: str | os.PathLike, affine_from: str | os.PathLike | None
                   ) -> tuple[WideSource, np.ndarray] | None:
    """(the wide tokens' source, the affine map (d_out, D + 1)) of a function with the affine map of the wide tokens,
    or None; a file given to a function without one, or none to one with it, is refused."""
    affine = affine_of(fn)
    if affine is None:
        if affine_from is not None:
            raise InputError("--affine-from was given but the function has no affine map of the wide tokens", data)
        return None
    D = affine.shape[1] - 1
    if affine_from is not None:
        wide = WideSource.open(affine_from, data)
    else:
        info = inspect_tokens(data)
        if info.d != D:
            raise InputError(f"the function adds an affine map of the wide tokens (width {D}): give the tokens file "
                             "that mhla reduce read to make this one (--affine-from WIDE.h5)", data)
        wide = WideSource(dataclasses.replace(info, has_targets=False, has_weights=False, samples=LAST, d_out=None), {})
    if wide.width != D:
        raise InputError(f"the wide tokens are {wide.width} wide but the function's affine map takes {D}", affine_from)
    return wide, affine


# --------------------------------------------------------------------------------------------
# rollout: autoregressive generation
# --------------------------------------------------------------------------------------------


def load_codebook(path: str | os.PathLike, d: int) -> np.ndarray:
    """The dataset `codebook` (C, d) of an HDF5 file, float64, validated (C >= 1, finite, d matches)."""
    with formats.open_input(path) as f:
        if "codebook" not in f:
            names = ", ".join(sorted(f.keys())) or "nothing"
            raise InputError(f"missing dataset 'codebook' (C, d) of token embeddings; found {names}", path)
        C = formats.read_array(f, "codebook", path, finite=False).astype(np.float64)
    if C.ndim != 2 or C.shape[0] < 1 or C.shape[1] != d:
        raise InputError(f"'codebook' has shape {C.shape}, expected (C, d) = (C, {d}) with C >= 1", path)
    if not np.isfinite(C).all():
        raise InputError("'codebook' contains NaN or Inf", path)
    return C


# Entries of the (rows of y) x (codebook rows) work arrays of `snap_to` per block (~8 MiB of float64).
SNAP_BLOCK_ENTRIES = 1 << 20


def snap_to(codebook: np.ndarray, y: np.ndarray, block: int = 4096) -> np.ndarray:
    """Index of the nearest codebook row (Euclidean; the lowest index on ties) of every row of y (B, d).

    Exact for any magnitudes: the expanded form |c|^2 - 2 y.c + |y|^2 (one matrix product, in
    coordinates centred on the codebook's mean) only selects the candidates, the rows within twice
    its rounding-error bound of the smallest; their distances are then recomputed directly as
    ||y - c||^2. Works on blocks of at most `block` rows of y and SNAP_BLOCK_ENTRIES pairs.
    """
    C = np.asarray(codebook, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n_c, d = C.shape
    m = C.mean(axis=0)
    Cc = C - m
    c2 = np.einsum("ij,ij->i", Cc, Cc)
    cmax = float(np.sqrt(c2.max()))
    # |computed - exact| of the expanded form (the centring, three dot products and two sums) is
    # below about (d + 4) eps / 2 (|y - m| + max |c - m|)^2; `rel` allows four times that
    rel = 2.0 * (d + 8) * EPS
    rows_per_block = max(1, min(block, SNAP_BLOCK_ENTRIES // n_c))
    pairs_per_step = max(1, SNAP_BLOCK_ENTRIES // max(d, 1))
    idx = np.empty(y.shape[0], dtype=np.int64)
    for a in range(0, y.shape[0], rows_per_block):
        yb = y[a:a + rows_per_block]
        ybc = yb - m
        y2 = np.einsum("ij,ij->i", ybc, ybc)
        dist = c2[None, :] - 2.0 * (ybc @ Cc.T) + y2[:, None]
        lo = dist.min(axis=1)
        slack = rel * (np.sqrt(y2) + cmax) ** 2
        ok = np.isfinite(lo) & np.isfinite(slack)
        if not ok.all():  # non-finite outputs: keep the plain argmin (NaN -> the first NaN)
            idx[a:a + yb.shape[0]][~ok] = np.argmin(dist[~ok], axis=1)
        cand = (dist <= (lo + 2.0 * slack)[:, None]) & ok[:, None]
        r, c = np.nonzero(cand)  # row-major: every row's candidates in increasing index
        exact = np.empty(r.size)
        for s in range(0, r.size, pairs_per_step):
            diff = yb[r[s:s + pairs_per_step]] - C[c[s:s + pairs_per_step]]
            exact[s:s + pairs_per_step] = np.einsum("ij,ij->i", diff, diff)
        dist[ok] = np.inf
        dist[r, c] = exact
        idx[a:a + yb.shape[0]][ok] = np.argmin(dist[ok], axis=1)  # the first of equal distances
    return idx


def rollout_chunk(coef: np.ndarray, tokens: np.ndarray, offsets: np.ndarray, steps: int,
                  normalize: str = "none", codebook: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Append `steps` generated tokens to every sequence of a chunk: (tokens (t + B*steps, d), offsets).

    Each new token is the last-token output of the sequence so far (S kept as a running sum, so a
    step costs O(B d^3)); with `codebook` it is replaced by the nearest codebook row.
    """
    d = coef.shape[0]
    if tokens.shape[1] != d:
        raise InputError(f"the model has d = {d} but the data have d = {tokens.shape[1]}")
    offsets = np.asarray(offsets, dtype=np.int64)
    S, last = sequence_moments(tokens, offsets)
    lengths = np.diff(offsets)
    B = lengths.size
    n = lengths.astype(np.float64)
    gen = np.empty((B, steps, d))
    for k in range(steps):
        Sn = S / n[:, None, None] if normalize == "length" else S
        y = features_from_moments(Sn, last) @ coef.T
        if codebook is not None:
            y = codebook[snap_to(codebook, y)]
        gen[:, k] = y
        S += y[:, :, None] * y[:, None, :]
        n += 1.0
        last = y
    new_off = offsets + steps * np.arange(B + 1)
    out = np.empty((int(new_off[-1]), d))
    pos = np.arange(int(offsets[-1]))
    seq = np.repeat(np.arange(B), lengths)
    out[pos + steps * seq] = np.asarray(tokens, dtype=np.float64)
    gen_rows = (new_off[:-1] + lengths)[:, None] + np.arange(steps)[None, :]
    out[gen_rows.reshape(-1)] = gen.reshape(-1, d)
    return out, new_off


def rollout_file(fn: Model | Heads, data: str | os.PathLike, out: str | os.PathLike, steps: int,
                 codebook: str | os.PathLike | None = None, chunk_size: int | None = None,
                 progress: Callable[[int], None] | None = None,
                 inputs: tuple[str | os.PathLike, ...] = ()) -> dict[str, Any]:
    """Stream `rollout_chunk` over a tokens file; write a tokens file (tokens (T + N K, d) float64 + offsets).

    Generated tokens that overflow float64 (a diverging rollout) are an InputError; nothing is written.
    """
    if steps < 1:
        raise InputError(f"steps must be >= 1, got {steps}")
    if bias_terms_of(fn):
        raise InputError("a rollout appends outputs as tokens; a function with the bias terms maps tokens x to "
                         "outputs through (x, 1), which rollout does not support", data)
    if affine_of(fn) is not None:
        raise InputError("a rollout appends outputs as tokens; a function with the affine map of the wide tokens "
                         "needs wide tokens the rollout does not make", data)
    coef, normalize, info = _function_and_data(fn, data)
    if isinstance(coef, HeadsFn):
        if out_width(coef) != in_width(coef):
            raise InputError(f"the heads map d = {in_width(coef)} tokens to {out_width(coef)}-dim outputs: a rollout "
                             "appends outputs as tokens, so they need equal widths", data)
        coef = coef_of(fn)
    d = coef.shape[0]
    C = None if codebook is None else load_codebook(codebook, d)
    formats.check_hdf5_suffix(out, "a tokens file")
    o = formats.check_output_path(out, (data, *inputs, *((codebook,) if codebook is not None else ())))
    N = info.n_samples
    total = info.n_tokens + N * steps
    size = chunk_size or max(1, default_chunk_size(info) // max(1, (steps + 1) // 2))
    meta = {**formats.header("tokens", (data, *inputs)), "generator": "rollout", "steps": steps,
            "normalize": normalize, "snapped": int(C is not None)}


    with formats.atomic_path(o) as tmp:
        with formats.create_output(tmp) as fout:
            for k, v in meta.items():
                fout.attrs[k] = v
            dt = fout.create_dataset("tokens", (total, d), dtype="f8")
            doff = fout.create_dataset("offsets", (N + 1,), dtype="i8")
            doff[0] = 0
            pos = 0
            for a, b, tokens, offsets, _y in iter_chunks(info, (0, N), size):
                check_finite(tokens, offsets, None, a, data)
                with np.errstate(over="ignore", invalid="ignore"):
                    new_tok, new_off = rollout_chunk(coef, tokens, offsets, steps, normalize, C)
                if not np.isfinite(new_tok).all():
                    bad = int(np.searchsorted(new_off, np.flatnonzero(~np.isfinite(new_tok).all(axis=1))[0],
                                              side="right") - 1)
                    raise InputError(f"the rollout of sequence {a + bad} diverges: generated tokens overflow "
                                     "float64 (use fewer steps or snap to a codebook); nothing was written",
                                     data)
                dt[pos:pos + new_tok.shape[0]] = new_tok
                doff[a + 1:b + 1] = pos + new_off[1:]
                pos += new_tok.shape[0]
                if progress is not None:
                    progress(b - a)
    return {"output": str(out), "n_samples": N, "d": d, "steps": steps, "n_tokens": total,
            "normalize": normalize, "snapped": C is not None}


def predict_span(coef: np.ndarray, info: Any, all_positions: bool, span: tuple[int, int],
                 normalize: str = "none", device: str | None = None, basis: np.ndarray | None = None,
                 affine: tuple[WideSource, np.ndarray] | None = None
                 ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, int, Spread]:
    """Predictions for samples [lo, hi): (pred (B, d), outputs (t, d) or None, offsets, count, the
    targets' Spread (their weight, spread and weighted SSE: the MSE and R^2)).

    With last-token targets the SSE is sum_i w_i ||pred_i - y_i||^2, count #{i: w_i > 0} and weight
    sum_i w_i (w_i = 1 without `weights`), as in `causal_span`; without targets (info.has_targets
    false) all are 0. `basis`: the tokens X basis are evaluated (Model.evaluation).
    """
    lo, hi = span
    for a, _b, tokens, offsets, targets, *w in iter_chunks(info, (lo, hi), hi - lo, prefetch=False,
                                                            with_weights=info.has_targets):
        weights = w[0] if w else None
        check_finite(tokens, offsets, targets, a, info.path)
        check_weights(weights, offsets, a, info.per_position, info.path)
        pred, outputs = predict_chunk(coef, in_basis(tokens, basis), offsets, all_positions, normalize,
                                      device=None if device is None else worker_device(device))
        if affine is not None:  # the affine map of the wide tokens at the last token (and every position)
            aff = _affine_span(affine, a, offsets)
            pred = pred + aff[offsets[1:] - 1]
            outputs = None if outputs is None else outputs + aff
        count, spread = scored(pred, targets, weights) if targets is not None else (0, Spread())
        return pred, outputs, offsets.copy(), count, spread
    raise ValueError("empty span")
