"""`convert_files`: the inputs (files, directories, patterns) read by their readers, named, unpadded,
joined and written as one tokens file."""

from __future__ import annotations

import dataclasses
import os
from functools import partial
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from ._join import _join, _part
from ._masks import _apply_mask
from ._readers import SUFFIXES, known, reader_for
from ._roles import COMPAT_KEY, FILE_NAMES, _pick, compat_record, parse_keys
from ..formats import COMPAT_ATTR
from ._source import _Source
from ._writer import _write
from .. import tokens as tokens_mod
from ...errors import InputError, Refused


def parse_input(spec: str | os.PathLike) -> tuple[str | None, Path]:
    """'NAME=FILE' -> (NAME, FILE) (NAME a dataset or mask name); a plain path -> (None, path)."""
    s = str(spec)
    name, sep, rest = s.partition("=")
    if sep and name in FILE_NAMES and not Path(s).exists():
        return name, Path(rest)
    return None, Path(s)


def expand_inputs(inputs: Sequence[str | os.PathLike]) -> list[str]:
    """Inputs with directories replaced by their files of a known suffix (sorted by name) and
    unexpanded shell patterns (*, ?, [) by their matches (sorted)."""
    import glob

    out: list[str] = []
    for spec in inputs:
        s = str(spec)
        name, p = parse_input(s)
        if name is None and p.is_dir() and reader_for(p) is None:
            files = sorted(str(q) for q in p.iterdir() if q.is_file() and q.suffix.lower() in SUFFIXES)
            if not files:
                raise InputError(f"is a directory with no {known('or')} file", p)
            out += files
        elif name is None and not p.exists() and any(c in s for c in "*?["):
            files = sorted(glob.glob(s))
            if not files:
                raise InputError("matches no file", s)
            out += files
        else:
            out.append(s)
    return out


def _file_sources(name: str | None, p: Path, stack: ExitStack) -> list[_Source]:
    if not p.exists():
        raise InputError("no such file", p)
    reader = reader_for(p)
    if reader is None and p.is_dir():
        raise InputError(f"is a directory, expected a {known('or')} file", p)
    if name is not None and not (reader is not None and reader.one_array):
        raise InputError("NAME=FILE names the array of a .npy file; the arrays of .npz, .safetensors and .pt "
                         "files are named inside them", p)
    if reader is None:
        suffix = p.suffix.lower()
        text = " (text: load it with np.loadtxt and np.save it as .npy)" if suffix in (".csv", ".tsv", ".txt") else ""
        raise InputError(f"unknown input format '{suffix or p.name}': mhla convert reads {known()} files{text}", p)
    sources = reader.sources(p, stack)
    if reader.one_array:
        sources = [dataclasses.replace(s, name=name or (p.stem if p.stem in FILE_NAMES else "tokens"))
                   for s in sources]
    return sources


# Input files whose reader's objects (memory maps, tensors loaded) are held at once while several files are read:
# a chunk of the output that spans two files reads each array from both (`_OneAtATime`).
OPEN_FILES = 2


class _OneAtATime:
    """The inputs' arrays read file by file: a file is opened (its reader's objects: memory maps, a torch file
    loaded) to list its arrays, and again when its rows are read, with at most `OPEN_FILES` files open (the
    least recently read is closed first), so the peak memory of several files is that of one or two, not
    their sum. Rows read are copies (a view into a file that is closed later would dangle)."""

    def __init__(self) -> None:
        self.specs: list[tuple[str | None, Path]] = []
        self.open: dict[int, tuple[list[_Source], ExitStack]] = {}  # in the order of their last read

    def add(self, name: str | None, p: Path) -> list[_Source]:
        """The arrays of the input `p` (NAME=FILE: `name`), whose rows are read from the file opened again."""
        k = len(self.specs)
        self.specs.append((name, p))
        return [dataclasses.replace(s, read=partial(self._read, k, i)) for i, s in enumerate(self._sources(k))]

    def _sources(self, k: int) -> list[_Source]:
        if k in self.open:
            self.open[k] = self.open.pop(k)  # the most recently read last
            return self.open[k][0]
        while len(self.open) >= OPEN_FILES:
            self._close(next(iter(self.open)))
        stack = ExitStack()
        try:
            sources = _file_sources(*self.specs[k], stack)
        except BaseException:
            stack.close()
            raise
        self.open[k] = (sources, stack)
        return sources

    def _read(self, k: int, i: int, a: int, b: int) -> np.ndarray:
        rows = np.asarray(self._sources(k)[i].read(a, b))
        return rows if rows.base is None and rows.flags.owndata else rows.copy()

    def _close(self, k: int) -> None:
        _, stack = self.open.pop(k)
        stack.close()

    def close(self) -> None:
        """Close every file still open."""
        while self.open:
            self._close(next(iter(self.open)))


