"""A layer as a sum of blocks on the command line: `mhla fit` / `certify --blocks`, `predict` and `export-heads` of a
blocks file. The library (mhla_cli.solve.blocks, mhla_cli.model.heads_sum; tested against numpy in
tests/test_blocks.py and tests/test_heads_sum.py) is the reference here: the commands' numbers and files are the
library's, their exit codes 0 / 1 / 2, their refusals one line, and their outputs never replace what mhla did not
write.

A test module of the command layer (tests/test_layout.py: cli is tested through `run([...])`); the blocks' maps
are reduced files of `mhla reduce --method weights`, whose token map spans the rows of the given W exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import mhla_cli
from mhla_cli import block_statistics, forward_heads, load_blocks, load_reduction, write_tokens
from mhla_cli.cli import run
from mhla_cli.samples import BIDIRECTIONAL, ReadSpec

D, D_OUT, HEADS = 4, 3, 2


@dataclass
class Files:
    dir: Path
    wide: Path  # last-token targets of a sum of two blocks on orthogonal token directions
    wide_pp: Path  # the same blocks' outputs at every position of the whole window (bidirectional)
    len1: Path  # sequences of one token: never identifiable
    other: Path  # tokens of another width (D - 1)
    maps: dict[str, Path]  # "b0", "b1": the two blocks' maps; "ov": a map overlapping both; "narrow": of `other`
    tokens: np.ndarray
    offsets: np.ndarray
    targets: np.ndarray


def _json(capsys: pytest.CaptureFixture[str], argv: list[str], code: int | None = 0) -> dict[str, Any]:
    capsys.readouterr()
    got = run([*argv, "--json", "-q"])
    out, err = capsys.readouterr()
    assert code is None or got == code, (argv, got, err)
    rec: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    rec["_code"], rec["_err"] = got, err
    return rec


def _maps(root: Path, wide: Path, W: np.ndarray, name: str) -> Path:
    np.savez(root / f"{name}.npz", W=W)
    out = root / f"{name}.h5"
    assert run(["reduce", str(wide), "-o", str(out), "--dim", str(W.shape[0]), "--method", "weights", "--weights",
                str(root / f"{name}.npz"), "--keep-targets", "-q"]) == 0
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    root = tmp_path_factory.mktemp("blocks")
    rng = np.random.default_rng(7)
    lengths = rng.integers(3, 8, size=160)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    X = rng.standard_normal((int(offsets[-1]), D))
    write_tokens(root / "plain.h5", X, offsets=offsets)
    E = np.linalg.qr(rng.standard_normal((D, D)))[0].T  # orthonormal token directions
    maps = {k: _maps(root, root / "plain.h5", W, k) for k, W in (("b0", E[:2]), ("b1", E[2:]), ("ov", E[1:3]))}
    P = [load_reduction(maps[k]).P for k in ("b0", "b1")]
    teacher = [(rng.standard_normal((HEADS, D_OUT, 2)), rng.standard_normal((HEADS, 2, 2))) for _ in P]
    seqs = [X[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    Y = np.array([sum(forward_heads(V, Q, x @ p) for (V, Q), p in zip(teacher, P)) for x in seqs])
    Ypp = np.concatenate([sum(forward_heads(V, Q, x @ p, layout=BIDIRECTIONAL) for (V, Q), p in zip(teacher, P))
                          for x in seqs])
    write_tokens(root / "wide.h5", X, offsets=offsets, targets=Y)
    write_tokens(root / "wide_pp.h5", X, offsets=offsets, targets=Ypp, attention="bidirectional")
    write_tokens(root / "len1.h5", rng.standard_normal((200, 1, D)), targets=rng.standard_normal((200, D_OUT)))
    write_tokens(root / "other.h5", rng.standard_normal((40, 3, D - 1)), targets=rng.standard_normal((40, 1)))
    maps["narrow"] = _maps(root, root / "other.h5", np.eye(D - 1)[:2], "narrow")
    return Files(root, root / "wide.h5", root / "wide_pp.h5", root / "len1.h5", root / "other.h5", maps, X, offsets,
                 Y)


def _blocks(files: Files, *names: str) -> list[str]:
    return [a for n in names for a in ("--blocks", str(files.maps[n]))]


def _library(files: Files, data: Path, names: tuple[str, ...] = ("b0", "b1"), **kw: Any) -> Any:
    return block_statistics(data, [load_reduction(files.maps[n]).P for n in names], **kw)


def test_fit_writes_the_librarys_sum_and_reports_its_numbers(files: Files, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sum.h5"
    rec = _json(capsys, ["fit", str(files.wide), "-o", str(out), *_blocks(files, "b0", "b1")])
    lib = mhla_cli.fit(_library(files, files.wide))  # the one dispatcher: fit_blocks
    assert isinstance(lib, mhla_cli.HeadsSum)
    assert rec["block_features"] == [6, 6] and rec["n_features"] == 12 and rec["n_blocks"] == 2
    assert rec["identifiable"] is True and lib.info["identifiable"] is True
    assert (rec["n_samples"], rec["n_tokens"]) == (160, int(files.offsets[-1]))
    for k in ("lambda_min", "lambda_max", "train_mse", "ridge"):
        assert rec[k] == pytest.approx(lib.info[k], rel=1e-12, abs=1e-300), k
    assert rec["train_mse"] < 1e-12 * np.mean(files.targets ** 2) and rec["train_r2"] > 1 - 1e-12  # the teacher is a sum of these blocks
    got = load_blocks(out)
    assert got.n_blocks == 2 and got.n_heads == lib.n_heads == rec["n_heads"]
    np.testing.assert_allclose(got.predict(files.tokens, files.offsets), lib.predict(files.tokens, files.offsets),
                               rtol=0, atol=1e-12)


def test_predict_of_a_blocks_file_is_the_sums_outputs(files: Files, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out, pred = tmp_path / "sum.h5", tmp_path / "pred.h5"
    _json(capsys, ["fit", str(files.wide), "-o", str(out), *_blocks(files, "b0", "b1")])
    rec = _json(capsys, ["predict", str(out), str(files.wide), "-o", str(pred)])
    assert rec["n_blocks"] == 2 and rec["scored_as"] == "sequences" and rec["n_scored"] == 160
    with h5py.File(pred, "r") as f:
        assert f.attrs["mhla_kind"] == "predictions" and "outputs" not in f
        P = f["predictions"][()]
    np.testing.assert_allclose(P, load_blocks(out).predict(files.tokens, files.offsets), rtol=0, atol=1e-12)
    np.testing.assert_allclose(P, files.targets, rtol=0, atol=1e-8 * np.abs(files.targets).max())
    assert rec["r2"] > 1 - 1e-12


def test_a_per_position_sum_predicts_at_every_position(files: Files, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out, pred = tmp_path / "sum.h5", tmp_path / "pred.h5"
    fit = _json(capsys, ["fit", str(files.wide_pp), "-o", str(out), *_blocks(files, "b0", "b1")])
    assert fit["attention"] == "bidirectional" and fit["n_samples"] == int(files.offsets[-1])
    lib = mhla_cli.fit(_library(files, files.wide_pp, read=ReadSpec("bidirectional")))
    assert fit["train_mse"] == pytest.approx(lib.info["train_mse"], rel=1e-12, abs=1e-300)
    rec = _json(capsys, ["predict", str(out), str(files.wide_pp), "-o", str(pred)])
    assert rec["scored_as"] == "bidirectional" and rec["n_scored"] == int(files.offsets[-1]) and rec["r2"] > 1 - 1e-12
    with h5py.File(pred, "r") as f:
        outputs, offsets = f["outputs"][()], f["offsets"][()]
        assert f.attrs["attention"] == "bidirectional"
    np.testing.assert_array_equal(offsets, files.offsets)
    np.testing.assert_allclose(outputs, lib.predict(files.tokens, files.offsets), rtol=0, atol=1e-10)


def test_normalize_length_is_the_librarys(files: Files, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sum.h5"
    rec = _json(capsys, ["fit", str(files.wide), "-o", str(out), *_blocks(files, "b0", "b1"), "--affine",
                         "--normalize", "length"])
    lib = mhla_cli.fit(_library(files, files.wide, read=ReadSpec(normalize="length"), affine=True))
    assert rec["normalize"] == "length" == load_blocks(out).normalize
    assert rec["train_mse"] == pytest.approx(lib.info["train_mse"], rel=1e-12)
    pred = _json(capsys, ["predict", str(out), str(files.wide), "-o", str(tmp_path / "p.h5")])
    assert pred["normalize"] == "length" and pred["mse"] == pytest.approx(rec["train_mse"], rel=1e-9)
    assert pred["r2"] == rec["train_r2"]
    with h5py.File(tmp_path / "p.h5", "r") as f:
        np.testing.assert_allclose(f["predictions"][()], lib.predict(files.tokens, files.offsets), rtol=0,
                                   atol=1e-10)


@pytest.mark.parametrize("affine", [False, True])
def test_certify_is_the_librarys_certificate(files: Files, affine: bool, capsys: pytest.CaptureFixture[str]) -> None:
    rec = _json(capsys, ["certify", str(files.wide), *_blocks(files, "b0", "b1"), *(["--affine"] if affine else [])])
    cert = mhla_cli.certify(_library(files, files.wide, affine=affine))
    assert rec["identifiable"] is True and cert.identifiable
    assert rec["n_features"] == cert.n_features == 12 + (D + 1 if affine else 0) == rec["rank"]
    assert rec["lambda_min"] == pytest.approx(cert.lambda_min, rel=1e-12)
    assert rec["affine"] is affine and rec["block_features"] == [6, 6] + ([D + 1] if affine else [])
    # --min-eig above lambda_max: the margin is not met (exit 1)
    _json(capsys, ["certify", str(files.wide), *_blocks(files, "b0", "b1"), "--min-eig",
                   str(2 * cert.lambda_max)], code=1)


def test_overlapping_blocks_do_not_certify_and_say_why(files: Files, capsys: pytest.CaptureFixture[str]) -> None:
    for names in (("b0", "ov"), ("b0", "b0")):
        rec = _json(capsys, ["certify", str(files.wide), *_blocks(files, *names)], code=1)
        assert rec["identifiable"] is False
        assert any("overlap" in r for r in rec["reasons"]), rec["reasons"]
    capsys.readouterr()
    assert run(["certify", str(files.wide), *_blocks(files, "b0", "ov")]) == 1
    assert "token directions overlap" in capsys.readouterr().err


def test_sequences_of_one_token_never_certify(files: Files, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for names in (("b0",), ("b0", "b1")):
        for affine in ([], ["--affine"]):
            rec = _json(capsys, ["certify", str(files.len1), *_blocks(files, *names), *affine], code=1)
            assert rec["identifiable"] is False and rec["reasons"]
    rec = _json(capsys, ["fit", str(files.len1), "-o", str(tmp_path / "s.h5"), *_blocks(files, "b0")])
    assert rec["identifiable"] is False and "do not determine the sum of blocks" in rec["_err"]


def test_ridge_auto_is_the_librarys_choice(files: Files, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    noisy = tmp_path / "noisy.h5"
    rng = np.random.default_rng(3)
    write_tokens(noisy, files.tokens, offsets=files.offsets,
                 targets=files.targets + 3.0 * rng.standard_normal(files.targets.shape))
    rec = _json(capsys, ["fit", str(noisy), "-o", str(tmp_path / "s.h5"), *_blocks(files, "b0", "b1"), "--affine",
                         "--ridge", "auto", "--folds", "3"])
    lib = mhla_cli.fit(_library(files, noisy, affine=True, folds=3), ridge="auto")
    assert rec["ridge_cv"]["n_folds"] == 3 and rec["ridge"] == lib.info["ridge"] == lib.info["cv"]["chosen"]
    assert rec["train_mse"] == pytest.approx(lib.info["train_mse"], rel=1e-12)
    default = _json(capsys, ["fit", str(noisy), "-o", str(tmp_path / "s.h5"), *_blocks(files, "b0"), "--ridge",
                             "auto"])
    assert default["ridge_cv"]["n_folds"] == 5  # cli.blocks.DEFAULT_FOLDS


def test_export_heads_writes_the_dense_heads_of_the_sum(files: Files, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out, heads, npz = tmp_path / "sum.h5", tmp_path / "heads.h5", tmp_path / "heads.npz"
    _json(capsys, ["fit", str(files.wide), "-o", str(out), *_blocks(files, "b0", "b1")])
    rec = _json(capsys, ["export-heads", str(out), "-o", str(npz)])
    dense = load_blocks(out).dense()
    assert (rec["n_heads"], rec["d"], rec["d_out"], rec["n_blocks"]) == (dense.n_heads, D, D_OUT, 2)
    with np.load(npz) as z:
        np.testing.assert_array_equal(z["V"], dense.V)
        np.testing.assert_array_equal(z["Q"], dense.Q)
    _json(capsys, ["export-heads", str(out), "-o", str(heads)])
    _json(capsys, ["predict", str(heads), str(files.wide), "-o", str(tmp_path / "p1.h5")])
    _json(capsys, ["predict", str(out), str(files.wide), "-o", str(tmp_path / "p2.h5")])
    with h5py.File(tmp_path / "p1.h5", "r") as a, h5py.File(tmp_path / "p2.h5", "r") as b:
        np.testing.assert_allclose(a["predictions"][()], b["predictions"][()], rtol=0, atol=1e-10)


def test_export_heads_of_a_sum_with_an_affine_map_is_refused(files: Files, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out, heads = tmp_path / "sum.h5", tmp_path / "heads.npz"
    _json(capsys, ["fit", str(files.wide), "-o", str(out), *_blocks(files, "b0"), "--affine"])
    rec = _json(capsys, ["export-heads", str(out), "-o", str(heads)], code=2)
    err = rec["_err"].strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mhla: error: {out}: ") and "affine map" in err[0], err
    assert not heads.exists()


def _refusals(f: Files, blocks_file: Path) -> list[tuple[list[str], str]]:
    fit = ["fit", str(f.wide), "-o", str(f.dir / "never.h5"), *_blocks(f, "b0")]
    cert = ["certify", str(f.wide), *_blocks(f, "b0")]
    pred = ["predict", str(blocks_file), str(f.wide), "-o", str(f.dir / "never.h5")]
    exp = ["export-heads", str(blocks_file), "-o", str(f.dir / "never.npz")]
    return [(fit + ["--heads", "2"], "--heads"), (fit + ["--nuclear", "1"], "--nuclear"),
            (fit + ["--weight-decay", "1"], "--weight-decay"), (fit + ["--affine-from", str(f.wide)], "--affine-from"),
            (fit + ["--bias-terms"], "--bias-terms"), (fit + ["--scheduler", "local"], "--scheduler"),
            (fit + ["--device", "torch:cpu"], "--device"), (fit + ["--restarts", "3"], "--restarts"),
            (fit + ["--folds", "3"], "--folds"),  # without --ridge auto
            (cert + ["--witness", str(f.dir / "w.h5")], "--witness"), (cert + ["--on", str(f.wide)], "--on"),
            (cert + ["--domain", "observed"], "--domain"), (cert + ["--affine-from", str(f.wide)], "--affine-from"),
            (cert + ["--bias-terms"], "--bias-terms"),
            (pred + ["--causal"], "--causal"), (pred + ["--all-positions"], "--all-positions"),
            (pred + ["--affine-from", str(f.wide)], "--affine-from"), (pred + ["--device", "torch:cpu"], "--device"),
            (exp + ["--fewest"], "--fewest"), (exp + ["--max-heads", "2"], "--max-heads"),
            (exp + ["--tol", "0.1"], "--tol"), (exp + ["--unreduce", str(f.maps["b0"])], "--unreduce"),
            (["fit", str(f.wide), "-o", str(f.dir / "never.h5"), "--affine"], "--affine"),
            (["fit", str(f.wide), "-o", str(f.dir / "never.h5"), "--ridge", "auto", "--folds", "3"], "--folds"),
            (["certify", str(f.wide), "--affine"], "--affine")]


def test_options_that_do_not_apply_are_refused_in_one_line(files: Files, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    blocks_file = tmp_path / "sum.h5"
    _json(capsys, ["fit", str(files.wide), "-o", str(blocks_file), *_blocks(files, "b0")])
    wrong = []
    for argv, option in _refusals(files, blocks_file):
        capsys.readouterr()
        code = run(argv)
        err = capsys.readouterr().err.strip().splitlines()
        if code != 2 or len(err) != 1 or not err[0].startswith("mhla: error: ") or option not in err[0]:
            wrong.append((argv[0], option, code, err))
    assert not wrong, wrong
    assert not (files.dir / "never.h5").exists() and not (files.dir / "never.npz").exists()


def test_inputs_that_cannot_be_blocks_are_refused(files: Files, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "s.h5")
    feats = tmp_path / "feats.h5"
    assert run(["featurize", str(files.wide), "-o", str(feats), "-q"]) == 0
    cases = [(["fit", str(files.wide), "-o", out, *_blocks(files, "b0", "narrow")], files.maps["narrow"],
              "3-dim tokens but"),
             (["certify", str(files.wide), *_blocks(files, "narrow")], files.maps["narrow"], "3-dim tokens but"),
             (["fit", str(files.wide), "-o", out, "--blocks", str(files.wide)], files.wide, "records no reduction"),
             (["fit", str(feats), "-o", out, *_blocks(files, "b0")], feats, "tokens file"),
             (["certify", str(tmp_path.parent / "missing.h5"), *_blocks(files, "b0")], None, ""),
             (["fit", str(files.dir / "plain.h5"), "-o", out, *_blocks(files, "b0")], files.dir / "plain.h5",
              "no 'targets'"),
             (["fit", str(files.wide), "-o", out, *_blocks(files, "b0"), "--ridge", "auto", "--folds", "1"], None, ""),
             (["fit", str(files.wide), "-o", out, *_blocks(files, "b0"), "--ridge", "auto", "--folds", "500"],
              files.wide, "folds")]
    for argv, path, words in cases:
        capsys.readouterr()
        assert run(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mhla: error: "), (argv, err)
        if path is not None:
            assert err[0].startswith(f"mhla: error: {path}: ") and words in err[0], (argv, err)
    assert not Path(out).exists()


def test_fit_never_replaces_what_mhla_did_not_write(files: Files, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    blocks = _blocks(files, "b0", "b1")
    notes = tmp_path / "notes.h5"
    users = tmp_path / "users.h5"
    notes.write_bytes(b"my notes, not mhla's\n")
    with h5py.File(users, "w") as f:
        f["tokens"] = files.tokens
    model = tmp_path / "model.h5"
    assert run(["fit", str(files.wide), "-o", str(model), "-q"]) == 0
    for out in (notes, users, model, files.wide, files.maps["b0"], files.maps["b1"]):
        before = out.read_bytes()
        capsys.readouterr()
        assert run(["fit", str(files.wide), "-o", str(out), *blocks]) == 2, out
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"mhla: error: {out}: "), err
        assert out.read_bytes() == before
        assert not list(out.parent.glob(f".{out.name}.*tmp-mhla*"))


def test_an_earlier_blocks_file_is_replaced(files: Files, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sum.h5"
    _json(capsys, ["fit", str(files.wide), "-o", str(out), *_blocks(files, "b0")])
    first = load_blocks(out)
    _json(capsys, ["fit", str(files.wide), "-o", str(out), *_blocks(files, "b0", "b1")])
    assert first.n_blocks == 1 and load_blocks(out).n_blocks == 2
