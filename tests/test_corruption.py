"""Damaged inputs: every kind of file mhla reads (tokens, features HDF5, Zarr store, model, heads, probes,
reductions) with each dataset / chunk / attribute deleted, truncated, filled with NaN or edited in turn (and the
whole file cut to half its bytes): the command that reads it exits 2 or gives the intact file's answer, never
another answer with exit 0 (issue 43; the manifest: mhla_cli.io.formats.manifest).

A cross-cutting test of the commands: there is no library module `corruption`, so tests/test_layout.py's rule of
one test module per library module does not pair this file with one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from mhla_cli.cli import run
from mhla_cli.model import synthetic

D = 3
# The mutations of an HDF5 file's pieces, and of the file as a whole.
DATASET_MUTATIONS = ("delete", "nan", "edit", "rows")
ATTR_MUTATIONS = ("delete", "edit")


def _cli(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = run([*args, "--json"])
    out = capsys.readouterr().out.strip()
    try:
        return code, json.loads(out.splitlines()[-1]) if out else {}
    except ValueError:
        return code, {}


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in f if isinstance(f[k], h5py.Dataset)}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corruption")
    ds, _ = synthetic.generate_teacher(D, 2, 200, "2:7", seed=3)
    t = root / "t.h5"
    ds.save(t, dtype="float64")
    p = {k: root / f"{k}.h5" for k in ("features", "model", "heads", "probes", "reduced", "rfeatures", "rmodel",
                                      "blocks")}
    for args in (["featurize", str(t), "-o", str(p["features"])], ["fit", str(p["features"]), "-o", str(p["model"])],
                 ["export-heads", str(p["model"]), "-o", str(p["heads"])],
                 ["certify", str(p["features"]), "--on", str(t), "-o", str(p["probes"])],
                 ["reduce", str(t), "--dim", "2", "-o", str(p["reduced"])],
                 ["featurize", str(p["reduced"]), "-o", str(p["rfeatures"])],
                 ["fit", str(p["rfeatures"]), "-o", str(p["rmodel"])],
                 ["fit", str(t), "-o", str(p["blocks"]), "--blocks", str(p["reduced"])]):
        assert run([*args, "-q"]) in (0, 1), args
    return {"tokens": t, **p}


def _answer(kind: str, path: Path, files: dict[str, Path], out: Path,
            capsys: pytest.CaptureFixture[str]) -> tuple[int, Any]:
    """The exit code of the command that reads a file of `kind`, and its answer."""
    t = files["tokens"]
    if kind in ("tokens", "features"):
        code, rep = _cli(capsys, ["certify", str(path)])
        answer: Any = (rep.get("identifiable"), rep.get("lambda_min"), rep.get("rank"))
        if kind == "features" and code in (0, 1):
            c2, _ = _cli(capsys, ["fit", str(path), "-o", str(out)])
            return max(code, c2) if c2 else code, (answer, _arrays(out)["coef"] if c2 == 0 else None)
        return code, answer
    if kind in ("model", "heads"):
        code, _ = _cli(capsys, ["predict", str(path), str(t), "-o", str(out)])
        return code, _arrays(out)["predictions"] if code == 0 else None
    if kind == "blocks":  # a sum of blocks (mhla fit --blocks): its predictions and its dense heads
        code, _ = _cli(capsys, ["predict", str(path), str(t), "-o", str(out)])
        pred = _arrays(out)["predictions"] if code == 0 else None
        heads = out.with_name(f"heads-{out.name}")
        c2, _ = _cli(capsys, ["export-heads", str(path), "-o", str(heads)])
        return (code if code == c2 else -1), (pred, _arrays(heads) if c2 == 0 else None)  # -1: one of them refused
    if kind == "probes":
        code, rep = _cli(capsys, ["inspect", str(path)])
        return code, (rep.get("valid"), rep.get("n_samples"), rep.get("n_undetermined"))
    assert kind == "reduced"
    code, _ = _cli(capsys, ["export-heads", str(files["rmodel"]), "--unreduce", str(path), "-o", str(out)])
    return code, {k: v for k, v in _arrays(out).items()} if code == 0 else None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.shape(a) == np.shape(b) and bool(np.array_equal(a, b))
    return a == b


def _edited(v: Any) -> Any:
    """Another value of an attribute's type."""
    if isinstance(v, (bytes, np.bytes_)):
        v = v.decode()
    if isinstance(v, str):
        return {"none": "length", "length": "none", "causal": "bidirectional", "bidirectional": "causal"}.get(
            v, v + "x" if not v.startswith(("{", "[")) else v.replace("0", "1", 1) if "0" in v else v + " ")
    a = np.asarray(v)
    if a.dtype.kind == "b":
        return np.logical_not(a)
    if a.dtype.kind in "iu":
        return a * 1000 + 1
    return a * 1000.0 + 1.0


