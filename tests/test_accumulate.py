"""The accumulator: own and canonical sums equal those of materialised features, weighted, causal and
length-normalised; an in-memory chunk equals the same data featurized from a file."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

import _reference
from conftest import relerr, write_tokens
from mhla_cli import featurize
from mhla_cli.statistics import accumulate


@pytest.mark.parametrize("case", ["plain", "weighted", "causal", "causal weighted", "length-normalised",
                                  "causal length-normalised"])
def test_own_and_canonical_sums_equal_the_materialised_features(case: str, tmp_path: Path) -> None:
    """gram, moments (own features) and basis_gram, basis_moments (the canonical features of the whitened
    tokens X A, A = the file's basis) equal sums over materialised features, per sample (or per prefix),
    weighted and length-normalised."""
    rng = np.random.default_rng(7)
    d, N = 3, 41
    offsets = np.concatenate([[0], np.cumsum(rng.integers(1, 9, size=N))])
    T = int(offsets[-1])
    tokens = rng.standard_normal((T, d)) * np.array([1.0, 0.1, 5.0])
    causal = case.startswith("causal")
    y = rng.standard_normal((T if causal else N, d))
    w = rng.uniform(0.5, 2.0, size=T if causal else N) if "weighted" in case else None
    normalize = "length" if "normalised" in case else "none"
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f["tokens"], f["offsets"], f["targets"] = tokens, offsets, y
        if w is not None:
            f["weights"] = w
    feats = featurize(path, chunk_size=5, normalize=normalize)
    smp = _reference.samples(tokens, offsets, per_position=causal, weights=w)
    H = np.stack([_reference.features(X, normalize) for X, _, _ in smp])
    Ht = np.stack([_reference.canonical_features(X @ feats.basis, normalize) for X, _, _ in smp])
    ws = np.array([wi for _, wi, _ in smp])
    ys = y[[r for _, _, r in smp]]
    assert feats.n_samples == len(smp)
    assert relerr(feats.gram, (H * ws[:, None]).T @ H) < 1e-12
    assert relerr(feats.moments, (H * ws[:, None]).T @ ys) < 1e-12
    assert relerr(feats.target_gram, (ys * ws[:, None]).T @ ys) < 1e-12
    assert relerr(feats.basis_gram, (Ht * ws[:, None]).T @ Ht) < 1e-12
    assert relerr(feats.basis_moments, (Ht * ws[:, None]).T @ ys) < 1e-12


def test_chunk_features_equals_featurize(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    X, y = rng.standard_normal((30, 5, 3)), rng.standard_normal((30, 3))
    offsets = np.arange(31) * 5
    mem = accumulate.chunk_features(X.reshape(-1, 3), offsets, y, 3)
    disk = featurize(write_tokens(tmp_path / "c.h5", X, None, y))
    for k in ("gram", "moments", "target_gram", "token_gram", "last_token_gram"):
        assert relerr(getattr(mem, k), getattr(disk, k)) < 1e-12, k
