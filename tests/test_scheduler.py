"""A Dask scheduler and the bounds on every wait on it (mhla_cli.statistics.distributed.scheduler): the worker-memory cut
just inside and outside, what the cluster's failures mean, a scheduler file, the probe of an address that
never answers and the watch of a cluster whose workers stop running. The commands' lines and exit codes:
tests/test_cluster.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mhla_cli.errors import InputError
from mhla_cli.statistics.distributed import scheduler

distributed = pytest.importorskip("dask.distributed")
from distributed.scheduler import KilledWorker  # noqa: E402 (after the skip)


def test_the_worker_memory_cut(client) -> None:
    """A worker whose limit is exactly what TILES_PER_TASK tiles per thread need beside what it holds, within
    WORKER_MEMORY_FRACTION of it, passes; a byte less is refused; a worker without a limit is not counted."""
    tile, used = 2**20, 10 * 2**20
    need = scheduler.tile_memory_needed(tile, 2, used)
    assert need == pytest.approx((used + 2 * scheduler.TILES_PER_TASK * tile) / scheduler.WORKER_MEMORY_FRACTION)
    def worker(limit: float) -> dict:
        return {"memory_limit": limit, "nthreads": 2, "metrics": {"memory": used}}
    assert scheduler.short_workers({"a": worker(need)}, tile) == []
    assert scheduler.short_workers({"a": worker(need - 1), "b": worker(0), "c": worker(need)}, tile) == \
        [("a", need - 1, need)]
    scheduler.check_worker_memory(client, 8)  # the fixture's workers: limits far above a tile of one number
    limit = max(w["memory_limit"] for w in client.scheduler_info()["workers"].values())
    with pytest.raises(scheduler.SchedulerError, match=r"cannot hold a tile of the Gram .* needs 4 tiles per thread"):
        scheduler.check_worker_memory(client, limit)


def test_failures_on_the_cluster_are_input_errors() -> None:
    """KilledWorker, a lost scheduler and a chunk its codec cannot decode: exit-2 errors with the reason."""
    killed = scheduler.cluster_error(KilledWorker("mhla-potrf-1", SimpleNamespace(address="tcp://10.0.0.1:1"), 3))
    assert isinstance(killed, scheduler.SchedulerError) and killed.cause == "killed"
    assert "ran out of memory or crashed" in str(killed)
    codec = scheduler.cluster_error(RuntimeError("Zstd decompression error: invalid input data"))
    assert isinstance(codec, InputError) and "the store is corrupted" in str(codec)
    assert scheduler.cluster_error(ZeroDivisionError("ours")) is None



def test_a_scheduler_file_gives_its_address(tmp_path: Path) -> None:
    f = tmp_path / "scheduler.json"
    f.write_text(json.dumps({"type": "Scheduler", "address": "tcp://10.0.0.5:8786"}))
    assert scheduler.scheduler_address(str(f)) == ("tcp://10.0.0.5:8786", str(f))
    assert scheduler.scheduler_address("tcp://10.0.0.5:8786") == ("tcp://10.0.0.5:8786", None)
    for text, match in (("{not json", "cannot read as a Dask scheduler file"), ("{}", "names no scheduler address"),
                        ("[1]", "cannot read as a Dask scheduler file")):
        f.write_text(text)
        with pytest.raises(InputError, match=match):
            scheduler.scheduler_address(str(f))
    with pytest.raises(InputError, match="no such scheduler file"):
        scheduler.scheduler_address(str(tmp_path / "none.json"))


def test_the_probe_is_bounded(tmp_path: Path) -> None:
    """A closed port is refused at once ("connect"); a port that accepts and never answers within the timeout
    ("answer"), not later."""
    t0 = time.monotonic()
    with pytest.raises(scheduler.SchedulerError, match="cannot connect") as closed:
        scheduler.probe("tcp://127.0.0.1:9", 30.0)
    assert closed.value.cause == "connect" and time.monotonic() - t0 < 5
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    try:
        t0 = time.monotonic()
        with pytest.raises(scheduler.SchedulerError, match="no Dask scheduler answered within 1 s") as hole:
            scheduler.probe(f"tcp://127.0.0.1:{server.getsockname()[1]}", 1.0)
        assert hole.value.cause == "answer" and 0.9 <= time.monotonic() - t0 < 15
    finally:
        server.close()


def test_a_cluster_whose_workers_stop_running_is_refused_within_the_timeout(tmp_path: Path) -> None:
    """Its one worker paused (as Dask pauses a worker over its memory) once the work has begun: the wait on
    the results ends within the timeout with SchedulerError "workers", instead of lasting for ever."""
    from distributed.core import Status

    from mhla_cli.model import synthetic
    from mhla_cli.statistics.distributed import tiled_statistics

    ds, _ = synthetic.generate_teacher(3, 2, 3000, "3:8", seed=0)
    ds.save(tmp_path / "data.h5", dtype="float64")
    # no memory limit: no memory monitor, which would resume a worker paused by hand
    cl = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None,
                                  memory_limit=0)
    client = distributed.Client(cl)

    done = threading.Event()

    def pause_at_the_first_task() -> None:  # and resume it after 25 s: without the watch the test fails, not hangs
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)):
                client.run(lambda dask_worker: setattr(dask_worker, "status", Status.paused))
                break
            time.sleep(0.005)
        done.wait(25)
        client.run(lambda dask_worker: setattr(dask_worker, "status", Status.running))
    pauser = threading.Thread(target=pause_at_the_first_task, daemon=True)
    try:
        t0 = time.monotonic()
        pauser.start()
        with scheduler.scheduler_timeout(2.0), pytest.raises(scheduler.SchedulerError,
                                                              match="no running worker for 2 s") as exc:
            tiled_statistics.accumulate(tmp_path / "data.h5", client, chunk_size=5)
        assert exc.value.cause == "workers" and time.monotonic() - t0 < 2.0 + 20
    finally:
        done.set()
        pauser.join(30)
        client.close()
        cl.close()
