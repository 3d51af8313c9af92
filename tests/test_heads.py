"""W <-> p <-> heads (Algorithm 1, steps 2-3) and the heads file (mhla_cli.model.heads).

References are written in plain numpy from the formulas of docs/formats.md:
  W[a*d+j, k*d+l] = sum_h V_h[a,j] Q_h[k,l]
  p[a,(j,k,l)] = W[a*d+j, k*d+l] + W[a*d+k, j*d+l] (j < k), W[a*d+j, j*d+l] (j = k)
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli.model import heads
from mhla_cli.errors import InputError
from mhla_cli.model.heads import Heads


def np_p_from_W(W: np.ndarray) -> np.ndarray:
    d = int(round(np.sqrt(W.shape[0])))
    rows = []
    for a in range(d):
        row = []
        for j in range(d):
            for k in range(j, d):
                for l in range(d):
                    v = W[a * d + j, k * d + l]
                    if j < k:
                        v += W[a * d + k, j * d + l]
                    row.append(v)
        rows.append(row)
    return np.array(rows)


def np_min_norm_W(p: np.ndarray) -> np.ndarray:
    """Each off-diagonal coefficient split equally between (j, k) and (k, j); diagonal ones kept."""
    d = p.shape[0]
    W = np.zeros((d * d, d * d))
    for a in range(d):
        f = 0
        for j in range(d):
            for k in range(j, d):
                for l in range(d):
                    if j == k:
                        W[a * d + j, j * d + l] = p[a, f]
                    else:
                        W[a * d + j, k * d + l] = W[a * d + k, j * d + l] = p[a, f] / 2
                    f += 1
    return W


def np_W_from_heads(V: np.ndarray, Q: np.ndarray) -> np.ndarray:
    H, d, _ = V.shape
    W = np.zeros((d * d, d * d))
    for h in range(H):
        for a in range(d):
            for j in range(d):
                for k in range(d):
                    for l in range(d):
                        W[a * d + j, k * d + l] += V[h, a, j] * Q[h, k, l]
    return W


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("d", [1, 2, 3, 4])
def test_p_W_heads_round_trips_on_random_p(d: int) -> None:
    rng = np.random.default_rng(d)
    psi = d * d * (d + 1) // 2
    p = rng.standard_normal((d, psi))
    W = heads.W_from_p(p)
    np.testing.assert_allclose(W, np_min_norm_W(p), rtol=0, atol=1e-15)  # the docs' formula
    np.testing.assert_allclose(heads.p_from_W(W), p, rtol=0, atol=1e-14)
    np.testing.assert_allclose(np_p_from_W(W), p, rtol=0, atol=1e-14)
    hs, s = heads.heads_from_W(W, tol=0)
    assert hs.V.shape == hs.Q.shape == (hs.n_heads, d, d) and hs.n_heads <= d * d
    assert s.shape == (d * d,) and (np.diff(s) <= 0).all()
    assert rel(np_W_from_heads(hs.V, hs.Q), W) <= 1e-12
    assert rel(np_p_from_W(np_W_from_heads(hs.V, hs.Q)), p) <= 1e-12
    assert rel(heads.p_from_heads(hs.V, hs.Q), p) <= 1e-12
    assert rel(hs.coef, p) <= 1e-12


@pytest.mark.parametrize("d", [2, 3])
def test_p_from_W_and_W_from_heads_match_the_formulas(d: int) -> None:
    rng = np.random.default_rng(10 + d)
    W = rng.standard_normal((d * d, d * d))
    np.testing.assert_allclose(heads.p_from_W(W), np_p_from_W(W), rtol=0, atol=1e-14)
    V, Q = rng.standard_normal((2, 3, d, d))
    np.testing.assert_allclose(heads.W_from_heads(V, Q), np_W_from_heads(V, Q), rtol=0, atol=1e-13)


def test_W_p_heads_roundtrip_and_min_norm() -> None:
    rng = np.random.default_rng(0)
    d = 3
    W = rng.standard_normal((d * d, d * d))
    p = heads.p_from_W(W)
    Wmin = heads.W_from_p(p)
    np.testing.assert_allclose(heads.p_from_W(Wmin), p, rtol=1e-14, atol=1e-14)
    # The minimum-norm representative is no larger than any other W with the same p.
    assert np.linalg.norm(Wmin) <= np.linalg.norm(W) + 1e-12
    # Adding a part antisymmetric in (j, k) leaves p unchanged.
    N4 = rng.standard_normal((d, d, d, d))
    N4 = N4 - N4.transpose(0, 2, 1, 3)
    np.testing.assert_allclose(heads.p_from_W(Wmin + N4.reshape(d * d, d * d)), p, atol=1e-13)
    # ... and Wmin is orthogonal to every such part (so it is the minimum-norm one, not just smaller).
    assert abs(float(np.sum(Wmin * N4.reshape(d * d, d * d)))) <= 1e-12 * np.linalg.norm(Wmin) * np.linalg.norm(N4)
    hs, s = heads.heads_from_W(Wmin, tol=0)
    assert hs.n_heads <= d * d
    np.testing.assert_allclose(hs.coef, p, rtol=1e-12, atol=1e-12)


def test_shape_errors() -> None:
    with pytest.raises(ValueError):
        heads.p_from_W(np.zeros((4, 5)))
    with pytest.raises(ValueError):
        heads.W_from_p(np.zeros((2, 5)))  # psi(2) = 6


def test_heads_file_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    V, Q = rng.standard_normal((2, 3, 2, 2))
    h = Heads(V=V, Q=Q, info={"normalize": "length", "function_change": 0.25, "coef_change": 0.5,
                              "coordinates": "canonical", "tol": 1e-9, "max_heads": 3})
    path = tmp_path / "h.h5"
    h.save(path)
    back = Heads.load(path)
    assert np.array_equal(back.V, V) and np.array_equal(back.Q, Q)
    assert back.info["normalize"] == "length"
    with h5py.File(path, "r") as f:
        assert f.attrs["mhla_kind"] == "heads" and int(f.attrs["n_heads"]) == 3 and int(f.attrs["d"]) == 2
        assert float(f.attrs["function_change"]) == 0.25 and int(f.attrs["max_heads"]) == 3
        assert float(f.attrs["coef_change"]) == 0.5 and f.attrs["coordinates"] == "canonical"


def _write(path: Path, attrs: dict | None = None, **data: np.ndarray) -> Path:
    with h5py.File(path, "w") as f:
        for k, v in (attrs if attrs is not None else {"mhla_kind": "heads"}).items():
            f.attrs[k] = v
        for k, v in data.items():
            f[k] = v
    return path


BAD_HEADS = {
    "Q_shape": (dict(V=np.ones((2, 3, 3)), Q=np.ones((2, 2, 2))), r"'Q' has shape \(2, 2, 2\) but 'V'"),
    "Q_count": (dict(V=np.ones((2, 3, 3)), Q=np.ones((1, 3, 3))), r"'Q' has shape"),
    "Q_not_square": (dict(V=np.ones((2, 3, 2)), Q=np.ones((2, 3, 2))), r"'Q' has shape .* expected \(H, d, d\)"),
    "V_vs_Q_width": (dict(V=np.ones((2, 3, 2)), Q=np.ones((2, 3, 3))), r"'Q' has shape \(2, 3, 3\) but 'V' has shape "
                     r"\(2, 3, 2\); expected V \(H, d_out, d\)"),
    "V_rank2": (dict(V=np.ones((3, 3)), Q=np.ones((3, 3))), r"'V' has shape"),
    "no_heads": (dict(V=np.ones((0, 2, 2)), Q=np.ones((0, 2, 2))), r"no heads"),
    "nan": (dict(V=np.full((1, 2, 2), np.nan), Q=np.ones((1, 2, 2))), r"NaN or Inf"),
    "inf": (dict(V=np.ones((1, 2, 2)), Q=np.full((1, 2, 2), np.inf)), r"NaN or Inf"),
    "no_Q": (dict(V=np.ones((1, 2, 2))), r"missing dataset 'Q'"),
    "strings": (dict(V=np.array([[[b"a"]]]), Q=np.ones((1, 1, 1))), r"dtype"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADS))
def test_bad_heads_files_are_refused(tmp_path: Path, case: str) -> None:
    data, msg = BAD_HEADS[case]
    path = _write(tmp_path / "h.h5", **data)
    with pytest.raises(InputError, match=msg) as exc:
        Heads.load(path)
    assert str(path) in str(exc.value)


def test_heads_file_bad_normalize_and_wrong_kind(tmp_path: Path) -> None:
    good = dict(V=np.ones((1, 2, 2)), Q=np.ones((1, 2, 2)))
    with pytest.raises(InputError, match="normalize"):
        Heads.load(_write(tmp_path / "a.h5", {"mhla_kind": "heads", "normalize": "squared"}, **good))
    with pytest.raises(InputError, match="is a model file"):
        Heads.load(_write(tmp_path / "b.h5", {"mhla_kind": "model"}, coef=np.ones((2, 6))))
    # no attributes at all: the kind is detected from the 'V' dataset
    assert Heads.load(_write(tmp_path / "c.h5", {}, **good)).n_heads == 1


# ------------------------------------------------------------- rectangular heads (d_out != d)


def _rect(seed: int = 0, H: int = 2, d_out: int = 2, d: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((H, d_out, d)), rng.standard_normal((H, d, d))


def test_rectangular_heads_round_trip_and_have_no_square_coef(tmp_path: Path) -> None:
    from mhla_cli.model.heads import coef_of_heads

    V, Q = _rect()
    h = Heads.from_arrays(V, Q)
    assert (h.d, h.d_out, h.n_heads) == (3, 2, 2)
    h.save(tmp_path / "h.h5")
    back = Heads.load(tmp_path / "h.h5")
    assert np.array_equal(back.V, V) and np.array_equal(back.Q, Q)
    with pytest.raises(InputError, match="no coef"):
        back.coef
    # the (d_out, psi) coef computes sum_h V_h S Q_h x on the features (reference: forward_heads)
    from mhla_cli.model.forward import forward_heads
    from mhla_cli.feature_map import cubic_features

    X = np.random.default_rng(1).standard_normal((5, 3))
    p = coef_of_heads(V, Q)
    assert p.shape == (2, 18)
    assert np.allclose(p @ cubic_features(X), forward_heads(V, Q, X), rtol=1e-12, atol=1e-12)


def test_coef_inner_is_the_frobenius_product_of_the_coefs() -> None:
    from mhla_cli.model.heads import coef_inner, coef_of_heads

    Va, Qa = _rect(0, H=3, d_out=2, d=4)
    Vb, Qb = _rect(1, H=2, d_out=2, d=4)
    want = float(np.sum(coef_of_heads(Va, Qa) * coef_of_heads(Vb, Qb)))
    assert coef_inner(Va, Qa, Vb, Qb) == pytest.approx(want, rel=1e-12)
    # square heads: the coef of p_from_heads
    Vs, Qs = _rect(2, H=2, d_out=3, d=3)
    assert np.allclose(coef_of_heads(Vs, Qs), heads.p_from_heads(Vs, Qs), rtol=0, atol=1e-12)


def test_heads_repr_is_short_and_shows_no_arrays() -> None:
    rng = np.random.default_rng(0)
    h = Heads(V=rng.standard_normal((5, 3, 3)), Q=rng.standard_normal((5, 3, 3)), info={"normalize": "length"})
    assert repr(h) == "Heads(n_heads=5, d=3, normalize='length')"
    assert repr(Heads(V=h.V, Q=h.Q)) == "Heads(n_heads=5, d=3)"
