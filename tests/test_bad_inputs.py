"""Every bad input gets exit 2 and one line ``mhla: error: <file>: <message>``, no traceback, and
nothing is written at -o (an existing file there stays byte-identical)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli.model import synthetic
from mhla_cli.cli import run
from mhla_cli.feature_map import n_features
from mhla_cli import export_heads
from mhla_cli.solve.lstsq import fit
from mhla_cli.statistics.stream import featurize
from conftest import unseal

from conftest import OUTPUT_KINDS, previous_output

PREVIOUS = b"previous output, must survive\n" * 10


@dataclass
class Base:
    """Valid files the bad ones are derived from (d = 2 data; a d = 3 model for the mismatch)."""

    dir: Path
    data: Path
    feats: Path
    model: Path
    heads: Path
    model3: Path
    tokens: np.ndarray
    offsets: np.ndarray
    targets: np.ndarray


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Base:
    d = tmp_path_factory.mktemp("base")
    ds, _ = synthetic.generate_teacher(2, 1, 40, "2:6", seed=1)
    data = d / "data.h5"
    ds.save(data, dtype="float64", compression=None)
    feats = featurize(data)
    feats.save(d / "feats.h5")
    model = fit(feats)
    model.save(d / "model.h5")
    export_heads(model).save(d / "heads.h5")
    ds3, _ = synthetic.generate_teacher(3, 1, 30, "3", seed=2)
    ds3.save(d / "data3.h5", dtype="float64")
    fit(featurize(d / "data3.h5")).save(d / "model3.h5")
    return Base(d, data, d / "feats.h5", d / "model.h5", d / "heads.h5", d / "model3.h5",
                ds.tokens, ds.offsets, ds.targets)


def h5(path: Path, **datasets: object) -> Path:
    with h5py.File(path, "w") as f:
        for k, v in datasets.items():
            f[k] = v
    return path


def copy_with(src: Path, dst: Path, edit: Callable[[h5py.File], None]) -> Path:
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        unseal(f)
        edit(f)
    return dst


def replace(name: str, value: np.ndarray) -> Callable[[h5py.File], None]:
    def edit(f: h5py.File) -> None:
        del f[name]
        f[name] = value
    return edit


# --------------------------------------------------------------------------------------------
# bad tokens files: each builder returns (path, expected message pattern)
# --------------------------------------------------------------------------------------------


def _nan_tokens(b: Base, p: Path) -> tuple[Path, str]:
    t = b.tokens.copy()
    t[b.offsets[7] + 1, 0] = np.nan  # second token of sample 7
    return h5(p, tokens=t, offsets=b.offsets, targets=b.targets), r"tokens of sample 7 contain NaN or Inf"


def _inf_targets(b: Base, p: Path) -> tuple[Path, str]:
    y = b.targets.copy()
    y[5, 1] = np.inf
    return h5(p, tokens=b.tokens, offsets=b.offsets, targets=y), r"targets of sample 5 contain NaN or Inf"


def _huge_tokens(b: Base, p: Path) -> tuple[Path, str]:
    t = b.tokens.copy()
    t[b.offsets[3], 1] = 1e200
    return h5(p, tokens=t, offsets=b.offsets, targets=b.targets), r"tokens of sample 3 contain values up to 1e\+200"


def _truncated(b: Base, p: Path) -> tuple[Path, str]:
    raw = b.data.read_bytes()
    p.write_bytes(raw[: len(raw) // 2])
    return p, r"truncated or corrupted"


def _corrupted_header(b: Base, p: Path) -> tuple[Path, str]:
    raw = bytearray(b.data.read_bytes())
    raw[8:200] = os.urandom(192)  # keep the signature, destroy the superblock and root group
    p.write_bytes(bytes(raw))
    return p, r"truncated or corrupted"


def _corrupted_chunk(b: Base, p: Path) -> tuple[Path, str]:
    # gzip-compressed tokens with garbage in the compressed data: the filter fails on reading.
    with h5py.File(p, "w") as f:
        f.create_dataset("tokens", data=b.tokens, compression="gzip", chunks=(len(b.tokens), 2))
        f["offsets"] = b.offsets
        f["targets"] = b.targets
        info = f["tokens"].id.get_chunk_info(0)
    raw = bytearray(p.read_bytes())
    start = info.byte_offset + 16
    raw[start:start + 64] = b"\x00" * 64
    p.write_bytes(bytes(raw))
    return p, r"truncated or corrupted"


TOKEN_CASES: dict[str, Callable[[Base, Path], tuple[Path, str]]] = {
    "missing": lambda b, p: (p, r"no such file"),
    "not_hdf5": lambda b, p: (p.write_text("x,y\n1,2\n") and p, r"not an HDF5 file"),
    "no_tokens": lambda b, p: (h5(p, stuff=np.ones(3)), r"expected a 'tokens' dataset.*found stuff"),
    "rank1": lambda b, p: (h5(p, tokens=np.ones(10), offsets=np.array([0, 10])), r"'tokens' has rank 1"),
    "rank4": lambda b, p: (h5(p, tokens=np.ones((2, 3, 4, 2))), r"'tokens' has rank 4"),
    "strings": lambda b, p: (h5(p, tokens=np.array([[b"a", b"b"]] * 4), offsets=np.array([0, 2, 4])),
                             r"dataset 'tokens' has dtype .*expected real numbers"),
    "complex": lambda b, p: (h5(p, tokens=b.tokens.astype(complex), offsets=b.offsets),
                             r"dataset 'tokens' has dtype complex128, expected real numbers"),
    "offsets_not_0": lambda b, p: (h5(p, tokens=b.tokens, offsets=b.offsets + 1),
                                   r"offsets\[0\] = 1, expected 0"),
    "empty_sequence": lambda b, p: (h5(p, tokens=b.tokens, offsets=np.insert(b.offsets, 3, b.offsets[3])),
                                    r"offsets not strictly increasing at sample 3 .*every sequence needs >= 1 token"),
    "offsets_not_T": lambda b, p: (h5(p, tokens=b.tokens, offsets=np.append(b.offsets[:-1], b.offsets[-1] - 1)),
                                   rf"offsets\[N\] = {b.offsets[-1] - 1} but tokens has T = {b.offsets[-1]} rows"),
    "offsets_float": lambda b, p: (h5(p, tokens=b.tokens, offsets=b.offsets.astype(float)),
                                   r"'offsets' must be a 1-d integer dataset"),
    "n0_dense": lambda b, p: (h5(p, tokens=np.zeros((0, 4, 2))), r"no samples"),
    "n0_ragged": lambda b, p: (h5(p, tokens=np.zeros((0, 2)), offsets=np.array([0])), r"no samples"),
    "nan_tokens": _nan_tokens,
    "inf_targets": _inf_targets,
    "huge_tokens": _huge_tokens,
    "targets_shape": lambda b, p: (h5(p, tokens=b.tokens, offsets=b.offsets, targets=np.ones((40, 2, 1))),
                                   r"'targets' has shape \(40, 2, 1\), expected \(N, d\) = \(40, 2\)"),
    # targets of another width are a valid file: fitted at their width (tests/test_output_width.py)
    "targets_wrong_n": lambda b, p: (h5(p, tokens=b.tokens, offsets=b.offsets, targets=b.targets[:-1]),
                                     r"'targets' has shape \(39, 2\), expected \(N, d\) = \(40, 2\)"),
    "truncated": _truncated,
    "corrupted_header": _corrupted_header,
    "corrupted_chunk": _corrupted_chunk,
    # d = 60 (psi = 109800): 180 GiB as full statistics; the spans of its 3 samples (a q x q partial
    # trace, q = 1830, found in ~1 s) make certify and fit small
    "d_too_large": lambda b, p: (h5(p, tokens=np.ones((3, 2, 60)), targets=np.ones((3, 60))),
                                 r"d = 60 needs psi = 109800 features.*the largest d that fits is \d+"),
}


def _features(edit: Callable[[h5py.File], None], msg: str) -> Callable[[Base, Path], tuple[Path, str]]:
    return lambda b, p: (copy_with(b.feats, p, edit), msg)


def _huge_features(b: Base, p: Path) -> tuple[Path, str]:
    def edit(f: h5py.File) -> None:
        psi = n_features(100)
        f.attrs["d"] = 100
        del f["gram"]
        f.create_dataset("gram", shape=(psi, psi), dtype="f8")  # never written: the file stays small
    return copy_with(b.feats, p, edit), r"d = 100 needs psi = 505000 features.*the largest d that fits is \d+"


FEATURE_CASES = {
    "gram_not_psi": _features(replace("gram", np.eye(5)), r"'gram' has shape \(5, 5\), expected \(psi, psi\) = \(6, 6\)"),
    "gram_not_symmetric": _features(replace("gram", np.triu(np.ones((6, 6)))), r"'gram' is not symmetric"),
    "gram_nan": _features(replace("gram", np.full((6, 6), np.nan)), r"'gram' contains NaN or Inf"),
    "moments_shape": _features(replace("moments", np.ones((5, 2))), r"'moments' has shape \(5, 2\), expected \(6, 2\)"),
    "features_truncated": lambda b, p: (p.write_bytes(b.feats.read_bytes()[:1500]) and p, r"truncated or corrupted"),
    "d_too_large": _huge_features,
}

MODEL_CASES = {
    "W_vs_coef": lambda b, p: (copy_with(b.model, p, replace("W", np.ones((4, 4)))),
                               r"'W' and 'coef' describe different functions"),
    "W_shape": lambda b, p: (copy_with(b.model, p, replace("W", np.ones((9, 9)))),
                             r"'W' has shape \(9, 9\), expected \(D_out d, d\^2\) = \(4, 4\)"),
    "coef_not_psi": lambda b, p: (copy_with(b.model, p, replace("coef", np.ones((2, 5)))),
                                  r"'coef' has 5 feature columns, which is not d\^2\(d\+1\)/2"),
}

HEADS_CASES = {
    "V_vs_Q": lambda b, p: (copy_with(b.heads, p, replace("Q", np.ones((1, 3, 3)))),
                            r"'Q' has shape \(1, 3, 3\) but 'V' has shape \(\d+, 2, 2\)"),
    "V_vs_Q_width": lambda b, p: (copy_with(b.heads, p, replace("V", np.ones((1, 2, 3)))),
                                  r"'Q' has shape \(\d+, 2, 2\) but 'V' has shape \(1, 2, 3\); expected V "
                                  r"\(H, d_out, d\) beside Q \(H, d, d\)"),
    "Q_not_square": lambda b, p: (copy_with(b.heads, p, replace("Q", np.ones((1, 2, 3)))),
                                  r"'Q' has shape \(1, 2, 3\), expected \(H, d, d\)"),
}


# --------------------------------------------------------------------------------------------
# the runner
# --------------------------------------------------------------------------------------------


def run_bad(capsys: pytest.CaptureFixture[str], argv: list[str], blamed: Path | None, pattern: str,
            out: Path | None) -> None:
    """Run twice (no file at -o, then an earlier output of the command's kind) and check exit 2, the message,
    no output."""
    for previous in (None, PREVIOUS) if out is not None else (None,):
        if out is not None and previous is not None:
            kind = "model" if "--witness" in argv else OUTPUT_KINDS.get(argv[0])
            if kind is not None and out.suffix in ("", ".h5", ".hdf5", ".hdf"):
                previous = previous_output(out, kind)
            if previous is PREVIOUS:
                out.write_bytes(previous)
        elif out is not None and out.is_file():
            out.unlink()
        capsys.readouterr()
        code = run(argv)
        cap = capsys.readouterr()
        assert code == 2, cap.err
        lines = cap.err.strip().splitlines()
        assert len(lines) == 1, cap.err
        assert "Traceback" not in cap.err
        if argv[0] == "inspect":  # --json: the report on stdout carries the same message
            rep = json.loads(cap.out)
            assert rep["valid"] is False and lines[0] == f"mhla: error: {rep['error']}"
            assert rep["exit_code"] == 2
        elif "--json" in argv:  # one error object on stdout, the stderr line's message
            rep = json.loads(cap.out)
            assert lines[0] == f"mhla: error: {rep['error']}" and rep["exit_code"] == 2
        else:
            assert cap.out == ""
        prefix = "mhla: error: " if blamed is None else f"mhla: error: {blamed}: "
        if blamed is None and lines[0].startswith(f"mhla: error: {argv[1]}: "):
            prefix = f"mhla: error: {argv[1]}: "
        assert lines[0].startswith(prefix), lines[0]
        assert re.search(pattern, lines[0][len(prefix):]), lines[0]
        if out is not None:
            if previous is None:
                assert not out.exists()
            else:
                assert out.read_bytes() == previous
            assert not list(out.parent.glob(f".{out.name}.*.tmp-mhla"))


@pytest.mark.parametrize("command", ["featurize", "certify", "fit", "predict", "inspect"])
@pytest.mark.parametrize("case", sorted(TOKEN_CASES))
def test_bad_tokens(case: str, command: str, base: Base, tmp_path: Path, capsys) -> None:
    bad, pattern = TOKEN_CASES[case](base, tmp_path / f"{case}.h5")
    out = tmp_path / "out.h5"
    argv = {"featurize": ["featurize", str(bad), "-o", str(out)],
            "certify": ["certify", str(bad)],
            "fit": ["fit", str(bad), "-o", str(out)],
            "predict": ["predict", str(base.model), str(bad), "-o", str(out)],
            "inspect": ["inspect", str(bad), "--json"]}[command]
    if command == "predict" and case == "d_too_large":
        pattern = r"the data have d = \d+ but the model has d = 2"  # predict needs no psi x psi statistics
    if case == "d_too_large" and command == "featurize":
        argv += ["--spans", "off"]  # every feature: psi x psi (the 3 samples' spans would fit: see below)
    if case == "d_too_large" and command in ("certify", "fit"):
        # the 3 samples span a tiny block of the 109800 features: the job fits, and is answered exactly
        code = run(argv)
        assert code == (1 if command == "certify" else 0), capsys.readouterr().err
        return
    if command == "inspect" and case == "d_too_large":
        pytest.skip("inspect validates the file, not the machine's memory")
    blamed: Path | None = bad
    if case == "d_too_large" and command != "predict":
        blamed = None  # stream.featurize raises check_memory's error without the file name (reported)
    run_bad(capsys, argv, blamed, pattern, out if "-o" in argv else None)


@pytest.mark.parametrize("command", ["fit", "certify", "inspect"])
@pytest.mark.parametrize("case", sorted(FEATURE_CASES))
def test_bad_features(case: str, command: str, base: Base, tmp_path: Path, capsys) -> None:
    bad, pattern = FEATURE_CASES[case](base, tmp_path / f"{case}.h5")
    out = tmp_path / "out.h5"
    argv = {"fit": ["fit", str(bad), "-o", str(out)], "certify": ["certify", str(bad), "--json"],
            "inspect": ["inspect", str(bad), "--json"]}[command]
    run_bad(capsys, argv, bad, pattern, out if command == "fit" else None)


@pytest.mark.parametrize("command", ["predict", "export-heads", "inspect"])
@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_bad_model(case: str, command: str, base: Base, tmp_path: Path, capsys) -> None:
    bad, pattern = MODEL_CASES[case](base, tmp_path / f"{case}.h5")
    out = tmp_path / "out.h5"
    argv = {"predict": ["predict", str(bad), str(base.data), "-o", str(out)],
            "export-heads": ["export-heads", str(bad), "-o", str(out)],
            "inspect": ["inspect", str(bad), "--json"]}[command]
    run_bad(capsys, argv, bad, pattern, None if command == "inspect" else out)


@pytest.mark.parametrize("case", sorted(HEADS_CASES))
def test_bad_heads(case: str, base: Base, tmp_path: Path, capsys) -> None:
    bad, pattern = HEADS_CASES[case](base, tmp_path / f"{case}.h5")
    out = tmp_path / "out.h5"
    run_bad(capsys, ["predict", str(bad), str(base.data), "-o", str(out)], bad, pattern, out)
    run_bad(capsys, ["inspect", str(bad), "--json"], bad, pattern, None)


def test_predict_with_other_d(base: Base, tmp_path: Path, capsys) -> None:
    out = tmp_path / "pred.h5"
    run_bad(capsys, ["predict", str(base.model3), str(base.data), "-o", str(out)], base.data,
            r"the data have d = 2 but the model has d = 3", out)


def test_wrong_kind(base: Base, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out.h5"
    run_bad(capsys, ["featurize", str(base.model), "-o", str(out)], base.model, r"is a model file, expected tokens", out)
    run_bad(capsys, ["predict", str(base.data), str(base.data), "-o", str(out)], base.data,
            r"is a tokens file, expected a model or heads file", out)


# --------------------------------------------------------------------------------------------
# bad -o paths
# --------------------------------------------------------------------------------------------


def _commands(base: Base, out: Path) -> list[list[str]]:
    return [["featurize", str(base.data), "-o", str(out)], ["fit", str(base.feats), "-o", str(out)],
            ["export-heads", str(base.model), "-o", str(out)],
            ["predict", str(base.heads), str(base.data), "-o", str(out)],
            ["generate", "teacher", "-o", str(out), "--dim", "2", "--heads", "1", "--n-samples", "5"]]


def test_output_in_missing_directory(base: Base, tmp_path: Path, capsys) -> None:
    out = tmp_path / "nope" / "out.h5"
    for argv in _commands(base, out):
        run_bad(capsys, argv, out, r"output directory '.*nope' does not exist", None)
        assert not out.parent.exists()


def test_output_is_a_directory(base: Base, tmp_path: Path, capsys) -> None:
    out = tmp_path / "adir"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    for argv in _commands(base, out):
        run_bad(capsys, argv, out, r"output path is a directory", None)
        assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_output_is_a_device(base: Base, capsys) -> None:
    # As root, renaming over /dev/null would replace the device: refused up front.
    run_bad(capsys, ["featurize", str(base.data), "-o", "/dev/null"], Path("/dev/null"),
            r"not a regular file", None)
    assert Path("/dev/null").is_char_device()


def test_input_as_its_own_output(base: Base, tmp_path: Path, capsys) -> None:
    data = tmp_path / "data.h5"
    shutil.copy(base.data, data)
    feats = tmp_path / "feats.h5"
    shutil.copy(base.feats, feats)
    link = tmp_path / "alias.h5"
    os.link(data, link)
    before = data.read_bytes(), feats.read_bytes()
    for argv, blamed in ((["featurize", str(data), "-o", str(data)], data),
                         (["featurize", str(data), "-o", str(link)], link),  # a hard link to the input
                         (["fit", str(feats), "-o", str(feats)], feats),
                         (["predict", str(base.heads), str(data), "-o", str(data)], data)):
        run_bad(capsys, argv, blamed, r"output would overwrite an input file", None)
    assert (data.read_bytes(), feats.read_bytes()) == before


def test_unknown_option_is_a_usage_error(base: Base, capsys) -> None:
    assert run(["featurize", str(base.data), "--no-such-option"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mhla: error: featurize: ") and "no-such-option" in err[0]


# --------------------------------------------------------------------------------------------
# integer tokens
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint16"])
def test_integer_tokens_equal_float64(dtype: str, tmp_path: Path, capsys) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 7, size=60)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(0 if dtype.startswith("u") else -5, 6, size=(int(offsets[-1]), 3))
    targets = rng.integers(0 if dtype.startswith("u") else -3, 4, size=(60, 3))
    ints = h5(tmp_path / "ints.h5", tokens=tokens.astype(dtype), offsets=offsets, targets=targets.astype(dtype))
    floats = h5(tmp_path / "floats.h5", tokens=tokens.astype(np.float64), offsets=offsets,
                targets=targets.astype(np.float64))
    for src in (ints, floats):
        assert run(["featurize", str(src), "-o", str(src.with_suffix(".feats.h5")), "-q"]) == 0
    a = h5py.File(ints.with_suffix(".feats.h5"), "r")
    b = h5py.File(floats.with_suffix(".feats.h5"), "r")
    with a, b:
        for name in ("gram", "moments", "target_gram", "token_gram", "last_token_gram"):
            assert a[name].dtype == np.float64
            np.testing.assert_array_equal(a[name][()], b[name][()])
    assert run(["inspect", str(ints)]) == 0


# --------------------------------------------------------------------------------------------
# HDF5 file locking (shared cluster filesystems)
# --------------------------------------------------------------------------------------------


def test_many_readers_share_a_file(base: Base, capsys) -> None:
    """Readers take a shared lock: another reader holding one does not block mhla."""
    import fcntl

    with open(base.data, "rb") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_SH)
        with h5py.File(base.data, "r"):
            assert run(["certify", str(base.data), "--json", "-q"]) == 0
    capsys.readouterr()


def test_locked_by_a_writer(base: Base, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import fcntl

    data = tmp_path / "data.h5"
    shutil.copy(base.data, data)
    out = tmp_path / "feats.h5"
    monkeypatch.delenv("HDF5_USE_FILE_LOCKING", raising=False)
    with open(data, "rb") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)  # what a program writing the file holds
        run_bad(capsys, ["featurize", str(data), "-o", str(out)], data,
                r"is locked by another process .*HDF5_USE_FILE_LOCKING=FALSE", out)
        # The documented way out: HDF5_USE_FILE_LOCKING=FALSE (read without locking).
        monkeypatch.setenv("HDF5_USE_FILE_LOCKING", "FALSE")
        assert run(["featurize", str(data), "-o", str(out), "-q"]) == 0
    assert out.exists()


def test_filesystem_without_locks_falls_back(base: Base, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Where flock is unsupported (ENOSYS, e.g. Lustre mounted without flock), reading goes on
    without a lock, unless HDF5_USE_FILE_LOCKING=TRUE demands one."""
    from mhla_cli.io import formats

    real = h5py.File
    calls = []

    def no_flock(name, mode="r", *args, locking=None, **kwargs):  # noqa: ANN001, ANN002, ANN003
        calls.append(locking)
        if mode == "r" and locking is not False:
            raise OSError(38, "Unable to synchronously open file (unable to lock file, errno = 38, "
                              "error message = 'Function not implemented')")
        return real(name, mode, *args, **({} if locking is None else {"locking": locking}), **kwargs)

    monkeypatch.setattr(formats.reading.h5py, "File", no_flock)
    monkeypatch.delenv("HDF5_USE_FILE_LOCKING", raising=False)
    assert run(["certify", str(base.data), "-q"]) == 0
    assert False in calls
    monkeypatch.setenv("HDF5_USE_FILE_LOCKING", "TRUE")
    run_bad(capsys, ["certify", str(base.data)], base.data,
            r"cannot lock the file for reading \(Function not implemented\).*HDF5_USE_FILE_LOCKING=FALSE", None)


# --------------------------------------------------------------------------------------------
# provenance and inspect on valid files
# --------------------------------------------------------------------------------------------


def test_every_output_records_provenance(tmp_path: Path, capsys) -> None:
    import shlex

    from mhla_cli.io import formats
    from mhla_cli import __version__

    p = {n: tmp_path / f"{n}.h5" for n in ("data", "feats", "model", "heads", "pred")}
    steps = [
        (["generate", "teacher", "-o", str(p["data"]), "--dim", "2", "--heads", "1", "--n-samples", "60",
          "--seq-len", "1:5", "-q"], p["data"], []),
        (["featurize", str(p["data"]), "-o", str(p["feats"]), "-q"], p["feats"], [p["data"]]),
        (["fit", str(p["feats"]), "-o", str(p["model"]), "-q"], p["model"], [p["feats"]]),
        (["export-heads", str(p["model"]), "-o", str(p["heads"]), "-q"], p["heads"], [p["model"]]),
        (["predict", str(p["heads"]), str(p["data"]), "-o", str(p["pred"]), "-q"], p["pred"],
         [p["data"], p["heads"]]),
    ]
    for argv, out, inputs in steps:
        assert run(argv) == 0, capsys.readouterr().err
        with h5py.File(out, "r") as f:
            assert f.attrs["mhla_version"] == __version__
            assert f.attrs["mhla_command"] == shlex.join(["mhla", *argv])
            recorded = json.loads(f.attrs["mhla_inputs"])
        assert sorted(r["path"] for r in recorded) == sorted(str(i) for i in inputs)
        for r in recorded:
            src = Path(r["path"])
            assert r["size"] == src.stat().st_size and r["name"] == src.name
            assert r["fingerprint"] == formats.source_identity(src)["fingerprint"]
            assert re.fullmatch(r"[0-9a-f]{32}", r["fingerprint"])
    assert run(["certify", str(p["data"]), "--json", "-q"]) == 0
    ident = json.loads(capsys.readouterr().out)["input_identity"]
    assert ident == formats.source_identity(p["data"])


def test_fingerprint_identifies_the_data(base: Base, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mhla_cli.io import formats

    same = h5(tmp_path / "same.h5", tokens=base.tokens, offsets=base.offsets, targets=base.targets)
    t = base.tokens.copy()
    t[len(t) // 2, 1] = np.nextafter(t[len(t) // 2, 1], np.inf)  # one ulp, in the middle
    changed = h5(tmp_path / "changed.h5", tokens=t, offsets=base.offsets, targets=base.targets)
    ref = formats.source_identity(base.data)
    assert ref["fingerprint_scope"] == "all data"
    assert formats.source_identity(same)["fingerprint"] == ref["fingerprint"]  # same data, other file
    assert formats.source_identity(changed)["fingerprint"] != ref["fingerprint"]
    # big files: shapes, all offsets and sampled rows (a cheap identity, not a full hash)
    monkeypatch.setattr(formats.identity, "FULL_FINGERPRINT_BYTES", 100)
    monkeypatch.setattr(formats.identity, "_BLOCK_BYTES", 64)
    big = formats.source_identity(same)
    assert big["fingerprint_scope"] == "shapes, offsets and sampled rows"
    t2 = base.tokens.copy()
    t2[0, 0] += 1.0
    other = h5(tmp_path / "other.h5", tokens=t2, offsets=base.offsets, targets=base.targets)
    assert formats.source_identity(other)["fingerprint"] != big["fingerprint"]
    assert formats.source_identity(same, full=True)["fingerprint"] == ref["fingerprint"]


def test_inspect_valid_files(base: Base, tmp_path: Path, capsys) -> None:
    pred = tmp_path / "pred.h5"
    assert run(["predict", str(base.heads), str(base.data), "-o", str(pred), "--all-positions", "-q"]) == 0
    expect = {
        base.data: ("tokens", {"layout": "ragged", "d": 2, "n_samples": 40, "has_targets": True}),
        base.feats: ("features", {"d": 2, "n_samples": 40, "n_features": 6, "has_targets": True}),
        base.model: ("model", {"d": 2, "n_features": 6}),
        base.heads: ("heads", {"d": 2}),
        pred: ("predictions", {"d": 2, "n_samples": 40, "n_tokens": int(base.offsets[-1])}),
    }
    for path, (kind, fields) in expect.items():
        capsys.readouterr()
        assert run(["inspect", str(path), "--json"]) == 0
        cap = capsys.readouterr()
        rep = json.loads(cap.out)
        assert rep["kind"] == kind and rep["valid"] is True and rep["error"] is None
        for k, v in fields.items():
            assert rep[k] == v, (kind, k)
        assert all("shape" in ds for ds in rep["datasets"].values())
        if kind != "tokens":
            assert rep["attrs"]["mhla_kind"] == kind and "inputs" in rep["provenance"]
        # human form: on stderr, valid, exit 0
        assert run(["inspect", str(path)]) == 0
        err = capsys.readouterr().err
        assert f"{kind} file, valid" in err and "mhla: error" not in err


# --------------------------------------------------------------------------------------------
# an output's suffix means its format; optional packages checked before any work
# --------------------------------------------------------------------------------------------

HDF5_ONLY = r"is written in HDF5; the suffix '\.[a-z]+' names another format: use \.h5, \.hdf5 or \.hdf"


def _suffix_cases(base: Base, d: Path) -> list[tuple[list[str], Path, str]]:
    """(argv, the output blamed, pattern) for every output option of every command."""
    gen = ["--dim", "2", "--heads", "1", "--n-samples", "5"]
    return [
        (["featurize", str(base.data), "-o", str(d / "f.npz")], d / "f.npz", HDF5_ONLY),
        (["merge", str(base.feats), "-o", str(d / "m.safetensors")], d / "m.safetensors", HDF5_ONLY),
        (["fit", str(base.feats), "-o", str(d / "model.npz")], d / "model.npz", HDF5_ONLY),
        (["fit", str(base.data), "-o", str(d / "model.safetensors")], d / "model.safetensors", HDF5_ONLY),
        (["predict", str(base.heads), str(base.data), "-o", str(d / "p.npy")], d / "p.npy", HDF5_ONLY),
        (["rollout", str(base.model), str(base.data), "-k", "1", "-o", str(d / "r.npz")], d / "r.npz", HDF5_ONLY),
        (["generate", "teacher", "-o", str(d / "t.csv"), *gen], d / "t.csv", HDF5_ONLY),
        (["generate", "assoc", "-o", str(d / "a.npz"), "--keys", "1", "--n-samples", "4"], d / "a.npz", HDF5_ONLY),
        (["certify", str(base.data), "--witness", str(d / "w.npz")], d / "w.npz", HDF5_ONLY),
        (["certify", str(base.data), "--on", str(base.data), "-o", str(d / "rep.json")], d / "rep.json", HDF5_ONLY),
        (["export-heads", str(base.model), "-o", str(d / "h.pt")], d / "h.pt",
         r"unknown heads format '\.pt': use \.h5 / \.hdf5 \(HDF5\), \.npz \(numpy\) or \.safetensors"),
        (["generate", "teacher", "-o", str(d / "t.h5"), *gen, "--teacher-out", str(d / "teacher.pt")],
         d / "teacher.pt", r"unknown heads format '\.pt'"),
        (["spectrum", str(base.model), "--plot", str(d / "s.pdf")], d / "s.pdf",
         r"--plot writes a PNG image; the suffix '\.pdf' names another format: use \.png"),
    ]


def test_output_suffix_must_name_its_format(base: Base, tmp_path: Path, capsys) -> None:
    # `mhla fit data.h5 -o model.npz` must not exit 0 with HDF5 under the .npz name
    cases = _suffix_cases(base, tmp_path)
    for argv, out, pattern in cases:
        run_bad(capsys, argv, out, pattern, out)  # the pre-existing file at the bad name survives
    # and no other output was written (t.h5 beside a refused --teacher-out)
    assert {p.name for p in tmp_path.iterdir()} == {out.name for _, out, _ in cases}


def test_output_suffix_is_refused_before_any_work(base: Base, tmp_path: Path, capsys) -> None:
    # with a missing input, the suffix is what is reported: it is checked before the input is read
    missing = tmp_path / "missing.h5"
    for argv, out, pattern in _suffix_cases(base, tmp_path):
        argv = [str(missing) if a in (str(base.data), str(base.feats), str(base.model), str(base.heads)) else a
                for a in argv]
        run_bad(capsys, argv, out, pattern, None)


def test_hdf5_outputs_take_any_hdf5_suffix_or_none(base: Base, tmp_path: Path, capsys) -> None:
    for name in ("model.hdf5", "model.HDF", "model"):
        assert run(["fit", str(base.feats), "-o", str(tmp_path / name), "-q"]) == 0, capsys.readouterr().err
        assert h5py.is_hdf5(tmp_path / name)


def _without(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make `import module` fail as if the package were not installed."""
    import sys
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)


def test_spectrum_plot_without_matplotlib(base: Base, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys) -> None:
    # refused before the spectrum is computed or printed (not printed in full, then failed)
    _without(monkeypatch, "matplotlib", "matplotlib.pyplot")
    png = tmp_path / "s.png"
    run_bad(capsys, ["spectrum", str(base.model), "--plot", str(png), "--json"], None,
            r"plotting needs matplotlib: pip install", png)


def test_safetensors_output_without_safetensors(base: Base, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys) -> None:
    _without(monkeypatch, "safetensors", "safetensors.numpy")
    out = tmp_path / "h.safetensors"
    run_bad(capsys, ["export-heads", str(base.model), "-o", str(out)], None, r"needs the optional package "
            "safetensors", out)
    data = tmp_path / "d.h5"
    run_bad(capsys, ["generate", "teacher", "-o", str(data), "--dim", "2", "--heads", "1", "--n-samples", "5",
                     "--teacher-out", str(out)], None, r"needs the optional package safetensors", out)
    assert not data.exists()  # nothing was generated


def test_scheduler_without_dask(base: Base, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    _without(monkeypatch, "dask", "dask.distributed", "distributed")
    import mhla_cli.statistics.ranges as ranges_mod

    def no_work(*a: object, **k: object) -> None:
        raise AssertionError("the pass started")
    monkeypatch.setattr(ranges_mod, "estimate_basis", no_work)
    out = tmp_path / "f.h5"
    run_bad(capsys, ["featurize", str(base.data), "-o", str(out), "--scheduler", "local:1"], None,
            r"a Dask scheduler needs Dask", out)


# --------------------------------------------------------------------------------------------
# nothing lost: an output replaces only an earlier output of its own kind, never an input
# --------------------------------------------------------------------------------------------

NOT_MHLAS = r"output path exists and is not a file mhla wrote; it is left as it is"


def _outputs(base: Base, d: Path) -> list[tuple[list[str], Path, str]]:
    """(argv, the output, the kind it writes) for every output option of every command (HDF5 and the other
    formats), each output in `d`."""
    gen = ["--dim", "2", "--heads", "1", "--n-samples", "5"]
    np.save(d / "x.npy", np.random.default_rng(0).standard_normal((6, 3, 2)))
    o = {name: d / name for name in ("f.h5", "m.h5", "model.h5", "h.h5", "h.npz", "h.safetensors", "p.h5", "r.h5",
                                     "t.h5", "teacher.h5", "a.h5", "w.h5", "rep.h5", "s.png", "c.h5", "red.h5", "b.h5")}
    if not (d / "maps.h5").exists():  # a block's token map (mhla fit --blocks)
        assert run(["reduce", str(base.data), "--dim", "1", "-o", str(d / "maps.h5"), "-q"]) == 0
    cases = [
        (["featurize", str(base.data), "-o", str(o["f.h5"])], o["f.h5"], "features"),
        (["merge", str(base.feats), "-o", str(o["m.h5"])], o["m.h5"], "features"),
        (["fit", str(base.feats), "-o", str(o["model.h5"])], o["model.h5"], "model"),
        (["export-heads", str(base.model), "-o", str(o["h.h5"])], o["h.h5"], "heads"),
        (["export-heads", str(base.model), "-o", str(o["h.npz"])], o["h.npz"], "heads"),
        (["predict", str(base.heads), str(base.data), "-o", str(o["p.h5"])], o["p.h5"], "predictions"),
        (["rollout", str(base.model), str(base.data), "-k", "1", "-o", str(o["r.h5"])], o["r.h5"], "tokens"),
        (["generate", "teacher", "-o", str(o["t.h5"]), *gen], o["t.h5"], "tokens"),
        (["generate", "teacher", "-o", str(d / "t2.h5"), *gen, "--teacher-out", str(o["teacher.h5"])],
         o["teacher.h5"], "heads"),
        (["generate", "assoc", "-o", str(o["a.h5"]), "--keys", "1", "--n-samples", "4"], o["a.h5"], "tokens"),
        (["certify", str(base.data), "--witness", str(o["w.h5"])], o["w.h5"], "model"),
        (["certify", str(base.data), "--on", str(base.data), "-o", str(o["rep.h5"])], o["rep.h5"], "probes"),
        (["convert", str(d / "x.npy"), "-o", str(o["c.h5"])], o["c.h5"], "tokens"),
        (["reduce", str(base.data), "--dim", "1", "-o", str(o["red.h5"])], o["red.h5"], "tokens"),
        (["fit", str(base.data), "-o", str(o["b.h5"]), "--blocks", str(d / "maps.h5")], o["b.h5"], "blocks"),
    ]
    if importlib.util.find_spec("safetensors") is not None:
        cases.append((["export-heads", str(base.model), "-o", str(o["h.safetensors"])], o["h.safetensors"], "heads"))
    if importlib.util.find_spec("matplotlib") is not None:
        cases.append((["spectrum", str(base.model), "--plot", str(o["s.png"])], o["s.png"], "plot"))
    return cases


def _refused_intact(capsys: pytest.CaptureFixture[str], argv: list[str], out: Path, pattern: str) -> None:
    """Exit 2, one line matching `pattern`, the file at `out` byte for byte as it was, no temporary left."""
    before = out.read_bytes()
    capsys.readouterr()
    assert run(argv) == 2, argv
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and re.search(pattern, lines[0]), (argv, lines)
    assert out.read_bytes() == before
    assert not list(out.parent.glob(f".{out.name}.*tmp-mhla*"))


def test_a_users_file_at_any_output_is_refused_and_kept(base: Base, tmp_path: Path, capsys) -> None:
    """`-o notes.h5` over a file mhla did not write (text, a user's HDF5 tokens without mhla_kind, a zip, a
    PNG of another program): exit 2, the file intact, at every output of every command."""
    users = [b"my notes, not mhla's\n", None, b"PK\x03\x04 a zip", b"\x89PNG\r\n\x1a\n" + b"\0" * 64]
    for argv, out, _ in _outputs(base, tmp_path):
        for content in users:
            if content is None:
                with h5py.File(out, "w") as f:  # a tokens file as a user writes it: no mhla attributes
                    f["tokens"] = base.tokens
                    f["offsets"] = base.offsets
            else:
                out.write_bytes(content)
            _refused_intact(capsys, argv, out, f"mhla: error: {re.escape(str(out))}: {NOT_MHLAS}")
            out.unlink()


def test_an_mhla_file_of_another_kind_is_refused_and_kept(base: Base, tmp_path: Path, capsys) -> None:
    for argv, out, kind in _outputs(base, tmp_path):
        if out.suffix not in (".h5",):
            continue
        other = "features" if kind != "features" else "model"
        previous_output(out, other)
        _refused_intact(capsys, argv, out, rf"is an mhla {other} file, not a {kind} file; it is left as it is")
        out.unlink()


def test_an_earlier_output_of_the_same_kind_is_replaced(base: Base, tmp_path: Path, capsys) -> None:
    """The one file an output replaces: what an earlier run of the command wrote there (every format)."""
    for argv, out, kind in _outputs(base, tmp_path):
        if "--witness" in argv or "teacher.h5" == out.name:
            continue  # identifiable data write no witness; --teacher-out: covered by export-heads' heads
        assert run(argv + ["-q"]) in (0, 1), (argv, capsys.readouterr().err)
        first = out.read_bytes()
        capsys.readouterr()
        assert run(argv + ["-q"]) in (0, 1), (argv, capsys.readouterr().err)
        assert out.exists() and out.read_bytes()[:8] == first[:8]


def test_an_input_inside_or_around_the_output_is_refused(base: Base, tmp_path: Path, capsys) -> None:
    """An output at an input's path through a symbolic link, or in a directory an input is (a store's
    directory): exit 2, the input intact."""
    data = tmp_path / "data.h5"
    shutil.copy(base.data, data)
    alias = tmp_path / "alias.h5"
    alias.symlink_to(data)
    _refused_intact(capsys, ["featurize", str(data), "-o", str(alias)], data, "output would overwrite an input")
    _refused_intact(capsys, ["fit", str(alias), "-o", str(data)], data, "output would overwrite an input")


def test_stores_never_replace_a_users_directory_an_input_or_a_part(base: Base, tmp_path: Path, capsys) -> None:
    """featurize --scheduler -o DIR.zarr over a user's directory, an input inside the output store, merge
    parts inside the output: exit 2 before the cluster is asked anything, every file intact."""
    pytest.importorskip("zarr")
    results = tmp_path / "results.zarr"
    results.mkdir()
    (results / "notes.txt").write_text("my notes")
    work = tmp_path / "work.zarr"
    work.mkdir()
    shutil.copy(base.data, work / "data.h5")
    out = tmp_path / "out.zarr"
    (out / "p0.zarr").mkdir(parents=True)
    (out / "p1.zarr").mkdir()
    (out / "p0.zarr" / "zarr.json").write_text('{"attributes": {"mhla_kind": "features"}}')
    (out / "zarr.json").write_text('{"attributes": {"mhla_kind": "features"}}')
    other = tmp_path / "other.zarr"
    other.mkdir()
    (other / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {"mhla_kind": "model"}}')
    dead = ["--scheduler", "tcp://127.0.0.1:9"]  # never contacted: refused before
    cases = [
        (["featurize", str(base.data), *dead, "-o", str(results)], results / "notes.txt",
         "output path exists and is not an mhla features store"),
        (["featurize", str(base.data), *dead, "-o", str(other)], other / "zarr.json", "is not an mhla features store"),
        (["featurize", str(work / "data.h5"), *dead, "-o", str(work)], work / "data.h5",
         "output would overwrite an input"),
        (["merge", str(out / "p0.zarr"), str(out / "p1.zarr"), "-o", str(out)], out / "p0.zarr" / "zarr.json",
         "output would overwrite an input"),
        (["merge", str(out), str(tmp_path / "p1.zarr"), "-o", str(out / "p0.zarr")], out / "zarr.json",
         "output would overwrite an input"),
    ]
    for argv, kept, pattern in cases:
        _refused_intact(capsys, argv, kept, pattern)
    assert (results / "notes.txt").read_text() == "my notes" and sorted(p.name for p in out.iterdir()) == [
        "p0.zarr", "p1.zarr", "zarr.json"]
