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


def test_rectangular_heads_round_trip_and_have_a_rectangular_coef(tmp_path: Path) -> None:
    from mhla_cli.model.heads import coef_of_heads

    V, Q = _rect()
    h = Heads.from_arrays(V, Q)
    assert (h.d, h.d_out, h.n_heads) == (3, 2, 2)
    h.save(tmp_path / "h.h5")
    back = Heads.load(tmp_path / "h.h5")
    assert np.array_equal(back.V, V) and np.array_equal(back.Q, Q)
    # the (d_out, psi) coef of heads of any output width (tests/test_output_width.py fits them)
    assert np.array_equal(back.coef, coef_of_heads(V, Q))
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


# --------------------------------------------------------------------------------------------
# factored heads (export-heads --unreduce) and to_torch on padded batches
# --------------------------------------------------------------------------------------------

# Relative error of two float64 evaluations of the same function in different orders of summation.
ROUNDING = 1e-12


def _relerr(a: np.ndarray, b: np.ndarray) -> float:
    scale = max(float(np.abs(b).max()), 1e-300)
    return float(np.abs(np.asarray(a) - np.asarray(b)).max()) / scale


def _factored(seed: int, D: int = 7, d: int = 3, E: int = 5, H: int = 2, bias: bool = True
              ) -> tuple[Heads, Heads, np.ndarray, np.ndarray]:
    """(factored heads of D-dim tokens and E-dim outputs through d coordinates, the reduced heads, P, U)."""
    from mhla_cli.model import synthetic
    from mhla_cli.model.reduce import Reduction, unreduce_heads

    rng = np.random.default_rng(seed)
    P = np.linalg.qr(rng.standard_normal((D, d)))[0]
    U = np.linalg.qr(rng.standard_normal((E, d)))[0]
    small = synthetic.random_teacher(d, H, rng, bias=bias)
    return unreduce_heads(small, Reduction(P, U)), small, P, U


def _ref_output(h: Heads, X: np.ndarray, t: int, normalize: str) -> np.ndarray:
    """numpy: the heads' output at query t of the window X (every row a token), loops over the tokens
    (tests/_reference.py); the zero terms for heads without bias terms."""
    import _reference as ref

    H, d_out, d = h.V.shape
    if h.bias_terms:
        return ref.biased_heads_output(h.V, h.Q, h.value_bias, h.score_key, h.score_query, h.score_bias, X, t,
                                       normalize)
    return ref.biased_heads_output(h.V, h.Q, np.zeros((H, d_out)), np.zeros((H, d)), np.zeros((H, d)),
                                   np.zeros(H), X, t, normalize)


def test_factored_heads_dense_is_the_same_function() -> None:
    """dense(): V = U V_h P^T, Q = P Q_h P^T and the bias terms mapped (U b_v, P c, P r); on wide tokens X
    both give U times the reduced heads' output on X P (numpy loops over the tokens)."""
    fac, small, P, U = _factored(0)
    assert fac.factored and (fac.d, fac.d_out, fac.reduced_dim) == (7, 5, 3) and "factored through d = 3" in repr(fac)
    dense = fac.dense()
    assert not dense.factored and dense.V.shape == (2, 5, 7) and dense.Q.shape == (2, 7, 7)
    np.testing.assert_allclose(dense.V, np.einsum("ij,hjk,lk->hil", U, small.V, P), rtol=0, atol=1e-14)
    X = np.random.default_rng(1).standard_normal((6, 7))
    for t in range(6):
        want = U @ _ref_output(small, X @ P, t, "none")
        assert _relerr(_ref_output(dense, X, t, "none"), want) < ROUNDING
    with pytest.raises(InputError, match="factored heads"):
        fac.coef  # noqa: B018
    assert dense.dense() is dense


def test_factored_heads_predict_at_the_reduced_cost() -> None:
    """forward.predict of factored heads (HeadsFn with the maps: the tokens to X P, the outputs back by U) gives
    the dense heads' outputs, last token and every position, with and without --normalize length."""
    from mhla_cli.model.forward import direct, predict

    for normalize in ("none", "length"):
        fac, small, P, U = _factored(2)
        fac.info["normalize"] = small.info["normalize"] = normalize
        fn = direct(fac)
        assert fn is not None and fn[0].shape == (2, 3, 4) and fn[2].shape == (8, 4)  # tokens (x, 1): the constant
        X = np.random.default_rng(3).standard_normal((3, 5, 7))
        last, every = predict(fac, X, all_positions=True)
        for b in range(3):
            assert _relerr(last[b], _ref_output(fac.dense(), X[b], 4, normalize)) < ROUNDING
            for t in range(5):
                assert _relerr(every[5 * b + t], U @ _ref_output(small, X[b] @ P, t, normalize)) < ROUNDING


