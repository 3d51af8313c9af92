"""The reduction over sample spans: invariant to the chunk size, and the sum over spans equals the whole."""

from __future__ import annotations

import pytest
from conftest import relerr
from mhla_cli import featurize
from mhla_cli.io.tokens import inspect_tokens
from mhla_cli.statistics import spans
from mhla_cli.samples import CAUSAL, LAST
from test_stream import ragged  # noqa: F401 (the fixture)


def test_chunk_size_invariance(ragged) -> None:
    path, tokens, offsets, y = ragged
    N = offsets.size - 1
    results = [featurize(path, chunk_size=c) for c in (1, 7, N)]
    for other in results[1:]:
        for k in ("gram", "moments", "target_gram", "token_gram", "last_token_gram"):
            assert relerr(getattr(other, k), getattr(results[0], k)) < 1e-12, k


def test_reduce_spans_adds_the_parts(ragged) -> None:
    path, tokens, offsets, y = ragged
    info = inspect_tokens(path)
    A = spans.estimate_basis(info)
    whole = spans.reduce_span(info, (0, info.n_samples), 10, basis=A, finalize=False)
    parts = spans.reduce_spans(info, [(0, 40), (40, 41), (41, info.n_samples)], chunk_size=7, basis=A,
                               finalize=False)
    assert parts.n_samples == whole.n_samples == info.n_samples
    assert relerr(parts.basis_gram, whole.basis_gram) < 1e-12
    assert relerr(parts.basis_moments, whole.basis_moments) < 1e-12
    assert spans.default_chunk_size(info) >= 1 and spans.check_spans("on") == "on"


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
    assert spans.exact_basis(info, (0, 60)) and not spans.exact_basis(info, (0, 30))
    for i, kw in enumerate(({"weights": True}, {"per_position": True}, {"weights": True, "per_position": True},
                            {"weights": True, "per_position": True, "attention": "bidirectional"})):
        p = _tokens_file(tmp_path / f"w{i}.h5", **{k: v for k, v in kw.items() if k != "attention"})[0]
        if "attention" in kw:
            with h5py.File(p, "a") as f:
                f.attrs["attention"] = kw["attention"]
        other = inspect_tokens(p)
        assert spans.exact_basis(other, (0, 60)) and not spans.exact_basis(other, (0, 30)), kw
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
    ratio = spans.change_flops(3) / (info.n_tokens * 3 * 4)
    monkeypatch.setattr(spans, "EXACT_BASIS_FLOPS_PER_BYTE", ratio)
    assert spans.exact_basis(info, (0, 400))
    monkeypatch.setattr(spans, "EXACT_BASIS_FLOPS_PER_BYTE", ratio * (1 + 1e-9))
    assert not spans.exact_basis(info, (0, 400))
    # the change: about 4 q^4 on K from SYMGRAM_MIN_D, two Kronecker products on the Gram below it
    assert spans.change_flops(24) == 4.0 * 300**4 and spans.change_flops(3) == 4.0 * 18**2 * 9


def test_the_whole_file_is_featurized_in_its_own_whitening(tmp_path, monkeypatch) -> None:
    """The exact basis (read in several blocks, rotated graded tokens) whitens the data to rounding
    against plain numpy on the tokens, so the sums need no change after the pass; the result equals
    that of a pass started in the tokens' own coordinates (the answer does not depend on the start)."""
    import numpy as np

    from mhla_cli.numerics import CANONICAL_TOL
    from mhla_cli.statistics import basis

    path, X = _tokens_file(tmp_path / "t.h5", N=400)
    monkeypatch.setattr(basis, "SAMPLE_TOKENS", 80)
    monkeypatch.setattr(spans, "EXACT_BASIS_FLOPS_PER_BYTE", 0.0)
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
    assert f"`spans.EXACT_BASIS_FLOPS_PER_BYTE` = {spans.EXACT_BASIS_FLOPS_PER_BYTE:g} per byte" in text
    assert "at d = 24 up to 210,937 float32 sequences of 16 tokens, at d = 16 only the 16,384" in text

    def exact(d: int, N: int) -> bool:
        info = TokensInfo(path="x.h5", layout="dense", n_samples=N, d=d, n_tokens=16 * N, dtype="float32",
                          has_targets=True, seq_len=16)
        return spans.exact_basis(info, (0, N))

    assert exact(24, 210937) and not exact(24, 210938)
    assert exact(16, 16384) and not exact(16, 16385)


