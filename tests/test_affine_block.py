"""The certificate, the fit, the predictions and the heads of the MHLA's features extended by the token-wise affine
block of the wide tokens (`--affine-from`, mhla_cli.solve.affine_block) against plain numpy on MATERIALISED features:
[H, f] of every sample (the MHLA's features of the reduced tokens, f = (x_wide, 1) at its query), least squares by
numpy's lstsq, the canonical spectrum from the reference's own whitenings; structural cases (a target made of an MHLA
and an affine map of the wide token is fitted exactly; wide tokens with a linear constraint never certify; the bias
terms with --normalize length hold the reduced coordinates already); metamorphic tests (hypothesis: invertible
affine maps of the wide tokens and invertible maps of the reduced ones change no certificate and no function)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import _reference as ref
from _metamorphic import FILE_SETTINGS, transform
from conftest import relerr, write_windows as write
from mhla_cli.api.learn import certify as learn_certify, export_heads, fit as learn_fit
from mhla_cli.cli import run
from mhla_cli.errors import InputError
from mhla_cli.io.tokens import inspect_tokens
from mhla_cli.model import synthetic
from mhla_cli.model.export import load_heads, save_heads
from mhla_cli.model.forward import predict_file, predict_samples
from mhla_cli.model.model import Model
from mhla_cli.model.reduce import load_reduction, reduce_tokens, unreduce_heads
from mhla_cli.samples import LAST, ReadSpec, samples_of
from mhla_cli.solve import affine_block
from mhla_cli.solve.certificate import certify_features as mhla_certify
from mhla_cli.solve.lstsq import fit as lstsq_fit
from mhla_cli.statistics.affine_sums import WideSource
from mhla_cli.statistics.folds import load_for_cv
from mhla_cli.statistics.ranges import estimate_basis, accumulate_range
from mhla_cli.statistics.stream import featurize, tokens_info

LAYOUTS = ("last", "causal", "bidirectional")


def windows(rng: np.random.Generator, n_seq: int, lo: int = 1, hi: int = 7) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(rng.integers(lo, hi + 1, size=n_seq))]).astype(np.int64)


def wide_tokens(rng: np.random.Generator, T: int, D: int) -> np.ndarray:
    return rng.standard_normal((T, D)) @ rng.standard_normal((D, D)) / np.sqrt(D) + 0.3


def setup(tmp: Path, layout: str, seed: int, D: int = 5, d: int = 2, n_seq: int = 60, weighted: bool = False,
          Y: np.ndarray | None = None, X: np.ndarray | None = None, off: np.ndarray | None = None) -> dict:
    """A wide tokens file (random wide targets unless Y) and its reduction (mhla reduce)."""
    rng = np.random.default_rng(seed)
    off = windows(rng, n_seq) if off is None else off
    T = int(off[-1])
    X = wide_tokens(rng, T, D) if X is None else X
    rows = T if layout != "last" else off.size - 1
    Y = rng.standard_normal((rows, D)) if Y is None else Y
    w = None
    if weighted:
        w = rng.uniform(0.3, 2.0, rows)
        w[rng.random(rows) < 0.2] = 0.0
    wide = write(tmp / f"w{seed}.h5", layout, X, off, Y, w)
    red = tmp / f"r{seed}.h5"
    reduce_tokens(wide, red, dim=d)
    with h5py.File(red) as f:
        Xr, Yr = f["tokens"][...], f["targets"][...]
    return {"wide": wide, "red": red, "X": X, "off": off, "w": w, "Xr": Xr, "Yr": Yr, "red_map": load_reduction(red)}


def samples(s: dict, layout: str, X: np.ndarray | None = None, Xr: np.ndarray | None = None,
            off: np.ndarray | None = None, w: np.ndarray | None = None):
    """(reduced sample window, the query's wide token, weight, target row) of every sample."""
    X = s["X"] if X is None else X
    Xr = s["Xr"] if Xr is None else Xr
    off = s["off"] if off is None else off
    pp = layout != "last"
    for Xs, wt, r in ref.samples(Xr, off, pp, w, attention=layout if pp else "causal"):
        yield Xs, X[r if pp else int(off[r + 1]) - 1], wt, r


def design(s: dict, layout: str, normalize: str, **kw) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The materialised own features [H(reduced sample), x_wide, 1] of the samples of weight > 0."""
    rows, ws, rs = [], [], []
    for Xs, xw, wt, r in samples(s, layout, **kw):
        if wt > 0:
            rows.append(np.concatenate([ref.features(Xs, normalize), xw, [1.0]]))
            ws.append(wt)
            rs.append(r)
    return np.array(rows), np.array(ws), rs


def ref_spectrum(s: dict, layout: str, normalize: str) -> np.ndarray:
    """The canonical spectrum of the extended features: the reference's whitening of the reduced tokens (sum w S
    over sum w n), orthonormal features, and f whitened by its own weighted second moment."""
    pp = layout != "last"
    smp = list(samples(s, layout, w=s["w"]))
    G = sum(wt * Xs.T @ Xs for Xs, _, wt, _ in smp) / sum(wt * Xs.shape[0] for Xs, _, wt, _ in smp)
    A = ref.inv_sqrt(G)
    keep = [(Xs, xw, wt) for Xs, xw, wt, _ in smp if wt > 0]
    Ht = np.array([ref.canonical_features(Xs @ A, normalize) for Xs, _, _ in keep])
    F = np.array([np.append(xw, 1.0) for _, xw, _ in keep])
    wv = np.array([wt for _, _, wt in keep])
    Af = ref.inv_sqrt((F * wv[:, None]).T @ F / wv.sum())
    Z = np.hstack([Ht, F @ Af])
    del pp
    return np.linalg.eigvalsh((Z * wv[:, None]).T @ Z / wv.sum())


def held_out(s: dict, layout: str, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Held-out wide windows and their reduction by the maps of the training file: (wide, reduced, offsets)."""
    rng = np.random.default_rng(seed)
    off = windows(rng, 10, 1, 9)
    X = wide_tokens(rng, int(off[-1]), s["X"].shape[1])
    return X, X @ s["red_map"].P, off


