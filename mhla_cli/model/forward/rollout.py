"""Autoregressive generation (`mhla rollout`): each sequence continued by the last-token output so far,
optionally snapped to the nearest row of a codebook of token embeddings."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ...io import formats
from ...errors import InputError
from ...feature_map import features_from_moments
from ..heads import Heads, d_of_coef
from ...numerics import EPS
from ..model import Model, affine_of, bias_terms_of, coef_of
from mhla_cli.statistics.ranges import default_chunk_size
from mhla_cli.kernels import sequence_moments
from ...io.tokens import (
    check_finite,
    iter_chunks,
)
from .evaluate import HeadsFn, in_width, out_width
from .stream import function_and_data



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
    coef, normalize, info = function_and_data(fn, data)
    if isinstance(coef, HeadsFn):
        if out_width(coef) != in_width(coef):
            raise InputError(f"the heads map d = {in_width(coef)} tokens to {out_width(coef)}-dim outputs: a rollout "
                             "appends outputs as tokens, so they need equal widths", data)
        coef = coef_of(fn)
    d = coef.shape[0]
    if d != d_of_coef(coef):  # a model of targets of another width (D_out != d)
        raise InputError(f"the model maps d = {d_of_coef(coef)} tokens to {d}-dim outputs: a rollout appends outputs "
                         "as tokens, so they need equal widths", data)
    C = None if codebook is None else load_codebook(codebook, d)
    formats.check_hdf5_suffix(out, "a tokens file")
    o = formats.check_output_path(out, (data, *inputs, *((codebook,) if codebook is not None else ())), "tokens")
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
