"""The accumulation over sample ranges [lo, hi): chunk sizing, `accumulate_range` (the one place the data are
read), its sum over many ranges (`accumulate_ranges`), and the basis a pass accumulates in (`estimate_basis`).

Everything here is a sum over samples, so statistics of disjoint sample ranges add up
(`Features.__add__`, mhla_cli.statistics.features). `accumulate_range` computes the statistics of one half-open
range [lo, hi); the serial loop, worker pools (mhla_cli.statistics.distributed.parallel), shards and Dask all call it.
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

from mhla_cli.statistics import basis as basis_mod
from mhla_cli.io import formats
from mhla_cli.statistics.distributed import parallel
from mhla_cli.feature_map import check_normalize, n_features
from mhla_cli.linalg import device as device_mod
from mhla_cli.linalg import symgram
from mhla_cli.linalg.memory import block_featurize_bytes, featurize_bytes
from mhla_cli.linalg.backends import PANEL_BYTES
from mhla_cli.statistics.accumulate import Accumulator
from mhla_cli.statistics.distributed.parallel import CANCEL, Cancelled
from mhla_cli.statistics.algebra import add_into
from mhla_cli.statistics.affine_sums import WideSource
from mhla_cli.statistics.features import Features, check_overflow
from mhla_cli.io.tokens import ReadBuffers, TokensInfo, check_chunk, check_weights, iter_chunks, read_chunk

__all__ = ["chunk_buffer_bytes", "default_chunk_size", "device_pass_bytes", "estimate_basis", "featurize_need",
           "accumulate_range", "accumulate_ranges"]

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
    """Bytes of one pass's chunk buffers (mhla_cli.linalg.memory): the chunk's arrays and the panel."""
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


def add_chunks(acc: Accumulator, info: TokensInfo, sample_range: tuple[int, int], chunk_size: int | None = None,
                progress: Callable[[int], None] | None = None, prefetch: bool = True,
                wide: WideSource | None = None) -> None:
    """Read samples [lo, hi) in chunks, validate each and add it to `acc`.

    `progress(n)` gets the samples of every chunk, in up to PROGRESS_STEPS parts when the chunk reports
    its work as it goes (`Accumulator.add`'s tick), so that a bar moves within the large chunks of a
    big file; the parts of a chunk sum to its samples, and nothing else depends on them.
    `wide`: the wide tokens read in lockstep, whose rows f = (x_wide, 1) at every sample's query go beside the
    targets (mhla_cli.statistics.affine_sums).
    """
    per_position = info.per_position
    size = chunk_size or default_chunk_size(info)
    wide_chunks = None if wide is None else wide.chunks(sample_range, size, prefetch)
    with acc.pipeline():  # a chunk's GEMMs run while the next is read and prepared (HostGram.pipeline)
        for a, b, tokens, offsets, targets, weights in iter_chunks(info, sample_range, size, prefetch, with_weights=True):
            if CANCEL.is_set():
                raise Cancelled("the reduction was cancelled")
            check_weights(weights, offsets, a, per_position, info.path)
            if wide is not None and wide_chunks is not None:  # [y, f]: the affine block rides beside the targets
                f = wide.rows(next(wide_chunks), a, offsets, info.samples)
                targets = f if not acc.has_targets else np.hstack([targets, f])
            elif not acc.has_targets:
                targets = None
            told = [0]  # samples of this chunk reported so far

            def tick(f: float, n: int = b - a, told: list[int] = told) -> None:
                k = min(n - 1, int(f * n))
                assert progress is not None  # a tick is passed only with progress
                if k - told[0] >= max(1, n // PROGRESS_STEPS):
                    progress(k - told[0])
                    told[0] = k
            acc.add(tokens, offsets, targets,
                    check=partial(check_chunk, info, a, tokens, offsets, targets),
                    weights=weights, tick=None if progress is None else tick)
            if progress is not None:
                progress(b - a - told[0])


# A chunk's progress is reported in at most this many parts (`add_chunks`).
PROGRESS_STEPS = 64


def accumulate_range(info: TokensInfo, sample_range: tuple[int, int], chunk_size: int | None = None,
                progress: Callable[[int], None] | None = None, prefetch: bool = True,
                normalize: str = "none", basis: np.ndarray | None = None, finalize: bool = True,
                spans: tuple[np.ndarray, np.ndarray] | None = None, device: str | None = None,
                wide: WideSource | None = None) -> Features:
    """Statistics of samples [lo, hi) of the tokens file `info.path` (opened here, read in chunks).

    This is the one chunk accumulation of mhla: the serial loop, worker pools, Dask and shards all
    call it. `progress(n)` is called after each chunk of n samples (sequences). The samples are
    `info.samples` (mhla_cli.samples: per sequence, every weighted prefix, or every weighted position of
    the whole window); `normalize="length"` divides S by its number of tokens. `basis` (d, d; None = the identity): accumulate the features of
    X @ basis (mhla_cli.statistics.basis). `finalize=False` returns the sums of that basis as they are (partial
    sums of a larger accumulation add exactly); otherwise they are changed to the whitening of the
    range's tokens and the own-coordinate sums derived. `spans` (E, F) in the canonical coordinates of
    `basis`: accumulate only the block on the data's spans (mhla_cli.statistics.structure, `find_spans`).
    `device` (mhla_cli.linalg.device): build the features and their Gram there ("cuda" in a worker process:
    one GPU per worker); the result is the same float64 Features. `wide`: the wide tokens of the affine block
    (mhla_cli.statistics.affine_sums), read in lockstep.
    """
    lo, hi = sample_range
    device = device_mod.worker_device(device)
    acc = Accumulator(info.d, info.has_targets, basis, samples=info.samples, normalize=check_normalize(normalize),
                       spans=spans, d_out=info.out_dim, device=device, n_affine=0 if wide is None else wide.width + 1)
    add_chunks(acc, info, sample_range, chunk_size, progress, prefetch, wide)
    total = acc.result(info.dtype)
    if wide is not None:  # the sums are of f_b = A_w^T f (mhla_cli.statistics.affine_sums)
        assert total.affine is not None  # accumulated with n_affine > 0
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
# byte of tokens read: the change runs at tens of GFLOP/s and reading and summing the tokens at a few
# tenths of a GB/s, so the break-even is some tens of flops a byte; the cut leaves room for a cold disk.
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


def exact_basis(info: TokensInfo, sample_range: tuple[int, int]) -> bool:
    """Whether `estimate_basis` of `sample_range` reads every token of it (EXACT_BASIS_FLOPS_PER_BYTE): only for
    the whole file (a shard's basis stays the file's sample estimate, the same in every shard)."""
    if tuple(sample_range) != (0, info.n_samples) or info.n_samples == 0:
        return False
    if basis_mod.sample_blocks(info.n_samples, info.n_tokens) == [(0, info.n_samples)]:
        return True  # the sample is every token already
    read = float(info.n_tokens) * info.d * np.dtype(info.dtype).itemsize
    return change_flops(info.d) >= EXACT_BASIS_FLOPS_PER_BYTE * read


def estimate_basis(info: TokensInfo, sample_range: tuple[int, int] | None = None) -> np.ndarray:
    """The basis a pass accumulates in: an estimate of the whitening of a tokens file from a fixed sample
    (basis.sample_blocks), rounded to float32 values; or, when `exact_basis(info, sample_range)`, the
    whitening of every token of `sample_range` (the samples the pass reads), not rounded: of the token
    Gram the pass accumulates, sum c x x^T with c the weight of the samples that contain the token (the
    layout's `token_weights`, mhla_cli.samples).

    The estimate is deterministic in the file's content (every shard, worker and machine gets the same
    basis). It only has to be good enough to accumulate in: `featurize` checks it against the token
    Gram of all the data at the end of the pass (basis.correction), and the exact one passes that
    check, so that the sums need no change after the pass.
    """
    exact = sample_range is not None and exact_basis(info, sample_range)
    if exact:
        assert sample_range is not None  # exact only for a range
        lo, hi = sample_range
        per = basis_mod.block_samples(info.n_samples, info.n_tokens)  # the sample's blocks: small buffers
        blocks = [(a, min(hi, a + per)) for a in range(lo, hi, per)]
    else:
        blocks = basis_mod.sample_blocks(info.n_samples, info.n_tokens)
    G = np.zeros((info.d, info.d))
    count: float = 0
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


def accumulate_ranges(info: TokensInfo, sample_ranges: Sequence[tuple[int, int]],
                 map: Callable[..., Iterable[Features]] = builtins.map,  # noqa: A002 (like builtins.map)
                 chunk_size: int | None = None,
                 progress: Callable[[int], None] | None = None, normalize: str = "none",
                 basis: np.ndarray | None = None, finalize: bool = True,
                 spans: tuple[np.ndarray, np.ndarray] | None = None, device: str | None = None,
                 wide: WideSource | None = None) -> Features:
    """Sum of `accumulate_range` over `sample_ranges`, evaluated with `map` (builtin, a pool's, Dask's).

    `map(fn, spans)` may also yield partial sums (Dask tree-reduces on the cluster); the parts are
    added in the order they come, all in `basis`. `finalize` as in `accumulate_range`. `progress` is told
    each part's samples when it comes back, or, with worker threads of this process
    (parallel.ThreadMap), each chunk's as the workers go (one call at a time).
    """
    total: Features | None = None
    threads = progress is not None and isinstance(map, parallel.ThreadMap)
    lock, raised = threading.Lock(), list[bool]()

    def locked(n: int) -> None:
        with lock:
            if raised:  # the callback raised (e.g. to interrupt): it is not called again
                return
            try:
                progress(n)  # type: ignore[misc]  # progress: not None where locked is used
            except BaseException:
                raised.append(True)
                raise
    for part in map(partial(accumulate_range, info, chunk_size=chunk_size, normalize=normalize, basis=basis,
                            finalize=False, spans=spans, device=device, progress=locked if threads else None,
                            wide=wide),
                    sample_ranges):
        if total is None:
            total = part  # each part is a fresh result: sum into it
        else:
            add_into(total, part)
        if progress is not None and not threads:
            progress(part.n_sequences if part.n_sequences is not None else part.n_samples)
    if total is None:
        total = Accumulator(info.d, info.has_targets, basis, samples=info.samples, normalize=normalize, spans=spans,
                             d_out=info.out_dim, n_affine=0 if wide is None else wide.width + 1).result(info.dtype)
    if finalize:
        total.canonical().finalize()
    total.token_dtype = info.dtype
    total.bias_terms = info.constant
    if sample_ranges:
        total.sample_range = (sample_ranges[0][0], sample_ranges[-1][1])
    return total
