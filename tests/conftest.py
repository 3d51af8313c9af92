"""Shared fixtures: small synthetic datasets written to HDF5 in a temporary directory."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import h5py
import numpy as np
import pytest

from mhla_cli.model import synthetic
from mhla_cli.statistics.features import Features

STATS = ("gram", "moments", "target_gram", "token_gram", "last_token_gram")


def unseal(f: h5py.File) -> None:
    """Make an open mhla file (mode "a") one written before manifests (format 5, no 'mhla_manifest'), so that a
    test may edit it and reach the checks of what it holds (a file of format 6 with an edit is refused as
    corrupted first: tests/test_corruption.py)."""
    if "mhla_manifest" in f.attrs:
        del f.attrs["mhla_manifest"]
    if int(f.attrs.get("mhla_format_version", 0)) >= 6:
        f.attrs["mhla_format_version"] = 5


def relerr(a: np.ndarray, b: np.ndarray) -> float:
    """Largest absolute difference relative to the largest entry of b."""
    return float(np.abs(a - b).max() / np.abs(b).max())


def assert_same_stats(a: Features, b: Features, tol: float = 1e-12) -> None:
    """Two sets of statistics agree: counts exactly, every sum to `tol` relative, and the canonical
    spectra (the certificate's Lambda~, whatever whitening each is in) to 1e3 `tol` of lambda_max."""
    assert a.n_samples == b.n_samples and a.n_tokens == b.n_tokens and a.d == b.d
    for k in STATS:
        assert relerr(getattr(a, k), getattr(b, k)) < tol, k
    wa, wb = (np.linalg.eigvalsh(f.solver_stats()[1] / f.n_samples) for f in (a, b))
    assert np.abs(wa - wb).max() <= 1e3 * tol * np.abs(wb).max()


@pytest.fixture(scope="module")
def local():
    """(LocalCluster, Client): two single-threaded in-process Dask workers for a test module; skipped
    without dask.distributed."""
    distributed = pytest.importorskip("dask.distributed")
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None)
    client = distributed.Client(cluster)
    yield cluster, client
    client.close()
    cluster.close()


@pytest.fixture(scope="module")
def client(local):
    """The Client of `local`."""
    return local[1]


def tile_value(handle) -> np.ndarray:
    """A tile's array from its handle: a future's result, a store reference read, or the array itself."""
    if hasattr(handle, "result"):
        return handle.result()
    if hasattr(handle, "load"):
        return handle.load()
    return np.asarray(handle)


def gather_tiles(m) -> np.ndarray:
    """The lower tiles of a linalg.tiled_matrix.TiledMatrix gathered into the dense symmetric matrix (what
    the cluster path never does; tests only)."""
    G = np.zeros((m.n, m.n))
    o = m.offsets
    for (i, j), f in m.tiles.items():
        t = tile_value(f)
        G[o[i]:o[i + 1], o[j]:o[j + 1]] = t
        G[o[j]:o[j + 1], o[i]:o[i + 1]] = t.T
    return G


def write_windows(path: Path, layout: str, X: np.ndarray, off: np.ndarray, Y: np.ndarray,
                  w: np.ndarray | None = None) -> Path:
    """A tokens file of windows as a user writes it with h5py: tokens, offsets, targets, weights, and (per
    position) the layout's `attention`."""
    with h5py.File(path, "w") as f:
        f["tokens"], f["offsets"], f["targets"] = X, off, Y
        if w is not None:
            f["weights"] = w
        if layout != "last":
            f.attrs["attention"] = layout
    return path


def gather_factor(f, sizes: list[int]) -> np.ndarray:
    """A tiled Cholesky factor's tiles (of the tile sizes `sizes`) gathered into the dense lower-triangular
    matrix (tests only)."""
    off = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    L = np.zeros((off[-1], off[-1]))
    for (i, j), h in f.tiles.items():
        t = tile_value(h)
        L[off[i]:off[i + 1], off[j]:off[j + 1]] = np.tril(t) if i == j else t
    return L


def load_example(path: Path, name: str) -> ModuleType:
    """Import an example script (examples/*.py) as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


# The kind of file each command writes at -o (an earlier output of that kind is what an output may replace).
OUTPUT_KINDS = {"featurize": "features", "merge": "features", "fit": "model", "export-heads": "heads",
                "predict": "predictions", "rollout": "tokens", "generate": "tokens", "convert": "tokens",
                "reduce": "tokens", "certify": "probes"}


def previous_output(path: Path, kind: str) -> bytes:
    """Write at `path` a small HDF5 file of mhla's `kind` (what an earlier run left at an output: the only
    file an output may replace), and return its bytes (to check that it survives)."""
    with h5py.File(path, "w") as f:
        f.attrs["mhla_kind"] = kind
        f.attrs["mhla_format_version"] = 1
        f["previous"] = np.arange(5.0)
    return path.read_bytes()


def write_tokens(path: Path, tokens: np.ndarray, offsets: np.ndarray | None = None,
                 targets: np.ndarray | None = None) -> Path:
    """Write a tokens file the way a user would with plain h5py (no attributes)."""
    with h5py.File(path, "w") as f:
        f["tokens"] = tokens
        if offsets is not None:
            f["offsets"] = offsets
        if targets is not None:
            f["targets"] = targets
    return path


@pytest.fixture
def teacher_file(tmp_path: Path) -> tuple[Path, Path, synthetic.Dataset]:
    """d = 3, 2-head teacher, ragged lengths 1..12, N = 300, float64 storage."""
    ds, teacher = synthetic.generate_teacher(3, 2, 300, "1:12", seed=3)
    data = tmp_path / "data.h5"
    ds.save(data, dtype="float64")
    th = tmp_path / "teacher.h5"
    teacher.save(th)
    return data, th, ds
