"""The Zarr features store (mhla_cli.statistics.files.zarr_store): written by the workers, read back whole or as
tiles, merged from shards, inspected; its provenance and refusals are those of the HDF5 features file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mhla_cli.cli import run
from mhla_cli.errors import InputError
from mhla_cli.io.formats import manifest
from mhla_cli.model import synthetic
from mhla_cli import certify
from mhla_cli.statistics.distributed import tiled_statistics
from mhla_cli.statistics.files import zarr_store
from mhla_cli.statistics.stream import featurize, load_features
from mhla_cli.samples import ReadSpec, samples_of
from mhla_cli.statistics.files.store_location import is_store

distributed = pytest.importorskip("dask.distributed")
zarr = pytest.importorskip("zarr")


@pytest.fixture
def data(tmp_path: Path) -> Path:
    ds, _ = synthetic.generate_teacher(4, 2, 150, "2:7", seed=11)
    path = tmp_path / "data.h5"
    ds.save(path, dtype="float64")
    return path


def spectrum(feats) -> np.ndarray:
    return np.linalg.eigvalsh(feats.solver_stats()[1] / feats.weight)


def test_store_round_trips(local, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cl, client = local
    out = tmp_path / "f.zarr"
    assert run(["featurize", str(data), "--scheduler", cl.scheduler_address, "-o", str(out), "--chunk-size", "31",
                "-q"]) == 0
    assert not [p for p in tmp_path.iterdir() if "tmp-mhla" in p.name]  # written under a temporary name, renamed
    one = featurize(data, spans="off")
    back = load_features(out)  # whole, on one machine
    w1, w2 = spectrum(one), spectrum(back)
    assert np.abs(w1 - w2).max() <= 1e-12 * w1[-1]
    for k in ("token_gram", "last_token_gram", "target_gram", "moments", "target_sum"):
        assert np.abs(getattr(back, k) - getattr(one, k)).max() <= 1e-11 * np.abs(getattr(one, k)).max(), k
    assert back.sample_range == (0, 150) and back.source["fingerprint"] == one.source["fingerprint"]
    # provenance: the attributes of an HDF5 features file
    attrs = dict(zarr.open_group(str(out), mode="r").attrs)
    assert attrs["mhla_kind"] == "features" and attrs["gram_storage"] == "tiles"
    assert "--scheduler" in attrs["mhla_command"] and json.loads(attrs["mhla_inputs"])[0]["fingerprint"]
    # tiles on the cluster equal the tiles accumulated there
    stats = zarr_store.load_tiled(out, client)
    fresh = tiled_statistics.accumulate(data, client, chunk_size=31)
    for key, f in stats.matrix.tiles.items():
        assert np.array_equal(f.result(), fresh.matrix.tiles[key].result())
    # certify reads it with and without a scheduler; inspect says what it is
    assert run(["certify", str(out), "-q"]) == 0
    assert run(["certify", str(out), "--scheduler", cl.scheduler_address, "-q", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["identifiable"]
    assert run(["inspect", str(out), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["valid"] and rep["gram_form"] == "tiles" and rep["d"] == 4 and "basis_gram_lower" in rep["datasets"]
    assert abs(certify(back).lambda_min - certify(one).lambda_min) <= 1e-10 * certify(one).lambda_min


def test_layout_and_bias_terms_round_trip_and_merge(local, tmp_path: Path) -> None:
    """A bidirectional file with the bias terms: the store records the layout and the bias terms (as an HDF5
    features file does), shards of it merge into the whole, and both read back as one machine's statistics."""
    cl, _ = local
    ds, _ = synthetic.generate_teacher(3, 2, 90, "2:6", seed=12,
                                       read=ReadSpec(samples_of(True, "bidirectional"), bias_terms=True))
    path = tmp_path / "enc.h5"
    ds.save(path, dtype="float64")
    opts = ["--scheduler", cl.scheduler_address, "--bias-terms", "--chunk-size", "17", "-q"]
    for i in range(2):
        assert run(["featurize", str(path), "-o", str(tmp_path / f"p{i}.zarr"), "--shard", f"{i}/2"] + opts) == 0
    assert run(["merge", str(tmp_path / "p0.zarr"), str(tmp_path / "p1.zarr"), "-o", str(tmp_path / "m.zarr"),
                "-q"]) == 0
    one = featurize(path, spans="off", bias_terms=True)
    back = load_features(tmp_path / "m.zarr")
    assert back.samples is one.samples and back.samples.attention == "bidirectional" and back.bias_terms
    w1, w2 = spectrum(one), spectrum(back)
    assert np.abs(w1 - w2).max() <= 1e-12 * w1[-1]
    for k in ("target_gram", "moments", "target_sum"):
        assert np.abs(getattr(back, k) - getattr(one, k)).max() <= 1e-11 * np.abs(getattr(one, k)).max(), k


