"""The Model (coef p and its min-norm W), its file, and loading a function (mhla_cli.model.model)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli.model import heads as heads_mod
from mhla_cli.errors import InputError
from mhla_cli.model.heads import Heads
from mhla_cli.model.model import Model, coef_of, load_function, normalize_of
from conftest import unseal


def _model(d: int = 2, seed: int = 0, **info) -> Model:
    rng = np.random.default_rng(seed)
    coef = rng.standard_normal((d, d * d * (d + 1) // 2))
    return Model(coef=coef, W=heads_mod.W_from_p(coef), d=d, info=info)


def _write(path: Path, attrs: dict, **data: np.ndarray) -> Path:
    with h5py.File(path, "w") as f:
        for k, v in attrs.items():
            f.attrs[k] = v
        for k, v in data.items():
            f[k] = v
    return path


def test_model_file_round_trip(tmp_path: Path) -> None:
    info = {"ridge": 0.5, "train_mse": 1.25e-3, "lambda_min": 2e-4, "identifiable": True, "n_samples": 77,
            "method": "lstsq", "normalize": "length", "condition_number": 12.5,
            "rank": 6}  # 'rank' is not one of the saved attributes
    m = _model(3, 1, **info)
    path = tmp_path / "m.h5"
    m.save(path)
    back = Model.load(path)
    assert back.d == 3
    assert np.array_equal(back.coef, m.coef) and np.array_equal(back.W, m.W)
    for k, v in info.items():
        if k == "rank":
            assert k not in back.info
        else:
            assert back.info[k] == v, k
    assert normalize_of(back) == "length"
    with h5py.File(path, "r") as f:
        assert f.attrs["mhla_kind"] == "model" and int(f.attrs["n_features"]) == 18


def test_model_without_W_gets_the_min_norm_W(tmp_path: Path) -> None:
    m = _model(2, 2)
    back = Model.load(_write(tmp_path / "m.h5", {"mhla_kind": "model"}, coef=m.coef))
    np.testing.assert_array_equal(back.W, m.W)
    # an other W with the same function (an antisymmetric part added) is accepted as it is
    rng = np.random.default_rng(3)
    N4 = rng.standard_normal((2, 2, 2, 2))
    W2 = m.W + (N4 - N4.transpose(0, 2, 1, 3)).reshape(4, 4)
    back2 = Model.load(_write(tmp_path / "m2.h5", {"mhla_kind": "model"}, coef=m.coef, W=W2))
    np.testing.assert_array_equal(back2.W, W2)


def test_inconsistent_or_malformed_model_files_are_refused(tmp_path: Path) -> None:
    m = _model(2, 4)
    W = m.W.copy()
    W[0, 0] += 1e-3 * np.abs(m.coef).max()  # p(W) differs from coef in one coefficient
    cases = {
        "mismatch": (dict(coef=m.coef, W=W), "describe different functions"),
        "W_shape": (dict(coef=m.coef, W=np.zeros((3, 3))), r"'W' has shape \(3, 3\)"),
        "psi": (dict(coef=np.ones((2, 7))), "not d\\^2\\(d\\+1\\)/2"),
        "rows": (dict(coef=np.ones((0, 6))), r"'coef' has shape \(0, 6\)"),
        "rank1": (dict(coef=np.ones(6)), r"'coef' has shape \(6,\)"),
        "nan": (dict(coef=np.full((2, 6), np.nan)), "NaN or Inf"),
    }
    for name, (data, msg) in cases.items():
        with pytest.raises(InputError, match=msg):
            Model.load(_write(tmp_path / f"{name}.h5", {"mhla_kind": "model"}, **data))


def test_load_function_by_kind(tmp_path: Path) -> None:
    m = _model(2, 5, normalize="none")
    mp = tmp_path / "m.h5"
    m.save(mp)
    h = Heads(V=np.ones((1, 2, 2)), Q=np.eye(2)[None], info={"normalize": "length"})
    hp = tmp_path / "h.h5"
    h.save(hp)
    fm, fh = load_function(mp), load_function(hp)
    assert isinstance(fm, Model) and np.array_equal(fm.coef, m.coef)
    assert isinstance(fh, Heads) and np.array_equal(fh.V, h.V) and normalize_of(fh) == "length"
    feats = _write(tmp_path / "f.h5", {"mhla_kind": "features"}, gram=np.eye(6))
    with pytest.raises(InputError, match="is a features file, expected a model or heads file"):
        load_function(feats)
    toks = _write(tmp_path / "t.h5", {}, tokens=np.ones((2, 3, 2)))
    with pytest.raises(InputError, match="is a tokens file"):
        load_function(toks)
    with pytest.raises(InputError, match="normalize"):
        load_function(_write(tmp_path / "bad.h5", {"mhla_kind": "model", "normalize": "rms"}, coef=m.coef))


def test_coef_of() -> None:
    rng = np.random.default_rng(6)
    V, Q = rng.standard_normal((2, 2, 3, 3))
    h = Heads(V=V, Q=Q)
    # the heads' coef is p of W = sum_h vec(V_h) vec(Q_h)^T (docs/formats.md), built here with np.outer
    W = sum(np.outer(V[i].reshape(-1), Q[i].reshape(-1)) for i in range(2))
    np.testing.assert_allclose(coef_of(h), heads_mod.p_from_W(W), rtol=0, atol=1e-13)
    m = _model(3, 7)
    assert coef_of(m) is m.coef
    arr = np.arange(18).reshape(3, 6)
    out = coef_of(arr)
    assert out.dtype == np.float64 and np.array_equal(out, arr)
    assert normalize_of(arr) == "none" and normalize_of(m) == "none"


def test_model_repr_is_short_and_shows_no_arrays() -> None:
    rng = np.random.default_rng(0)
    V, Q = rng.standard_normal((2, 3, 3)), rng.standard_normal((2, 3, 3))
    W = heads_mod.W_from_heads(V, Q)
    m = Model(coef=heads_mod.p_from_W(W), W=W, d=3, info={"method": "lstsq", "ridge": 0.5, "train_mse": 1.25e-3})
    assert repr(m) == "Model(d=3, n_features=18, method='lstsq', ridge=0.5, train_mse=0.00125)"


def test_model_files_before_canonical_coef_are_read_and_broken_ones_refused(tmp_path: Path) -> None:
    """A model file without canonical_coef / canonical_basis (written before them) is read and predicts with coef; a file
    with only one of them, or with coef_b in basis disagreeing with coef, is refused."""
    from mhla_cli.model import forward
    from mhla_cli.solve.lstsq import fit
    from mhla_cli.statistics.accumulate import chunk_features

    rng = np.random.default_rng(2)
    X = rng.standard_normal((60, 2)) * np.array([1.0, 30.0])
    off = np.arange(0, 61, 3)
    y = rng.standard_normal((20, 2))
    model = fit(chunk_features(X, off, y, 2), ridge=1e-3)
    path = tmp_path / "m.h5"
    model.save(path)
    old = tmp_path / "old.h5"
    with h5py.File(path) as f, h5py.File(old, "w") as g:
        for k in ("coef", "W"):
            g[k] = f[k][()]
        for k, v in f.attrs.items():
            g.attrs[k] = v
        unseal(g)
    m_old = Model.load(old)
    assert m_old.coef_b is None and m_old.evaluation()[1] is None
    Z = rng.standard_normal((12, 2))
    zoff = np.array([0, 5, 12])
    a, b = forward.predict(m_old, Z, zoff), forward.predict(Model.load(path), Z, zoff)
    assert np.abs(a - b).max() <= 1e-10 * np.abs(b).max()
    for name, change, match in (("canonical_basis", None, "has 'canonical_coef' but no 'canonical_basis'"),
                                ("canonical_coef", lambda c: c * (1 + 1e-6), "describe different functions"),
                                ("canonical_basis", lambda A: np.zeros_like(A), "singular")):
        bad = tmp_path / f"bad_{name}.h5"
        with h5py.File(path) as f, h5py.File(bad, "w") as g:
            for k in f:
                if k == name and change is None:
                    continue
                g[k] = change(f[k][()]) if k == name else f[k][()]
            for k, v in f.attrs.items():
                g.attrs[k] = v
            unseal(g)
        with pytest.raises(InputError, match=match):
            Model.load(bad)


# --------------------------------------------------------------------------------------------
# No model that cannot be read: fit writes only what every reader accepts
# --------------------------------------------------------------------------------------------


def _teacher_file(path: Path, T: np.ndarray | None = None, target_scale: float = 1.0, N: int = 200):
    from mhla_cli.model import synthetic

    ds, _ = synthetic.generate_teacher(3, 2, N, seq_len=(2, 6), seed=3, noise=0.1)
    X = ds.tokens if T is None else ds.tokens @ T
    _write(path, {}, tokens=X, offsets=ds.offsets, targets=ds.targets * target_scale)
    return ds


def test_units_with_a_tiny_coordinate_give_a_readable_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The issue's row: units diag(1, 1, 1e-20). fit said exit 0 and every reader refused the model's
    canonical_basis (diag ~ (1, 1, 1e20)) as singular; the basis is checked by its row-scaled condition
    number, as features files are, and predict gives numpy's least-squares predictions."""
    from _reference import canonical, min_norm_function, predict_canonical
    from mhla_cli.cli import run

    T = np.diag([1.0, 1.0, 1e-20])
    data = tmp_path / "t.h5"
    ds = _teacher_file(data, T)
    out = tmp_path / "m.h5"
    assert run(["fit", str(data), "-o", str(out), "-q"]) == 0
    model = Model.load(out)  # readable
    assert np.linalg.cond(model.basis) > 1e19
    pred = tmp_path / "p.h5"
    assert run(["predict", str(out), str(data), "-o", str(pred), "-q"]) == 0
    ref = canonical(ds.tokens, ds.offsets, ds.targets)  # units cannot change the fitted function
    want = predict_canonical(min_norm_function(ref), ref["A"], [ds.sequence(i) for i in range(ds.n_samples)])
    with h5py.File(pred) as f:
        got = f["predictions"][()]
    assert np.abs(got - want).max() <= 1e-8 * np.abs(want).max()
    assert run(["export-heads", str(out), "-o", str(tmp_path / "h.h5"), "-q"]) == 0


