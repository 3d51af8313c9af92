"""`mhla convert` of activations as interpretability tools save them, checked against the arrays.

- a TransformerLens cache saved with `torch.save(cache.cache_dict)` (its keys and shapes built here:
  hook_resid_pre [batch, pos, d_model], attn.hook_result and hook_attn_in [batch, pos, head, d_model],
  hook_attn_out), picked with --key ROLE=NAME, NAME[h] (one head) and NAME[sum];
- a Hugging Face `datasets` directory as SAELens writes it (Array2D(context, d) columns, one per hook,
  and token_ids; dataset_info.json, state.json, data-*.arrow in the Arrow IPC streaming format), written
  here with pyarrow exactly as `datasets` lays it out;
- padded per-position targets with a mask, HDF5 activations, nested dicts;
- the file's `attention` attribute: required for per-position targets, refused for others.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import mhla_cli
from conftest import previous_output
from mhla_cli.cli import run
from mhla_cli.errors import InputError
from mhla_cli.io import convert as convert_mod
from mhla_cli.io.convert import _roles, _writer



def _read(path: Path) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    with h5py.File(path, "r") as f:
        assert f.attrs["mhla_kind"] == "tokens"
        return {k: f[k][()] for k in f}, dict(f.attrs)


def _ok(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    rc = run(["convert", *args])
    err = capsys.readouterr().err
    assert rc == 0, err
    return err


def _refused(args: list[str], capsys: pytest.CaptureFixture[str], pattern: str, out: Path) -> str:
    """Exit 2 with one line holding `pattern`; nothing written at `out` (a previous file kept byte for byte)."""
    capsys.readouterr()
    previous = previous_output(out, "tokens")
    before = set(os.listdir(out.parent))
    assert run(["convert", *args, "-o", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mhla: error: "), lines
    assert pattern in lines[0], lines[0]
    assert set(os.listdir(out.parent)) == before and out.read_bytes() == previous
    out.unlink()
    return lines[0]


def _offsets(mask: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(mask.sum(axis=1))]).astype(np.int64)


# --------------------------------------------------------------------------------------------
# a TransformerLens cache
# --------------------------------------------------------------------------------------------

N, n, H, D, DH, LAYERS = 5, 6, 3, 8, 4, 2


def _cache(seed: int = 0) -> dict[str, np.ndarray]:
    """The keys and shapes of `cache.cache_dict` of a 2-layer HookedTransformer with use_attn_result and
    use_attn_in set (random values: convert only copies them)."""
    rng = np.random.default_rng(seed)

    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    c = {"hook_embed": r(N, n, D), "hook_pos_embed": r(N, n, D)}
    for L in range(LAYERS):
        b = f"blocks.{L}."
        c |= {b + "hook_resid_pre": r(N, n, D), b + "hook_attn_in": r(N, n, H, D), b + "ln1.hook_scale": r(N, n, 1),
              b + "ln1.hook_normalized": r(N, n, D), b + "attn.hook_q": r(N, n, H, DH), b + "attn.hook_k": r(N, n, H, DH),
              b + "attn.hook_v": r(N, n, H, DH), b + "attn.hook_attn_scores": r(N, H, n, n),
              b + "attn.hook_pattern": r(N, H, n, n), b + "attn.hook_z": r(N, n, H, DH),
              b + "attn.hook_result": r(N, n, H, D), b + "hook_attn_out": r(N, n, D), b + "hook_resid_mid": r(N, n, D),
              b + "hook_resid_post": r(N, n, D)}
    c |= {"ln_final.hook_scale": r(N, n, 1), "ln_final.hook_normalized": r(N, n, D)}
    return c


def _save_cache(path: Path, cache: dict[str, np.ndarray], **extra: np.ndarray) -> Path:
    torch = pytest.importorskip("torch")
    torch.save({k: torch.from_numpy(v) for k, v in {**cache, **extra}.items()}, path)
    return path


def test_transformerlens_one_head_and_their_sum(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    c = _cache()
    pt = _save_cache(tmp_path / "cache.pt", c)
    out = tmp_path / "h.h5"
    err = _ok([str(pt), "--key", "tokens=blocks.1.hook_resid_pre", "--key", "targets=blocks.1.attn.hook_result[2]",
               "--attention", "bidirectional", "-o", str(out)], capsys)
    assert "attention bidirectional" in err
    got, attrs = _read(out)
    assert sorted(got) == ["targets", "tokens"] and attrs["attention"] == "bidirectional"
    assert np.array_equal(got["tokens"], c["blocks.1.hook_resid_pre"])
    assert got["targets"].dtype == np.float32
    assert np.array_equal(got["targets"], c["blocks.1.attn.hook_result"][:, :, 2, :])
    # the sum over the heads (in float64), the whole layer's output, and a head's copy of the input
    _ok([str(pt), "--key", "tokens=blocks.0.hook_attn_in[1]", "--key", "targets=blocks.0.attn.hook_result[sum]",
         "--attention", "causal", "-o", str(tmp_path / "s.h5"), "-q"], capsys)
    got, attrs = _read(tmp_path / "s.h5")
    assert attrs["attention"] == "causal"
    assert np.array_equal(got["tokens"], c["blocks.0.hook_attn_in"][:, :, 1, :])
    want = c["blocks.0.attn.hook_result"].astype(np.float64).sum(axis=2)
    assert got["targets"].dtype == np.float64
    np.testing.assert_allclose(got["targets"], want, rtol=1e-12, atol=1e-12)
    _ok([str(pt), "--key", "tokens=blocks.0.ln1.hook_normalized", "--key", "targets=blocks.0.hook_attn_out",
         "--attention", "causal", "-o", str(tmp_path / "o.h5"), "-q"], capsys)
    got, _ = _read(tmp_path / "o.h5")
    assert np.array_equal(got["tokens"], c["blocks.0.ln1.hook_normalized"])
    assert np.array_equal(got["targets"], c["blocks.0.hook_attn_out"])


def test_transformerlens_padded_batch_with_its_mask(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Padding (left here) is dropped from the windows: tokens and per-position targets at the kept
    positions, ragged; the mask may sit in the dict or in a file of its own."""
    c = _cache(1)
    mask = np.zeros((N, n), dtype=np.int64)
    for i, k in enumerate((6, 1, 4, 5, 2)):
        mask[i, n - k:] = 1
    keep = mask == 1
    keys = ["--key", "tokens=blocks.1.hook_resid_pre", "--key", "targets=blocks.1.attn.hook_result[0]"]
    pt = _save_cache(tmp_path / "cache.pt", c, attention_mask=mask)
    _ok([str(pt), *keys, "--attention", "bidirectional", "-o", str(tmp_path / "a.h5"), "-q"], capsys)
    np.save(tmp_path / "m.npy", mask)
    pt2 = _save_cache(tmp_path / "nomask.pt", c)
    _ok([str(pt2), f"attention_mask={tmp_path / 'm.npy'}", *keys, "--attention", "bidirectional",
         "-o", str(tmp_path / "b.h5"), "-q"], capsys)
    for name in ("a.h5", "b.h5"):
        got, attrs = _read(tmp_path / name)
        assert np.array_equal(got["offsets"], _offsets(mask))
        assert np.array_equal(got["tokens"], c["blocks.1.hook_resid_pre"][keep])
        assert np.array_equal(got["targets"], c["blocks.1.attn.hook_result"][:, :, 0, :][keep])
        assert attrs["attention"] == "bidirectional"
        info = mhla_cli.io.tokens.inspect_tokens(tmp_path / name)
        assert info.per_position and info.layout == "ragged" and info.n_tokens == int(mask.sum())


