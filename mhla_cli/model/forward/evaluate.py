"""The MHLA forward pass in memory: the function a model or heads file evaluates (its coef p in the
coordinates it was solved in, or heads evaluated directly: `HeadsFn`, also factored ones), and its outputs
on tokens at the last token, every position of the whole window, or every prefix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...linalg.backends import get_backend
from ...linalg.device import check_device
from ...errors import InputError, Refused
from ...feature_map import d_of_psi
from ..heads import Heads
from ..model import Model, affine_of, bias_terms_of, coef_of, evaluation_of, normalize_of
from ...statistics.affine_sums import affine_rows
from ...samples import BIDIRECTIONAL, CAUSAL, LAST, Samples, fitted_layout
from mhla_cli.kernels import sequence_moments
from ...bias_terms import with_constant



def forward_heads(V: np.ndarray, Q: np.ndarray, X: np.ndarray, all_positions: bool = False,
                  normalize: str = "none", layout: Samples | None = None) -> np.ndarray:
    """Reference forward pass of one sequence X (n, d): sum_h V_h S Q_h x_t, S = X^T X and t = n (the last
    token); with a per-position `layout` (mhla_cli.samples) at every t with S_t of the positions its query
    reads (`Samples.spans`); `all_positions` is layout=BIDIRECTIONAL (every t with the whole S).

    normalize="length" divides S by the tokens it sums.
    """
    X = np.asarray(X, dtype=np.float64)
    layout = BIDIRECTIONAL if layout is None and all_positions else layout
    if layout is not None and layout.per_position:
        start, stop = layout.spans(X.shape[0])
        out = np.empty((X.shape[0], V.shape[1]))
        for t, (a, b) in enumerate(zip(start.tolist(), stop.tolist())):
            S = X[a:b].T @ X[a:b] / ((b - a) if normalize == "length" else 1)
            out[t] = np.einsum("hab,bc,hcl,l->a", V, S, Q, X[t], optimize=True)
        return out
    S = X.T @ X
    if normalize == "length":
        S = S / X.shape[0]
    last: np.ndarray = np.einsum("hab,bc,hcl,l->a", V, S, Q, X[-1], optimize=True)
    return last


class HeadsFn(tuple):
    """Heads (V (H, r_out, r), Q (H, r, r), P, U) evaluated directly, sum_h V_h S Q_h x (O(H r^2) per
    sequence after S), instead of through coef (d_out, psi): for heads whose outputs have another
    width than the tokens, whose coef would not fit (`direct`), or factored heads (mhla export-heads
    --unreduce): P (d, r) and U (d_out, r_out) their maps (None for the others), the tokens taken to x~ = X P
    and the outputs back to y~ U^T, so that the heads work in r dimensions whatever d."""

    def __new__(cls, V: np.ndarray, Q: np.ndarray, P: np.ndarray | None = None,
                U: np.ndarray | None = None) -> HeadsFn:
        return super().__new__(cls, (V, Q, P, U))

    def __getnewargs__(self) -> tuple[Any, ...]:  # pickled to process workers as the four arrays
        return tuple(self)

    @property
    def shape(self) -> tuple[int, int]:  # (outputs, tokens) widths, like coef's (d, psi) first axis
        V, Q, P, U = self
        return int(V.shape[1] if U is None else U.shape[0]), int(Q.shape[1] if P is None else P.shape[0])

    def reduce(self, tokens: np.ndarray) -> np.ndarray:
        """The tokens the heads themselves take: X P of factored heads, X otherwise."""
        P = self[2]
        return tokens if P is None else np.asarray(tokens, dtype=np.float64) @ P

    def back(self, out: np.ndarray) -> np.ndarray:
        """The heads' outputs in the function's coordinates: y~ U^T of factored heads, y~ otherwise."""
        U = self[3]
        return out if U is None else out @ U.T


# Heads whose coef (d_out, psi) would exceed this are evaluated directly (HeadsFn).
DIRECT_COEF_BYTES = 256 << 20
# Bytes of the per-sequence S (B, d, d) of a chunk evaluated directly (predict_file's default chunk).
DIRECT_CHUNK_BYTES = 32 << 20


def direct(fn: Model | Heads | np.ndarray) -> HeadsFn | None:
    """`fn` as a HeadsFn when it is heads that are factored, rectangular (d_out != d) or too wide for a coef."""
    if not isinstance(fn, Heads):
        return None
    # with bias terms: of the tokens (x, 1), centred heads through the map (x, 1) -> (x - c, 1)
    V, Q = (np.asarray(a, dtype=np.float64) for a in fn.augmented_centred())
    maps = fn.augmented_maps()
    if maps is not None:
        return HeadsFn(V, Q, *maps)
    d_out, d = V.shape[1], Q.shape[1]
    if fn.bias_terms or d_out != d or 8 * d_out * (d * d * (d + 1) // 2) > DIRECT_COEF_BYTES:
        return HeadsFn(V, Q)
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


def heads_chunk(fn: HeadsFn, tokens: np.ndarray, offsets: np.ndarray, layout: Samples | None = None,
                normalize: str = "none") -> tuple[np.ndarray, np.ndarray | None]:
    """`predict_chunk` of heads evaluated directly: last-token outputs (B, d_out), every sample's (R, d_out)."""
    V, Q = fn[0], fn[1]
    if tokens.shape[1] != in_width(fn):
        raise InputError(f"the model has d = {in_width(fn)} but the data have d = {tokens.shape[1]}")
    Z = fn.reduce(tokens)
    S, last = _chunk_moments(Z, offsets, Q.shape[1], normalize)
    # sum_h V_h (S (Q_h x)): per head, matrix-vector products
    qx = np.einsum("hcl,bl->bhc", Q, last, optimize=True)
    sqx = np.einsum("bjc,bhc->bhj", S, qx, optimize=True)
    pred = fn.back(np.einsum("haj,bhj->ba", V, sqx, optimize=True))
    outputs = None if layout is None else sample_outputs(fn, tokens, offsets, layout, normalize)
    return pred, outputs


