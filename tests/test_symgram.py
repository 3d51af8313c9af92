"""The Gram from its distinct entries (mhla_cli.linalg.symgram): K = U^T V on every path of the accumulation,
against materialised features in plain numpy (tests/_reference.py)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _reference as ref
from conftest import assert_same_stats, relerr, write_tokens
from mhla_cli.linalg import backends
from mhla_cli.statistics import accumulate
from mhla_cli.linalg import symgram
from mhla_cli import featurize
from mhla_cli.io.tokens import inspect_tokens
from mhla_cli.statistics.ranges import accumulate_range
from mhla_cli.linalg.backends import MIN_THREADED_WIDTH

# the gram derived from K against the materialised reference (issue 24)
TOL = 1e-13


@pytest.fixture(params=["pairs", "syrk"])
def kernel(request, monkeypatch) -> str:
    """Run a test with the accumulation on K for every d ("pairs") and on the syrk for every d."""
    monkeypatch.setattr(symgram, "SYMGRAM_MIN_D", 1 if request.param == "pairs" else 10**9)
    return request.param


# ---------------------------------------------------------------- the kernel


@pytest.mark.parametrize("panel", [8, 8 * 7 * 9, None])  # one a-block per GEMM, a few merged, all in one
@pytest.mark.parametrize("q,d,t", [(1, 1, 1), (3, 2, 2), (6, 3, 0), (10, 4, 4), (4, 2, 3), (21, 6, 6)])
def test_kernel_equals_materialised_rows(q: int, d: int, t: int, panel: int | None, monkeypatch) -> None:
    if panel is not None:
        monkeypatch.setattr(symgram, "PAIRS_PANEL_BYTES", panel)
    rng = np.random.default_rng(q * 31 + d)
    sg = symgram.SymGram(q, d, t)
    rows, ys = [], []
    for R in (7, 0, 1, 40):  # chunks of several sizes, an empty one among them
        s, x, y = rng.standard_normal((q, R)), rng.standard_normal((d, R)), rng.standard_normal((t, R))
        sg.add(s, x, y if t else None)
        rows.append((s[:, None, :] * x[None, :, :]).reshape(q * d, R))
        ys.append(y)
    H, Y = np.hstack(rows), np.hstack(ys)
    G = sg.gram()
    assert np.array_equal(G, G.T)  # exactly symmetric by construction
    assert relerr(G, H @ H.T) < TOL
    if t:
        assert relerr(sg.moments(), H @ Y.T) < TOL and relerr(sg.target_gram(), Y @ Y.T) < TOL
    else:
        assert sg.moments() is None and sg.target_gram() is None
    assert np.array_equal(symgram.pairs_from_gram(G, q, d), sg.K)
    assert sg.K.shape == symgram.pairs_shape(q, d) == (q * (q + 1) // 2, d * (d + 1) // 2)


def test_panels_over_python_threads_give_the_same_sums(monkeypatch) -> None:
    """`threads`: the panels shared out over Python threads (one BLAS thread each) give the same K,
    bit for bit, as one thread on one BLAS thread."""
    from threadpoolctl import threadpool_limits

    monkeypatch.setattr(symgram, "PAIRS_PANEL_BYTES", 8 * 30 * 9)  # several panels for each thread
    rng = np.random.default_rng(9)
    s, x, y = rng.standard_normal((21, 30)), rng.standard_normal((6, 30)), rng.standard_normal((6, 30))
    one, many = symgram.SymGram(21, 6, 6), symgram.SymGram(21, 6, 6)
    with threadpool_limits(limits=1, user_api="blas"):
        one.add(s, x, y)
    many.add(s, x, y, threads=3)
    assert np.array_equal(one.K, many.K) and np.array_equal(one.M, many.M)
    H = (s[:, None, :] * x[None, :, :]).reshape(126, 30)
    assert relerr(many.gram(), H @ H.T) < TOL


def _blas_now() -> list[int]:
    from threadpoolctl import threadpool_info

    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


def test_pipeline_gives_the_blocking_sums_bit_for_bit(monkeypatch) -> None:
    """`pipeline`: chunks handed out while the caller overwrites its own buffers for the next one (as the
    accumulation does) give K, the moments and the target Gram of the blocking `add`, bit for bit, and BLAS
    is back at its thread count after the block."""
    monkeypatch.setattr(symgram, "PAIRS_PANEL_BYTES", 8 * 40 * 9)  # several panels for each thread
    rng = np.random.default_rng(4)
    q, d = 21, 6
    chunks = [(rng.standard_normal((q, R)), rng.standard_normal((d, R)), rng.standard_normal((d, R)))
              for R in (40, 3, 40, 17, 1)]
    blocking = symgram.SymGram(q, d, d)
    for s, x, y in chunks:
        blocking.add(s, x, y, threads=3)
    before = _blas_now()
    piped = symgram.SymGram(q, d, d)
    with piped.pipeline(3):
        for s, x, y in chunks:
            bufs = (s.copy(), x.copy(), y.copy())
            piped.add(*bufs)
            for b in bufs:  # the caller's next chunk goes into the same buffers at once
                b[...] = np.nan
        assert _blas_now() == [1] * len(before)  # one BLAS thread for every panel in the block
    assert _blas_now() == before
    assert np.array_equal(piped.K, blocking.K) and np.array_equal(piped.M, blocking.M)
    assert np.array_equal(piped.target_gram(), blocking.target_gram())


def test_window_rows_equal_the_rows_of_their_positions(monkeypatch) -> None:
    """`add_windows`: a row (s, xx = sum_t x_t x_t^T, xy = sum_t x_t y_t^T) gives the K, moments and target Gram
    of its positions' rank-one rows (s, x_t, y_t), blocking, over Python threads and in the pipeline (the
    caller's arrays overwritten at once); and K expands to the materialised Gram."""
    monkeypatch.setattr(symgram, "PAIRS_PANEL_BYTES", 8 * 12 * 9)  # several panels for each thread
    rng = np.random.default_rng(6)
    q, d = 21, 6
    windows = []
    for R in (12, 1, 7):
        n = rng.integers(1, 5, size=R)
        s = rng.standard_normal((q, R))
        X = [rng.standard_normal((k, d)) for k in n]
        Y = [rng.standard_normal((k, d)) for k in n]
        windows.append((s, X, Y))
    ranked = symgram.SymGram(q, d, d)
    for s, X, Y in windows:
        cols = np.repeat(np.arange(s.shape[1]), [len(x) for x in X])
        ranked.add(s[:, cols], np.concatenate(X).T, np.concatenate(Y).T)
    blocking, threaded, piped = (symgram.SymGram(q, d, d) for _ in range(3))

    def parts(s, X, Y):
        return (s.copy(), np.stack([x.T @ x for x in X]), np.stack([x.T @ y for x, y in zip(X, Y)]),
                sum(y.T @ y for y in Y))
    for w in windows:
        blocking.add_windows(*parts(*w))
        threaded.add_windows(*parts(*w), threads=3)
    with piped.pipeline(3):
        for w in windows:
            bufs = parts(*w)
            piped.add_windows(*bufs)
            for b in bufs:
                b[...] = np.nan
    for g in (blocking, threaded, piped):
        assert relerr(g.K, ranked.K) < TOL and relerr(g.M, ranked.M) < TOL
        assert relerr(g.target_gram(), ranked.target_gram()) < TOL
    assert np.array_equal(threaded.K, piped.K) and np.array_equal(threaded.M, piped.M)
    H = np.concatenate([np.repeat(s, [len(x) for x in X], axis=1)[:, None, :] * np.concatenate(X).T[None]
                        for s, X, _ in windows], axis=2).reshape(q * d, -1)
    assert relerr(blocking.gram(), H @ H.T) < TOL


