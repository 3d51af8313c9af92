"""Workers, threads and Dask give the serial statistics and predictions (up to summation order)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import assert_same_stats, relerr
from mhla_cli.linalg import memory
from mhla_cli.statistics.distributed import parallel
from mhla_cli.statistics import stream
from mhla_cli.io.tokens import inspect_tokens
from mhla_cli.statistics.ranges import accumulate_range, featurize_need
from mhla_cli.model import synthetic
from mhla_cli.cli import run
from mhla_cli.model.forward import predict_file
from mhla_cli.solve.lstsq import fit
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.stream import featurize

@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """d = 3, ragged lengths 1..15, N = 211, float32."""
    ds, _ = synthetic.generate_teacher(3, 2, 211, "1:15", seed=7)
    path = tmp_path_factory.mktemp("par") / "data.h5"
    ds.save(path, dtype="float32")
    return path


@pytest.fixture(scope="module")
def serial(data: Path) -> Features:
    return featurize(data, chunk_size=13)


@pytest.mark.parametrize("backend", ["process", "thread"])
def test_workers_equal_serial(data: Path, serial: Features, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MHLA_PARALLEL_BACKEND", backend)
    par = featurize(data, chunk_size=13, workers=2)
    assert_same_stats(par, serial)
    assert par.sample_range == (0, 211) and par.source == serial.source


def test_cli_workers_file_equals_serial(data: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "serial.h5", tmp_path / "pool.h5"
    assert run(["featurize", str(data), "-o", str(a), "-q", "--chunk-size", "20"]) == 0
    assert run(["featurize", str(data), "-o", str(b), "-q", "--chunk-size", "20", "--workers", "2"]) == 0
    assert_same_stats(Features.load(b), Features.load(a))


@pytest.mark.parametrize("backend", ["process", "thread"])
def test_predict_workers_equal_serial(data: Path, serial: Features, tmp_path: Path, backend: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MHLA_PARALLEL_BACKEND", backend)
    model = fit(serial)
    a = predict_file(model, data, tmp_path / "a.h5", all_positions=True, chunk_size=30)
    b = predict_file(model, data, tmp_path / "b.h5", all_positions=True, chunk_size=30, workers=2)
    assert a.mse == pytest.approx(b.mse, rel=1e-12)
    with h5py.File(tmp_path / "a.h5") as fa, h5py.File(tmp_path / "b.h5") as fb:
        for name in ("predictions", "outputs"):
            assert relerr(fb[name][()], fa[name][()]) < 1e-12, name
        np.testing.assert_array_equal(fa["offsets"][()], fb["offsets"][()])


def test_cli_predict_workers(data: Path, serial: Features, tmp_path: Path) -> None:
    model = tmp_path / "model.h5"
    fit(serial).save(model)
    for name, extra in (("s.h5", []), ("p.h5", ["--workers", "2"])):
        assert run(["predict", str(model), str(data), "-o", str(tmp_path / name), "-q", "--chunk-size", "40",
                    *extra]) == 0
    with h5py.File(tmp_path / "s.h5") as fa, h5py.File(tmp_path / "p.h5") as fb:
        assert relerr(fb["predictions"][()], fa["predictions"][()]) < 1e-12


def test_worker_errors_reach_the_user(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    X = np.random.default_rng(0).standard_normal((60, 4, 2))
    X[47, 2, 1] = np.nan
    path = tmp_path / "nan.h5"
    with h5py.File(path, "w") as f:
        f["tokens"] = X
    assert run(["featurize", str(path), "-o", str(tmp_path / "f.h5"), "--workers", "2", "--chunk-size", "5"]) == 2
    assert "sample 47" in capsys.readouterr().err
    assert not (tmp_path / "f.h5").exists()


def test_option_errors(data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "f.h5")
    assert run(["featurize", str(data), "-o", out, "--workers", "2", "--scheduler", "local"]) == 2
    assert "cannot be combined" in capsys.readouterr().err
    assert run(["featurize", str(data), "-o", out, "--scheduler", "local:0"]) == 2
    assert "local:K with K >= 1" in capsys.readouterr().err
    assert run(["featurize", str(data), "-o", out, "--workers", "-1"]) == 2


def test_missing_dask_is_a_clear_error(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "dask.distributed", None)  # import fails as if not installed
    assert run(["featurize", str(data), "-o", str(tmp_path / "f.h5"), "--scheduler", "local"]) == 2
    assert "pip install 'dask[distributed]>=2023.1' (mhla's [dask] extra)" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ Dask


@pytest.fixture(scope="module")
def dask_cluster():
    distributed = pytest.importorskip("dask.distributed")
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                       dashboard_address=None)
    client = distributed.Client(cluster)
    yield cluster, client
    client.close()
    cluster.close()


def test_dask_equals_serial(data: Path, serial: Features, dask_cluster, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    cluster, client = dask_cluster
    # library: an existing client; many spans, tree-reduced on the workers
    par = featurize(data, chunk_size=13, scheduler=client)
    assert_same_stats(par, serial)
    # CLI: the scheduler's address
    out = tmp_path / "dask.h5"
    assert run(["featurize", str(data), "-o", str(out), "--scheduler", cluster.scheduler_address,
                "--chunk-size", "13", "--json", "-q"]) == 0
    assert json.loads(capsys.readouterr().out)["n_samples"] == 211
    assert_same_stats(Features.load(out), serial)


def test_dask_shard_merge(data: Path, serial: Features, dask_cluster, tmp_path: Path) -> None:
    cluster, _ = dask_cluster
    parts = []
    for i in range(2):
        parts.append(tmp_path / f"p{i}.h5")
        assert run(["featurize", str(data), "--shard", f"{i}/2", "-o", str(parts[-1]), "-q",
                    "--scheduler", cluster.scheduler_address, "--chunk-size", "9"]) == 0
    assert run(["merge", *map(str, parts), "-o", str(tmp_path / "m.h5"), "-q"]) == 0
    assert_same_stats(Features.load(tmp_path / "m.h5"), serial)


def test_dask_local_cluster_from_the_cli(data: Path, serial: Features, tmp_path: Path) -> None:
    pytest.importorskip("dask.distributed")
    out = tmp_path / "local.h5"
    assert run(["featurize", str(data), "-o", str(out), "-q", "--scheduler", "local:1", "--chunk-size", "50"]) == 0
    assert_same_stats(Features.load(out), serial)


def test_unreachable_scheduler(data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("dask.distributed")
    import dask

    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        code = run(["featurize", str(data), "-o", str(tmp_path / "f.h5"), "--scheduler", "tcp://127.0.0.1:9"])
    assert code == 2
    assert "cannot connect to a Dask scheduler" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- memory


def test_featurize_and_fit_refuse_a_d_that_does_not_fit(data: Path, serial: Features, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    feats = tmp_path / "feats.h5"
    serial.save(feats)
    info = inspect_tokens(data)
    for args, need in ((["featurize", str(data), "-o", str(tmp_path / "f.h5")], featurize_need(info)),
                       (["fit", str(feats), "-o", str(tmp_path / "m.h5")], stream.solve_need(feats, command="fit")[1]),
                       (["certify", str(data)], stream.solve_need(data)[1])):
        budget = need(2) + 1  # d = 3 data, room for d = 2 only
        monkeypatch.setattr(memory, "available_memory", lambda budget=budget: budget)
        assert run(args) == 2
        err = capsys.readouterr().err
        assert "largest d that fits is 2" in err, (args, err)


def test_interrupt_stops_thread_workers(data: Path, serial: Features, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MHLA_PARALLEL_BACKEND", "thread")
    seen = []

    def progress(n: int) -> None:
        seen.append(n)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        featurize(data, chunk_size=3, workers=2, progress=progress)
    assert len(seen) == 1 and not parallel.CANCEL.is_set()
    # a cancelled pass stops at its next chunk; the flag does not leak into later runs
    parallel.CANCEL.set()
    try:
        with pytest.raises(parallel.Cancelled):
            accumulate_range(inspect_tokens(data), (0, 211), 10)
    finally:
        parallel.CANCEL.clear()
    assert_same_stats(featurize(data, chunk_size=13, workers=2), serial)
