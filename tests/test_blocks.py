"""A sum of MHLA blocks, each on its own token map (mhla_cli.solve.blocks), against plain numpy on materialised
features: the joint least squares, the certificate's spectrum, the ridge, and what cannot change the answer."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mhla_cli
from mhla_cli.errors import InputError
from mhla_cli.linalg import memory
from mhla_cli.samples import ReadSpec
from mhla_cli.solve import blocks
from mhla_cli.solve.blocks import MAP_COND_MAX, OVERLAP_TOL, block_statistics, certify_blocks, fit_blocks, overlap

from _reference import samples as ref_samples


def _data(rng, n_seq=120, D=6, lo=2, hi=7):
    lens = rng.integers(lo, hi, size=n_seq)
    off = np.concatenate([[0], np.cumsum(lens)])
    return rng.normal(size=(off[-1], D)), off


def _teacher(X, off, maps, e, rng, attention="bidirectional", normalize="length"):
    """A sum of random MHLAs, block b reading X maps[b], at every sample of the layout (numpy)."""
    heads = [(rng.normal(size=(2, e, P.shape[1])), rng.normal(size=(2, P.shape[1], P.shape[1]))) for P in maps]
    Y = np.zeros((X.shape[0] if attention else off.size - 1, e))
    for (V, Q), P in zip(heads, maps):
        Z = X @ P
        for Xs, _, row in ref_samples(Z, off, per_position=attention is not None, attention=attention or "causal"):
            S = Xs.T @ Xs / (Xs.shape[0] if normalize == "length" else 1)
            Y[row] += np.einsum("hab,bc,hcl,l->a", V, S, Q, Xs[-1])
    return Y


def _write(tmp_path, name, X, off, Y, attention="bidirectional", weights=None):
    p = tmp_path / name
    kw = {} if weights is None else {"weights": weights}
    mhla_cli.write_tokens(p, X, offsets=off, targets=Y, attention=attention, **kw)
    return p


def _design(X, off, maps, attention="bidirectional", normalize="length", affine=False, weights=None):
    """The materialised features (one row per sample, plain coordinates: S[j,k] x[l], j <= k) of every block side by
    side, (x, 1) with `affine`; the sample weights; the rows of the targets."""
    rows, w, where = [], [], []
    per = attention is not None
    blocks_samples = [ref_samples(X @ P, off, per_position=per, attention=attention or "causal", weights=weights)
                      for P in maps]
    wide = ref_samples(X, off, per_position=per, attention=attention or "causal", weights=weights)
    for i, (xw, wt, row) in enumerate(wide):
        feats = []
        for P, bs in zip(maps, blocks_samples):
            Xs = bs[i][0]
            S = Xs.T @ Xs / (Xs.shape[0] if normalize == "length" else 1)
            d = P.shape[1]
            feats.append([S[j, k] * Xs[-1, m] for j in range(d) for k in range(j, d) for m in range(d)])
        if affine:
            feats.append(list(xw[-1]) + [1.0])
        rows.append(np.concatenate(feats))
        w.append(wt)
        where.append(row)
    return np.array(rows), np.array(w), np.array(where)


def _lstsq_fit(F, w, Y):
    """Fitted values of the weighted least squares (unique even where the coefficients are not)."""
    sw = np.sqrt(w)[:, None]
    coef = np.linalg.lstsq(F * sw, Y * sw, rcond=None)[0]
    return coef


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


@pytest.mark.parametrize("attention", ["bidirectional", "causal", None])
@pytest.mark.parametrize("normalize", ["none", "length"])
@pytest.mark.parametrize("e", [1, 4])
def test_joint_fit_equals_numpy_lstsq(tmp_path, attention, normalize, e):
    rng = np.random.default_rng(abs(hash((attention, normalize, e))) % 2**32)
    X, off = _data(rng)
    maps = [rng.normal(size=(6, 2)), rng.normal(size=(6, 3))]
    Y = _teacher(X, off, maps, e, rng, attention, normalize) + 0.1 * rng.normal(
        size=(X.shape[0] if attention else off.size - 1, e))
    p = _write(tmp_path, "t.h5", X, off, Y, attention=attention)
    fn = fit_blocks(block_statistics(p, maps, ReadSpec(normalize=normalize)))
    F, w, row = _design(X, off, maps, attention, normalize)
    coef = _lstsq_fit(F, w, Y[row])
    pred = fn.predict(X, off)
    assert _rel(pred[row], F @ coef) < 1e-8
    # and on held-out data
    X2, off2 = _data(rng, n_seq=30)
    F2, _, row2 = _design(X2, off2, maps, attention, normalize)
    assert _rel(fn.predict(X2, off2)[row2], F2 @ coef) < 1e-8
    # the train MSE from the sums: to the rounding of the target energy it is a difference from
    assert fn.info["train_mse"] == pytest.approx(np.mean((F @ coef - Y[row]) ** 2), abs=1e-10 * np.mean(Y ** 2))


def test_affine_block_and_weights_equal_numpy(tmp_path):
    rng = np.random.default_rng(3)
    X, off = _data(rng)
    maps = [rng.normal(size=(6, 2)), rng.normal(size=(6, 2))]
    Y = _teacher(X, off, maps, 3, rng) + X[:, :3] @ rng.normal(size=(3, 3)) + 0.5 + 0.1 * rng.normal(size=(len(X), 3))
    wts = rng.uniform(0.0, 2.0, size=len(X))
    wts[::7] = 0.0
    p = _write(tmp_path, "t.h5", X, off, Y, weights=wts)
    fn = fit_blocks(block_statistics(p, maps, ReadSpec(normalize="length"), affine=True))
    F, w, row = _design(X, off, maps, "bidirectional", "length", affine=True, weights=wts)
    coef = _lstsq_fit(F[w > 0], w[w > 0], Y[row][w > 0])
    assert _rel(fn.predict(X, off)[row], F @ coef) < 1e-8
    assert fn.affine_weight.shape == (3, 6) and fn.affine_bias.shape == (3,)
    # the affine block is whitened in Lambda~'s own scale: its diagonal block is I (the blocks' are near I)
    stats = block_statistics(p, maps, ReadSpec(normalize="length"), affine=True)
    k = stats.affine_map.shape[1]
    assert k == 7 and np.allclose(stats.gram[-k:, -k:] / stats.weight, np.eye(k), atol=1e-10)


def _canonical_lambda(X, off, maps, attention="bidirectional", normalize="length"):
    """Lambda~ of the blocks in numpy: each block's tokens whitened by G = sum_i S_i / sum_i n_i (inverse square
    root), orthonormal pair coordinates (sqrt 2 off the diagonal)."""
    per = ref_samples(X, off, per_position=attention is not None, attention=attention or "causal")
    cols = []
    for P in maps:
        Z = X @ P
        G = sum(Xs.T @ Xs for Xs, _, _ in ref_samples(Z, off, per_position=True, attention=attention)) / sum(
            Xs.shape[0] for Xs, _, _ in ref_samples(Z, off, per_position=True, attention=attention))
        w, V = np.linalg.eigh(G)
        A = (V / np.sqrt(w)) @ V.T
        d = P.shape[1]
        rows = []
        for Xs, _, _ in ref_samples(Z @ A, off, per_position=True, attention=attention):
            S = Xs.T @ Xs / (Xs.shape[0] if normalize == "length" else 1)
            rows.append([S[j, k] * (1 if j == k else np.sqrt(2)) * Xs[-1, m]
                         for j in range(d) for k in range(j, d) for m in range(d)])
        cols.append(np.array(rows))
    F = np.hstack(cols)
    assert F.shape[0] == len(per)
    return F.T @ F / F.shape[0]


def test_certificate_spectrum_equals_numpy(tmp_path):
    rng = np.random.default_rng(5)
    X, off = _data(rng, n_seq=150)
    maps = [rng.normal(size=(6, 2)), rng.normal(size=(6, 2))]
    p = _write(tmp_path, "t.h5", X, off, rng.normal(size=(len(X), 2)))
    cert = certify_blocks(block_statistics(p, maps, ReadSpec(normalize="length")))
    ev = np.linalg.eigvalsh(_canonical_lambda(X, off, maps))
    assert cert.identifiable and cert.proof == "cholesky of Lambda~ - t I"
    assert cert.lambda_max == pytest.approx(ev[-1], rel=1e-8)
    assert cert.lambda_min == pytest.approx(ev[0], rel=1e-6)
    assert cert.n_features == 2 * 6
    # the margin as a CI gate: just below lambda_min certifies, just above does not
    assert certify_blocks(block_statistics(p, maps, ReadSpec(normalize="length")), min_eig=0.99 * ev[0]).identifiable
    assert not certify_blocks(block_statistics(p, maps, ReadSpec(normalize="length")), min_eig=1.01 * ev[0]).identifiable


def test_one_block_is_the_mhla_certificate(tmp_path):
    """One block on the identity map is the plain MHLA of the file: the same spectrum as certify_features."""
    rng = np.random.default_rng(6)
    X, off = _data(rng, n_seq=150, D=3)
    p = _write(tmp_path, "t.h5", X, off, rng.normal(size=(len(X), 3)))
    one = certify_blocks(block_statistics(p, [np.eye(3)], ReadSpec(normalize="length")))
    ref = mhla_cli.certify(mhla_cli.featurize(p, read=ReadSpec(normalize="length")))
    assert one.identifiable == ref.identifiable
    assert one.lambda_max == pytest.approx(ref.lambda_max, rel=1e-7)
    assert one.lambda_min == pytest.approx(ref.lambda_min, rel=1e-6)


def test_overlapping_blocks_never_certify_and_the_sum_is_still_least_squares(tmp_path):
    rng = np.random.default_rng(7)
    X, off = _data(rng)
    P1 = rng.normal(size=(6, 2))
    P2 = np.column_stack([P1[:, 0], rng.normal(size=6)])  # a shared direction
    maps = [P1, P2]
    Y = _teacher(X, off, maps, 2, rng) + 0.1 * rng.normal(size=(len(X), 2))
    p = _write(tmp_path, "t.h5", X, off, Y)
    stats = block_statistics(p, maps, ReadSpec(normalize="length"))
    cert = certify_blocks(stats)
    assert not cert.identifiable
    assert any("overlap" in r for r in cert.reasons)
    fn = fit_blocks(stats)
    assert not fn.info["identifiable"]
    F, w, row = _design(X, off, maps)
    assert _rel(fn.predict(X, off)[row], F @ _lstsq_fit(F, w, Y[row])) < 1e-7


def test_length_one_sequences_never_certify(tmp_path):
    rng = np.random.default_rng(8)
    X = rng.normal(size=(400, 4))
    off = np.arange(401)
    p = _write(tmp_path, "t.h5", X, off, rng.normal(size=(400, 2)), attention=None)
    for maps in ([np.eye(4)[:, :2], np.eye(4)[:, 2:]], [rng.normal(size=(4, 3))]):
        cert = certify_blocks(block_statistics(p, maps, ReadSpec(normalize="none")))
        assert not cert.identifiable


def test_overlap_cut():
    """OVERLAP_TOL: the smallest singular value of the maps' orthonormal bases side by side; a shared direction
    tilted by eps has overlap ~ eps / sqrt(2): just below the cut it is reported, just above it is not."""
    rng = np.random.default_rng(9)
    u, v = np.linalg.qr(rng.normal(size=(5, 2)))[0].T
    for eps, shared in ((0.5 * OVERLAP_TOL, True), (4 * OVERLAP_TOL, False)):
        maps = [u[:, None], (u + eps * v)[:, None]]
        Q = np.column_stack([u, (u + eps * v) / np.linalg.norm(u + eps * v)])
        assert overlap(maps) == pytest.approx(np.linalg.svd(Q, compute_uv=False)[-1], rel=1e-6)
        assert (overlap(maps) < OVERLAP_TOL) == shared
    # what the cut is for: a direction shared to rounding is an overlap, one tilted by 1e-3 is not
    for eps, shared in ((1e-9, True), (1e-3, False)):
        assert (overlap([u[:, None], (u + eps * v)[:, None]]) < OVERLAP_TOL) == shared
    assert overlap([np.eye(4)[:, :2], np.eye(4)[:, 2:]]) == pytest.approx(1.0)
    assert overlap([np.eye(3)[:, :2], np.eye(3)[:, 1:]]) == 0.0  # more columns than dimensions


def test_map_condition_cut(tmp_path):
    rng = np.random.default_rng(10)
    X, off = _data(rng, n_seq=20, D=3)
    p = _write(tmp_path, "t.h5", X, off, rng.normal(size=(len(X), 1)))
    u = np.array([1.0, 0.0, 0.0])
    v = np.array([0.0, 1.0, 0.0])
    # two unit columns at angle a: condition ~ 2 / a
    # just outside and inside the cut, and what it is for: a condition of 1e6 is a block, 1e10 the same column twice
    for a, ok in ((2 / MAP_COND_MAX * 0.5, False), (2 / MAP_COND_MAX * 2.0, True), (2e-6, True), (2e-10, False)):
        P = np.column_stack([u, np.cos(a) * u + np.sin(a) * v])
        if ok:
            block_statistics(p, [P])
        else:
            with pytest.raises(InputError, match="dependent columns"):
                block_statistics(p, [P])


@pytest.mark.parametrize("bad, match", [
    (np.ones((5, 2)), "shape"), (np.full((3, 1), np.nan), "NaN"), (np.zeros((3, 1)), "dependent"),
    (np.ones(3), "shape")])
def test_bad_maps_are_refused(tmp_path, bad, match):
    rng = np.random.default_rng(11)
    X, off = _data(rng, n_seq=10, D=3)
    p = _write(tmp_path, "t.h5", X, off, rng.normal(size=(len(X), 1)))
    with pytest.raises(InputError, match=match):
        block_statistics(p, [bad])


def test_refusals(tmp_path, monkeypatch):
    rng = np.random.default_rng(12)
    X, off = _data(rng, n_seq=10, D=3)
    p = _write(tmp_path, "t.h5", X, off, rng.normal(size=(len(X), 1)))
    q = tmp_path / "nt.h5"
    mhla_cli.write_tokens(q, X, offsets=off)
    with pytest.raises(InputError, match="no 'targets'"):
        block_statistics(q, [np.eye(3)])
    with pytest.raises(InputError, match="bias terms"):
        block_statistics(p, [np.eye(3)], ReadSpec(bias_terms=True))
    with pytest.raises(InputError, match="at least one"):
        block_statistics(p, [])
    with pytest.raises(InputError, match="folds"):
        block_statistics(p, [np.eye(3)], folds=1)
    with pytest.raises(InputError, match="ridge"):
        fit_blocks(block_statistics(p, [np.eye(3)]), ridge=-1.0)
    with pytest.raises(InputError, match="folds"):
        fit_blocks(block_statistics(p, [np.eye(3)]), ridge="auto")
    monkeypatch.setattr(blocks, "available_memory", lambda: 1000)
    with pytest.raises(InputError, match="GiB"):
        block_statistics(p, [np.eye(3)])
    assert memory.available_memory() > 1000


def test_ridge_auto_is_numpys_cv_and_its_ridge(tmp_path):
    """ridge="auto": the held-out MSE of each fold along the grid equals numpy's ridge on the canonical features of
    the rest (the penalty in Lambda~'s units), and the fit with the chosen penalty is numpy's."""
    rng = np.random.default_rng(13)
    X, off = _data(rng, n_seq=90)
    maps = [rng.normal(size=(6, 2)), rng.normal(size=(6, 2))]
    Y = _teacher(X, off, maps, 2, rng) + 2.0 * rng.normal(size=(len(X), 2))
    p = _write(tmp_path, "t.h5", X, off, Y)
    stats = block_statistics(p, maps, ReadSpec(normalize="length"), folds=3)
    fn = fit_blocks(stats, "auto")
    cv = fn.info["cv"]
    # numpy: the whole file's canonical coordinates, contiguous folds of sequences
    G = _canonical_lambda(X, off, maps) * len(X)
    Ft = _canonical_features(X, off, maps)
    assert np.allclose(Ft.T @ Ft, G, rtol=1e-9, atol=1e-9 * np.abs(G).max())
    edges = np.linspace(0, off.size - 1, 4).round().astype(int)
    for entry in cv["table"][::6]:
        r, errs = entry["ridge"], []
        for a, b in zip(edges[:-1], edges[1:]):
            val = np.zeros(len(X), bool)
            val[off[a]:off[b]] = True
            Ftr, Ytr = Ft[~val], Y[~val]
            n = Ftr.shape[0]
            sol = np.linalg.lstsq(Ftr.T @ Ftr / n + r * np.eye(Ft.shape[1]), Ftr.T @ Ytr / n, rcond=1e-13)[0]
            errs.append(np.mean((Ft[val] @ sol - Y[val]) ** 2))
        assert entry["cv_mse"] == pytest.approx(np.mean(errs), rel=1e-6)
    r = fn.info["ridge"]
    n = len(X)
    sol = np.linalg.solve(Ft.T @ Ft / n + r * np.eye(Ft.shape[1]), Ft.T @ Y / n)
    assert _rel(fn.predict(X, off), Ft @ sol) < 1e-7


def _canonical_features(X, off, maps, normalize="length"):
    cols = []
    for P in maps:
        Z = X @ P
        spl = ref_samples(Z, off, per_position=True, attention="bidirectional")
        G = sum(Xs.T @ Xs for Xs, _, _ in spl) / sum(Xs.shape[0] for Xs, _, _ in spl)
        w, V = np.linalg.eigh(G)
        A = (V / np.sqrt(w)) @ V.T
        d = P.shape[1]
        rows = []
        for Xs, _, _ in ref_samples(Z @ A, off, per_position=True, attention="bidirectional"):
            S = Xs.T @ Xs / (Xs.shape[0] if normalize == "length" else 1)
            rows.append([S[j, k] * (1 if j == k else np.sqrt(2)) * Xs[-1, m]
                         for j in range(d) for k in range(j, d) for m in range(d)])
        cols.append(np.array(rows))
    return np.hstack(cols)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), chunk=st.integers(1, 40))
def test_what_cannot_change_the_answer(tmp_path_factory, seed, chunk):
    """An invertible map of each block's coordinates (P_b -> P_b R_b) and of the wide tokens (X -> X M with the maps
    M^-1 P_b), the chunk size, the order of the sequences and the data twice over change neither the fitted
    function nor the certificate's spectrum."""
    tmp = tmp_path_factory.mktemp("inv")
    rng = np.random.default_rng(seed)
    X, off = _data(rng, n_seq=60, D=5)
    maps = [rng.normal(size=(5, 2)), rng.normal(size=(5, 2))]
    Y = _teacher(X, off, maps, 2, rng) + 0.3 * rng.normal(size=(len(X), 2))
    read = ReadSpec(normalize="length")
    base = block_statistics(_write(tmp, "a.h5", X, off, Y), maps, read)
    f0, c0 = fit_blocks(base), certify_blocks(base)
    X2, off2 = _data(rng, n_seq=10, D=5)
    ref = f0.predict(X2, off2)
    M = rng.normal(size=(5, 5)) + 3 * np.eye(5)
    R = [rng.normal(size=(2, 2)) + 2 * np.eye(2) for _ in maps]
    order = rng.permutation(off.size - 1)
    Xp = np.concatenate([X[off[i]:off[i + 1]] for i in order])
    Yp = np.concatenate([Y[off[i]:off[i + 1]] for i in order])
    offp = np.concatenate([[0], np.cumsum(np.diff(off)[order])])
    cases = [
        (block_statistics(_write(tmp, "b.h5", X, off, Y), [P @ r for P, r in zip(maps, R)], read), None),
        (block_statistics(_write(tmp, "c.h5", X @ M, off, Y), [np.linalg.solve(M, P) for P in maps], read), M),
        (block_statistics(_write(tmp, "d.h5", X, off, Y), maps, read, chunk_size=chunk), None),
        (block_statistics(_write(tmp, "e.h5", Xp, offp, Yp), maps, read), None),
        (block_statistics(_write(tmp, "f.h5", np.vstack([X, X]), np.concatenate([off, off[1:] + off[-1]]),
                                 np.vstack([Y, Y])), maps, read), None),
    ]
    for stats, Mx in cases:
        fn = fit_blocks(stats)
        assert _rel(fn.predict(X2 if Mx is None else X2 @ Mx, off2), ref) < 1e-7
        cert = certify_blocks(stats)
        assert cert.identifiable == c0.identifiable
        assert cert.lambda_max == pytest.approx(c0.lambda_max, rel=1e-7)
        assert cert.lambda_min == pytest.approx(c0.lambda_min, rel=1e-5)


def test_progress_and_seconds(tmp_path):
    rng = np.random.default_rng(14)
    X, off = _data(rng, n_seq=25, D=3)
    p = _write(tmp_path, "t.h5", X, off, rng.normal(size=(len(X), 1)))
    seen = []
    stats = block_statistics(p, [np.eye(3)[:, :2], np.eye(3)[:, 2:]], chunk_size=7, progress=seen.append)
    assert sum(seen) == 2 * 25  # both passes
    assert stats.n_tokens == len(X) and stats.n_samples == len(X)
    assert set(stats.seconds) == {"moments", "sums"}
    fn = fit_blocks(stats)
    assert fn.info["n_tokens"] == len(X) and fn.info["block_features"] == [6, 1]
