"""Padded activations: tokens (N, n, d) with a padding mask (an attention_mask (N, n) of 0/1, or
lengths (N,)) become the unpadded sequences, written ragged; per-position targets and weights are
masked alike. Dropping the padding (rather than weighing it 0) keeps it out of every window: it is
neither a sample nor one of the tokens that a position attends to."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ._roles import MASK_NAMES
from ._source import _array_source, _Source
from .. import formats
from ...errors import InputError, Refused

# Bytes of mask rows read at once while counting a padded file's lengths.
_MASK_BYTES = 16 << 20


def _mask_rows(mask: _Source, n: int) -> Callable[[int, int], np.ndarray]:
    """Rows [a, b) of the keep mask (bool (b-a, n)): an attention mask of 0/1, or lengths (N,)."""
    if len(mask.shape) == 1:
        def read(a: int, b: int) -> np.ndarray:
            lens = np.asarray(mask.read(a, b))
            return np.arange(n)[None, :] < lens.astype(np.int64)[:, None]
        return read

    def read2(a: int, b: int) -> np.ndarray:
        return np.asarray(mask.read(a, b)) != 0
    return read2


def _check_mask(mask: _Source, N: int, n: int, label: str) -> np.ndarray:
    """The offsets (N+1,) of the kept tokens; refuses a mask of another shape, values other than 0/1
    (lengths outside 1..n) and sequences with no token kept."""
    if mask.dtype.kind not in "biuf":
        raise InputError(f"the mask '{mask.name}' has dtype {mask.dtype}, expected 0/1 numbers (or integer lengths)", label)
    lengths = np.empty(N, dtype=np.int64)
    step = max(1, _MASK_BYTES // max(1, n * max(1, mask.dtype.itemsize)))
    for a in range(0, N, step):
        b = min(N, a + step)
        m = np.asarray(mask.read(a, b))
        if len(mask.shape) == 1:
            bad = ~((m >= 1) & (m <= n) & (m == np.floor(m)))
            if bad.any():
                i = a + int(np.flatnonzero(bad)[0])
                raise InputError(f"the mask '{mask.name}' (lengths) of sequence {i} is {formats.value_text(m[i - a])}: lengths must be whole numbers in "
                                 f"1..{n} (the padded length)", label)
            lengths[a:b] = m.astype(np.int64)
        else:
            bad = ~((m == 0) | (m == 1))
            if bad.any():
                i, t = (int(x[0]) for x in np.nonzero(bad))
                raise InputError(f"the mask '{mask.name}' of sequence {a + i}, position {t} is {formats.value_text(m[i, t])}: an attention "
                                 "mask holds 0 (padding) or 1 (a token)", label)
            lengths[a:b] = (m != 0).sum(axis=1)
            empty = np.flatnonzero(lengths[a:b] == 0)
            if empty.size:
                raise InputError(f"sequence {a + int(empty[0])} has no token: its mask '{mask.name}' is all 0", label)
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _masked(src: _Source, keep: Callable[[int, int], np.ndarray], offsets: np.ndarray) -> _Source:
    """Rows of a padded (N, n, ...) array at the kept positions, flattened: (T, ...) in order."""
    rest = src.shape[2:]

    def read(a: int, b: int) -> np.ndarray:
        if b <= a:
            return np.empty((0, *rest), src.dtype)
        i0 = int(np.searchsorted(offsets, a, side="right")) - 1
        i1 = int(np.searchsorted(offsets, b, side="left"))
        rows = np.asarray(src.read(i0, i1))[keep(i0, i1)]
        r0 = a - int(offsets[i0])
        return rows[r0:r0 + (b - a)]

    return _Source(src.name, (int(offsets[-1]), *rest), src.dtype, read, src.label)


def _apply_mask(sources: list[_Source], mask_name: str | None, label: str, explicit: bool) -> list[_Source]:
    """Padded tokens (N, n, d) with a mask (N, n) or lengths (N,): the unpadded sequences (ragged; the
    last kept position is the query), per-position targets and weights masked the same way."""
    by = {s.name: s for s in sources}
    if mask_name is None:
        found = [m for m in MASK_NAMES if m in by]
        if len(found) > 1:
            raise Refused(f"both {' and '.join(repr(f) for f in found)}: give one padding mask (or name it with "
                          "{mask:NAME})", label, mask={})
        mask_name = found[0] if found else None
    if mask_name is None:
        return sources
    if mask_name not in by:
        if explicit:
            have = ", ".join(repr(s.name) for s in sources) or "nothing"
            raise InputError(f"no array '{mask_name}' to use as the padding mask (found {have})", label)
        return sources
    mask = by[mask_name]
    tok = by.get("tokens")
    if tok is None:
        return sources  # the missing tokens are reported by the writer
    if len(tok.shape) != 3:
        raise InputError(f"the mask '{mask_name}' masks padded tokens (N, n, d), but 'tokens' has shape {tok.shape}", label)
    if "offsets" in by:
        raise InputError(f"give either the mask '{mask_name}' (padded tokens) or 'offsets' (ragged tokens), not both", label)
    N, n = tok.shape[0], tok.shape[1]
    want = (N,) if len(mask.shape) == 1 else (N, n)
    if mask.shape != want:
        raise InputError(f"the mask '{mask_name}' has shape {mask.shape}, expected (N, n) = ({N}, {n}) (0/1 per position) "
                         f"or (N,) = ({N},) (lengths)", label)
    offsets = _check_mask(mask, N, n, label)
    keep = _mask_rows(mask, n)
    out = []
    for s in sources:
        if s.name == mask_name:
            continue
        if s.name == "tokens" or (len(s.shape) >= 2 and s.shape[:2] == (N, n) and s.name in ("targets", "weights")
                                  and not (s.name == "targets" and len(s.shape) == 2)):
            s = _masked(s, keep, offsets)  # per position: tokens, targets (N, n, e), weights (N, n)
        out.append(s)
    out.append(_array_source("offsets", offsets, label))
    return out
