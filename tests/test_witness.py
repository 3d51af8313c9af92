"""`mhla certify --witness`: two equally good models with different functions (issue 5, item 5)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mhla_cli import synthetic
from mhla_cli.cli import run
from mhla_cli.model import forward_heads, predict
from mhla_cli.solve import Model
from mhla_cli.witness import Witness


def _sse(coef: np.ndarray, ds: synthetic.Dataset) -> float:
    return float(((predict(coef, ds.tokens, ds.offsets) - ds.targets) ** 2).sum())


@pytest.mark.parametrize("kind", ["assoc", "few"])
def test_witness_for_unidentifiable_data(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if kind == "assoc":  # orthogonal keys: the min-norm fit is the teacher, yet other zero-loss models exist
        ds, _ = synthetic.generate_assoc(2, 500, orthogonal_fraction=1.0, seed=0)
    else:  # N < psi
        ds, _ = synthetic.generate_teacher(3, 2, 12, 5, noise=0.1, seed=0)
    data = tmp_path / "d.h5"
    ds.save(data, dtype="float64")
    w = tmp_path / "w.h5"
    capsys.readouterr()
    assert run(["certify", str(data), "--witness", str(w), "--json", "-q"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["witness"]["verified"] and out["witness"]["loss_source"] == "data"
    wit = Witness.load(w)
    assert np.allclose(Model.load(w).coef, wit.model_a.coef)
    # same training loss, recomputed here from the data, to 1e-10 relative to the target energy
    sa, sb = _sse(wit.model_a.coef, ds), _sse(wit.model_b.coef, ds)
    assert abs(sa - sb) <= 1e-10 * float((ds.targets**2).sum())
    # different functions, by the stated amount, on the stored sequence
    assert np.linalg.norm(wit.model_a.coef - wit.model_b.coef) >= 0.1 * np.linalg.norm(wit.model_a.coef)
    X = wit.tokens
    ya = predict(wit.model_a.coef, X[None])[0]
    yb = predict(wit.model_b.coef, X[None])[0]
    diff = float(np.linalg.norm(ya - yb))
    assert diff == pytest.approx(wit.info["prediction_difference"], rel=1e-9)
    assert diff > 1e-3 * max(1.0, float(np.linalg.norm(ya)))
    # the heads of model B really compute it (so the witness is an MHLA, not just a coef)
    from mhla_cli.heads import heads_from_W
    hb, _ = heads_from_W(wit.model_b.W, tol=0)
    assert np.allclose(forward_heads(hb.V, hb.Q, X), yb, rtol=1e-9, atol=1e-12)


def test_no_witness_when_identifiable(teacher_file: tuple[Path, Path, synthetic.Dataset], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    data, _, _ = teacher_file
    w = tmp_path / "w.h5"
    assert run(["certify", str(data), "--witness", str(w)]) == 0
    assert not w.exists()
    assert "no witness" in capsys.readouterr().err


def test_observed_domain_witness_differs_on_observed_inputs(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Orthogonal associative memory: the witness of `--domain observed` differs on inputs whose
    last token is a query (q, 0), the inputs the task actually has."""
    k = 2
    ds, _ = synthetic.generate_assoc(k, 600, orthogonal_fraction=1.0, seed=1)
    data = tmp_path / "d.h5"
    ds.save(data, dtype="float64")
    w = tmp_path / "w.h5"
    capsys.readouterr()
    assert run(["certify", str(data), "--domain", "observed", "--witness", str(w), "--json", "-q"]) == 1
    assert json.loads(capsys.readouterr().out)["witness"]["verified"]
    wit = Witness.load(w)
    X = wit.tokens
    assert np.abs(X[-1, k:]).max() < 1e-12  # the last token lies in U_n = span of the queries
    sa, sb = _sse(wit.model_a.coef, ds), _sse(wit.model_b.coef, ds)
    assert abs(sa - sb) <= 1e-10 * float((ds.targets**2).sum())
    ya, yb = (predict(c, X[None])[0] for c in (wit.model_a.coef, wit.model_b.coef))
    assert np.linalg.norm(ya - yb) > 1e-3 * max(np.linalg.norm(ya), 1.0)
