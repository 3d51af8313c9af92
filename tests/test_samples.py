"""The sample layouts (mhla_cli.samples): each layout's (S, x) pairs, Gram rows, token weights and divisor equal
their definitions, written out sample by sample in plain numpy; the layouts as file attributes and across
processes."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from conftest import relerr
from mhla_cli.errors import InputError
from mhla_cli.samples import (BIDIRECTIONAL, CAUSAL, LAST, LAYOUTS, from_attrs, named, samples_of)


def _chunk(seed: int = 0, d: int = 3) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 7, size=9)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    X = rng.standard_normal((int(off[-1]), d))
    w = rng.uniform(0.0, 2.0, int(off[-1]))
    w[rng.random(w.size) < 0.3] = 0.0
    return X, off, w, rng.standard_normal((int(off[-1]), 2))


def _pairs(X: np.ndarray, off: np.ndarray, samples) -> list[tuple[np.ndarray, np.ndarray, float, int]]:
    """Every sample's (S, x, divisor, row of its per-sample data), from the definitions."""
    out = []
    for i, (a, b) in enumerate(zip(off[:-1], off[1:])):
        W = X[a:b]
        if samples is LAST:
            out.append((W.T @ W, W[-1], b - a, i))
        for t in range(a, b):
            if samples is CAUSAL:
                P = X[a:t + 1]
                out.append((P.T @ P, X[t], t + 1 - a, t))
            elif samples is BIDIRECTIONAL:
                out.append((W.T @ W, X[t], b - a, t))
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("normalize", ["none", "length"])
def test_queries_are_the_samples_pairs(name: str, normalize: str) -> None:
    samples = named(name)
    X, off, _, _ = _chunk(1)
    q = samples.queries(X, off, normalize)
    want = _pairs(X, off, samples)
    j, k = np.triu_indices(3)
    upper = q.sample_upper()
    assert upper.shape[0] == q.x.shape[0] == len(want) == samples.count(off.size - 1, X.shape[0])
    for r, (S, x, n, _) in enumerate(want):
        assert relerr(upper[r], S[j, k] / (n if normalize == "length" else 1)) < 1e-14
        assert np.array_equal(q.x[r], x)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("weighted", [False, True])
def test_token_weights_and_rows_sum_to_the_samples(name: str, weighted: bool) -> None:
    """sum_samples w S = sum_tokens c x x^T; sum_samples w x x^T from the query rows and weights; the Gram
    and moments of the rows (rank-one or a window's second moments) equal sum_samples w h h^T and w h y^T."""
    samples = named(name)
    X, off, w_pos, Y_pos = _chunk(2)
    B = off.size - 1
    w = (w_pos if samples.per_position else w_pos[:B]) if weighted else None
    Y = Y_pos if samples.per_position else Y_pos[:B]
    want = _pairs(X, off, samples)
    ws = np.ones(len(want)) if w is None else w
    c, rows, qw = samples.token_weights(off, w)
    c = np.ones(X.shape[0]) if c is None else c
    assert relerr(np.einsum("t,ti,tj->ij", c, X, X), sum(ws[i] * S for i, (S, _, _, _) in enumerate(want))) < 1e-13
    Xq = X if rows is None else X[rows]
    qw = np.ones(Xq.shape[0]) if qw is None else qw
    assert relerr(np.einsum("t,ti,tj->ij", qw, Xq, Xq), sum(ws[i] * np.outer(x, x) for i, (_, x, _, _) in
                                                             enumerate(want))) < 1e-13
    j, k = np.triu_indices(3)
    G = M = 0.0
    for i, (S, x, _, r) in enumerate(want):
        h = np.kron(S[j, k], x)
        G, M = G + ws[i] * np.outer(h, h), M + ws[i] * np.outer(h, Y[r])
    rw = samples.rows(X, off, w, Y)
    assert rw.n_samples == int((ws > 0).sum()) and (rw.xx is not None) == samples.window_rows
    Gr = Mr = 0.0
    for r in range(rw.n_rows):
        s = rw.upper[r]
        if rw.xx is None:
            wr = 1.0 if rw.w is None else rw.w[r]
            V, Z = wr * np.outer(rw.x[r], rw.x[r]), wr * np.outer(rw.x[r], rw.y[r])
        else:
            V, Z = rw.xx[r], rw.xy[r]
        Gr = Gr + np.einsum("a,b,lm->albm", s, s, V).reshape(G.shape)
        Mr = Mr + np.einsum("a,le->ale", s, Z).reshape(M.shape)
    assert relerr(Gr, G) < 1e-12 and relerr(Mr, M) < 1e-12
    if rw.xx is not None:  # the target sums of a window's samples
        assert relerr(rw.yy, np.einsum("t,te,tf->ef", ws, Y, Y)) < 1e-13 and relerr(rw.y_sum, ws @ Y) < 1e-13
    if rw.token_grams is not None:  # the token Grams the rows carry: sum w S, sum w x x^T, sum x x^T
        tg, qg, plain = rw.token_grams
        assert relerr(tg, sum(ws[i] * S for i, (S, _, _, _) in enumerate(want))) < 1e-13
        assert relerr(qg, sum(ws[i] * np.outer(x, x) for i, (_, x, _, _) in enumerate(want))) < 1e-13
        assert relerr(plain, X.T @ X) < 1e-13


def test_layouts_as_file_attributes_and_across_processes() -> None:
    for s in LAYOUTS.values():
        assert from_attrs(s.attrs()) is s
        assert pickle.loads(pickle.dumps(s)) is s  # one singleton per layout, in workers too
    assert from_attrs({"per_position": 1}) is CAUSAL  # files before the attribute
    assert from_attrs({}) is LAST and samples_of(True, None) is CAUSAL
    assert from_attrs({"per_position": 1, "attention": b"bidirectional"}) is BIDIRECTIONAL
    for attrs in ({"per_position": 1, "attention": "full"}, {"per_position": 0, "attention": "causal"}):
        with pytest.raises(InputError, match="attention"):
            from_attrs(attrs)
    with pytest.raises(InputError, match="per_position=True"):
        samples_of(False, "bidirectional")
    with pytest.raises(InputError, match="unknown sample layout"):
        named("sliding")
    assert CAUSAL.rows_per_sequence(12.5) == 12.5 and BIDIRECTIONAL.rows_per_sequence(12.5) == 1.0
    assert LAST.count(10, 70) == 10 and BIDIRECTIONAL.count(10, 70) == 70