def test_fit_refuses_coefficients_that_overflow(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The issue's row: tokens x 1e-110. The own-coordinate coefficients are ~1e330 (a coefficient scales as
    the targets over three token scales): fit wrote inf and exit 0, every reader said "corrupted". Now fit
    refuses, naming the tokens' scale and the remedy, and writes nothing; x 1e-100 (coefficients ~1e300)
    is still fitted and read."""
    from mhla_cli.cli import run

    data = tmp_path / "t.h5"
    _teacher_file(data, np.eye(3) * 1e-110)
    out = tmp_path / "m.h5"
    capsys.readouterr()
    assert run(["fit", str(data), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "overflow float64" in err and "standard deviations from 9." in err
    assert "e-111 to 1.0" in err and "rescale the tokens" in err and "RuntimeWarning" not in err
    assert not out.exists()
    _teacher_file(data, np.eye(3) * 1e-100)
    assert run(["fit", str(data), "-o", str(out), "-q"]) == 0
    assert np.abs(Model.load(out).coef).max() > 1e290


def test_save_refuses_what_load_would_refuse(tmp_path: Path) -> None:
    """Model.save runs load's checks first (check_readable): a non-finite coef or a singular basis is an
    InputError and no file."""
    m = _model(2)
    bad = Model(coef=m.coef * np.inf, W=m.W, d=2)
    with pytest.raises(InputError, match="'coef' contains NaN or Inf"):
        bad.save(tmp_path / "a.h5")
    assert not (tmp_path / "a.h5").exists()
    sing = Model(coef=m.coef, W=m.W, d=2, coef_b=m.coef, basis=np.array([[1.0, 1.0], [1.0, 1.0]]))
    with pytest.raises(InputError, match="singular"):
        sing.save(tmp_path / "b.h5")
