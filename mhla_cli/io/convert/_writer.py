"""The tokens file written from sources: created, checked by the reader's own `inspect_tokens`, then
copied chunk by chunk (NaN, Inf and bad weights refused as readers refuse them) and renamed into
place; a bad input leaves nothing.

A file with per-position targets records how the model's attention ran, the root attribute
`attention`: "causal" (position t attends to the positions up to t: every prefix is a sample) or
"bidirectional" (every position attends to the whole window, as in an encoder). A file without it
is read as causal.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ._readers import SUFFIXES
from ._roles import _check_names
from ._source import _Source
from ._values import _value_sources
from .. import formats
from .. import tokens as tokens_mod
from ...errors import InputError, Refused
from ...samples import attentions

# Output suffixes that name another format (an output's suffix means its format).
_OTHER_FORMATS = tuple(s for s in (*SUFFIXES, ".csv", ".tsv", ".txt", ".json", ".zip", ".pkl", ".pickle")
                       if s not in formats.HDF5_SUFFIXES)
# Bytes of token (and per-position target) rows copied per chunk (at least one sample per chunk).
CHUNK_BYTES = 16 << 20
_OFFSET_BLOCK = 1 << 20


def _relabel(exc: InputError, tmp: Path, where: str) -> InputError:
    """The reader's error about the temporary output, said of the inputs it was made from."""
    if exc.path != str(tmp):
        return exc
    if isinstance(exc, Refused):
        return Refused(exc.template, where, **exc.remedies)
    return InputError(str(exc)[len(exc.path) + 2:], where)


