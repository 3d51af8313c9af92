"""Issue 14's cases (trust II): each against an independent numpy reference (tests/_reference.py)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest

from _reference import canonical, min_norm_function, predict_own, ratio, teacher_p
from mhla_cli.statistics import basis
from mhla_cli.model import synthetic
from mhla_cli import MHLA
from mhla_cli.cli import run
from mhla_cli.model.forward import forward_heads
from mhla_cli import certify
from mhla_cli.solve.lstsq import fit
from mhla_cli.statistics.accumulate import chunk_features


def rotation(d: int, seed: int) -> np.ndarray:
    return np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))[0]


def teacher_targets(teacher, tokens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return np.stack([forward_heads(teacher.V, teacher.Q, tokens[a:b]) for a, b in zip(offsets[:-1], offsets[1:])])


def write(path: Path, tokens: np.ndarray, offsets: np.ndarray, targets: np.ndarray | None = None) -> Path:
    with h5py.File(path, "w") as f:
        f["tokens"], f["offsets"] = tokens, offsets
        if targets is not None:
            f["targets"] = targets
    return path


def small_direction(n: int, d: int, std: float, seed: int) -> np.ndarray:
    """Gaussian tokens with one rotated (not axis-aligned) direction of standard deviation `std`."""
    rng = np.random.default_rng(seed)
    Z = rng.standard_normal((n, d))
    Z[:, -1] *= std
    return Z @ rotation(d, seed + 100)


def cli_json(capsys, args: list[str]) -> tuple[int, dict]:
    code = run(args)
    out = capsys.readouterr().out.strip()
    return code, (json.loads(out.splitlines()[-1]) if out else {})


# ------------------------------------------------------------------------------- case 1
def test_case1_length_one_sequences_with_a_tiny_direction_never_certify(tmp_path: Path, capsys) -> None:
    d, N = 4, 2000
    rng = np.random.default_rng(1)
    teacher = synthetic.random_teacher(d, 2, rng)
    tokens = small_direction(N, d, 1e-6, 1)
    offsets = np.arange(N + 1)
    y = teacher_targets(teacher, tokens, offsets)
    data = write(tmp_path / "d.h5", tokens, offsets, y)
    code, rep = cli_json(capsys, ["certify", str(data), "--json", "-q"])
    assert code == 1 and not rep["identifiable"]
    # symmetric cubic tensors: rank <= C(d + 2, 3) = 20 < psi = 40, as the reference says
    ref = canonical(tokens, offsets, y)
    assert rep["rank"] == int((ref["eigenvalues"] > 40 * 2.2e-16 * ref["eigenvalues"][-1]).sum()) == 20
    code, m = cli_json(capsys, ["fit", str(data), "-o", str(tmp_path / "m.h5"), "--json", "-q"])
    assert code == 0 and not m["identifiable"]
    assert m["train_mse"] <= max(m["mse_resolution"], 1e-20)  # realisable: exact on the data
    # length-1 probes determined, length-5 probes not
    for n, want in ((1, 1.0), (5, 0.0)):
        Z = small_direction(50 * n, d, 1.0, 7)
        probes = write(tmp_path / f"p{n}.h5", Z, np.arange(0, 50 * n + 1, n))
        code, pr = cli_json(capsys, ["certify", str(data), "--on", str(probes), "--json", "-q"])
        assert 1 - pr["n_undetermined"] / pr["n_probes"] == want, (n, pr)


# ------------------------------------------------------------------------------- case 2
def test_case2_a_distribution_shift_the_sample_misses(tmp_path: Path, capsys) -> None:
    d, N, n = 4, 40000, 10
    rng = np.random.default_rng(2)
    teacher = synthetic.random_teacher(d, 2, rng)
    tokens = rng.standard_normal((N * n, d))
    in_sample = np.zeros(N, dtype=bool)
    for a, b in basis.sample_blocks(N, N * n):
        in_sample[a:b] = True
    assert 0.3 < in_sample.mean() < 0.9
    tokens[np.repeat(in_sample, n), 3] *= 1e-4
    offsets = np.arange(0, N * n + 1, n)
    y = teacher_targets(teacher, tokens, offsets)
    data = write(tmp_path / "d.h5", tokens, offsets, y)
    code, f = cli_json(capsys, ["featurize", str(data), "-o", str(tmp_path / "f.h5"), "--json", "-q"])
    assert code == 0 and f["basis_passes"] == 2  # the estimate was checked against all the tokens, and redone
    code, rep = cli_json(capsys, ["certify", str(data), "--json", "-q"])
    ref = canonical(tokens, offsets, y)
    assert code == 0 and rep["identifiable"] and rep["rank"] == 40
    assert ratio(rep["lambda_min"], ref["eigenvalues"][0]) < 1e-8
    assert ratio(rep["lambda_max"], ref["eigenvalues"][-1]) < 1e-8
    code, m = cli_json(capsys, ["fit", str(data), "-o", str(tmp_path / "m.h5"), "--json", "-q"])
    with h5py.File(tmp_path / "m.h5") as f:
        p = f["coef"][()]
    assert code == 0 and ratio(p, teacher_p(teacher)) < 1e-8


# ------------------------------------------------------------------------------- case 3
def test_case3_partial_fit_whatever_the_first_chunk_holds() -> None:
    d = 3
    rng = np.random.default_rng(3)
    teacher = synthetic.random_teacher(d, 2, rng)
    chunks = [small_direction(200 * 6, d, 1e-4, 3)] + [rng.standard_normal((200 * 6, d)) for _ in range(4)]
    off = np.arange(0, 200 * 6 + 1, 6)
    est = MHLA()
    for X in chunks:
        est.partial_fit(X, teacher_targets(teacher, X, off), offsets=off)
    assert est.certificate_.identifiable
    assert ratio(est.coef_, teacher_p(teacher)) < 1e-8
    Xt = rng.standard_normal((300 * 5, d))
    offt = np.arange(0, 300 * 5 + 1, 5)
    assert est.score(Xt, teacher_targets(teacher, Xt, offt), offsets=offt) > 1 - 1e-12
    one = MHLA().fit(np.concatenate(chunks), np.concatenate([teacher_targets(teacher, X, off) for X in chunks]),
                     offsets=np.arange(0, 1000 * 6 + 1, 6))
    assert ratio(est.certificate_.lambda_min, one.certificate_.lambda_min) < 1e-9


# ------------------------------------------------------------------------------- case 4
@pytest.mark.parametrize("std", [1e-3, 1e-4, 1e-5])
def test_case4_accuracy_on_identifiable_data_with_a_small_rotated_direction(std: float) -> None:
    """p within 1e-6 of the teacher at cond 1e3, and never far from the ideal: whiten the tokens with
    the exact G^(-1/2), materialise the canonical features, numpy lstsq, map back (p = p_b M_A
    carries cond(A)^3, so p itself degrades as the direction shrinks, whatever the solver)."""
    d, N, n = 4, 400, 8
    rng = np.random.default_rng(4)
    teacher = synthetic.random_teacher(d, 2, rng)
    tokens = small_direction(N * n, d, std, 4)
    offsets = np.arange(0, N * n + 1, n)
    y = teacher_targets(teacher, tokens, offsets)
    model = fit(chunk_features(tokens, offsets, y, d))
    assert model.info["identifiable"]
    ref = canonical(tokens, offsets, y)
    p_ideal = basis.coef_from_basis(ref["A"], min_norm_function(ref, rcond=1e-14))
    p_true = teacher_p(teacher)
    err, ideal = ratio(model.coef, p_true), ratio(p_ideal, p_true)
    assert err <= 10 * ideal + 1e-12, (err, ideal)
    if std == 1e-3:
        assert err < 1e-6
    # the function on inputs like the data's is as accurate as the teacher's own rounding allows
    Zs = [small_direction(7, d, std, 40 + i) for i in range(20)]
    want = np.stack([forward_heads(teacher.V, teacher.Q, Z) for Z in Zs])
    assert ratio(predict_own(model.coef, Zs), want) <= 10 * ratio(predict_own(p_ideal, Zs), want) + 1e-12


# ------------------------------------------------------------------------------- case 5
def test_case5_the_reported_number_does_not_move_with_the_units() -> None:
    ds, _ = synthetic.generate_teacher(3, 2, 400, "4:12", seed=11)
    T = rotation(3, 5) @ np.diag([1.0, 30.0, 1e3]) @ rotation(3, 6)
    a = certify(chunk_features(ds.tokens, ds.offsets, ds.targets, 3))
    b = certify(chunk_features(ds.tokens @ T, ds.offsets, ds.targets, 3))
    ref = canonical(ds.tokens, ds.offsets)["eigenvalues"]
    assert ratio(a.lambda_min, ref[0]) < 1e-9 and ratio(a.lambda_max, ref[-1]) < 1e-9
    assert ratio(b.lambda_min, a.lambda_min) < 1e-6 and ratio(b.lambda_max, a.lambda_max) < 1e-6


# ------------------------------------------------------------------------------- case 6
def test_case6_ridge_in_the_units_of_lambda_max(tmp_path: Path, capsys) -> None:
    ds, teacher = synthetic.generate_teacher(3, 2, 400, "4:12", seed=12)
    for scale in (1.0, 1e-3):
        X = ds.tokens * scale
        y = ds.targets * scale**3  # the same function in the new units
        data = write(tmp_path / "d.h5", X, ds.offsets, y)
        _, c = cli_json(capsys, ["certify", str(data), "--json", "-q"])
        ridge = 1e-6 * c["lambda_max"]
        code, m = cli_json(capsys, ["fit", str(data), "-o", str(tmp_path / "m.h5"), "--ridge", f"{ridge:.17g}",
                                    "--json", "-q"])
        assert code == 0
        with h5py.File(tmp_path / "m.h5") as f:
            p = f["coef"][()]
        Zs = [X[a:b] for a, b in zip(ds.offsets[:-1], ds.offsets[1:])][:50]
        pred = predict_own(p, Zs)
        # a ridge of 1e-6 lambda_max shrinks the fit by about 1e-6 / (lambda_min / lambda_max)
        assert ratio(pred, y[:50]) < 1e-6 * c["lambda_max"] / c["lambda_min"] * 10, scale


# ------------------------------------------------------------------------------- case 9
def test_case9_estimator_warns_where_the_cli_warns() -> None:
    ds, _ = synthetic.generate_teacher(3, 2, 10, "3:5", seed=13)  # N = 10 < psi = 18
    with pytest.warns(UserWarning, match="do not determine the function"):
        MHLA().fit(ds.tokens, ds.targets, offsets=ds.offsets)
    ds, _ = synthetic.generate_teacher(3, 2, 200, "3:5", seed=13)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MHLA().fit(ds.tokens, ds.targets, offsets=ds.offsets)  # identifiable: no warning