def test_shards_merge_into_the_whole(local, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cl, _ = local
    parts = [tmp_path / f"p{i}.zarr" for i in range(3)]
    for i, p in enumerate(parts):
        assert run(["featurize", str(data), "--scheduler", cl.scheduler_address, "--shard", f"{i}/3", "-o", str(p),
                    "-q"]) == 0
    whole = tmp_path / "whole.zarr"
    assert run(["featurize", str(data), "--scheduler", cl.scheduler_address, "-o", str(whole), "-q"]) == 0
    merged = tmp_path / "m.zarr"
    assert run(["merge", *map(str, parts), "-o", str(merged), "-q"]) == 0
    a, b = load_features(merged), load_features(whole)
    assert np.abs(a.basis_gram - b.basis_gram).max() <= 1e-12 * np.abs(b.basis_gram).max()
    assert a.n_samples == b.n_samples and a.sample_range == (0, 150)
    # the refusals of a merge: a part twice, a gap, a store with an HDF5 part
    assert run(["merge", str(parts[0]), str(parts[0]), "-o", str(tmp_path / "x.zarr")]) == 2
    assert "listed twice" in capsys.readouterr().err
    assert run(["merge", str(parts[0]), str(parts[2]), "-o", str(tmp_path / "x.zarr")]) == 2
    assert "missing samples 50..100" in capsys.readouterr().err
    assert run(["merge", str(parts[0]), str(data), "-o", str(tmp_path / "x.zarr")]) == 2
    assert "of one form" in capsys.readouterr().err
    assert not (tmp_path / "x.zarr").exists()
    # a partial merge is in the whole file's basis: whole on one machine it certifies, tiled it is refused
    partial = tmp_path / "partial.zarr"
    assert run(["merge", str(parts[0]), str(parts[1]), "-o", str(partial), "--allow-partial", "-q"]) == 0
    assert run(["certify", str(partial), "-q"]) == 0
    assert run(["certify", str(partial), "--scheduler", cl.scheduler_address]) == 2
    assert "partial merge" in capsys.readouterr().err


def test_parts_in_other_bases_are_refused(local, data: Path, tmp_path: Path) -> None:
    cl, _ = local
    for i in range(2):
        assert run(["featurize", str(data), "--scheduler", cl.scheduler_address, "--shard", f"{i}/2", "-o",
                    str(tmp_path / f"p{i}.zarr"), "-q"]) == 0
    g = zarr.open_group(str(tmp_path / "p1.zarr"), mode="r+")
    g["basis"][0, 0] = g["basis"][0, 0] * (1 + 1e-15) + 1e-15
    with pytest.raises(InputError, match="store is corrupted: 'basis' differs from what was written"):
        zarr_store.sum_stores([str(tmp_path / "p0.zarr"), str(tmp_path / "p1.zarr")], str(tmp_path / "m.zarr"),
                              {}, {}, (0, 150))
    man = json.loads(g.attrs[manifest.MANIFEST_ATTR])  # a part sealed in another basis
    man["datasets"]["basis"]["digest"] = manifest.digest(np.asarray(g["basis"][...]))
    g.attrs[manifest.MANIFEST_ATTR] = json.dumps(man)
    man["attrs"] = manifest.attrs_digest(dict(g.attrs))
    g.attrs[manifest.MANIFEST_ATTR] = json.dumps(man)
    with pytest.raises(InputError, match="another basis"):
        zarr_store.sum_stores([str(tmp_path / "p0.zarr"), str(tmp_path / "p1.zarr")], str(tmp_path / "m.zarr"),
                              {}, {}, (0, 150))
    assert not (tmp_path / "m.zarr").exists()


def test_corrupt_or_foreign_stores_are_refused(local, data: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    cl, client = local
    out = tmp_path / "f.zarr"
    assert run(["featurize", str(data), "--scheduler", cl.scheduler_address, "-o", str(out), "-q"]) == 0
    g = zarr.open_group(str(out), mode="r+")
    g[zarr_store.TILES][0, 0] = np.nan
    assert run(["inspect", str(out)]) == 2
    assert "NaN or Inf" in capsys.readouterr().err
    assert run(["certify", str(out), "-q"]) == 2
    stats = zarr_store.load_tiled(out, client)
    with pytest.raises(InputError, match="NaN or Inf"):
        stats.matrix.tiles[0, 0].result()
    other = zarr.open_group(str(tmp_path / "o.zarr"), mode="w")
    other.attrs["mhla_kind"] = "model"
    with pytest.raises(InputError, match="not an mhla features store"):
        load_features(tmp_path / "o.zarr")
    with pytest.raises(InputError, match="not a Zarr store"):
        load_features(tmp_path / "none.zarr")


def test_output_rules(local, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                      monkeypatch: pytest.MonkeyPatch) -> None:
    cl, _ = local
    # a store needs a cluster, and holds every feature: one line each, nothing written
    for args, text in ((["-o", str(tmp_path / "f.zarr")], "give --scheduler"),
                       (["-o", str(tmp_path / "f.zarr"), "--scheduler", cl.scheduler_address, "--compact"],
                        "cannot be combined"),
                       (["-o", str(tmp_path / "no" / "f.zarr"), "--scheduler", cl.scheduler_address], "does not exist")):
        assert run(["featurize", str(data), *args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and text in err[0], (args, err)
    # a failure while writing leaves neither the store nor its temporary
    def fail(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(zarr_store, "_commit", fail)
    with pytest.raises(OSError):
        stats = tiled_statistics.accumulate(data, local[1])
        zarr_store.save(stats, tmp_path / "f.zarr")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.h5"]


def test_a_store_at_an_fsspec_url(local, data: Path) -> None:
    """memory:// (the in-process cluster's workers share this process's memory filesystem)."""
    _, client = local
    pytest.importorskip("fsspec")
    stats = tiled_statistics.accumulate(data, client)
    url = "memory://mhla-test/feats.zarr"
    zarr_store.save(stats, url)
    back = load_features(url)
    assert np.abs(spectrum(back) - spectrum(featurize(data, spans="off"))).max() <= 1e-12 * spectrum(back)[-1]
    assert is_store(url) and not is_store("feats.h5")


def test_an_empty_shard_merges(local, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 43 row 8 on a cluster: a shard whose weights are all 0 is a store of zero sums (exit 0) that merges;
    the merge of the shards is the whole file's statistics; the empty store alone is no data (exit 2)."""
    import h5py

    cl, _ = local
    ds, _ = synthetic.generate_teacher(3, 2, 90, "2:6", seed=12)
    path = tmp_path / "w.h5"
    ds.save(path, dtype="float64")
    with h5py.File(path, "r+") as f:
        w = np.ones(90)
        w[30:60] = 0.0
        if "weights" in f:
            del f["weights"]
        f["weights"] = w
    parts = [tmp_path / f"p{i}.zarr" for i in range(3)]
    for i, p in enumerate(parts):
        assert run(["featurize", str(path), "--scheduler", cl.scheduler_address, "--shard", f"{i}/3", "-o", str(p),
                    "-q"]) == 0
    merged = tmp_path / "m.zarr"
    assert run(["merge", *map(str, parts), "-o", str(merged), "-q"]) == 0
    a, b = load_features(merged), featurize(path)
    a.to_basis(b.basis)
    assert a.n_samples == b.n_samples == 60 and a.weight == b.weight
    assert np.abs(a.basis_gram - b.basis_gram).max() <= 1e-12 * np.abs(b.basis_gram).max()
    capsys.readouterr()
    assert run(["certify", str(parts[1])]) == 2
    assert "no samples" in capsys.readouterr().err
    assert run(["merge", str(parts[1]), "-o", str(tmp_path / "e.zarr"), "--allow-partial", "-q"]) == 2
    assert "no sample" in capsys.readouterr().err
