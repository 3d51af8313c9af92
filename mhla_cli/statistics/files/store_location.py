"""Where a Zarr store is written: the output's checks, the temporary sibling it is written into, and the
commit that replaces an earlier store only once the new one is complete and verified.

A store (mhla_cli.statistics.files.zarr_store) is a directory or any fsspec URL with the suffix .zarr. An output
store may replace only an mhla features store (the root metadata's mhla_kind = "features": `store_kind`),
never a user's directory or file, an input, or a directory holding an input or held by one (`check_output`).
`commit` moves the written store in: the new store is verified first, the earlier one moved aside, the new
one moved in and verified in place, and only then is the old one removed; on any failure the old one is
put back. (On object stores a move is a copy: a reader there may see the store before the copy ends.)
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mhla_cli.errors import InputError
from mhla_cli.io import formats
from mhla_cli.signals import shield_signals

__all__ = ["SUFFIX", "check_output", "commit", "inside", "is_store", "remove", "require_zarr", "store_kind",
           "temporary"]

SUFFIX = ".zarr"


def is_store(path: Any) -> bool:
    """Whether `path` names a Zarr store (its suffix .zarr: a directory or an fsspec URL)."""
    return isinstance(path, (str, os.PathLike)) and str(path).rstrip("/").lower().endswith(SUFFIX)


def require_zarr() -> Any:
    """The zarr module, or an InputError with its install hint."""
    try:
        import zarr
    except ImportError:
        raise InputError("a Zarr store needs zarr, an optional dependency: "
                         "pip install 'zarr>=3' (mhla's [cluster] extra)") from None
    return zarr


def location(path: Any) -> str:
    """A store's path or URL as text, without a trailing slash."""
    return str(path).rstrip("/")


def is_local(where: str) -> bool:
    return "://" not in where or where.startswith("file://")


def local_path(where: str) -> Path:
    return Path(where[len("file://"):] if where.startswith("file://") else where)


def filesystem(where: str) -> Any:
    import fsspec

    return fsspec.core.url_to_fs(where)[0]


def _exists(where: str) -> bool:
    return local_path(where).exists() if is_local(where) else bool(filesystem(where).exists(where))


def inside(a: str, b: str) -> bool:
    """Whether the locations `a` and `b` are one or one lies inside the other (local paths resolved, symbolic
    links followed; URLs by their text)."""
    if is_local(a) and is_local(b):
        return formats.overlaps(local_path(a), local_path(b))
    a, b = a.rstrip("/") + "/", b.rstrip("/") + "/"
    return a.startswith(b) or b.startswith(a)


def store_kind(where: str) -> str | None:
    """The mhla_kind of the Zarr group at `where` from its root metadata (zarr.json, or .zattrs of format 2),
    without opening it as a store; None when there is no such metadata or it names no kind."""
    for name, attrs in (("zarr.json", lambda m: m.get("attributes", {})), (".zattrs", lambda m: m)):
        try:
            if is_local(where):
                text = (local_path(where) / name).read_bytes()
            else:
                text = filesystem(where).cat_file(f"{where}/{name}")
            kind = attrs(json.loads(text)).get("mhla_kind")
        except (OSError, ValueError, AttributeError, TypeError):
            continue
        return kind if isinstance(kind, str) else None
    return None


def check_replaceable(where: str) -> None:
    """Refuse (InputError) to replace anything at `where` but an mhla features store."""
    if _exists(where) and store_kind(where) != "features":
        raise InputError("output path exists and is not an mhla features store (no mhla_kind = 'features' in its "
                         "root metadata); it is left as it is: remove it or choose another -o path", where)


def check_output(out: Any, inputs: tuple[Any, ...] = ()) -> str:
    """A store to write: the suffix .zarr, zarr installed, (a local one) a writable parent directory, no input
    at, inside or around it, and nothing in its place but an mhla features store (`check_replaceable`);
    refused (InputError) before any work. Returns its location."""
    where = location(out)
    if not is_store(where):
        raise InputError(f"a Zarr store is named by the suffix {SUFFIX}", out)
    require_zarr()
    if is_local(where):
        o = local_path(where)
        if o.exists() and not o.is_dir():
            raise InputError("output path exists and is not a Zarr store (a directory)", out)
        formats.check_output_directory(o)
    for i in inputs:
        if i is not None and inside(location(i), where):
            raise InputError("output would overwrite an input (the same path, or one inside the other); choose "
                             "another -o path", out)
    check_replaceable(where)
    return where


def temporary(where: str) -> str:
    """A sibling of the target to write into (moved in by `commit`)."""
    return _sibling(where, f"tmp-mhla{SUFFIX}")


def _sibling(where: str, suffix: str) -> str:
    head, _, name = where.rpartition("/")
    tmp = f".{name}.{uuid.uuid4().hex[:12]}.{suffix}"
    return f"{head}/{tmp}" if head else tmp


def commit(tmp: str, where: str, verify: Callable[[str], None]) -> None:
    """Put the written store `tmp` at `where`. `tmp` is verified first (`verify` raises when it is not a
    complete store); an earlier store at `where` (only an mhla features store: `check_replaceable`) is moved
    aside, the new one moved in and verified in place, and only then is the old one removed. On a failure the
    old store is put back, and the new one left at `tmp` for the caller to remove."""
    verify(tmp)
    check_replaceable(where)
    aside = _sibling(where, "old-mhla")
    moved = _exists(where)
    target: str | Path
    src: str | Path
    old: str | Path
    if is_local(where):
        target, src, old = local_path(where), local_path(tmp), local_path(aside)
        move: Callable[[Any, Any], None] = os.replace
    else:
        fs = filesystem(where)
        target, src, old = where, tmp, aside

        def move(a: Any, b: Any) -> None:
            fs.mv(a, b, recursive=True)
    if moved:
        move(target, old)
    try:
        move(src, target)
        verify(where)
    except BaseException:
        with shield_signals():
            if _exists(where) and not _exists(tmp):
                move(target, src)
            if moved:
                move(old, target)
        raise
    if moved:
        remove(aside)


def remove(where: str) -> None:
    """Remove the store at `where`, if any (cleaning up: an error here is not reported)."""
    try:
        if is_local(where):
            shutil.rmtree(local_path(where), ignore_errors=True)
        else:
            fs = filesystem(where)
            if fs.exists(where):
                fs.rm(where, recursive=True)
    except Exception:  # noqa: BLE001 (cleaning up after a failure: the failure is what is reported)
        pass
