"""`mhla compare`: same function or not, in p-space and on data (issue 5, item 4)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mhla_cli import synthetic
from mhla_cli.cli import run
from mhla_cli.compare import compare
from mhla_cli.heads import Heads


def test_model_vs_teacher_heads(teacher_file: tuple[Path, Path, synthetic.Dataset], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    data, th, ds = teacher_file
    m = tmp_path / "m.h5"
    assert run(["fit", str(data), "-o", str(m), "-q"]) == 0
    capsys.readouterr()
    assert run(["compare", str(m), str(th), "--tol", "1e-8", "--on", str(data), "--json", "-q"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["relative_distance"] < 1e-8 and out["distance"] < 1e-8
    assert out["rms_prediction_difference"] < 1e-8 * out["rms_prediction_b"]
    # a different function: exit 1, and the JSON still says by how much
    other = tmp_path / "o.h5"
    t = Heads.load(th)
    Heads(V=t.V, Q=t.Q * 1.01).save(other)
    assert run(["compare", str(other), str(th), "--tol", "1e-3", "--json", "-q"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["relative_distance"] == pytest.approx(0.01, rel=1e-9)
    assert out["same"] is False


def test_gauge_invariance() -> None:
    rng = np.random.default_rng(0)
    t = synthetic.random_teacher(3, 2, rng)
    c = np.array([2.0, -0.5])[:, None, None]
    perm = Heads(V=(t.V * c)[::-1], Q=(t.Q / c)[::-1])  # rescaled and reordered heads
    res = compare(perm, t, tol=1e-12)
    assert res["same"] and res["relative_distance"] < 1e-14


def test_different_d_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(1)
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    synthetic.random_teacher(3, 1, rng).save(a)
    synthetic.random_teacher(4, 1, rng).save(b)
    capsys.readouterr()
    assert run(["compare", str(a), str(b)]) == 2
    assert "different d" in capsys.readouterr().err
