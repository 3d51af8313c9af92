"""HDF5 kinds, versions, provenance and atomic writes (mhla_cli.io.formats)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli.io import formats
from mhla_cli.model import synthetic
from mhla_cli._version import __version__
from mhla_cli.errors import InputError, UnverifiedFileWarning
from mhla_cli.model.heads import Heads
from mhla_cli.model.model import Model
from mhla_cli.cli import run

from conftest import unseal


def _write(path: Path, attrs: dict | None = None, **data: np.ndarray) -> Path:
    with h5py.File(path, "w") as f:
        for k, v in (attrs or {}).items():
            f.attrs[k] = v
        for k, v in data.items():
            f[k] = v
    return path


UNSTORABLE = np.array([object(), object()], dtype=object)  # h5py has no HDF5 type for Python objects


@pytest.mark.parametrize("existing", [False, True])
def test_failed_write_leaves_no_temp_file_and_keeps_the_output(tmp_path: Path, existing: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out.h5"
    during: list[str] = []
    fill = formats.writing._fill

    def spy(*args, **kwargs):  # what the directory holds while the file is being written
        during.extend(os.listdir(tmp_path))
        return fill(*args, **kwargs)

    monkeypatch.setattr(formats.writing, "_fill", spy)
    if existing:
        _write(out, {"marker": 7, "mhla_kind": "model"}, old=np.arange(5))  # an earlier model: replaceable
        before = out.read_bytes()
    listing = sorted(os.listdir(tmp_path))
    with pytest.raises(TypeError, match="Object dtype"):  # raised inside the write, after the temp file exists
        formats.write_file(out, "model", {"coef": np.ones((2, 6)), "bad": UNSTORABLE})
    assert any(n.startswith(".out.h5.") and n.endswith(".tmp-mhla") for n in during)  # the temp file existed
    assert sorted(os.listdir(tmp_path)) == listing  # neither a temp file nor a partial output
    if existing:
        assert out.read_bytes() == before
        with h5py.File(out, "r") as f:
            assert int(f.attrs["marker"]) == 7 and list(f) == ["old"]
    else:
        assert not out.exists()


def test_successful_write_replaces_the_output(tmp_path: Path) -> None:
    out = _write(tmp_path / "out.h5", {"marker": 7, "mhla_kind": "model"}, old=np.arange(5))
    formats.write_file(out, "model", {"coef": np.ones((2, 6)), "skipped": None}, {"d": 2, "none_attr": None})
    with h5py.File(out, "r") as f:
        assert sorted(f) == ["coef"] and "marker" not in f.attrs and "none_attr" not in f.attrs
        assert f.attrs["mhla_kind"] == "model" and int(f.attrs["d"]) == 2
    assert sorted(os.listdir(tmp_path)) == ["out.h5"]


def test_output_path_rules(tmp_path: Path) -> None:
    inp = _write(tmp_path / "in.h5", tokens=np.ones((2, 3, 2)))
    with pytest.raises(InputError, match="overwrite an input"):
        formats.write_file(inp, "model", {"coef": np.ones((2, 6))}, inputs=(inp,))
    with pytest.raises(InputError, match="does not exist"):
        formats.write_file(tmp_path / "nodir" / "o.h5", "model", {"coef": np.ones((2, 6))})
    with pytest.raises(InputError, match="is a directory"):
        formats.write_file(tmp_path, "model", {"coef": np.ones((2, 6))})
    with pytest.raises(ValueError):
        formats.write_file(tmp_path / "o.h5", "nonsense", {"x": np.ones(2)})


def test_an_output_replaces_only_an_earlier_output_of_its_kind(tmp_path: Path) -> None:
    """written_kind by format (HDF5's mhla_kind, heads' "mhla-heads" metadata in .npz / .safetensors, a PNG's
    Software chunk) and check_replaceable: a user's file or another kind is refused, untouched."""
    users = _write(tmp_path / "users.h5", {}, tokens=np.ones((2, 3, 2)))  # no mhla_kind
    model = _write(tmp_path / "model.h5", {"mhla_kind": "model"}, coef=np.ones((2, 6)))
    np.savez(tmp_path / "h.npz", V=np.ones(2), format=np.array("mhla-heads"))
    np.savez(tmp_path / "other.npz", V=np.ones(2), format=np.array("mhla-headz"))
    (tmp_path / "s.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20 + b"tEXtSoftware\x00mhla 1.0" + b"\0" * 9)
    (tmp_path / "t.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20 + b"tEXtSoftware\x00Matplotlib" + b"\0" * 9)
    header = b'{"__metadata__": {"format": "mhla-heads"}}'
    (tmp_path / "h.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    (tmp_path / "notes.txt").write_text("mine")
    kinds = {p.name: formats.written_kind(p) for p in sorted(tmp_path.iterdir())}
    assert kinds == {"h.npz": "heads", "h.safetensors": "heads", "model.h5": "model", "notes.txt": None,
                     "other.npz": None, "s.png": "plot", "t.png": None, "users.h5": None}
    formats.check_replaceable(model, "model")
    formats.check_replaceable(tmp_path / "h.npz", "heads")
    formats.check_replaceable(tmp_path / "absent.h5", "model")
    with pytest.raises(InputError, match="is an mhla model file, not a features file"):
        formats.write_file(model, "features", {"gram": np.ones((2, 2))})
    before = users.read_bytes()
    with pytest.raises(InputError, match="not a file mhla wrote; it is left as it is"):
        formats.write_file(users, "tokens", {"tokens": np.ones((2, 3, 2))})
    assert users.read_bytes() == before
    with pytest.raises(InputError, match="overwrite an input"):  # an input inside a directory named as output
        formats.check_output_path(tmp_path / "new.h5", (tmp_path / "new.h5" / "inner.h5",))


def test_newer_format_version_is_refused(tmp_path: Path) -> None:
    coef = np.zeros((2, 6))
    newer = _write(tmp_path / "new.h5", {"mhla_kind": "model", "mhla_format_version": formats.FORMAT_VERSION + 1},
                   coef=coef)
    for read in (formats.kind_of, Model.load):
        with pytest.raises(InputError, match=f"format version {formats.FORMAT_VERSION + 1}.*upgrade"):
            read(newer)
    same = _write(tmp_path / "same.h5", {"mhla_kind": "model", "mhla_format_version": formats.FORMAT_VERSION},
                  coef=coef)
    assert formats.kind_of(same) == "model"
    with pytest.raises(InputError, match="corrupted: it has no manifest"):  # this format's files carry one
        Model.load(same)
    prev = _write(tmp_path / "prev.h5", {"mhla_kind": "model", "mhla_format_version": formats.MANIFEST_FORMAT - 1},
                  coef=coef)
    with pytest.warns(UnverifiedFileWarning, match="no manifest"):
        assert Model.load(prev).d == 2
    older = _write(tmp_path / "old.h5", {"mhla_kind": "model", "mhla_format_version": 1}, coef=coef)
    assert Model.load(older).d == 2


@pytest.mark.parametrize("name,kind", [("gram", "features"), ("coef", "model"), ("V", "heads"),
                                       ("tokens", "tokens"), ("predictions", "predictions")])
def test_kind_detected_from_datasets_without_attributes(tmp_path: Path, name: str, kind: str) -> None:
    assert formats.kind_of(_write(tmp_path / "f.h5", **{name: np.ones((2, 2)), "other": np.ones(1)})) == kind


def test_kind_rules(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not an mhla file.*found other, stuff"):
        formats.kind_of(_write(tmp_path / "a.h5", other=np.ones(1), stuff=np.ones(1)))
    with pytest.raises(InputError, match="unknown mhla_kind 'banana'"):
        formats.kind_of(_write(tmp_path / "b.h5", {"mhla_kind": "banana"}, tokens=np.ones((1, 1, 1))))
    # the attribute wins over the datasets
    assert formats.kind_of(_write(tmp_path / "c.h5", {"mhla_kind": "heads"}, coef=np.ones(1))) == "heads"
    with h5py.File(_write(tmp_path / "d.h5", {"mhla_kind": "heads"}, V=np.ones(1)), "r") as f:
        with pytest.raises(InputError, match="is a heads file, expected model or features"):
            formats.expect_kind(f, tmp_path / "d.h5", "model", "features")
    (tmp_path / "text.h5").write_text("not hdf5")
    with pytest.raises(InputError, match="not an HDF5 file"):
        formats.kind_of(tmp_path / "text.h5")
    with pytest.raises(InputError, match="no such file"):
        formats.kind_of(tmp_path / "missing.h5")


def test_provenance_attributes(tmp_path: Path) -> None:
    inp = _write(tmp_path / "in.h5", tokens=np.arange(12.0).reshape(2, 3, 2))
    out = tmp_path / "h.h5"
    formats.set_command(["mhla", "export-heads", "model file.h5"])
    try:
        t0 = time.time()
        Heads(V=np.ones((1, 2, 2)), Q=np.ones((1, 2, 2))).save(out, inputs=(inp,))
    finally:
        formats.set_command(None)
    with h5py.File(out, "r") as f:
        a = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
    assert a["mhla_kind"] == "heads" and int(a["mhla_format_version"]) == formats.FORMAT_VERSION
    assert a["mhla_version"] == __version__
    assert a["mhla_command"] == "mhla export-heads 'model file.h5'"  # shell-quoted
    created = time.mktime(time.strptime(a["mhla_created"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    assert abs(created - t0) < 120
    inputs = json.loads(a["mhla_inputs"])
    assert len(inputs) == 1 and inputs[0]["path"] == str(inp) and inputs[0]["size"] == inp.stat().st_size
    fp = inputs[0]["fingerprint"]
    assert len(fp) == 32 and fp == formats.source_identity(inp)["fingerprint"]


def test_read_array_rules(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.h5", x=np.array([1.0, np.nan]), s=np.array([b"a"]), c=np.ones(2, complex))
    path2 = tmp_path / "a.h5"
    with h5py.File(path, "a") as f:
        f.create_group("g")
    with formats.open_input(path2) as f:
        with pytest.raises(InputError, match="'x' contains NaN"):
            formats.read_array(f, "x", path2)
        assert np.isnan(formats.read_array(f, "x", path2, finite=False)[1])
        for name, msg in (("s", "dtype"), ("c", "dtype"), ("g", "is a group"), ("missing", "missing dataset")):
            with pytest.raises(InputError, match=msg):
                formats.read_array(f, name, path2)


def test_library_hdf5_writers_refuse_other_suffixes(tmp_path) -> None:
    """An output's suffix means its format in the library too: Model.save / Features.save /
    predict_file write HDF5 and refuse a NumPy, safetensors or text name (nothing written)."""
    import pytest

    from mhla_cli.model import synthetic
    from mhla_cli import featurize, fit, predict_file
    from mhla_cli.errors import InputError

    ds, _ = synthetic.generate_teacher(2, 1, 40, 4, seed=0)
    data = tmp_path / "d.h5"
    ds.save(data)
    feats = featurize(data)
    model = fit(feats)
    for name in ("m.npz", "m.safetensors", "m.npy", "m.csv"):
        for write in (lambda p: model.save(p), lambda p: feats.save(p), lambda p: predict_file(model, data, p)):
            with pytest.raises(InputError, match="HDF5"):
                write(tmp_path / name)
            assert not (tmp_path / name).exists()
    for name in ("m.h5", "m.hdf5", "m.hdf", "m"):
        model.save(tmp_path / name)


@pytest.mark.parametrize("size", [10, (formats.IN_MEMORY_WRITE_BYTES // 8) + 1])  # in memory, through libhdf5
def test_a_deferred_dataset_is_made_when_written_and_counted_before(tmp_path: Path, monkeypatch, size: int) -> None:
    """formats.Deferred: computed once, while the file is written (not before the free-space check, which
    counts its declared bytes), and written like an array."""
    made = []

    def make() -> np.ndarray:
        made.append(1)
        return np.arange(size, dtype=np.float64)

    seen = []
    monkeypatch.setattr(formats.writing, "_check_free_space", lambda o, need: seen.append((need, len(made))))
    out = formats.write_file(tmp_path / "x.h5", "tokens", {"a": formats.Deferred(make, 8 * size),
                                                           "b": np.zeros(3)})
    assert made == [1] and seen == [(8 * size + 24 + (1 << 16), 0)]
    with h5py.File(out, "r") as f:
        assert np.array_equal(f["a"][()], np.arange(size)) and f["b"].shape == (3,)


def test_a_deferred_dataset_of_row_blocks_is_written_block_by_block(tmp_path: Path) -> None:
    """formats.Deferred with a shape: the blocks (first row, rows) fill a float64 dataset of that shape."""
    full = np.arange(35, dtype=np.float64).reshape(7, 5)
    blocks = [(0, full[:3]), (3, full[3:6]), (6, full[6:])]
    out = formats.write_file(tmp_path / "x.h5", "tokens", {"a": formats.Deferred(lambda: iter(blocks), full.nbytes,
                                                                                 shape=full.shape)})
    with h5py.File(out, "r") as f:
        assert f["a"].dtype == np.float64 and np.array_equal(f["a"][()], full)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [(0, 0), (9, 1), (2, 8)])  # a diagonal tile, below it, above it
def test_stored_symmetric_finds_every_non_finite_entry(tmp_path: Path, bad: float, where: tuple[int, int]) -> None:
    """The tiled check (tiles of 4 over a 10 x 10 dataset: partial edge tiles) sees a NaN / Inf in any tile,
    on one side of the diagonal only."""
    rng = np.random.default_rng(0)
    M = rng.standard_normal((10, 10))
    M = M + M.T
    M[where] = bad
    with h5py.File(tmp_path / "g.h5", "w") as f:
        f["g"] = M
        with pytest.raises(InputError, match="'g' contains NaN or Inf"):
            formats.check_stored_symmetric(f, "g", tmp_path / "g.h5", tile=4)


def test_stored_symmetric_cut_on_both_sides(tmp_path: Path) -> None:
    """Symmetric to SYMMETRY_TOL of the largest entry: an asymmetry just inside passes, just outside fails
    (in a tile off the diagonal and in a diagonal one)."""
    from mhla_cli.numerics import SYMMETRY_TOL

    rng = np.random.default_rng(1)
    M = rng.standard_normal((10, 10))
    M = M + M.T
    top = float(np.abs(M).max())
    for i, j in ((9, 1), (5, 6)):
        for factor, ok in ((0.5, True), (2.0, False)):
            A = M.copy()
            A[i, j] += factor * SYMMETRY_TOL * top
            with h5py.File(tmp_path / "g.h5", "w") as f:
                f["g"] = A
                if ok:
                    formats.check_stored_symmetric(f, "g", tmp_path / "g.h5", tile=4)
                else:
                    with pytest.raises(InputError, match="'g' is not symmetric"):
                        formats.check_stored_symmetric(f, "g", tmp_path / "g.h5", tile=4)


def test_value_text_shows_numbers_not_numpy_reprs() -> None:
    """Messages show values as Python numbers (the issue: `np.float32(-10000.0)` in an error line)."""
    from mhla_cli.io.formats import value_text

    assert value_text(np.float32(-10000.0)) == "-10000.0"
    assert value_text(np.int64(6)) == "6" and value_text(np.array(2.5)) == "2.5"
    assert value_text(np.array([1, 2])) == "[1, 2]" and value_text(np.bool_(True)) == "True"
    assert value_text("abc") == "'abc'" and value_text(float("nan")) == "nan"


def test_messages_keep_the_directory_and_show_no_numpy_reprs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A file in another directory: the convert hint names it with its directory (it dropped it), from any
    working directory; a weight-total attribute that is not a number is shown as a Python value."""
    from mhla_cli.cli import run

    sub = tmp_path / "sub dir"
    sub.mkdir()
    np.save(sub / "x.npy", np.zeros((3, 2)))
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert run(["certify", "sub dir/x.npy"]) == 2
    err = capsys.readouterr().err
    assert "mhla convert 'sub dir/x.npy' -o 'sub dir/x.h5'" in err, err
    feats = tmp_path / "f.h5"
    ds, _ = synthetic.generate_teacher(2, 1, 20, "2:4", seed=1)
    ds.save(tmp_path / "t.h5", dtype="float64")
    assert run(["featurize", str(tmp_path / "t.h5"), "-o", str(feats), "-q"]) == 0
    with h5py.File(feats, "a") as f:
        unseal(f)  # an edited file of format 6 is refused as corrupted first (tests/test_corruption.py)
        f.attrs["weight_sum"] = np.array([np.float32(1.0), np.float32(2.0)])
    capsys.readouterr()
    assert run(["certify", str(feats)]) == 2
    err = capsys.readouterr().err
    assert "attribute 'weight_sum' = [1.0, 2.0] is not a number" in err and "np." not in err and "array(" not in err


# ---------------------------------------------------------------------------------------------
# the manifest (mhla_cli.io.formats.manifest)

def test_an_array_checksum_is_of_its_shape_and_values_in_any_layout() -> None:
    from mhla_cli.io.formats import manifest

    rng = np.random.default_rng(0)
    a = rng.standard_normal((7, 5))
    h = manifest.digest(a)
    assert manifest.digest(np.asfortranarray(a)) == h and manifest.digest(a.astype(">f8")) == h
    blocks = manifest.Hasher(a.shape)
    for r0 in (0, 1, 4):  # rows in blocks of any sizes, first row first
        blocks.update(a[r0:{0: 1, 1: 4, 4: 7}[r0]])
    assert blocks.hexdigest() == h
    assert manifest.digest(a.reshape(5, 7)) != h  # the same bytes in another shape
    b = a.copy()
    b[3, 2] = np.nextafter(b[3, 2], np.inf)  # one ulp
    assert manifest.digest(b) != h
    f32 = a.astype(np.float32)
    assert manifest.digest(f32) == manifest.digest(f32.astype(np.float64))  # stored or read as float64
    ints = np.arange(6).reshape(2, 3)
    assert manifest.digest(ints.astype(np.int32)) == manifest.digest(ints) != manifest.digest(ints.astype(float))
    big = rng.standard_normal((3 * manifest.HASH_BLOCK_BYTES // 800 + 1, 100))  # hashed in blocks of rows
    whole = manifest.Hasher(big.shape)
    whole.update(big)
    assert manifest.digest(big) == whole.hexdigest()


def test_the_header_checksum_is_of_every_attribute_but_the_manifest() -> None:
    from mhla_cli.io.formats import manifest

    attrs = {"d": np.int64(3), "weight_sum": np.float64(2.5), "normalize": "none", "r": np.array([1, 2]),
             "b": b"x"}
    h = manifest.attrs_digest(attrs)
    assert manifest.attrs_digest({"d": 3, "weight_sum": 2.5, "normalize": "none", "r": [1, 2], "b": "x"}) == h
    assert manifest.attrs_digest({**attrs, manifest.MANIFEST_ATTR: "{}"}) == h
    for k, v in (("d", 4), ("weight_sum", 2.5 * (1 + 2**-52)), ("normalize", "length"), ("extra", 0)):
        assert manifest.attrs_digest({**attrs, k: v}) != h, k
    assert manifest.attrs_digest({k: v for k, v in attrs.items() if k != "b"}) != h


def test_a_written_file_is_sealed_and_each_damage_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mhla_cli.io.formats import manifest

    coef = np.random.default_rng(1).standard_normal((2, 6))
    path = tmp_path / "m.h5"
    formats.write_file(path, "model", {"coef": coef})
    with h5py.File(path, "r") as f:
        man = json.loads(f.attrs[manifest.MANIFEST_ATTR])
        assert man["datasets"] == {"coef": {"shape": [2, 6], "digest": manifest.digest(coef)}}
        assert man["attrs"] == manifest.attrs_digest(dict(f.attrs)) and man["hash"] == "sha256"
    assert np.array_equal(Model.load(path).coef, coef)
    cases = {
        "edited": (lambda f: f["coef"].__setitem__((0, 0), coef[0, 0] + 1e-12), "'coef' differs from what was written"),
        "foreign": (lambda f: f.create_dataset("notes", data=np.eye(4)), "'notes' is not in its manifest"),
        "missing": (lambda f: f.__delitem__("coef"), None),  # the loader's own refusal comes first
        "header": (lambda f: f.attrs.__setitem__("mhla_command", "mhla fit other.h5"), "attributes differ"),
        "manifest": (lambda f: f.attrs.__setitem__(manifest.MANIFEST_ATTR, "{"), "manifest .* is not readable"),
        "no manifest": (lambda f: f.attrs.__delitem__(manifest.MANIFEST_ATTR), "has no manifest"),
    }
    for name, (edit, match) in cases.items():
        bad = tmp_path / f"{name}.h5"
        bad.write_bytes(path.read_bytes())
        with h5py.File(bad, "a") as f:
            edit(f)
        with pytest.raises(InputError, match=f"the file is corrupted: .*{match}" if match else "'coef'"):
            Model.load(bad)
        capsys.readouterr()
        assert run(["predict", str(bad), str(tmp_path / "none.h5"), "-o", str(tmp_path / "p.h5")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mhla: error:"), (name, err)
    # a dataset written in blocks (Deferred with a shape) is hashed as its blocks are written
    rows = np.arange(40.0).reshape(8, 5)
    blocks = formats.Deferred(lambda: ((r0, rows[r0:r0 + 3]) for r0 in range(0, 8, 3)), rows.nbytes, rows.shape)
    formats.write_file(tmp_path / "b.h5", "model", {"coef": np.ones((2, 6)), "extra": blocks})
    with h5py.File(tmp_path / "b.h5", "r") as f:
        assert json.loads(f.attrs[manifest.MANIFEST_ATTR])["datasets"]["extra"]["digest"] == manifest.digest(rows)


def test_an_older_file_reads_with_one_warning_line_after_the_output(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    ds, teacher = synthetic.generate_teacher(2, 1, 30, "2:4", seed=2)
    ds.save(tmp_path / "t.h5", dtype="float64")
    h = tmp_path / "h.h5"
    teacher.save(h)
    with h5py.File(h, "a") as f:
        unseal(f)
    capsys.readouterr()
    assert run(["predict", str(h), str(tmp_path / "t.h5"), "-o", str(tmp_path / "p.h5")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    warned = [e for e in err if "no manifest" in e]
    assert len(warned) == 1 and warned[0] == err[-1] and warned[0].startswith(f"mhla: warning: {h}: written before")
    assert run(["predict", str(h), str(tmp_path / "none.h5"), "-o", str(tmp_path / "p.h5")]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # an error stays one line
    assert len(err) == 1 and err[0].startswith("mhla: error:"), err
