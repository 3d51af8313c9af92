"""`mhla compare`: same function or not, on data, on the training data and in p-space (issues 5 and 36)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mhla_cli.model import synthetic
from mhla_cli.cli import run
from mhla_cli.model.compare import Distance, compare, function_distance
from mhla_cli.model.heads import Heads


def test_model_vs_teacher_heads(teacher_file: tuple[Path, Path, synthetic.Dataset], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    data, th, ds = teacher_file
    m = tmp_path / "m.h5"
    assert run(["fit", str(data), "-o", str(m), "-q"]) == 0
    capsys.readouterr()
    assert run(["compare", str(m), str(th), "--tol", "1e-8", "--on", str(data), "--json", "-q"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["relative_distance"] < 1e-8 and out["distance"] < 1e-8
    assert out["rms_prediction_difference"] < 1e-8 * out["rms_prediction_b"]
    # a different function: exit 1, and the JSON still says by how much
    other = tmp_path / "o.h5"
    t = Heads.load(th)
    Heads(V=t.V, Q=t.Q * 1.01).save(other)
    assert run(["compare", str(other), str(th), "--tol", "1e-3", "--json", "-q"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["relative_distance"] == pytest.approx(0.01, rel=1e-9)
    assert out["same"] is False and out["judged_by"] == "coefficients"  # two heads files: no data
    # a model and heads: judged on the model's training data (its Lambda~), and --on by the outputs there
    capsys.readouterr()
    assert run(["compare", str(other), str(m), "--tol", "1e-3", "--json", "-q"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["judged_by"] == "training data" and out["measured_on"] == "b" and out["function_change"] > 1e-3
    assert run(["compare", str(other), str(m), "--tol", "1e-3", "--on", str(data), "--json", "-q"]) == 1
    on = json.loads(capsys.readouterr().out)
    assert on["judged_by"] == "data" and on["relative_rms_difference"] == pytest.approx(out["function_change"],
                                                                                      rel=1e-9)


def test_compare_on_data_evaluates_a_model_where_it_was_solved(tmp_path: Path) -> None:
    """Length-1 sequences with a rotated direction of std 1e-6 (tests/test_forward.py's extreme case): the
    model's coefficients on the tokens' own features lose ~cond(A)^3 eps, so compare --on evaluates it in its
    canonical coordinates, as predict does: it equals the teacher there to 1e-8."""
    from mhla_cli.model.forward import predict
    from mhla_cli.solve.lstsq import fit
    from mhla_cli.statistics.accumulate import chunk_features

    rng = np.random.default_rng(41)
    d, N = 3, 420
    R = np.linalg.qr(rng.standard_normal((d, d)))[0]

    def squashed(n: int) -> np.ndarray:
        Z = rng.standard_normal((n, d))
        Z[:, -1] *= 1e-6
        return Z @ R.T

    X = squashed(N)
    off = np.arange(N + 1)
    teacher = synthetic.random_teacher(d, 2, rng)
    model = fit(chunk_features(X, off, predict(teacher, X, off), d))
    Z = squashed(40)
    path = tmp_path / "z.h5"
    import h5py

    with h5py.File(path, "w") as f:
        f["tokens"], f["offsets"] = Z, np.arange(41)
    res = compare(model, teacher, tol=1e-8, on=path)
    assert res["same"] and res["relative_rms_difference"] < 1e-8


def test_gauge_invariance() -> None:
    rng = np.random.default_rng(0)
    t = synthetic.random_teacher(3, 2, rng)
    c = np.array([2.0, -0.5])[:, None, None]
    perm = Heads(V=(t.V * c)[::-1], Q=(t.Q / c)[::-1])  # rescaled and reordered heads
    res = compare(perm, t, tol=1e-12)
    assert res["same"] and res["relative_distance"] < 1e-14


def test_different_d_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(1)
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    synthetic.random_teacher(3, 1, rng).save(a)
    synthetic.random_teacher(4, 1, rng).save(b)
    capsys.readouterr()
    assert run(["compare", str(a), str(b)]) == 2
    assert "different d" in capsys.readouterr().err


@pytest.mark.parametrize("wide", [False, True])
def test_rectangular_heads_compare_on_their_coef(wide: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """V (H, d_out, d): the distance of the (d_out, psi) coefs, or (`wide`: no coef formed) of the
    d x d products (heads.coef_inner); reference: the coefs materialised in numpy."""
    from mhla_cli.model import compare as compare_mod
    from mhla_cli.model import forward
    from mhla_cli.errors import InputError
    from mhla_cli.model.heads import coef_of_heads

    rng = np.random.default_rng(3)
    a = Heads.from_arrays(rng.standard_normal((2, 2, 4)), rng.standard_normal((2, 4, 4)))
    b = Heads.from_arrays(a.V + 1e-3 * rng.standard_normal(a.V.shape), a.Q)
    if wide:
        monkeypatch.setattr(compare_mod, "DIRECT_COEF_BYTES", 0)
        monkeypatch.setattr(forward.evaluate, "DIRECT_COEF_BYTES", 0)
    pa, pb = coef_of_heads(a.V, a.Q), coef_of_heads(b.V, b.Q)
    res = compare(a, b, tol=1e-6)
    assert res["distance"] == pytest.approx(float(np.linalg.norm(pa - pb)), rel=1e-6)
    assert res["norm_b"] == pytest.approx(float(np.linalg.norm(pb)), rel=1e-12)
    assert res["same"] is False and compare(a, a)["same"] is True
    with pytest.raises(InputError, match="nothing to compare"):
        compare(a, Heads.from_arrays(rng.standard_normal((1, 3, 4)), rng.standard_normal((1, 4, 4))))


def test_function_distance_is_a_record() -> None:
    """function_distance returns a Distance; its to_dict holds compare's first four keys."""
    a, b = np.ones((2, 10)), np.zeros((2, 10))
    dist = function_distance(a, 2 * a)
    assert isinstance(dist, Distance) and dist.distance == pytest.approx(np.sqrt(20)) and dist.relative_distance == 0.5
    assert list(dist.to_dict()) == ["distance", "relative_distance", "norm_a", "norm_b"]
    assert dist.to_dict() == {k: v for k, v in compare(a, 2 * a).items() if k in dist.to_dict()}
    assert function_distance(a, b).relative_distance == float("inf") and function_distance(b, b).relative_distance == 0
    assert repr(dist).startswith("Distance(distance=4.472")


def test_training_data_that_do_not_determine_the_function_are_said_so(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A minimum-norm fit of data that do not certify and the teacher agree on the training data (exit 0) but
    not elsewhere: the verdict is on the training data, and a warning says those data leave room."""
    data, th, m = tmp_path / "a.h5", tmp_path / "t.h5", tmp_path / "m.h5"
    assert run(["generate", "assoc", "-o", str(data), "--keys", "2", "--n-samples", "500", "--orthogonal-fraction",
                "1.0", "--dtype", "float64", "--teacher-out", str(th), "-q"]) == 0
    assert run(["fit", str(data), "-o", str(m), "-q"]) == 0
    capsys.readouterr()
    assert run(["compare", str(m), str(th), "--json"]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert out["judged_by"] == "training data" and out["measured_on"] == "a"
    assert out["training_data_identifiable"] is False and out["function_change"] < 1e-10
    assert out["relative_distance"] > 1e-2 and "do not determine the function" in cap.err


def _windows(rng: np.random.Generator, n_seq: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    off = np.concatenate([[0], np.cumsum(rng.integers(3, 7, size=n_seq))]).astype(np.int64)
    return rng.standard_normal((int(off[-1]), d)), off


def _write(path: Path, X: np.ndarray, off: np.ndarray, Y: np.ndarray, attention: str | None = None) -> Path:
    import h5py

    with h5py.File(path, "w") as f:
        f["tokens"], f["offsets"], f["targets"] = X, off, Y
        if attention is not None:
            f.attrs["attention"] = attention
    return path


def _numpy_outputs(coef: np.ndarray, X: np.ndarray, off: np.ndarray, layout: str) -> np.ndarray:
    """coef . H(S, x) at every sample of `layout` on materialised features (tests/_reference.py)."""
    import _reference as ref

    pp = layout != "last"
    return np.stack([coef @ ref.features(Xs) for Xs, _, _ in ref.samples(X, off, pp, None,
                                                                         attention=layout if pp else "causal")])


@pytest.mark.parametrize("layout", ["bidirectional", "causal"])
def test_compare_on_scores_every_position_of_a_per_position_model(tmp_path: Path, layout: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 43: A fitted at every position (an encoder's windows, or a decoder's prefixes), B at the last position
    only, on 12 windows it interpolates (N < psi): they agree at the last positions of those windows and nowhere
    else. `compare --on` scores the positions A's layout scores: the relative RMS difference there is numpy's on
    the materialised features, the verdict "different" (exit 1), and it agrees with the function change."""
    from mhla_cli.model.forward import predict_samples
    from mhla_cli.model.model import Model
    from mhla_cli.samples import LAST, named

    rng = np.random.default_rng(43)
    d = 3
    teacher = synthetic.random_teacher(d, 2, rng)
    X, off = _windows(rng, 60, d)
    big = _write(tmp_path / "big.h5", X, off, predict_samples(teacher, X, off, named(layout)), layout)
    Z, zoff = _windows(rng, 12, d)
    small = _write(tmp_path / "small.h5", Z, zoff, predict_samples(teacher, Z, zoff, LAST))
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    assert run(["fit", str(big), "-o", str(a), "-q"]) == 0
    assert run(["fit", str(small), "-o", str(b), "-q"]) == 0
    capsys.readouterr()
    ma, mb = Model.load(a), Model.load(b)
    ya, yb = _numpy_outputs(ma.coef, Z, zoff, layout), _numpy_outputs(mb.coef, Z, zoff, layout)
    want = np.sqrt(np.mean((ya - yb) ** 2)) / np.sqrt(np.mean(yb ** 2))
    last = zoff[1:] - 1
    assert np.abs(ya[last] - yb[last]).max() <= 1e-9 * np.abs(yb).max() and want > 0.05  # agree at the last only
    for first, second in ((b, a), (a, b)):
        assert run(["compare", str(first), str(second), "--on", str(small), "--json"]) == 1
        cap = capsys.readouterr()
        res = json.loads(cap.out)
        assert res["same"] is False and res["judged_by"] == "data" and res["scored_as"] == [layout]
        assert res["n_scored"] == int(zoff[-1]) and res["n_samples"] == 12
        yref = yb if second == b else ya
        rel = np.sqrt(np.mean((ya - yb) ** 2)) / np.sqrt(np.mean(yref ** 2))
        assert abs(res["relative_rms_difference"] - rel) <= 1e-9 * rel
        assert "different functions" in cap.err and "every" in cap.err
    # two last-token models score the last tokens: B against itself refitted, the same function
    assert run(["compare", str(b), str(b), "--on", str(small), "--json", "-q"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["scored_as"] == ["last"] and res["n_scored"] == 12 and res["relative_rms_difference"] == 0


def test_the_verdict_never_contradicts_the_function_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    """A and B differ only on features that --on DATA never excite (its tokens' last coordinate is 0): equal
    outputs there, but a function change of 0.3 on B's training data. The verdict is "different" (exit 1) and
    says why; the data's own numbers are kept."""
    from mhla_cli.model.model import Model
    from mhla_cli.model.heads import W_from_p

    rng = np.random.default_rng(7)
    d = 2
    X, off = _windows(rng, 80, d)
    data = _write(tmp_path / "d.h5", X, off, rng.standard_normal((80, d)))
    b = tmp_path / "b.h5"
    assert run(["fit", str(data), "-o", str(b), "-q"]) == 0
    mb = Model.load(b)
    k = 2 * d + 1  # S[1,1] x_1 (pairs (0,0), (0,1), (1,1), l fastest): zero where x[:, 1] = 0
    coef = mb.coef.copy()
    coef[:, k] += 0.5 * np.abs(coef).max()
    import dataclasses

    ma = dataclasses.replace(mb, coef=coef, W=W_from_p(coef), coef_b=None, basis=None)
    a = tmp_path / "a.h5"
    ma.save(a)
    Z, zoff = _windows(rng, 10, d)
    Z[:, 1] = 0.0
    on = _write(tmp_path / "z.h5", Z, zoff, np.zeros((10, d)))
    capsys.readouterr()
    assert run(["compare", str(a), str(b), "--on", str(on), "--json"]) == 1
    cap = capsys.readouterr()
    res = json.loads(cap.out)
    assert res["relative_rms_difference"] <= 1e-12 and res["function_change"] > 1e-2
    assert res["same"] is False and res["training_data_differ"] is True and "differ by" in cap.err
    # the data and the training data agree: the same
    assert run(["compare", str(b), str(b), "--on", str(on), "--json", "-q"]) == 0
    assert json.loads(capsys.readouterr().out)["training_data_differ"] is False