def test_coef_inner_of_factored_heads_is_the_product_of_the_dense_coefs() -> None:
    """coef_inner with the maps (products of the reduced widths) = <p_A, p_B> of the dense heads' coefs; also
    with different maps on each side, and through compare (its distance of two factored heads)."""
    from mhla_cli.model.compare import function_distance
    from mhla_cli.model.heads import coef_inner, coef_of_heads

    a, _, Pa, Ua = _factored(4, bias=False)
    b, _, Pb, Ub = _factored(5, bias=False)
    da, db = a.dense(), b.dense()
    for x, y, mx, my in ((a, b, (Pa, Ua), (Pb, Ub)), (a, a, (Pa, Ua), (Pa, Ua))):
        want = float(np.sum(coef_of_heads(x.dense().V, x.dense().Q) * coef_of_heads(y.dense().V, y.dense().Q)))
        assert coef_inner(x.V, x.Q, y.V, y.Q, mx, my) == pytest.approx(want, rel=1e-12)
    pa, pb = coef_of_heads(da.V, da.Q), coef_of_heads(db.V, db.Q)
    dist = function_distance(a, b)
    assert dist.distance == pytest.approx(float(np.linalg.norm(pa - pb)), rel=1e-10)
    assert dist.norm_b == pytest.approx(float(np.linalg.norm(pb)), rel=1e-12)
    # the same maps: A - B in one set of reduced heads; a tiny change is resolved (no cancellation of norms)
    c = Heads(V=a.V * (1 + 1e-9), Q=a.Q.copy(), info=dict(a.info), P=a.P, U=a.U)
    pc = coef_of_heads(c.dense().V, c.dense().Q)
    assert function_distance(c, a).distance == pytest.approx(float(np.linalg.norm(pc - pa)), rel=1e-5)
    assert function_distance(a, da).distance <= 1e-12 * float(np.linalg.norm(pa))  # factored vs its dense form


def _padded(windows: list[np.ndarray], n: int, side: str, rng: np.random.Generator
            ) -> tuple[np.ndarray, np.ndarray]:
    """A batch (B, n, D) of the windows padded on `side` with random junk (it must not count), and the mask."""
    D = windows[0].shape[1]
    X = rng.standard_normal((len(windows), n, D)) * 100.0
    mask = np.zeros((len(windows), n))
    for b, w in enumerate(windows):
        k = w.shape[0]
        sl = slice(n - k, n) if side == "left" else slice(0, k)
        X[b, sl], mask[b, sl] = w, 1.0
    return X, mask


@pytest.mark.parametrize("factored", [False, True])
@pytest.mark.parametrize("normalize", ["none", "length"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_to_torch_on_padded_batches_gives_the_unpadded_windows(side: str, normalize: str, factored: bool) -> None:
    """to_torch(attention_mask= / lengths=): on a padded batch the last-token, causal and every-position outputs
    of each window are numpy's on the unpadded window (loops over its tokens; the bias terms included); padded
    positions output 0, and so does a window without tokens. Without the mask the padding counts (it must)."""
    torch = pytest.importorskip("torch")
    from mhla_cli.model import synthetic

    rng = np.random.default_rng(7)
    if factored:
        h, small, P, U = _factored(8)
        D = h.d

        def ref_out(X: np.ndarray, t: int) -> np.ndarray:
            return U @ _ref_output(small, X @ P, t, normalize)
    else:
        h = synthetic.random_teacher(4, 2, rng, bias=True)
        D = h.d

        def ref_out(X: np.ndarray, t: int) -> np.ndarray:
            return _ref_output(h, X, t, normalize)
    h.info["normalize"] = normalize
    if factored:
        small.info["normalize"] = normalize
    lens = [6, 3, 1, 0, 5]
    n = max(lens)
    windows = [rng.standard_normal((k, D)) for k in lens]
    X, mask = _padded(windows, n, side, rng)
    m = h.to_torch()
    kw = {"attention_mask": torch.from_numpy(mask)}
    with torch.no_grad():
        Xt = torch.from_numpy(X)
        last = m(Xt, **kw).numpy()
        causal = m(Xt, causal=True, **kw).numpy()
        every = m(Xt, all_positions=True, **kw).numpy()
        if side == "right":  # lengths: the first lengths[b] positions
            by_len = m(Xt, all_positions=True, lengths=torch.tensor(lens)).numpy()
            assert np.array_equal(by_len, every)
            assert np.array_equal(m(Xt, lengths=torch.tensor(lens)).numpy(), last)
        unmasked = m(Xt).numpy()
    for b, (w, k) in enumerate(zip(windows, lens)):
        pos = np.flatnonzero(mask[b])
        if k == 0:
            assert not last[b].any() and not causal[b].any() and not every[b].any()
            continue
        assert _relerr(last[b], ref_out(w, k - 1)) < ROUNDING
        for i, t in enumerate(pos):
            assert _relerr(every[b, t], ref_out(w, i)) < ROUNDING
            assert _relerr(causal[b, t], ref_out(w[:i + 1], i)) < ROUNDING
        pad = np.flatnonzero(mask[b] == 0)
        assert not every[b, pad].any() and not causal[b, pad].any()
    # the padding is data without the mask: the answer changes (the mask is what takes it out)
    assert _relerr(unmasked[1], last[1]) > 1e-3


def test_to_torch_mask_refusals() -> None:
    torch = pytest.importorskip("torch")
    from mhla_cli.model import synthetic

    m = synthetic.random_teacher(3, 1, np.random.default_rng(0)).to_torch()
    X = torch.zeros(2, 4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="at most one of attention_mask and lengths"):
        m(X, attention_mask=torch.ones(2, 4), lengths=torch.tensor([4, 4]))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        m(X, attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="0 \\(padding\\) and 1"):
        m(X, attention_mask=torch.full((2, 4), 0.5))
    with pytest.raises(ValueError, match="lengths must have shape"):
        m(X, lengths=torch.tensor([5, 1]))
    # one window (n, d) with its mask (n,)
    one = m(X[0], attention_mask=torch.ones(4))
    assert one.shape == (3,)
