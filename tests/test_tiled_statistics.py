"""The statistics accumulated on a Dask cluster with the Gram as tiles (mhla_cli.statistics.distributed.tiled_statistics),
against plain numpy on materialised canonical features (tests/_reference.py), and metamorphic: the
chunk size, the tiles, the order of the sequences, the units of the tokens and the shards change nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import _reference as ref
from mhla_cli.errors import InputError
from mhla_cli.io.tokens import inspect_tokens
from mhla_cli.model import synthetic
from mhla_cli.samples import ReadSpec, samples_of
from mhla_cli.statistics.distributed import tiled_statistics
from mhla_cli.statistics.stream import featurize
from conftest import gather_tiles

distributed = pytest.importorskip("dask.distributed")


def dense(stats: tiled_statistics.TiledStatistics) -> np.ndarray:
    """The tiles gathered into the dense canonical Gram."""
    return gather_tiles(stats.matrix)


# kind: (per-position layout's attention or None, normalize, weights, bias terms)
KINDS = {"last": (None, "none", False, False), "causal": ("causal", "none", False, False),
         "weighted": (None, "none", True, False), "length": (None, "length", False, False),
         "bidirectional": ("bidirectional", "none", False, False),
         "bidirectional-weighted-length": ("bidirectional", "length", True, False),
         "causal-weighted-bias": ("causal", "none", True, True), "bidirectional-bias": ("bidirectional", "none", False, True)}


def dataset(tmp_path: Path, kind: str, d: int = 4, n: int = 160, seed: int = 0) -> tuple[Path, synthetic.Dataset]:
    attention, normalize, weighted, bias = KINDS[kind]
    rng = np.random.default_rng(seed)
    ds, _ = synthetic.generate_teacher(d, 2, n, "2:7", seed=seed,
                                       read=ReadSpec(samples_of(attention is not None, attention),
                                                     normalize=normalize, bias_terms=bias))
    if weighted:  # per sequence, or per position for per-position data; some of them 0
        ds.weights = rng.uniform(0.0, 2.0, n if attention is None else ds.tokens.shape[0])
        ds.weights[::7] = 0.0
    path = tmp_path / f"{kind}.h5"
    ds.save(path, dtype="float64")
    return path, ds


@pytest.mark.parametrize("kind", list(KINDS))
def test_tiles_equal_materialised_canonical_features(client, tmp_path: Path, kind: str) -> None:
    """Every sample layout (last, causal, bidirectional; weights, --normalize length) and the bias terms: the
    tiles are the canonical Gram of the materialised features, the other sums those of one machine."""
    attention, normalize, _, bias = KINDS[kind]
    path, ds = dataset(tmp_path, kind)
    d = 4 + int(bias)
    stats = tiled_statistics.accumulate(path, client, chunk_size=23, read=ReadSpec(normalize=normalize,
                                                                                   bias_terms=bias),
                                        tile_features=2 * d)
    feats = stats.sums
    tokens, targets = ds.tokens, ds.targets
    if bias:  # the reader's tokens (x, 1) and targets (y, 0) (docs/bias_terms.md)
        tokens = np.hstack([tokens, np.ones((tokens.shape[0], 1))])
        targets = np.hstack([targets, np.zeros((targets.shape[0], 1))])
    r = ref.canonical(tokens, ds.offsets, targets, per_position=attention is not None, weights=ds.weights,
                      normalize=normalize, A=feats.basis, attention=attention or "causal")
    G = dense(stats)
    q = d * (d + 1) // 2
    k = tiled_statistics.tile_pairs(d, 2 * d)  # 2 pairs a tile (q = 10), 3 with the bias terms (q = 15)
    assert stats.matrix.nb == q // k > 1 and stats.tile == k * d
    assert np.abs(G - r["lambda"] * r["W"]).max() <= 1e-12 * np.abs(G).max()
    assert np.abs(feats.basis_moments - r["moments"] * r["W"]).max() <= 1e-12 * np.abs(feats.basis_moments).max()
    assert feats.n_samples == r["N"] and abs(feats.weight - r["W"]) <= 1e-12 * r["W"]
    # the basis whitens the data's tokens: the canonical token Gram is I
    G_tok = feats.basis_token_gram / feats.token_weight
    assert np.abs(G_tok - np.eye(d)).max() <= 1e-9
    # the record's other sums are those of the single-machine featurize
    one = featurize(path, normalize=normalize, spans="off", bias_terms=bias)
    for k in ("token_gram", "last_token_gram", "target_gram", "target_sum"):
        assert np.abs(getattr(feats, k) - getattr(one, k)).max() <= 1e-12 * np.abs(getattr(one, k)).max(), k
    assert (feats.n_tokens, feats.n_sequences, feats.samples, feats.bias_terms) == \
        (one.n_tokens, one.n_sequences, one.samples, one.bias_terms)
    assert feats.samples.attention == attention


def test_chunks_tiles_and_order_change_nothing(client, tmp_path: Path) -> None:
    path, ds = dataset(tmp_path, "last", d=5, n=200, seed=1)
    base = tiled_statistics.accumulate(path, client, chunk_size=200, tile_features=75)
    G0 = dense(base) / base.sums.weight
    w0 = np.linalg.eigvalsh(G0)
    for chunk, tile in ((7, 5), (31, 15), (64, 25)):
        other = tiled_statistics.accumulate(path, client, chunk_size=chunk, tile_features=tile)
        # another chunk size sums the tokens in another order: the same basis up to rounding
        assert np.abs(other.sums.basis - base.sums.basis).max() <= 1e-13
        assert np.abs(dense(other) / other.sums.weight - G0).max() <= 1e-12 * w0[-1], (chunk, tile)
    # the sequences in reverse order: the same data, the same spectrum
    order = np.arange(ds.n_samples)[::-1]
    seqs = [ds.sequence(i) for i in order]
    rev = synthetic.Dataset(np.concatenate(seqs), np.concatenate([[0], np.cumsum([len(s) for s in seqs])]),
                            ds.targets[order])
    rev.save(tmp_path / "rev.h5", dtype="float64")
    other = tiled_statistics.accumulate(tmp_path / "rev.h5", client, chunk_size=13, tile_features=25)
    assert np.abs(np.linalg.eigvalsh(dense(other) / other.sums.weight) - w0).max() <= 1e-12 * w0[-1]


def test_units_of_the_tokens_do_not_move_the_spectrum(client, tmp_path: Path) -> None:
    """X -> X T with a badly scaled rotation: the canonical Lambda~ has the same eigenvalues."""
    path, ds = dataset(tmp_path, "last", d=4, n=150, seed=2)
    rng = np.random.default_rng(5)
    T = np.linalg.qr(rng.standard_normal((4, 4)))[0] @ np.diag([1e-3, 1.0, 10.0, 1e3])
    moved = synthetic.Dataset(ds.tokens @ T, ds.offsets, ds.targets)
    moved.save(tmp_path / "moved.h5", dtype="float64")
    a = tiled_statistics.accumulate(path, client, chunk_size=40, tile_features=8)
    b = tiled_statistics.accumulate(tmp_path / "moved.h5", client, chunk_size=40, tile_features=8)
    wa = np.linalg.eigvalsh(dense(a) / a.sums.weight)
    wb = np.linalg.eigvalsh(dense(b) / b.sums.weight)
    assert np.abs(wa - wb).max() <= 1e-9 * wa[-1]


def test_shards_share_the_files_basis_and_add_up(client, tmp_path: Path) -> None:
    path, _ = dataset(tmp_path, "last", d=4, n=120, seed=3)
    whole = tiled_statistics.accumulate(path, client, chunk_size=17, tile_features=8)
    parts = [tiled_statistics.accumulate(path, client, chunk_size=17, tile_features=8, shard=(i, 3)) for i in range(3)]
    for p in parts:
        assert np.array_equal(p.sums.basis, whole.sums.basis)
    assert [p.sums.sample_range for p in parts] == [(0, 40), (40, 80), (80, 120)]
    assert parts[1].sums.extra_attrs["shard"] == "1/3"
    total = sum(dense(p) for p in parts)
    assert np.abs(total - dense(whole)).max() <= 1e-12 * np.abs(total).max()
    assert sum(p.sums.n_samples for p in parts) == whole.sums.n_samples


def test_tile_pairs_divide_the_pairs_evenly() -> None:
    for d in (4, 6, 12, 20, 32, 48, 64):
        q = d * (d + 1) // 2
        k = tiled_statistics.tile_pairs(d)
        assert q % k == 0 and 0.5 <= k * d / 2048 <= 2.0 or q < 2048 // d, (d, k)
    assert tiled_statistics.tile_pairs(4, 8) == 2 and tiled_statistics.tile_pairs(4, 10**6) == 10


def test_a_file_changed_between_passes_is_refused(tmp_path: Path) -> None:
    path, _ = dataset(tmp_path, "last", d=3, n=20)
    info = inspect_tokens(path)
    with pytest.raises(InputError, match="changed while it was read"):
        tiled_statistics._tile_part(info, (0, 20), np.eye(3), (0, 2), (0, 2), 10, "none", (0, 0))


def test_no_sample_left_is_refused(client, tmp_path: Path) -> None:
    path, ds = dataset(tmp_path, "weighted", d=3, n=30)
    ds.weights[:] = 0.0
    ds.save(path, dtype="float64")
    with pytest.raises(InputError, match="every weight"):
        tiled_statistics.accumulate(path, client)