def test_the_probe_lies_in_the_sample_and_holds_enough_samples() -> None:
    """`probe_blocks`: disjoint ranges, each inside a block of the basis sample (so the sample's traces
    are the probe's plus PSD terms), about SPANS_PROBE_PER_PAIR samples per pair coordinate in all (prefixes
    for per-position data), at most half the sample; None when the sample is that small."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from mhla_cli.feature_map import n_features
    from mhla_cli.io.tokens import TokensInfo
    from mhla_cli.statistics import basis

    @settings(max_examples=60, deadline=None)
    @given(N=st.integers(1, 400000), n=st.integers(1, 64), d=st.integers(1, 40), causal=st.booleans())
    def check(N: int, n: int, d: int, causal: bool) -> None:
        info = TokensInfo(path="x.h5", layout="dense", n_samples=N, d=d, n_tokens=n * N, dtype="float32",
                          has_targets=True, seq_len=n, samples=CAUSAL if causal else LAST)
        sample = basis.sample_blocks(N, n * N)
        probe = spans.probe_blocks(info)
        size = sum(b - a for a, b in sample)
        if probe is None:
            return
        got = sum(b - a for a, b in probe)
        assert 2 * got <= size
        assert all(a < b for a, b in probe) and all(b0 < a1 for (_, b0), (a1, _) in zip(probe, probe[1:]))
        assert all(any(a0 <= a and b <= b0 for a0, b0 in sample) for a, b in probe)
        q = n_features(d) // d
        rows = got * (n if causal else 1)
        assert rows >= min(spans.SPANS_PROBE_PER_PAIR * q, N * (n if causal else 1))

    check()
    # a small file's sample is the whole file (4000 sequences); a probe of 8 x 300 of them would be more
    # than half of it at d = 24 (q = 300): none
    small = TokensInfo(path="x.h5", layout="dense", n_samples=4000, d=24, n_tokens=4000 * 30, dtype="float32",
                       has_targets=True, seq_len=30)
    assert spans.probe_blocks(small) is None


@pytest.mark.parametrize("per_position", [False, True])
def test_auto_spans_stop_at_the_probe_only_with_room(tmp_path, monkeypatch, per_position: bool) -> None:
    """"auto" on dense Gaussian tokens reads only the probe (nothing is dropped: no span pass); with
    SPANS_PROBE_MARGIN so large that no probe has room, it reads the sample as well and decides the
    same; tokens in a subspace are found reduced with or without the probe (the probe never decides
    that). Per-position data: every prefix is a sample, so the probe holds fewer sequences."""
    import numpy as np

    from mhla_cli.statistics import basis

    monkeypatch.setattr(spans, "SPANS_MIN_FEATURES", 0)  # "auto" at this small psi
    monkeypatch.setattr(basis, "SAMPLE_TOKENS", 1 << 14)  # blocks of 204 sequences; the probe 15 (2) each
    path, _ = _tokens_file(tmp_path / "t.h5", N=2000, n=10, d=5, per_position=per_position)
    read: list[tuple[int, int]] = []
    traces = spans.span_traces

    def recording(info, span, *args, **kwargs):
        read.append(span)
        return traces(info, span, *args, **kwargs)

    monkeypatch.setattr(spans, "span_traces", recording)
    info = inspect_tokens(path)
    A = spans.estimate_basis(info)
    probe, sample = spans.probe_blocks(info), basis.sample_blocks(info.n_samples, info.n_tokens)
    assert probe is not None and sum(b - a for a, b in probe) == 8 * (2 if per_position else 15)
    assert info.per_position == per_position
    found, _, passes = spans.find_spans(info, A, (0, info.n_samples), 100)
    assert found is None and passes == 0 and read == probe
    read.clear()
    monkeypatch.setattr(spans, "SPANS_PROBE_MARGIN", 1e300)
    found, _, passes = spans.find_spans(info, A, (0, info.n_samples), 100)
    assert found is None and passes == 0 and read == probe + sample
    # the same tokens in a 3-d subspace of R^5: the probe is reduced, the sample and then the data decide
    monkeypatch.setattr(spans, "SPANS_PROBE_MARGIN", 1e6)
    import h5py

    with h5py.File(path, "r+") as f:
        X = f["tokens"][...]
        rng = np.random.default_rng(5)
        f["tokens"][...] = (X[..., :3] @ rng.standard_normal((3, 5))).astype(np.float32)
    info = inspect_tokens(path)
    read.clear()
    found, _, passes = spans.find_spans(info, spans.estimate_basis(info), (0, info.n_samples), 100)
    assert found is not None and found[1].shape[1] == 3 and passes >= 1
    assert read[:len(probe)] == probe and read[len(probe):len(probe) + len(sample)] == sample


def test_the_probe_constants_quoted_in_formats_md() -> None:
    """docs/formats_features.md quotes the probe's size and margin as the code has them."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "formats_features.md").read_text(encoding="utf-8")
    text = " ".join(text.split())
    assert f"`spans.SPANS_PROBE_PER_PAIR` = {spans.SPANS_PROBE_PER_PAIR} samples per pair coordinate" in text
    assert f"`spans.SPANS_PROBE_MARGIN` = {spans.SPANS_PROBE_MARGIN:g} times the cut" in text
