"""The accumulation over sample ranges: invariant to the chunk size, the sum over ranges equals the whole, and
the basis a pass accumulates in."""

from __future__ import annotations

from conftest import relerr
from mhla_cli import featurize
from mhla_cli.io.tokens import inspect_tokens
from mhla_cli.statistics import ranges
from test_stream import ragged  # noqa: F401 (the fixture)


def test_chunk_size_invariance(ragged) -> None:
    path, tokens, offsets, y = ragged
    N = offsets.size - 1
    results = [featurize(path, chunk_size=c) for c in (1, 7, N)]
    for other in results[1:]:
        for k in ("gram", "moments", "target_gram", "token_gram", "last_token_gram"):
            assert relerr(getattr(other, k), getattr(results[0], k)) < 1e-12, k


def test_accumulate_ranges_adds_the_parts(ragged) -> None:
    path, tokens, offsets, y = ragged
    info = inspect_tokens(path)
    A = ranges.estimate_basis(info)
    whole = ranges.accumulate_range(info, (0, info.n_samples), 10, basis=A, finalize=False)
    parts = ranges.accumulate_ranges(info, [(0, 40), (40, 41), (41, info.n_samples)], chunk_size=7, basis=A,
                               finalize=False)
    assert parts.n_samples == whole.n_samples == info.n_samples
    assert relerr(parts.basis_gram, whole.basis_gram) < 1e-12
    assert relerr(parts.basis_moments, whole.basis_moments) < 1e-12
    assert ranges.default_chunk_size(info) >= 1


def _tokens_file(path, N=60, n=5, d=3, weights=False, per_position=False, seed=2):
    import h5py
    import numpy as np

    rng = np.random.default_rng(seed)
    # rotated, graded coordinates: a whitening far from the identity
    Q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    X = (rng.standard_normal((N, n, d)) * np.geomspace(1.0, 1e-2, d)) @ Q.T
    with h5py.File(path, "w") as f:
        f["tokens"] = X.astype(np.float32)
        f["targets"] = rng.standard_normal((N, n, d) if per_position else (N, d))
        if weights:
            f["weights"] = rng.uniform(0.5, 2.0, size=(N, n) if per_position else N)
    return path, X.astype(np.float32).astype(np.float64).reshape(-1, d)


def test_exact_basis_for_a_whole_file_of_any_layout_and_weights(tmp_path) -> None:
    """The sample holds every token of a small file: the whole file's basis is the exact whitening of the
    token Gram the pass accumulates (each token weighted by the samples that contain it: weights, causal
    prefixes, bidirectional windows), so its sums are not changed after the pass; a shard keeps the
    file's sample estimate."""
    import h5py

    path, _ = _tokens_file(tmp_path / "t.h5")
    info = inspect_tokens(path)
    assert ranges.exact_basis(info, (0, 60)) and not ranges.exact_basis(info, (0, 30))
    for i, kw in enumerate(({"weights": True}, {"per_position": True}, {"weights": True, "per_position": True},
                            {"weights": True, "per_position": True, "attention": "bidirectional"})):
        p = _tokens_file(tmp_path / f"w{i}.h5", **{k: v for k, v in kw.items() if k != "attention"})[0]
        if "attention" in kw:
            with h5py.File(p, "a") as f:
                f.attrs["attention"] = kw["attention"]
        other = inspect_tokens(p)
        assert ranges.exact_basis(other, (0, 60)) and not ranges.exact_basis(other, (0, 30)), kw
        feats = featurize(p, chunk_size=7)
        assert feats.extra_attrs["basis_correction_cond"] == 1.0 and feats.correction() == (None, 1.0), kw
        assert featurize(p, chunk_size=7, shard=(0, 2)).extra_attrs["basis_correction_cond"] > 1.0, kw


