"""Streaming statistics: equal to the in-memory sums, invariant to the chunk size, additive."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

import _reference
from conftest import relerr, write_tokens
from mhla_cli import featurize
from mhla_cli.statistics.stream import Features


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


def test_chunk_size_invariance(ragged) -> None:
    path, tokens, offsets, y = ragged
    N = offsets.size - 1
    results = [featurize(path, chunk_size=c) for c in (1, 7, N)]
    for other in results[1:]:
        for k in ("gram", "moments", "target_gram", "token_gram", "last_token_gram"):
            assert relerr(getattr(other, k), getattr(results[0], k)) < 1e-12, k


def test_shards_add_up(ragged) -> None:
    path, *_ = ragged
    whole = featurize(path)
    parts = [featurize(path, shard=(i, 3)) for i in range(3)]
    total = parts[0] + parts[1] + parts[2]
    assert total.n_samples == whole.n_samples
    assert relerr(total.gram, whole.gram) < 1e-12
    assert [p.sample_range for p in parts] == [(0, 32), (32, 64), (64, 97)]


def test_dense_and_ragged_layouts_agree(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    N, n, d = 40, 5, 4
    X = rng.standard_normal((N, n, d))
    y = rng.standard_normal((N, d))
    a = featurize(write_tokens(tmp_path / "dense.h5", X, None, y))
    b = featurize(write_tokens(tmp_path / "rag.h5", X.reshape(-1, d), np.arange(N + 1) * n, y))
    assert relerr(a.gram, b.gram) < 1e-13 and relerr(a.moments, b.moments) < 1e-13


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