def convert_files(inputs: Sequence[str | os.PathLike], output: str | os.PathLike, *,
                  chunk_size: int | None = None, progress: Callable[[int], None] | None = None,
                  mask: str | None = None, keys: Sequence[str] | None = None,
                  attention: str | None = None, compatibility_mode: bool | None = None) -> tokens_mod.TokensInfo:
    """Write the arrays of `inputs` (the formats of `READERS`) as one tokens file `output`.

    A `.npy` input holds one array: the one named by `NAME=FILE` (e.g. `targets=y.npy`), else by its
    stem when that is a dataset or mask name (`offsets.npy`), else the tokens (allowed once). The
    others hold arrays named as the datasets of a tokens file; a torch file may also hold a tensor
    (the tokens) or a list of (n_i, d) tensors (ragged sequences). Validated and written as
    `write_tokens`.

    Activations as models write them: `last_hidden_state` or `hidden_states` are the tokens when no
    array is named `tokens`; `keys` ("ROLE=NAME": tokens, targets, weights, offsets, mask; NAME[h]
    one head, NAME[sum] the sum over the heads) name any array's role, and hook points that no key
    picks are left out; padded tokens (N, n, d) with an `attention_mask` (N, n) of 0/1 or `lengths`
    (N,) (or the array named by `mask`) become the unpadded sequences, the last kept position the
    query (per-position targets and weights masked alike). When several files hold tokens (a
    directory or a glob gives its files sorted), each is one part and they are joined in the order
    given; a file of another d or layout is refused, naming it.

    Per-position targets need `attention` ("causal" or "bidirectional"), written as the file's
    attribute `attention`; with other targets it is refused.

    Whether TransformerLens 4's compatibility mode was on (a torch dict's `compatibility_mode` entry, or
    `compatibility_mode`) is written as the attribute `transformer_lens_compatibility_mode` ("on" / "off"); a
    TransformerBridge cache without that record is refused (its activations differ in the two modes).
    """
    if not inputs:
        raise InputError("no input files")
    keymap = parse_keys(keys)
    specs = [parse_input(i) for i in expand_inputs(inputs)]
    files = _OneAtATime()
    with ExitStack() as stack:
        stack.callback(files.close)
        plain = [p for n, p in specs if n is None and p.suffix.lower() == ".npy" and p.stem not in FILE_NAMES]
        raw = [(p, files.add(name, p)) for name, p in specs]
        compat = compat_record([s for _, srcs in raw for s in srcs], compatibility_mode,
                               " + ".join(str(p) for _, p in specs))
        raw = [(p, [s for s in srcs if s.name != COMPAT_KEY]) for p, srcs in raw]
        held = {s.name for _, srcs in raw for s in srcs}
        for pick in keymap.values():
            if pick.name not in held:
                listed = ", ".join(repr(n) for n in sorted(held)[:8]) + (", ..." if len(held) > 8 else "")
                raise Refused(f"{{key:{pick}}}: no input holds an array '{pick.name}' (they hold {listed})", key={})
        per_file = [(p, *_pick(srcs, keymap, mask)) for p, srcs in raw]
        holders = [p for p, srcs, _ in per_file if any(s.name == "tokens" for s in srcs)]
        if len(holders) > 1 and not plain:
            parts = []
            for p, srcs, mask_name in per_file:
                if not any(s.name == "tokens" for s in srcs):
                    raise InputError("holds no tokens: when several files hold tokens each file is one part to "
                                     "join, with its own targets and weights", p)
                parts.append(_part(_apply_mask(srcs, mask_name, str(p), mask is not None), str(p)))
            sources = _join(parts)
        else:
            if len(plain) > 1:
                raise InputError(f"cannot tell which array each of {', '.join(p.name for p in plain)} holds: name "
                                 "the files tokens.npy, offsets.npy, targets.npy, weights.npy, or write NAME=FILE "
                                 "(e.g. targets=y.npy)")
            sources = [s for _, srcs, _ in per_file for s in srcs]
            where = " + ".join(str(p) for p, _, _ in per_file)
            mask_name = next((m for _, _, m in per_file if m is not None), None)
            sources = _apply_mask(sources, mask_name, where, mask is not None)
        return _write(output, sources, tuple(p for _, p in specs), chunk_size, progress, attention,
                      require_attention=True, attrs=None if compat is None else {COMPAT_ATTR: compat})