def test_exact_basis_cut_on_both_sides(tmp_path, monkeypatch) -> None:
    """A sample of part of the file: every token is read exactly when the change's flops reach
    EXACT_BASIS_FLOPS_PER_BYTE per byte of tokens, not a hair below."""
    from mhla_cli.statistics import basis

    path, _ = _tokens_file(tmp_path / "t.h5", N=400)
    info = inspect_tokens(path)
    monkeypatch.setattr(basis, "SAMPLE_TOKENS", 80)  # 8 blocks of 2 sequences: part of the file
    assert basis.sample_blocks(info.n_samples, info.n_tokens) != [(0, 400)]
    ratio = ranges.change_flops(3) / (info.n_tokens * 3 * 4)
    monkeypatch.setattr(ranges, "EXACT_BASIS_FLOPS_PER_BYTE", ratio)
    assert ranges.exact_basis(info, (0, 400))
    monkeypatch.setattr(ranges, "EXACT_BASIS_FLOPS_PER_BYTE", ratio * (1 + 1e-9))
    assert not ranges.exact_basis(info, (0, 400))
    # the change: about 4 q^4 on K from SYMGRAM_MIN_D, two Kronecker products on the Gram below it
    assert ranges.change_flops(24) == 4.0 * 300**4 and ranges.change_flops(3) == 4.0 * 18**2 * 9


def test_the_whole_file_is_featurized_in_its_own_whitening(tmp_path, monkeypatch) -> None:
    """The exact basis (read in several blocks, rotated graded tokens) whitens the data to rounding
    against plain numpy on the tokens, so the sums need no change after the pass; the result equals
    that of a pass started in the tokens' own coordinates (the answer does not depend on the start)."""
    import numpy as np

    from mhla_cli.numerics import CANONICAL_TOL
    from mhla_cli.statistics import basis

    path, X = _tokens_file(tmp_path / "t.h5", N=400)
    monkeypatch.setattr(basis, "SAMPLE_TOKENS", 80)
    monkeypatch.setattr(ranges, "EXACT_BASIS_FLOPS_PER_BYTE", 0.0)
    feats = featurize(path, chunk_size=37)
    A = feats.basis
    G = X.T @ X / X.shape[0]
    assert np.abs(A.T @ G @ A - np.eye(3)).max() < 1e-12
    assert not np.array_equal(A, basis.round32(A))  # not rounded to float32 values
    assert feats.extra_attrs["basis_correction_cond"] == 1.0 and feats.correction() == (None, 1.0)
    assert np.abs(feats.basis_token_gram / feats.token_weight_sum - np.eye(3)).max() <= CANONICAL_TOL
    start = featurize(path, chunk_size=37, basis="identity")
    assert start.extra_attrs["basis_correction_cond"] > 10.0  # changed after its pass
    # its basis is a whitening too (redone in a float32 one: X A M, M orthogonal): the same own sums and
    # the same spectrum of the canonical Gram
    for k in ("gram", "moments", "token_gram"):
        assert relerr(getattr(start, k), getattr(feats, k)) < 1e-11, k
    assert relerr(np.linalg.eigvalsh(start.basis_gram), np.linalg.eigvalsh(feats.basis_gram)) < 1e-11
    # a shard keeps the file's sample estimate (float32 values) and is changed after its pass
    shard = featurize(path, chunk_size=37, shard=(0, 2))
    assert shard.extra_attrs["basis_correction_cond"] > 1.0


def test_the_exact_basis_limits_quoted_in_formats_md() -> None:
    """docs/formats_features.md quotes the constant and where its cut falls for float32 sequences of 16 tokens."""
    from pathlib import Path

    from mhla_cli.io.tokens import TokensInfo

    text = (Path(__file__).resolve().parent.parent / "docs" / "formats_features.md").read_text(encoding="utf-8")
    text = " ".join(text.split())
    assert f"`ranges.EXACT_BASIS_FLOPS_PER_BYTE` = {ranges.EXACT_BASIS_FLOPS_PER_BYTE:g} per byte" in text
    assert "at d = 24 up to 210,937 float32 sequences of 16 tokens, at d = 16 only the 16,384" in text

    def exact(d: int, N: int) -> bool:
        info = TokensInfo(path="x.h5", layout="dense", n_samples=N, d=d, n_tokens=16 * N, dtype="float32",
                          has_targets=True, seq_len=16)
        return ranges.exact_basis(info, (0, N))

    assert exact(24, 210937) and not exact(24, 210938)
    assert exact(16, 16384) and not exact(16, 16385)
