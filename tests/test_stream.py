"""Streaming statistics: equal to the in-memory sums, invariant to the chunk size, additive."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import _reference
from conftest import relerr, write_tokens
from mhla_cli import featurize
from mhla_cli.statistics.features import Features


def reference(tokens: np.ndarray, offsets: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """The sums in plain numpy on materialised features (tests/_reference.py, not mhla's feature map)."""
    F = np.stack([_reference.features(tokens[offsets[i]:offsets[i + 1]]) for i in range(offsets.size - 1)])
    last = tokens[offsets[1:] - 1].astype(np.float64)
    t64 = tokens.astype(np.float64)
    return {"gram": F.T @ F, "moments": F.T @ y, "target_gram": y.T @ y,
            "token_gram": t64.T @ t64, "last_token_gram": last.T @ last}


@pytest.fixture
def ragged(tmp_path: Path):
    rng = np.random.default_rng(1)
    d, N = 3, 97
    L = rng.integers(1, 40, size=N)
    offsets = np.concatenate([[0], np.cumsum(L)])
    tokens = rng.standard_normal((offsets[-1], d)).astype(np.float32)
    y = rng.standard_normal((N, d))
    return write_tokens(tmp_path / "r.h5", tokens, offsets, y), tokens, offsets, y


def test_equals_in_memory_sums(ragged) -> None:
    path, tokens, offsets, y = ragged
    feats = featurize(path)
    ref = reference(tokens, offsets, y)
    for k, v in ref.items():
        assert relerr(getattr(feats, k), v) < 1e-12, k
    assert feats.n_samples == offsets.size - 1 and feats.n_tokens == offsets[-1]
    assert feats.token_dtype == "float32"


def test_save_load_roundtrip(ragged, tmp_path: Path) -> None:
    path, *_ = ragged
    feats = featurize(path)
    out = tmp_path / "feats.h5"
    feats.save(out, inputs=(path,))
    back = Features.load(out)
    assert back.n_samples == feats.n_samples and back.d == feats.d
    np.testing.assert_array_equal(back.gram, feats.gram)
    np.testing.assert_array_equal(back.moments, feats.moments)


def test_without_targets(tmp_path: Path) -> None:
    X = np.random.default_rng(3).standard_normal((10, 4, 2))
    feats = featurize(write_tokens(tmp_path / "nt.h5", X))
    assert not feats.has_targets and feats.moments is None
    assert feats.gram.shape == (6, 6)


def test_data_kind_routes_a_store_and_files(tmp_path: Path) -> None:
    """A Zarr store (by its suffix, a directory) is features data, read on one machine by load_features (fit and
    certify without --scheduler); an HDF5 file is its own kind; a plain directory is refused as before."""
    from mhla_cli.errors import InputError
    from mhla_cli.statistics.stream import data_kind

    (tmp_path / "f.zarr").mkdir()
    assert data_kind(tmp_path / "f.zarr") == "features" and data_kind(str(tmp_path / "f.zarr") + "/") == "features"
    rng = np.random.default_rng(0)
    tokens = write_tokens(tmp_path / "t.h5", rng.standard_normal((5, 3, 2)))
    assert data_kind(tokens) == "tokens"
    featurize(tokens).save(tmp_path / "f.h5")
    assert data_kind(tmp_path / "f.h5") == "features"
    (tmp_path / "plain").mkdir()
    with pytest.raises(InputError, match="is a directory"):
        data_kind(tmp_path / "plain")


def test_affine_from_on_a_device_is_refused(tmp_path: Path) -> None:
    """--affine-from accumulates with numpy on the host: a torch device (torch on the CPU too) is refused before
    the wide file is opened; on the host the same call reads it (here: a file that is not there)."""
    pytest.importorskip("torch")
    from mhla_cli.errors import InputError

    rng = np.random.default_rng(3)
    X, offsets, Y = rng.standard_normal((8, 2)), np.array([0, 3, 8]), rng.standard_normal((2, 2))
    path = write_tokens(tmp_path / "d.h5", X, offsets, Y)
    with pytest.raises(InputError, match="accumulates on the CPU"):
        featurize(path, device="torch:cpu", affine_from=tmp_path / "wide.h5")
    with pytest.raises(InputError) as err:
        featurize(path, affine_from=tmp_path / "wide.h5")
    assert "accumulates on the CPU" not in str(err.value)
