"""The memory budget (mhla_cli.linalg.memory): each command's need, and refusals before any work."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from mhla_cli.linalg import memory
from mhla_cli.statistics import ranges, stream
from mhla_cli.model import synthetic
from mhla_cli.cli import run
from mhla_cli.cli.options import in_options
from mhla_cli.errors import InputError, Refused
from mhla_cli.feature_map import n_features
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.accumulate import chunk_features
from mhla_cli.io.tokens import inspect_tokens
from mhla_cli.statistics.ranges import featurize_need


def test_check_memory_names_the_largest_d() -> None:
    budget = 2 * 2**30
    with pytest.raises(InputError, match=r"largest d that fits is (\d+)") as exc:
        memory.check_memory(30, budget_bytes=budget)
    import re

    fits = int(re.search(r"largest d that fits is (\d+)", exc.value.args[0]).group(1))
    assert memory.featurize_bytes(fits) <= budget < memory.featurize_bytes(fits + 1)
    memory.check_memory(fits, budget_bytes=budget)  # no error
    # K worker processes hold K accumulators (and the sum they are added into)
    with pytest.raises(InputError, match="4 workers"):
        memory.check_memory(fits, budget_bytes=budget, copies=4)


def test_needs_count_psi_by_psi_matrices() -> None:
    d, psi = 24, n_features(24)
    mat = 8 * psi * psi
    assert memory.matrix_bytes(d) == mat
    # featurize: the accumulator with its chunk buffers, then the accumulator + the derived own gram
    chunk = 300 * 2**20
    assert memory.featurize_bytes(d, chunk) == memory.accumulator_bytes(d) + mat + memory.SLACK_BYTES
    assert memory.featurize_bytes(d, 2 * mat) == memory.accumulator_bytes(d) + 2 * mat + memory.SLACK_BYTES
    # certify / fit: basis_gram and the factor (Lambda~ is basis_gram and 1 / N, no copy), within the
    # 3 psi x psi matrices of issue 15's acceptance
    assert memory.solve_bytes(d, memory.solve_kind(d, psi)) <= 2.5 * mat + memory.SLACK_BYTES
    assert memory.solve_kind(d, psi - 1) == "eigh"  # N < psi: singular for sure
    assert memory.solve_bytes(d, memory.solve_kind(d, psi - 1, command="fit")) > memory.solve_bytes(d, "eigh")
    assert memory.solve_kind(d, psi, ridge=0.1) == "ridge"
    assert memory.solve_bytes(d, "eigh") > memory.solve_bytes(d, "cholesky")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    ds, _ = synthetic.generate_teacher(3, 1, 80, 6, seed=3)
    root = tmp_path_factory.mktemp("mem")
    tokens = root / "tokens.h5"
    ds.save(tokens)
    feats = root / "feats.h5"
    assert run(["featurize", str(tokens), "-o", str(feats), "-q"]) == 0
    return tokens, feats


def _no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any pass over tokens or load of statistics fails the test: a refusal comes before the work."""
    def boom(*a: object, **k: object) -> None:
        raise AssertionError("work started before the memory check")

    monkeypatch.setattr(ranges, "estimate_basis", boom)
    monkeypatch.setattr(ranges, "accumulate_range", boom)
    monkeypatch.setattr(Features, "load", classmethod(boom))


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], path: Path, what: str) -> str:
    assert run(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"mhla: error: {path}: d = 3 needs psi = 18 features and about "), err[0]
    assert f"GiB for {what}," in err[0] and "largest d that fits is 2" in err[0], err[0]
    # beyond this machine: the cluster path, whose Gram stays tiled on the workers
    assert err[0].endswith("--scheduler (docs/cluster.md)"), err[0]
    return err[0]