def test_pipeline_joins_and_restores_blas_on_an_error(monkeypatch) -> None:
    """An error in the caller's loop: the chunk in flight is joined, BLAS gets its threads back, the
    error is the caller's; an error in a panel's work is raised at the block's exit."""
    rng = np.random.default_rng(5)
    s, x = rng.standard_normal((21, 30)), rng.standard_normal((6, 30))
    before = _blas_now()
    sg = symgram.SymGram(21, 6)
    with pytest.raises(KeyError, match="the caller's"):
        with sg.pipeline(2):
            sg.add(s, x)
            raise KeyError("the caller's")
    assert _blas_now() == before and sg._pending == [] and sg._pool is None
    good = symgram.SymGram(21, 6)
    good.add(s, x)
    assert np.array_equal(sg.K, good.K)  # the chunk in flight was finished, not dropped
    real = symgram.work_array

    def broken(pool, name, rows, cols):
        if name.startswith("T"):
            raise MemoryError("a panel's block")
        return real(pool, name, rows, cols)

    monkeypatch.setattr(symgram, "work_array", broken)
    bad = symgram.SymGram(21, 6)
    with pytest.raises(MemoryError, match="a panel's block"):
        with bad.pipeline(2):
            bad.add(s, x)
    assert _blas_now() == before and bad._pool is None


