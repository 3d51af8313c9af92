"""Dask task graphs built task by task with deterministic keys, run on any Dask scheduler.

The tiled algorithms of mhla_cli.linalg.tiled_matrix are written as plain dict graphs (dask's own graph
format: a key maps to a literal or to a task tuple `(function, *arguments)`, arguments that are keys
replaced by their values) and handed to a scheduler, never run by one of ours:

- a key is the string "mhla-<kind>-<token>-<indices>": the token is dask.base.tokenize of the inputs
  (the tiles' own tokens, the shift, the right-hand sides), the indices the tile's (or a running count
  per kind), so the same inputs give the same keys and different inputs different ones;
- `run` takes the graph to the scheduler: None runs it on dask's threaded local scheduler
  (dask.threaded.get), a function with dask's `get(dsk, keys)` signature runs it there (e.g.
  dask.local.get_sync), and a dask.distributed Client on its cluster (`Client.get`), the results kept
  there as futures;
- a tile may live in a store (`Stored`: a small reference, read by the task that needs it), and a
  graph built with a `spill` directory writes every tile it makes to a local Zarr array there and
  passes on the reference (`Spill`), so that a task holds only its own few tiles and nothing else
  stays in memory: the out-of-core path for one machine (tiled_matrix's module docstring gives the
  bound).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Spill", "Stored", "TaskGraph", "handle_token", "read_spilled", "release", "run"]


@dataclass(frozen=True)
class Stored:
    """A tile in a store, as a small reference that travels in place of the tile: `read(*args)` reads it."""

    read: Callable[..., np.ndarray]
    args: tuple[Any, ...]

    def load(self) -> np.ndarray:
        return self.read(*self.args)


@dataclass(frozen=True)
class Spill:
    """Where a task writes the tile it makes: the local Zarr array at `path` (its own store)."""

    path: str


def read_spilled(path: str) -> np.ndarray:
    """A tile written by `write_tile`: the Zarr array at path, read whole."""
    import zarr

    return np.asarray(zarr.open_array(store=path, mode="r")[...], dtype=np.float64)


def write_tile(spill: Spill, a: np.ndarray) -> Stored:
    """Write the tile a to its own Zarr array (one chunk, uncompressed: a scratch copy) and return its reference."""
    import zarr

    arr = zarr.create_array(store=spill.path, shape=a.shape, chunks=tuple(max(1, s) for s in a.shape), dtype="f8",
                            overwrite=True, compressors=None)
    arr[...] = a
    return Stored(read_spilled, (spill.path,))


def _call(fn: Callable[..., Any], out: Spill | None, *args: Any) -> Any:
    """Task: fn on its arguments, each `Stored` one read first; with `out`, an array result is written
    there and its reference returned (anything else, e.g. a failure passed on, is returned as it is)."""
    result = fn(*(a.load() if isinstance(a, Stored) else a for a in args))
    if out is not None and isinstance(result, np.ndarray):
        return write_tile(out, result)
    return result


def handle_token(handle: Any) -> Any:
    """What identifies a tile for the keys: a future's key, a reference's fields, an array's contents."""
    from dask.base import tokenize

    key = getattr(handle, "key", None)
    if key is not None and not isinstance(handle, np.ndarray):
        return ("future", key)
    return tokenize(handle)


class TaskGraph:
    """A dict graph being built (module docstring): `literal` puts a value under a key, `submit` a task;
    both return the key. `counts` counts the tasks by kind; `spill` a directory for the tiles made."""

    def __init__(self, token: str, spill: str | os.PathLike | None = None) -> None:
        self.token = token
        self.dsk: dict[Any, Any] = {}
        self.counts: dict[str, int] = {}
        self.spill = None if spill is None else os.path.join(os.fspath(spill), token)

    def literal(self, kind: str, value: Any, *at: int, token: str | None = None) -> str:
        """The key of a value (a tile's handle, a block of vectors): "mhla-<kind>-<token>-<at...>"."""
        key = _key(kind, token or self.token, at)
        self.dsk[key] = value
        return key

    def submit(self, kind: str, fn: Callable[..., Any], *args: Any, at: Sequence[int] | None = None,
               tile: str | None = None, raw: bool = False) -> str:
        """One task fn(*args) (keys among args replaced by their values), its key "mhla-<kind>-<token>-<at>"
        (the indices `at`, or a running count of the kind). `tile`: the task makes a tile, written under that name in the
        spill directory when the graph has one; `raw`: fn gets the arguments as they are (no reads)."""
        n = self.counts.get(kind, 0)
        self.counts[kind] = n + 1
        key = _key(kind, self.token, (n,) if at is None else at)
        if raw:
            self.dsk[key] = (fn, *args)
        else:
            out = Spill(os.path.join(self.spill, tile)) if tile is not None and self.spill is not None else None
            self.dsk[key] = (_call, fn, out, *args)
        return key


def _key(kind: str, token: str, at: Sequence[int]) -> str:
    return "-".join([f"mhla-{kind}-{token}", *(str(int(i)) for i in at)])


def _is_client(scheduler: Any) -> bool:
    return hasattr(scheduler, "gather") and hasattr(scheduler, "get") and hasattr(scheduler, "submit")


def run(scheduler: Any, graph: TaskGraph, gather: Sequence[Any], keep: Sequence[Any] = ()) -> tuple[list[Any], list[Any]]:
    """Run the graph for the keys `gather` (their values returned: small results) and `keep` (their
    handles returned: futures on a cluster, else the values themselves, arrays or Stored references).
    `scheduler`: None (dask's threaded scheduler), a dask `get` function, or a dask.distributed Client."""
    keys = list(gather) + list(keep)
    if not keys:
        return [], []
    if _is_client(scheduler):
        from distributed import wait

        futures = scheduler.get(graph.dsk, keys, sync=False)
        values = scheduler.gather(futures[:len(gather)])
        kept = futures[len(gather):]
        wait(kept)
        return list(values), list(kept)
    if scheduler is None:
        import dask.threaded

        get = dask.threaded.get
    else:
        get = scheduler
    values = list(get(graph.dsk, keys))
    return values[:len(gather)], values[len(gather):]


def release(handles: Any) -> None:
    """Drop the references to results kept on a cluster (the cluster frees them); arrays and references
    to stores need nothing (a spill directory is its owner's to remove)."""
    for h in handles:
        if hasattr(h, "release") and not isinstance(h, np.ndarray):
            h.release()
