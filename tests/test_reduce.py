"""`mhla reduce` and mhla_cli.model.reduce: the maps against numpy's eigh on the materialised arrays, `--like`
bit for bit, layouts (ragged, dense, per position, weights) and the refusals (exit 2, one line)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli.model import reduce as reduce_mod
from mhla_cli import write_tokens
from mhla_cli.cli import run
from mhla_cli.errors import InputError
from mhla_cli.io.tokens import inspect_tokens
from mhla_cli.api.learn import export_heads
from mhla_cli.model.model import Model
from mhla_cli.model.reduce import unreduce_heads
from conftest import unseal

D, E, N = 24, 6, 30


def _data(seed: int = 0, n_max: int = 7) -> tuple[list[np.ndarray], np.ndarray]:
    """Ragged sequences of D-dim tokens with well separated second-moment eigenvalues, E-dim targets."""
    rng = np.random.default_rng(seed)
    scale = 2.0 ** -np.arange(D / 2, step=0.5)
    R = np.linalg.qr(rng.standard_normal((D, D)))[0]
    seqs = [(rng.standard_normal((int(rng.integers(1, n_max)), D)) * scale) @ R.T for _ in range(N)]
    Y = rng.standard_normal((N, E)) * 2.0 ** -np.arange(E)
    return seqs, Y


def _ref_maps(X: np.ndarray, k: int) -> np.ndarray:
    """Top-k eigenvectors of X^T X by numpy's eigh, signed largest entry positive (the reference)."""
    w, V = np.linalg.eigh(X.T @ X)
    top = V[:, np.argsort(w)[::-1][:k]]
    for j in range(k):
        i = int(np.argmax(np.abs(top[:, j])))
        top[:, j] *= np.sign(top[i, j])
    return top


def _read(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in f}


@pytest.fixture()
def data(tmp_path: Path) -> tuple[Path, list[np.ndarray], np.ndarray]:
    seqs, Y = _data()
    path = tmp_path / "wide.h5"
    write_tokens(path, seqs, targets=Y)
    return path, seqs, Y


def test_maps_are_numpys_top_eigenvectors(data: tuple[Path, list[np.ndarray], np.ndarray], tmp_path: Path) -> None:
    path, seqs, Y = data
    out = tmp_path / "r.h5"
    assert run(["reduce", str(path), "-o", str(out), "--dim", "4", "-q"]) == 0
    got = _read(out)
    X = np.concatenate(seqs)
    P, U = got["reduce_P"], got["reduce_U"]
    Pr, Ur = _ref_maps(X, 4), _ref_maps(Y, 4)
    # the subspaces (projectors) and, with the sign rule, the maps themselves
    assert np.abs(P @ P.T - Pr @ Pr.T).max() < 1e-10
    assert np.abs(U @ U.T - Ur @ Ur.T).max() < 1e-10
    assert np.abs(P - Pr).max() < 1e-10 and np.abs(U - Ur).max() < 1e-10
    assert np.abs(got["tokens"] - X @ Pr).max() < 1e-10 * np.abs(X).max()
    assert np.abs(got["targets"] - Y @ Ur).max() < 1e-10 * np.abs(Y).max()
    assert np.array_equal(got["offsets"], np.concatenate([[0], np.cumsum([len(s) for s in seqs])]))
    with h5py.File(out, "r") as f:
        wx = np.sort(np.linalg.eigvalsh(X.T @ X))[::-1]
        wy = np.sort(np.linalg.eigvalsh(Y.T @ Y))[::-1]
        assert f.attrs["reduce_token_share"] == pytest.approx(wx[:4].sum() / wx.sum(), rel=1e-12)
        assert f.attrs["reduce_target_share"] == pytest.approx(wy[:4].sum() / wy.sum(), rel=1e-12)
        assert f.attrs["mhla_kind"] == "tokens" and int(f.attrs["reduce_dim"]) == 4