# --------------------------------------------------------------------------------------------
# certificate, fit and predict against the materialised features
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("normalize", ["none", "length"])
@pytest.mark.parametrize("weighted", [False, True])
def test_certificate_fit_and_predictions_match_numpy(tmp_path: Path, layout: str, normalize: str,
                                                     weighted: bool) -> None:
    s = setup(tmp_path, layout, 3 + weighted, weighted=weighted)
    f = featurize(s["red"], normalize=normalize, affine_from=s["wide"])
    cert = learn_certify(f)
    ev = ref_spectrum(s, layout, normalize)
    assert cert.n_features == ev.size == 6 + 6  # psi = 6 at d = 2, and (x_wide, 1)
    assert abs(cert.lambda_max - ev[-1]) <= 1e-9 * ev[-1] and abs(cert.lambda_min - ev[0]) <= 1e-9 * ev[-1]
    assert cert.identifiable and cert.proof == "cholesky of Lambda~ - t I"
    model = learn_fit(f)
    H, wv, rs = design(s, layout, normalize, w=s["w"])
    sw = np.sqrt(wv)[:, None]
    coef = np.linalg.lstsq(H * sw, s["Yr"][rs] * sw, rcond=None)[0].T
    psi = f.n_features
    assert relerr(model.coef, coef[:, :psi]) < 1e-7 and relerr(model.affine_coef, coef[:, psi:]) < 1e-7
    resid = H @ coef.T - s["Yr"][rs]
    mse = float(wv @ (resid ** 2).sum(axis=1)) / (wv.sum() * 2)
    assert abs(model.info["train_mse"] - mse) <= 1e-8 * mse
    # held-out windows (the training maps): mhla's predictions are the least-squares function's
    Xh, Xrh, offh = held_out(s, layout, 11)
    want = np.array([coef @ np.concatenate([ref.features(Xs, normalize), xw, [1.0]])
                     for Xs, xw, _, _ in samples(s, layout, X=Xh, Xr=Xrh, off=offh)])
    got = predict_samples(model, Xrh, offh, samples_of(layout != "last", None if layout == "last" else layout),
                          wide=Xh)
    assert relerr(got, want) < 1e-7
    with pytest.raises(InputError, match="wide tokens"):
        predict_samples(model, Xrh, offh, LAST)
    # the MHLA-only solvers refuse statistics that hold the block (they would leave it out)
    with pytest.raises(InputError, match="affine block"):
        mhla_certify(f)
    with pytest.raises(InputError, match="affine block"):
        lstsq_fit(f)


def test_ridge_is_in_the_units_of_lambda_max(tmp_path: Path) -> None:
    """fit --ridge L solves (Lambda~ + L I) p = m~ on the extended canonical features: the reference's."""
    s = setup(tmp_path, "bidirectional", 5)
    f = featurize(s["red"], affine_from=s["wide"])
    ext = affine_block.extended(f)
    M = np.asarray(ext.fac.lam) * ext.fac.scale
    rhs = affine_block._rhs(f, ext)
    lam = 0.3
    sol = np.linalg.solve(M + lam * np.eye(M.shape[0]), rhs)
    model = learn_fit(f, ridge=lam)
    assert relerr(model.affine_coef, (f.affine.f_basis @ ext.B @ sol[ext.n:]).T) < 1e-10


