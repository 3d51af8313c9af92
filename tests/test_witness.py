"""`mhla certify --witness`: what the data fail to determine, checked against plain numpy (issue 9, item 3).

The reference is independent of mhla: cubic features materialised with numpy from the definition
(H_(j,k,l) = S[j,k] x_n[l], j <= k, l fastest), losses and predictions computed from them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from _reference import canonical
import pytest
from conftest import write_tokens, unseal

from mhla_cli.model import synthetic
from mhla_cli.cli import run
from mhla_cli.model.forward import forward_heads
from mhla_cli.model.model import Model
from mhla_cli.solve.witness import MIN_FUNCTION_CHANGE, ROUNDING, Witness
from mhla_cli.samples import ReadSpec, samples_of


def np_features(X: np.ndarray) -> np.ndarray:
    """H(X) for one sequence (n, d), from the definition, in plain numpy."""
    d = X.shape[1]
    S = np.einsum("tj,tk->jk", X, X)
    j, k = np.triu_indices(d)  # j ascending, then k >= j ascending
    return np.einsum("p,l->pl", S[j, k], X[-1]).ravel()


def np_design(ds: synthetic.Dataset) -> np.ndarray:
    return np.stack([np_features(ds.sequence(i)) for i in range(ds.n_samples)])


def reference(wit: Witness, ds: synthetic.Dataset) -> dict[str, float]:
    """The witness's numbers recomputed in numpy on the materialised features."""
    F, Y = np_design(ds), ds.targets
    pa, pb = wit.model_a.coef, wit.model_b.coef
    ya, yb = F @ pa.T, F @ pb.T
    Nd = Y.size
    return {"mse_a": float(((ya - Y) ** 2).sum()) / Nd,
            "increase": float(((yb - ya) * (yb + ya - 2 * Y)).sum()) / Nd,  # product form: no cancellation
            "rel_fn": float(np.linalg.norm(pb - pa) / np.linalg.norm(pa)),
            "max_train": float(np.linalg.norm(yb - ya, axis=1).max()),
            "probe": float(np.linalg.norm((pb - pa) @ np_features(wit.tokens))),
            "mean_y2": float((Y**2).mean())}


def certify_witness(ds: synthetic.Dataset, tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str
                    ) -> tuple[dict, Witness]:
    data = tmp_path / "d.h5"
    ds.save(data, dtype="float64")
    w = tmp_path / "w.h5"
    capsys.readouterr()
    assert run(["certify", str(data), "--witness", str(w), "--json", *extra]) == 1
    out = json.loads(capsys.readouterr().out)
    return out, Witness.load(w)


def zero_coordinate_data() -> synthetic.Dataset:
    """Realisable d = 3 data whose token coordinate 2 is always 0: every feature touching it vanishes."""
    ds, teacher = synthetic.generate_teacher(3, 2, 200, "2:8", seed=2)
    X = ds.tokens.copy()
    X[:, 2] = 0.0
    Y = np.stack([sum(V @ X[a:b].T @ X[a:b] @ Q @ X[b - 1] for V, Q in zip(teacher.V, teacher.Q))
                  for a, b in zip(ds.offsets[:-1], ds.offsets[1:])])
    return synthetic.Dataset(tokens=X, offsets=ds.offsets, targets=Y)


