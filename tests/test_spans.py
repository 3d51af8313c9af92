"""The passes that find the data's spans: the probe of the basis sample, and "auto" deciding on it."""

from __future__ import annotations

import pytest
from mhla_cli.io.tokens import inspect_tokens
from mhla_cli.samples import CAUSAL, LAST
from mhla_cli.statistics import ranges, spans
from test_ranges import _tokens_file


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

    def recording(info, sample_range, *args, **kwargs):
        read.append(sample_range)
        return traces(info, sample_range, *args, **kwargs)

    monkeypatch.setattr(spans, "span_traces", recording)
    info = inspect_tokens(path)
    A = ranges.estimate_basis(info)
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
    found, _, passes = spans.find_spans(info, ranges.estimate_basis(info), (0, info.n_samples), 100)
    assert found is not None and found[1].shape[1] == 3 and passes >= 1
    assert read[:len(probe)] == probe and read[len(probe):len(probe) + len(sample)] == sample


def test_the_probe_constants_quoted_in_formats_md() -> None:
    """docs/formats_features.md quotes the probe's size and margin as the code has them."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "formats_features.md").read_text(encoding="utf-8")
    text = " ".join(text.split())
    assert f"`spans.SPANS_PROBE_PER_PAIR` = {spans.SPANS_PROBE_PER_PAIR} samples per pair coordinate" in text
    assert f"`spans.SPANS_PROBE_MARGIN` = {spans.SPANS_PROBE_MARGIN:g} times the cut" in text


def test_the_spans_option_is_one_of_auto_on_off() -> None:
    from mhla_cli.errors import InputError

    assert [spans.check_spans(s) for s in spans.SPANS] == ["auto", "on", "off"]
    with pytest.raises(InputError, match="unknown spans option 'yes'"):
        spans.check_spans("yes")