def test_predict_files_heads_unreduce_and_torch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    layout = "bidirectional"
    s = setup(tmp_path, layout, 6)
    model = learn_fit(featurize(s["red"], affine_from=s["wide"]))
    model.save(tmp_path / "m.h5")
    back = Model.load(tmp_path / "m.h5")
    np.testing.assert_array_equal(back.affine_coef, model.affine_coef)
    # held-out data reduced with the training maps (mhla reduce --like): predict reads its wide tokens in lockstep
    Xh, _, offh = held_out(s, layout, 2)
    hw = write(tmp_path / "hw.h5", layout, Xh, offh, np.zeros((Xh.shape[0], 5)))
    hr = tmp_path / "hr.h5"
    reduce_tokens(hw, hr, like=s["red"])
    with h5py.File(hr) as fh:
        Xrh = fh["tokens"][...]
    want = predict_samples(model, Xrh, offh, samples_of(True, layout), wide=Xh)
    res = predict_file(back, hr, affine_from=hw, chunk_size=3)
    assert relerr(res.outputs, want) < 1e-12
    assert run(["predict", str(tmp_path / "m.h5"), str(hr), "-o", str(tmp_path / "p.h5")]) == 2
    assert "--affine-from" in capsys.readouterr().err
    assert run(["predict", str(tmp_path / "m.h5"), str(hr), "-o", str(tmp_path / "p.h5"), "--affine-from",
                str(s["wide"])]) == 2  # hr was reduced from hw, not from the training file
    assert "was reduced from" in capsys.readouterr().err
    # the heads with the affine map reproduce the model, from files too, and through torch
    heads = export_heads(model)
    assert heads.affine_weight.shape == (2, 5) and heads.affine_bias.shape == (2,)
    for name in ("h.h5", "h.npz"):
        save_heads(heads, tmp_path / name)
        h = load_heads(tmp_path / name)
        assert relerr(predict_samples(h, Xrh, offh, samples_of(True, layout), wide=Xh), want) < 1e-10
    # heads put back into the wide coordinates (--unreduce) on the reduced file: refused, the wide file named,
    # with or without --affine-from
    save_heads(unreduce_heads(heads, s["red_map"]), tmp_path / "hu.h5")
    for extra in ([], ["--affine-from", str(hw)]):
        assert run(["predict", str(tmp_path / "hu.h5"), str(hr), "-o", str(tmp_path / "p.h5"), *extra]) == 2
        err = capsys.readouterr().err
        assert "put back into the" in err and f"({hw.name}, the file mhla reduce read" in err, err
        assert "but the model has d" not in err
    torch = pytest.importorskip("torch")
    module = heads.to_torch()
    a, b = offh[0], offh[1]
    out = module(torch.tensor(Xrh[a:b]), all_positions=True, wide=torch.tensor(Xh[a:b])).detach().numpy()
    assert np.abs(out - want[a:b]).max() <= 1e-10 * np.abs(want).max()
    # --unreduce: the heads and the affine map act on the wide token itself; outputs U times the reduced ones
    wide_heads = unreduce_heads(heads, s["red_map"])
    got = predict_samples(wide_heads, Xh, offh, samples_of(True, layout), wide=Xh)
    assert relerr(got, want @ s["red_map"].U.T) < 1e-10
    out = wide_heads.to_torch()(torch.tensor(Xh[a:b]), all_positions=True).detach().numpy()
    assert np.abs(out - want[a:b] @ s["red_map"].U.T).max() <= 1e-10 * np.abs(want).max()
    # a file of the unreduced heads predicts the wide file with no --affine-from: its tokens are the wide ones
    save_heads(wide_heads, tmp_path / "hu.h5")
    res = predict_file(load_heads(tmp_path / "hu.h5"), hw)
    assert relerr(res.outputs, want @ s["red_map"].U.T) < 1e-10


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_mhla_plus_an_affine_map_of_the_wide_token_is_fitted_exactly(tmp_path: Path, layout: str) -> None:
    """The structural case: targets = an MHLA teacher of the reduced tokens + B x_wide + c are realisable by the
    extended features (R^2 = 1, the affine map recovered) and not by the MHLA alone."""
    rng = np.random.default_rng(4)
    D, d = 6, 2
    off = windows(rng, 80, 2, 7)
    X = wide_tokens(rng, int(off[-1]), D)
    (tmp_path / "a").mkdir()
    first = setup(tmp_path / "a", layout, 1, D=D, d=d, X=X, off=off)
    P = first["red_map"].P
    Xr = X @ P
    teacher = synthetic.random_teacher(d, 2, rng)
    pp = layout != "last"
    y_mhla = predict_samples(teacher, Xr, off, samples_of(pp, layout if pp else None))
    B, c = rng.standard_normal((d, D)), rng.standard_normal(d)
    q = np.arange(X.shape[0]) if pp else off[1:] - 1
    aff = X[q] @ B.T + c
    Y = y_mhla / np.sqrt(np.mean(y_mhla ** 2)) + aff / np.sqrt(np.mean(aff ** 2))  # both parts matter
    B, c = B / np.sqrt(np.mean(aff ** 2)), c / np.sqrt(np.mean(aff ** 2))
    # the reduced file with these targets: the wide file's targets are Y in the reduced coordinates (U = I there)
    wide = write(tmp_path / "wt.h5", layout, X, off, np.hstack([Y, np.zeros((Y.shape[0], D - d))]))
    red = tmp_path / "rt.h5"
    reduce_tokens(wide, red, dim=d)
    with h5py.File(red) as fh:
        U = fh["reduce_U"][...]
    f = featurize(red, affine_from=wide)
    model = learn_fit(f)
    assert model.info["identifiable"] and model.info["train_r2"] > 1 - 1e-10
    # the affine map in the wide coordinates: U^T (B x + c) (the targets were reduced by U)
    np.testing.assert_allclose(model.affine_coef, np.hstack([U[:d].T @ B, (U[:d].T @ c)[:, None]]), atol=1e-7)
    assert learn_fit(featurize(red)).info["train_r2"] < 0.9