@pytest.mark.parametrize("kind", ["assoc", "zero_coordinate", "few"])
def test_indistinguishable_pair_for_non_identifiable_data(kind: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    if kind == "assoc":  # orthogonal keys: sum_j k_j k_j^T = I, collinear features
        ds, _ = synthetic.generate_assoc(2, 500, orthogonal_fraction=1.0, seed=0)
    elif kind == "zero_coordinate":
        ds = zero_coordinate_data()
    else:  # N < psi, noisy labels
        ds, _ = synthetic.generate_teacher(3, 2, 12, 5, noise=0.1, seed=0)
    F = np_design(ds)
    sv = np.linalg.svd(F, compute_uv=False)
    assert sv.size < F.shape[1] or sv[-1] < 1e-12 * sv[0]  # numpy agrees: the features are rank deficient
    out, wit = certify_witness(ds, tmp_path, capsys)
    wj = out["witness"]
    assert wj["kind"] == "indistinguishable" and wj["verified"] and wj["loss_source"] == "data"
    assert wit.info["kind"] == "indistinguishable"
    ref = reference(wit, ds)
    # loss increase: at rounding level by numpy, and the reported number agrees with numpy's
    assert abs(ref["increase"]) <= ROUNDING * wj["loss_resolution"]
    assert abs(wj["loss_increase"] - ref["increase"]) <= 1e-12 * ref["mean_y2"]
    assert wj["loss_resolution"] <= 1e-11 * ref["mean_y2"]  # "rounding level" is a float64 level, not 1e-3
    assert wj["loss_a"] == pytest.approx(ref["mse_a"], rel=1e-6, abs=1e-13 * ref["mean_y2"])
    # a real change of the function: relative p distance as stated, and >= 1e-3
    assert wj["relative_function_distance"] == pytest.approx(ref["rel_fn"], rel=1e-12)
    assert ref["rel_fn"] >= MIN_FUNCTION_CHANGE
    # the stated prediction differences: on the probe (large) and on the training samples (rounding)
    assert wj["prediction_difference"] == pytest.approx(ref["probe"], rel=1e-9)
    assert ref["probe"] > 1e-3 * max(1.0, float(np.linalg.norm(wit.info["pred_a"])))
    assert wj["max_train_prediction_difference"] == pytest.approx(ref["max_train"], rel=1e-6, abs=1e-12)
    assert ref["max_train"] <= 1e-10 * ref["probe"]
    assert "random sequences of length" in wj["probe"]
    # Model.load gives A; the heads of B compute B's function (the witness is an MHLA, not just a coef)
    assert np.array_equal(Model.load(tmp_path / "w.h5").coef, wit.model_a.coef)
    from mhla_cli.model.heads import heads_from_W

    hb, _ = heads_from_W(wit.model_b.W, tol=0)
    yb = wit.model_b.coef @ np_features(wit.tokens)
    assert np.allclose(forward_heads(hb.V, hb.Q, wit.tokens), yb, rtol=1e-9, atol=1e-12)


def issue_data() -> synthetic.Dataset:
    """Identifiable realisable data: lambda_min / lambda_max = 1.6e-2 (issue 9, item 3)."""
    return synthetic.generate_teacher(3, 2, 400, "4:12", seed=0)[0]


@pytest.mark.parametrize("from_features", [False, True])
def test_identifiable_data_above_min_eig_is_not_called_indistinguishable(
        from_features: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ds = issue_data()
    F = np_design(ds)
    lam = np.linalg.eigvalsh(F.T @ F / ds.n_samples)
    assert 1e-2 < lam[0] / lam[-1] < 2e-2  # the issue's regime, by numpy
    lam_own = lam
    lam = canonical(ds.tokens, ds.offsets)["eigenvalues"]  # the certificate's numbers
    data = tmp_path / "d.h5"
    ds.save(data, dtype="float64")
    src = data
    if from_features:
        src = tmp_path / "f.h5"
        assert run(["featurize", str(data), "-o", str(src), "-q"]) == 0
    w = tmp_path / "w.h5"
    capsys.readouterr()
    assert run(["certify", str(src), "--min-eig", f"{1.1 * lam[0]:.6g}", "--witness", str(w), "--json"]) == 1
    captured = capsys.readouterr()
    wj = json.loads(captured.out)["witness"]
    assert wj["kind"] == "weakly_determined"
    assert wj["loss_source"] == ("statistics" if from_features else "data")
    assert "determine the function only weakly" in wj["message"] and "weakly" in captured.err
    wit = Witness.load(w)
    assert wit.info["kind"] == "weakly_determined"
    ref = reference(wit, ds)
    # a change as large as the function, and what it costs, by numpy
    assert ref["rel_fn"] == pytest.approx(1.0, rel=1e-12)
    assert wj["loss_increase"] == pytest.approx(ref["increase"], rel=1e-9)
    assert wj["relative_loss_increase"] == pytest.approx(ref["increase"] / ref["mean_y2"], rel=1e-9)
    assert ref["increase"] > 1e6 * ROUNDING * wj["loss_resolution"]  # far from rounding level
    # exact arithmetic: increase = ||p_A|| ^2 v^T Lambda v (A is the exact optimum), v^T Lambda v >= lambda_min
    # (v a unit direction on the own features; the certificate's threshold chose it canonically)
    v = wit.info["null_direction"]
    lv = float(v @ (F.T @ F) @ v) / ds.n_samples
    assert lam_own[0] * (1 - 1e-9) <= lv <= lam_own[-1]
    assert ref["increase"] == pytest.approx(float(np.sum(wit.model_a.coef**2)) * lv / 3, rel=1e-8)
    # the largest change at rounding level costs at most the stated rounding level (numpy), and is << 1e-3
    c = wj["largest_indistinguishable_change"]
    assert 0 < c < 1e-4
    assert float(np.sum(wit.model_a.coef**2)) * c**2 * lv / 3 <= ROUNDING * wj["loss_resolution"]


def test_no_witness_when_identifiable(teacher_file: tuple[Path, Path, synthetic.Dataset], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    data, _, _ = teacher_file
    w = tmp_path / "w.h5"
    assert run(["certify", str(data), "--witness", str(w)]) == 0
    assert not w.exists()
    assert "no witness" in capsys.readouterr().err


def test_observed_domain_witness_differs_on_observed_inputs(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Orthogonal associative memory: the witness of `--domain observed` differs on inputs whose
    last token is a query (q, 0), the inputs the task actually has."""
    k = 2
    ds, _ = synthetic.generate_assoc(k, 600, orthogonal_fraction=1.0, seed=1)
    out, wit = certify_witness(ds, tmp_path, capsys, "--domain", "observed", "-q")
    wj = out["witness"]
    assert wj["kind"] == "indistinguishable" and "span U" in wj["probe"]
    X = wit.tokens
    assert np.abs(X[-1, k:]).max() < 1e-12  # the last token lies in U_n = span of the queries
    ref = reference(wit, ds)
    assert abs(ref["increase"]) <= ROUNDING * wj["loss_resolution"] <= 1e-11 * ref["mean_y2"]
    assert ref["probe"] == pytest.approx(wj["prediction_difference"], rel=1e-9)
    assert ref["probe"] > 1e-3 * max(np.linalg.norm(wit.info["pred_a"]), 1.0)


def test_witness_failing_its_verification_is_not_written(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """If a recomputation disagrees with the claim (here: a training MSE off by 1e-6), no file."""
    from mhla_cli.solve import witness

    real = witness.train_mse
    calls = {"n": 0}

    def second_call_wrong(feats, coef):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        mse, res = real(feats, coef)
        return (mse + 1e-6 if calls["n"] == 2 else mse), res

    monkeypatch.setattr(witness, "train_mse", second_call_wrong)
    ds, _ = synthetic.generate_assoc(2, 300, orthogonal_fraction=1.0, seed=0)
    data = write_tokens(tmp_path / "d.h5", ds.tokens, ds.offsets, ds.targets)
    w = tmp_path / "w.h5"
    capsys.readouterr()
    assert run(["certify", str(data), "--witness", str(w)]) == 3
    err = capsys.readouterr().err
    assert "failed its own verification" in err and "training MSE increase" in err
    assert not w.exists()


# --------------------------------------------------------------------------------------------
# the witness file: round trip and the rules of Witness.load
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def witness_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Witness]:
    from mhla_cli import certify, featurize
    from mhla_cli.solve.witness import make_witness

    tmp = tmp_path_factory.mktemp("witness")
    few, _ = synthetic.generate_teacher(2, 1, 3, 4, seed=3)  # 3 samples < psi = 6: not identifiable
    data = write_tokens(tmp / "few.h5", few.tokens, few.offsets, few.targets)
    feats = featurize(data)
    wit = make_witness(feats, cert=certify(feats))
    path = tmp / "w.h5"
    wit.save(path, inputs=(data,))
    return path, wit


def _rewrite(src: Path, dst: Path, **changes: np.ndarray | None) -> Path:
    import h5py

    with h5py.File(src, "r") as f, h5py.File(dst, "w") as g:
        for k, v in f.attrs.items():
            g.attrs[k] = v
        unseal(g)
        for k in f:
            if k not in changes:
                g[k] = f[k][()]
        for k, v in changes.items():
            if v is not None:
                g[k] = v
    return dst


def test_witness_file_round_trip(witness_file: tuple[Path, Witness]) -> None:
    path, wit = witness_file
    back = Witness.load(path)
    assert np.array_equal(back.model_a.coef, wit.model_a.coef) and np.array_equal(back.model_b.coef, wit.model_b.coef)
    assert np.array_equal(back.tokens, wit.tokens)
    for k in ("pred_a", "pred_b", "null_direction", "output_direction"):
        assert np.array_equal(back.info[k], wit.info[k]), k
    assert back.info["kind"] == wit.info["kind"] and back.indistinguishable == wit.indistinguishable
    # the stored predictions are the two models' outputs on the probe input
    for m, k in ((back.model_a, "pred_a"), (back.model_b, "pred_b")):
        np.testing.assert_allclose(m.coef @ np_features(back.tokens), back.info[k], rtol=1e-9,
                                   atol=1e-12 * max(1.0, np.abs(back.info[k]).max()))
    assert Model.load(path).coef.shape == wit.model_a.coef.shape  # every model command accepts it


def test_bad_witness_files_are_refused(witness_file: tuple[Path, Witness], tmp_path: Path) -> None:
    from mhla_cli.errors import InputError

    path, wit = witness_file
    cases = {
        "no_coef_b": ({"coef_b": None}, "not a witness file"),
        "coef_b_shape": ({"coef_b": np.ones((2, 5))}, "inconsistent witness datasets"),
        "coef_b_rows": ({"coef_b": np.ones((3, 6))}, "inconsistent witness datasets"),
        "tokens_d": ({"witness_tokens": np.ones((4, 3))}, "inconsistent witness datasets"),
        "tokens_rank": ({"witness_tokens": np.ones(4)}, "inconsistent witness datasets"),
        "no_tokens": ({"witness_tokens": None}, "missing dataset 'witness_tokens'"),
        "no_pred_b": ({"witness_pred_b": None}, "missing dataset 'witness_pred_b'"),
        "nan_coef_b": ({"coef_b": np.full(wit.model_b.coef.shape, np.nan)}, "NaN"),
        "model_a_inconsistent": ({"W": np.eye(4)}, "describe different functions"),
        "W_b_inconsistent": ({"W_b": np.eye(4) * 1e6}, "'W_b' and 'coef_b' describe different functions"),
        "pred_b_shape": ({"witness_pred_b": np.ones(7)}, "'witness_pred_b' has shape"),
        "pred_b_wrong": ({"witness_pred_b": wit.info["pred_b"] + 1.0}, "not the prediction of its model"),
        "null_direction_shape": ({"null_direction": np.ones(2)}, "'null_direction' has shape"),
    }
    for name, (changes, msg) in cases.items():
        with pytest.raises(InputError, match=msg):
            Witness.load(_rewrite(path, tmp_path / f"{name}.h5", **changes))


# --------------------------------------------------------------------------------------------
# the library's rules: what make_witness refuses, and what it leaves of the caller's objects
# --------------------------------------------------------------------------------------------


def test_the_library_refuses_what_the_witness_does_not_support(tmp_path: Path) -> None:
    """The preconditions live in mhla_cli.solve.witness (the CLI words them for its options)."""
    from mhla_cli import featurize
    from mhla_cli.solve.witness import WitnessRefused, check_witness_features, check_witness_input, make_witness

    few, _ = synthetic.generate_teacher(2, 1, 3, 4, seed=3)
    untargeted = write_tokens(tmp_path / "x.h5", few.tokens, few.offsets)
    with pytest.raises(WitnessRefused, match="a witness needs targets") as exc:
        check_witness_input(untargeted)
    assert exc.value.rule == "targets" and exc.value.path == str(untargeted)
    causal, _ = synthetic.generate_teacher(2, 1, 10, "2:6", seed=8, read=ReadSpec(samples_of(True)))
    causal_file = tmp_path / "c.h5"
    causal.save(causal_file)
    with pytest.raises(WitnessRefused, match="per-position data") as exc:
        check_witness_input(causal_file)
    assert exc.value.rule == "per_position"
    feats = featurize(causal_file)
    with pytest.raises(WitnessRefused, match="without normalize") as exc:
        make_witness(feats)  # a Python call is refused too, not only `mhla certify --witness`
    assert exc.value.rule == "normalized"
    normalized = featurize(write_tokens(tmp_path / "n.h5", few.tokens, few.offsets, few.targets), normalize="length")
    with pytest.raises(WitnessRefused):
        check_witness_features(normalized)


def test_make_witness_leaves_the_callers_statistics_and_keeps_the_device(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Statistics on the data's spans are expanded in a copy; the re-certification and the fit run on the
    certificate's device."""
    from mhla_cli import certify, featurize
    from mhla_cli.solve import witness

    ds, _ = synthetic.generate_assoc(2, 300, orthogonal_fraction=1.0, seed=0)
    data = write_tokens(tmp_path / "d.h5", ds.tokens, ds.offsets, ds.targets)
    red = featurize(data, spans="on")
    cert = certify(red)
    block = red.basis_gram.copy()
    seen = []

    def spy(name: str, real):  # type: ignore[no-untyped-def]
        def call(*a, **k):  # type: ignore[no-untyped-def]
            seen.append((name, k.get("device")))
            return real(*a, **{**k, "device": None})  # the device asked for is recorded, numpy runs
        return call

    monkeypatch.setattr(witness, "certify_features", spy("certify", witness.certify_features))
    monkeypatch.setattr(witness, "fit", spy("fit", witness.fit))
    cert.device = "cuda"  # as if certified there: the witness asks for that device
    wit = witness.make_witness(red, data=data, cert=cert)
    assert seen == [("certify", "cuda"), ("fit", "cuda")]
    assert red.on_spans and np.array_equal(red.basis_gram, block) and red.factor_cache.get("full") is not None
    assert wit.info["verified"] and wit.info["kind"] in ("indistinguishable", "weakly_determined")


def test_observed_witness_when_the_spans_are_all_of_r_d(tmp_path: Path) -> None:
    """U = U_n = R^d: the observed domain is the full one, and its null vectors (canonical coordinates) are
    mapped by T^T = M_A^T like any other; taken as own coordinates they would give a wrong
    'weakly_determined' witness (v^T Lambda_D v = 6.3e3 here) whenever the basis A is not I."""
    from mhla_cli import certify, featurize
    from mhla_cli.solve.witness import make_witness

    few, _ = synthetic.generate_teacher(2, 1, 4, 4, seed=3)  # N = 4 < psi = 6
    few = synthetic.Dataset(few.tokens * np.array([1.0, 30.0]), few.offsets, few.targets)  # A far from I
    few.save(tmp_path / "f.h5", dtype="float64")
    feats = featurize(tmp_path / "f.h5")
    cert = certify(feats, domain="observed")
    assert (cert.dim_tokens, cert.dim_last_tokens) == (2, 2) and not cert.identifiable
    wit = make_witness(feats, cert=cert)
    v = wit.info["null_direction"]
    assert wit.indistinguishable and abs(float(v @ feats.gram @ v)) <= 1e-10 * float(np.trace(feats.gram))
