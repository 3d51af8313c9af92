"""mhla_cli.api.estimator.MHLA: the scikit-learn-style estimator against the CLI and plain numpy."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from conftest import relerr, write_tokens

from mhla_cli.model import synthetic
from mhla_cli import MHLA, InputError
from mhla_cli.cli import run
from mhla_cli.model.forward import forward_heads, predict, predict_causal
from mhla_cli.model.model import Model
from mhla_cli.samples import ReadSpec, samples_of


def _features(X: np.ndarray, normalize: str = "none") -> np.ndarray:
    """H(X) (psi,) by the definition (docs/formats.md, "Math"): S[j,k] x_n[l], j <= k, l fastest; plain loops."""
    S = X.T @ X / (X.shape[0] if normalize == "length" else 1)
    d = X.shape[1]
    return np.array([S[j, k] * X[-1, l] for j in range(d) for k in range(j, d) for l in range(d)])


@pytest.fixture(scope="module")
def ragged() -> synthetic.Dataset:
    # d = 3, ragged lengths, label noise (not realisable): the least-squares optimum is unique
    ds, _ = synthetic.generate_teacher(3, 2, 300, seq_len=(3, 25), noise=0.3, seed=4)
    return ds


def _seqs(ds: synthetic.Dataset) -> list[np.ndarray]:
    return [ds.sequence(i) for i in range(ds.n_samples)]


def test_fit_equals_cli_and_plain_lstsq(ragged: synthetic.Dataset, tmp_path: Path) -> None:
    data = write_tokens(tmp_path / "d.h5", ragged.tokens, ragged.offsets, ragged.targets)
    assert run(["fit", str(data), "-o", str(tmp_path / "m.h5"), "-q"]) == 0
    cli = Model.load(tmp_path / "m.h5")
    est = MHLA().fit(_seqs(ragged), ragged.targets)
    assert relerr(est.coef_, cli.coef) < 1e-12
    assert relerr(est.W_, cli.W) < 1e-12
    # independent reference: least squares on the materialised features
    H = np.array([_features(X) for X in _seqs(ragged)])
    p_ref = np.linalg.lstsq(H, ragged.targets, rcond=None)[0].T
    assert relerr(est.coef_, p_ref) < 1e-8
    assert est.n_samples_ == ragged.n_samples == est.features_.n_samples
    assert est.certificate_.identifiable and est.certificate_.domain == "full"
    assert est.coef_.shape == (3, 18) and est.W_.shape == (9, 9)
    # the exported heads compute the fitted function
    assert relerr(est.heads_.coef, est.coef_) < 1e-10


def test_input_forms_agree(ragged: synthetic.Dataset) -> None:
    a = MHLA().fit(_seqs(ragged), ragged.targets)
    b = MHLA().fit(ragged.tokens, ragged.targets, offsets=ragged.offsets)
    assert np.array_equal(a.coef_, b.coef_)
    ds, _ = synthetic.generate_teacher(2, 1, 60, seq_len=7, seed=3)
    c = MHLA().fit(ds.tokens.reshape(60, 7, 2), ds.targets)
    d = MHLA().fit([ds.sequence(i) for i in range(60)], ds.targets)
    assert np.array_equal(c.coef_, d.coef_)


@pytest.mark.parametrize("normalize,per_position", [("none", False), ("length", False), ("length", True)])
def test_three_partial_fits_equal_one_fit(normalize: str, per_position: bool) -> None:
    ds, _ = synthetic.generate_teacher(3, 2, 240, seq_len=(4, 20), noise=0.2, seed=7,
                                       read=ReadSpec(samples_of(per_position), normalize=normalize))
    # different units per coordinate: the basis fixed by chunk 1 must serve every chunk
    scale = np.array([1e-3, 1.0, 50.0])
    tokens = ds.tokens * scale
    seqs = [tokens[ds.offsets[i]:ds.offsets[i + 1]] for i in range(ds.n_samples)]
    y = ds.targets
    one = MHLA(normalize=normalize, per_position=per_position).fit(tokens, y, offsets=ds.offsets)
    parts = MHLA(normalize=normalize, per_position=per_position)
    cuts = [0, 50, 130, 240]
    for a, b in itertools.pairwise(cuts):
        ya = y[ds.offsets[a]:ds.offsets[b]] if per_position else y[a:b]
        parts.partial_fit(seqs[a:b], ya)
    assert relerr(parts.coef_, one.coef_) < 1e-12
    assert parts.n_samples_ == one.n_samples_ == (ds.tokens.shape[0] if per_position else 240)
    assert np.isclose(parts.certificate_.lambda_min, one.certificate_.lambda_min, rtol=1e-10)
    X = seqs[:30]
    assert relerr(parts.predict(X), one.predict(X)) < 1e-12


def test_partial_fit_with_unlike_chunks() -> None:
    # the second chunk's tokens are 100x larger: each chunk in its own whitening, the sum changed to
    # the whitening of all tokens (another whitening than one fit's, which the numbers cannot see)
    ds, _ = synthetic.generate_teacher(2, 1, 100, seq_len=6, noise=0.1, seed=1)
    tokens = ds.tokens.copy()
    tokens[60:] *= 100.0
    est = MHLA().partial_fit(tokens[:60], ds.targets[:10], offsets=ds.offsets[:11])
    est.partial_fit(tokens[60:], ds.targets[10:], offsets=ds.offsets[10:] - 60)
    one = MHLA().fit(tokens, ds.targets, offsets=ds.offsets)
    assert est.n_samples_ == 100
    assert relerr(est.coef_, one.coef_) < 1e-12
    for f in (est.features_, one.features_):  # both in a whitening of all the tokens
        G = f.basis.T @ (f.token_gram / f.n_tokens) @ f.basis
        assert np.abs(G - np.eye(2)).max() < 1e-9
    assert np.isclose(est.certificate_.lambda_min, one.certificate_.lambda_min, rtol=1e-10)


def test_predict_and_score(ragged: synthetic.Dataset) -> None:
    seqs = _seqs(ragged)
    est = MHLA().fit(seqs, ragged.targets)
    pred = est.predict(seqs)
    assert np.array_equal(pred, predict(est.model_, ragged.tokens, ragged.offsets))
    ref = np.array([forward_heads(est.heads_.V, est.heads_.Q, X) for X in seqs])
    assert relerr(pred, ref) < 1e-10
    y = ragged.targets
    # R^2 over all outputs, SST about the mean vector (mhla_cli.model.scores; tests/test_scores.py)
    r2 = 1 - ((y - pred) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()
    assert abs(est.score(seqs, y) - r2) < 1e-12
    assert 0.5 < r2 < 1  # noisy labels: a good but imperfect fit
    # constant targets score 1 when predicted exactly, 0 otherwise (as scikit-learn)
    assert est.score(seqs, np.ones_like(y)) == 0.0


def test_per_position_predicts_every_prefix() -> None:
    ds, _ = synthetic.generate_teacher(2, 1, 80, seq_len=(3, 9), seed=5, read=ReadSpec(samples_of(True)))
    est = MHLA(per_position=True).fit(ds.tokens, ds.targets, offsets=ds.offsets)
    out = est.predict(ds.tokens, offsets=ds.offsets)
    assert out.shape == ds.targets.shape
    assert np.array_equal(out, predict_causal(est.model_, ds.tokens, ds.offsets))
    X = ds.sequence(3)
    ref = np.array([forward_heads(est.heads_.V, est.heads_.Q, X[:t]) for t in range(1, X.shape[0] + 1)])
    assert relerr(out[ds.offsets[3]:ds.offsets[4]], ref) < 1e-10
    assert est.score(ds.tokens, ds.targets, offsets=ds.offsets) > 1 - 1e-12  # realisable


def test_low_rank_fits() -> None:
    ds, teacher = synthetic.generate_teacher(2, 1, 40, seq_len=8, seed=2)
    est = MHLA(heads=1).fit(ds.tokens, ds.targets, offsets=ds.offsets)
    assert est.heads_.n_heads == 1 and np.linalg.matrix_rank(est.W_, tol=1e-9 * np.abs(est.W_).max()) == 1
    assert relerr(est.coef_, teacher.coef) < 1e-6
    nuc = MHLA(nuclear=1e-6).fit(ds.tokens, ds.targets, offsets=ds.offsets)
    assert nuc.model_.info["method"] != "lstsq" and relerr(nuc.coef_, teacher.coef) < 1e-3
    ds, teacher = synthetic.generate_teacher(2, 1, 60, seq_len=8, noise=0.05, seed=2)
    auto = MHLA(heads="auto", cv=3, restarts=2).fit(ds.tokens, ds.targets, offsets=ds.offsets)
    cv = auto.model_.info["cv"]
    assert auto.model_.info["n_folds"] == 3 and cv["chosen"] == 1 == auto.heads_.n_heads
    # interleaved folds (sequence i -> fold i mod cv): the same data in chunks give the same folds
    chunks = MHLA(heads="auto", cv=3, restarts=2)
    for a, b in ((0, 13), (13, 60)):
        chunks.partial_fit(ds.tokens[ds.offsets[a]:ds.offsets[b]], ds.targets[a:b],
                           offsets=ds.offsets[a:b + 1] - ds.offsets[a])
    cv2 = chunks.model_.info["cv"]
    assert [r["heads"] for r in cv2["table"]] == [r["heads"] for r in cv["table"]]
    assert np.allclose([r["cv_mse"] for r in cv2["table"]], [r["cv_mse"] for r in cv["table"]], rtol=1e-8)


def test_get_set_params() -> None:
    est = MHLA(ridge=0.5, domain="observed")
    p = est.get_params(deep=True)
    assert p["ridge"] == 0.5 and p["domain"] == "observed" and p["heads"] is None
    assert MHLA(**p).get_params() == p
    assert est.set_params(ridge=0.0, heads=3) is est
    assert est.ridge == 0.0 and est.heads == 3
    with pytest.raises(ValueError, match="unknown parameter.*alpha"):
        est.set_params(alpha=1.0)
    assert repr(est) == "MHLA(heads=3, domain='observed')"
    # the constructor stores exactly its parameters, by name (scikit-learn's get_params / clone read them)
    import inspect

    assert tuple(inspect.signature(MHLA.__init__).parameters)[1:] == tuple(p)
    assert vars(MHLA(seed=3, cv=4)) == {**MHLA().get_params(), "seed": 3, "cv": 4}


def test_bad_inputs(ragged: synthetic.Dataset) -> None:
    seqs = _seqs(ragged)
    with pytest.raises(InputError, match="not fitted"):
        MHLA().predict(seqs)
    with pytest.raises(InputError, match="need offsets="):
        MHLA().fit(ragged.tokens, ragged.targets)
    with pytest.raises(InputError, match="offsets must start at 0"):
        MHLA().fit(ragged.tokens, ragged.targets, offsets=ragged.offsets + 1)
    with pytest.raises(InputError, match=r"sequences\[1\] has d = 2"):
        MHLA().fit([seqs[0], seqs[1][:, :2]], ragged.targets[:2])
    bad = ragged.tokens.copy()
    bad[5, 1] = np.nan
    with pytest.raises(InputError, match="NaN or Inf"):
        MHLA().fit(bad, ragged.targets, offsets=ragged.offsets)
    with pytest.raises(InputError, match=r"targets have shape \(299, 3\), expected \(300, D_out\)"):
        MHLA().fit(seqs, ragged.targets[:-1])
    with pytest.raises(InputError, match="real numbers"):
        MHLA().fit(np.array([["a", "b"]]), ragged.targets[:1], offsets=[0, 1])
    with pytest.raises(InputError, match="at most one of heads= and nuclear="):
        MHLA(heads=1, nuclear=0.1).fit(seqs, ragged.targets)
    with pytest.raises(InputError, match="unknown domain"):
        MHLA(domain="everywhere").fit(seqs, ragged.targets)
    with pytest.raises(InputError, match="heads must be an integer"):
        MHLA(heads=0).fit(seqs, ragged.targets)
    with pytest.raises(InputError, match="'auto' needs at least 2"):
        MHLA(heads="auto").fit(seqs[:1], ragged.targets[:1])
    est = MHLA().fit(seqs[:100], ragged.targets[:100])
    coef = est.coef_.copy()
    with pytest.raises(InputError, match="this chunk has d = 2 but the earlier chunks have d = 3"):
        est.partial_fit([s[:, :2] for s in seqs[100:]], ragged.targets[100:, :2])
    est.set_params(normalize="length")
    with pytest.raises(InputError, match="call fit"):
        est.partial_fit(seqs[100:], ragged.targets[100:])
    # refused chunks leave the estimator as it was
    assert np.array_equal(est.coef_, coef) and est.n_samples_ == 100
    with pytest.raises(InputError, match="the model has d = 3"):
        est.predict([s[:, :2] for s in seqs[:3]])


def test_to_torch_equals_predict(ragged: synthetic.Dataset) -> None:
    torch = pytest.importorskip("torch")
    for normalize in ("none", "length"):
        ds, _ = synthetic.generate_teacher(3, 2, 120, seq_len=11, noise=0.1, seed=9, read=ReadSpec(normalize=normalize))
        X = ds.tokens.reshape(120, 11, 3)
        est = MHLA(normalize=normalize).fit(X, ds.targets)
        module = est.to_torch()
        with torch.no_grad():
            out = module(torch.from_numpy(X))
            allpos = module(torch.from_numpy(X), all_positions=True)
            causal = module(torch.from_numpy(X), causal=True)
            single = module(torch.from_numpy(X[4]))
        assert out.dtype == torch.float64
        pred = est.predict(X)
        assert relerr(out.numpy(), pred) < 1e-12
        assert relerr(single.numpy(), pred[4]) < 1e-12
        _, outputs = predict(est.model_, X, all_positions=True)
        assert relerr(allpos.numpy().reshape(-1, 3), outputs) < 1e-12
        assert relerr(causal.numpy().reshape(-1, 3), predict_causal(est.model_, X)) < 1e-12
    assert sum(p.numel() for p in module.parameters()) == 2 * est.heads_.n_heads * 9


# --------------------------------------------------------------------------------------------
# scikit-learn: the protocol, tested against scikit-learn itself (skipped without it)
# --------------------------------------------------------------------------------------------


def _np_r2(pred: np.ndarray, y: np.ndarray) -> float:
    return float(1 - ((pred - y) ** 2).sum() / ((y - y.mean(0)) ** 2).sum())


def test_sklearn_clone_params_tags_and_pickle(ragged: synthetic.Dataset) -> None:
    base = pytest.importorskip("sklearn.base")
    import pickle

    from sklearn.utils import get_tags

    est = MHLA(ridge=1e-3, cv=4)
    c = base.clone(est)
    assert c is not est and c.get_params() == est.get_params() and base.is_regressor(est)
    tags = get_tags(est)
    assert tags.estimator_type == "regressor" and tags.target_tags.multi_output
    assert tags.input_tags.three_d_array and not tags.input_tags.two_d_array
    assert repr(c.set_params(ridge=0.5)) == "MHLA(ridge=0.5, cv=4)"
    with pytest.raises(ValueError, match="unknown parameter"):
        c.set_params(alpha=1.0)
    seqs = _seqs(ragged)
    fitted = MHLA().fit(seqs, ragged.targets)
    assert fitted.n_features_in_ == 3 and not hasattr(base.clone(fitted), "model_")
    from sklearn.utils.validation import check_is_fitted

    check_is_fitted(fitted)
    with pytest.raises(Exception, match="not fitted"):
        check_is_fitted(MHLA())
    back = pickle.loads(pickle.dumps(fitted))
    assert np.array_equal(back.predict(seqs), fitted.predict(seqs))
    assert back.features_.gram.shape == (18, 18)  # a lazily derived gram survives pickling
    # a singular fit: its certificate's null vectors (computed on first use) are pickled computed
    few = MHLA().set_params(ridge=0.0)
    with pytest.warns(UserWarning, match="do not determine"):
        few.fit(seqs[:5], ragged.targets[:5])
    back = pickle.loads(pickle.dumps(few))
    assert np.array_equal(back.certificate_.null_vectors, few.certificate_.null_vectors)
    assert back.certificate_.null_vectors.shape[1] == 18 - few.certificate_.rank


def test_sklearn_cross_val_score_and_grid_search(ragged: synthetic.Dataset) -> None:
    ms = pytest.importorskip("sklearn.model_selection")
    seqs = _seqs(ragged)
    y = ragged.targets
    kf = ms.KFold(3)
    scores = ms.cross_val_score(MHLA(), seqs, y, cv=kf)
    # the same numbers by hand: fit on the other folds, R^2 (over all outputs) on the held-out one
    want = []
    for tr, te in kf.split(seqs):
        m = MHLA().fit([seqs[i] for i in tr], y[tr])
        want.append(_np_r2(m.predict([seqs[i] for i in te]), y[te]))
    assert np.allclose(scores, want, rtol=1e-12)
    # a 3-d array slices too (equal lengths)
    ds, _ = synthetic.generate_teacher(2, 1, 60, seq_len=4, noise=0.2, seed=8)
    X3 = ds.tokens.reshape(60, 4, 2)
    assert ms.cross_val_score(MHLA(), X3, ds.targets, cv=3).shape == (3,)
    gs = ms.GridSearchCV(MHLA(), {"ridge": [0.0, 1e-2, 10.0]}, cv=3).fit(seqs, y)
    assert gs.best_params_["ridge"] in (0.0, 1e-2, 10.0) and gs.n_features_in_ == 3
    assert gs.score(seqs, y) == pytest.approx(gs.best_estimator_.score(seqs, y))
    assert gs.cv_results_["mean_test_score"][2] < gs.cv_results_["mean_test_score"][0]  # ridge 10: underfit


def test_sklearn_pipeline_last_step(ragged: synthetic.Dataset) -> None:
    pytest.importorskip("sklearn")
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import FunctionTransformer

    seqs = _seqs(ragged)
    scale = FunctionTransformer(lambda xs: [2.0 * x for x in xs])  # a preprocessing step on sequences
    pipe = make_pipeline(scale, MHLA()).fit(seqs, ragged.targets)
    direct = MHLA().fit([2.0 * x for x in seqs], ragged.targets)
    assert np.allclose(pipe.predict(seqs), direct.predict([2.0 * x for x in seqs]), rtol=1e-9, atol=1e-12)
    assert pipe.score(seqs, ragged.targets) == pytest.approx(direct.score([2.0 * x for x in seqs], ragged.targets))


def test_tags_without_scikit_learn(monkeypatch: pytest.MonkeyPatch) -> None:
    """mhla never imports scikit-learn but for its tags, and has a plain answer without it."""
    import sys

    monkeypatch.setitem(sys.modules, "sklearn", None)  # `import sklearn...` raises ImportError
    monkeypatch.setitem(sys.modules, "sklearn.utils", None)
    tags = MHLA().__sklearn_tags__()
    assert tags["estimator_type"] == "regressor" and tags["target_tags"]["multi_output"]


def test_mhla_does_not_import_sklearn() -> None:
    import subprocess
    import sys

    code = ("import sys, numpy as np, mhla_cli; from mhla_cli.model import synthetic; "
            "ds, _ = synthetic.generate_teacher(2, 1, 30, seq_len=3, seed=1); "
            "mhla_cli.MHLA().fit(ds.tokens.reshape(30, 3, 2), ds.targets).score(ds.tokens.reshape(30, 3, 2), ds.targets); "
            "print(any(m == 'sklearn' or m.startswith('sklearn.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_bad_numpy_options_are_shown_as_numbers() -> None:
    """An option given as a NumPy scalar is named as its number in the message (not np.int64(0))."""
    import numpy as np

    from mhla_cli import MHLA
    from mhla_cli.errors import InputError

    for kw, text in ((dict(heads=np.int64(0)), "got 0"), (dict(ridge=np.float32(-1.0)), "got -1.0")):
        with pytest.raises(InputError, match=text) as err:
            MHLA(**kw).fit([np.ones((2, 2))] * 3, np.ones((3, 2)))
        assert "np." not in str(err.value)
