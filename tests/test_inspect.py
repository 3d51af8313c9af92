"""`inspect_file` (mhla_cli.api.inspect): kinds, shapes and validity of every kind of mhla file."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli.model import synthetic
from mhla_cli import certify, export_heads, featurize, fit
from mhla_cli.model.forward import predict_file
from mhla_cli.api.inspect import inspect_file
from mhla_cli.solve.probes import certify_probes
from mhla_cli.solve.witness import make_witness
from conftest import unseal


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("inspect")
    ds, _ = synthetic.generate_teacher(2, 1, 30, "2:6", seed=1)
    p = {k: tmp / f"{k}.h5" for k in ("tokens", "features", "model", "heads", "predictions", "probes", "witness",
                                       "few")}
    ds.save(p["tokens"], dtype="float64")
    feats = featurize(p["tokens"])
    feats.save(p["features"], inputs=(p["tokens"],))
    model = fit(feats)
    model.save(p["model"])
    export_heads(model).save(p["heads"])
    predict_file(model, p["tokens"], p["predictions"], all_positions=True)
    rng = np.random.default_rng(2)
    with h5py.File(tmp / "probe_tokens.h5", "w") as f:
        f["tokens"] = rng.standard_normal((5, 3, 2))
    certify_probes(feats, tmp / "probe_tokens.h5").save(p["probes"])
    few, _ = synthetic.generate_teacher(2, 1, 3, 4, seed=3)  # 3 samples < psi = 6: not identifiable
    few.save(p["few"], dtype="float64")
    ffew = featurize(p["few"])
    make_witness(ffew, cert=certify(ffew)).save(p["witness"])
    return p


EXPECT = {
    "tokens": ("tokens", {"layout": "ragged", "d": 2, "n_samples": 30, "has_targets": True,
                          "per_position": False, "has_weights": False}),
    "features": ("features", {"d": 2, "n_samples": 30, "n_features": 6, "has_targets": True, "normalize": "none",
                              "sample_range": [0, 30]}),
    "model": ("model", {"d": 2, "n_features": 6}),
    "heads": ("heads", {"d": 2}),
    "predictions": ("predictions", {"d": 2, "n_samples": 30}),
    "probes": ("probes", {"n_samples": 5}),
    "witness": ("model", {"d": 2, "n_features": 6}),
}


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_inspect_valid_files(files: dict[str, Path], name: str) -> None:
    kind, fields = EXPECT[name]
    path = files[name]
    rep = inspect_file(path)
    assert rep["kind"] == kind and rep["valid"] is True and rep["error"] is None, rep
    for k, v in fields.items():
        assert rep[k] == v, k
    # every dataset with the shape plain h5py reports
    with h5py.File(path, "r") as f:
        assert set(rep["datasets"]) == set(f)
        for ds, meta in rep["datasets"].items():
            assert meta["shape"] == list(f[ds].shape) and meta["dtype"] == str(f[ds].dtype)
    if name != "tokens":
        assert rep["attrs"]["mhla_kind"] == kind and "inputs" in rep["provenance"]


def test_inspect_reports_counts(files: dict[str, Path]) -> None:
    with h5py.File(files["tokens"], "r") as f:
        T = f["tokens"].shape[0]
    assert inspect_file(files["tokens"])["n_tokens"] == T
    assert inspect_file(files["predictions"])["n_tokens"] == T
    assert inspect_file(files["heads"])["n_heads"] >= 1
    with h5py.File(files["probes"], "r") as f:
        assert inspect_file(files["probes"])["n_undetermined"] == f["undetermined"].shape[0]
    with h5py.File(files["witness"], "r") as f:
        assert "coef_b" in f and int(f.attrs["witness"]) == 1


def _copy_with(src: Path, dst: Path, **changes: np.ndarray | None) -> Path:
    with h5py.File(src, "r") as f, h5py.File(dst, "w") as g:
        for k, v in f.attrs.items():
            g.attrs[k] = v
        unseal(g)  # an edited file of format 6 is refused as corrupted first (tests/test_corruption.py)
        for k in f:
            if k not in changes:
                g[k] = f[k][()]
        for k, v in changes.items():
            if v is not None:
                g[k] = v
    return dst


def test_predictions_whose_offsets_do_not_describe_outputs_are_invalid(files: dict[str, Path], tmp_path: Path
                                                                       ) -> None:
    with h5py.File(files["predictions"], "r") as f:
        off = f["offsets"][()]
        outputs = f["outputs"][()]
    bad = {
        "not_from_0": off + 1,
        "last_not_T": np.append(off[:-1], off[-1] - 1),
        "not_increasing": np.where(np.arange(off.size) == 3, off[2], off),  # sequence 2 empty; ends at T
        "too_short": off[:-1],
    }
    for name, o in bad.items():
        rep = inspect_file(_copy_with(files["predictions"], tmp_path / f"{name}.h5", offsets=o))
        assert rep["valid"] is False and rep["kind"] == "predictions", name
        assert "'offsets' do not describe 'outputs'" in rep["error"] and str(tmp_path) in rep["error"], name
    rep = inspect_file(_copy_with(files["predictions"], tmp_path / "cols.h5", outputs=outputs[:, :1]))
    assert rep["valid"] is False and "'outputs' has shape" in rep["error"]
    rep = inspect_file(_copy_with(files["predictions"], tmp_path / "nooff.h5", offsets=None))
    assert rep["valid"] is False and "missing dataset 'offsets'" in rep["error"]


def test_invalid_files_of_other_kinds(files: dict[str, Path], tmp_path: Path) -> None:
    with h5py.File(files["probes"], "r") as f:
        n = f["residual"].shape[0]
    rep = inspect_file(_copy_with(files["probes"], tmp_path / "p.h5", undetermined=np.array([n])))
    assert rep["valid"] is False and "do not match" in rep["error"]
    rep = inspect_file(_copy_with(files["model"], tmp_path / "m.h5", W=np.eye(4)))
    assert rep["valid"] is False and "describe different functions" in rep["error"]
    (tmp_path / "junk.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)
    rep = inspect_file(tmp_path / "junk.h5")
    assert rep["valid"] is False and rep["error"]


def test_the_manifest_is_said_in_a_few_words(tmp_path, capsys) -> None:
    """`mhla inspect` names the manifest's hash and what it covers in one short line; --json keeps the checksums."""
    import json as _json

    from mhla_cli.cli import run

    path = Path(__file__).resolve().parent.parent / "sample_data" / "teacher_heads.h5"
    assert run(["inspect", str(path)]) == 0
    line = [x for x in capsys.readouterr().err.splitlines() if "@mhla_manifest" in x]
    assert line == ["  @mhla_manifest = sha256 of 2 datasets and the header (--json: the checksums)"]
    assert run(["inspect", str(path), "--json"]) == 0
    attrs = _json.loads(capsys.readouterr().out)["attrs"]
    assert len(_json.loads(attrs["mhla_manifest"])["datasets"]) == 2