def test_like_applies_the_same_maps_bit_for_bit(data: tuple[Path, list[np.ndarray], np.ndarray],
                                                tmp_path: Path) -> None:
    path, _, _ = data
    out, again, other = tmp_path / "r.h5", tmp_path / "again.h5", tmp_path / "other.h5"
    assert run(["reduce", str(path), "-o", str(out), "--dim", "5", "-q"]) == 0
    # the same data through --like: the very same file contents (maps; tokens, targets in the same chunks)
    assert run(["reduce", str(path), "--like", str(out), "-o", str(again), "-q"]) == 0
    a, b = _read(out), _read(again)
    for k in ("reduce_P", "reduce_U", "tokens", "targets", "offsets"):
        assert np.array_equal(a[k], b[k]), k
    # held-out data: the maps of OUT, not their own
    seqs2, Y2 = _data(seed=5)
    held = tmp_path / "held.h5"
    write_tokens(held, seqs2, targets=Y2)
    assert run(["reduce", str(held), "--like", str(out), "-o", str(other), "-q"]) == 0
    c = _read(other)
    assert np.array_equal(c["reduce_P"], a["reduce_P"]) and np.array_equal(c["reduce_U"], a["reduce_U"])
    assert np.abs(c["tokens"] - np.concatenate(seqs2) @ a["reduce_P"]).max() < 1e-12
    assert np.abs(c["targets"] - Y2 @ a["reduce_U"]).max() < 1e-12


def test_chunking_changes_nothing_but_rounding(data: tuple[Path, list[np.ndarray], np.ndarray],
                                               tmp_path: Path) -> None:
    path, _, _ = data
    whole = reduce_mod.fit_reduction(path, 3)
    small = reduce_mod.fit_reduction(path, 3, chunk_size=1)
    assert np.abs(whole.P - small.P).max() < 1e-10 and np.abs(whole.U - small.U).max() < 1e-10


