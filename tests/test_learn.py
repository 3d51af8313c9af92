"""The fit and head-export dispatch (mhla_cli.api.learn: `mhla_cli.fit`, `mhla_cli.export_heads`)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

import mhla_cli
from mhla_cli.solve import lstsq
from mhla_cli.model import synthetic
from mhla_cli import featurize
from mhla_cli.errors import InputError
from mhla_cli.statistics.features import Features
from mhla_cli.samples import ReadSpec


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def one_head(tmp_path_factory: pytest.TempPathFactory) -> tuple[Features, np.ndarray]:
    """Statistics of realisable data from a 1-head d = 2 teacher, and the teacher's p."""
    ds, teacher = synthetic.generate_teacher(2, 1, 120, "2:8", seed=4)
    path = tmp_path_factory.mktemp("learn") / "d.h5"
    ds.save(path, dtype="float64")
    return featurize(path), teacher.coef


def test_fit_equals_solve_fit(one_head: tuple[Features, np.ndarray]) -> None:
    feats, p = one_head
    a, b = mhla_cli.fit(feats), lstsq.fit(feats)
    assert np.array_equal(a.coef, b.coef) and np.array_equal(a.W, b.W)
    assert rel(a.coef, p) <= 1e-8  # identifiable, realisable: the teacher's function
    ar, br = mhla_cli.fit(feats, ridge=0.1), lstsq.fit(feats, ridge=0.1)
    assert np.array_equal(ar.coef, br.coef) and ar.info["ridge"] == 0.1
    assert rel(ar.coef, p) > 1e-6  # the ridge does change the answer


def test_factorised_fit_with_one_head(one_head: tuple[Features, np.ndarray]) -> None:
    feats, p = one_head
    model = mhla_cli.fit(feats, heads=1, restarts=2)
    s = np.linalg.svd(model.W, compute_uv=False)
    assert s[1] <= 1e-10 * s[0]  # W has rank 1
    assert rel(model.coef, p) <= 1e-6
    assert model.info["n_heads"] == 1 and model.info["normalize"] == "none"


def test_fit_argument_rules(one_head: tuple[Features, np.ndarray]) -> None:
    feats, _ = one_head
    for kw in ({"heads": "auto"}, {"nuclear": "auto"}):
        with pytest.raises(InputError, match="folds"):
            mhla_cli.fit(feats, **kw)  # 'auto' without per-fold statistics
    with pytest.raises(InputError, match="ridge"):
        mhla_cli.fit(feats, ridge=0.1, heads=1)
    with pytest.raises(InputError, match="ridge"):
        mhla_cli.fit(feats, ridge=0.1, nuclear=1e-3)
    with pytest.raises(InputError):
        mhla_cli.fit(feats, heads=1, nuclear=1e-3)
    with pytest.raises(InputError, match="ridge"):
        mhla_cli.fit(feats, ridge=-1.0)


def test_export_heads_dispatch(one_head: tuple[Features, np.ndarray]) -> None:
    feats, p = one_head
    model = mhla_cli.fit(feats)
    fewest = mhla_cli.export_heads(model, fewest=True)
    assert fewest.n_heads == 1 and rel(fewest.coef, p) <= 1e-8
    svd = mhla_cli.export_heads(model)  # plain SVD of the min-norm W: more heads, same function
    assert svd.n_heads > 1 and rel(svd.coef, model.coef) <= 1e-12
    two = mhla_cli.export_heads(model, max_heads=2)
    assert two.n_heads == 2 and two.info["max_heads"] == 2
    with pytest.raises(InputError, match="fewest and max_heads"):
        mhla_cli.export_heads(model, fewest=True, max_heads=2)


@pytest.mark.parametrize("normalize", ["none", "length"])
def test_normalisation_is_propagated(tmp_path: Path, normalize: str) -> None:
    ds, teacher = synthetic.generate_teacher(2, 1, 60, "2:6", seed=5, read=ReadSpec(normalize=normalize))
    path = tmp_path / "d.h5"
    ds.save(path, dtype="float64")
    feats = featurize(path, normalize=normalize)
    model = mhla_cli.fit(feats)
    assert model.info["normalize"] == normalize
    assert rel(model.coef, teacher.coef) <= 1e-8
    for kw in ({}, {"fewest": True}, {"max_heads": 1}):
        h = mhla_cli.export_heads(model, **kw)
        assert h.info["normalize"] == normalize, kw
    # predictions of the exported heads use the normalisation: they reproduce the targets
    h = mhla_cli.export_heads(model, fewest=True)
    yhat = mhla_cli.predict(h, ds.tokens, ds.offsets)
    assert rel(yhat, ds.targets) <= 1e-8


def test_fit_and_export_rules_are_the_librarys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The rules of a fit / export request live in api.learn (RequestError and its `rule`); `mhla fit` and
    `mhla export-heads` word them in their flags (cli.fit.FLAG_WORDS): one line, exit 2, no output."""
    from mhla_cli.api.learn import (RULES, RequestError, check_export_options, check_fit_file, check_fit_options,
                                    check_fit_targets, needs_folds)
    from mhla_cli.cli import run
    from mhla_cli.cli.fit import FLAG_WORDS

    assert set(FLAG_WORDS) == set(RULES)
    assert needs_folds(ridge="auto") and needs_folds(heads="auto") and not needs_folds(0.5, 2, None)
    for kw in ({"ridge": 0.1, "heads": 1}, {"ridge": "auto", "nuclear": 1e-3}):
        with pytest.raises(RequestError, match="ridge penalty") as exc:
            check_fit_options(**kw)
        assert exc.value.rule == "ridge_with_lowrank"
    check_fit_options(ridge=0.0, heads=2)
    with pytest.raises(RequestError) as exc:
        check_export_options(max_heads=2, fewest=True)
    assert exc.value.rule == "fewest_with_max_heads"
    ds, _ = synthetic.generate_teacher(2, 1, 60, "2:6", seed=5)
    data, bare, feats = tmp_path / "d.h5", tmp_path / "bare.h5", tmp_path / "f.h5"
    ds.save(data, dtype="float64")
    with h5py.File(bare, "w") as f:
        f["tokens"], f["offsets"] = ds.tokens, ds.offsets
    featurize(data).save(feats)
    with pytest.raises(InputError, match="has no 'targets'"):
        check_fit_targets(bare)
    with pytest.raises(RequestError) as exc:
        check_fit_file(feats, heads="auto")
    assert exc.value.rule == "auto_without_folds" and exc.value.path == str(feats)
    with pytest.raises(RequestError) as exc:
        check_fit_file(data, ridge="auto", normalize="length")
    assert exc.value.rule == "auto_with_normalize"
    check_fit_file(data, ridge="auto")
    out = tmp_path / "m.h5"
    for args, rule, path in ((["fit", str(data), "--ridge", "1", "--heads", "2"], "ridge_with_lowrank", None),
                             (["fit", str(feats), "--nuclear", "auto"], "auto_without_folds", feats),
                             (["fit", str(data), "--heads", "auto", "--normalize", "length"], "auto_with_normalize",
                              None),
                             (["export-heads", str(data), "--fewest", "--max-heads", "2"], "fewest_with_max_heads",
                              None)):
        capsys.readouterr()
        assert run([*args, "-o", str(out if args[0] == "fit" else tmp_path / "h.h5")]) == 2
        want = FLAG_WORDS[rule] if path is None else f"{path}: {FLAG_WORDS[rule]}"
        assert capsys.readouterr().err.strip() == f"mhla: error: {want}"
        assert not out.exists()
