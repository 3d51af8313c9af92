"""Where a Zarr store is written (mhla_cli.statistics.files.store_location): what an output may replace, inputs
inside or around it, and the commit that removes an earlier store only after the new one is in place and
verified (and puts it back on any failure)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mhla_cli.errors import InputError
from mhla_cli.statistics.files import store_location as loc

pytest.importorskip("zarr")


def store(path: Path, kind: str | None = "features", fmt: int = 3, payload: str = "old") -> Path:
    """A directory with the root metadata of a Zarr group of mhla's `kind` (format 3 zarr.json or 2 .zattrs)
    and a payload file that tells one store from another."""
    path.mkdir(parents=True)
    attrs = {} if kind is None else {"mhla_kind": kind}
    if fmt == 3:
        (path / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attrs}))
    else:
        (path / ".zattrs").write_text(json.dumps(attrs))
    (path / "payload").write_text(payload)
    return path


def test_store_kind_reads_the_root_metadata(tmp_path: Path) -> None:
    assert loc.store_kind(str(store(tmp_path / "a.zarr"))) == "features"
    assert loc.store_kind(str(store(tmp_path / "b.zarr", fmt=2))) == "features"
    assert loc.store_kind(str(store(tmp_path / "c.zarr", kind="model"))) == "model"
    assert loc.store_kind(str(store(tmp_path / "d.zarr", kind=None))) is None
    (tmp_path / "e.zarr").mkdir()
    (tmp_path / "e.zarr" / "zarr.json").write_text("{not json")
    assert loc.store_kind(str(tmp_path / "e.zarr")) is None
    assert loc.store_kind(str(tmp_path / "missing.zarr")) is None


def test_check_output_replaces_only_an_mhla_features_store(tmp_path: Path) -> None:
    assert loc.check_output(tmp_path / "new.zarr") == str(tmp_path / "new.zarr")
    assert loc.check_output(store(tmp_path / "old.zarr")) == str(tmp_path / "old.zarr")
    users = tmp_path / "results.zarr"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    for bad in (users, store(tmp_path / "m.zarr", kind="model"), store(tmp_path / "n.zarr", kind=None)):
        with pytest.raises(InputError, match="is not an mhla features store"):
            loc.check_output(bad)
    (tmp_path / "file.zarr").write_text("a file")
    with pytest.raises(InputError, match=r"not a Zarr store \(a directory\)"):
        loc.check_output(tmp_path / "file.zarr")


def test_inputs_at_inside_or_around_the_output_are_refused(tmp_path: Path) -> None:
    out = store(tmp_path / "out.zarr")
    part = store(out / "p0.zarr")
    link = tmp_path / "link.zarr"
    link.symlink_to(out)
    for inputs, target in (((out,), out), ((part,), out), ((out,), part), ((part,), link), ((link,), out),
                           ((tmp_path / "x.h5", out / "data.h5"), out)):
        with pytest.raises(InputError, match="output would overwrite an input"):
            loc.check_output(target, inputs)
    loc.check_output(out, (tmp_path / "out.zarr.h5", tmp_path / "other.zarr"))  # a name's prefix is not inside
    assert loc.inside("s3://b/out.zarr", "s3://b/out.zarr/p0.zarr")
    assert not loc.inside("s3://b/out.zarr", "s3://b/out.zarr2")


def _ok(where: str) -> None:
    if loc.store_kind(where) != "features":
        raise InputError("not a complete store", where)


def test_commit_replaces_the_old_store_only_after_the_new_one_is_verified(tmp_path: Path) -> None:
    target = store(tmp_path / "s.zarr", payload="old")
    tmp = store(Path(loc.temporary(str(target))), payload="new")
    loc.commit(str(tmp), str(target), _ok)
    assert (target / "payload").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]  # nothing aside, no temporary


def test_a_new_store_that_fails_its_check_leaves_the_old_one(tmp_path: Path) -> None:
    target = store(tmp_path / "s.zarr", payload="old")
    tmp = store(Path(loc.temporary(str(target))), kind=None, payload="broken")
    with pytest.raises(InputError, match="not a complete store"):
        loc.commit(str(tmp), str(target), _ok)
    assert (target / "payload").read_text() == "old" and tmp.is_dir()


@pytest.mark.parametrize("fail_at", [1, 2])
def test_a_failure_in_place_puts_the_old_store_back(tmp_path: Path, fail_at: int) -> None:
    """The check of the new store at its place fails (the second call), or an interrupt arrives there: the old
    store is back at the target, the new one at its temporary name (which the caller removes)."""
    target = store(tmp_path / "s.zarr", payload="old")
    tmp = store(Path(loc.temporary(str(target))), payload="new")
    calls = []

    def verify(where: str) -> None:
        calls.append(where)
        if len(calls) == 2:
            raise InputError("fails in place") if fail_at == 1 else KeyboardInterrupt
    with pytest.raises((InputError, KeyboardInterrupt)):
        loc.commit(str(tmp), str(target), verify)
    assert calls == [str(tmp), str(target)]
    assert (target / "payload").read_text() == "old" and (tmp / "payload").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["s.zarr", tmp.name])


def test_commit_never_replaces_a_users_directory(tmp_path: Path) -> None:
    target = tmp_path / "s.zarr"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    tmp = store(Path(loc.temporary(str(target))), payload="new")
    with pytest.raises(InputError, match="is not an mhla features store"):
        loc.commit(str(tmp), str(target), _ok)
    assert (target / "notes.txt").read_text() == "mine"


def test_commit_on_an_fsspec_filesystem(tmp_path: Path) -> None:
    """The same on a URL (fsspec's memory filesystem): the old store removed only after the new one is in."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    for name, payload in (("/b/s.zarr", "old"), ("/b/.s.zarr.tmp", "new")):
        fs.pipe(f"{name}/zarr.json", json.dumps({"attributes": {"mhla_kind": "features"}}).encode())
        fs.pipe(f"{name}/payload", payload.encode())
    loc.commit("memory://b/.s.zarr.tmp", "memory://b/s.zarr", _ok)
    assert fs.cat("/b/s.zarr/payload") == b"new" and not fs.exists("/b/.s.zarr.tmp")
    assert [p for p in fs.ls("/b", detail=False) if "old-mhla" in p] == []