def layer_normed(rng: np.random.Generator, T: int, D: int) -> tuple[np.ndarray, np.ndarray, float]:
    """LayerNorm of random vectors with a gain g and a shift b: (x - b) / g is centred and of norm 1, so every token
    lies on the hyperplane a^T x = c, a = (1 / g) / |1 / g|, c = a^T b. Returns (X, a, c)."""
    Z = rng.standard_normal((T, D)) @ rng.standard_normal((D, D))
    Z -= Z.mean(axis=1, keepdims=True)
    Z /= np.linalg.norm(Z, axis=1, keepdims=True)
    g, b = rng.uniform(0.5, 2.0, D), rng.standard_normal(D)
    a = (1.0 / g) / np.linalg.norm(1.0 / g)
    return Z * g + b, a, float(a @ b)


def hull_spectrum(s: dict, layout: str) -> np.ndarray:
    """The reference spectrum on the wide tokens' affine hull: ref_spectrum's canonical MHLA features beside f
    whitened on the range of its weighted second moment (numpy's eigh, the null direction dropped)."""
    smp = [(Xs, xw, wt) for Xs, xw, wt, _ in samples(s, layout, w=s["w"])]
    G = sum(wt * Xs.T @ Xs for Xs, _, wt in smp) / sum(wt * Xs.shape[0] for Xs, _, wt in smp)
    A = ref.inv_sqrt(G)
    Ht = np.array([ref.canonical_features(Xs @ A) for Xs, _, wt in smp if wt > 0])
    F = np.array([np.append(xw, 1.0) for _, xw, wt in smp if wt > 0])
    wv = np.array([wt for _, _, wt in smp if wt > 0])
    ev, V = np.linalg.eigh((F * wv[:, None]).T @ F / wv.sum())
    keep = ev > 1e-9 * ev[-1]
    Z = np.hstack([Ht, F @ (V[:, keep] / np.sqrt(ev[keep]))])
    return np.linalg.eigvalsh((Z * wv[:, None]).T @ Z / wv.sum())


@pytest.mark.parametrize("layout", ["last", "bidirectional"])
def test_layer_normed_wide_tokens_certify_on_their_affine_hull(tmp_path: Path, layout: str) -> None:
    """A layer norm's output lies on a^T x = c: (x_wide, 1) is collinear and the affine map is determined only up to
    a multiple of a^T x - c. The certificate names that hyperplane, proves the rest (the numpy spectrum of the
    features with f whitened on its range), and the fit's condition number is that spectrum's."""
    rng = np.random.default_rng(5)
    off = windows(rng, 70)
    X, a, c = layer_normed(rng, int(off[-1]), 5)
    s = setup(tmp_path, layout, 9, X=X, off=off)
    f = featurize(s["red"], affine_from=s["wide"])
    cert = learn_certify(f)
    want = hull_spectrum(s, layout)
    assert cert.identifiable and cert.n_features == want.size == 6 + 5, cert
    (plane,) = cert.hyperplanes
    assert abs(float(np.dot(plane["normal"], a))) >= 1 - 1e-10 and abs(plane["offset"] - c) < 1e-9
    assert "hyperplane a^T x" in cert.notes[0] and cert.to_dict()["hyperplanes"] == cert.hyperplanes
    assert relerr(cert.lambda_min, want[0]) < 1e-8 and relerr(cert.lambda_max, want[-1]) < 1e-8
    model = learn_fit(f)
    assert model.info["identifiable"] and np.isfinite(model.info["condition_number"])
    assert relerr(model.info["condition_number"], want[-1] / want[0]) < 1e-8
    assert model.info["affine_hyperplanes"] == cert.hyperplanes
    # the fitted function on held-out tokens of the hull is numpy's least squares on [H(X), x_wide, 1]
    H, _, rs = design(s, layout, "none")
    coef = np.linalg.lstsq(H, s["Yr"][rs], rcond=None)[0].T
    offh = windows(np.random.default_rng(7), 10, 1, 9)
    Xh = 0.5 * (X[: int(offh[-1])] + X[1: int(offh[-1]) + 1])  # affine combinations stay on the hull
    Xrh = Xh @ s["red_map"].P
    pp = layout != "last"
    want_p = np.array([coef @ np.concatenate([ref.features(Xs), xw, [1.0]])
                       for Xs, xw, _, _ in samples(s, layout, X=Xh, Xr=Xrh, off=offh)])
    got = predict_samples(model, Xrh, offh, samples_of(pp, layout if pp else "causal"), wide=Xh)
    assert relerr(got, want_p) < 1e-7