@pytest.mark.parametrize("command", ["featurize", "certify", "fit"])
def test_refused_before_any_work(command: str, files: tuple[Path, Path], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    tokens, feats = files
    out = tmp_path / "out.h5"
    info = inspect_tokens(tokens)
    source, need = {"featurize": (tokens, featurize_need(info)),
                    "certify": (feats, stream.solve_need(feats)[1]),
                    "fit": (feats, stream.solve_need(feats, command="fit")[1])}[command]
    monkeypatch.setattr(memory, "available_memory", lambda: need(2) + 1)  # room for d = 2 only
    _no_work(monkeypatch)
    argv = {"featurize": ["featurize", str(tokens), "-o", str(out)], "certify": ["certify", str(feats)],
            "fit": ["fit", str(feats), "-o", str(out)]}[command]
    _refused(capsys, argv, source, command)
    assert not out.exists()


def test_certify_and_fit_of_tokens_count_the_pass_and_the_solve(files: tuple[Path, Path], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    tokens, _ = files
    d, need = stream.solve_need(tokens)
    info = inspect_tokens(tokens)
    assert need(d) >= featurize_need(info, derive=False)(d)
    assert need(d) >= memory.solve_bytes(d, memory.solve_kind(d, info.n_samples))
    monkeypatch.setattr(memory, "available_memory", lambda: need(2) + 1)
    _no_work(monkeypatch)
    _refused(capsys, ["certify", str(tokens)], tokens, "certify")
    _refused(capsys, ["fit", str(tokens), "-o", str(tmp_path / "m.h5")], tokens, "fit")


def test_a_ridge_fit_needs_more(files: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    _, feats = files
    plain = stream.solve_need(feats)[1](3)
    ridge = stream.solve_need(feats, ridge=0.5)[1]
    assert ridge(3) > plain
    monkeypatch.setattr(memory, "available_memory", lambda: ridge(2) + 1)
    _refused(capsys, ["fit", str(feats), "-o", str(tmp_path / "m.h5"), "--ridge", "0.5"], feats, "fit")


def test_workers_count_their_accumulators(files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, _ = files
    info = inspect_tokens(tokens)
    one, two = featurize_need(info), featurize_need(info, workers=2)
    assert two(3) > one(3)
    monkeypatch.setenv("MHLA_PARALLEL_BACKEND", "thread")
    monkeypatch.setattr(memory, "available_memory", lambda: two(2) + 1)
    with pytest.raises(InputError, match=r"for featurize \(2 workers\).*largest d that fits is 2") as exc:
        stream.featurize(tokens, workers=2)
    assert exc.value.path is not None and Path(exc.value.path) == tokens


def test_a_job_that_fits_runs(files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, _ = files
    need = featurize_need(inspect_tokens(tokens))
    monkeypatch.setattr(memory, "available_memory", lambda: need(3))
    feats = stream.featurize(tokens)
    assert feats.d == 3 and np.isfinite(feats.gram).all()


def test_loading_features_is_refused_up_front(files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """memory.check_load (the policy features_file.expect_features applies before reading): the psi x psi
    basis_gram, or only the stored block on the data's spans, plus a compact file's distinct entries."""
    _, feats = files
    monkeypatch.setattr(memory, "available_memory", lambda: memory.load_bytes(2) + 1)
    with pytest.raises(InputError, match=r"d = 3 needs psi = 18 features .* GiB for loading the statistics, "
                                         r".*largest d that fits is 2") as exc:
        Features.load(feats)
    assert Path(exc.value.path) == feats
    memory.check_load(3, block=4)  # a block of 4 features fits
    with pytest.raises(InputError, match="for loading the statistics"):
        memory.check_load(3, block=4, pairs_bytes=memory.load_bytes(3))
    assert memory.merge_bytes(3) == 4 * memory.matrix_bytes(3) + memory.SLACK_BYTES


# ------------------------------------------------------------- one psi x psi array per load


def test_certify_and_fit_never_read_the_own_gram(files: tuple[Path, Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from mhla_cli.statistics.files import features_file

    _, feats = files
    def boom(self: object) -> None:
        raise AssertionError("the own gram was read")

    monkeypatch.setattr(features_file.StoredGram, "read", boom)
    loaded = Features.load(feats)
    assert isinstance(loaded._gram_raw, features_file.StoredGram)
    assert loaded.basis_gram.flags.c_contiguous and loaded.basis_gram.flags.writeable
    assert run(["certify", str(feats), "-q"]) in (0, 1)
    assert run(["fit", str(feats), "-o", str(tmp_path / "m.h5"), "-q"]) == 0


def test_the_stored_gram_is_read_when_used(files: tuple[Path, Path], tmp_path: Path) -> None:
    import h5py
    import shutil

    _, feats = files
    with h5py.File(feats, "r") as f:
        stored = f["gram"][()]
    loaded = Features.load(feats)
    assert np.array_equal(loaded.gram, stored)
    copy = tmp_path / "copy.h5"
    shutil.copy(feats, copy)
    lazy = Features.load(copy)
    with h5py.File(copy, "a") as f:
        f["gram"][0, 0] += 1.0
    st = os.stat(copy)
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # whatever the clock's resolution
    with pytest.raises(InputError, match="changed since its statistics were loaded"):
        lazy.gram


def test_featurize_derives_the_own_gram_when_used(files: tuple[Path, Path]) -> None:
    from mhla_cli.statistics import basis
    from mhla_cli.statistics.files import features_file

    tokens, _ = files
    feats = stream.featurize(tokens)
    assert feats._gram_raw is features_file.DERIVED and feats.moments is not None
    M = basis.feature_map(feats.basis)  # H(X A) = M H(X): the own Gram is M^-1 G_b M^-T
    want = np.linalg.solve(M, np.linalg.solve(M, feats.basis_gram).T)
    assert np.abs(feats.gram - want).max() <= 1e-10 * np.abs(want).max() and feats._gram_raw is feats.gram


# ------------------------------------------------------------- wide tokens, refused up front


def test_floor_cut_and_message() -> None:
    """check_floor refuses just above floor_bytes(d), lets through at it; the line names d, psi, the
    GiB, the largest d whose featurize fits and mhla reduce."""
    d = 40
    need = memory.floor_bytes(d)
    memory.check_floor(d, "t.h5", budget_bytes=need)  # just inside: no error
    with pytest.raises(Refused) as exc:
        memory.check_floor(d, "t.h5", "featurize", budget_bytes=need - 1)
    # the library names no option: its remedy is machine-readable, the CLI words it in its options
    assert exc.value.remedies == {"reduce": {"tokens": "t.h5", "dim": memory.SUGGESTED_DIM}}
    assert "--" not in str(exc.value) and f"reduce_tokens(t.h5, REDUCED, dim={memory.SUGGESTED_DIM})" in str(exc.value)
    msg = str(in_options(exc.value))
    fits = memory.largest_d(need - 1, below=d)
    assert memory.featurize_bytes(fits) <= need - 1 < memory.featurize_bytes(fits + 1)
    assert f"d = {d} needs psi = {n_features(d)} features and at least {need / 2**30:.1f} GiB for featurize" in msg
    assert f"the largest d that fits is {fits}" in msg
    # the remedy first, with a sensible d (SUGGESTED_DIM; fewer when memory takes fewer), the memory fact after
    assert fits > memory.SUGGESTED_DIM
    assert msg.startswith(f"t.h5: the tokens are too wide (d = {d}): map them to a few dimensions first: mhla reduce t.h5 "
                          f"-o REDUCED.h5 --dim {memory.SUGGESTED_DIM} ")
    assert msg.index("mhla reduce") < msg.index("GiB")
    small = memory.floor_bytes(memory.SUGGESTED_DIM + 5)
    with pytest.raises(Refused) as exc:
        memory.check_floor(d, "t.h5", budget_bytes=small)
    k = memory.largest_d(small, below=d)
    assert k < memory.SUGGESTED_DIM and f"--dim {k} " in str(in_options(exc.value))
    # below every command's own need: the floor never refuses what the full check lets through
    for k in (3, 8, 16, 24):
        assert memory.floor_bytes(k) <= memory.featurize_bytes(k)


def test_library_entry_points_check_the_floor(files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, _ = files
    monkeypatch.setattr(memory, "available_memory", lambda: memory.floor_bytes(3) - 1)
    _no_work(monkeypatch)
    with pytest.raises(InputError, match="at least .* GiB for featurize"):
        stream.featurize(tokens)
    with pytest.raises(InputError, match="reduce_tokens"):
        stream.solve_need(tokens)
    with pytest.raises(InputError, match="reduce_tokens|not even d = 1"):
        chunk_features(np.ones((4, 3)), np.array([0, 2, 4]), None, 3)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The issue's case: 384-dim hidden states of N = 50 sequences (10 tokens each)."""
    from mhla_cli import write_tokens

    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("wide") / "w384.h5"
    write_tokens(path, [rng.standard_normal((10, 384)).astype(np.float32) for _ in range(50)],
                 targets=rng.standard_normal((50, 384)))
    return path


@pytest.mark.parametrize("command", ["featurize", "certify", "fit"])
def test_wide_tokens_refused_in_one_line_with_a_small_peak(command: str, wide: Path, tmp_path: Path) -> None:
    """d = 384 (psi = 28385280): one line naming d, psi, the memory, the largest d and mhla reduce;
    exit 2; a peak RSS below 300 MB (the span pass alone would hold 4 x 40.7 GiB)."""
    import subprocess
    import sys

    out = tmp_path / "out.h5"
    argv = {"featurize": ["featurize", str(wide), "-o", str(out)], "certify": ["certify", str(wide)],
            "fit": ["fit", str(wide), "-o", str(out)]}[command]
    wrapper = ("import resource, subprocess, sys\n"
               "r = subprocess.run([sys.executable, '-m', 'mhla_cli', *sys.argv[1:]], capture_output=True, text=True)\n"
               "sys.stderr.write(r.stderr)\n"
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)\n"
               "sys.exit(r.returncode)\n")
    r = subprocess.run([sys.executable, "-c", wrapper, *argv], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1, err
    line = err[0]
    # the remedy first (mhla reduce to a sensible d, not the largest that memory allows), the memory fact after
    assert line.startswith(f"mhla: error: {wide}: the tokens are too wide (d = 384): map them to a few dimensions "
                           f"first: mhla reduce {wide} -o REDUCED.h5 --dim {memory.SUGGESTED_DIM} "), line
    assert "; d = 384 needs psi = 28385280 features and at least " in line, line
    assert f"GiB for {command}," in line and "the largest d that fits is " in line, line
    rss = float(r.stdout.strip().splitlines()[-1])
    assert rss < 300 * 1e6 / 2**20, f"peak RSS {rss:.0f} MiB"
    assert not out.exists()