def _mutate_hdf5(path: Path, what: str, piece: str | None) -> None:
    if what == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
        return
    with h5py.File(path, "a") as f:
        if what == "delete-attr":
            del f.attrs[piece]
        elif what == "edit-attr":
            f.attrs[piece] = _edited(f.attrs[piece])
        elif what == "delete":
            del f[piece]
        else:
            a = np.array(f[piece][()])
            if what == "nan":
                if a.dtype.kind != "f" or a.size == 0:
                    a = a.astype(np.float64)
                a.reshape(-1)[a.size // 2 if a.size else 0:][:1] = np.nan
            elif what == "edit":
                flat = a.reshape(-1)
                if flat.size:
                    flat[-1] = flat[-1] + 1 if a.dtype.kind in "iu" else (not flat[-1] if a.dtype.kind == "b"
                                                                          else flat[-1] * 1.001 + 1e-3)
            else:  # rows: the last row gone
                a = a[:-1] if a.ndim else a
            del f[piece]
            f[piece] = a


def _pieces(path: Path, what: str) -> list[str | None]:
    if what == "truncate":
        return [None]
    with h5py.File(path, "r") as f:
        if what.endswith("-attr"):
            return sorted(f.attrs.keys())
        names: list[str] = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        return sorted(names)


# Tokens files are the user's data: an edit of a value is other data (its answer may change), so only the pieces'
# absence, damage and NaN are tried; every file mhla writes is tried with every edit too.
KINDS = {"tokens": ("delete", "nan", "rows", "truncate", "delete-attr"),
         **{k: ("delete", "nan", "edit", "rows", "truncate", "delete-attr", "edit-attr")
            for k in ("features", "model", "heads", "probes", "reduced", "blocks")}}


@pytest.mark.parametrize("kind,what", [(k, w) for k, ws in KINDS.items() for w in ws])
def test_a_damaged_file_is_refused_or_changes_nothing(files: dict[str, Path], kind: str, what: str,
                                                       tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = files[kind]
    base_code, base = _answer(kind, src, files, tmp_path / "base.h5", capsys)
    assert base_code in (0, 1), kind
    wrong = []
    for piece in _pieces(src, what):
        bad = tmp_path / f"bad-{kind}.h5"
        shutil.copyfile(src, bad)
        _mutate_hdf5(bad, what, piece)
        code, answer = _answer(kind, bad, files, tmp_path / "out.h5", capsys)
        if not (code == 2 or (code == base_code and _same(answer, base))):
            wrong.append((piece, code))
    assert not wrong, f"{kind}: {what} of these pieces gave another answer without exit 2: {wrong}"


def test_an_edited_file_of_mhla_names_the_corruption(files: dict[str, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A file mhla wrote whose value was edited is refused by its manifest, in one line, exit 2."""
    bad = tmp_path / "f.h5"
    shutil.copyfile(files["features"], bad)
    with h5py.File(bad, "a") as f:
        f["basis_gram"][0, 0] = f["basis_gram"][0, 0] * (1 + 1e-12)
    capsys.readouterr()
    assert run(["certify", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the file is corrupted: 'basis_gram' differs from what was written" in err[0], err
    with h5py.File(bad, "a") as f:
        f["basis_gram"][0, 0] = h5py.File(files["features"], "r")["basis_gram"][0, 0]
        f.attrs["n_samples"] = 60
    assert run(["certify", str(bad)]) == 2
    assert "its attributes differ from those written" in capsys.readouterr().err


# ------------------------------------------------------------------------------- the Zarr store

def _zarr_pieces(store: Path) -> list[Path]:
    """The chunk files of every array of a store."""
    return sorted(p for p in store.rglob("*") if p.is_file() and "/c/" in p.as_posix() + "/" and p.name != "zarr.json"
                  and "c" in p.relative_to(store).parts)


def _mutate_chunk(path: Path, what: str, chunks: list[Path]) -> None:
    if what == "delete":
        path.unlink()
    elif what == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    else:  # foreign: another chunk of the same array in its place
        same = [c for c in chunks if c.parent.parent == path.parent.parent and c != path] or \
               [c for c in chunks if c.parts[-4:-3] == path.parts[-4:-3] and c != path]
        if not same:
            path.unlink()
            return
        shutil.copyfile(same[0], path)


def _mutate_store_attrs(store: Path, what: str, key: str) -> None:
    meta = json.loads((store / "zarr.json").read_text())
    attrs = meta["attributes"]
    if what == "delete-attr":
        del attrs[key]
    else:
        v = _edited(attrs[key])
        attrs[key] = v.tolist() if hasattr(v, "tolist") else v
    (store / "zarr.json").write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def store(local, files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("zarr")
    from mhla_cli.statistics.distributed import tiled_statistics
    from mhla_cli.statistics.files import zarr_store

    out = tmp_path_factory.mktemp("store") / "s.zarr"
    zarr_store.save(tiled_statistics.accumulate(files["tokens"], local[1], tile_features=3 * D), out)
    return out


def _store_answer(path: Path, scheduler: str | None, capsys: pytest.CaptureFixture[str]) -> tuple[int, Any]:
    code, rep = _cli(capsys, ["certify", str(path), *(["--scheduler", scheduler] if scheduler else [])])
    return code, (rep.get("identifiable"), rep.get("lambda_min"), rep.get("rank"))


@pytest.mark.parametrize("what", ["delete", "truncate", "foreign"])
def test_a_damaged_chunk_of_a_store_is_refused(local, store: Path, what: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    address = local[0].scheduler_address
    bases = {s: _store_answer(store, s, capsys) for s in (None, address)}
    assert all(c == 0 for c, _ in bases.values())
    chunks = _zarr_pieces(store)
    assert len([c for c in chunks if "basis_gram_lower" in c.parts]) == 3  # 2 x 2 tiles, the lower three
    wrong = []
    meta = sorted(p for p in store.glob("*/zarr.json")) if what == "delete" else []  # an array's metadata
    for k, chunk in enumerate(chunks + meta):
        bad = tmp_path / f"b{k}.zarr"
        shutil.copytree(store, bad)
        _mutate_chunk(bad / chunk.relative_to(store), what, [bad / c.relative_to(store) for c in chunks])
        for s, (base_code, base) in bases.items():
            code, answer = _store_answer(bad, s, capsys)
            if not (code == 2 or (code == base_code and _same(answer, base))):
                wrong.append((str(chunk.relative_to(store)), s, code))
        capsys.readouterr()
        assert run(["inspect", str(bad)]) == 2, chunk
        shutil.rmtree(bad)
    assert not wrong, f"{what}: {wrong}"


@pytest.mark.parametrize("what", ["delete-attr", "edit-attr"])
def test_an_edited_header_of_a_store_is_refused(local, store: Path, what: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    base_code, base = _store_answer(store, None, capsys)
    keys = sorted(json.loads((store / "zarr.json").read_text())["attributes"])
    assert {"n_samples", "weight_sum", "normalize", "sample_hi", "mhla_manifest"} <= set(keys)
    wrong = []
    for key in keys:
        bad = tmp_path / "b.zarr"
        shutil.copytree(store, bad)
        _mutate_store_attrs(bad, what, key)
        code, answer = _store_answer(bad, None, capsys)
        if not (code == 2 or (code == base_code and _same(answer, base))):
            wrong.append((key, code))
        shutil.rmtree(bad)
    assert not wrong, f"{what}: {wrong}"


def test_a_store_and_a_merge_check_every_tile(local, files: dict[str, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A part with a deleted tile is refused by merge (nothing written); a clean merge is sealed anew and reads
    back as the whole; a store without its manifest but of format 5 reads with one warning line."""
    pytest.importorskip("zarr")
    from mhla_cli.statistics.distributed import tiled_statistics
    from mhla_cli.statistics.files import zarr_store

    client = local[1]
    parts = [tmp_path / f"p{i}.zarr" for i in range(2)]
    for i, p in enumerate(parts):
        zarr_store.save(tiled_statistics.accumulate(files["tokens"], client, shard=(i, 2), tile_features=3 * D), p)
    assert run(["merge", *map(str, parts), "-o", str(tmp_path / "m.zarr"), "-q"]) == 0
    whole = tmp_path / "w.zarr"
    zarr_store.save(tiled_statistics.accumulate(files["tokens"], client, tile_features=3 * D), whole)
    code_m, m = _store_answer(tmp_path / "m.zarr", None, capsys)
    code_w, w = _store_answer(whole, None, capsys)
    assert code_m == code_w == 0 and abs(m[1] - w[1]) <= 1e-10 * w[1]
    (parts[1] / "basis_gram_lower" / "c" / "1" / "0").unlink()
    capsys.readouterr()
    assert run(["merge", *map(str, parts), "-o", str(tmp_path / "m2.zarr")]) == 2
    err = capsys.readouterr().err
    assert "p1.zarr: the store is corrupted: tile (1, 0)" in err and not (tmp_path / "m2.zarr").exists()
    shutil.copytree(whole, tmp_path / "w2.zarr")
    (tmp_path / "w2.zarr" / "basis_gram_lower" / "c" / "1" / "1").unlink()
    for args in (["fit", str(tmp_path / "w2.zarr"), "--scheduler", local[0].scheduler_address, "-o",
                  str(tmp_path / "m.h5")], ["inspect", str(tmp_path / "w2.zarr")]):
        assert run(args) == 2, args
        assert "the store is corrupted: tile (1, 1)" in capsys.readouterr().err, args
    assert not (tmp_path / "m.h5").exists()
    meta = json.loads((whole / "zarr.json").read_text())
    del meta["attributes"]["mhla_manifest"]
    (whole / "zarr.json").write_text(json.dumps(meta))
    assert run(["certify", str(whole), "-q"]) == 2  # format 6 without a manifest: a deleted manifest
    assert "has no manifest" in capsys.readouterr().err
    meta["attributes"]["mhla_format_version"] = 5
    (whole / "zarr.json").write_text(json.dumps(meta))
    assert run(["certify", str(whole), "-q"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mhla: warning:") and "no manifest" in err[0], err