def _plan(f: h5py.File, info: tokens_mod.TokensInfo, rows: int, chunk_size: int | None
          ) -> Iterator[tuple[int, int, np.ndarray]]:
    """(a, b, offsets[a..b]) for chunks of samples of about `rows` token rows (at least one sample)."""
    N = info.n_samples
    if info.layout == "dense":
        n = info.dense_len
        step = chunk_size or max(1, rows // n)
        for a, b in tokens_mod.chunk_ranges(0, N, step):
            yield a, b, np.arange(a, b + 1, dtype=np.int64) * n
        return
    for s in range(0, N, _OFFSET_BLOCK):
        e = min(N, s + _OFFSET_BLOCK)
        off = np.asarray(f["offsets"][s:e + 1], dtype=np.int64)
        a = s
        while a < e:
            b = int(np.searchsorted(off, off[a - s] + rows, side="right")) - 1 + s
            b = min(e, a + chunk_size) if chunk_size else min(e, max(a + 1, b))
            yield a, b, off[a - s:b - s + 1]
            a = b


def _reopen(tmp: Path) -> h5py.File:
    """The private temporary output, opened again for writing (no lock: nobody else opens it)."""
    try:
        return h5py.File(tmp, "r+", locking=False)
    except ValueError:  # HDF5 older than 1.10.7 / 1.12.1: no locking property
        return h5py.File(tmp, "r+")


def _attention(info: tokens_mod.TokensInfo, attention: str | None, required: bool, where: str) -> str | None:
    """The `attention` attribute to write: given for per-position targets (required there when
    `required`), refused for any other file."""
    per_position = info.has_targets and info.per_position
    if attention is not None and attention not in attentions():
        raise InputError(f"attention '{attention}': expected {' or '.join(attentions())}")
    if attention is not None and not per_position:
        what = ("the targets are per sequence (N, e): the last position is the query" if info.has_targets
                else "there are no targets")
        raise Refused(f"{{attention_is:{attention}}} is for per-position targets, but {what}; drop {{attention_opt}}",
                      where, attention_is={}, attention_opt={})
    if attention is None and per_position and required:
        raise Refused("the targets are per position: say how the model's attention ran, {attention_is:causal} (a "
                      "decoder: position t sees the positions up to t) or {attention_is:bidirectional} (an encoder, "
                      "BERT-style: every position sees the whole window)", where, attention_is={})
    return attention


def _write(out: str | os.PathLike, sources: list[_Source], inputs: tuple[str | os.PathLike, ...],
           chunk_size: int | None, progress: Callable[[int], None] | None, attention: str | None = None,
           require_attention: bool = False, attrs: dict[str, str] | None = None) -> tokens_mod.TokensInfo:
    labels = list(dict.fromkeys(s.label for s in sources))
    where = " + ".join(labels) if labels else "input"
    sources = _check_names(sources, where)
    src = {s.name: s for s in sources}
    for s in sources:
        formats.check_numeric(s, s.name, s.label)  # a duck-typed dataset: only its dtype is read
    suffix = Path(out).suffix.lower()
    if suffix in _OTHER_FORMATS:
        raise InputError(f"the output is an HDF5 tokens file: give it a .h5 name, not {suffix}", out)
    o = formats.check_output_path(out, inputs, "tokens")
    with formats.atomic_path(o) as tmp:
        with formats.create_output(tmp) as f:
            for k, v in formats.header("tokens", inputs).items():
                f.attrs[k] = v
            for s in sources:
                f.create_dataset(s.name, shape=s.shape, dtype=s.dtype)
            if "offsets" in src and src["offsets"].shape:
                off = src["offsets"]
                for a, b in tokens_mod.chunk_ranges(0, off.shape[0], _OFFSET_BLOCK):
                    f["offsets"][a:b] = off.read(a, b)
        try:
            info = tokens_mod.inspect_tokens(tmp)  # the reader's own checks of shapes and offsets
        except InputError as exc:
            raise _relabel(exc, tmp, where) from None
        attention = _attention(info, attention, require_attention, where)
        with _reopen(tmp) as f:
            if attention is not None:
                f.attrs["attention"] = attention
            for k, v in (attrs or {}).items():
                f.attrs[k] = v
            _copy(f, info, src, chunk_size, progress)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
    return dataclasses.replace(info, path=str(o))


def _copy(f: h5py.File, info: tokens_mod.TokensInfo, src: dict[str, _Source], chunk_size: int | None,
          progress: Callable[[int], None] | None) -> None:
    """Copy tokens, targets and weights chunk by chunk, refusing NaN, Inf and bad weights as readers do."""
    N, d = info.n_samples, info.d
    tok = src["tokens"]
    row_bytes = tok.dtype.itemsize * d + (8 * d if info.per_position else 0)
    data = [s for name, s in src.items() if name != "offsets"]
    for a, b, off in _plan(f, info, max(1, CHUNK_BYTES // row_bytes), chunk_size):
        r0, r1 = int(off[0]), int(off[-1])
        local = off - r0
        rows = {s.name: (a, b) if s.shape[0] == N else (r0, r1) for s in data}  # per sample, or per token
        chunk = {s.name: s.read(*rows[s.name]) for s in data}
        tokens_mod.check_finite(chunk["tokens"].reshape(-1, d), local, None, a, tok.label)
        if "targets" in chunk:
            tokens_mod.check_finite(chunk["tokens"][:0].reshape(0, d), local, chunk["targets"], a,
                                    src["targets"].label)
        if "weights" in chunk:
            w = np.asarray(chunk["weights"], dtype=np.float64).reshape(-1)
            tokens_mod.check_weights(w, local, a, info.per_position and w.size != b - a, src["weights"].label)
        for name, arr in chunk.items():
            lo, hi = rows[name]
            if hi > lo:
                f[name][lo:hi] = arr
        if progress is not None:
            progress(b - a)


def write_tokens(path: str | os.PathLike, tokens: Any, offsets: Any = None, targets: Any = None,
                 weights: Any = None, *, chunk_size: int | None = None,
                 progress: Callable[[int], None] | None = None, attention: str | None = None
                 ) -> tokens_mod.TokensInfo:
    """Write a tokens file (atomically) from arrays; returns the layout of the file written.

    `tokens`: a list of (n_i, d) sequences (written ragged, offsets from their lengths), a (T, d)
    array with `offsets` (N+1,), or an (N, n, d) array. `targets` (N, d) or per position (T, d) /
    (N, n, d), and `weights` (N,) or (T,) / (N, n), may also be lists (one row or one block per
    sequence). Arrays may be numpy arrays, memory maps or torch tensors; they are copied in chunks.
    Refused (InputError, nothing written) as every reader refuses them: wrong shapes, offsets that do
    not increase, NaN or Inf, negative weights. `attention` ("causal" or "bidirectional"; only with
    per-position targets) is written as the file's attribute `attention`; without it the file is
    read as causal, like a file written with h5py.
    """
    values = {"tokens": tokens, "offsets": offsets, "targets": targets, "weights": weights}
    return _write(path, _value_sources(values, "input"), (), chunk_size, progress, attention)
