"""A Dask scheduler for mhla's work, and bounds on every wait on it: connecting (an address or a scheduler file),
a running worker, workers that can hold a tile of the Gram, and results while no worker runs.

A cluster that cannot do the work is refused within the scheduler timeout (`scheduler_timeout`, default
SCHEDULER_TIMEOUT; the CLI's --scheduler-timeout) by a `SchedulerError` that names the cause; failures that
surface from the cluster during the work (a task whose workers all died, a lost scheduler, a chunk its codec
cannot decode) become InputErrors (`cluster_error`). Used by statistics.distributed.parallel.DaskMap, statistics.distributed.tiled_statistics
and solve.cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mhla_cli.errors import InputError

__all__ = ["SCHEDULER_TIMEOUT", "TILES_PER_TASK", "WAIT_POLL", "WATCH_INTERVAL", "WORKER_MEMORY_FRACTION", "SchedulerError", "Watch",
           "check_worker_memory", "cluster_error", "connect", "current_timeout", "probe", "scheduler_address",
           "scheduler_timeout", "short_workers", "tile_memory_needed", "wait_for_workers", "watch"]

# Seconds a Dask scheduler has, by default, to answer a connection and to have a running worker
# (`scheduler_timeout`, the CLI's --scheduler-timeout): a cluster that does neither is refused within it.
SCHEDULER_TIMEOUT = 60.0
# A task on the Gram's tiles holds at most this many tiles at once per thread of its worker (a tile, its
# distinct entries K; in the Cholesky's trailing update a tile and three operands).
TILES_PER_TASK = 4
# The share of a worker's memory limit its tasks may fill: Dask pauses a worker at 80 % of its limit by
# default (distributed.worker.memory.pause), and a paused worker runs nothing.
WORKER_MEMORY_FRACTION = 0.8
# How often (seconds) an open Dask map asks the scheduler whether a worker still runs (`Watch`), and how often the
# wait for a first worker asks it (`wait_for_workers`).
WATCH_INTERVAL = 1.0
WAIT_POLL = 0.1


class SchedulerError(InputError):
    """A Dask cluster that cannot run the work: `cause` is "connect" (no scheduler at the address),
    "answer" (something accepts connections but does not answer as a scheduler), "workers" (no running
    worker), "memory" (workers too small for a tile), "killed" (a worker died running a task) or "lost"
    (the connection to the scheduler dropped). The message names no option of the CLI (which adds its
    remedy by `cause`)."""

    def __init__(self, message: str, cause: str, path: str | os.PathLike | None = None) -> None:
        super().__init__(message, path)
        self.cause = cause


# The clients a `Watch` watches (by id).
_WATCHED: set[int] = set()

_TIMEOUT: contextvars.ContextVar[float] = contextvars.ContextVar("mhla_scheduler_timeout", default=SCHEDULER_TIMEOUT)


@contextlib.contextmanager
def scheduler_timeout(seconds: float | None) -> Iterator[float]:
    """Within the block, Dask maps wait at most `seconds` (None: SCHEDULER_TIMEOUT) for a scheduler to answer
    and for a running worker; yields the value in force."""
    t = SCHEDULER_TIMEOUT if seconds is None else float(seconds)
    if not (t > 0 and t < float("inf")):
        raise InputError(f"the scheduler timeout must be a finite number of seconds > 0, got {seconds}")
    token = _TIMEOUT.set(t)
    try:
        yield t
    finally:
        _TIMEOUT.reset(token)


def current_timeout() -> float:
    """The scheduler timeout in force (`scheduler_timeout`)."""
    return _TIMEOUT.get()



def scheduler_address(spec: str) -> tuple[str, str | None]:
    """(the address, the scheduler file it was read from or None) of a --scheduler that is an address or a
    scheduler file (the JSON that `dask scheduler --scheduler-file` writes)."""
    if not spec.endswith(".json"):
        return spec, None
    try:
        with open(spec) as fh:
            address = json.load(fh).get("address")
    except FileNotFoundError:
        raise InputError("no such scheduler file", spec) from None
    except (OSError, ValueError, AttributeError) as exc:
        raise InputError(f"cannot read as a Dask scheduler file ({' '.join(str(exc).split())})", spec) from None
    if not isinstance(address, str) or not address:
        raise InputError("names no scheduler address (its 'address' field)", spec)
    return address, spec


async def _identity(address: str, timeout: float, stage: dict[str, bool]) -> Any:
    """The scheduler's answer to `identity` over one connection (connecting bounded by `timeout`)."""
    from distributed.comm import connect as comm_connect

    comm = await comm_connect(address, timeout=timeout)
    stage["connected"] = True
    try:
        await comm.write({"op": "identity", "reply": True})
        return await comm.read()
    finally:
        comm.abort()