def test_the_pipeline_only_on_the_main_thread(monkeypatch) -> None:
    """HostGram.pipeline opens SymGram's pipeline for a wide block on the main thread only (worker
    threads of one process would set the process-wide BLAS limit over each other)."""
    import threading

    monkeypatch.setattr(backends, "_blas_threads", lambda: 2)
    d = 13
    q = symgram.n_pairs(d)
    seen: dict[str, bool] = {}

    def probe(name: str) -> None:
        g = backends.HostGram(q, d, 0, q * d, q * d)
        with g.pipeline():
            seen[name] = g._pairs._pool is not None

    probe("main")
    t = threading.Thread(target=probe, args=("worker",))
    t.start()
    t.join()
    assert seen == {"main": True, "worker": False}
    narrow = backends.HostGram(symgram.n_pairs(12), 12, 0, 100, 100)  # below MIN_THREADED_WIDTH
    with narrow.pipeline():
        assert narrow._pairs._pool is None


def test_featurize_that_fails_in_a_late_chunk_gives_blas_back(tmp_path: Path, monkeypatch) -> None:
    """A wide block in the pipeline (d = 13, two threads): a NaN in the last chunk is an input error and
    leaves BLAS as it was."""
    from mhla_cli.errors import InputError

    d = 13
    rng = np.random.default_rng(6)
    X, y = rng.standard_normal((150, 4, d)), rng.standard_normal((150, d))
    X[-1, 2, 3] = np.nan
    path = write_tokens(tmp_path / "nan.h5", X, None, y)
    monkeypatch.setattr(backends, "_blas_threads", lambda: 2)
    before = _blas_now()
    with pytest.raises(InputError):
        featurize(path, chunk_size=60, spans="off", basis="identity")
    assert _blas_now() == before


def test_gram_from_pairs_refuses_a_wrong_shape() -> None:
    with pytest.raises(ValueError, match="shape"):
        symgram.gram_from_pairs(np.zeros((3, 4)), 2, 2)


def test_pair_positions_is_the_upper_triangle_order() -> None:
    P = symgram.pair_positions(4)
    a, b = np.triu_indices(4)
    assert np.array_equal(P[a, b], np.arange(a.size)) and np.array_equal(P, P.T)


