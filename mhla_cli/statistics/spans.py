"""The data's spans: the cheap passes that find them (partial traces over sample ranges, a probe of
the basis sample first) and featurize's `spans` option; the spans themselves are read off the traces in
mhla_cli.statistics.structure.
"""

from __future__ import annotations

import numpy as np

from mhla_cli.statistics import basis as basis_mod
from mhla_cli.statistics import structure as structure_mod
from mhla_cli.errors import InputError
from mhla_cli.feature_map import check_normalize, n_features
from mhla_cli.linalg.memory import check_floor
from mhla_cli.statistics.accumulate import Accumulator
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.ranges import add_chunks
from mhla_cli.io.tokens import TokensInfo

__all__ = ["SPANS", "SPANS_MIN_FEATURES", "SPANS_PROBE_MARGIN", "SPANS_PROBE_PER_PAIR", "SPANS_SHARE",
           "check_spans", "find_spans", "probe_blocks", "span_traces"]

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
# decides. The probe is at most half the sample (`probe_blocks`).
SPANS_PROBE_PER_PAIR = 8
SPANS_PROBE_MARGIN = 1e6
SPANS = ("auto", "on", "off")


def check_spans(spans: str) -> str:
    """Validate featurize's `spans` option."""
    if spans not in SPANS:
        raise InputError(f"unknown spans option '{spans}', expected auto, on or off")
    return spans


def span_traces(info: TokensInfo, sample_range: tuple[int, int], A: np.ndarray, chunk_size: int | None = None,
                normalize: str = "none") -> tuple[np.ndarray, np.ndarray, Features]:
    """The two partial traces of the canonical Gram of samples [lo, hi) in basis A (tokens X A):
    sum w ||x_n||^2 s s^T (q x q) and sum w ||s||^2 x_n x_n^T (d x d) (mhla_cli.statistics.structure), and the
    token Grams of the same pass (a Features without feature sums, for `Features.correction`).

    A cheap pass: O(q^2) per sample instead of the Gram's O(psi^2).
    """
    acc = Accumulator(info.d, False, A, samples=info.samples, normalize=check_normalize(normalize), traces=True)
    add_chunks(acc, info, sample_range, chunk_size)
    tp, tl = acc.traces  # type: ignore[misc]  # traces=True: the traces are set
    return 0.5 * (tp + tp.T), 0.5 * (tl + tl.T), acc.result(info.dtype)


def find_spans(info: TokensInfo, A: np.ndarray, sample_range: tuple[int, int], chunk_size: int,
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
            if not st.on_spans or st.n > share * psi:
                return None, A, 0
    tp, tl, sums = span_traces(info, sample_range, A, chunk_size, normalize)
    passes = 1
    C, cond = sums.correction()
    if C is not None and cond > basis_mod.CHANGE_COND:
        A = basis_mod.round32(sums.basis @ C)
        tp, tl, _ = span_traces(info, sample_range, A, chunk_size, normalize)
        passes = 2
    st = structure_mod.from_traces(tp, tl)
    if not st.on_spans or st.n > share * psi:
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


def spans_block(found: tuple[np.ndarray, np.ndarray] | None) -> int | None:
    """Features of the block on the data's spans (None: all psi)."""
    return None if found is None else int(found[0].shape[1] * found[1].shape[1])
