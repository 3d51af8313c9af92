"""The manifest of a file mhla writes: a checksum of every dataset (of every tile of a Zarr store's Gram) and one
over the header attributes, kept in the attribute `mhla_manifest` and compared as each piece is read (docs/formats.md,
"The manifest"). A missing, truncated, edited or foreign piece is then an InputError "the file (store) is
corrupted: <what>", never numbers read as if mhla had written them.

The checksum of an array is the SHA-256 of its shape and its bytes in C order, as float64 for floating-point data
and int64 for integers and booleans (so it is the same whether a dataset is read in its stored type or as
float64); rows may be fed in blocks (`Hasher`). The header's is the SHA-256 of the canonical JSON of every root
attribute but the manifest. Files mhla wrote in a format before MANIFEST_FORMAT have none: they are read with an
`UnverifiedFileWarning`; a file that claims MANIFEST_FORMAT or later and has none is refused; a file the user made
(no `mhla_format_version`, e.g. a heads file of V and Q) has none and needs none.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...errors import InputError, UnverifiedFileWarning

# The root attribute holding the manifest (JSON).
MANIFEST_ATTR = "mhla_manifest"
# The format version from which every file of MANIFEST_KINDS (and every Zarr store) carries a manifest.
MANIFEST_FORMAT = 6
# The kinds of file whose writer (formats.write_file) seals them; tokens and predictions files carry none (a
# user's tokens file has none either: they are checked finite as they stream).
MANIFEST_KINDS = ("features", "model", "heads", "probes", "blocks")
HASH = "sha256"
# Arrays larger than this are hashed a block of rows at a time.
HASH_BLOCK_BYTES = 16 << 20


def _canonical(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.kind == "f":
        return np.ascontiguousarray(a, dtype="<f8")
    if a.dtype.kind in "iub":
        return np.ascontiguousarray(a, dtype="<i8")
    return np.ascontiguousarray(a)


class Hasher:
    """The checksum of an array of `shape` fed in blocks of whole rows, first row first."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.h = hashlib.new(HASH)
        self.h.update(repr(tuple(int(s) for s in shape)).encode())

    def update(self, block: np.ndarray) -> None:
        self.h.update(_canonical(block).data.cast("B"))

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def digest(a: np.ndarray) -> str:
    """The checksum of an array (module docstring); a large one fed in blocks of rows (no copy of its size)."""
    a = np.asarray(a)
    h = Hasher(a.shape)
    if a.ndim < 1 or a.nbytes <= HASH_BLOCK_BYTES:
        h.update(a)
    else:
        rows = max(1, HASH_BLOCK_BYTES // max(1, a[:1].nbytes))
        for r0 in range(0, a.shape[0], rows):
            h.update(a[r0:r0 + rows])
    return h.hexdigest()


def plain(v: Any) -> Any:
    """An attribute value as JSON: NumPy scalars and arrays as Python numbers and lists, bytes as text."""
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, np.ndarray):
        return [plain(x) for x in v.tolist()] if v.ndim else plain(v.item())
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return v


