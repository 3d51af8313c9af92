"""`mhla convert` and `mhla_cli.write_tokens`: tokens files from .npy, .npz, .safetensors and torch .pt.

Round trips are checked against the source arrays read back with plain h5py; bad inputs exit 2 with
one line and leave nothing at -o (a file already there stays byte-identical) nor a temporary file.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest

import mhla_cli
from conftest import previous_output
from mhla_cli.io import convert as convert_mod
from mhla_cli.io.convert import _source, _writer
from mhla_cli.cli import run
from mhla_cli.errors import InputError
from mhla_cli.statistics.stream import featurize

from conftest import STATS, write_tokens as h5_write_tokens

HAVE_TORCH = importlib.util.find_spec("torch") is not None



def _read(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        assert f.attrs["mhla_kind"] == "tokens"
        return {k: f[k][()] for k in f}


def _same(path: Path, **expected: np.ndarray | None) -> None:
    """The file holds exactly the expected datasets, equal in values, shape and dtype."""
    got = _read(path)
    want = {k: np.asarray(v) for k, v in expected.items() if v is not None}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].shape == v.shape, k
        assert got[k].dtype == v.dtype, k
        assert np.array_equal(got[k], v), k


def _ragged(seed: int = 0, N: int = 9, d: int = 3, dtype: str = "float64") -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 8, size=N)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.standard_normal((int(offsets[-1]), d)).astype(dtype)
    return tokens, offsets, rng.standard_normal((N, d)), rng.random(N)


def _dense(seed: int = 1, N: int = 7, n: int = 5, d: int = 2) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((N, n, d)).astype(np.float32), rng.standard_normal((N, n, d)),
            rng.random((N, n)))


def _convert(args: list[str], capsys: pytest.CaptureFixture[str], code: int = 0) -> str:
    rc = run(["convert", *args, "-q"])
    err = capsys.readouterr().err
    assert rc == code, err
    return err


# --------------------------------------------------------------------------------------------
# the library function
# --------------------------------------------------------------------------------------------


def test_write_tokens_list_of_sequences(tmp_path: Path) -> None:
    tokens, offsets, targets, weights = _ragged()
    seqs = [tokens[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    info = mhla_cli.write_tokens(tmp_path / "a.h5", seqs, targets=targets, weights=weights)
    assert (info.layout, info.n_samples, info.d, info.n_tokens) == ("ragged", 9, 3, offsets[-1])
    _same(tmp_path / "a.h5", tokens=tokens, offsets=offsets, targets=targets, weights=weights)


def test_write_tokens_ragged_per_position_and_dense(tmp_path: Path) -> None:
    tokens, offsets, _, _ = _ragged(2, dtype="float32")
    T = tokens.shape[0]
    y, w = np.arange(T * 3.0).reshape(T, 3), np.linspace(0, 1, T)
    info = mhla_cli.write_tokens(tmp_path / "r.h5", tokens, offsets, targets=y, weights=w, chunk_size=2)
    assert info.per_position and info.has_weights
    _same(tmp_path / "r.h5", tokens=tokens, offsets=offsets, targets=y, weights=w)
    X, Y, W = _dense()
    info = mhla_cli.write_tokens(tmp_path / "d.h5", X, targets=Y, weights=W)
    assert (info.layout, info.seq_len, info.per_position) == ("dense", 5, True)
    _same(tmp_path / "d.h5", tokens=X, targets=Y, weights=W)
    # lists of per-position targets and per-sequence weights go with a list of sequences
    seqs = [tokens[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    ys = [y[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    mhla_cli.write_tokens(tmp_path / "l.h5", seqs, targets=ys, weights=list(w[:0]) + [1.0] * T)
    _same(tmp_path / "l.h5", tokens=tokens, offsets=offsets, targets=y, weights=np.ones(T))


def test_write_tokens_torch_tensors(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    X, Y, _ = _dense()
    mhla_cli.write_tokens(tmp_path / "t.h5", torch.tensor(X), targets=torch.tensor(Y[:, -1]))
    _same(tmp_path / "t.h5", tokens=X, targets=Y[:, -1])


def test_chunking_does_not_change_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, offsets, targets, weights = _ragged(5, N=40)
    np.savez_compressed(tmp_path / "c.npz", tokens=tokens, offsets=offsets, targets=targets, weights=weights)
    # tiny chunks and offset blocks: many chunks, chunk plans across offset-block boundaries, one
    # sample per chunk where a sequence is longer than the chunk, and a compressed stream reopened
    monkeypatch.setattr(_writer, "CHUNK_BYTES", 3 * 8 * 4)
    monkeypatch.setattr(_writer, "_OFFSET_BLOCK", 7)
    for i, cs in enumerate((None, 1, 3, 1000)):
        convert_mod.convert_files([tmp_path / "c.npz"], tmp_path / f"o{i}.h5", chunk_size=cs)
        _same(tmp_path / f"o{i}.h5", tokens=tokens, offsets=offsets, targets=targets, weights=weights)


def test_converted_file_featurizes_as_the_h5py_one(tmp_path: Path) -> None:
    tokens, offsets, targets, _ = _ragged(3, N=60)
    np.save(tmp_path / "tokens.npy", tokens)
    np.save(tmp_path / "offsets.npy", offsets)
    np.save(tmp_path / "targets.npy", targets)
    convert_mod.convert_files([tmp_path / n for n in ("tokens.npy", "offsets.npy", "targets.npy")],
                              tmp_path / "c.h5")
    ref = h5_write_tokens(tmp_path / "ref.h5", tokens, offsets, targets)
    a, b = featurize(tmp_path / "c.h5"), featurize(ref)
    assert (a.n_samples, a.n_tokens) == (b.n_samples, b.n_tokens)
    for k in STATS:  # the same data: the same sums, bit for bit
        assert np.array_equal(getattr(a, k), getattr(b, k)), k


# --------------------------------------------------------------------------------------------
# mhla convert: every input kind, ragged and dense, with targets and weights
# --------------------------------------------------------------------------------------------


def test_npy_dense_and_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    X, Y, W = _dense()
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", Y)
    np.save(tmp_path / "weights.npy", W)
    out = tmp_path / "o.h5"
    _convert([str(tmp_path / "X.npy"), f"targets={tmp_path / 'y.npy'}", str(tmp_path / "weights.npy"),
              "-o", str(out), "--attention", "causal"], capsys)
    _same(out, tokens=X, targets=Y, weights=W)
    np.save(tmp_path / "F.npy", np.asfortranarray(X))  # column-major files are read too
    _convert([str(tmp_path / "F.npy"), "-o", str(tmp_path / "f.h5")], capsys)
    _same(tmp_path / "f.h5", tokens=X)


def test_npy_ragged_by_stem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokens, offsets, targets, weights = _ragged(dtype="float32")
    for name, arr in (("tokens", tokens), ("offsets", offsets.astype(np.int32)), ("targets", targets),
                      ("weights", weights)):
        np.save(tmp_path / f"{name}.npy", arr)
    out = tmp_path / "o.h5"
    rc = run(["convert", *(str(tmp_path / f"{n}.npy") for n in ("tokens", "offsets", "targets", "weights")),
              "-o", str(out), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    summary = __import__("json").loads(captured.out)
    assert summary["layout"] == "ragged" and summary["n_samples"] == 9 and summary["weights"]
    _same(out, tokens=tokens, offsets=offsets.astype(np.int32), targets=targets, weights=weights)


@pytest.mark.parametrize("compressed", [False, True])
def test_npz(tmp_path: Path, capsys: pytest.CaptureFixture[str], compressed: bool) -> None:
    save = np.savez_compressed if compressed else np.savez
    tokens, offsets, targets, weights = _ragged(4)
    save(tmp_path / "r.npz", tokens=tokens, offsets=offsets, targets=targets, weights=weights)
    _convert([str(tmp_path / "r.npz"), "-o", str(tmp_path / "r.h5"), "--chunk-size", "2"], capsys)
    _same(tmp_path / "r.h5", tokens=tokens, offsets=offsets, targets=targets, weights=weights)
    X, Y, W = _dense()
    save(tmp_path / "d.npz", tokens=X, targets=Y, weights=W)
    _convert([str(tmp_path / "d.npz"), "-o", str(tmp_path / "d.h5"), "--attention", "causal"], capsys)
    _same(tmp_path / "d.h5", tokens=X, targets=Y, weights=W)
    with zipfile.ZipFile(tmp_path / "d.npz") as z:  # the archive really is (not) compressed
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_DEFLATED if compressed else zipfile.ZIP_STORED}


def test_safetensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    st = pytest.importorskip("safetensors.numpy")
    tokens, offsets, targets, weights = _ragged(6, dtype="float32")
    st.save_file({"tokens": tokens, "offsets": offsets, "targets": targets, "weights": weights},
                 str(tmp_path / "r.safetensors"), metadata={"source": "test"})
    _convert([str(tmp_path / "r.safetensors"), "-o", str(tmp_path / "r.h5")], capsys)
    _same(tmp_path / "r.h5", tokens=tokens, offsets=offsets, targets=targets, weights=weights)
    X, Y, W = _dense()
    st.save_file({"tokens": X, "targets": Y, "weights": W}, str(tmp_path / "d.safetensors"))
    _convert([str(tmp_path / "d.safetensors"), "-o", str(tmp_path / "d.h5"), "--attention", "causal"], capsys)
    _same(tmp_path / "d.h5", tokens=X, targets=Y, weights=W)


def test_safetensors_bfloat16_widened_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    sttorch = pytest.importorskip("safetensors.torch")
    X = torch.randn(4, 3, 2).to(torch.bfloat16)
    sttorch.save_file({"tokens": X}, str(tmp_path / "b.safetensors"))
    _convert([str(tmp_path / "b.safetensors"), "-o", str(tmp_path / "b.h5")], capsys)
    _same(tmp_path / "b.h5", tokens=X.float().numpy())


def test_torch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    tokens, offsets, targets, weights = _ragged(7)
    seqs = [torch.tensor(tokens[offsets[i]:offsets[i + 1]]) for i in range(len(offsets) - 1)]
    torch.save(seqs, tmp_path / "list.pt")  # a list of (n_i, d) tensors: ragged
    _convert([str(tmp_path / "list.pt"), "-o", str(tmp_path / "l.h5")], capsys)
    _same(tmp_path / "l.h5", tokens=tokens, offsets=offsets)
    torch.save({"tokens": seqs, "targets": torch.tensor(targets), "weights": torch.tensor(weights)},
               tmp_path / "dl.pt")  # a dict whose tokens are a list of sequences
    _convert([str(tmp_path / "dl.pt"), "-o", str(tmp_path / "dl.h5")], capsys)
    _same(tmp_path / "dl.h5", tokens=tokens, offsets=offsets, targets=targets, weights=weights)
    torch.save({"tokens": torch.tensor(tokens), "offsets": torch.tensor(offsets), "targets": torch.tensor(targets)},
               tmp_path / "r.pth")
    _convert([str(tmp_path / "r.pth"), "-o", str(tmp_path / "r.h5")], capsys)
    _same(tmp_path / "r.h5", tokens=tokens, offsets=offsets, targets=targets)
    X, Y, W = _dense()
    torch.save({"tokens": torch.tensor(X), "targets": torch.tensor(Y), "weights": torch.tensor(W)},
               tmp_path / "d.pt")
    _convert([str(tmp_path / "d.pt"), "-o", str(tmp_path / "d.h5"), "--attention", "causal"], capsys)
    _same(tmp_path / "d.h5", tokens=X, targets=Y, weights=W)
    torch.save(torch.tensor(X), tmp_path / "one.pt", _use_new_zipfile_serialization=False)  # legacy, one tensor
    _convert([str(tmp_path / "one.pt"), "-o", str(tmp_path / "one.h5")], capsys)
    _same(tmp_path / "one.h5", tokens=X)


def test_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["convert", "--help"]) == 0
    text = capsys.readouterr().out
    assert "Example: mhla convert" in text and "NAME=FILE" in text


# --------------------------------------------------------------------------------------------
# bad inputs: exit 2, one line, nothing written
# --------------------------------------------------------------------------------------------


def _npz(**arrays: np.ndarray) -> "callable":
    return lambda d: (np.savez(d / "in.npz", **arrays), [str(d / "in.npz")])[1]


def _npys(**arrays: np.ndarray) -> "callable":
    def make(d: Path) -> list[str]:
        for k, v in arrays.items():
            np.save(d / f"{k}.npy", v)
        return [str(d / f"{k}.npy") for k in arrays]
    return make


_T, _O, _Y, _W = _ragged(8)
_X = _dense()[0]
_NAN = _T.copy()
_NAN[5, 1] = np.nan


def _file(name: str, data: bytes) -> "callable":
    return lambda d: ((d / name).write_bytes(data), [str(d / name)])[1]


def _pickled(d: Path) -> list[str]:
    np.save(d / "tokens.npy", np.array([np.zeros((2, 2)), np.zeros((3, 2))], dtype=object), allow_pickle=True)
    return [str(d / "tokens.npy")]


def _truncated(d: Path) -> list[str]:
    np.save(d / "tokens.npy", _X)
    (d / "tokens.npy").write_bytes((d / "tokens.npy").read_bytes()[:-8])
    return [str(d / "tokens.npy")]


def _hdf5(d: Path) -> list[str]:
    h5_write_tokens(d / "in.h5", _X)
    return [str(d / "in.h5")]


BAD = {
    "tokens 1-d": (_npz(tokens=np.zeros(5)), "rank 1"),
    "tokens 4-d": (_npz(tokens=np.zeros((2, 2, 2, 2))), "rank 4"),
    "no offsets for (T, d)": (_npz(tokens=_T), "no 'offsets'"),
    "dense with offsets": (_npz(tokens=_X, offsets=np.arange(8)), "'offsets' dataset is present"),
    "offsets not increasing": (_npz(tokens=_T, offsets=np.r_[_O[:3], _O[2], _O[4:]]), "not strictly increasing"),
    "offsets[0] != 0": (_npz(tokens=_T, offsets=_O + 1), "offsets[0]"),
    "offsets[N] != T": (_npz(tokens=_T, offsets=np.r_[_O[:-1], _O[-1] - 1]), "offsets[N]"),
    "float offsets": (_npz(tokens=_T, offsets=_O.astype(float)), "integer"),
    "2-d offsets": (_npz(tokens=_T, offsets=_O[:, None]), "1-d integer"),
    "NaN tokens": (_npz(tokens=_NAN, offsets=_O), "NaN or Inf"),
    "Inf targets": (_npz(tokens=_T, offsets=_O, targets=np.where(np.eye(9, 3) > 0, np.inf, _Y)), "NaN or Inf"),
    "huge tokens": (_npz(tokens=_T * 1e45, offsets=_O), "too large"),
    "int64 tokens beyond 2^53": (_npz(tokens=np.r_[_T[:4].astype(np.int64), [[2**53 + 1, 0, 0]],
                                                   _T[5:].astype(np.int64)], offsets=_O), "beyond 2^53"),
    "uint64 tokens beyond 2^53": (_npz(tokens=np.full((7, 3, 2), 2**63, dtype=np.uint64)), "beyond 2^53"),
    "negative weights": (_npz(tokens=_T, offsets=_O, weights=-_W), "weights must be finite and >= 0"),
    "NaN weights": (_npz(tokens=_T, offsets=_O, weights=np.r_[_W[:-1], np.nan]), "weights must be finite"),
    "targets of other length": (_npz(tokens=_T, offsets=_O, targets=_Y[:-1]), "'targets' has shape"),
    "targets of rank 3 for ragged tokens": (_npz(tokens=_T, offsets=_O, targets=_Y[:, :, None]), "'targets' has shape"),
    "weights of other length": (_npz(tokens=_T, offsets=_O, weights=_W[:-1]), "'weights' has shape"),
    "unknown key": (_npz(tokens=_X, labels=np.zeros(7)), "unknown array 'labels'"),
    "no tokens": (_npz(targets=_Y), "no 'tokens' array"),
    "complex tokens": (_npz(tokens=_X.astype(complex)), "expected real numbers"),
    "bool weights": (_npz(tokens=_X, weights=np.ones(7, bool)), "expected real numbers"),
    "empty dense": (_npz(tokens=np.zeros((0, 3, 2))), "no samples"),
    "pickled objects": (_pickled, "Python objects"),
    "truncated .npy": (_truncated, "truncated"),
    "two plain .npy": (lambda d: (_npys(tokens=_X)(d), np.save(d / "a.npy", _X), np.save(d / "b.npy", _X),
                                  [str(d / "a.npy"), str(d / "b.npy")])[-1], "cannot tell which"),
    "the same array twice": (lambda d: _npys(tokens=_X, targets=_X[:, -1])(d) + _npz(targets=_X[:, -1])(d),
                             "more than one array"),
    "not a zip .npz": (_file("in.npz", b"not a zip at all"), "not a valid .npz"),
    "bad safetensors": (_file("in.safetensors", b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}"), ".safetensors"),
    # without torch the refusal names the file and says what is missing
    "bad torch": (_file("in.pt", b"garbage"), "cannot read as a torch file" if HAVE_TORCH
                  else "in.pt: reading torch .pt files: PyTorch is not installed"),
    "unknown suffix": (_file("in.csv", b"1,2\n"), "unknown input format"),
    "already a tokens file": (_hdf5, "is already a tokens file: mhla reads it as it is"),
    "missing": (lambda d: [str(d / "nope.npy")], "no such file"),
    "NAME= on an npz": (lambda d: [f"targets={_npz(tokens=_X)(d)[0]}"], "NAME=FILE names the array of a .npy"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    make, expected = BAD[case]
    args = make(tmp_path)
    for out, existed in ((tmp_path / "out.h5", False), (tmp_path / "prev.h5", True)):
        if existed:
            previous = previous_output(out, "tokens")
        before = set(os.listdir(tmp_path))
        assert run(["convert", *args, "-o", str(out)]) == 2
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mhla: error: "), err
        assert expected in lines[0], lines[0]
        assert "Traceback" not in err
        assert set(os.listdir(tmp_path)) == before  # no output, no temporary file
        assert out.read_bytes() == previous if existed else not out.exists()


def test_bad_torch_content(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    torch.save({"tokens": torch.zeros(2, 3, 2, dtype=torch.complex64)}, tmp_path / "c.pt")
    torch.save({"tokens": [torch.zeros(2, 2), torch.zeros(3, 3)]}, tmp_path / "ragged_d.pt")
    torch.save({"tokens": torch.zeros(2, 3, 2), "mask": torch.ones(2)}, tmp_path / "key.pt")
    torch.save("a string", tmp_path / "s.pt")
    for name, expected in (("c.pt", "real numbers"), ("ragged_d.pt", "sequence 1 has shape"),
                           ("key.pt", "unknown array 'mask'"), ("s.pt", "holds a str")):
        assert run(["convert", str(tmp_path / name), "-o", str(tmp_path / "o.h5")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], err
        assert not (tmp_path / "o.h5").exists()


def test_bad_output_suffix_and_overwriting_the_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "X.npy", _X)
    for out, expected in ((tmp_path / "o.npz", ".h5"), (tmp_path / "X.npy", ".h5")):
        assert run(["convert", str(tmp_path / "X.npy"), "-o", str(out)]) == 2
        assert expected in capsys.readouterr().err
    assert run(["convert", "-o", str(tmp_path / "o.h5")]) == 2  # no INPUT
    capsys.readouterr()


def test_library_refuses_like_the_cli(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not strictly increasing"):
        mhla_cli.write_tokens(tmp_path / "o.h5", _T, np.r_[_O[:3], _O[2], _O[4:]])
    with pytest.raises(InputError, match="sequence 1 has shape"):
        mhla_cli.write_tokens(tmp_path / "o.h5", [np.zeros((2, 2)), np.zeros((2, 3))])
    with pytest.raises(InputError, match="offsets"):
        mhla_cli.write_tokens(tmp_path / "o.h5", [np.zeros((2, 2))], offsets=[0, 2])
    with pytest.raises(InputError, match="NaN"):
        mhla_cli.write_tokens(tmp_path / "o.h5", _NAN, _O)
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------------------------
# other commands given a non-HDF5 file say what it is and name mhla convert
# --------------------------------------------------------------------------------------------


def test_other_commands_name_mhla_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "x.npy", _X)
    np.savez(tmp_path / "x.npz", tokens=_X)
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    files = {"x.npy": "NumPy .npy", "x.npz": "NumPy .npz", "x.csv": "text file"}
    try:
        import safetensors.numpy as st

        st.save_file({"tokens": _X}, str(tmp_path / "x.safetensors"))
        files["x.safetensors"] = "safetensors"
    except ImportError:
        pass
    try:
        import torch

        torch.save({"tokens": torch.tensor(_X)}, tmp_path / "x.pt")
        files["x.pt"] = "PyTorch"
    except ImportError:
        pass
    for name, what in files.items():
        for cmd in (["certify", str(tmp_path / name)],
                    ["featurize", str(tmp_path / name), "-o", str(tmp_path / "f.h5")],
                    ["fit", str(tmp_path / name), "-o", str(tmp_path / "m.h5")]):
            assert run(cmd) == 2
            lines = capsys.readouterr().err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"mhla: error: {tmp_path / name}: "), lines
            assert what in lines[0] and "not an HDF5 file" in lines[0], lines[0]
            if name != "x.csv":  # the command names the file with its directory
                assert f"mhla convert {tmp_path / name} -o {tmp_path / Path(name).stem}.h5" in lines[0], lines[0]
            assert not (tmp_path / "f.h5").exists() and not (tmp_path / "m.h5").exists()
        # ... and the command it names works, as it is written (from any directory)
        if name != "x.csv":
            named = shlex.split(lines[0].split("convert it with: ")[1])
            assert named[:2] == ["mhla", "convert"]
            if Path(named[4]).exists():
                Path(named[4]).unlink()
            assert run([*named[1:], "-q"]) == 0
            _same(Path(named[4]), tokens=_X)


# --------------------------------------------------------------------------------------------
# bounded memory
# --------------------------------------------------------------------------------------------


def _peak_rss_mib(args: list[str], env: dict[str, str] | None = None) -> float:
    """Peak RSS (MiB) of a fresh `mhla` process, measured by a wrapper whose only child it is."""
    wrapper = ("import resource, subprocess, sys\n"
               "r = subprocess.run([sys.executable, '-m', 'mhla_cli', *sys.argv[1:]])\n"
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)\n"
               "sys.exit(r.returncode)\n")
    r = subprocess.run([sys.executable, "-c", wrapper, *args], capture_output=True, text=True,
                       env=None if env is None else {**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return float(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["npy", "pt", "arrow"])
def test_large_input_converts_in_bounded_memory(tmp_path: Path, kind: str) -> None:
    """A 2 GiB .npy (1 GiB torch or Arrow file) converts with a peak RSS under 500 MB, into equal data."""
    N, n, d = (2**15 if kind == "npy" else 2**14), 1024, 16  # float32: 2 GiB (1 GiB)
    big = np.lib.format.open_memmap(tmp_path / "big.npy", mode="w+", dtype=np.float32, shape=(N, n, d))
    rng = np.random.default_rng(0)
    for a in range(0, N, 1024):
        big[a:a + 1024] = rng.standard_normal((1024, n, d), dtype=np.float32)
    big.flush()
    del big
    src = np.load(tmp_path / "big.npy", mmap_mode="r")
    inp = tmp_path / "big.npy"
    if kind == "pt":
        torch = pytest.importorskip("torch")
        inp = tmp_path / "big.pt"
        torch.save({"tokens": torch.from_numpy(np.array(src))}, inp)
    keys = []
    if kind == "arrow":  # one Array2D(n, d) column, as datasets writes it: list<list<float>>, batches of 1000 rows
        pa = pytest.importorskip("pyarrow")
        inp, keys = tmp_path / "big.arrow", ["--key", "tokens=blocks.0.hook_resid_pre"]
        schema = pa.schema([pa.field("blocks.0.hook_resid_pre", pa.list_(pa.list_(pa.float32())))])
        with pa.OSFile(str(inp), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
            for a in range(0, N, 1000):
                rows = np.ascontiguousarray(src[a:a + 1000])
                inner = pa.ListArray.from_arrays(np.arange(0, rows.size + 1, d, dtype=np.int32),
                                                 pa.array(rows.reshape(-1)))
                outer = pa.ListArray.from_arrays(np.arange(0, len(rows) * n + 1, n, dtype=np.int32), inner)
                w.write_batch(pa.record_batch([outer], schema=schema))
    out = tmp_path / "big.h5"
    rss = _peak_rss_mib(["convert", str(inp), *keys, "-o", str(out), "-q"])
    assert rss < 500 * 1e6 / 2**20, f"peak RSS {rss:.0f} MiB"
    with h5py.File(out, "r") as f:
        assert f["tokens"].shape == (N, n, d)
        for a in range(0, N, 2048):
            assert np.array_equal(f["tokens"][a:a + 2048], src[a:a + 2048])


def test_a_folder_of_torch_files_converts_in_memory_flat_in_their_number(tmp_path: Path) -> None:
    """16 torch files of strided tensors (one hook's slice, as a capture saves it) convert with a peak RSS within
    3 files' size of the peak for 4 of them (more than one chunk of the copy: CHUNK_BYTES); reading them all at once
    held every file's pages, 12 files' size more. glibc's mmap threshold is fixed for the measure: its dynamic
    threshold keeps freed chunk buffers in the heap, a few tens of MB whatever the number of files."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    folder, n_files, parts = tmp_path / "acts", 16, []
    folder.mkdir()
    for i in range(n_files):
        wide = torch.from_numpy(rng.standard_normal((40, 96, 520), dtype=np.float32))  # 8 MB
        parts.append(wide[:, :, :512].numpy().copy())
        torch.save({"tokens": wide[:, :, :512]}, folder / f"p{i:02d}.pt")  # saves the whole storage
    file_mib = (folder / "p00.pt").stat().st_size / 2**20
    assert 4 * file_mib * 2**20 > convert_mod.CHUNK_BYTES
    env = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    four = _peak_rss_mib(["convert", *(str(folder / f"p{i:02d}.pt") for i in range(4)), "-o", str(tmp_path / "t.h5"),
                          "-q"], env)
    every = _peak_rss_mib(["convert", str(folder), "-o", str(tmp_path / "all.h5"), "-q"], env)
    assert every - four < 3 * file_mib, (four, every, file_mib)
    with h5py.File(tmp_path / "all.h5", "r") as f:
        assert np.array_equal(f["tokens"][()], np.concatenate(parts))


def test_several_files_are_read_one_or_two_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """convert_files holds at most OPEN_FILES inputs open (their readers' objects), whatever their number, and
    writes the same file as when they were all held."""
    from mhla_cli.io.convert import _driver

    rng = np.random.default_rng(4)
    X = [rng.standard_normal((3, 4, 2)) for _ in range(9)]
    M = [np.ones((3, 4)) for _ in range(9)]
    for k, m in enumerate(M):
        m[k % 3, 2 + k % 2:] = 0
    for k, (x, m) in enumerate(zip(X, M)):  # padded activations with their mask and per-position targets
        with h5py.File(tmp_path / f"p{k}.h5", "w") as f:
            f["tokens"], f["attention_mask"], f["targets"] = x, m, x[..., ::-1] * 2
    live, peak, opened = [0], [0], [0]
    plain = _driver._file_sources

    def counted(name, p, stack):  # type: ignore[no-untyped-def]
        live[0] += 1
        opened[0] += 1
        peak[0] = max(peak[0], live[0])
        stack.callback(lambda: live.__setitem__(0, live[0] - 1))
        return plain(name, p, stack)

    monkeypatch.setattr(_driver, "_file_sources", counted)
    files = [str(tmp_path / f"p{k}.h5") for k in range(9)]
    convert_mod.convert_files(files, tmp_path / "o.h5", chunk_size=2, attention="causal")
    assert peak[0] == _driver.OPEN_FILES and live[0] == 0 and opened[0] >= 9
    keep = np.concatenate(M).reshape(-1) != 0
    lengths = np.concatenate(M).sum(axis=1).astype(np.int64)
    _same(tmp_path / "o.h5", tokens=np.concatenate(X).reshape(-1, 2)[keep],
          offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
          targets=(np.concatenate(X).reshape(-1, 2)[:, ::-1] * 2)[keep])


def test_not_hdf5_reason(tmp_path: Path) -> None:
    from mhla_cli.io import formats
    from mhla_cli.model.export import save_heads
    from mhla_cli.model.heads import Heads

    heads = Heads(V=np.eye(2)[None], Q=np.eye(2)[None])
    save_heads(heads, tmp_path / "h.npz")
    (tmp_path / "empty.h5").write_bytes(b"")
    (tmp_path / "blob.h5").write_bytes(bytes(range(256)) * 4)
    with zipfile.ZipFile(tmp_path / "z.h5", "w") as z:
        z.writestr("readme.txt", "hello")
    cases = {"h.npz": "mhla heads in NumPy .npz form", "empty.h5": "is empty",
             "blob.h5": "mhla convert makes tokens files from", "z.h5": "is a zip archive"}
    try:
        save_heads(heads, tmp_path / "h.safetensors")
        cases["h.safetensors"] = "mhla heads in safetensors form"
    except InputError:  # safetensors not installed
        pass
    for name, expected in cases.items():
        reason = formats.not_hdf5_reason(tmp_path / name)
        assert expected in reason and "not an HDF5 file" in reason, (name, reason)
        assert ("mhla convert " + name) not in reason  # converting would not help these


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page dropping is Linux-only")
def test_dropped_pages_read_back_the_same_and_changed_pages_are_never_dropped(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    x = torch.randn(4096, 64, dtype=torch.float64)  # 2 MiB: many pages
    torch.save({"tokens": x}, tmp_path / "x.pt")
    t = torch.load(tmp_path / "x.pt", mmap=True, weights_only=True)["tokens"]
    drop = _source._PageDropper(tmp_path / "x.pt")
    assert drop.ranges  # the file is mapped
    before = t.numpy().copy()
    drop(t.data_ptr(), t.numel() * t.element_size())
    assert np.array_equal(t.numpy(), before) and np.array_equal(before, x.numpy())
    t[0, 0] = 7.0  # a changed (copy-on-write) page: dropping it would bring back the file's bytes
    assert _source._PageDropper(tmp_path / "x.pt").ranges == []


# --------------------------------------------------------------------------------------------
# activations as models write them: padding masks, names, several files, bfloat16, tuples
# --------------------------------------------------------------------------------------------


def _padded(seed: int = 3, N: int = 6, n: int = 5, d: int = 4, left: bool = False
            ) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Padded activations (N, n, d) (garbage in the padding), a 0/1 mask and the kept sequences."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((N, n, d)).astype(np.float32)
    lengths = rng.integers(1, n + 1, size=N)
    mask = np.zeros((N, n), dtype=np.int64)
    for i, k in enumerate(lengths):
        if left:
            mask[i, n - k:] = 1
        else:
            mask[i, :k] = 1
    return X, mask, [X[i][mask[i] == 1] for i in range(N)]


@pytest.mark.parametrize("left", [False, True])
def test_padded_tokens_with_an_attention_mask_become_the_unpadded_sequences(left: bool, tmp_path: Path) -> None:
    X, mask, seqs = _padded(left=left)
    N, n, _ = X.shape
    rng = np.random.default_rng(0)
    Y = rng.standard_normal((N, 2))  # per sequence, another width than the tokens
    Yp = rng.standard_normal((N, n, 3))  # per position
    Wp = rng.random((N, n))
    np.savez(tmp_path / "a.npz", last_hidden_state=X, attention_mask=mask, targets=Y)
    assert run(["convert", str(tmp_path / "a.npz"), "-o", str(tmp_path / "a.h5"), "-q"]) == 0
    off = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    _same(tmp_path / "a.h5", tokens=np.concatenate(seqs), offsets=off, targets=Y)
    # per-position targets and weights are masked alike; the last kept position is the query
    np.savez(tmp_path / "b.npz", tokens=X, attention_mask=mask, targets=Yp, weights=Wp)
    assert run(["convert", str(tmp_path / "b.npz"), "-o", str(tmp_path / "b.h5"), "--attention", "causal", "-q"]) == 0
    keep = mask == 1
    _same(tmp_path / "b.h5", tokens=np.concatenate(seqs), offsets=off, targets=Yp[keep], weights=Wp[keep])
    info = mhla_cli.io.tokens.inspect_tokens(tmp_path / "b.h5")
    assert info.per_position and info.out_dim == 3


def test_lengths_mask_name_and_keys(tmp_path: Path) -> None:
    X, mask, seqs = _padded()
    lengths = mask.sum(axis=1)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    np.savez(tmp_path / "l.npz", tokens=X, lengths=lengths)
    assert run(["convert", str(tmp_path / "l.npz"), "-o", str(tmp_path / "l.h5"), "-q"]) == 0
    _same(tmp_path / "l.h5", tokens=np.concatenate(seqs), offsets=off)
    # another name for the mask, and any array mapped to a role
    np.savez(tmp_path / "k.npz", hidden=X, keep=mask, head=X[:, 0, :2].astype(np.float64))
    assert run(["convert", str(tmp_path / "k.npz"), "-o", str(tmp_path / "k.h5"), "--mask", "keep",
                "--key", "tokens=hidden", "--key", "targets=head", "-q"]) == 0
    _same(tmp_path / "k.h5", tokens=np.concatenate(seqs), offsets=off, targets=X[:, 0, :2].astype(np.float64))
    assert run(["convert", str(tmp_path / "k.npz"), "-o", str(tmp_path / "k2.h5"), "--key", "mask=keep",
                "--key", "tokens=hidden", "--key", "targets=head", "-q"]) == 0
    _same(tmp_path / "k2.h5", tokens=np.concatenate(seqs), offsets=off, targets=X[:, 0, :2].astype(np.float64))


@pytest.mark.parametrize("case, pattern", [
    ("not 0/1", "an attention mask holds 0 (padding) or 1"),
    ("all 0", "sequence 2 has no token"),
    ("bad length", "lengths must be whole numbers in 1..5"),
    ("ragged tokens", "masks padded tokens"),
    ("no such mask", "no array 'nope' to use as the padding mask"),
    ("bad key", "--key foo=bar: expected ROLE=NAME"),
    # an array given the mask role (--key mask=NAME) is named as the mask in every refusal
    ("key mask shape", "the mask 'keep' has shape (6, 6), expected (N, n) = (6, 5)"),
    ("key mask not 0/1", "the mask 'blocks.0.hook_keep' of sequence 0, position 0 is 2"),
])
def test_bad_masks_exit_2(case: str, pattern: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    X, mask, _ = _padded()
    extra: list[str] = []
    if case == "not 0/1":
        mask = mask * 2
    if case == "all 0":
        mask[2] = 0
    arrays: dict[str, np.ndarray] = {"tokens": X, "attention_mask": mask}
    if case == "bad length":
        arrays = {"tokens": X, "lengths": np.r_[mask.sum(axis=1)[:-1], 6]}
    if case == "ragged tokens":
        arrays = {"tokens": _T, "offsets": _O, "attention_mask": np.ones((9, 2))}
    if case == "no such mask":
        extra = ["--mask", "nope"]
    if case == "bad key":
        extra = ["--key", "foo=bar"]
    if case == "key mask shape":
        arrays, extra = {"tokens": X, "keep": np.ones((X.shape[0], X.shape[1] + 1))}, ["--key", "mask=keep"]
    if case == "key mask not 0/1":
        arrays = {"tokens": X, "blocks.0.hook_keep": mask * 2}
        extra = ["--key", "mask=blocks.0.hook_keep"]
    np.savez(tmp_path / "m.npz", **arrays)
    out = tmp_path / "m.h5"
    capsys.readouterr()
    assert run(["convert", str(tmp_path / "m.npz"), "-o", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and pattern in err[0], err
    assert "np." not in err[0], err  # values as Python numbers, not NumPy reprs
    if case in ("not 0/1", "all 0", "bad length", "ragged tokens"):
        assert "mask '" in err[0], err  # the array named as the mask
    if case in ("not 0/1", "bad length"):
        assert " is 2:" in err[0] or " is 6:" in err[0], err
    assert not out.exists()


def test_several_files_are_joined_in_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal((k, 4, 3)) for k in (2, 3, 1)]
    ys = [rng.standard_normal((k, 3)) for k in (2, 3, 1)]
    for i, (x, y) in enumerate(zip(parts, ys)):
        np.savez(tmp_path / f"p{i}.npz", tokens=x, targets=y)
    files = [str(tmp_path / f"p{i}.npz") for i in range(3)]
    # dense parts of one n: dense
    assert run(["convert", *files, "-o", str(tmp_path / "all.h5"), "-q"]) == 0
    _same(tmp_path / "all.h5", tokens=np.concatenate(parts), targets=np.concatenate(ys))
    # the order given, a directory (sorted), a pattern (sorted)
    assert run(["convert", files[2], files[0], "-o", str(tmp_path / "rev.h5"), "-q"]) == 0
    _same(tmp_path / "rev.h5", tokens=np.concatenate([parts[2], parts[0]]), targets=np.concatenate([ys[2], ys[0]]))
    d = tmp_path / "dir"
    d.mkdir()
    for i in range(3):
        (tmp_path / f"p{i}.npz").rename(d / f"p{i}.npz")
    assert run(["convert", str(d), "-o", str(tmp_path / "dir.h5"), "-q"]) == 0
    _same(tmp_path / "dir.h5", tokens=np.concatenate(parts), targets=np.concatenate(ys))
    assert run(["convert", str(d / "p*.npz"), "-o", str(tmp_path / "glob.h5"), "-q"]) == 0
    _same(tmp_path / "glob.h5", tokens=np.concatenate(parts), targets=np.concatenate(ys))
    # a padded part with a mask and a ragged one among dense ones: joined ragged
    X, mask, seqs = _padded(N=3, n=4, d=3)
    yx = rng.standard_normal((3, 3))
    np.savez(d / "p3.npz", tokens=X, attention_mask=mask, targets=yx)
    tr, orr, _, _ = _ragged(2, N=2, d=3)
    yr = rng.standard_normal((2, 3))
    np.savez(d / "p4.npz", tokens=tr, offsets=orr, targets=yr)
    assert run(["convert", str(d), "-o", str(tmp_path / "mix.h5"), "-q"]) == 0
    all_seqs = [s for x in parts for s in x] + seqs + [tr[orr[i]:orr[i + 1]] for i in range(2)]
    off = np.concatenate([[0], np.cumsum([len(s) for s in all_seqs])]).astype(np.int64)
    got = _read(tmp_path / "mix.h5")
    assert np.array_equal(got["offsets"], off)
    assert np.array_equal(got["tokens"], np.concatenate(all_seqs))
    assert np.array_equal(got["targets"], np.concatenate([*ys, yx, yr]))


def test_joining_refuses_a_file_of_another_d_or_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(2)
    np.savez(tmp_path / "a.npz", tokens=rng.standard_normal((2, 4, 3)), targets=rng.standard_normal((2, 3)))
    np.savez(tmp_path / "b.npz", tokens=rng.standard_normal((2, 4, 5)), targets=rng.standard_normal((2, 5)))
    np.savez(tmp_path / "c.npz", tokens=rng.standard_normal((2, 4, 3)))
    for other, pattern in (("b", "has tokens of d = 5 but"), ("c", "has another layout than")):
        capsys.readouterr()
        out = tmp_path / "o.h5"
        assert run(["convert", str(tmp_path / "a.npz"), str(tmp_path / f"{other}.npz"), "-o", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"mhla: error: {tmp_path / f'{other}.npz'}: {pattern}"), err
        assert not out.exists()


def test_bfloat16_is_read_exactly_and_tuples_are_refused_clearly(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    X, mask, seqs = _padded()
    xb = torch.from_numpy(X).to(torch.bfloat16)
    exact = xb.float().numpy()  # bfloat16 -> float32 is exact
    torch.save({"last_hidden_state": xb, "attention_mask": torch.from_numpy(mask)}, tmp_path / "b.pt")
    assert run(["convert", str(tmp_path / "b.pt"), "-o", str(tmp_path / "b.h5"), "-q"]) == 0
    got = _read(tmp_path / "b.h5")
    assert got["tokens"].dtype == np.float32
    assert np.array_equal(got["tokens"], np.concatenate([exact[i][mask[i] == 1] for i in range(len(mask))]))
    try:
        from safetensors.torch import save_file
    except ImportError:
        save_file = None
    if save_file is not None:
        save_file({"tokens": xb.contiguous(), "attention_mask": torch.from_numpy(mask)}, str(tmp_path / "b.safetensors"))
        assert run(["convert", str(tmp_path / "b.safetensors"), "-o", str(tmp_path / "bs.h5"), "-q"]) == 0
        assert np.array_equal(_read(tmp_path / "bs.h5")["tokens"], got["tokens"])
    # a model's output tuple: refused in one line that says what to save instead
    torch.save((xb, xb[:, 0]), tmp_path / "t.pt")
    capsys.readouterr()
    assert run(["convert", str(tmp_path / "t.pt"), "-o", str(tmp_path / "t.h5")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a tuple of 2 arrays of shapes (6, 5, 4), (6, 4)" in err[0], err
    assert "last_hidden_state" in err[0]
    # a list of (n_i, d) sequences is still ragged data
    torch.save([torch.from_numpy(s) for s in seqs], tmp_path / "l.pt")
    assert run(["convert", str(tmp_path / "l.pt"), "-o", str(tmp_path / "l.h5"), "-q"]) == 0
    assert np.array_equal(_read(tmp_path / "l.h5")["tokens"], np.concatenate(seqs))


def test_a_refusal_relabelled_keeps_its_remedies(tmp_path: Path) -> None:
    """The reader's refusal of the temporary output, said of the inputs, still words its remedy per caller."""
    from mhla_cli.cli.options import in_options
    from mhla_cli.errors import Refused
    from mhla_cli.io.convert._writer import _relabel

    tmp = tmp_path / "out.h5.tmp"
    exc = _relabel(Refused("map them with {reduce}", tmp, reduce={"tokens": "a.pt", "dim": "K"}), tmp, "a.pt")
    assert isinstance(exc, Refused) and exc.path == "a.pt"
    assert str(exc) == "a.pt: map them with mhla_cli.reduce_tokens(a.pt, REDUCED, dim=K)"
    assert str(in_options(exc)) == "a.pt: map them with mhla reduce a.pt -o REDUCED.h5 --dim K"
