"""The reduction over sample spans [lo, hi): chunk sizing, `reduce_span` (the one place the data are
read), its sum over many spans (`reduce_spans`), the basis estimate, and the cheap passes that find the
data's spans (mhla_cli.statistics.structure).

Everything here is a sum over samples, so statistics of disjoint sample ranges add up
(`Features.__add__`, mhla_cli.statistics.features). `reduce_span` computes the statistics of one half-open
range [lo, hi); the serial loop, worker pools (mhla_cli.statistics.parallel), shards and Dask all call it.
Per chunk a reader thread fetches the next chunk in its stored dtype and the accumulator
(mhla_cli.statistics.accumulate) adds it.
"""

from __future__ import annotations

import builtins
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from functools import partial

import numpy as np

from . import basis as basis_mod
from ..io import formats
from . import parallel
from . import structure as structure_mod
from ..errors import InputError
from ..feature_map import check_normalize, n_features
from ..linalg import device as device_mod
from ..linalg import symgram
from ..linalg.memory import block_featurize_bytes, check_floor, featurize_bytes
from .accumulate import PANEL_BYTES, _Accumulator
from .parallel import CANCEL, Cancelled
from .algebra import add_into
from .affine_sums import WideSource
from .features import Features, check_overflow
from ..io.tokens import ReadBuffers, TokensInfo, check_chunk, check_weights, iter_chunks, read_chunk

__all__ = ["SPANS", "SPANS_MIN_FEATURES", "SPANS_PROBE_MARGIN", "SPANS_PROBE_PER_PAIR",
           "SPANS_SHARE", "check_spans", "chunk_buffer_bytes", "default_chunk_size",
           "device_pass_bytes", "estimate_basis", "featurize_need", "find_spans", "probe_blocks", "reduce_span",
           "reduce_spans",
           "span_traces"]

# Target size of the per-chunk work buffers; the default chunk size is derived from it.
CHUNK_BYTES = 64 * 2**20
# Rows per chunk at least, for wide blocks: as in the dsyrk baseline (4096 x psi) of benchmarks/.
MIN_SYRK_ROWS = 4096


def default_chunk_size(info: TokensInfo, affine_width: int = 0) -> int:
    """Samples per chunk so that the chunk's buffers stay near CHUNK_BYTES (with the affine block of wide tokens of
    `affine_width` coordinates: their read buffers and the rows f beside the targets too)."""
    psi = n_features(info.d)
    mean_len = max(1.0, info.n_tokens / info.n_samples)
    extra = 0
    if affine_width:
        per_seq = info.samples.rows_per_sequence(mean_len)
        extra = int(3 * 8 * (affine_width + 1) * (per_seq + mean_len) + 2 * 8 * affine_width * mean_len)
    rows = CHUNK_BYTES // (_sample_bytes(info) + extra)
    if psi + info.d >= 512:
        # the per-chunk cost outside the syrk (adding the psi^2 product) shrinks as 1/rows
        rows = max(rows, math.ceil(MIN_SYRK_ROWS / info.samples.rows_per_sequence(mean_len)))
    return int(max(1, min(info.n_samples, rows)))


