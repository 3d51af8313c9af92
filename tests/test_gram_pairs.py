"""The Gram held as its distinct entries (mhla_cli.statistics.storage.gram_pairs): its pairs, its sum with another
form, its rows as written, and the refusals of its features-file dataset (format version, shape, NaN)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli.errors import InputError
from mhla_cli.io import formats
from mhla_cli.linalg import symgram
from mhla_cli.statistics.storage.gram_dense import DenseGram
from mhla_cli.statistics.storage.gram_pairs import PAIRS_FORMAT, PairsGram


def pairs_gram(q: int = 3, r: int = 2, seed: int = 0) -> tuple[PairsGram, np.ndarray]:
    """A PairsGram accumulated from random factors, and the numpy Gram of its rows s (x) x."""
    rng = np.random.default_rng(seed)
    s, x = rng.standard_normal((20, q)), rng.standard_normal((20, r))
    acc = symgram.SymGram(q, r)
    acc.add(np.ascontiguousarray(s.T), np.ascontiguousarray(x.T))
    H = (s[:, :, None] * x[:, None, :]).reshape(20, q * r)
    return PairsGram(symgram.Pairs(acc.K, q, r)), H.T @ H


def test_expand_and_rows_written_are_the_gram() -> None:
    p, G = pairs_gram()
    assert p.n == 6 and np.abs(p.expand() - G).max() <= 1e-13 * np.abs(G).max()
    deferred = p.written()
    assert deferred.shape == (6, 6) and deferred.nbytes == 8 * 36
    out = np.zeros((6, 6))
    for r0, block in deferred.make():
        out[r0:r0 + len(block)] = block
    assert np.abs(out - G).max() <= 1e-13 * np.abs(G).max()


def test_add_keeps_the_form_for_like_factors_and_expands_otherwise() -> None:
    a, Ga = pairs_gram(seed=1)
    b, Gb = pairs_gram(seed=2)
    total = a.add(b)
    assert total is a and np.abs(total.expand() - (Ga + Gb)).max() <= 1e-13 * np.abs(Ga + Gb).max()
    c, Gc = pairs_gram(seed=3)
    mixed = c.add(DenseGram(Gb.copy()))
    assert isinstance(mixed, DenseGram) and np.abs(mixed.held - (Gc + Gb)).max() <= 1e-13 * np.abs(Gc).max()
    other, _ = pairs_gram(q=2, r=3, seed=4)  # the same side, other factors: added as arrays
    assert isinstance(pairs_gram(seed=5)[0].add(other), DenseGram)


def test_pairs_of_other_factors_are_refused() -> None:
    p, _ = pairs_gram()
    assert p.pairs(3, 2) is p.held.K
    with pytest.raises(ValueError, match="factors of lengths 3, 2"):
        p.pairs(2, 3)


def _file(tmp_path: Path, K: np.ndarray, version: int) -> Path:
    path = tmp_path / "p.h5"
    with h5py.File(path, "w") as f:
        f[formats.PAIRS_DATASET] = K
        f.attrs["mhla_format_version"] = version
    return path


@pytest.mark.parametrize("change,match", [
    (lambda K: (K, PAIRS_FORMAT - 1), "format version"),
    (lambda K: (K[:-1], PAIRS_FORMAT), "shape"),
    (lambda K: (K * np.nan, PAIRS_FORMAT), "NaN"),
])
def test_read_refuses_a_broken_dataset(tmp_path: Path, change, match: str) -> None:
    p, _ = pairs_gram()
    path = _file(tmp_path, *change(p.held.K))
    with h5py.File(path, "r") as f, pytest.raises(InputError, match=match):
        PairsGram.from_file(f, path, 3, 2)


def test_read_returns_the_stored_entries(tmp_path: Path) -> None:
    p, G = pairs_gram()
    path = _file(tmp_path, p.held.K, PAIRS_FORMAT)
    with h5py.File(path, "r") as f:
        back = PairsGram.from_file(f, path, 3, 2)
    assert np.array_equal(back.held.K, p.held.K) and np.abs(back.expand() - G).max() <= 1e-13 * np.abs(G).max()
