"""The least-squares fit on the sufficient statistics (Algorithm 1, step 1) and the training MSE from them
(mhla_cli.solve.lstsq)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mhla_cli import featurize
from mhla_cli.errors import InputError
from mhla_cli.model import synthetic
from mhla_cli.solve.lstsq import fit, train_mse


def test_realisable_data_fit_exactly_and_train_mse_agrees(tmp_path: Path) -> None:
    ds, _ = synthetic.generate_assoc(3, 2000, orthogonal_fraction=1.0, seed=0)  # not identifiable, realisable
    ds.save(tmp_path / "d.h5")
    feats = featurize(tmp_path / "d.h5")
    model = fit(feats)
    assert model.info["method"] == "lstsq" and not model.info["identifiable"]
    assert model.info["train_mse"] < 1e-12
    mse, resolution = train_mse(feats, model.coef)
    assert mse == pytest.approx(model.info["train_mse"], abs=10 * resolution)


def test_ridge_shrinks_and_is_validated(tmp_path: Path) -> None:
    ds, _ = synthetic.generate_teacher(2, 1, 200, "3:6", noise=0.1, seed=9)
    ds.save(tmp_path / "d.h5")
    feats = featurize(tmp_path / "d.h5")
    plain, ridged = fit(feats), fit(feats, ridge=1.0)
    assert plain.info["identifiable"] and ridged.info["ridge"] == 1.0
    assert np.linalg.norm(ridged.coef_b) < np.linalg.norm(plain.coef_b)
    assert ridged.info["condition_number"] < plain.info["condition_number"]
    with pytest.raises(InputError, match="ridge must be a finite number >= 0"):
        fit(feats, ridge=-1.0)
