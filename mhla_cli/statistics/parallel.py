"""Parallel and distributed evaluation of the chunk accumulation: local worker pools and Dask.

Every backend is a `map(fn, items)` returning results in order, plus two attributes used to plan
the work: `n_workers` (how many sample ranges to cut) and `local_copies` (how many psi x psi accumulators
live in this machine's memory at once). The function mapped is always `stream.accumulate_range` (or the
prediction of a sample range); workers open the HDF5 file themselves from its path, never an h5py handle.

Local pools use threads by default (MHLA_PARALLEL_BACKEND=process switches to processes): threads with
BLAS pinned to one thread each match or beat processes (numpy releases the GIL in BLAS and in the
large ufuncs of the hot path; benchmarks/bench_workers.py, docs/performance.md), with no worker
start-up and no copies of the psi x psi partial sums between processes.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import contextvars
import json
import logging
import multiprocessing as mp
import operator
import os
import socket
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import InputError

BACKENDS = ("process", "thread")
DEFAULT_BACKEND = "thread"
# Results in flight per worker: bounds memory (each may hold a psi x psi matrix or a chunk's output)
_WINDOW_PER_WORKER = 2
# Seconds a Dask scheduler has, by default, to answer a connection and to have a running worker
# (`scheduler_timeout`, the CLI's --scheduler-timeout): a cluster that does neither is refused within it.
SCHEDULER_TIMEOUT = 60.0
# A task on the Gram's tiles holds at most this many tiles at once per thread of its worker (a tile, its
# distinct entries K; in the Cholesky's trailing update a tile and three operands).
TILES_PER_TASK = 4
# The share of a worker's memory limit its tasks may fill: Dask pauses a worker at 80 % of its limit by
# default (distributed.worker.memory.pause), and a paused worker runs nothing.
WORKER_MEMORY_FRACTION = 0.8


class SchedulerError(InputError):
    """A Dask cluster that cannot run the work: `cause` is "connect" (no scheduler at the address),
    "answer" (something accepts connections but does not answer as a scheduler), "workers" (no running
    worker), "memory" (workers too small for a tile), "killed" (a worker died running a task) or "lost"
    (the connection to the scheduler dropped). The message names no option of the CLI (which adds its
    remedy by `cause`)."""

    def __init__(self, message: str, cause: str, path: str | os.PathLike | None = None) -> None:
        super().__init__(message, path)
        self.cause = cause


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


def _pin_blas(n_threads: int) -> None:
    """Worker initialiser: limit every BLAS/OpenMP pool of this process to `n_threads`."""
    from threadpoolctl import threadpool_limits

    global _LIMITS  # keep the limiter alive for the worker's lifetime
    _LIMITS = threadpool_limits(limits=n_threads)


_LIMITS: Any = None


def _mp_context() -> Any:
    """fork when this process has no other threads (fast start, no re-import of __main__), else a
    forkserver that has imported mhla (forking a multi-threaded process is unsafe)."""
    methods = mp.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return mp.get_context("fork")
    if "forkserver" in methods:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["mhla_cli.statistics.stream", "mhla_cli.model.model"])
        return ctx
    return mp.get_context("spawn")


class SerialMap:
    """The builtin map (or any user map) with the planning attributes of a backend."""

    def __init__(self, fn_map: Callable[..., Iterable[Any]] = builtins.map, n_workers: int = 1) -> None:
        self._map = fn_map
        self.n_workers = n_workers
        self.local_copies = 1

    def __call__(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        return iter(self._map(fn, items))


class ProcessMap:
    """An ordered map over a pool of K processes, each with single-threaded BLAS.

    At most 2K results are in flight, so memory stays bounded however many items there are.
    """

    def __init__(self, workers: int, blas_threads: int = 1) -> None:
        self.n_workers = self.local_copies = max(1, int(workers))
        self._blas_threads = blas_threads
        self._pool: Any = None

    def __enter__(self) -> ProcessMap:
        self._pool = _mp_context().Pool(self.n_workers, initializer=_pin_blas, initargs=(self._blas_threads,))
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self._pool.close()
        else:
            self._pool.terminate()
        self._pool.join()

    def __call__(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        pending: deque[Any] = deque()
        window = _WINDOW_PER_WORKER * self.n_workers
        for item in items:
            pending.append(self._pool.apply_async(fn, (item,)))
            if len(pending) >= window:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class ThreadMap:
    """An ordered map over K threads of this process, BLAS limited to one thread while it runs.

    numpy releases the GIL in BLAS and large ufuncs, so threads share the work without copies.
    """

    def __init__(self, workers: int) -> None:
        self.n_workers = self.local_copies = max(1, int(workers))
        self._pool: ThreadPoolExecutor | None = None
        self._limits: Any = None

    def __enter__(self) -> ThreadMap:
        from threadpoolctl import threadpool_limits

        self._limits = threadpool_limits(limits=1)
        self._pool = ThreadPoolExecutor(self.n_workers, thread_name_prefix="mhla-worker")
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        assert self._pool is not None
        if exc_type is not None:
            CANCEL.set()  # running passes stop at their next chunk
        try:
            self._pool.shutdown(wait=True, cancel_futures=exc_type is not None)
        finally:
            CANCEL.clear()
            self._limits.restore_original_limits()

    def __call__(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        assert self._pool is not None
        pending: deque[Any] = deque()
        window = _WINDOW_PER_WORKER * self.n_workers
        for item in items:
            pending.append(self._pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


class DaskMap:
    """Map over a dask.distributed cluster; the results are tree-reduced with `+` on the cluster.

    `scheduler` is a scheduler address (tcp://host:8786), a path to a scheduler file (JSON written
    by `dask scheduler --scheduler-file`), "local" (a LocalCluster with one single-threaded worker
    process per core) or "local:K" (K workers), or an existing `distributed.Client`. Calling the map
    yields one item: the sum of fn over all items (so it fits `stream.accumulate_ranges`).
    """

    local_copies = 1  # partial sums live on the workers; only the total comes back

    def __init__(self, scheduler: Any, timeout: float | None = None) -> None:
        self.scheduler = scheduler
        self.timeout = current_timeout() if timeout is None else float(timeout)
        self.n_workers = 1
        self._client: Any = None
        self._cluster: Any = None
        self._own_client = False

    def __enter__(self) -> DaskMap:
        if isinstance(self.scheduler, str) and (self.scheduler == "local" or self.scheduler.startswith("local:")):
            _parse_local(self.scheduler)  # a malformed spec is a usage error, Dask installed or not
        try:
            from dask.distributed import Client, LocalCluster
        except ImportError:
            raise InputError("a Dask scheduler needs Dask, an optional dependency: "
                             "pip install 'dask[distributed]>=2023.1' (mhla's [dask] extra)") from None
        sched = self.scheduler
        if isinstance(sched, Client):
            self._client = sched
        else:
            sched = str(sched)
            if sched == "local" or sched.startswith("local:"):
                k = _parse_local(sched)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # "Port 8787 is already in use"
                    self._cluster = LocalCluster(n_workers=k, threads_per_worker=1, processes=True,
                                                 dashboard_address=None, silence_logs=logging.ERROR)
                self._client = Client(self._cluster)
            else:
                self._client = connect(sched, self.timeout)
            self._own_client = True
        try:
            wait_for_workers(self._client, self.timeout, str(self.scheduler))
        except BaseException:
            self.__exit__()
            raise
        self.n_workers = max(1, len(self._client.scheduler_info().get("workers", {})))
        return self

    @property
    def client(self) -> Any:
        """The dask.distributed Client (while the map is open): for work other than a map (the tiles of
        mhla_cli.statistics.tiled_gram)."""
        return self._client

    def __exit__(self, *exc: Any) -> None:
        if self._own_client:
            with contextlib.suppress(Exception):
                self._client.close()
        if self._cluster is not None:
            with contextlib.suppress(Exception):
                self._cluster.close()

    def __call__(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        items = list(items)
        if not items:
            return
        futures = self._client.map(fn, items, pure=False)
        # pairwise sums on the workers: depth log2(len(items)), the client receives one result
        while len(futures) > 1:
            nxt = [self._client.submit(operator.add, a, b, pure=False)
                   for a, b in zip(futures[0::2], futures[1::2])]
            if len(futures) % 2:
                nxt.append(futures[-1])
            futures = nxt
        yield futures[0].result()


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


def wait_for_workers(client: Any, timeout: float, name: str) -> None:
    """Wait at most `timeout` seconds for a running worker; SchedulerError "workers" when none comes."""
    try:
        client.wait_for_workers(1, timeout=timeout)
    except (OSError, TimeoutError) as exc:
        workers = client.scheduler_info().get("workers", {})
        paused = [(a, w) for a, w in workers.items() if w.get("status") == "paused"]
        if paused and len(paused) == len(workers):
            address, w = paused[0]
            used = float((w.get("metrics") or {}).get("memory") or 0)
            raise SchedulerError(f"scheduler {name}: its {len(workers)} worker(s) are paused, their memory over "
                                 f"Dask's pause threshold (e.g. {address}: {used / 2**20:.0f} MiB used of a "
                                 f"{float(w.get('memory_limit') or 0) / 2**20:.0f} MiB limit), so they can hold no "
                                 "tile and would run nothing", "memory") from None
        raise SchedulerError(f"scheduler {name}: no running worker within {timeout:g} s "
                             f"({' '.join(str(exc).split())})", "workers") from None


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


def _parse_local(spec: str) -> int:
    if spec == "local":
        return max(1, os.cpu_count() or 1)
    try:
        k = int(spec.split(":", 1)[1])
    except ValueError:
        k = 0
    if k < 1:
        raise InputError(f"scheduler {spec}: expected local or local:K with K >= 1")
    return k


def resolve_workers(workers: int) -> int:
    """K >= 1 workers; 0 means one per core."""
    if workers < 0:
        raise InputError(f"workers must be >= 0 (0: one per core), got {workers}")
    return workers or max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def make_map(workers: int = 1, scheduler: Any = None, map: Callable[..., Iterable[Any]] | None = None,  # noqa: A002
             backend: str | None = None, timeout: float | None = None) -> Iterator[Any]:
    """The map to evaluate passes with: Dask if `scheduler` (refused within `timeout` seconds, default the one
    in force: `scheduler_timeout`, when it does not answer or has no running worker; the cluster's failures
    raised in the block become InputErrors: `cluster_error`), a local pool if workers > 1.

    `backend` is "thread" or "process" (default: MHLA_PARALLEL_BACKEND, else thread).
    """
    if map is not None:
        # a user's map (e.g. a pool's): cut a few sample ranges per core, its workers are unknown
        yield map if hasattr(map, "n_workers") else SerialMap(map, n_workers=os.cpu_count() or 1)
        return
    if scheduler is not None:
        with DaskMap(scheduler, timeout) as dm:
            try:
                yield dm
            except InputError:
                raise
            except Exception as exc:  # noqa: BLE001 (what the cluster's failures mean: cluster_error)
                mapped = cluster_error(exc)
                if mapped is None:
                    raise
                raise mapped from exc
        return
    k = resolve_workers(workers)
    if k == 1:
        yield SerialMap()
        return
    backend = backend or os.environ.get("MHLA_PARALLEL_BACKEND", DEFAULT_BACKEND)
    if backend not in BACKENDS:
        raise InputError(f"unknown parallel backend '{backend}', expected one of {', '.join(BACKENDS)}")
    pool = ProcessMap(k) if backend == "process" else ThreadMap(k)
    with pool:
        yield pool


# --------------------------------------------------------------------------------------------
# prediction ranges (streamed by model.forward.predict_file)
# --------------------------------------------------------------------------------------------


class Cancelled(Exception):
    """Raised by `accumulate_range` in worker threads once `CANCEL` is set (the caller is stopping)."""


# Set by a thread pool that is shutting down after an error or an interrupt, so that its running
# passes stop at the next chunk instead of finishing their sample ranges.
CANCEL = threading.Event()
