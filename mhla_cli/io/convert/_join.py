"""Several input files as one: each file that holds tokens is one part, joined in the order given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._roles import _check_names
from ._source import _array_source, _Source
from ...errors import InputError


@dataclass
class _Part:
    """One input file of several: its arrays (named as a tokens file's) and their layout."""

    label: str
    src: dict[str, _Source]
    N: int
    dense: int | None  # n for (N, n, d) tokens, None for ragged (T, d) + offsets

    @property
    def d(self) -> int:
        return int(self.src["tokens"].shape[-1])

    def role(self, name: str) -> str | None:
        """How `name` is laid out: "sequence" (first axis N) or "position" (per token), None if absent."""
        s = self.src.get(name)
        if s is None:
            return None
        if self.dense is not None:
            per_pos = len(s.shape) >= 2 and s.shape[1] == self.dense and (name == "weights" or len(s.shape) == 3)
        else:
            T = self.src["tokens"].shape[0]
            per_pos = s.shape[0] == T and T != self.N
        return "position" if per_pos else "sequence"

    def layout(self) -> tuple[Any, ...]:
        tg = self.src.get("targets")
        return (self.d, self.role("targets"), None if tg is None else int(tg.shape[-1]), self.role("weights"))


def _part(sources: list[_Source], label: str) -> _Part:
    src = {s.name: s for s in _check_names(sources, label)}
    tok = src["tokens"]
    if len(tok.shape) == 3:
        return _Part(label, src, int(tok.shape[0]), int(tok.shape[1]))
    if len(tok.shape) != 2 or "offsets" not in src:
        raise InputError(f"'tokens' has shape {tok.shape}: to join several files each needs tokens (N, n, d), "
                         "(N, n, d) with a padding mask, or (T, d) with offsets", label)
    return _Part(label, src, int(src["offsets"].shape[0]) - 1, None)


def _concat(name: str, parts: list[_Source]) -> _Source:
    """Sources joined along their first axis, read part by part."""
    sizes = np.concatenate([[0], np.cumsum([p.shape[0] for p in parts])]).astype(np.int64)
    dtype = np.result_type(*[p.dtype for p in parts])

    def read(a: int, b: int) -> np.ndarray:
        out = []
        for k, p in enumerate(parts):
            lo, hi = max(a, int(sizes[k])), min(b, int(sizes[k + 1]))
            if hi > lo:
                out.append(np.asarray(p.read(lo - int(sizes[k]), hi - int(sizes[k]))).astype(dtype, copy=False))
        if not out:
            return np.empty((0, *parts[0].shape[1:]), dtype)
        return np.concatenate(out)

    return _Source(name, (int(sizes[-1]), *parts[0].shape[1:]), dtype, read, " + ".join(p.label for p in parts))


def _flat(src: _Source) -> _Source:
    """A dense (N, n, ...) array read as (N n, ...) rows."""
    n = src.shape[1]
    rest = src.shape[2:]

    def read(a: int, b: int) -> np.ndarray:
        if b <= a:
            return np.empty((0, *rest), src.dtype)
        i0, i1 = a // n, -(-b // n)
        rows = np.asarray(src.read(i0, i1)).reshape(-1, *rest)
        return rows[a - i0 * n:b - i0 * n]

    return _Source(src.name, (src.shape[0] * n, *rest), src.dtype, read, src.label)


def _join(parts: list[_Part]) -> list[_Source]:
    """Several files' arrays as one: concatenated in the order given (dense when every file is dense
    with one n, else ragged), refusing a file of another d or layout."""
    first = parts[0]
    for p in parts[1:]:
        if p.d != first.d:
            raise InputError(f"has tokens of d = {p.d} but {first.label} has d = {first.d}: the files cannot be "
                             "joined", p.label)
        if p.layout() != first.layout():
            def desc(q: _Part) -> str:
                d, tr, te, wr = q.layout()
                return (f"targets {'per ' + tr + f' ({te} wide)' if tr else 'none'}, weights "
                        f"{'per ' + wr if wr else 'none'}")
            raise InputError(f"has another layout than {first.label} ({desc(p)}; {desc(first)}): the files cannot "
                             "be joined", p.label)
    dense = all(p.dense is not None and p.dense == first.dense for p in parts)
    out = []
    names = [n for n in ("tokens", "targets", "weights") if n in first.src]
    if dense:
        for name in names:
            out.append(_concat(name, [p.src[name] for p in parts]))
        return out
    flat: dict[str, list[_Source]] = {n: [] for n in names}
    offs = [np.zeros(1, dtype=np.int64)]
    total = 0
    for p in parts:
        for name in names:
            s = p.src[name]
            flat[name].append(_flat(s) if p.dense is not None and p.role(name) in ("position",) or
                              (p.dense is not None and name == "tokens") else s)
        if p.dense is not None:
            o = np.arange(1, p.N + 1, dtype=np.int64) * p.dense
        else:
            off = p.src["offsets"]
            o = np.asarray(off.read(1, off.shape[0]), dtype=np.int64)
        offs.append(o + total)
        total += int(o[-1]) if o.size else 0
    for name in names:
        out.append(_concat(name, flat[name]))
    offsets = np.concatenate(offs)
    out.append(_array_source("offsets", offsets, " + ".join(p.label for p in parts)))
    return out
