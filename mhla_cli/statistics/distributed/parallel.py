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

import builtins
import contextlib
import logging
import multiprocessing as mp
import operator
import os
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mhla_cli.errors import InputError
from mhla_cli.statistics.distributed.scheduler import SchedulerError, Watch, cluster_error, connect, current_timeout, wait_for_workers, watch

BACKENDS = ("process", "thread")
DEFAULT_BACKEND = "thread"
# Results in flight per worker: bounds memory (each may hold a psi x psi matrix or a chunk's output)
_WINDOW_PER_WORKER = 2


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
        self.watch: Watch | None = None

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
        name = str(self.scheduler) if isinstance(self.scheduler, str) else str(self._client.scheduler.address)
        try:
            wait_for_workers(self._client, self.timeout, name)
        except BaseException:
            self.__exit__()
            raise
        self.n_workers = max(1, len(self._client.scheduler_info().get("workers", {})))
        self.watch = watch(self._client, self.timeout, name)
        return self

    @property
    def client(self) -> Any:
        """The dask.distributed Client (while the map is open): for work other than a map (the tiles of
        mhla_cli.statistics.distributed.tiled_statistics)."""
        return self._client

    def __exit__(self, *exc: Any) -> None:
        if self.watch is not None:
            self.watch.stop()
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
            except BaseException as exc:
                if dm.watch is not None and dm.watch.fired is not None:
                    raise SchedulerError(dm.watch.fired, "workers") from None
                if isinstance(exc, InputError) or not isinstance(exc, Exception):
                    raise
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
