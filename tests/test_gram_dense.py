"""The Gram dense in memory (mhla_cli.statistics.storage.gram_dense): its symmetry check at the tolerance's cut,
its congruence in place only where it may write, and the refusals of its features-file dataset."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli.errors import InputError
from mhla_cli.numerics import SYMMETRY_TOL
from mhla_cli.statistics.storage.gram_dense import DenseGram, is_symmetric


def spd(n: int, seed: int = 0) -> np.ndarray:
    a = np.random.default_rng(seed).standard_normal((n, n + 3))
    return a @ a.T


@pytest.mark.parametrize("tile", [2, 512])
def test_is_symmetric_at_the_tolerance_cut(tile: int) -> None:
    G = spd(7)
    top = np.abs(G).max()
    for factor, want in ((0.5, True), (2.0, False)):
        H = G.copy()
        H[5, 1] += factor * SYMMETRY_TOL * top
        assert is_symmetric(H, tile=tile) is want, factor
    assert is_symmetric(np.zeros((0, 0)))


def test_congruence_overwrites_only_a_writeable_square_array() -> None:
    rng = np.random.default_rng(1)
    G = spd(6)
    P, R = rng.standard_normal((3, 3)), rng.standard_normal((2, 2))
    M = np.kron(P, R)
    want = M @ G @ M.T
    held = G.copy()
    out = DenseGram(held).congruence(P, R, overwrite=True)
    assert out.held is held and np.abs(held - want).max() <= 1e-12 * np.abs(want).max()  # in its memory
    ro = G.copy()
    ro.flags.writeable = False
    out = DenseGram(ro).congruence(P, R, overwrite=True)
    assert np.array_equal(ro, G) and np.abs(out.held - want).max() <= 1e-12 * np.abs(want).max()


def test_written_is_the_array_or_made_when_written() -> None:
    G = spd(4)
    s = DenseGram(G)
    assert s.written() is G
    deferred = s.written(lambda g: DenseGram(2 * g.held))
    assert deferred.nbytes == 8 * 16 and np.array_equal(deferred.make(), 2 * G)


@pytest.mark.parametrize("value,block,match", [
    (spd(6)[:5, :5], False, r"'basis_gram' has shape \(5, 5\), expected \(6, 6\)"),
    (np.triu(spd(6)), False, "'basis_gram' is not symmetric"),
    (np.triu(spd(6)), True, r"'basis_gram' must be a finite symmetric \(6, 6\) block"),
    (spd(6) * np.nan, True, "'basis_gram' contains NaN or Inf"),
])
def test_read_refuses_a_broken_dataset(tmp_path: Path, value: np.ndarray, block: bool, match: str) -> None:
    with h5py.File(tmp_path / "g.h5", "w") as f:
        f["basis_gram"] = value
    with h5py.File(tmp_path / "g.h5", "r") as f:
        with pytest.raises(InputError, match=match):
            DenseGram.from_file(f, tmp_path / "g.h5", 3, 2, block=block)


def test_read_returns_the_stored_gram(tmp_path: Path) -> None:
    G = spd(6)
    with h5py.File(tmp_path / "g.h5", "w") as f:
        f["basis_gram"] = G
    with h5py.File(tmp_path / "g.h5", "r") as f:
        for block in (False, True):
            assert np.array_equal(DenseGram.from_file(f, tmp_path / "g.h5", 3, 2, block=block).held, G)