def _sample_bytes(info: TokensInfo) -> int:
    """Bytes of the chunk buffers per sample (sequence) of a chunk."""
    psi, d = n_features(info.d), info.d
    mean_len = max(1.0, info.n_tokens / info.n_samples)
    rows = info.samples.rows_per_sequence(mean_len)
    if rows > 1:
        # every row is a row of the [H | Y] block, with its prefix Gram entries
        return int(rows * (8 * (psi + d) + 3 * 8 * (psi // d) + 4 * 8 * d))
    # [H | Y] block + S + pair products, and two float64 read slots of tokens and targets
    per_sample = 8 * (psi + d) + 8 * (d * d + psi // d) + 2 * 8 * d * (mean_len + 1)
    if info.per_position:  # per-position targets, the tokens weighted, X^T W X and X^T W Y of each window
        per_sample += 3 * 8 * d * mean_len + 2 * 8 * d * d
    return int(per_sample)


def chunk_buffer_bytes(info: TokensInfo, chunk_size: int | None = None) -> int:
    """Bytes of one reduction's chunk buffers (mhla_cli.linalg.memory): the chunk's arrays and the panel."""
    rows = min(chunk_size or default_chunk_size(info), info.n_samples)
    W = n_features(info.d) + (info.d if info.has_targets else 0)
    panel = 8 * W * max(1, min(W, PANEL_BYTES // (8 * W)))
    return int(rows * _sample_bytes(info) * 1.25) + panel


def device_pass_bytes(info: TokensInfo, chunk_size: int | None = None, block: int | None = None) -> int:
    """Bytes a pass holds on a device (`device.DeviceGram`): the Gram of [Ht | Y] and a chunk's block."""
    W = (n_features(info.d) if block is None else block) + (info.d if info.has_targets else 0)
    rows = min(chunk_size or default_chunk_size(info), info.n_samples)
    rows = int(rows * info.samples.rows_per_sequence(info.n_tokens / info.n_samples))
    return 8 * W * W + 2 * 8 * W * rows + 64 * 2**20


def featurize_need(info: TokensInfo, chunk_size: int | None = None, workers: int = 1,
                   derive: bool = True, block: int | None = None) -> Callable[[int], int]:
    """need(d): the peak bytes of featurizing `info` with its dimension set to d (memory.check_memory).

    `block`: at the file's own d only that many features are accumulated (the data's spans).
    """
    def need(d: int) -> int:
        other = replace(info, d=d)
        if block is not None and d == info.d:
            return block_featurize_bytes(block, d, chunk_buffer_bytes(other, chunk_size), workers, info.has_targets)
        return featurize_bytes(d, chunk_buffer_bytes(other, chunk_size), workers, info.has_targets, derive)
    return need


def _add_chunks(acc: _Accumulator, info: TokensInfo, span: tuple[int, int], chunk_size: int | None = None,
                progress: Callable[[int], None] | None = None, prefetch: bool = True,
                wide: WideSource | None = None) -> None:
    """Read samples [lo, hi) in chunks, validate each and add it to `acc`.

    `progress(n)` gets the samples of every chunk, in up to PROGRESS_STEPS parts when the chunk reports
    its work as it goes (`_Accumulator.add`'s tick), so that a bar moves within the large chunks of a
    big file; the parts of a chunk sum to its samples, and nothing else depends on them.
    `wide`: the wide tokens read in lockstep, whose rows f = (x_wide, 1) at every sample's query go beside the
    targets (mhla_cli.statistics.affine_sums).
    """
    per_position = info.per_position
    size = chunk_size or default_chunk_size(info)
    wide_chunks = None if wide is None else wide.chunks(span, size, prefetch)
    with acc.pipeline():  # a chunk's GEMMs run while the next is read and prepared (HostGram.pipeline)
        for a, b, tokens, offsets, targets, weights in iter_chunks(info, span, size, prefetch, with_weights=True):
            if CANCEL.is_set():
                raise Cancelled("the reduction was cancelled")
            check_weights(weights, offsets, a, per_position, info.path)
            if wide_chunks is not None:  # [y, f]: the affine block rides beside the targets
                f = wide.rows(next(wide_chunks), a, offsets, info.samples)
                targets = f if not acc.has_targets else np.hstack([targets, f])
            elif not acc.has_targets:
                targets = None
            told = [0]  # samples of this chunk reported so far

            def tick(f: float, n: int = b - a, told: list[int] = told) -> None:
                k = min(n - 1, int(f * n))
                if k - told[0] >= max(1, n // PROGRESS_STEPS):
                    progress(k - told[0])
                    told[0] = k
            acc.add(tokens, offsets, targets,
                    check=lambda top, a=a, t=tokens, o=offsets, y=targets: check_chunk(info, a, t, o, y, top),
                    weights=weights, tick=None if progress is None else tick)
            if progress is not None:
                progress(b - a - told[0])


# A chunk's progress is reported in at most this many parts (`_add_chunks`).
PROGRESS_STEPS = 64


def reduce_span(info: TokensInfo, span: tuple[int, int], chunk_size: int | None = None,
                progress: Callable[[int], None] | None = None, prefetch: bool = True,
                normalize: str = "none", basis: np.ndarray | None = None, finalize: bool = True,
                spans: tuple[np.ndarray, np.ndarray] | None = None, device: str | None = None,
                wide: WideSource | None = None) -> Features:
    """Statistics of samples [lo, hi) of the tokens file `info.path` (opened here, read in chunks).

    This is the one chunk reduction of mhla: the serial loop, worker pools, Dask and shards all
    call it. `progress(n)` is called after each chunk of n samples (sequences). The samples are
    `info.samples` (mhla_cli.samples: per sequence, every weighted prefix, or every weighted position of
    the whole window); `normalize="length"` divides S by its number of tokens. `basis` (d, d; None = the identity): accumulate the features of
    X @ basis (mhla_cli.statistics.basis). `finalize=False` returns the sums of that basis as they are (partial
    sums of a larger reduction add exactly); otherwise they are changed to the whitening of the
    span's tokens and the own-coordinate sums derived. `spans` (E, F) in the canonical coordinates of
    `basis`: accumulate only the block on the data's spans (mhla_cli.statistics.structure, `find_spans`).
    `device` (mhla_cli.linalg.device): build the features and their Gram there ("cuda" in a worker process:
    one GPU per worker); the result is the same float64 Features. `wide`: the wide tokens of the affine block
    (mhla_cli.statistics.affine_sums), read in lockstep.
    """
    lo, hi = span
    device = device_mod.worker_device(device)
    acc = _Accumulator(info.d, info.has_targets, basis, samples=info.samples, normalize=check_normalize(normalize),
                       spans=spans, device=device, n_affine=0 if wide is None else wide.width + 1)
    _add_chunks(acc, info, span, chunk_size, progress, prefetch, wide)
    total = acc.result(info.dtype)
    if wide is not None:  # the sums are of f_b = A_w^T f (mhla_cli.statistics.affine_sums)
        total.affine.basis, total.affine.P, total.affine.source = wide.basis, wide.P, wide.identity or None
    check_overflow(total, f"samples {lo}..{hi}", info.path)
    if finalize:
        total.canonical().finalize()
        check_overflow(total, f"samples {lo}..{hi}", info.path)
    total.sample_range = (lo, hi)
    total.bias_terms = info.constant
    return total


# featurize of a whole file starts in the whitening of its data itself (every token read once before the
# pass, not rounded to float32) instead of the estimate of a fixed sample, when the sample holds every
# token anyway, or when reading them costs little beside what it saves: the change of the sums to the
# whitening after the pass (basis.correction then finds A^T G A = I to rounding, within CANONICAL_TOL),
# about 4 q^4 flops on K (q = d(d+1)/2; `change_flops`). Taken when those flops are at least this many per
# byte of tokens read. Measured on this machine (AMD EPYC, 2 cores, float32 tokens, sequences of 16; a
# scratch script): the change took 0.83-1.0 s at d = 24 (3.2e10 flops, 32-39 GFLOP/s) and 0.07-0.08 s
# at d = 16 (1.4e9); reading and summing every token 0.08-0.24 s at d = 24, N = 36000 (55 MB: 590 flops
# of change per byte) and 0.33-0.52 s at d = 16, N = 2e5 (205 MB: 7 flops per byte), 0.2-0.7 GB/s. The
# break-even is near 60 flops a byte; from a cold disk reading is slower.
EXACT_BASIS_FLOPS_PER_BYTE = 100.0


def change_flops(d: int) -> float:
    """About the flops of changing the pass's sums to another basis of the tokens. On K (symgram.Pairs:
    q(q+1)/2 rows, q columns, q = d(d+1)/2): per column the pair step's two GEMMs, 2 q^3 and the
    triangle's (1 + 1 / PAIR_TRIANGLE_BLOCKS) q^3, and the token step K T^T, 2 q^2 per row: about 4 q^4
    in all. On the Gram itself (below SYMGRAM_MIN_D): two Kronecker products of 2 psi^2 (q + d) each."""
    q = symgram.n_pairs(d)
    if symgram.use_pairs(q, d):
        return 4.0 * float(q) ** 4
    return 4.0 * float(n_features(d)) ** 2 * (q + d)


def exact_basis(info: TokensInfo, span: tuple[int, int]) -> bool:
    """Whether `estimate_basis` of `span` reads every token of it (EXACT_BASIS_FLOPS_PER_BYTE): only for
    the whole file (a shard's basis stays the file's sample estimate, the same in every shard)."""
    if tuple(span) != (0, info.n_samples) or info.n_samples == 0:
        return False
    if basis_mod.sample_blocks(info.n_samples, info.n_tokens) == [(0, info.n_samples)]:
        return True  # the sample is every token already
    read = float(info.n_tokens) * info.d * np.dtype(info.dtype).itemsize
    return change_flops(info.d) >= EXACT_BASIS_FLOPS_PER_BYTE * read


def estimate_basis(info: TokensInfo, span: tuple[int, int] | None = None) -> np.ndarray:
    """The basis a pass accumulates in: an estimate of the whitening of a tokens file from a fixed sample
    (basis.sample_blocks), rounded to float32 values; or, when `exact_basis(info, span)`, the whitening
    of every token of `span` (the samples the pass reads), not rounded: of the token Gram the pass
    accumulates, sum c x x^T with c the weight of the samples that contain the token (the layout's
    `token_weights`, mhla_cli.samples).

    The estimate is deterministic in the file's content (every shard, worker and machine gets the same
    basis). It only has to be good enough to accumulate in: `featurize` checks it against the token
    Gram of all the data at the end of the pass (basis.correction), and the exact one passes that
    check, so that the sums need no change after the pass.
    """
    exact = span is not None and exact_basis(info, span)
    if exact:
        lo, hi = span
        per = basis_mod.block_samples(info.n_samples, info.n_tokens)  # the sample's blocks: small buffers
        blocks = [(a, min(hi, a + per)) for a in range(lo, hi, per)]
    else:
        blocks = basis_mod.sample_blocks(info.n_samples, info.n_tokens)
    G = np.zeros((info.d, info.d))
    count = 0
    bufs = ReadBuffers()
    with formats.open_input(info.path) as f, np.errstate(invalid="ignore", over="ignore"):
        for a, b in blocks:
            tokens, offsets, targets, weights = read_chunk(f, info, a, b, bufs, with_weights=True)
            X = tokens.astype(np.float64)
            top = float(np.max(X * X)) if X.size else 0.0
            check_chunk(info, a, tokens, offsets, targets, top)
            if exact:  # weighted tokens: the weights checked as the pass checks them (one line naming the sample)
                check_weights(weights, offsets, a, info.per_position, info.path)
            c = info.samples.token_weights(offsets, weights)[0] if exact else None
            G += X.T @ (X if c is None else X * c[:, None])
            count += X.shape[0] if c is None else float(np.sum(c))
    return basis_mod.whitening(G, count, round32=not exact)


def reduce_spans(info: TokensInfo, span_list: Sequence[tuple[int, int]],
                 map: Callable[..., Iterable[Features]] = builtins.map,  # noqa: A002 (like builtins.map)
                 chunk_size: int | None = None,
                 progress: Callable[[int], None] | None = None, normalize: str = "none",
                 basis: np.ndarray | None = None, finalize: bool = True,
                 spans: tuple[np.ndarray, np.ndarray] | None = None, device: str | None = None,
                 wide: WideSource | None = None) -> Features:
    """Sum of `reduce_span` over `span_list`, evaluated with `map` (builtin, a pool's, Dask's).

    `map(fn, spans)` may also yield partial sums (Dask tree-reduces on the cluster); the parts are
    added in the order they come, all in `basis`. `finalize` as in `reduce_span`. `progress` is told
    each part's samples when it comes back, or, with worker threads of this process
    (parallel.ThreadMap), each chunk's as the workers go (one call at a time).
    """
    total: Features | None = None
    threads = progress is not None and isinstance(map, parallel.ThreadMap)
    lock, raised = threading.Lock(), []

    def locked(n: int) -> None:
        with lock:
            if raised:  # the callback raised (e.g. to interrupt): it is not called again
                return
            try:
                progress(n)  # type: ignore[misc]
            except BaseException:
                raised.append(True)
                raise
    for part in map(partial(reduce_span, info, chunk_size=chunk_size, normalize=normalize, basis=basis,
                            finalize=False, spans=spans, device=device, progress=locked if threads else None,
                            wide=wide),
                    span_list):
        if total is None:
            total = part  # each part is a fresh result: sum into it
        else:
            add_into(total, part)
        if progress is not None and not threads:
            progress(part.n_sequences if part.n_sequences is not None else part.n_samples)
    if total is None:
        total = _Accumulator(info.d, info.has_targets, basis, samples=info.samples, normalize=normalize, spans=spans,
                             n_affine=0 if wide is None else wide.width + 1).result(info.dtype)
    if finalize:
        total.canonical().finalize()
    total.token_dtype = info.dtype
    total.bias_terms = info.constant
    if span_list:
        total.sample_range = (span_list[0][0], span_list[-1][1])
    return total


# "auto": featurize accumulates only the block on the data's spans when it holds at most this share
# of the psi features (below it the block's factorization costs <= 1/8 of the full one, O(n^3)).
SPANS_SHARE = 0.5
# ... and psi is at least this (smaller statistics are cheap whole, and keep every feature for the
# commands that need them: low-rank fits, the witness, folds).
SPANS_MIN_FEATURES = 2048
# "auto" first looks at a probe: the head of each block of the basis sample, about this many samples
# (prefixes, for per-position data) per pair coordinate in all. When the probe's partial traces have no
# direction within SPANS_PROBE_MARGIN times the structure cut, nothing is dropped from the sample
# either (its traces are the probe's plus PSD terms; only a sample whose lambda_max is SPANS_PROBE_MARGIN
# times the probe's could put a direction under its own cut) and no more is read; otherwise the sample
# decides as before. Measured on this machine (one process, a scratch timing): find_spans 0.019 s for
# d = 16 causal (N = 2048 x 32), 0.044 s at d = 24 (N = 9000), 0.015 s at d = 16 (N = 2e5), against
# 0.39, 0.42 and 0.29 s before in a profile (the sample's traces 0.20, 0.18 and 0.08 s of them; the rest
# scipy.linalg's import, which structure._eig_desc no longer needs).
SPANS_PROBE_PER_PAIR = 8
SPANS_PROBE_MARGIN = 1e6
SPANS = ("auto", "on", "off")


def check_spans(spans: str) -> str:
    """Validate featurize's `spans` option."""
    if spans not in SPANS:
        raise InputError(f"unknown spans option '{spans}', expected auto, on or off")
    return spans


def span_traces(info: TokensInfo, span: tuple[int, int], A: np.ndarray, chunk_size: int | None = None,
                normalize: str = "none") -> tuple[np.ndarray, np.ndarray, Features]:
    """The two partial traces of the canonical Gram of samples [lo, hi) in basis A (tokens X A):
    sum w ||x_n||^2 s s^T (q x q) and sum w ||s||^2 x_n x_n^T (d x d) (mhla_cli.statistics.structure), and the
    token Grams of the same pass (a Features without feature sums, for `Features.correction`).

    A cheap pass: O(q^2) per sample instead of the Gram's O(psi^2).
    """
    acc = _Accumulator(info.d, False, A, samples=info.samples, normalize=check_normalize(normalize), traces=True)
    _add_chunks(acc, info, span, chunk_size)
    tp, tl = acc.traces  # type: ignore[misc]
    return 0.5 * (tp + tp.T), 0.5 * (tl + tl.T), acc.result(info.dtype)


def find_spans(info: TokensInfo, A: np.ndarray, span: tuple[int, int], chunk_size: int,
               normalize: str = "none", spans: str = "auto"
               ) -> tuple[tuple[np.ndarray, np.ndarray] | None, np.ndarray, int]:
    """((E, F) bases of the data's spans in the canonical coordinates of the returned basis, or None:
    accumulate every feature; the basis to accumulate in; the passes over the data spent).

    The spans are read off partial traces in a basis that whitens the data to within
    basis.CHANGE_COND (else the pass is redone in the whitening it measured, which is then returned):
    in a badly scaled basis the traces' small directions would fall under the cut. "auto" first looks
    at the fixed sample of `estimate_basis` (its spans are within the data's; a probe of it first,
    `probe_blocks`): when they already hold more than SPANS_SHARE of the features, no pass is spent.
    """
    if check_spans(spans) == "off":
        return None, A, 0
    check_floor(info.d, info.path, "featurize")
    share = 1.0 if spans == "on" else SPANS_SHARE
    psi = n_features(info.d)
    if spans == "auto" and psi < SPANS_MIN_FEATURES:
        return None, A, 0
    if spans == "auto":
        blocks = basis_mod.sample_blocks(info.n_samples, info.n_tokens)
        probe = probe_blocks(info)
        for part, margin in ((probe, SPANS_PROBE_MARGIN), (blocks, 1.0)):
            if part is None:
                continue
            tp, tl = np.zeros((psi // info.d, psi // info.d)), np.zeros((info.d, info.d))
            for block in part:
                a, b, _ = span_traces(info, block, A, chunk_size, normalize)
                tp += a
                tl += b
            st = structure_mod.from_traces(tp, tl, margin)
            if not st.reduced or st.n > share * psi:
                return None, A, 0
    tp, tl, part = span_traces(info, span, A, chunk_size, normalize)
    passes = 1
    C, cond = part.correction()
    if C is not None and cond > basis_mod.CHANGE_COND:
        A = basis_mod.round32(part.basis @ C)
        tp, tl, _ = span_traces(info, span, A, chunk_size, normalize)
        passes = 2
    st = structure_mod.from_traces(tp, tl)
    if not st.reduced or st.n > share * psi:
        return None, A, passes
    return (np.ascontiguousarray(st.E), np.ascontiguousarray(st.F)), A, passes


def probe_blocks(info: TokensInfo) -> list[tuple[int, int]] | None:
    """`find_spans`'s probe: SAMPLE_BLOCKS ranges at the starts of the basis sample's blocks
    (`basis.sample_blocks`, before they merge), each the head of its block, about SPANS_PROBE_PER_PAIR
    samples per pair coordinate in all; None when that is more than half the sample (then the sample
    alone decides)."""
    N = info.n_samples
    q = n_features(info.d) // info.d
    per = info.samples.rows_per_sequence(info.n_tokens / max(N, 1))
    k = max(1, -(-int(SPANS_PROBE_PER_PAIR * q) // max(1, int(basis_mod.SAMPLE_BLOCKS * per))))
    if 2 * k > basis_mod.block_samples(N, info.n_tokens):
        return None
    probe = basis_mod.sample_blocks(N, info.n_tokens, per_block=k)  # within the sample's blocks (k <= theirs)
    sample = basis_mod.sample_blocks(N, info.n_tokens)
    if 2 * sum(b - a for a, b in probe) > sum(b - a for a, b in sample):  # a small file's sample: itself
        return None
    return probe


def _block(found: tuple[np.ndarray, np.ndarray] | None) -> int | None:
    """Features of the block on the data's spans (None: all psi)."""
    return None if found is None else int(found[0].shape[1] * found[1].shape[1])