def test_layer_normed_wide_tokens_with_bias_terms_and_length_normalisation(tmp_path: Path) -> None:
    """The bias terms hold x_t = P^T x_wide and 1 already: the block keeps the rest of the hull's functions (D - d - 1
    features: the constant is a^T x / c there) and certifies; its function is numpy least squares on
    [expanded bias features, x_wide, 1] on held-out tokens of the hull."""
    rng = np.random.default_rng(6)
    off = windows(rng, 70)
    X, a, _ = layer_normed(rng, int(off[-1]), 6)
    s = setup(tmp_path, "bidirectional", 8, D=6, d=2, X=X, off=off)
    f = featurize(s["red"], normalize="length", bias_terms=True, affine_from=s["wide"])
    cert = learn_certify(f)
    assert cert.identifiable and cert.n_features == 18 + 3, cert  # psi of (x, 1) at d = 2, D - d - 1
    assert abs(float(np.dot(cert.hyperplanes[0]["normal"], a))) >= 1 - 1e-10
    model = learn_fit(f)
    rows, rs = [], []
    for Xs, xw, _, r in samples(s, "bidirectional"):
        rows.append(np.concatenate([ref.expanded_features(Xs, "length")[0], xw, [1.0]]))
        rs.append(r)
    coef = np.linalg.lstsq(np.array(rows), s["Yr"][rs], rcond=None)[0].T
    offh = windows(np.random.default_rng(4), 10, 1, 9)
    Xh = 0.5 * (X[: int(offh[-1])] + X[2: int(offh[-1]) + 2])
    Xrh = Xh @ s["red_map"].P
    want = np.array([coef @ np.concatenate([ref.expanded_features(Xs, "length")[0], xw, [1.0]])
                     for Xs, xw, _, _ in samples(s, "bidirectional", X=Xh, Xr=Xrh, off=offh)])
    got = predict_samples(model, Xrh, offh, samples_of(True, "bidirectional"), wide=Xh)
    assert relerr(got, want) < 1e-7 and np.isfinite(model.info["condition_number"])
    # the block's features are uncorrelated on the data with the functions the bias terms hold (x_t and 1)
    W = f.weight
    B = affine_block.block_map(f, W)
    held = np.linalg.solve(f.affine.f_basis, affine_block.held_elsewhere(f))
    Gb = f.affine.gram / W
    corr = (B.T @ Gb @ held) / np.sqrt(np.diag(held.T @ Gb @ held))  # B's features have unit variance
    assert np.abs(corr).max() <= 1e-9, corr


def test_a_hyperplane_under_badly_scaled_coordinates_is_named(tmp_path: Path) -> None:
    """sum_j x_j = 2 mapped by X M + 3 i (a rotated direction 1e-4 of the others, a shift): the hyperplane is
    M^-1 1 . x = 2 + 3 i 1^T M^-1 1, found in the nearly whitened sums whatever the scales."""
    rng = np.random.default_rng(5)
    off = windows(rng, 60)
    X = wide_tokens(rng, int(off[-1]), 5)
    X[:, -1] = 2.0 - X[:, :-1].sum(axis=1)
    for i, M in enumerate((np.eye(5), transform(5, 1e4, 3))):
        (tmp_path / str(i)).mkdir()
        s = setup(tmp_path / str(i), "causal", 9, X=X @ M + 3.0 * i, off=off)
        cert = learn_certify(featurize(s["red"], affine_from=s["wide"]))
        v = np.linalg.solve(M, np.ones(5))
        (plane,) = cert.hyperplanes
        assert cert.identifiable and abs(float(np.dot(plane["normal"], v / np.linalg.norm(v)))) >= 1 - 1e-10


def test_a_hyperplane_with_a_collinearity_across_the_blocks_does_not_certify(tmp_path: Path, capsys) -> None:
    """Windows of one length n with the bias terms: n x_t = n P^T x_wide is held by both blocks; on layer-normed
    tokens the hyperplane is named and the rest is still not determined: exit 1. Without the bias terms: exit 0."""
    rng = np.random.default_rng(8)
    off = np.arange(0, 61 * 5, 5)
    X, a, _ = layer_normed(rng, int(off[-1]), 4)
    s = setup(tmp_path, "bidirectional", 3, D=4, X=X, off=off)
    cert = learn_certify(featurize(s["red"], bias_terms=True, affine_from=s["wide"]))
    assert not cert.identifiable and len(cert.hyperplanes) == 1
    assert abs(float(np.dot(cert.hyperplanes[0]["normal"], a))) >= 1 - 1e-10
    red, wide = str(s["red"]), str(s["wide"])
    assert run(["featurize", red, "-o", str(tmp_path / "b.h5"), "--affine-from", wide, "--bias-terms", "-q"]) == 0
    assert run(["certify", str(tmp_path / "b.h5")]) == 1
    assert "lie on the hyperplane" in "".join(capsys.readouterr())
    assert run(["featurize", red, "-o", str(tmp_path / "f.h5"), "--affine-from", wide, "-q"]) == 0
    assert run(["certify", str(tmp_path / "f.h5")]) == 0
    assert "the affine map is determined up to that direction" in "".join(capsys.readouterr())
    assert run(["fit", str(tmp_path / "f.h5"), "-o", str(tmp_path / "m.h5")]) == 0
    said = "".join(capsys.readouterr())
    assert "condition number = inf" not in said and "lie on 1 hyperplane(s)" in said


@pytest.mark.parametrize("side", [1 - 1e-3, 1 + 1e-3])
def test_hull_cut_is_affine_hull_tol(side: float) -> None:
    """A direction of f's moment at the cut affine_hull_tol(k, N) of the largest (just inside: a hyperplane) or just
    outside it (a direction of the data)."""
    from types import SimpleNamespace

    k, N = 6, 400
    w = np.linspace(1.0, 2.0, k)
    w[0] = side * 1.0 * k * 2.0 ** -52 * np.sqrt(N) * w[-1]  # AFFINE_HULL_FACTOR (1, docs/certificate.md)
    Q = np.linalg.qr(np.random.default_rng(1).standard_normal((k, k)))[0]
    feats = SimpleNamespace(affine=SimpleNamespace(gram=3.0 * (Q * w) @ Q.T, f_basis=np.eye(k)), n_samples=N)
    hull = affine_block.affine_hull(feats, 3.0)  # type: ignore[arg-type]
    if side < 1:
        assert hull[0] is not None and hull[0].shape == (k, k - 1) and len(hull[1]) == 1
        v = Q[:, 0] / np.linalg.norm(Q[:-1, 0])
        assert abs(float(np.dot(hull[1][0].normal, v[:-1]))) >= 1 - 1e-10
    else:
        assert hull[0] is None and hull[1] == []


