"""Faults: Ctrl-C / SIGTERM during real runs, write errors, and interrupted writes leave nothing behind."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import OUTPUT_KINDS, previous_output
from mhla_cli.io import formats
from mhla_cli import signals
from mhla_cli.cli import run
from mhla_cli.model.heads import W_from_p
from mhla_cli.model.model import Model
from mhla_cli.feature_map import n_features

MHLA = [sys.executable, "-m", "mhla_cli"] if (Path(formats.__file__).parent / "__main__.py").exists() else ["mhla"]

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux /proc")


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tokens file that takes a few seconds to featurize (d = 8, psi = 288), and a d = 8 model."""
    d = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(0)
    N, n, dim = 480_000, 4, 8  # ~3 s of work: the signal always lands mid-run
    data = d / "big.h5"
    with h5py.File(data, "w") as f:
        f["tokens"] = rng.standard_normal((N, n, dim)).astype(np.float32)
        f["targets"] = rng.standard_normal((N, dim))
    coef = rng.standard_normal((dim, n_features(dim)))
    Model(coef=coef, W=W_from_p(coef), d=dim).save(d / "model.h5")
    return data, d / "model.h5"


def _wait_until_reading(proc: subprocess.Popen, path: Path, timeout: float = 30.0) -> None:
    """Block until the process has `path` open (it has imported everything and is working)."""
    target = str(path.resolve())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"finished before the signal: {proc.communicate()}"
        try:
            for fd in os.listdir(f"/proc/{proc.pid}/fd"):
                try:
                    if os.readlink(f"/proc/{proc.pid}/fd/{fd}") == target:
                        return
                except OSError:
                    pass
        except OSError:
            pass
        time.sleep(0.02)
    raise AssertionError("the process never opened its input")


def _temps(out: Path) -> list[Path]:
    return list(out.parent.glob(f".{out.name}.*.tmp-mhla"))


