"""mhla_cli.model.directions: the whitened readings of `mhla reduce --method supervised|weights` against plain numpy
(Cholesky factors, lstsq), their cuts (WHITEN_RTOL, RANK_RTOL: cases just inside and outside), the completion by
principal directions, unit-freeness, and the --weights file's accepted keys and shapes (refusals: one line)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy.linalg import subspace_angles

from mhla_cli.errors import InputError
from mhla_cli.model import directions
from mhla_cli.model.directions import RANK_RTOL, WHITEN_RTOL

ANGLE_TOL = 1e-8


def _ref_supervised(X: np.ndarray, Y: np.ndarray, w: np.ndarray, d: int) -> np.ndarray:
    """Reduced-rank regression by Cholesky: C = L L^T, SVD of L^T B = U S W^T, P = L^-T U_d; completed (rank of the
    read k < d) by the top eigenvectors of the residual second moment C - C P_k P_k^T C."""
    C = (X * w[:, None]).T @ X
    B = np.linalg.lstsq(np.sqrt(w)[:, None] * X, np.sqrt(w)[:, None] * Y, rcond=None)[0]
    L = np.linalg.cholesky(C)
    U, s, _ = np.linalg.svd(L.T @ B)
    k = min(d, int((s > 1e-9 * s[0]).sum()))
    Pk = np.linalg.solve(L.T, U[:, :k])
    if k == d:
        return Pk
    res = C - C @ Pk @ Pk.T @ C
    ev, V = np.linalg.eigh(res)
    return np.hstack([Pk, V[:, np.argsort(ev)[::-1][:d - k]]])


def _ref_weights(X: np.ndarray, W: np.ndarray, d: int) -> np.ndarray:
    """P = L^-T V_d, V_d the top right singular vectors of W L, C = X^T X / n = L L^T."""
    L = np.linalg.cholesky(X.T @ X / len(X))
    Vt = np.linalg.svd(W @ L)[2]
    return np.linalg.solve(L.T, Vt[:d].T)


def _tokens(rng: np.random.Generator, n: int, D: int) -> np.ndarray:
    scale = np.ones(D)
    scale[-2:] = 1e-2  # two directions of low variance
    return (rng.standard_normal((n, D)) * scale) @ np.linalg.qr(rng.standard_normal((D, D)))[0].T


def test_supervised_spans_numpys_reduced_rank_regression() -> None:
    rng = np.random.default_rng(0)
    X, w = _tokens(rng, 400, 9), rng.uniform(0.5, 2.0, 400)
    Y = X @ rng.standard_normal((9, 5)) + 0.1 * rng.standard_normal((400, 5))
    for d in (1, 3, 5):
        P, share = directions.supervised((X * w[:, None]).T @ X / w.sum(), (X * w[:, None]).T @ Y / w.sum(), d)
        assert np.max(subspace_angles(P, _ref_supervised(X, Y, w, d))) <= ANGLE_TOL
        # the reduced tokens have unit mean square and are uncorrelated (P^T C P = I)
        C = (X * w[:, None]).T @ X / w.sum()
        assert np.abs(P.T @ C @ P - np.eye(d)).max() < 1e-10
        # the share: of the linear prediction's mean square, the rank-d reduced-rank regression's part
        B = np.linalg.lstsq(np.sqrt(w)[:, None] * X, np.sqrt(w)[:, None] * Y, rcond=None)[0]
        Bd = np.linalg.lstsq(np.sqrt(w)[:, None] * (X @ P), np.sqrt(w)[:, None] * Y, rcond=None)[0]
        full, kept = w @ ((X @ B) ** 2).sum(axis=1), w @ ((X @ P @ Bd) ** 2).sum(axis=1)
        assert share == pytest.approx(kept / full, rel=1e-10)


def test_supervised_completes_a_low_rank_read_with_principal_directions() -> None:
    """Targets of rank 2 and d = 4: the two read directions, then the top principal directions of the residual."""
    rng = np.random.default_rng(1)
    X, w = _tokens(rng, 300, 8), np.ones(300)
    Y = X @ rng.standard_normal((8, 2)) @ rng.standard_normal((2, 6))
    P, share = directions.supervised(X.T @ X / 300, X.T @ Y / 300, 4)
    assert share == pytest.approx(1.0, abs=1e-12)
    assert np.max(subspace_angles(P, _ref_supervised(X, Y, w, 4))) <= ANGLE_TOL
    # no target at all: every direction is a principal one (the tokens' PCA)
    P0, share0 = directions.supervised(X.T @ X, np.zeros((8, 3)), 3)
    top = np.linalg.eigh(X.T @ X)[1][:, ::-1][:, :3]
    assert share0 == 1.0 and np.max(subspace_angles(P0, top)) <= ANGLE_TOL


def test_weights_span_numpys_and_keep_a_known_W() -> None:
    rng = np.random.default_rng(2)
    X = _tokens(rng, 500, 10)
    W = rng.standard_normal((6, 10))
    for d in (2, 4):
        P, share = directions.weight_directions(W, X.T @ X / 500, d)
        assert np.max(subspace_angles(P, _ref_weights(X, W, d))) <= ANGLE_TOL
        s = np.linalg.svd(W @ np.linalg.cholesky(X.T @ X / 500), compute_uv=False)
        assert share == pytest.approx((s[:d] ** 2).sum() / (s ** 2).sum(), rel=1e-10)
    # W reads only 2 directions: d = 2 keeps W x exactly (share 1): the readings span W's rows
    rows = rng.standard_normal((2, 10))
    P, share = directions.weight_directions(rng.standard_normal((5, 2)) @ rows, X.T @ X, 2)
    assert share == pytest.approx(1.0, abs=1e-12)
    assert np.max(subspace_angles(P, rows.T)) <= ANGLE_TOL


@pytest.mark.parametrize("method", ["supervised", "weights"])
def test_unit_free_under_an_invertible_map(method: str) -> None:
    """x -> A^T x (and W -> W A^-T): the reduced tokens change by an invertible d x d map (their span is the same)."""
    rng = np.random.default_rng(3)
    X = _tokens(rng, 400, 7)
    Y = np.tanh(X @ rng.standard_normal((7, 4)))
    W = rng.standard_normal((5, 7))
    A = rng.standard_normal((7, 7)) + 3 * np.eye(7)
    Xa = X @ A

    def reduced(X: np.ndarray, W: np.ndarray) -> np.ndarray:
        if method == "supervised":
            return X @ directions.supervised(X.T @ X, X.T @ Y, 3)[0]
        return X @ directions.weight_directions(W, X.T @ X, 3)[0]

    Z, Za = reduced(X, W), reduced(Xa, W @ np.linalg.inv(A).T)
    assert np.max(subspace_angles(Z, Za)) <= ANGLE_TOL


@pytest.mark.parametrize("factor, rank", [(2.0, 4), (0.5, 3)])
def test_whiten_cut_just_inside_and_outside(factor: float, rank: int) -> None:
    lam = np.array([1.0, 0.5, 0.25, factor * WHITEN_RTOL])
    Q = np.linalg.qr(np.random.default_rng(4).standard_normal((4, 4)))[0]
    C = (Q * lam) @ Q.T
    assert directions.whitening(C).rank == rank
    if rank < 4:  # the tokens span 3 dimensions: 4 cannot be kept
        with pytest.raises(InputError, match="more than the 3 dimensions the tokens span"):
            directions.supervised(C, np.ones((4, 2)), 4)
    else:
        assert directions.supervised(C, np.ones((4, 2)), 4)[0].shape == (4, 4)


@pytest.mark.parametrize("factor, k", [(2.0, 2), (0.5, 1)])
def test_rank_cut_just_inside_and_outside(factor: float, k: int) -> None:
    Q = np.linalg.qr(np.random.default_rng(5).standard_normal((5, 5)))[0]
    M = Q[:, :2] * np.array([1.0, factor * RANK_RTOL * 1.0])
    U, _ = directions.top_reads(M, 3)
    assert U.shape == (5, k)


def test_sign_rule() -> None:
    P = directions.sign_columns(np.array([[1.0, -3.0], [-2.0, 3.0]]))
    assert np.array_equal(P, [[-1.0, 3.0], [2.0, -3.0]])


def _save(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    if path.suffix == ".npz":
        np.savez(path, **arrays)
    else:
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(path))
    return path


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_weights_file_keys_and_shapes(tmp_path: Path, suffix: str) -> None:
    rng = np.random.default_rng(6)
    Wq, Wv = rng.standard_normal((3, 8)), rng.standard_normal((2, 4, 8)).astype(np.float32)
    W = directions.load_read_weights(_save(tmp_path / f"w{suffix}", {"W_V": Wv, "W_Q": Wq}), 8)
    assert np.array_equal(W, np.vstack([Wq, Wv.reshape(-1, 8).astype(np.float64)]))  # in WEIGHT_KEYS' order


@pytest.mark.parametrize("arrays, pattern", [
    ({"W_Q": np.ones((3, 8)), "b_Q": np.ones(3)}, "holds 'b_Q'; it takes only the arrays W, W_Q, W_K, W_V"),
    ({"W_Q": np.ones((8, 3))}, r"has shape \(8, 3\), expected \(k, 8\) .*is the transpose"),
    ({"W": np.ones((2, 3, 4, 8))}, r"has shape \(2, 3, 4, 8\)"),
    ({"W": np.ones(8)}, r"has shape \(8,\)"),
    ({"W": np.array([[np.nan] * 8])}, "NaN or Inf"),
    ({}, "holds no array"),
])
def test_weights_file_refusals(tmp_path: Path, arrays: dict[str, np.ndarray], pattern: str) -> None:
    path = _save(tmp_path / "w.npz", arrays)
    with pytest.raises(InputError, match=pattern):
        directions.load_read_weights(path, 8)


def test_weights_file_suffix_and_missing(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="takes a .npz or .safetensors file, not .pt"):
        directions.load_read_weights(tmp_path / "w.pt", 8)
    with pytest.raises(InputError, match="no such file"):
        directions.load_read_weights(tmp_path / "w.npz", 8)


def test_weights_of_fewer_rows_than_d_are_completed_like_supervised() -> None:
    """W of 2 rows and d = 4: W's rows, then the principal directions of the residual (the reference's)."""
    rng = np.random.default_rng(7)
    X = _tokens(rng, 300, 8)
    W = rng.standard_normal((2, 8))
    P, share = directions.weight_directions(W, X.T @ X / 300, 4)
    assert share == pytest.approx(1.0, abs=1e-12)
    assert np.max(subspace_angles(P[:, :2], W.T)) <= ANGLE_TOL
    # the same span as supervised's completion of the targets y = W x (whose read is W's rows)
    ref = _ref_supervised(X, X @ W.T, np.ones(300), 4)
    assert np.max(subspace_angles(P, ref)) <= ANGLE_TOL