def attrs_digest(attrs: Mapping[str, Any]) -> str:
    """The checksum of the header: every attribute but the manifest, as canonical JSON."""
    values = {str(k): plain(v) for k, v in attrs.items() if k != MANIFEST_ATTR}
    text = json.dumps(values, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.new(HASH, text.encode()).hexdigest()


def seal(attrs: Mapping[str, Any], arrays: Mapping[str, tuple[tuple[int, ...], str]],
         tiles: Mapping[str, str] | None = None) -> str:
    """The manifest (JSON) of a file with these attributes (as read back) and arrays (name -> (shape, checksum));
    `tiles`: "i,j" -> the checksum of that tile of a store's Gram."""
    man: dict[str, Any] = {"hash": HASH, "attrs": attrs_digest(attrs),
                           "datasets": {k: {"shape": [int(s) for s in shape], "digest": h}
                                        for k, (shape, h) in sorted(arrays.items())}}
    if tiles is not None:
        man["tiles"] = dict(sorted(tiles.items()))
    return json.dumps(man, sort_keys=True)


def corrupted(what: str, path: str | os.PathLike | None, store: bool = False) -> InputError:
    """The error of a piece that is not what mhla wrote."""
    return InputError(f"the {'store' if store else 'file'} is corrupted: {what}", path)


def load(attrs: Mapping[str, Any], kind: str | None, path: str | os.PathLike | None,
         store: bool = False) -> dict[str, Any] | None:
    """The manifest of a file (None for a file of a kind or format without one, warned of), its header checked:
    an InputError when it is missing from a file of format MANIFEST_FORMAT or later, unreadable, or does not
    match the attributes."""
    raw = attrs.get(MANIFEST_ATTR)
    if raw is None:
        if not store and kind not in MANIFEST_KINDS:
            return None
        version = attrs.get("mhla_format_version")
        try:
            version = None if version is None else int(np.asarray(version).reshape(()))
        except (TypeError, ValueError):
            version = None
        if version is None and not store:  # a file the user made (no mhla attributes): nothing to check it against
            return None
        if version is not None and version >= MANIFEST_FORMAT:
            raise corrupted(f"it has no manifest ('{MANIFEST_ATTR}'), which every file of format version "
                            f"{MANIFEST_FORMAT} or later has", path, store)
        warnings.warn(UnverifiedFileWarning(
            f"{path}: written before mhla format {MANIFEST_FORMAT} (no manifest): its integrity cannot be checked"),
            stacklevel=2)
        return None
    try:
        man = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
        ok = man.get("hash") == HASH and isinstance(man.get("datasets"), dict) and isinstance(man.get("attrs"), str)
    except (ValueError, AttributeError):
        ok = False
    if not ok:
        raise corrupted(f"its manifest ('{MANIFEST_ATTR}') is not readable", path, store)
    if attrs_digest(attrs) != man["attrs"]:
        raise corrupted("its attributes differ from those written (an edited or foreign header)", path, store)
    return man


def check_names(man: Mapping[str, Any], present: Mapping[str, tuple[int, ...]], path: str | os.PathLike | None,
                store: bool = False) -> None:
    """Every array of the manifest present with its shape, and no other (`present`: name -> shape)."""
    listed = man["datasets"]
    for name in sorted(listed):
        if name not in present:
            raise corrupted(f"'{name}' is missing", path, store)
        if list(present[name]) != listed[name]["shape"]:
            raise corrupted(f"'{name}' has shape {tuple(present[name])}, written as {tuple(listed[name]['shape'])}",
                            path, store)
    foreign = sorted(set(present) - set(listed))
    if foreign:
        raise corrupted(f"'{foreign[0]}' is not in its manifest (a foreign dataset)", path, store)


def check_array(man: Mapping[str, Any] | None, name: str, a: np.ndarray, path: str | os.PathLike | None,
                store: bool = False) -> None:
    """An array as read equals the one written (no-op for a file without a manifest)."""
    if man is None:
        return
    entry = man["datasets"].get(name)
    if entry is None:
        raise corrupted(f"'{name}' is not in its manifest (a foreign dataset)", path, store)
    if list(np.shape(a)) != entry["shape"] or digest(a) != entry["digest"]:
        raise corrupted(f"'{name}' differs from what was written (its checksum does not match)", path, store)


def tile_digest(man: Mapping[str, Any] | None, i: int, j: int) -> str | None:
    """The checksum written for tile (i, j) of a store's Gram (None without a manifest)."""
    if man is None:
        return None
    return man.get("tiles", {}).get(f"{i},{j}", "")


def check_tile(expected: str | None, i: int, j: int, tile: np.ndarray, path: str | os.PathLike | None) -> None:
    """A tile of a store's Gram as read equals the one written (`expected`: `tile_digest`; None: no manifest)."""
    if expected is not None and digest(tile) != expected:
        raise corrupted(f"tile ({i}, {j}) of the Gram differs from what was written (a missing, edited or "
                        "foreign chunk)", path, store=True)


def verify_file(f: Any, path: str | os.PathLike) -> None:
    """Every dataset of an open HDF5 file (h5py.File) against its manifest, read in blocks of rows (`mhla inspect`,
    which vouches for the whole file; the commands check what they read as they read it)."""
    raw = f.attrs.get(MANIFEST_ATTR)
    if raw is None:
        return
    try:
        man = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
        listed = man["datasets"]
    except (ValueError, TypeError, KeyError):
        raise corrupted(f"its manifest ('{MANIFEST_ATTR}') is not readable", path) from None
    for name, entry in sorted(listed.items()):
        if name not in f:
            raise corrupted(f"'{name}' is missing", path)
        ds = f[name]
        h = Hasher(ds.shape)
        if ds.ndim == 0 or ds.size == 0:
            h.update(np.asarray(ds[()]))
        else:
            rows = max(1, HASH_BLOCK_BYTES // max(1, 8 * int(np.prod(ds.shape[1:]))))
            for r0 in range(0, int(ds.shape[0]), rows):
                h.update(np.asarray(ds[r0:r0 + rows]))
        if list(ds.shape) != entry["shape"] or h.hexdigest() != entry["digest"]:
            raise corrupted(f"'{name}' differs from what was written (its checksum does not match)", path)