def test_bias_terms_with_length_normalisation_hold_the_reduced_coordinates(tmp_path: Path) -> None:
    """With --bias-terms --normalize length the features n x_t / n and n / n are x_t = P^T x_wide and 1: the
    affine block keeps x_wide outside span(P) (D - d features) and certifies; its function is the reference's."""
    s = setup(tmp_path, "bidirectional", 8, D=5, d=2)
    f = featurize(s["red"], normalize="length", bias_terms=True, affine_from=s["wide"])
    cert = learn_certify(f)
    assert cert.identifiable and cert.n_features == 18 + 3  # psi of (x, 1) at d = 2, D - d
    # the same function as numpy least squares on [expanded bias features, x_wide, 1] (collinear: predictions)
    model = learn_fit(f)
    rows, rs = [], []
    for Xs, xw, wt, r in samples(s, "bidirectional"):
        rows.append(np.concatenate([ref.expanded_features(Xs, "length")[0], xw, [1.0]]))
        rs.append(r)
    H = np.array(rows)
    coef = np.linalg.lstsq(H, s["Yr"][rs], rcond=None)[0].T
    Xh, Xrh, offh = held_out(s, "bidirectional", 4)
    want = np.array([coef @ np.concatenate([ref.expanded_features(Xs, "length")[0], xw, [1.0]])
                     for Xs, xw, _, _ in samples(s, "bidirectional", X=Xh, Xr=Xrh, off=offh)])
    got = predict_samples(model, Xrh, offh, samples_of(True, "bidirectional"), wide=Xh)
    assert relerr(got, want) < 1e-7
    # without the complement the block would repeat them: never certified
    held = affine_block.held_elsewhere
    try:
        affine_block.held_elsewhere = lambda feats: None
        g = featurize(s["red"], normalize="length", bias_terms=True, affine_from=s["wide"])
        assert not learn_certify(g).identifiable
    finally:
        affine_block.held_elsewhere = held