@pytest.mark.parametrize("command,sig,existing", [
    ("featurize", signal.SIGINT, False),
    ("featurize", signal.SIGTERM, True),
    ("predict", signal.SIGINT, True),
    ("predict", signal.SIGTERM, False),
])
def test_interrupt_real_run(command: str, sig: int, existing: bool, big: tuple[Path, Path],
                            tmp_path: Path) -> None:
    data, model = big
    out = tmp_path / "out.h5"
    if existing:
        previous = previous_output(out, OUTPUT_KINDS[command])
    argv = (["featurize", str(data), "-o", str(out), "--chunk-size", "2000"] if command == "featurize" else
            ["predict", str(model), str(data), "-o", str(out), "--all-positions", "--chunk-size", "2000"])
    proc = subprocess.Popen([*MHLA, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_until_reading(proc, data)
        time.sleep(0.2)
        sent = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    elapsed = time.monotonic() - sent
    assert proc.returncode == 128 + sig, err
    print(f"stopped {elapsed:.2f} s after the signal")
    assert elapsed < 5.0, f"took {elapsed:.1f} s to stop"
    assert "Traceback" not in err
    assert err.strip() == ("mhla: interrupted" if sig == signal.SIGINT else "mhla: terminated")
    assert not _temps(out)
    if existing:
        assert out.read_bytes() == previous
    else:
        assert not out.exists()


def _limit_file_size(limit: int):
    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


@pytest.mark.parametrize("existing", [False, True])
def test_write_error_is_clean(existing: bool, tmp_path: Path) -> None:
    """A write that fails half way (file-size limit, like a full disk) through libhdf5 (predict's
    streamed output) and through the in-memory writer (features): exit 2, one line, nothing left."""
    rng = np.random.default_rng(1)
    data = tmp_path / "data.h5"
    with h5py.File(data, "w") as f:
        f["tokens"] = rng.standard_normal((3000, 5, 4))
        f["targets"] = rng.standard_normal((3000, 4))
    coef = rng.standard_normal((4, n_features(4)))
    model = tmp_path / "model.h5"
    Model(coef=coef, W=W_from_p(coef), d=4).save(model)
    for argv in (["featurize", str(data), "-o", "{out}"],
                 ["predict", str(model), str(data), "-o", "{out}", "--all-positions"]):
        out = tmp_path / f"{argv[0]}.h5"
        if existing:
            previous = previous_output(out, OUTPUT_KINDS[argv[0]])
        args = [a.format(out=out) for a in argv]
        r = subprocess.run([*MHLA, *args], capture_output=True, text=True, preexec_fn=_limit_file_size(12_000),
                           timeout=60)
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip() == f"mhla: error: {out}: cannot write output (File too large); nothing was written"
        assert not _temps(out)
        if existing:
            assert out.read_bytes() == previous
        else:
            assert not out.exists()


# --------------------------------------------------------------------------------------------
# in-process: interrupts and failures while the output is being written
# --------------------------------------------------------------------------------------------


@pytest.fixture
def small(tmp_path: Path) -> Path:
    rng = np.random.default_rng(2)
    data = tmp_path / "data.h5"
    with h5py.File(data, "w") as f:
        f["tokens"] = rng.standard_normal((50, 3, 2))
        f["targets"] = rng.standard_normal((50, 2))
    return data


@pytest.mark.parametrize("exc,code", [(KeyboardInterrupt(), 130), (signals.Interrupted(signal.SIGINT), 130),
                                      (signals.Interrupted(signal.SIGTERM), 143),
                                      (OSError(28, "No space left on device"), 2)])
def test_interrupt_while_writing(exc: BaseException, code: int, small: Path, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    out = tmp_path / "feats.h5"
    previous = previous_output(out, "features")
    real_fill = formats.writing._fill

    def fill_then_fail(f, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        real_fill(f, *args, **kwargs)
        raise exc

    monkeypatch.setattr(formats.writing, "_fill", fill_then_fail)
    assert run(["featurize", str(small), "-o", str(out), "-q"]) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 1
    if isinstance(exc, signals.Interrupted):
        assert err.strip() == ("mhla: interrupted" if code == 130 else "mhla: terminated")
    if code == 2:
        assert err.strip() == f"mhla: error: {out}: cannot write output (No space left on device); nothing was written"
    assert out.read_bytes() == previous
    assert not _temps(out)


def test_not_enough_disk_space_is_refused_up_front(small: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    out = tmp_path / "feats.h5"
    real = os.statvfs

    class Tiny:
        def __init__(self, st: os.statvfs_result) -> None:
            self.f_frsize, self.f_bavail = st.f_frsize, 1

    monkeypatch.setattr(formats.writing.os, "statvfs", lambda p: Tiny(real(p)))
    assert run(["featurize", str(small), "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mhla: error: {out}: not enough disk space: the output needs about ")
    assert not out.exists() and not _temps(out)


def test_second_sigterm_during_cleanup_is_ignored() -> None:
    """Only the first SIGTERM raises, so `finally` blocks can finish removing temporary files."""
    raised = []
    with signals.sigterm_as_exception():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        except signals.Interrupted as exc:
            raised.append(exc.signum)
            os.kill(os.getpid(), signal.SIGTERM)  # ignored while cleaning up
            time.sleep(0.05)
    assert raised == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


def test_swallowed_signal_still_stops_the_output(small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys) -> None:
    """A SIGTERM whose exception is swallowed (raised inside a destructor, say) must still end the
    run with 143 and commit nothing."""
    out = tmp_path / "feats.h5"
    real_fill = formats.writing._fill

    def fill_and_swallow(*args, **kwargs):  # noqa: ANN002, ANN003
        real_fill(*args, **kwargs)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        except signals.Interrupted:
            pass  # e.g. Python printing "Exception ignored in __del__" and going on

    monkeypatch.setattr(formats.writing, "_fill", fill_and_swallow)
    assert run(["featurize", str(small), "-o", str(out), "-q"]) == 143
    assert capsys.readouterr().err.strip() == "mhla: terminated"
    assert not out.exists() and not _temps(out)
    assert signals._signal_received is None  # reset once the run is over


def test_signal_in_a_finalizer_is_not_printed(capsys) -> None:
    """An Interrupted raised while a generator is finalized cannot propagate: it is not printed as
    'Exception ignored', and check_interrupted() re-raises it at the next chunk."""
    import gc

    def gen():  # noqa: ANN202
        try:
            yield 1
            yield 2
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)

    with signals.sigterm_as_exception():
        g = gen()
        next(g)
        del g
        gc.collect()
        assert signals._signal_received == signal.SIGTERM
        with pytest.raises(signals.Interrupted):
            signals.check_interrupted()
    assert capsys.readouterr().err == ""