def test_rule_uses_pairs_from_the_measured_width() -> None:
    m = symgram.SYMGRAM_MIN_D
    assert symgram.use_pairs(m * (m + 1) // 2, m) and not symgram.use_pairs(m * m, m - 1)
    assert symgram.accumulator(m * (m + 1) // 2, m - 1) is None
    assert isinstance(symgram.accumulator(m * (m + 1) // 2, m, m), symgram.SymGram)


# ---------------------------------------------------------------- the accumulation against the reference


def _reference_gram(X: np.ndarray, off: np.ndarray, A: np.ndarray, per_position: bool, w: np.ndarray | None,
                    normalize: str, y: np.ndarray | None, spans: tuple[np.ndarray, np.ndarray] | None = None
                    ) -> tuple[np.ndarray, np.ndarray | None, int]:
    """sum w Ht Ht^T and sum w Ht y^T of the canonical features of X A (or of their block on `spans`)."""
    rows, ws, ts = [], [], []
    for Xs, wt, r in ref.samples(X, off, per_position, w):
        if wt > 0:
            h = ref.canonical_features(Xs @ A, normalize)
            if spans is not None:
                E, F = spans
                d = X.shape[1]
                h = (E.T @ h.reshape(-1, d) @ F).reshape(-1)  # (E^T s) (x) (F^T x_n)
            rows.append(h)
            ws.append(wt)
            ts.append(r)
    H, wv = np.stack(rows), np.array(ws)
    M = None if y is None else (H * wv[:, None]).T @ y[ts]
    return (H * wv[:, None]).T @ H, M, len(rows)


def _data(kind: str, d: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Tokens files of every kind the accumulation reads."""
    if kind == "dense":
        return {"tokens": rng.standard_normal((23, 4, d)), "targets": rng.standard_normal((23, d))}
    if kind == "single":
        return {"tokens": rng.standard_normal((5, d)), "offsets": np.array([0, 5]),
                "targets": rng.standard_normal((1, d))}
    lengths = rng.integers(1, 9, size=31)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    X = rng.standard_normal((int(off[-1]), d)).astype(np.float32)
    out = {"tokens": X, "offsets": off}
    if kind in ("ragged", "weighted"):
        out["targets"] = rng.standard_normal((31, d))
    if kind == "weighted":
        w = rng.random(31) * 2
        w[::3] = 0.0  # weights with zeros
        out["weights"] = w
    if kind in ("causal", "causal-weighted"):
        out["targets"] = rng.standard_normal((X.shape[0], d))
    if kind == "causal-weighted":
        w = rng.random(X.shape[0])
        w[::4] = 0.0
        out["weights"] = w
    return out


def _write(path: Path, data: dict[str, np.ndarray]) -> Path:
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f[k] = v
    return path


KINDS = ["dense", "ragged", "weighted", "causal", "causal-weighted", "single"]


@pytest.mark.parametrize("normalize", ["none", "length"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [1, 2, 3])
def test_reduction_equals_the_reference(tmp_path: Path, kernel: str, kind: str, d: int, normalize: str) -> None:
    rng = np.random.default_rng(d * 7 + KINDS.index(kind))
    data = _data(kind, d, rng)
    info = inspect_tokens(_write(tmp_path / "t.h5", data))
    A = np.linalg.qr(rng.standard_normal((d, d)))[0] * 1.5 + 0.1 * np.eye(d)  # a basis with a transform
    X = data["tokens"].reshape(-1, d).astype(np.float64)
    off = data.get("offsets", np.arange(data["tokens"].shape[0] + 1) * (data["tokens"].shape[1]
                                                                       if data["tokens"].ndim == 3 else 1))
    y = data["targets"].reshape(-1, d)
    G, M, n = _reference_gram(X, off, A, info.per_position, data.get("weights"), normalize, y)
    for chunk in (3, None):  # several chunks (the empty chunks of zero weights among them), one chunk
        f = accumulate_range(info, (0, info.n_samples), chunk, normalize=normalize, basis=A, finalize=False)
        assert f.n_samples == n
        assert relerr(f.basis_gram, G) < TOL and relerr(f.basis_moments, M) < TOL
        assert np.array_equal(f.basis_gram, f.basis_gram.T)


@pytest.mark.parametrize("kind", ["ragged", "causal-weighted"])
def test_reduction_on_spans_equals_the_reference(tmp_path: Path, kernel: str, kind: str) -> None:
    d = 3
    rng = np.random.default_rng(5)
    data = _data(kind, d, rng)
    info = inspect_tokens(_write(tmp_path / "t.h5", data))
    E = np.linalg.qr(rng.standard_normal((6, 4)))[0]
    F = np.linalg.qr(rng.standard_normal((3, 2)))[0]
    X = data["tokens"].astype(np.float64)
    G, M, n = _reference_gram(X, data["offsets"], np.eye(d), info.per_position, data.get("weights"), "none",
                              data["targets"], spans=(E, F))
    f = accumulate_range(info, (0, info.n_samples), 4, basis=np.eye(d), finalize=False, spans=(E, F))
    assert f.on_spans and f.n_samples == n
    assert relerr(f.basis_gram, G) < TOL and relerr(f.basis_moments, M) < TOL


def test_empty_range_and_all_zero_weights(tmp_path: Path, kernel: str) -> None:
    rng = np.random.default_rng(8)
    data = _data("weighted", 2, rng)
    data["weights"][:10] = 0.0
    info = inspect_tokens(_write(tmp_path / "t.h5", data))
    empty = accumulate_range(info, (4, 4), basis=np.eye(2), finalize=False)
    zero = accumulate_range(info, (0, 10), 3, basis=np.eye(2), finalize=False)  # every weight 0
    for f in (empty, zero):
        assert f.n_samples == 0 and not f.basis_gram.any() and not f.basis_moments.any()
        assert f.basis_gram.shape == (6, 6)  # psi = d^2 (d + 1) / 2


def test_at_the_rule_width_without_forcing(tmp_path: Path) -> None:
    """d = SYMGRAM_MIN_D takes the K path by itself; it equals the reference and the syrk path."""
    d = symgram.SYMGRAM_MIN_D
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 6, size=40)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    X, y = rng.standard_normal((int(off[-1]), d)), rng.standard_normal((40, d))
    w = rng.random(40)
    w[::5] = 0.0
    path = _write(tmp_path / "t.h5", {"tokens": X, "offsets": off, "targets": y, "weights": w})
    info = inspect_tokens(path)
    acc = accumulate.Accumulator(d, True)
    assert acc._gram._pairs is not None
    G, M, n = _reference_gram(X, off, np.eye(d), False, w, "none", y)
    f = accumulate_range(info, (0, 40), 7, basis=np.eye(d), finalize=False)
    assert relerr(f.basis_gram, G) < TOL and relerr(f.basis_moments, M) < TOL and f.n_samples == n


def test_featurize_paths_equal_the_syrk(tmp_path: Path, monkeypatch) -> None:
    """Serial, shards, workers and the spans of featurize: K and the syrk give the same statistics."""
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 12, size=60)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    X = rng.standard_normal((int(off[-1]), 3))
    X[:, 2] = X[:, 0] - X[:, 1]  # tokens in a 2-d subspace: the data have spans
    path = write_tokens(tmp_path / "t.h5", X, off, rng.standard_normal((60, 3)))
    runs = {}
    for rule in (1, 10**9):
        monkeypatch.setattr(symgram, "SYMGRAM_MIN_D", rule)
        serial = featurize(path, chunk_size=9)
        sharded = featurize(path, shard=(0, 2), chunk_size=7) + featurize(path, shard=(1, 2), chunk_size=7)
        pooled = featurize(path, workers=2, chunk_size=11)
        on_spans = featurize(path, spans="on", chunk_size=9)
        runs[rule] = (serial, sharded, pooled, on_spans)
    for a, b in zip(*runs.values()):
        if a.on_spans:
            assert relerr(a.basis_gram, b.basis_gram) < 1e-12
        else:
            assert_same_stats(a, b)


@pytest.mark.parametrize("kind", ["dense", "weighted", "causal-weighted", "single"])
def test_device_reduction_equals_the_reference(tmp_path: Path, kernel: str, kind: str) -> None:
    """The torch backend (device.DevicePairs for K, device.DeviceGram for the syrk form)."""
    pytest.importorskip("torch")
    d = 3
    rng = np.random.default_rng(11 + KINDS.index(kind))
    data = _data(kind, d, rng)
    info = inspect_tokens(_write(tmp_path / "t.h5", data))
    X = data["tokens"].reshape(-1, d).astype(np.float64)
    off = data.get("offsets", np.arange(data["tokens"].shape[0] + 1) * (data["tokens"].shape[1]
                                                                       if data["tokens"].ndim == 3 else 1))
    G, M, n = _reference_gram(X, off, np.eye(d), info.per_position, data.get("weights"), "length",
                              data["targets"].reshape(-1, d))
    f = accumulate_range(info, (0, info.n_samples), 5, normalize="length", basis=np.eye(d), finalize=False,
                           device="torch:cpu")
    assert f.n_samples == n and relerr(f.basis_gram, G) < TOL and relerr(f.basis_moments, M) < TOL
    E = np.linalg.qr(rng.standard_normal((6, 3)))[0]
    F = np.linalg.qr(rng.standard_normal((3, 2)))[0]
    Gs, Ms, _ = _reference_gram(X, off, np.eye(d), info.per_position, data.get("weights"), "none",
                                data["targets"].reshape(-1, d), spans=(E, F))
    g = accumulate_range(info, (0, info.n_samples), 5, basis=np.eye(d), finalize=False, spans=(E, F),
                           device="torch:cpu")
    assert relerr(g.basis_gram, Gs) < TOL and relerr(g.basis_moments, Ms) < TOL


def test_a_wide_block_with_threaded_panels_equals_the_syrk(tmp_path: Path, monkeypatch) -> None:
    """d = 13 (psi + d >= MIN_THREADED_WIDTH): the panels go over Python threads; the statistics
    equal those of the syrk path."""
    d = 13
    assert symgram.n_pairs(d) * d + d >= MIN_THREADED_WIDTH
    rng = np.random.default_rng(12)
    X, y = rng.standard_normal((150, 4, d)), rng.standard_normal((150, d))
    path = write_tokens(tmp_path / "w.h5", X, None, y)
    monkeypatch.setattr(backends, "_blas_threads", lambda: 2)  # two threads even on a one-core runner
    monkeypatch.setattr(symgram, "PAIRS_PANEL_BYTES", 8 * 150 * 2000)  # several panels per thread
    a = featurize(path, chunk_size=60, spans="off")
    monkeypatch.setattr(symgram, "SYMGRAM_MIN_D", 10**9)
    b = featurize(path, chunk_size=60, spans="off")
    assert_same_stats(a, b)


# ---------------------------------------------------------------- the held form (symgram.Pairs)


def _rows_gram(rng: np.random.Generator, q: int, r: int, n: int = 17) -> tuple[np.ndarray, np.ndarray]:
    """(s (x) x rows (n, q r), their Gram): materialised, in plain numpy."""
    s, x = rng.standard_normal((n, q)), rng.standard_normal((n, r))
    H = (s[:, :, None] * x[:, None, :]).reshape(n, q * r)
    return H, H.T @ H


@settings(max_examples=40, deadline=None)
@given(q=st.integers(1, 7), r=st.integers(1, 5), q2=st.integers(1, 7), r2=st.integers(1, 5),
       seed=st.integers(0, 2**16), small_blocks=st.booleans(), overwrite=st.booleans(), square=st.booleans())
def test_congruence_on_the_factors_equals_the_materialised_kron(q: int, r: int, q2: int, r2: int, seed: int,
                                                                 small_blocks: bool, overwrite: bool,
                                                                 square: bool) -> None:
    """Pairs.congruence(P, R) is the K of kron(P, R) Gram kron(P, R)^T for every shape of the factors
    (square, wider, narrower: a change of basis, a block's expansion onto its spans), in one block of
    columns or in blocks of one column (of rows, for the token step in place), over K or beside it."""
    rng = np.random.default_rng(seed)
    if square:
        q2, r2 = q, r
    H, G = _rows_gram(rng, q, r)
    P, R = rng.standard_normal((q2, q)), rng.standard_normal((r2, r))
    K0 = symgram.pairs_from_gram(G, q, r)
    pairs = symgram.Pairs(K0.copy(), q, r)
    with pytest.MonkeyPatch.context() as mp:
        if small_blocks:
            mp.setattr(symgram, "CONGRUENCE_BLOCK_BYTES", 1)  # one column (row) per block
        out = pairs.congruence(P, R, overwrite=overwrite)
    Hc = H @ np.kron(P, R).T  # the rows in the new coordinates, materialised
    assert (out.q, out.r) == (q2, r2) and out.shape == (q2 * r2, q2 * r2)
    assert relerr(out.expand(), Hc.T @ Hc) < TOL
    in_place = overwrite and (q2, r2) == (q, r)
    assert np.shares_memory(out.K, pairs.K) == in_place  # over K exactly when asked and square
    if not in_place:
        assert np.array_equal(pairs.K, K0)  # the input is not changed


def test_congruence_never_writes_over_a_read_only_k() -> None:
    rng = np.random.default_rng(5)
    _, G = _rows_gram(rng, 4, 3)
    K = symgram.pairs_from_gram(G, 4, 3)
    K.setflags(write=False)
    P, R = rng.standard_normal((4, 4)), rng.standard_normal((3, 3))
    out = symgram.Pairs(K, 4, 3).congruence(P, R, overwrite=True)
    assert not np.shares_memory(out.K, K)
    assert relerr(out.K, symgram.Pairs(K.copy(), 4, 3).congruence(P, R).K) < TOL


def test_token_pair_map_maps_the_upper_triangle() -> None:
    rng = np.random.default_rng(2)
    for r, r2 in ((1, 1), (3, 3), (4, 2), (2, 5)):
        X = rng.standard_normal((r, r))
        X = X + X.T
        R = rng.standard_normal((r2, r))
        assert relerr(symgram.token_pair_map(R) @ X[np.triu_indices(r)], (R @ X @ R.T)[np.triu_indices(r2)]) < TOL


def test_pairs_refuse_wrong_shapes() -> None:
    with pytest.raises(ValueError, match="expected"):
        symgram.Pairs(np.zeros((3, 4)), 2, 2)
    p = symgram.Pairs(np.zeros(symgram.pairs_shape(3, 2)), 3, 2)
    with pytest.raises(ValueError, match="do not act"):
        p.congruence(np.eye(2), np.eye(2))


@pytest.mark.parametrize("rows", [1, 5, 6, 10**6])  # one pair row per block, uneven blocks, the whole Gram
def test_gram_rows_give_the_gram_block_by_block(rows: int) -> None:
    rng = np.random.default_rng(rows)
    q, r = 5, 3
    _, G = _rows_gram(rng, q, r)
    K = symgram.pairs_from_gram(G, q, r)
    got = np.full_like(G, np.nan)
    for r0, block in symgram.gram_rows(K, q, r, rows=rows):
        assert block.shape[0] % r == 0 and block.shape[0] <= max(r, rows)
        got[r0:r0 + block.shape[0]] = block
    assert relerr(got, G) < TOL and np.array_equal(got, symgram.gram_from_pairs(K, q, r))


@pytest.mark.parametrize("blocks", [1, 3, 4, 1000])
@pytest.mark.parametrize("shape", [(7, 7), (5, 7), (9, 7)])
def test_pair_step_triangle_blocks_match_plain_numpy(monkeypatch, blocks: int, shape: tuple[int, int]) -> None:
    """The pair step's GEMM in PAIR_TRIANGLE_BLOCKS row blocks (from one block to one row each, more
    blocks than rows, square and rectangular P) gives upper(P M_j P^T) of every column's symmetric M_j,
    against plain numpy on the expanded matrices."""
    monkeypatch.setattr(symgram, "PAIR_TRIANGLE_BLOCKS", blocks)
    rng = np.random.default_rng(blocks)
    q2, q = shape
    P = rng.standard_normal((q2, q))
    block = rng.standard_normal((symgram.n_pairs(q), 4))
    got = symgram._pair_congruence(block, P, {})
    a, b = np.triu_indices(q)
    a2, b2 = np.triu_indices(q2)
    for j in range(block.shape[1]):
        M = np.zeros((q, q))
        M[a, b] = block[:, j]
        M[b, a] = block[:, j]
        want = (P @ M @ P.T)[a2, b2]
        assert np.abs(got[:, j] - want).max() <= 1e-13 * np.abs(want).max()
