"""The identity of mhla's inputs and the provenance of its files: an input's name, size and content
fingerprint (and the maps of the reduction that wrote it), the inputs a file records, and the attributes
saying which mhla, command and inputs made a file."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ...errors import InputError
from .reading import _version, open_input


# Inputs whose datasets hold at most this many bytes are fingerprinted over all their data; larger
# ones over their structure, offsets and a fixed sample of row blocks (see `source_identity`).
FULL_FINGERPRINT_BYTES = 16 * 2**20
_SAMPLED_BLOCKS = 64
_BLOCK_BYTES = 4 * 2**20
_identity_cache: dict[tuple[Any, ...], dict[str, Any]] = {}


def _hash_dataset(h: Any, ds: h5py.Dataset, full: bool) -> None:
    """Feed a dataset's contents (all rows, or head, tail and evenly spaced blocks) into `h`."""
    if ds.ndim == 0:
        h.update(np.ascontiguousarray(ds[()]).tobytes())
        return
    n = int(ds.shape[0])
    if n == 0:
        return
    row_bytes = max(1, ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64)))
    rows = max(1, _BLOCK_BYTES // row_bytes)
    sample = max(1, rows // 16)  # a sample of ~_BLOCK_BYTES/16 per block keeps this cheap
    if full or n <= sample * (_SAMPLED_BLOCKS + 2):
        for lo in range(0, n, rows):  # every byte, in order: independent of the block size
            h.update(np.ascontiguousarray(ds[lo:min(n, lo + rows)]).tobytes())
        return
    rows = sample
    for lo in sorted({0, n - rows, *(int(s) for s in np.linspace(0, n - rows, _SAMPLED_BLOCKS))}):
        h.update(f"@{lo}:{rows};".encode())
        h.update(np.ascontiguousarray(ds[lo:min(n, lo + rows)]).tobytes())


def window_digests(tokens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The content fingerprint of every window of a chunk of tokens (t, D) with local `offsets` (n + 1,): a
    SHA-256 of the window's float64 values (little-endian, row-major; the first 16 bytes as 2 uint64), the same
    whatever the file's dtype, chunking or storage. `mhla reduce` records the digests of every window it reads
    (`REDUCE_DIGESTS`) so that a pass reading the wide tokens again can tell each of its windows from another's."""
    X = np.ascontiguousarray(tokens, dtype="<f8")
    off = np.asarray(offsets, dtype=np.int64)
    out = np.empty((off.size - 1, 2), dtype=np.uint64)
    for i in range(off.size - 1):
        out[i] = np.frombuffer(hashlib.sha256(X[off[i]:off[i + 1]].tobytes()).digest()[:16], dtype="<u8")
    return out


# The tokens file's root attribute recording whether TransformerLens's compatibility mode was on ("on" / "off",
# written by mhla convert): part of the data's identity (`source_identity`'s `compatibility_mode`).
COMPAT_ATTR = "transformer_lens_compatibility_mode"

# The dataset of a reduced tokens file holding the digests (N, 2) of the wide windows it was made from.
REDUCE_DIGESTS = "reduce_window_digests"


# Files mhla reads that are not HDF5: heads exported for other frameworks (mhla_cli.model.export).
FOREIGN_SUFFIXES = (".npz", ".safetensors")


def _reduction_identity(dsets: Mapping[str, h5py.Dataset]) -> dict[str, Any] | None:
    """{"maps": fingerprint, "dim": d} of the maps `reduce_P` (and `reduce_U`) that `mhla reduce` records in its
    output (None for a file without them): a SHA-256 (first 32 hex digits) of their shapes and float64 values, the
    same for every file reduced with the same maps (`mhla reduce --like` copies them bit for bit), different for
    another reduction."""
    if "reduce_P" not in dsets:
        return None
    h = hashlib.sha256()
    dim = None
    for name in ("reduce_P", "reduce_U"):
        if name in dsets:
            a = np.ascontiguousarray(dsets[name][()], dtype="<f8")
            h.update(f"{name}:{a.shape};".encode())
            h.update(a.tobytes())
            dim = int(a.shape[-1]) if a.ndim == 2 else dim
    return {"maps": h.hexdigest()[:32], "dim": dim}


def recorded_inputs(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The inputs an mhla file records in its provenance (`mhla_inputs`: path, name, size, fingerprint of each);
    [] when it records none or cannot be read."""
    try:
        with open_input(path) as f:
            raw = f.attrs.get("mhla_inputs", "[]")
        out = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
    except (InputError, OSError, ValueError):
        return []
    return [i for i in out if isinstance(i, dict)] if isinstance(out, list) else []


def source_identity(path: str | os.PathLike, full: bool | None = None) -> dict[str, Any]:
    """Name, size and content fingerprint of an input file, for provenance.

    The fingerprint is a SHA-256 (first 32 hex digits) of the datasets' names, shapes, dtypes and
    contents plus the attributes other than mhla_* (format and provenance), so it identifies the
    data, not the bytes of the file (re-saving the same data, with any chunking or compression,
    gives the same fingerprint). Files with more than
    FULL_FINGERPRINT_BYTES of data are fingerprinted over their shapes, every offset and a fixed
    sample of row blocks (`fingerprint_scope` says which); `full=True` forces a hash of everything.
    A file written by `mhla reduce` also gets `reduction`, the fingerprint of its maps (`_reduction_identity`), and a
    tokens file that records TransformerLens's compatibility mode (`COMPAT_ATTR`) `compatibility_mode`.
    """
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        raise InputError("no such file", p) from None
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, full, FULL_FINGERPRINT_BYTES, _BLOCK_BYTES)
    if key in _identity_cache:
        return dict(_identity_cache[key])
    h = hashlib.sha256()
    if p.suffix.lower() in FOREIGN_SUFFIXES:
        # heads exported for other frameworks (.npz, .safetensors): the bytes identify the data
        whole = bool(full) if full is not None else st.st_size <= FULL_FINGERPRINT_BYTES
        with open(p, "rb") as fh:
            if whole:
                for block in iter(lambda: fh.read(_BLOCK_BYTES), b""):
                    h.update(block)
            else:
                for i in range(_SAMPLED_BLOCKS):
                    fh.seek((st.st_size * i) // _SAMPLED_BLOCKS)
                    h.update(fh.read(_BLOCK_BYTES // 64))
        ident = {"path": str(p), "name": p.name, "size": st.st_size, "fingerprint": h.hexdigest()[:32],
                 "fingerprint_scope": "all bytes" if whole else "sampled bytes"}
        _identity_cache[key] = ident
        return dict(ident)
    with open_input(p) as f:
        dsets = {k: v for k, v in f.items() if isinstance(v, h5py.Dataset)}
        total = sum(int(ds.size) * ds.dtype.itemsize for ds in dsets.values())
        reduction = _reduction_identity(dsets)
        compat = _compat_of(f)
        whole = bool(full) if full is not None else total <= FULL_FINGERPRINT_BYTES
        for k in sorted(f.attrs.keys()):
            if not k.startswith("mhla_"):  # format and provenance metadata are not data
                with contextlib.suppress(Exception):
                    h.update(f"attr {k}={f.attrs[k]!r};".encode())
        for name in sorted(dsets):
            ds = dsets[name]
            h.update(f"{name}:{ds.shape}:{ds.dtype.str};".encode())
            _hash_dataset(h, ds, whole or name == "offsets")
    ident = {"path": str(p), "name": p.name, "size": st.st_size, "fingerprint": h.hexdigest()[:32],
             "fingerprint_scope": "all data" if whole else "shapes, offsets and sampled rows"}
    if reduction is not None:
        ident["reduction"] = reduction
    if compat is not None:
        ident["compatibility_mode"] = compat
    _identity_cache[key] = ident
    return dict(ident)

def _compat_of(f: h5py.File) -> str | None:
    v = f.attrs.get(COMPAT_ATTR)
    return None if v is None else str(v.decode() if isinstance(v, bytes) else v)


def recorded_compatibility_mode(path: str | os.PathLike) -> str | None:
    """A tokens file's record of TransformerLens's compatibility mode (`COMPAT_ATTR`: "on" / "off"), None without
    one."""
    with open_input(path) as f:
        return _compat_of(f)


_command: list[str] | None = None


def set_command(argv: list[str] | None) -> None:
    """Record the command line that provenance attributes report (the CLI sets it; default sys.argv)."""
    global _command
    _command = None if argv is None else [str(a) for a in argv]


def command_line() -> str:
    """The command line of this run, shell-quoted."""
    argv = _command if _command is not None else ([Path(sys.argv[0]).name] + sys.argv[1:] if sys.argv else [])
    return shlex.join(argv)


def provenance(inputs: tuple[str | os.PathLike, ...] = ()) -> dict[str, Any]:
    """Attributes saying which mhla, command and inputs (path, size, fingerprint) made a file."""
    ids = []
    for i in inputs:
        if i is None:
            continue
        try:
            ids.append(source_identity(i))
        except InputError:
            ids.append({"path": str(i)})
    return {
        "mhla_version": _version(),
        "mhla_command": command_line(),
        "mhla_inputs": json.dumps(ids),
        "mhla_created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