def test_dense_per_position_and_weights(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    X = rng.standard_normal((8, 5, D)) * np.linspace(1, 0.1, D)
    Y = rng.standard_normal((8, 5, E))
    w = rng.uniform(0.5, 1.5, (8, 5))
    path, out = tmp_path / "dense.h5", tmp_path / "r.h5"
    write_tokens(path, X, targets=Y, weights=w)
    red = reduce_mod.reduce_tokens(path, out, dim=3)
    got = _read(out)
    assert got["tokens"].shape == (8, 5, 3) and got["targets"].shape == (8, 5, 3)
    Pr, Ur = _ref_maps(X.reshape(-1, D), 3), _ref_maps(Y.reshape(-1, E), 3)
    assert np.abs(red.P - Pr).max() < 1e-10 and np.abs(red.U - Ur).max() < 1e-10
    assert np.abs(got["tokens"] - X @ Pr).max() < 1e-10
    assert np.array_equal(got["weights"], w)
    assert run(["fit", str(out), "-o", str(tmp_path / "m.h5"), "-q"]) == 0


def test_tokens_without_targets(tmp_path: Path) -> None:
    seqs, _ = _data()
    path, out = tmp_path / "x.h5", tmp_path / "r.h5"
    write_tokens(path, seqs)
    red = reduce_mod.reduce_tokens(path, out, dim=2)
    assert red.U is None and "reduce_U" not in _read(out) and "targets" not in _read(out)


def test_sign_rule_is_deterministic() -> None:
    G = np.diag([3.0, 2.0, 1.0])
    P, share = reduce_mod.top_eigenvectors(-np.eye(3) @ G @ -np.eye(3), 2)
    assert np.array_equal(P, np.eye(3)[:, :2]) and share == pytest.approx(5 / 6)
    rng = np.random.default_rng(0)
    A = rng.standard_normal((5, 5))
    P1, _ = reduce_mod.top_eigenvectors(A @ A.T, 3)
    assert (P1[np.argmax(np.abs(P1), axis=0), np.arange(3)] > 0).all()


@pytest.mark.parametrize("argv, pattern", [
    (["--dim", "25"], r"--dim 25 is more than the tokens' width D = 24"),
    (["--dim", "7"], r"--dim 7 is more than the targets' width D_out = 6"),
    (["--dim", "0"], r"--dim must be >= 1"),
    ([], r"give exactly one of --dim"),
])
def test_bad_dims_exit_2(argv: list[str], pattern: str, data: tuple[Path, list[np.ndarray], np.ndarray],
                         tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import re

    path, _, _ = data
    out = tmp_path / "r.h5"
    capsys.readouterr()
    assert run(["reduce", str(path), "-o", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mhla: error: ") and re.search(pattern, err[0]), err
    assert not out.exists()


def test_like_of_other_widths_exit_2(data: tuple[Path, list[np.ndarray], np.ndarray], tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    path, seqs, Y = data
    out = tmp_path / "r.h5"
    assert run(["reduce", str(path), "-o", str(out), "--dim", "3", "-q"]) == 0
    narrow, wide_y = tmp_path / "narrow.h5", tmp_path / "widey.h5"
    write_tokens(narrow, [s[:, :20] for s in seqs], targets=Y)
    write_tokens(wide_y, seqs, targets=np.hstack([Y, Y]))
    for bad, pattern in ((narrow, "the tokens have width D = 20 but the reduction of"),
                         (wide_y, "the targets have width D_out = 12 but the reduction of")):
        capsys.readouterr()
        assert run(["reduce", str(bad), "--like", str(out), "-o", str(tmp_path / "o.h5")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"mhla: error: {bad}: {pattern}"), err
    capsys.readouterr()
    assert run(["reduce", str(path), "--like", str(path), "-o", str(tmp_path / "o.h5")]) == 2
    assert "records no reduction" in capsys.readouterr().err
    assert not (tmp_path / "o.h5").exists()


def test_targets_of_another_width_are_a_valid_file(data: tuple[Path, list[np.ndarray], np.ndarray],
                                                   tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fitted at their own width (tests/test_output_width.py); a reduction keeping them copies them as they are."""
    path, _, _ = data
    capsys.readouterr()
    assert run(["inspect", str(path), "--json"]) == 0
    assert run(["reduce", str(path), "-o", str(tmp_path / "k.h5"), "--dim", "8", "--keep-targets", "-q"]) == 0
    assert inspect_tokens(tmp_path / "k.h5").out_dim == 6 and reduce_mod.load_reduction(tmp_path / "k.h5").U is None
    assert run(["reduce", str(path), "-o", str(tmp_path / "k2.h5"), "--like", str(tmp_path / "k.h5"),
                "--keep-targets"]) == 2


def test_json_summary(data: tuple[Path, list[np.ndarray], np.ndarray], tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    path, _, _ = data
    capsys.readouterr()
    assert run(["reduce", str(path), "-o", str(tmp_path / "r.h5"), "--dim", "2", "--json", "-q"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["d"] == 2 and rep["D"] == D and rep["D_out"] == E and 0 < rep["token_share"] <= 1


def test_library_errors() -> None:
    with pytest.raises(InputError, match="cannot keep 4 of 3"):
        reduce_mod.top_eigenvectors(np.eye(3), 4)


# ------------------------------------------------------------- --method supervised | weights

ANGLE_TOL = 1e-8  # the acceptance's bound on the principal angles between a map's span and numpy's


def _low_variance_data(seed: int = 0, n_seq: int = 60, D_: int = 8, E_: int = 3
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Bidirectional windows (dense (N, 6, D)) whose targets at every position depend on two token directions of
    low variance (the last two coordinates, rotated): (tokens, targets, weights, the two directions (D, 2))."""
    rng = np.random.default_rng(seed)
    scale = np.ones(D_)
    scale[-2:] = 0.05
    R = np.linalg.qr(rng.standard_normal((D_, D_)))[0]
    X = (rng.standard_normal((n_seq, 6, D_)) * scale) @ R.T
    low = R[:, -2:]
    Y = np.tanh(X @ low @ rng.standard_normal((2, E_)) * 10) + 0.01 * rng.standard_normal((n_seq, 6, E_))
    return X, Y, rng.uniform(0.5, 1.5, (n_seq, 6)), low


def _ref_supervised_file(Xq: np.ndarray, Y: np.ndarray, w: np.ndarray, d: int) -> np.ndarray:
    """Reduced-rank regression on the materialised scored samples, by a Cholesky factor: C = L L^T,
    L^T B = U S W^T, P = L^-T U_d (B = numpy's weighted lstsq)."""
    sw = np.sqrt(w)[:, None]
    B = np.linalg.lstsq(sw * Xq, sw * Y, rcond=None)[0]
    L = np.linalg.cholesky((Xq * w[:, None]).T @ Xq)
    U = np.linalg.svd(L.T @ B)[0]
    return np.linalg.solve(L.T, U[:, :d])


def test_supervised_finds_a_low_variance_direction_pca_does_not(tmp_path: Path) -> None:
    """Targets of two low-variance token directions: supervised spans them (and numpy's reduced-rank regression,
    every position weighted), the tokens' PCA is nearly orthogonal to them."""
    from scipy.linalg import subspace_angles

    X, Y, w, low = _low_variance_data()
    path = tmp_path / "w.h5"
    write_tokens(path, X, targets=Y, weights=w, attention="bidirectional")
    sup = reduce_mod.reduce_tokens(path, tmp_path / "s.h5", dim=2, method="supervised")
    pca = reduce_mod.reduce_tokens(path, tmp_path / "p.h5", dim=2)
    Xq, Yq, wq = X.reshape(-1, X.shape[2]), Y.reshape(-1, Y.shape[2]), w.reshape(-1)
    assert np.max(subspace_angles(sup.P, _ref_supervised_file(Xq, Yq, wq, 2))) <= ANGLE_TOL
    assert np.max(subspace_angles(sup.P, low)) < 0.05  # the noise's share only
    assert np.min(subspace_angles(pca.P, low)) > 1.4  # nearly orthogonal: PCA keeps what varies most
    got = _read(tmp_path / "s.h5")
    assert np.abs(got["tokens"] - X @ sup.P).max() < 1e-12 * np.abs(X @ sup.P).max()
    with h5py.File(tmp_path / "s.h5") as f:
        assert f.attrs["reduce_method"] == "supervised" and "linear read" in f.attrs["reduce_share_of"]
        assert f.attrs["reduce_token_share"] == sup.token_share and 0.99 < sup.token_share <= 1.0
    assert reduce_mod.load_reduction(tmp_path / "s.h5").method == "supervised"


def test_supervised_scores_the_last_tokens_of_last_token_data(tmp_path: Path) -> None:
    """Last-token targets: the scored samples are each sequence's last token, with its weight."""
    from scipy.linalg import subspace_angles

    seqs, Y = _data(n_max=4)
    w = np.random.default_rng(3).uniform(0.5, 2.0, N)
    path = tmp_path / "last.h5"
    write_tokens(path, seqs, targets=Y, weights=w)
    red = reduce_mod.fit_reduction(path, 4, method="supervised", chunk_size=7)
    last = np.stack([s[-1] for s in seqs])
    assert np.max(subspace_angles(red.P, _ref_supervised_file(last, Y, w, 4))) <= ANGLE_TOL


def test_weights_method_against_numpy(tmp_path: Path) -> None:
    """--method weights: P = C^-1/2 V_d, V_d the top right singular vectors of W C^(1/2) (C over every token)."""
    from scipy.linalg import subspace_angles

    X, Y, _, _ = _low_variance_data(seed=1)
    path, wfile = tmp_path / "w.h5", tmp_path / "qkv.npz"
    write_tokens(path, X, targets=Y, attention="bidirectional")
    rng = np.random.default_rng(7)
    Wq, Wk = rng.standard_normal((2, 8)), rng.standard_normal((2, 8))
    np.savez(wfile, W_Q=Wq, W_K=Wk)
    out = tmp_path / "r.h5"
    assert run(["reduce", str(path), "-o", str(out), "--dim", "3", "--method", "weights", "--weights", str(wfile),
                "-q"]) == 0
    red = reduce_mod.load_reduction(out)
    Xa = X.reshape(-1, 8)
    L = np.linalg.cholesky(Xa.T @ Xa)
    Vt = np.linalg.svd(np.vstack([Wq, Wk]) @ L)[2]
    assert np.max(subspace_angles(red.P, np.linalg.solve(L.T, Vt[:3].T))) <= ANGLE_TOL
    assert red.method == "weights" and red.weights == str(wfile)
    with h5py.File(out) as f:  # the --weights file among the recorded inputs, after the data (--affine-from's)
        inputs = json.loads(f.attrs["mhla_inputs"])
        assert inputs[0]["name"] == "w.h5" and inputs[1]["name"] == "qkv.npz" and inputs[1]["fingerprint"]
    s = np.linalg.svd(np.vstack([Wq, Wk]) @ L, compute_uv=False)
    assert red.token_share == pytest.approx((s[:3] ** 2).sum() / (s ** 2).sum(), rel=1e-10)


def test_pca_is_the_default_bit_for_bit(data: tuple[Path, list[np.ndarray], np.ndarray], tmp_path: Path) -> None:
    path, _, _ = data
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    assert run(["reduce", str(path), "-o", str(a), "--dim", "4", "-q"]) == 0
    assert run(["reduce", str(path), "-o", str(b), "--dim", "4", "--method", "pca", "-q"]) == 0
    ga, gb = _read(a), _read(b)
    for k in ga:
        assert np.array_equal(ga[k], gb[k]), k
    with h5py.File(a) as f:
        assert f.attrs["reduce_method"] == "pca" and f.attrs["reduce_share_of"] == "the tokens' second moment"


@pytest.mark.parametrize("method", ["supervised", "weights"])
def test_like_applies_a_whitened_reduction_bit_for_bit(method: str, tmp_path: Path) -> None:
    X, Y, w, _ = _low_variance_data()
    path, out, again = tmp_path / "w.h5", tmp_path / "r.h5", tmp_path / "again.h5"
    write_tokens(path, X, targets=Y, weights=w, attention="bidirectional")
    np.savez(tmp_path / "W.npz", W=np.random.default_rng(0).standard_normal((4, 8)))
    extra = ["--weights", str(tmp_path / "W.npz")] if method == "weights" else []
    assert run(["reduce", str(path), "-o", str(out), "--dim", "3", "--method", method, *extra, "-q"]) == 0
    assert run(["reduce", str(path), "--like", str(out), "-o", str(again), "-q"]) == 0
    a, b = _read(out), _read(again)
    for k in ("reduce_P", "reduce_U", "tokens", "targets"):
        assert np.array_equal(a[k], b[k]), k
    assert reduce_mod.load_reduction(again).method == method


@pytest.mark.parametrize("method", ["supervised", "weights", "pca"])
def test_the_fitted_function_is_unit_free(method: str, tmp_path: Path) -> None:
    """x -> A^T x (A invertible; W -> W A^-T): reduce -> featurize -> fit -> predict gives the same predictions
    (pca, which is not unit-free, is the control: the same test tells them apart)."""
    from mhla_cli import load_function, predict_file

    X, Y, _, _ = _low_variance_data(seed=2, n_seq=120)
    rng = np.random.default_rng(11)
    A = rng.standard_normal((8, 8)) + 4 * np.eye(8)
    W = rng.standard_normal((6, 8))
    preds = []
    for name, Xm, Wm in (("plain", X, W), ("mapped", X @ A, W @ np.linalg.inv(A).T)):
        path, red, feats, model = (tmp_path / f"{name}_{k}.h5" for k in ("w", "r", "f", "m"))
        write_tokens(path, Xm, targets=Y, attention="bidirectional")
        np.savez(tmp_path / f"{name}_W.npz", W=Wm)
        extra = ["--weights", str(tmp_path / f"{name}_W.npz")] if method == "weights" else []
        assert run(["reduce", str(path), "-o", str(red), "--dim", "3", "--method", method, *extra, "-q"]) == 0
        assert run(["featurize", str(red), "-o", str(feats), "-q"]) == 0
        assert run(["fit", str(feats), "-o", str(model), "-q"]) == 0
        preds.append(predict_file(load_function(model), red, all_positions=True).outputs)
    scale = np.abs(preds[0]).max()
    if method == "pca":
        assert np.abs(preds[0] - preds[1]).max() > 1e-2 * scale
    else:
        assert np.abs(preds[0] - preds[1]).max() <= 1e-8 * scale


@pytest.mark.parametrize("argv, pattern", [
    (["--dim", "3", "--method", "weights"], "--method weights needs --weights FILE"),
    (["--dim", "3", "--weights", "W.npz"], "--weights goes with --method weights, not --method pca"),
    (["--like", "r.h5", "--method", "supervised"], "--method and --weights choose the maps fitted on DATA"),
    (["--dim", "3", "--method", "weights", "--weights", "bad.npz"], r"--weights array 'W' has shape \(4, 5\)"),
    (["--dim", "25", "--method", "supervised"], r"--dim 25 is more than the tokens' width"),
])
def test_method_refusals_exit_2(argv: list[str], pattern: str, data: tuple[Path, list[np.ndarray], np.ndarray],
                                tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
                                ) -> None:
    import re

    path, _, _ = data
    monkeypatch.chdir(tmp_path)
    np.savez(tmp_path / "W.npz", W=np.ones((2, D)))
    np.savez(tmp_path / "bad.npz", W=np.ones((4, 5)))
    assert run(["reduce", str(path), "-o", "r.h5", "--dim", "2", "-q"]) == 0
    capsys.readouterr()
    assert run(["reduce", str(path), "-o", "out.h5", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mhla: error: ") and re.search(pattern, err[0]), err
    assert not (tmp_path / "out.h5").exists()


def test_supervised_needs_targets_and_a_scored_sample(tmp_path: Path) -> None:
    seqs, Y = _data()
    path = tmp_path / "x.h5"
    write_tokens(path, seqs)
    with pytest.raises(InputError, match="method='supervised' needs targets"):
        reduce_mod.reduce_tokens(path, tmp_path / "r.h5", dim=2, method="supervised")
    zero = tmp_path / "zero.h5"
    write_tokens(zero, seqs, targets=Y, weights=np.zeros(N))
    with pytest.raises(InputError):  # every weight 0: refused (by the file's rules, or as no scored sample)
        reduce_mod.reduce_tokens(zero, tmp_path / "r.h5", dim=2, method="supervised")
    assert not (tmp_path / "r.h5").exists()


# ------------------------------------------------------------- heads back in the original widths


@pytest.mark.parametrize("method", ["pca", "supervised", "weights"])
def test_unreduced_heads_predict_U_times_the_reduced_predictions(data: tuple[Path, list[np.ndarray], np.ndarray],
                                                                 tmp_path: Path, method: str) -> None:
    """export-heads --unreduce: on the unreduced tokens, U times the reduced model's predictions (1e-10), whatever
    the method (the whitened methods' P is not orthonormal: V = U V_h P^T, Q = P Q_h P^T hold for any P)."""
    from mhla_cli import load_function, predict_file
    from mhla_cli.model.export import load_heads

    path, seqs, _ = data
    red, model, heads = tmp_path / "r.h5", tmp_path / "m.h5", tmp_path / "h.h5"
    np.savez(tmp_path / "W.npz", W_Q=np.random.default_rng(8).standard_normal((5, D)))
    extra = {"pca": [], "supervised": ["--method", "supervised"],
             "weights": ["--method", "weights", "--weights", str(tmp_path / "W.npz")]}[method]
    assert run(["reduce", str(path), "-o", str(red), "--dim", "3", *extra, "-q"]) == 0
    assert run(["fit", str(red), "-o", str(model), "-q"]) == 0
    assert run(["export-heads", str(model), "-o", str(heads), "--unreduce", str(red), "-q"]) == 0
    h = load_function(heads)
    # factored: the reduced heads (3 x 3) and the maps of the reduction; the function of D-dim tokens to E-dim outputs
    assert h.factored and h.V.shape[1:] == (3, 3) and h.Q.shape[1:] == (3, 3) and (h.d, h.d_out) == (D, E)
    maps = _read(red)
    assert np.array_equal(h.P, maps["reduce_P"]) and np.array_equal(h.U, maps["reduce_U"])
    dense = h.dense()
    assert dense.V.shape[1:] == (E, D) and dense.Q.shape[1:] == (D, D) and not dense.factored
    U = maps["reduce_U"]
    small = predict_file(load_function(model), red)
    full = predict_file(h, path)
    want = small.predictions @ U.T
    scale = np.abs(want).max()
    assert np.abs(full.predictions - want).max() <= 1e-10 * scale
    # against the targets of the original width: an MSE (E wide)
    assert full.mse is not None and full.d == E
    # every position, and causal, the same way (the reduced model's outputs mapped by U)
    for kw in ({"all_positions": True}, {"causal": True}):
        a, b = predict_file(h, path, **kw), predict_file(load_function(model), red, **kw)
        assert np.abs(a.outputs - b.outputs @ U.T).max() <= 1e-10 * np.abs(b.outputs).max()
    # the exports of other frameworks hold the factored heads too
    for suffix in (".npz",):
        out = tmp_path / f"h{suffix}"
        assert run(["export-heads", str(model), "-o", str(out), "--unreduce", str(red), "-q"]) == 0
        back = load_heads(out)
        assert np.array_equal(back.V, h.V) and np.array_equal(back.Q, h.Q) and np.array_equal(back.P, h.P)
        assert np.array_equal(back.U, h.U)
    # compare: the file against itself, and the --on check on the original tokens
    assert run(["compare", str(heads), str(tmp_path / "h.npz"), "--on", str(path), "-q"]) == 0


def test_unreduce_refusals(data: tuple[Path, list[np.ndarray], np.ndarray], tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    path, _, _ = data
    red, model = tmp_path / "r.h5", tmp_path / "m.h5"
    assert run(["reduce", str(path), "-o", str(red), "--dim", "3", "-q"]) == 0
    other = tmp_path / "r2.h5"
    assert run(["reduce", str(path), "-o", str(other), "--dim", "2", "-q"]) == 0
    assert run(["fit", str(red), "-o", str(model), "-q"]) == 0
    capsys.readouterr()
    assert run(["export-heads", str(model), "-o", str(tmp_path / "h.h5"), "--unreduce", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mhla: error: {other}: the heads have d = 3 but the reduction maps to d = 2"], err
    assert run(["export-heads", str(model), "-o", str(tmp_path / "h.h5"), "--unreduce", str(path)]) == 2
    assert "records no reduction" in capsys.readouterr().err
    assert not (tmp_path / "h.h5").exists()


def test_unreduce_checks_the_maps_against_the_models_data(data: tuple[Path, list[np.ndarray], np.ndarray],
                                                          tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The model records its training data's identity with the fingerprint of their reduction's maps: --unreduce
    takes that reduction or a file reduced --like it (fit on tokens or on a features file, --ridge auto), and
    refuses another reduce run of the same d (other data: other maps) with one line, exit 2, no file; a model
    fitted on data mhla reduce did not write is refused; a model without the record is warned about."""
    import h5py as h5

    path, _, _ = data
    seqs_b, Y_b = _data(seed=1)
    other = tmp_path / "other.h5"
    write_tokens(other, seqs_b, targets=Y_b)
    ra, rb, like = tmp_path / "ra.h5", tmp_path / "rb.h5", tmp_path / "like.h5"
    assert run(["reduce", str(path), "-o", str(ra), "--dim", "3", "-q"]) == 0
    assert run(["reduce", str(other), "-o", str(rb), "--dim", "3", "-q"]) == 0
    assert run(["reduce", str(other), "--like", str(ra), "-o", str(like), "-q"]) == 0
    m, feats, m2, m3 = (tmp_path / f"{n}.h5" for n in ("m", "f", "m2", "m3"))
    assert run(["fit", str(ra), "-o", str(m), "-q"]) == 0
    assert run(["featurize", str(ra), "-o", str(feats), "-q"]) == 0
    assert run(["fit", str(feats), "-o", str(m2), "-q"]) == 0
    assert run(["fit", str(ra), "-o", str(m3), "--ridge", "auto", "-q"]) == 0
    out = tmp_path / "h.h5"
    for model in (m, m2, m3):
        for good in (ra, like):
            capsys.readouterr()
            assert run(["export-heads", str(model), "-o", str(out), "--unreduce", str(good), "-q"]) == 0, (model, good)
            assert capsys.readouterr().err == ""
        out.unlink()
        assert run(["export-heads", str(model), "-o", str(out), "--unreduce", str(rb)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"mhla: error: {rb}: holds other maps") and "ra.h5" in err[0], err
        assert not out.exists()
    # what the check prevents: the heads put back with the other run's maps are another function
    from mhla_cli import load_function, predict_file

    heads = export_heads(Model.load(m))
    right = predict_file(unreduce_heads(heads, reduce_mod.load_reduction(ra)), path)
    wrong = predict_file(unreduce_heads(heads, reduce_mod.load_reduction(rb)), path)
    assert wrong.mse > 2 * right.mse
    # a model fitted on data that mhla reduce did not write
    with h5.File(ra) as f:
        toks, offs, ys = f["tokens"][()], f["offsets"][()], f["targets"][()]
    plain, mp = tmp_path / "plain.h5", tmp_path / "mp.h5"
    write_tokens(plain, toks, offsets=offs, targets=ys)
    assert run(["fit", str(plain), "-o", str(mp), "-q"]) == 0
    capsys.readouterr()
    assert run(["export-heads", str(mp), "-o", str(out), "--unreduce", str(ra)]) == 2
    assert "which mhla reduce did not write" in capsys.readouterr().err
    # a model without the record (an older mhla's): its recorded input confirms the file itself; any other file
    # is exported with a warning that it could not be checked
    with h5.File(m, "a") as f:
        unseal(f)
        del f.attrs["data_source"]
    assert load_function(m).info.get("data_source") is None
    capsys.readouterr()
    assert run(["export-heads", str(m), "-o", str(out), "--unreduce", str(ra), "-q"]) == 0
    err = capsys.readouterr().err.splitlines()  # only that the (older) model's integrity is not checked
    assert len(err) == 1 and err[0].startswith("mhla: warning:") and "no manifest" in err[0], err
    assert run(["export-heads", str(m), "-o", str(tmp_path / "h2.h5"), "--unreduce", str(like), "-q"]) == 0
    assert "does not record which reduction" in capsys.readouterr().err


@pytest.mark.slow
def test_reduce_runs_in_bounded_memory(tmp_path: Path) -> None:
    """A 192 MiB file of 384-dim float32 tokens reduces with a peak RSS under 300 MB (chunks + D^2)."""
    import subprocess
    import sys

    N, n, Dw = 4096, 32, 384
    path = tmp_path / "big.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f.attrs["mhla_kind"] = "tokens"
        ds = f.create_dataset("tokens", (N, n, Dw), dtype="f4")
        for a in range(0, N, 512):
            ds[a:a + 512] = rng.standard_normal((512, n, Dw), dtype=np.float32)
        f["targets"] = rng.standard_normal((N, 32))
    wrapper = ("import resource, subprocess, sys\n"
               "r = subprocess.run([sys.executable, '-m', 'mhla_cli', *sys.argv[1:]])\n"
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)\n"
               "sys.exit(r.returncode)\n")
    out = tmp_path / "r.h5"
    r = subprocess.run([sys.executable, "-c", wrapper, "reduce", str(path), "-o", str(out), "--dim", "8", "-q"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rss = float(r.stdout.strip().splitlines()[-1])
    assert rss < 300 * 1e6 / 2**20, f"peak RSS {rss:.0f} MiB"
    with h5py.File(out, "r") as f:
        assert f["tokens"].shape == (N, n, 8) and f["targets"].shape == (N, 8)