def probe(address: str, timeout: float, where: str | None = None) -> None:
    """Refuse (SchedulerError) an address where no scheduler answers within `timeout` seconds: nothing
    listens ("connect") or what listens does not answer as a Dask scheduler ("answer"). In-process
    schedulers (inproc://) are not probed."""
    if address.startswith("inproc://"):
        return
    stage = {"connected": False}  # set once something accepts the connection
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if address.startswith(("tcp://", "tls://")) and port.isdigit():  # a closed port: at once, not after retries
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        except OSError as exc:
            raise SchedulerError(f"scheduler {address}: cannot connect to a Dask scheduler "
                                 f"({exc.strerror or type(exc).__name__})", "connect", where) from None
        stage["connected"] = True

    def ask() -> Any:
        return asyncio.run(asyncio.wait_for(_identity(address, timeout, stage), timeout))

    with ThreadPoolExecutor(1, thread_name_prefix="mhla-probe") as pool:  # its own event loop, whoever calls
        try:
            pool.submit(ask).result()
        except (OSError, asyncio.TimeoutError, ValueError, TypeError) as exc:
            if stage["connected"]:
                raise SchedulerError(f"scheduler {address}: it accepts connections, but no Dask scheduler answered "
                                     f"within {timeout:g} s", "answer", where) from None
            reason = " ".join(str(exc).split()) or f"no connection within {timeout:g} s"
            raise SchedulerError(f"scheduler {address}: cannot connect to a Dask scheduler ({reason})", "connect",
                                 where) from None


def connect(spec: str, timeout: float) -> Any:
    """A dask.distributed Client of the scheduler `spec` (an address or a scheduler file), refused
    (SchedulerError) within about `timeout` seconds when none answers there."""
    from dask.distributed import Client

    address, where = scheduler_address(spec)
    probe(address, timeout, where)
    try:
        return Client(address, timeout=timeout)
    except (OSError, TimeoutError, ValueError) as exc:
        raise SchedulerError(f"scheduler {address}: cannot connect to a Dask scheduler "
                             f"({' '.join(str(exc).split())})", "connect", where) from None


def _starved(w: dict[str, Any]) -> bool:
    """Whether a worker record (Client.scheduler_info) is paused, or holds more than WORKER_MEMORY_FRACTION of its
    memory limit (Dask pauses it, or its nanny restarts it over and over)."""
    limit = float(w.get("memory_limit") or 0)
    used = float((w.get("metrics") or {}).get("memory") or 0)
    return w.get("status") == "paused" or (limit > 0 and used > WORKER_MEMORY_FRACTION * limit)


def wait_for_workers(client: Any, timeout: float, name: str) -> None:
    """Wait at most `timeout` seconds for a running worker (asking the scheduler every WAIT_POLL seconds);
    SchedulerError "memory" when the workers seen meanwhile were all starved of memory (`_starved`: paused, or
    restarted by their nanny as they start), else "workers"."""
    deadline = time.monotonic() + timeout
    starved = None
    while True:
        try:
            workers = client.scheduler_info().get("workers", {})
        except (OSError, TimeoutError):
            workers = {}
        if any(w.get("status", "running") == "running" and not _starved(w) for w in workers.values()):
            return
        starved = next(((a, w) for a, w in workers.items() if _starved(w)), starved)
        if time.monotonic() >= deadline:
            break
        time.sleep(min(WAIT_POLL, max(0.0, deadline - time.monotonic())))
    if starved is not None:
        address, w = starved
        used = float((w.get("metrics") or {}).get("memory") or 0)
        raise SchedulerError(f"scheduler {name}: no worker could run within {timeout:g} s: their memory is over "
                             f"Dask's limits (e.g. {address}: {used / 2**20:.0f} MiB used of a "
                             f"{float(w.get('memory_limit') or 0) / 2**20:.0f} MiB limit), so Dask pauses or restarts "
                             "them and they can hold no tile", "memory")
    raise SchedulerError(f"scheduler {name}: no running worker within {timeout:g} s", "workers")


def tile_memory_needed(tile_bytes: int, nthreads: int, used: float) -> float:
    """The memory limit (bytes) a worker of `nthreads` threads, holding `used` bytes now, needs to run tasks
    on tiles of `tile_bytes`: TILES_PER_TASK tiles per thread, within WORKER_MEMORY_FRACTION of its limit."""
    return (float(used) + max(1, int(nthreads)) * TILES_PER_TASK * float(tile_bytes)) / WORKER_MEMORY_FRACTION


