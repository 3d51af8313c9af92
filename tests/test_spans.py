"""The reduction over sample spans: invariant to the chunk size, and the sum over spans equals the whole."""

from __future__ import annotations

from conftest import relerr
from mhla_cli import featurize
from mhla_cli.io.tokens import inspect_tokens
from mhla_cli.statistics import spans
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
