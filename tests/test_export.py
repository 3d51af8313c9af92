"""mhla_cli.model.export (heads as .h5 / .npz / .safetensors) and Heads.to_torch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from mhla_cli.model import synthetic
from mhla_cli import InputError, __version__
from mhla_cli.cli import run
from mhla_cli.model.export import load_heads, save_heads
from mhla_cli.model.forward import forward_heads, predict
from mhla_cli.model.heads import Heads
from conftest import unseal


def _heads(normalize: str = "none") -> Heads:
    rng = np.random.default_rng(3)
    return Heads(V=rng.standard_normal((3, 4, 4)), Q=rng.standard_normal((3, 4, 4)) * 1e-7,
                 info={"normalize": normalize, "relative_function_error": 1.25e-15})


@pytest.mark.parametrize("suffix", [".npz", ".safetensors", ".h5", ".hdf5"])
def test_round_trip_is_exact(suffix: str, tmp_path: Path) -> None:
    if suffix == ".safetensors":
        pytest.importorskip("safetensors")
    h = _heads("length")
    out = tmp_path / f"heads{suffix}"
    save_heads(h, out)
    g = load_heads(out)
    assert np.array_equal(g.V, h.V) and np.array_equal(g.Q, h.Q)
    assert g.V.dtype == np.float64 and g.info["normalize"] == "length"
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no temporary left


def test_npz_and_safetensors_metadata(tmp_path: Path) -> None:
    h = _heads()
    save_heads(h, tmp_path / "h.npz")
    with np.load(tmp_path / "h.npz", allow_pickle=False) as z:  # readable by plain numpy
        assert str(z["format"]) == "mhla-heads" and str(z["mhla_version"]) == __version__
        assert int(z["d"]) == 4 and int(z["n_heads"]) == 3 and str(z["normalize"]) == "none"
        assert np.array_equal(z["V"], h.V)
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    save_heads(h, tmp_path / "h.safetensors")
    with safe_open(str(tmp_path / "h.safetensors"), framework="np") as f:
        meta = f.metadata()
        assert np.array_equal(f.get_tensor("Q"), h.Q)
    assert meta["format"] == "mhla-heads" and meta["d"] == "4" and meta["n_heads"] == "3"
    assert meta["mhla_version"] == __version__ and meta["normalize"] == "none"


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="unknown heads format '.pt'"):
        save_heads(_heads(), tmp_path / "h.pt")
    with pytest.raises(InputError, match="unknown heads format"):
        load_heads(tmp_path / "h.json")
    np.savez(tmp_path / "other.npz", V=np.ones((1, 2, 2)), Q=np.ones((1, 2, 2)))
    with pytest.raises(InputError, match="not an mhla heads file"):
        load_heads(tmp_path / "other.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(InputError, match="not a .npz archive"):
        load_heads(tmp_path / "junk.npz")
    np.savez(tmp_path / "noq.npz", V=np.ones((1, 2, 2)), format="mhla-heads")
    with pytest.raises(InputError, match="has no 'Q'"):
        load_heads(tmp_path / "noq.npz")
    np.savez(tmp_path / "nan.npz", V=np.full((1, 2, 2), np.nan), Q=np.ones((1, 2, 2)), format="mhla-heads")
    with pytest.raises(InputError, match="NaN or Inf"):
        load_heads(tmp_path / "nan.npz")
    np.savez(tmp_path / "shape.npz", V=np.ones((1, 2, 3)), Q=np.ones((1, 2, 3)), format="mhla-heads")
    with pytest.raises(InputError, match=r"expected \(H, d, d\)"):
        load_heads(tmp_path / "shape.npz")
    with pytest.raises(InputError, match="no such file"):
        load_heads(tmp_path / "missing.npz")
    if _has("safetensors"):
        (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 16)
        with pytest.raises(InputError, match="cannot read as .safetensors"):
            load_heads(tmp_path / "junk.safetensors")


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "h.npz"
    save_heads(_heads(), out)
    before = out.read_bytes()

    def boom(*a: object, **k: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(InputError, match="No space left"):
        save_heads(Heads(V=np.ones((1, 2, 2)), Q=np.ones((1, 2, 2))), out)
    assert out.read_bytes() == before  # the old file is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.npz"]


def test_missing_optional_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(InputError, match=r"pip install 'safetensors>=0\.4' \(mhla's \[safetensors\] extra\)"):
        save_heads(_heads(), tmp_path / "h.safetensors")
    assert not list(tmp_path.iterdir())
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match=r"pip install 'torch>=2\.1' \(mhla's \[torch\] extra\)"):
        _heads().to_torch()


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("export")
    ds, _ = synthetic.generate_teacher(3, 2, 200, seq_len=(4, 12), seed=1)
    ds.save(tmp / "d.h5", dtype="float64")
    assert run(["fit", str(tmp / "d.h5"), "-o", str(tmp / "m.h5"), "-q"]) == 0
    return tmp / "m.h5"


def test_cli_export_heads_each_suffix(model_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["export-heads", str(model_file), "-o", str(tmp_path / "h.h5"), "-q"]) == 0
    ref = Heads.load(tmp_path / "h.h5")
    suffixes = [".npz", ".hdf5"] + ([".safetensors"] if _has("safetensors") else [])
    for suffix in suffixes:
        out = tmp_path / f"h{suffix}"
        assert run(["export-heads", str(model_file), "-o", str(out), "--json", "-q"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["output"] == str(out) and report["n_heads"] == ref.n_heads
        got = load_heads(out)
        assert np.array_equal(got.V, ref.V) and np.array_equal(got.Q, ref.Q)
    # unknown suffix: exit 2, one error line, nothing written
    before = sorted(p.name for p in tmp_path.iterdir())
    assert run(["export-heads", str(model_file), "-o", str(tmp_path / "h.pt")]) == 2
    err = capsys.readouterr().err
    assert "mhla: error:" in err and "unknown heads format '.pt'" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_to_torch_matches_forward(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((5, 7, 4))
    for normalize in ("none", "length"):
        h = _heads(normalize)
        h.Q *= 1e7
        m = h.to_torch()
        with torch.no_grad():
            out = m(torch.from_numpy(X)).numpy()
            allpos = m(torch.from_numpy(X), all_positions=True).numpy()
        np.testing.assert_allclose(out, predict(h, X), rtol=1e-12, atol=1e-12 * np.abs(out).max())
        ref = np.array([forward_heads(h.V, h.Q, x, all_positions=True, normalize=normalize) for x in X])
        np.testing.assert_allclose(allpos, ref, rtol=0, atol=1e-12 * np.abs(ref).max())
    with pytest.raises(ValueError, match="d = 4"):
        m(torch.zeros(2, 3, 5, dtype=torch.float64))
    m32 = h.to_torch(dtype=torch.float32)
    assert m32.V.dtype == torch.float32


def _has(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_predict_compare_inspect_read_exported_heads(tmp_path) -> None:
    """Heads written as .npz / .safetensors feed back into predict, compare and inspect."""
    import json as _json
    import subprocess
    import sys

    from mhla_cli.model import synthetic

    ds, _ = synthetic.generate_teacher(3, 2, 120, "3:8", seed=4)
    data = tmp_path / "d.h5"
    ds.save(data, dtype="float64")
    mhla = [sys.executable, "-m", "mhla_cli"]
    model = tmp_path / "m.h5"
    assert subprocess.run([*mhla, "fit", str(data), "-o", str(model), "-q"]).returncode == 0
    for suffix in (".npz", ".safetensors") if _has("safetensors") else (".npz",):
        heads = tmp_path / f"h{suffix}"
        assert subprocess.run([*mhla, "export-heads", str(model), "-o", str(heads), "-q"]).returncode == 0
        r = subprocess.run([*mhla, "predict", str(heads), str(data), "-o", str(tmp_path / f"p{suffix}.h5"),
                            "--json", "-q"], capture_output=True, text=True)
        assert r.returncode == 0 and _json.loads(r.stdout)["mse"] < 1e-20
        r = subprocess.run([*mhla, "compare", str(heads), str(model), "--json", "-q"], capture_output=True, text=True)
        assert r.returncode == 0 and _json.loads(r.stdout)["relative_distance"] < 1e-12
        r = subprocess.run([*mhla, "inspect", str(heads), "--json"], capture_output=True, text=True)
        rep = _json.loads(r.stdout)
        assert r.returncode == 0 and rep["kind"] == "heads" and rep["valid"] and rep["d"] == 3
    bad = tmp_path / "bad.npz"
    bad.write_text("junk")
    r = subprocess.run([*mhla, "predict", str(bad), str(data), "-o", str(tmp_path / "q.h5")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("mhla: error: ") and "not a .npz archive" in r.stderr
    assert not (tmp_path / "q.h5").exists()


@pytest.mark.parametrize("suffix", [".h5", ".npz", ".safetensors"])
def test_rectangular_heads_round_trip(suffix: str, tmp_path: Path) -> None:
    """V (H, d_out, d) beside Q (H, d, d): every format keeps them exactly, with d_out in the metadata."""
    from mhla_cli.model.export import load_heads, save_heads
    from mhla_cli.model.heads import Heads

    if suffix == ".safetensors":
        pytest.importorskip("safetensors")
    rng = np.random.default_rng(0)
    h = Heads.from_arrays(rng.standard_normal((2, 3, 5)), rng.standard_normal((2, 5, 5)))
    path = tmp_path / f"h{suffix}"
    save_heads(h, path)
    back = load_heads(path)
    assert np.array_equal(back.V, h.V) and np.array_equal(back.Q, h.Q) and (back.d, back.d_out) == (5, 3)
    assert run(["inspect", str(path), "--json"]) == 0


def test_to_torch_of_rectangular_heads(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from mhla_cli.model.forward import forward_heads
    from mhla_cli.model.heads import Heads

    rng = np.random.default_rng(1)
    V, Q = rng.standard_normal((2, 3, 5)), rng.standard_normal((2, 5, 5))
    m = Heads.from_arrays(V, Q).to_torch()
    assert (m.d, m.d_out) == (5, 3) and "d_out=3" in repr(m)
    X = rng.standard_normal((4, 5))
    with torch.no_grad():
        last = m(torch.from_numpy(X)).numpy()
        causal = m(torch.from_numpy(X), causal=True).numpy()
    assert np.allclose(last, forward_heads(V, Q, X), rtol=1e-12, atol=1e-12)
    assert np.allclose(causal[1], forward_heads(V, Q, X[:2]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("suffix", [".h5", ".npz", ".safetensors", ".pt"])
def test_factored_heads_round_trip(suffix: str, tmp_path: Path) -> None:
    """Factored heads (export-heads --unreduce: the reduced heads with their bias terms and the maps reduce_P,
    reduce_U) come back bit for bit from .h5 / .npz / .safetensors, and a torch module's state_dict (the maps
    are buffers) loads into the module of the same heads; the widths stated beside the arrays are checked."""
    from mhla_cli.model.reduce import Reduction, unreduce_heads

    rng = np.random.default_rng(5)
    P = np.linalg.qr(rng.standard_normal((6, 2)))[0]
    U = np.linalg.qr(rng.standard_normal((4, 2)))[0]
    h = unreduce_heads(synthetic.random_teacher(2, 2, rng, bias=True), Reduction(P, U))
    h.info["normalize"] = "length"
    if suffix == ".pt":
        torch = pytest.importorskip("torch")
        m = h.to_torch()
        torch.save(m.state_dict(), tmp_path / "h.pt")
        other = Heads(V=np.zeros_like(h.V), Q=np.zeros_like(h.Q), info=dict(h.info), P=np.zeros_like(P),
                      U=np.zeros_like(U), **{k: np.zeros_like(v) for k, v in h.bias_arrays().items()}).to_torch()
        other.load_state_dict(torch.load(tmp_path / "h.pt"))
        X = torch.from_numpy(rng.standard_normal((3, 5, 6)))
        with torch.no_grad():
            assert torch.equal(other(X, all_positions=True), m(X, all_positions=True))
        assert torch.equal(other.P, m.P) and torch.equal(other.U, m.U)
        return
    if suffix == ".safetensors":
        pytest.importorskip("safetensors")
    out = tmp_path / f"h{suffix}"
    save_heads(h, out)
    g = load_heads(out)
    assert g.factored and (g.d, g.d_out, g.reduced_dim) == (6, 4, 2) and g.info["normalize"] == "length"
    for k in ("V", "Q", "P", "U", "value_bias", "score_key", "score_query", "score_bias"):
        assert np.array_equal(getattr(g, k), getattr(h, k)), k
    X = rng.standard_normal((2, 4, 6))
    assert np.array_equal(predict(g, X), predict(h, X))


def test_factored_heads_files_refuse_inconsistent_widths(tmp_path: Path) -> None:
    """A heads file whose maps do not fit V, or whose metadata d contradicts reduce_P, is refused (one line)."""
    import h5py

    rng = np.random.default_rng(6)
    good = Heads(V=rng.standard_normal((1, 2, 2)), Q=rng.standard_normal((1, 2, 2)), info={"normalize": "none"},
                 P=rng.standard_normal((5, 2)), U=rng.standard_normal((3, 2)))
    save_heads(good, tmp_path / "h.npz")
    with np.load(tmp_path / "h.npz") as z:
        arrays = dict(z)
    np.savez(tmp_path / "bad.npz", **{**arrays, "reduce_P": rng.standard_normal((5, 3))})
    with pytest.raises(InputError, match="'reduce_P' has shape"):
        load_heads(tmp_path / "bad.npz")
    np.savez(tmp_path / "half.npz", **{k: v for k, v in arrays.items() if k != "reduce_U"})
    with pytest.raises(InputError, match="no 'reduce_U'"):
        load_heads(tmp_path / "half.npz")
    np.savez(tmp_path / "d.npz", **{**arrays, "d": np.array("7")})
    with pytest.raises(InputError, match="metadata 'd' = 7"):
        load_heads(tmp_path / "d.npz")
    save_heads(good, tmp_path / "h.h5")
    with h5py.File(tmp_path / "h.h5", "a") as f:
        unseal(f)
        f.attrs["d"] = 9
    with pytest.raises(InputError, match="metadata 'd' = 9"):
        load_heads(tmp_path / "h.h5")