def predict_chunk(coef: np.ndarray | HeadsFn, tokens: np.ndarray, offsets: np.ndarray,
                  layout: Samples | None = None, normalize: str = "none",
                  device: str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Predictions for a chunk: last-token outputs (B, d) and, with a `layout` (mhla_cli.samples), the outputs at
    every sample of that layout (`sample_outputs`; None: none).

    normalize="length" divides each sequence's S by its length (as the model was fitted). `device`
    (mhla_cli.linalg.device): the last-token outputs computed there (every position's stay on the CPU).
    `coef` may be a HeadsFn (heads evaluated directly, on the CPU: `heads_chunk`).
    """
    if isinstance(coef, HeadsFn):
        return heads_chunk(coef, tokens, offsets, layout, normalize)
    S, last = _chunk_moments(tokens, offsets, in_width(coef), normalize)
    pred = get_backend(device).last_outputs(coef, S, last)
    outputs = None if layout is None else sample_outputs(coef, tokens, offsets, layout, normalize)
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
    npairs = d * (d + 1) // 2
    heads = isinstance(coef, HeadsFn)
    d_out = out_width(coef)
    if not heads:
        P = np.asarray(coef, dtype=np.float64).reshape(d_out, npairs, d).transpose(1, 0, 2).reshape(npairs, d_out * d)
    else:
        from ...linalg.symgram import pair_positions

        V, Q = coef[0], coef[1]
        full = pair_positions(Q.shape[1])  # S[j, k] from its upper entries (of the reduced tokens: factored heads)
    outs = []
    for s, e in _blocks(offsets):
        r0, r1 = int(offsets[s]), int(offsets[e])
        if isinstance(coef, HeadsFn):  # sum_h V_h (S (Q_h x)) row by row: no (rows, d_out, d) array; factored: of x~ = P^T x, then U
            q = samples.queries(coef.reduce(tokens[r0:r1]), offsets[s:e + 1] - r0, normalize)
            S = q.sample_upper()[:, full]
            qx = np.einsum("hcl,rl->rhc", Q, q.x, optimize=True)
            outs.append(coef.back(np.einsum("haj,rhj->ra", V, np.einsum("rjc,rhc->rhj", S, qx, optimize=True),
                                            optimize=True)))
        else:
            q = samples.queries(tokens[r0:r1], offsets[s:e + 1] - r0, normalize)
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
        raise Refused(f"the function adds an affine map of the wide tokens (width {affine.shape[1] - 1}): give them "
                      "({wide})", wide={})
    wide = np.asarray(wide, dtype=np.float64)
    wide = wide.reshape(-1, wide.shape[-1])
    if wide.shape != (int(offsets[-1]), affine.shape[1] - 1):
        raise InputError(f"the wide tokens have shape {wide.shape}, expected "
                         f"({int(offsets[-1])}, {affine.shape[1] - 1})")
    total: np.ndarray = out + affine_rows(wide, offsets, CAUSAL if per_position else LAST) @ affine.T
    return total


def _tokens_of(fn: Model | Heads | np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The tokens `fn` evaluates: (x, 1) for a function with the bias terms (mhla_cli.bias_terms), else x."""
    return with_constant(tokens) if bias_terms_of(fn) else np.asarray(tokens)


def fitted_samples(fn: Model | Heads | np.ndarray) -> Samples:
    """The layout a model or heads were fitted on, as their `attention` records it: BIDIRECTIONAL or CAUSAL
    for per-position fits, LAST otherwise (files without it)."""
    return LAST if isinstance(fn, np.ndarray) else fitted_layout(fn.info)


def predict(fn: Model | Heads | np.ndarray, tokens: np.ndarray, offsets: np.ndarray | None = None,
            all_positions: bool = False, device: str | None = None, wide: np.ndarray | None = None,
            layout: Samples | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """In-memory prediction. tokens (N, n, d), or (T, d) with offsets (N+1,); the model's normalisation.
    `device` (mhla_cli.linalg.device): the last-token outputs computed there. `wide`: the wide tokens of a function
    with the affine map of them (`predict_samples`). With a per-position `layout` (mhla_cli.samples; `all_positions`:
    BIDIRECTIONAL, the whole window's S) (the last-token outputs, the outputs at every sample of that layout)."""
    coef, A = evaluated(fn)
    tokens, offsets = as_ragged(_tokens_of(fn, tokens), offsets)
    layout = BIDIRECTIONAL if layout is None and all_positions else layout
    pred, outputs = predict_chunk(coef, in_basis(tokens, A), offsets, layout,
                                  normalize_of(fn), device=check_device(device))
    pred = _with_affine(fn, pred, wide, offsets, False)
    if layout is None:
        return pred
    assert outputs is not None  # a layout's outputs
    return pred, _with_affine(fn, outputs, wide, offsets, layout.per_position)


def in_basis(tokens: np.ndarray, A: np.ndarray | None) -> np.ndarray:
    """The tokens X A a model evaluates (Model.evaluation); X itself for A None."""
    if A is None:
        return tokens
    out: np.ndarray = np.asarray(tokens, dtype=np.float64) @ A
    return out