def short_workers(workers: dict[str, Any], tile_bytes: int) -> list[tuple[str, float, float]]:
    """(address, memory limit, limit needed) of each worker of a scheduler's `workers` record (Client.scheduler_info)
    whose memory limit is below `tile_memory_needed`; workers without a limit are not counted."""
    short = []
    for address, w in workers.items():
        limit = float(w.get("memory_limit") or 0)
        used = float((w.get("metrics") or {}).get("memory") or 0)
        need = tile_memory_needed(tile_bytes, w.get("nthreads", 1), used)
        if limit > 0 and need > limit:
            short.append((address, limit, need))
    return short


def check_worker_memory(client: Any, tile_bytes: int) -> None:
    """Refuse (SchedulerError "memory"), before any task is submitted, a cluster whose workers' memory
    limits cannot hold the tasks on tiles of `tile_bytes` (`short_workers`): Dask would pause them, or
    restart them over and over, and the work would never end."""
    workers = client.scheduler_info().get("workers", {})
    short = short_workers(workers, tile_bytes)
    if short:
        address, limit, need = max(short, key=lambda s: s[2] - s[1])
        raise SchedulerError(f"{len(short)} of {len(workers)} workers cannot hold a tile of the Gram "
                             f"({tile_bytes / 2**20:.3g} MiB): a worker needs {TILES_PER_TASK} tiles per thread "
                             f"within {WORKER_MEMORY_FRACTION:.0%} of its memory limit beside what it holds, e.g. "
                             f"{address} a limit of {need / 2**20:.0f} MiB, not {limit / 2**20:.0f} MiB", "memory")


# Exceptions of the codecs that decode a store's chunks (their modules), and the words of their messages.
_CODEC_MODULES = ("numcodecs", "zarr", "zstandard", "blosc", "crc32c")
_CODEC_WORDS = ("decompress", "compressed data", "codec")


def cluster_error(exc: BaseException) -> InputError | None:
    """The InputError a failure on the cluster means, or None for one that is not the cluster's or the data's:
    a task whose workers all died (KilledWorker: SchedulerError "killed"), the scheduler lost (CommClosedError:
    "lost"), a chunk that its codec cannot decode (a corrupted store)."""
    name = type(exc).__name__
    text = " ".join(str(exc).split())
    if name == "KilledWorker":
        return SchedulerError(f"the workers died running a task ({text}): they ran out of memory or crashed",
                              "killed")
    if name == "CommClosedError":
        return SchedulerError(f"the connection to the scheduler was lost ({text})", "lost")
    module = type(exc).__module__ or ""
    if module.split(".")[0] in _CODEC_MODULES or any(w in text.lower() for w in _CODEC_WORDS):
        return InputError(f"the store is corrupted: a chunk cannot be decoded ({name}: {text})")
    return None



class Watch:
    """While a Dask map is open: a thread that asks the scheduler every WATCH_INTERVAL seconds for its running
    workers and, when there has been none for `timeout` seconds (all gone, or all paused by their memory),
    cancels the client's futures, so that the wait on a result ends; `fired` then says why (the map raises it
    as SchedulerError "workers")."""

    def __init__(self, client: Any, timeout: float, name: str) -> None:
        self.client, self.timeout, self.name = client, timeout, name
        self.fired: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mhla-cluster-watch", daemon=True)
        _WATCHED.add(id(client))
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        _WATCHED.discard(id(self.client))

    def _run(self) -> None:
        from distributed import Future

        since = None
        while not self._stop.wait(WATCH_INTERVAL):
            try:
                workers = self.client.scheduler_info().get("workers", {})
            except Exception:  # noqa: BLE001 (a scheduler that does not answer: the wait itself reports it)
                continue
            if any(w.get("status", "running") == "running" for w in workers.values()):
                since = None
                continue
            since = time.monotonic() if since is None else since
            if time.monotonic() - since >= self.timeout and not self._stop.is_set():
                self.fired = (f"scheduler {self.name}: no running worker for {self.timeout:g} s while mhla waited "
                              f"for results ({len(workers)} worker(s), none running: gone, or paused by their memory)")
                with contextlib.suppress(Exception):
                    self.client.cancel([Future(k, self.client) for k in list(self.client.futures)], force=True)
                return




def watch(client: Any, timeout: float, name: str) -> Watch | None:
    """A `Watch` of `client`, or None when one already watches it (a map opened inside another shares it)."""
    return None if id(client) in _WATCHED else Watch(client, timeout, name)