def test_picking_heads_in_small_blocks_gives_the_same_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    c = _cache(2)
    pt = _save_cache(tmp_path / "cache.pt", c)
    args = [str(pt), "--key", "tokens=blocks.0.hook_resid_pre", "--key", "targets=blocks.0.attn.hook_result[sum]",
            "--attention", "causal", "-q"]
    _ok([*args, "-o", str(tmp_path / "ref.h5")], capsys)
    monkeypatch.setattr(_roles, "_HEAD_BYTES", 1)  # one sequence of all heads at a time
    monkeypatch.setattr(_writer, "CHUNK_BYTES", 1)  # one sequence per chunk
    _ok([*args, "-o", str(tmp_path / "small.h5")], capsys)
    a, _ = _read(tmp_path / "ref.h5")
    b, _ = _read(tmp_path / "small.h5")
    assert all(np.array_equal(a[k], b[k]) for k in ("tokens", "targets"))


@pytest.mark.parametrize("keys, pattern", [
    ([], "no 'tokens' array: pick the activations with --key tokens=NAME"),
    (["tokens=blocks.0.hook_resid_pre", "targets=blocks.0.attn.hook_result"], "with an axis of 3 heads: pick one"),
    (["tokens=blocks.0.hook_attn_in", "targets=blocks.0.hook_attn_out"], "--key tokens=blocks.0.hook_attn_in[h]"),
    (["tokens=blocks.0.hook_resid_pre", "targets=blocks.0.attn.hook_result[3]"], "has 3 heads"),
    (["tokens=blocks.0.hook_resid_pre", "targets=blocks.0.hook_attn_out[0]"], "picks a head of an array of 4 axes"),
    (["tokens=blocks.0.hook_resid_pre", "targets=blocks.0.attn.hook_reslt[0]"], "no input holds an array"),
    (["tokens=blocks.0.hook_resid_pre", "targets=blocks.0.attn.hook_result[first]"], "[first] picks heads"),
    (["tokens=blocks.0.hook_resid_pre", "targets=blocks.0.hook_resid_pre"], "is given two roles"),
    (["tokens=blocks.0.hook_resid_pre", "targets=blocks.0.hook_attn_out"], "the targets are per position: say"),
])
def test_transformerlens_refusals(keys: list[str], pattern: str, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    pt = _save_cache(tmp_path / "cache.pt", _cache())
    _refused([str(pt), *(a for k in keys for a in ("--key", k))], capsys, pattern, tmp_path / "o.h5")


def test_an_activation_cache_object_is_refused_with_what_to_save(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    torch.save(ActivationCache({"blocks.0.hook_resid_pre": torch.zeros(2, 3, 4)}), tmp_path / "obj.pt")
    _refused([str(tmp_path / "obj.pt")], capsys, "save its dict of tensors, torch.save(cache.cache_dict, PATH)",
             tmp_path / "o.h5")


class ActivationCache:
    """Stands for transformer_lens.ActivationCache: an object torch.load(weights_only=True) refuses."""

    def __init__(self, cache_dict: dict[str, object]) -> None:
        self.cache_dict = cache_dict


def test_nested_dicts_are_named_by_dotted_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    X, Y = rng.standard_normal((4, 5, 3)), rng.standard_normal((4, 2))
    torch.save({"acts": {"layer2": {"x": torch.from_numpy(X)}, "y": torch.from_numpy(Y)}}, tmp_path / "n.pt")
    _ok([str(tmp_path / "n.pt"), "--key", "tokens=acts.layer2.x", "--key", "targets=acts.y", "-o",
         str(tmp_path / "n.h5"), "-q"], capsys)
    got, attrs = _read(tmp_path / "n.h5")
    assert np.array_equal(got["tokens"], X) and np.array_equal(got["targets"], Y) and "attention" not in attrs
    # without keys: the dotted names are said, not "Python objects"
    _refused([str(tmp_path / "n.pt")], capsys, "unknown arrays 'acts.layer2.x', 'acts.y'", tmp_path / "o.h5")


# --------------------------------------------------------------------------------------------
# padded per-position targets, and the attention attribute
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["causal", "bidirectional"])
def test_padded_per_position_targets_of_another_width(attention: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(4)
    X = rng.standard_normal((6, 7, 5)).astype(np.float32)  # (N, n, D), garbage in the padding
    Y = rng.standard_normal((6, 7, 3))  # (N, n, D_out)
    W = rng.random((6, 7))
    mask = (np.arange(7)[None, :] < np.array([7, 1, 3, 6, 2, 5])[:, None]).astype(np.int8)  # right padding
    np.savez(tmp_path / "p.npz", hidden=X, head=Y, weights=W, attention_mask=mask)
    rc = run(["convert", str(tmp_path / "p.npz"), "--key", "tokens=hidden", "--key", "targets=head", "--attention",
              attention, "-o", str(tmp_path / "p.h5"), "--json", "-q"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["attention"] == attention and summary["per_position"] and summary["d_out"] == 3
    got, attrs = _read(tmp_path / "p.h5")
    keep = mask == 1
    assert attrs["attention"] == attention
    assert np.array_equal(got["offsets"], _offsets(mask))
    assert np.array_equal(got["tokens"], X[keep]) and np.array_equal(got["targets"], Y[keep])
    assert np.array_equal(got["weights"], W[keep])


def test_attention_is_only_for_per_position_targets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(5)
    X = rng.standard_normal((4, 3, 2))
    np.savez(tmp_path / "seq.npz", tokens=X, targets=rng.standard_normal((4, 2)))
    np.savez(tmp_path / "none.npz", tokens=X)
    np.savez(tmp_path / "pos.npz", tokens=X, targets=rng.standard_normal((4, 3, 2)))
    out = tmp_path / "o.h5"
    _refused([str(tmp_path / "seq.npz"), "--attention", "causal"], capsys,
             "--attention causal is for per-position targets, but the targets are per sequence", out)
    _refused([str(tmp_path / "none.npz"), "--attention", "bidirectional"], capsys, "there are no targets", out)
    _refused([str(tmp_path / "pos.npz")], capsys, "--attention causal (a decoder", out)
    assert run(["convert", str(tmp_path / "pos.npz"), "--attention", "both", "-o", str(out)]) == 2
    capsys.readouterr()
    _ok([str(tmp_path / "seq.npz"), "-o", str(out), "-q"], capsys)
    assert "attention" not in _read(out)[1]
    # the library: write_tokens records it when given (a file without it is read as causal)
    mhla_cli.write_tokens(tmp_path / "w.h5", X, targets=X, attention="bidirectional")
    assert _read(tmp_path / "w.h5")[1]["attention"] == "bidirectional"
    mhla_cli.write_tokens(tmp_path / "w0.h5", X, targets=X)
    assert "attention" not in _read(tmp_path / "w0.h5")[1]
    with pytest.raises(InputError, match="is for per-position targets"):
        mhla_cli.write_tokens(tmp_path / "w1.h5", X, targets=X[:, -1], attention="causal")
    with pytest.raises(InputError, match="the targets are per position"):
        convert_mod.convert_files([tmp_path / "pos.npz"], tmp_path / "w2.h5")
    assert not (tmp_path / "w1.h5").exists() and not (tmp_path / "w2.h5").exists()


# --------------------------------------------------------------------------------------------
# HDF5 activations
# --------------------------------------------------------------------------------------------


def test_hdf5_activations_with_groups_and_a_mask(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(6)
    X, Y = rng.standard_normal((4, 5, 3)), rng.standard_normal((4, 2))
    mask = (np.arange(5)[None, :] < np.array([5, 2, 4, 1])[:, None]).astype(np.int64)
    with h5py.File(tmp_path / "acts.hdf5", "w") as f:
        f["layer3/hidden"] = X
        f["layer3/head7"] = Y
        f["attention_mask"] = mask
    _ok([str(tmp_path / "acts.hdf5"), "--key", "tokens=layer3.hidden", "--key", "targets=layer3.head7", "-o",
         str(tmp_path / "t.h5"), "-q"], capsys)
    got, _ = _read(tmp_path / "t.h5")
    assert np.array_equal(got["tokens"], X[mask == 1]) and np.array_equal(got["targets"], Y)
    # a file mhla reads as it is, and mhla's other files, are refused
    _refused([str(tmp_path / "t.h5")], capsys, "is already an mhla tokens file: mhla reads it as it is",
             tmp_path / "o.h5")


# --------------------------------------------------------------------------------------------
# a Hugging Face datasets directory, as SAELens writes it
# --------------------------------------------------------------------------------------------


def _datasets_dir(path: Path, columns: dict[str, np.ndarray], token_ids: np.ndarray | None, n_files: int = 2,
                  batch: int = 3) -> Path:
    """A directory as `Dataset.save_to_disk` writes it: Array2D columns (datasets' extension type over
    list<list<dtype>>), token_ids as Sequence(Value('int32'), length=L) (a fixed-size list), the
    `huggingface` schema metadata, record batches in the IPC streaming format, and the two JSON files."""
    pa = pytest.importorskip("pyarrow")

    class Array2DExtensionType(pa.ExtensionType):  # as datasets.features.features defines it
        def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
            self.shape, self.value_type = tuple(shape), dtype
            storage = pa.list_(pa.list_(pa.from_numpy_dtype(np.dtype(dtype))))
            pa.ExtensionType.__init__(self, storage, "datasets.features.features.Array2DExtensionType")

        def __arrow_ext_serialize__(self) -> bytes:
            return json.dumps((self.shape, self.value_type)).encode()

        @classmethod
        def __arrow_ext_deserialize__(cls, storage_type: object, serialized: bytes) -> "Array2DExtensionType":
            return cls(*json.loads(serialized))

    features: dict[str, object] = {}
    fields = []
    for name, arr in columns.items():
        t = Array2DExtensionType(arr.shape[1:], str(arr.dtype))
        fields.append(pa.field(name, t))
        features[name] = {"shape": list(arr.shape[1:]), "dtype": str(arr.dtype), "_type": "Array2D"}
    if token_ids is not None:
        fields.append(pa.field("token_ids", pa.list_(pa.int32(), token_ids.shape[1])))
        features["token_ids"] = {"feature": {"dtype": "int32", "_type": "Value"}, "length": token_ids.shape[1],
                                 "_type": "Sequence"}
    schema = pa.schema(fields, metadata={"huggingface": json.dumps({"info": {"features": features}})})
    path.mkdir()
    N = len(next(iter(columns.values())))
    bounds = np.linspace(0, N, n_files + 1).astype(int)
    names = []
    for k in range(n_files):
        name = f"data-{k:05d}-of-{n_files:05d}.arrow"
        names.append({"filename": name})
        with pa.OSFile(str(path / name), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
            for a in range(bounds[k], bounds[k + 1], batch):
                b = min(bounds[k + 1], a + batch)
                arrays = [pa.ExtensionArray.from_storage(f.type, pa.array(columns[f.name][a:b].tolist(),
                                                                          type=f.type.storage_type))
                          for f in fields if f.name in columns]
                if token_ids is not None:
                    arrays.append(pa.array(token_ids[a:b].tolist(), type=fields[-1].type))
                w.write_batch(pa.record_batch(arrays, schema=schema))
    (path / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": features,
                                                        "homepage": "", "license": ""}))
    (path / "state.json").write_text(json.dumps({"_data_files": names, "_fingerprint": "0123456789abcdef",
                                                 "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
                                                 "_output_all_columns": False, "_split": None}))
    return path


def _hooks(N: int = 10, ctx: int = 4, d: int = 6, seed: int = 7, dtype: str = "float32") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"blocks.{L}.{h}": rng.standard_normal((N, ctx, d)).astype(dtype)
            for L in (2, 3) for h in ("hook_resid_pre", "hook_attn_out")}


def test_saelens_datasets_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cols = _hooks()
    ids = np.arange(40, dtype=np.int32).reshape(10, 4)
    ds = _datasets_dir(tmp_path / "cache", cols, ids, n_files=3, batch=2)
    keys = ["--key", "tokens=blocks.3.hook_resid_pre", "--key", "targets=blocks.3.hook_attn_out"]
    err = _ok([str(ds), *keys, "--attention", "causal", "-o", str(tmp_path / "c.h5")], capsys)
    assert "attention causal" in err
    got, attrs = _read(tmp_path / "c.h5")
    assert sorted(got) == ["targets", "tokens"] and attrs["attention"] == "causal"
    assert np.array_equal(got["tokens"], cols["blocks.3.hook_resid_pre"])
    assert np.array_equal(got["targets"], cols["blocks.3.hook_attn_out"])
    # the same rows in other chunks; one data file read on its own
    _ok([str(ds), *keys, "--attention", "causal", "--chunk-size", "3", "-o", str(tmp_path / "c3.h5"), "-q"], capsys)
    assert all(np.array_equal(got[k], _read(tmp_path / "c3.h5")[0][k]) for k in got)
    _ok([str(ds / "data-00001-of-00003.arrow"), *keys, "--attention", "causal", "-o", str(tmp_path / "one.h5"),
         "-q"], capsys)
    assert np.array_equal(_read(tmp_path / "one.h5")[0]["tokens"], cols["blocks.3.hook_resid_pre"][3:6])
    # state.json gives the order of the data files
    state = json.loads((ds / "state.json").read_text())
    state["_data_files"].reverse()
    (ds / "state.json").write_text(json.dumps(state))
    _ok([str(ds), *keys, "--attention", "causal", "-o", str(tmp_path / "rev.h5"), "-q"], capsys)
    order = np.r_[6:10, 3:6, 0:3]
    assert np.array_equal(_read(tmp_path / "rev.h5")[0]["tokens"], cols["blocks.3.hook_resid_pre"][order])


def test_two_datasets_directories_one_hook_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SAELens caches one hook per run: the tokens from one cache, the targets from another, row by row;
    float16 columns are read as float16."""
    cols = _hooks(dtype="float16")
    a = _datasets_dir(tmp_path / "resid", {"blocks.2.hook_resid_pre": cols["blocks.2.hook_resid_pre"]}, None)
    b = _datasets_dir(tmp_path / "out", {"blocks.2.hook_attn_out": cols["blocks.2.hook_attn_out"]}, None, n_files=1)
    _ok([str(a), str(b), "--key", "tokens=blocks.2.hook_resid_pre", "--key", "targets=blocks.2.hook_attn_out",
         "--attention", "causal", "-o", str(tmp_path / "ab.h5"), "-q"], capsys)
    got, _ = _read(tmp_path / "ab.h5")
    assert got["tokens"].dtype == np.float16
    assert np.array_equal(got["tokens"], cols["blocks.2.hook_resid_pre"])
    assert np.array_equal(got["targets"], cols["blocks.2.hook_attn_out"])


def test_datasets_directory_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pa = pytest.importorskip("pyarrow")
    cols = _hooks()
    ds = _datasets_dir(tmp_path / "cache", cols, np.zeros((10, 4), np.int32))
    out = tmp_path / "o.h5"
    _refused([str(ds)], capsys, "no 'tokens' array: pick the activations with --key tokens=NAME", out)
    _refused([str(ds), "--key", "tokens=token_ids"], capsys, "'tokens' has shape (T, d) but there is no 'offsets'", out)
    # a DatasetDict, a directory whose state.json lists a missing file
    dd = tmp_path / "dd"
    dd.mkdir()
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    _refused([str(dd)], capsys, f"is a DatasetDict of splits train, test: convert one split, e.g. mhla convert "
             f"{dd / 'train'}", out)
    state = json.loads((ds / "state.json").read_text())
    (ds / "state.json").write_text(json.dumps({**state, "_indices_data_files": [{"filename": "indices.arrow"}]}))
    _refused([str(ds), "--key", "tokens=blocks.2.hook_resid_pre"], capsys, "holds an indices mapping", out)
    (ds / "state.json").write_text(json.dumps({"_data_files": "data.arrow"}))
    _refused([str(ds), "--key", "tokens=blocks.2.hook_resid_pre"], capsys, "does not list its data files", out)
    (ds / "state.json").write_text(json.dumps(state))
    (ds / "data-00001-of-00002.arrow").unlink()
    _refused([str(ds), "--key", "tokens=blocks.2.hook_resid_pre"], capsys, "lists data files that are not there",
             out)
    # rows of other shapes in a variable-length column, and missing values
    rag = tmp_path / "rag"
    rag.mkdir()
    schema = pa.schema([pa.field("x", pa.list_(pa.list_(pa.float32())))])
    with pa.OSFile(str(rag / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        w.write_batch(pa.record_batch([pa.array([[[1.0, 2.0]], [[1.0, 2.0], [3.0, 4.0]]], schema[0].type)], schema))
    (rag / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    _refused([str(rag), "--key", "tokens=x"], capsys, "column 'x' has rows of other shapes than its first row", out)
    with pa.OSFile(str(rag / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        w.write_batch(pa.record_batch([pa.array([[[1.0, 2.0]], [[None, 2.0]]], schema[0].type)], schema))
    _refused([str(rag), "--key", "tokens=x"], capsys, "column 'x' has missing (null) entries", out)


def test_without_pyarrow_the_refusal_names_the_extra(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "cache"
    d.mkdir()
    (d / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    _refused([str(d)], capsys, "pyarrow is not installed; pip install 'pyarrow>=14.0.1' (mhla's [arrow] extra)",
             tmp_path / "o.h5")


def test_registry_lists_every_reader_once() -> None:
    suffixes = [s for r in convert_mod.READERS for s in r.suffixes]
    assert len(suffixes) == len(set(suffixes)) and tuple(suffixes) == convert_mod.SUFFIXES
    assert {".npy", ".npz", ".safetensors", ".pt", ".pth", ".h5", ".arrow"} <= set(suffixes)


# --------------------------------------------------------------------------------------------
# TransformerLens 4 (TransformerBridge) and nnsight, as they are installed today, on a tiny random BERT
# --------------------------------------------------------------------------------------------

TINY = {"vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 32, "max_position_embeddings": 32}


def _tiny_bert(path: Path) -> Path:
    """A randomly initialised 2-layer BERT (4 heads of 4, d_model 16) and a tokenizer, saved for an offline boot."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(transformers.BertConfig(**TINY)).eval()
    with torch.no_grad():  # biases of a trained model (BERT starts them at 0): folding the value bias then shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    (path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefgh"]) + "\n")
    transformers.BertTokenizerFast(str(path / "vocab.txt")).save_pretrained(path)
    return path


def _batch() -> tuple[object, object]:
    """Token ids (3, 7) and their attention mask, one window right-padded to 5 tokens."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 13, (3, 7), generator=gen)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0
    return ids, mask


@pytest.fixture(scope="module")
def bridge_caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, np.ndarray]]:
    """The cache of TransformerLens 4's TransformerBridge over the tiny BERT, compatibility mode off and on."""
    pytest.importorskip("transformer_lens")
    bridge_mod = pytest.importorskip("transformer_lens.model_bridge")
    torch = pytest.importorskip("torch")
    bridge = bridge_mod.TransformerBridge.boot_transformers(str(_tiny_bert(tmp_path_factory.mktemp("bert"))),
                                                          device="cpu")
    ids, mask = _batch()
    out = {}
    for mode in ("off", "on"):
        if mode == "on":
            bridge.enable_compatibility_mode(disable_warnings=True)
        assert bridge.compatibility_mode == (mode == "on")
        with torch.no_grad():
            _, cache = bridge.run_with_cache(ids, attention_mask=mask)
        out[mode] = {**cache.cache_dict, "attention_mask": mask, "compatibility_mode": bridge.compatibility_mode}
    return out


def test_transformerlens4_bridge_cache_converts_to_its_tensors(bridge_caches: dict, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """hook_z[h] (a head before W_O) and hook_attn_out as targets, hook_resid_pre and ln1.hook_normalized as
    tokens, unpadded; the file records the mode, and the modes' hook_z differ (why the record is kept)."""
    torch = pytest.importorskip("torch")
    keep = bridge_caches["off"]["attention_mask"].numpy() == 1
    for mode, cache in bridge_caches.items():
        torch.save(cache, tmp_path / f"{mode}.pt")
        for tokens, targets, want in (("blocks.1.hook_resid_pre", "blocks.1.attn.hook_z[2]", "blocks.1.attn.hook_z"),
                                      ("blocks.0.ln1.hook_normalized", "blocks.0.hook_attn_out",
                                       "blocks.0.hook_attn_out")):
            out = tmp_path / f"{mode}-{tokens}.h5"
            err = _ok([str(tmp_path / f"{mode}.pt"), "--key", f"tokens={tokens}", "--key", f"targets={targets}",
                       "--attention", "bidirectional", "-o", str(out)], capsys)
            assert f"TransformerLens compatibility mode {mode}" in err
            got, attrs = _read(out)
            assert attrs[convert_mod.COMPAT_ATTR] == mode and attrs["attention"] == "bidirectional"
            assert np.array_equal(got["offsets"], _offsets(keep.astype(np.int64)))
            assert np.array_equal(got["tokens"], cache[tokens].numpy()[keep])
            head = cache[want].numpy()
            assert np.array_equal(got["targets"], (head[:, :, 2, :] if head.ndim == 4 else head)[keep])
    z = {m: c["blocks.1.attn.hook_z"].numpy()[keep] for m, c in bridge_caches.items()}
    assert np.abs(z["on"] - z["off"]).max() > 1e-3


def test_transformerlens4_bridge_cannot_give_hook_result_for_bert(bridge_caches: dict) -> None:
    """Why hook_z, not hook_result, is the head's target for BERT in TransformerLens 4."""
    assert not any(k.endswith("attn.hook_result") for k in bridge_caches["off"])


def _bridge_like(compat: object = None) -> dict[str, object]:
    """A dict with a TransformerBridge cache's names (hook_in / hook_out of the blocks) and, maybe, its record."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(5)
    c: dict[str, object] = {"blocks.0.hook_in": torch.randn(4, 3, 6, generator=g),
                            "blocks.0.hook_resid_pre": torch.randn(4, 3, 6, generator=g),
                            "blocks.0.attn.hook_z": torch.randn(4, 3, 2, 3, generator=g)}
    return c if compat is None else {**c, "compatibility_mode": compat}


BRIDGE_KEYS = ["--key", "tokens=blocks.0.hook_resid_pre", "--key", "targets=blocks.0.attn.hook_z[1]",
               "--attention", "causal"]


@pytest.mark.parametrize("record, option, want", [(True, None, "on"), (False, None, "off"), (None, "on", "on"),
                                                  (None, "off", "off"), (True, "on", "on"),
                                                  (torch_true := "tensor", None, "on")])
def test_compatibility_mode_record_is_written(record: object, option: str | None, want: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    torch.save(_bridge_like(torch.tensor(True) if record == torch_true else record), tmp_path / "c.pt")
    _ok([str(tmp_path / "c.pt"), *BRIDGE_KEYS, *(["--compatibility-mode", option] if option else []),
         "-o", str(tmp_path / "o.h5"), "-q"], capsys)
    _, attrs = _read(tmp_path / "o.h5")
    assert attrs[convert_mod.COMPAT_ATTR] == want
    assert f"@{convert_mod.COMPAT_ATTR} = {want}" in _inspect(tmp_path / "o.h5", capsys)


def _inspect(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert run(["inspect", str(path)]) == 0
    got = capsys.readouterr()
    return got.out + got.err


def test_compatibility_mode_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bridge cache without the record, records that disagree (two files, or a file and the option), a record
    that is not a bool: exit 2, nothing written."""
    torch = pytest.importorskip("torch")
    for name, record in (("none.pt", None), ("on.pt", True), ("off.pt", False), ("bad.pt", "yes"), ("two.pt", 2)):
        torch.save(_bridge_like(record), tmp_path / name)
    out = tmp_path / "o.h5"
    _refused([str(tmp_path / "none.pt"), *BRIDGE_KEYS], capsys, "without a record of whether compatibility mode", out)
    _refused([str(tmp_path / "on.pt"), *BRIDGE_KEYS, "--compatibility-mode", "off"], capsys,
             "compatibility mode disagree", out)
    _refused([str(tmp_path / "on.pt"), str(tmp_path / "off.pt"), *BRIDGE_KEYS], capsys,
             "compatibility mode disagree", out)
    _refused([str(tmp_path / "bad.pt"), *BRIDGE_KEYS], capsys, "records whether TransformerLens's compatibility", out)
    _refused([str(tmp_path / "two.pt"), *BRIDGE_KEYS], capsys, "records whether TransformerLens's compatibility", out)
    _refused([str(tmp_path / "on.pt"), *BRIDGE_KEYS, "--compatibility-mode", "yes"], capsys, "expected on or off",
             out)


def test_a_2x_cache_needs_no_compatibility_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """HookedTransformer / HookedEncoder (2.x) names have no bridge hook: converted without a record, as before."""
    pt = _save_cache(tmp_path / "cache.pt", _cache())
    _ok([str(pt), "--key", "tokens=blocks.1.hook_resid_pre", "--key", "targets=blocks.1.attn.hook_z[1]",
         "--attention", "causal", "-o", str(tmp_path / "o.h5"), "-q"], capsys)
    got, attrs = _read(tmp_path / "o.h5")
    assert convert_mod.COMPAT_ATTR not in attrs
    assert np.array_equal(got["targets"], _cache()["blocks.1.attn.hook_z"][:, :, 1, :])


def test_convert_help_names_hook_z_not_hook_result(capsys: pytest.CaptureFixture[str]) -> None:
    """TransformerLens 4 gives no hook_result for BERT (set_use_attn_result raises): the help names hook_z."""
    assert run(["convert", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "hook_z" in text and "hook_result" not in text and "--compatibility-mode" in text


def test_nnsight_saved_tensors_convert_to_their_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """nnsight 0.8: the `.save()`d values of a trace are tensors after it; a dict of them, the per-head outputs
    before W_O viewed as [batch, pos, head, d_head], converts to those tensors."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    nnsight = pytest.importorskip("nnsight")
    torch.manual_seed(0)
    model = nnsight.NNsight(transformers.BertModel(transformers.BertConfig(**TINY)).eval())
    ids, mask = _batch()
    layer = model.encoder.layer[1]
    with model.trace(input_ids=ids, attention_mask=mask):
        hidden = layer.input.save()
        z = layer.attention.self.output[0].save()
    assert isinstance(z, torch.Tensor) and isinstance(hidden, torch.Tensor)
    heads = z.reshape(*z.shape[:2], TINY["num_attention_heads"], -1)
    torch.save({"hidden": hidden, "z": heads, "attention_mask": mask}, tmp_path / "nns.pt")
    _ok([str(tmp_path / "nns.pt"), "--key", "tokens=hidden", "--key", "targets=z[3]", "--attention",
         "bidirectional", "-o", str(tmp_path / "o.h5"), "-q"], capsys)
    got, attrs = _read(tmp_path / "o.h5")
    keep = mask.numpy() == 1
    assert convert_mod.COMPAT_ATTR not in attrs
    assert np.array_equal(got["tokens"], hidden.detach().numpy()[keep])  # saved with requires_grad: detached
    assert np.array_equal(got["targets"], heads.detach().numpy()[:, :, 3, :][keep])


def test_compatibility_mode_is_checked_where_a_model_is_applied(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The record travels with the data (reduce keeps it; the model's data identity and the heads exported from it
    hold it) and predict refuses a model or heads fitted on one mode on tokens of the other; tokens of the same
    mode, or without a record, are read."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 4, 3, generator=g, dtype=torch.float64)
    y = torch.randn(30, 4, 3, generator=g, dtype=torch.float64)
    for mode, record in (("on", True), ("off", False), ("none", None)):
        cache = {"blocks.0.hook_resid_pre": x, "blocks.0.attn.hook_z": y[:, :, None, :]}
        torch.save(cache if record is None else {**cache, "compatibility_mode": record}, tmp_path / f"{mode}.pt")
        _ok([str(tmp_path / f"{mode}.pt"), "--key", "tokens=blocks.0.hook_resid_pre", "--key",
             "targets=blocks.0.attn.hook_z[0]", "--attention", "causal", "-o", str(tmp_path / f"{mode}.h5"), "-q"],
            capsys)
    assert run(["reduce", str(tmp_path / "on.h5"), "--dim", "2", "-o", str(tmp_path / "r.h5"), "-q"]) == 0
    assert _read(tmp_path / "r.h5")[1][convert_mod.COMPAT_ATTR] == "on"
    assert run(["fit", str(tmp_path / "on.h5"), "-o", str(tmp_path / "m.h5"), "-q"]) == 0
    assert run(["export-heads", str(tmp_path / "m.h5"), "-o", str(tmp_path / "h.h5"), "-q"]) == 0
    with h5py.File(tmp_path / "h.h5", "r") as f:
        assert f.attrs[convert_mod.COMPAT_ATTR] == "on"
    for fn, said in (("m.h5", "the model was fitted on activations captured with TransformerLens's compatibility "
                               "mode on (on.h5), these with it off"),
                     ("h.h5", "the heads were fitted on activations captured with TransformerLens's compatibility "
                              "mode on, these with it off")):
        for mode in ("on", "none"):
            assert run(["predict", str(tmp_path / fn), str(tmp_path / f"{mode}.h5"), "-o",
                        str(tmp_path / f"p-{mode}.h5"), "-q"]) == 0
        capsys.readouterr()
        assert run(["predict", str(tmp_path / fn), str(tmp_path / "off.h5"), "-o", str(tmp_path / "p.h5")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err
        assert not (tmp_path / "p.h5").exists()