def test_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = setup(tmp_path, "bidirectional", 2)
    red, wide = str(s["red"]), str(s["wide"])
    assert run(["featurize", red, "-o", str(tmp_path / "f.h5"), "--affine-from", wide, "--json", "-q"]) == 0
    assert json.loads(capsys.readouterr().out)["affine_width"] == 5
    assert run(["certify", str(tmp_path / "f.h5"), "--json", "-q"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["affine_width"] == 5 and out["n_features"] == 6 + 6
    assert run(["fit", red, "-o", str(tmp_path / "m.h5"), "--affine-from", wide, "--ridge", "1e-9", "-q"]) == 0
    assert run(["predict", str(tmp_path / "m.h5"), red, "-o", str(tmp_path / "p.h5"), "--affine-from", wide,
                "--json", "-q"]) == 0
    r2 = json.loads(capsys.readouterr().out)["r2"]
    assert run(["fit", str(tmp_path / "f.h5"), "-o", str(tmp_path / "m2.h5"), "--json", "-q"]) == 0
    assert abs(json.loads(capsys.readouterr().out)["train_r2"] - r2) < 1e-6
    assert run(["export-heads", str(tmp_path / "m.h5"), "-o", str(tmp_path / "h.npz"), "--unreduce", red, "-q"]) == 0
    assert run(["predict", str(tmp_path / "h.npz"), wide, "-o", str(tmp_path / "pw.h5"), "-q"]) == 0
    assert run(["compare", str(tmp_path / "m.h5"), str(tmp_path / "m2.h5"), "-q"]) == 0
    assert run(["rollout", str(tmp_path / "m.h5"), red, "-o", str(tmp_path / "r.h5"), "-k", "1"]) == 2
    assert run(["fit", red, "-o", str(tmp_path / "m3.h5"), "--affine-from", wide, "--heads", "2"]) == 2
    capsys.readouterr()


# --------------------------------------------------------------------------------------------
# metamorphic: maps of the tokens change nothing
# --------------------------------------------------------------------------------------------


def extended_features(red: Path, wide: Path, normalize: str, P: np.ndarray, bias_terms: bool = False):
    """The statistics of a reduced file with the affine block of `wide`, read in lockstep without the provenance
    check (a map of the wide tokens is another file: the reduced file was not made from it)."""
    info = tokens_info(red, ReadSpec(bias_terms=bias_terms))
    winfo = replace(inspect_tokens(wide), has_targets=False, has_weights=False, samples=LAST, d_out=None)
    A = estimate_basis(info, (0, info.n_samples))  # featurize's: accumulated in the whitening of the tokens
    src = WideSource(winfo, {}, P)
    src = replace(src, basis=src.estimate_basis(info.samples))
    f = accumulate_range(info, (0, info.n_samples), 7, normalize=normalize, basis=A, wide=src)
    f.affine.P, f.affine.basis = P, src.basis
    f.bias_terms = bias_terms
    return f


@given(layout=st.sampled_from(LAYOUTS), normalize=st.sampled_from(["none", "length"]), seed=st.integers(0, 10**6),
       cond=st.sampled_from([1.0, 1e3, 1e5]), shift=st.floats(-2, 2), bias=st.booleans())
@FILE_SETTINGS
def test_maps_of_the_wide_and_the_reduced_tokens_change_no_certificate_and_no_function(
        tmp_path_factory, layout: str, normalize: str, seed: int, cond: float, shift: float, bias: bool) -> None:
    tmp = tmp_path_factory.mktemp("maps")
    s = setup(tmp, layout, seed % 50, D=4, d=2, n_seq=40)
    P = s["red_map"].P
    rng = np.random.default_rng(seed)
    T = transform(4, cond, seed % 31)
    c = shift * rng.standard_normal(4)
    R = transform(2, cond, seed % 17)
    Y = s["Yr"]
    moved_wide = write(tmp / "mw.h5", layout, s["X"] @ T + c, s["off"], Y)
    moved_red = write(tmp / "mr.h5", layout, s["Xr"] @ R, s["off"], Y)
    a = extended_features(s["red"], s["wide"], normalize, P, bias)
    # the moved reduced tokens are x R = (x_wide' - c) T^-1 P R: the reduction's map of the moved data
    b = extended_features(moved_red, moved_wide, normalize, np.linalg.solve(T, P @ R), bias)
    ca, cb = learn_certify(a), learn_certify(b)
    assert ca.identifiable == cb.identifiable
    assert abs(ca.lambda_max - cb.lambda_max) <= 1e-7 * ca.lambda_max
    assert abs(ca.lambda_min - cb.lambda_min) <= 1e-6 * ca.lambda_max
    if ca.identifiable and ca.lambda_min > 1e-5 * ca.lambda_max:
        Xh, Xrh, offh = held_out(s, layout, seed % 7)
        smp = samples_of(layout != "last", None if layout == "last" else layout)
        pa = predict_samples(learn_fit(a), Xrh, offh, smp, wide=Xh)
        pb = predict_samples(learn_fit(b), Xrh @ R, offh, smp, wide=Xh @ T + c)
        assert relerr(pb, pa) < 1e-5


@pytest.mark.parametrize("layout", ["last", "bidirectional"])
@pytest.mark.parametrize("cond", [1.0, 1e3])
def test_an_affine_map_of_layer_normed_wide_tokens_moves_the_hyperplane_and_nothing_else(
        tmp_path: Path, layout: str, cond: float) -> None:
    """x_wide -> x_wide T + c maps the hull {a^T x = c0} to the hull with the normal T^-1 a (normalised): the certificate
    names that hyperplane, its eigenvalues and the fitted function on held-out tokens of the hull do not move."""
    rng = np.random.default_rng(11)
    off = windows(rng, 70)
    X, a, _ = layer_normed(rng, int(off[-1]), 5)
    s = setup(tmp_path, layout, 9, X=X, off=off)
    T, c = transform(5, cond, 3), rng.standard_normal(5)
    Y = s["Yr"]
    moved = write(tmp_path / "moved.h5", layout, X @ T + c, off, Y)
    P = s["red_map"].P
    fa = extended_features(s["red"], s["wide"], "none", P)
    fb = extended_features(s["red"], moved, "none", np.linalg.solve(T, P))  # x_r = x P = (x' - c) T^-1 P
    ca, cb = learn_certify(fa), learn_certify(fb)
    assert ca.identifiable and cb.identifiable and ca.n_features == cb.n_features
    assert relerr(cb.lambda_min, ca.lambda_min) < 1e-6 and relerr(cb.lambda_max, ca.lambda_max) < 1e-7
    (plane,) = cb.hyperplanes
    a_moved = np.linalg.solve(T, a)
    assert abs(float(np.dot(plane["normal"], a_moved / np.linalg.norm(a_moved)))) >= 1 - 1e-8
    offh = windows(np.random.default_rng(7), 10, 1, 9)
    Xh = 0.5 * (X[: int(offh[-1])] + X[1: int(offh[-1]) + 1])  # affine combinations stay on the hull
    Xrh = Xh @ P
    smp = samples_of(layout != "last", None if layout == "last" else layout)
    pa = predict_samples(learn_fit(fa), Xrh, offh, smp, wide=Xh)
    pb = predict_samples(learn_fit(fb), Xrh, offh, smp, wide=Xh @ T + c)
    assert relerr(pb, pa) < 1e-6


def test_a_collinearity_across_the_blocks_never_certifies_however_the_wide_tokens_are_scaled(tmp_path: Path) -> None:
    """Windows of one length n with the bias terms (no normalisation): n x_t = n P^T x_wide, a direction of the MHLA's
    block that the affine block holds too. Exact: never certified, also when the wide coordinates have wildly
    different scales (the sums are accumulated in a whitening estimate; whitening the raw sums afterwards lifted
    this null direction above the threshold)."""
    rng = np.random.default_rng(8)
    off = np.arange(0, 61 * 5, 5)
    X0 = wide_tokens(rng, int(off[-1]), 4)
    for i, cond in enumerate((1.0, 1e4)):
        (tmp_path / str(i)).mkdir()
        s = setup(tmp_path / str(i), "bidirectional", 3, D=4, X=X0 @ transform(4, cond, 5) + 2.0, off=off)
        f = featurize(s["red"], bias_terms=True, affine_from=s["wide"])
        cert = learn_certify(f)
        # the exact null at rounding level, of either sign (a raw whitening put it at ~1e-12 of either sign here)
        assert not cert.identifiable and abs(cert.lambda_min) <= cert.threshold, (cond, cert)
        assert learn_certify(featurize(s["red"], bias_terms=True)).identifiable  # the bias terms alone certify


def test_the_block_on_the_data_s_spans_gives_the_same_answer(tmp_path: Path) -> None:
    """featurize --spans on: the MHLA's sums on the data's spans only (the cross sums' rows in the block's
    coordinates); the extended certificate and fit are those of every feature."""
    rng = np.random.default_rng(12)
    off = windows(rng, 80, 2, 8)
    X = np.zeros((int(off[-1]), 6))
    X[:, :3] = wide_tokens(rng, int(off[-1]), 3)  # wide tokens of rank 3, reduced to d = 4: a coordinate 0
    s = setup(tmp_path, "bidirectional", 1, D=6, d=4, X=X, off=off)
    on = featurize(s["red"], affine_from=s["wide"], spans="on")
    off_ = featurize(s["red"], affine_from=s["wide"], spans="off")
    assert on.on_spans and not off_.on_spans
    ca, cb = learn_certify(on), learn_certify(off_)
    assert ca.identifiable == cb.identifiable
    assert abs(ca.lambda_max - cb.lambda_max) <= 1e-9 * cb.lambda_max
    Xh, Xrh, offh = held_out(s, "bidirectional", 3)
    Xh[:, 3:] = 0.0
    Xrh = Xh @ s["red_map"].P
    smp = samples_of(True, "bidirectional")
    pa = predict_samples(learn_fit(on), Xrh, offh, smp, wide=Xh)
    pb = predict_samples(learn_fit(off_), Xrh, offh, smp, wide=Xh)
    assert relerr(pa, pb) < 1e-8


# --------------------------------------------------------------------------------------------
# the ridge by cross-validation of the extended features
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hull", [False, True])
def test_ridge_auto_is_numpy_s_cross_validation(tmp_path: Path, hull: bool, capsys) -> None:
    """fit --ridge auto with --affine-from: K-fold CV of the extended features (each training fold in its own
    canonical coordinates, f whitened on its range), the same curve and ridge as the numpy reference."""
    rng = np.random.default_rng(21)
    off = windows(rng, 90, 2, 6)
    T, N, D = int(off[-1]), 90, 5
    X = layer_normed(rng, T, D)[0] if hull else wide_tokens(rng, T, D)
    Xq = X[off[1:] - 1]
    Y = Xq @ rng.standard_normal((D, D)) + 0.5 * rng.standard_normal((N, D))
    s = setup(tmp_path, "last", 4, D=D, X=X, off=off, Y=Y)
    total, folds = load_for_cv(s["red"], 5, affine_from=s["wide"])  # the command line's K
    model = learn_fit(total, ridge="auto", folds=folds)
    cv = model.info["ridge_cv"]
    grid = np.array([row["ridge"] for row in cv["table"]])
    want = ref.affine_ridge_cv_path(s["Xr"], off, s["Yr"], X, 5, grid).mean(axis=1)
    got = np.array([row["cv_mse"] for row in cv["table"]])
    assert relerr(got, want) < 1e-8
    assert cv["chosen"] == grid[int(np.argmin(want))] and model.info["ridge"] == cv["chosen"]
    assert relerr(model.info["lambda_max"], cv["lambda_max"]) < 1e-12
    # the command line: the same choice
    assert run(["fit", str(s["red"]), "-o", str(tmp_path / "m.h5"), "--affine-from", str(s["wide"]),
                "--ridge", "auto", "--json", "-q"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert abs(out["ridge"] - cv["chosen"]) <= 1e-12 * cv["chosen"]
    # featurize --folds with the wide tokens stores each fold's affine block: fitting that file chooses alike
    feats = tmp_path / "f.h5"
    assert run(["featurize", str(s["red"]), "-o", str(feats), "--affine-from", str(s["wide"]), "--folds", "5",
                "-q"]) == 0
    assert run(["fit", str(feats), "-o", str(tmp_path / "m2.h5"), "--ridge", "auto", "--json", "-q"]) == 0
    out2 = json.loads(capsys.readouterr().out)
    assert abs(out2["ridge"] - cv["chosen"]) <= 1e-12 * cv["chosen"]
    assert relerr(np.array(out2["ridge_cv"]["table"][3]["cv_mse"]), np.array(want[3])) < 1e-8
    # a features file of the block without its folds' blocks is refused, not cross-validated without them
    with h5py.File(feats, "a") as f:
        del f["fold_affine_gram"]
    assert run(["fit", str(feats), "-o", str(tmp_path / "m3.h5"), "--ridge", "auto"]) == 2
    assert "fold_affine_gram" in capsys.readouterr().err
