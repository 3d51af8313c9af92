"""The `mhla` command line end to end: exit codes, JSON keys, files, no partial outputs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli import __version__, formats
from mhla_cli.cli import run
from mhla_cli.heads import Heads
from mhla_cli.model import Model


def cli_json(capsys: pytest.CaptureFixture[str], args: list[str], code: int = 0) -> dict:
    assert run(args) == code, capsys.readouterr().err
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out  # exactly one JSON object on stdout
    return json.loads(out[0])


def test_pipeline_recovers_teacher(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, teacher, feats, model, heads, pred = (tmp_path / n for n in
                                                 ("d.h5", "t.h5", "f.h5", "m.h5", "h.h5", "p.h5"))
    g = cli_json(capsys, ["generate", "teacher", "-o", str(data), "--dim", "3", "--heads", "2", "--n-samples",
                          "300", "--seq-len", "1:20", "--teacher-out", str(teacher), "--dtype", "float64",
                          "--json", "-q"])
    assert g["n_samples"] == 300 and g["d"] == 3
    f = cli_json(capsys, ["featurize", str(data), "-o", str(feats), "--chunk-size", "50", "--json", "-q"])
    assert f["n_features"] == 18 and f["n_samples"] == 300 and f["basis_passes"] == 1  # the estimate sufficed
    c = cli_json(capsys, ["certify", str(feats), "--json", "-q"])
    for key in ("identifiable", "lambda_min", "lambda_max", "rank", "n_features", "n_samples", "threshold",
                "domain", "margin"):
        assert key in c
    assert c["identifiable"] is True and c["domain"] == "full"
    m = cli_json(capsys, ["fit", str(feats), "-o", str(model), "--json", "-q"])
    assert m["identifiable"] is True and m["train_mse"] <= m["mse_resolution"]
    e = cli_json(capsys, ["export-heads", str(model), "-o", str(heads), "--json", "-q"])
    assert 1 <= e["n_heads"] <= 9 and e["relative_function_error"] < 1e-12
    p = cli_json(capsys, ["predict", str(heads), str(data), "-o", str(pred), "--json", "-q"])
    assert p["mse"] < 1e-20
    true_coef = Heads.load(teacher).coef
    fitted = Model.load(model)
    assert np.linalg.norm(fitted.coef - true_coef) < 1e-8 * np.linalg.norm(true_coef)
    with h5py.File(pred) as fh:
        assert fh.attrs["mhla_kind"] == "predictions" and fh.attrs["mhla_format_version"] == formats.FORMAT_VERSION
        assert fh["predictions"].shape == (300, 3) and fh["predictions"].dtype == np.float64
    # certify straight from the tokens file gives the same verdict
    c2 = cli_json(capsys, ["certify", str(data), "--json", "-q"])
    assert c2["lambda_min"] == pytest.approx(c["lambda_min"], rel=1e-10)


def test_certify_exit_1_and_json_when_not_identifiable(tmp_path: Path, capsys) -> None:
    data = tmp_path / "a.h5"
    assert run(["generate", "assoc", "-o", str(data), "--keys", "2", "--n-samples", "500",
                "--orthogonal-fraction", "1", "-q"]) == 0
    c = cli_json(capsys, ["certify", str(data), "--json", "--domain", "observed"], code=1)
    assert c["identifiable"] is False and c["reasons"]
    g = tmp_path / "g.h5"
    assert run(["generate", "assoc", "-o", str(g), "--keys", "2", "--n-samples", "500", "-q"]) == 0
    assert run(["certify", str(g), "-q"]) == 1
    assert run(["certify", str(g), "-q", "--domain", "observed"]) == 0


def test_all_positions_outputs(tmp_path: Path, teacher_file) -> None:
    data, teacher, ds = teacher_file
    pred = tmp_path / "p.h5"
    assert run(["predict", str(teacher), str(data), "-o", str(pred), "--all-positions", "-q"]) == 0
    from mhla_cli.forward import forward_heads

    th = Heads.load(teacher)
    with h5py.File(pred) as f:
        off = f["offsets"][()]
        np.testing.assert_array_equal(off, ds.offsets)
        out = f["outputs"][()]
    for i in (0, 7, 299):
        np.testing.assert_allclose(out[off[i]:off[i + 1]], forward_heads(th.V, th.Q, ds.sequence(i), True),
                                   rtol=1e-10, atol=1e-10)


def test_max_heads_reports_function_change(tmp_path: Path, teacher_file, capsys) -> None:
    data, _, _ = teacher_file
    model, heads = tmp_path / "m.h5", tmp_path / "h.h5"
    assert run(["fit", str(data), "-o", str(model), "-q"]) == 0
    e = cli_json(capsys, ["export-heads", str(model), "-o", str(heads), "--max-heads", "1", "--json", "-q"])
    assert e["n_heads"] == 1 and 0 < e["relative_function_error"] < 1
    assert Heads.load(heads).V.shape == (1, 3, 3)


def test_failed_command_leaves_no_output(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nope.h5"
    out = tmp_path / "out.h5"
    assert run(["featurize", str(missing), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"mhla: error: {missing}: no such file"
    assert not out.exists()
    out.write_bytes(b"keep me")
    assert run(["featurize", str(missing), "-o", str(out)]) == 2
    assert out.read_bytes() == b"keep me"
    assert not list(tmp_path.glob("*.tmp-mhla"))


def test_usage_errors_exit_2_one_line(capsys) -> None:
    assert run(["fit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mhla: error: fit: Missing argument")
    assert run(["certify", "x.h5", "--domain", "sideways"]) == 2
    assert "mhla: error:" in capsys.readouterr().err


def test_console_script_as_process(tmp_path: Path, teacher_file) -> None:
    data, _, _ = teacher_file
    script = shutil.which("mhla")  # the installed console script; `python -m mhla_cli` otherwise
    exe = [script] if script else [sys.executable, "-m", "mhla_cli"]
    v = subprocess.run(exe + ["--version"], capture_output=True, text=True)
    assert v.returncode == 0 and v.stdout.strip() == f"mhla {__version__}"
    r = subprocess.run(exe + ["certify", str(data), "--json"], capture_output=True, text=True)
    assert r.returncode == 0 and json.loads(r.stdout)["identifiable"] is True
    bad = subprocess.run(exe + ["certify", str(tmp_path / "missing.h5")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("mhla: error: ") and "Traceback" not in bad.stderr
