"""The shipped sample data behave as documented in sample_data/README.md."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mhla_cli import Heads, certify, export_heads, featurize, fit, predict
from mhla_cli.cli import run

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data"


def test_certify_gate_on_sample_data() -> None:
    assert run(["certify", str(SAMPLE / "teacher.h5"), "-q"]) == 0
    assert run(["certify", str(SAMPLE / "assoc_orthogonal.h5"), "-q"]) == 1
    assert run(["certify", str(SAMPLE / "assoc_orthogonal.h5"), "-q", "--domain", "observed"]) == 1


def test_pipeline_recovers_sample_teacher() -> None:
    feats = featurize(SAMPLE / "teacher.h5")
    assert (feats.d, feats.n_samples, feats.n_tokens) == (4, 2048, 204800)
    assert certify(feats).identifiable
    teacher = Heads.load(SAMPLE / "teacher_heads.h5")
    model = fit(feats)
    assert np.linalg.norm(model.coef - teacher.coef) < 1e-9 * np.linalg.norm(teacher.coef)
    heads = export_heads(model)
    X = np.random.default_rng(0).standard_normal((4, 300, 4))  # longer than any training sequence
    ref = predict(teacher, X)
    np.testing.assert_allclose(predict(heads, X), ref, rtol=1e-7, atol=1e-7 * np.abs(ref).max())


def test_orthogonal_sample_fits_but_is_not_determined() -> None:
    feats = featurize(SAMPLE / "assoc_orthogonal.h5")
    cert = certify(feats, domain="observed")
    assert not cert.identifiable and cert.lambda_min < cert.numerical_tolerance
    assert fit(feats).info["train_mse"] <= 1e-12
