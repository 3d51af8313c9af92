"""Tokens files (mhla_cli.io.tokens): the one chunk reader against plain h5py slicing, the file rules, spans.

Rules already exercised through the CLI in test_bad_inputs.py (offsets[0] != 0, an empty sequence,
offsets[N] != T, float offsets, targets (N, d) of the wrong shape, NaN) are not repeated here; this
file adds the library-level checks and the rules of weights and per-position targets.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli.errors import InputError
from mhla_cli.statistics.stream import featurize
from mhla_cli.io.tokens import check_weights, inspect_tokens, iter_chunks, chunk_ranges

N, D = 23, 3


def _write(path: Path, **data: np.ndarray) -> Path:
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f[k] = v
    return path


def _ragged(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.concatenate([[0], np.cumsum(rng.integers(1, 6, size=N))]).astype(np.int64)
    return rng.standard_normal((int(offsets[-1]), D)).astype(np.float32), offsets


def _plain_chunk(f: h5py.File, a: int, b: int, layout: str, target_kind: str, weight_kind: str
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Samples [a, b) read with plain h5py slicing: tokens (t, d), offsets from 0, targets, weights."""
    if layout == "dense":
        n = f["tokens"].shape[1]
        tok = f["tokens"][a:b].reshape(-1, D)
        off = np.arange(b - a + 1) * n
        t0, t1 = a * n, b * n
    else:
        full = f["offsets"][()]
        t0, t1 = int(full[a]), int(full[b])
        tok = f["tokens"][t0:t1]
        off = full[a:b + 1] - t0
    tg = w = None
    if target_kind == "seq":
        tg = f["targets"][a:b]
    elif target_kind == "pos":
        tg = f["targets"][a:b].reshape(-1, D) if layout == "dense" else f["targets"][t0:t1]
    if weight_kind == "seq":
        w = f["weights"][a:b]
    elif weight_kind == "pos":
        w = f["weights"][t0:t1]
    return tok, off, tg, w


@pytest.mark.parametrize("layout", ["dense", "ragged"])
@pytest.mark.parametrize("target_kind,weight_kind", [("none", "none"), ("seq", "none"), ("seq", "seq"),
                                                     ("pos", "none"), ("pos", "pos"), ("none", "pos")])
def test_iter_chunks_equals_plain_h5py(tmp_path: Path, layout: str, target_kind: str, weight_kind: str) -> None:
    rng = np.random.default_rng(hash((layout, target_kind, weight_kind)) % 2**32)
    if layout == "dense":
        tokens = rng.standard_normal((N, 4, D)).astype(np.float32)
        data = {"tokens": tokens}
        T = N * 4
    else:
        tokens, offsets = _ragged(rng)
        data = {"tokens": tokens, "offsets": offsets}
        T = tokens.shape[0]
    if target_kind == "seq":
        data["targets"] = rng.standard_normal((N, D))
    elif target_kind == "pos":
        data["targets"] = rng.standard_normal((N, 4, D) if layout == "dense" else (T, D))
    if weight_kind == "seq":
        data["weights"] = rng.random(N)
    elif weight_kind == "pos":
        data["weights"] = rng.random(T)
    path = _write(tmp_path / "t.h5", **data)
    info = inspect_tokens(path)
    assert (info.layout, info.n_samples, info.d, info.n_tokens) == (layout, N, D, T)
    assert info.has_targets == (target_kind != "none") and info.has_weights == (weight_kind != "none")
    assert info.per_position == ("pos" in (target_kind, weight_kind))
    with h5py.File(path, "r") as f:
        for sample_range, size, prefetch in (((0, N), 1, True), ((0, N), 7, True), ((0, N), N, True),
                                     ((3, N - 2), 7, False), ((3, N - 2), 4, True)):
            seen = []
            for a, b, tok, off, tg, w in iter_chunks(info, sample_range, size, prefetch=prefetch, with_weights=True):
                seen.append((a, b))
                ptok, poff, ptg, pw = _plain_chunk(f, a, b, layout, target_kind, weight_kind)
                assert tok.dtype == np.float32
                np.testing.assert_array_equal(tok, ptok)
                np.testing.assert_array_equal(off, poff)
                if ptg is None:
                    assert tg is None
                else:
                    assert tg.dtype == np.float64
                    np.testing.assert_array_equal(tg, ptg)
                if pw is None:
                    assert w is None
                else:
                    np.testing.assert_array_equal(w, pw)
            assert seen == chunk_ranges(*sample_range, size)
        items = list(iter_chunks(info, (0, N), 5, prefetch=False))
        assert all(len(it) == 5 for it in items)  # (a, b, tokens, offsets, targets) without weights


@pytest.mark.parametrize("lo,hi,size", [(0, 10, 1), (0, 10, 3), (0, 10, 10), (0, 10, 100), (4, 9, 2),
                                        (5, 5, 3), (0, 7, 0)])
def test_chunk_ranges_cover_the_range_exactly(lo: int, hi: int, size: int) -> None:
    s = chunk_ranges(lo, hi, size)
    covered = [i for a, b in s for i in range(a, b)]
    assert covered == list(range(lo, hi))  # every sample once, in order
    assert all(0 < b - a <= max(1, size) for a, b in s)
    assert all(b - a == max(1, size) for a, b in s[:-1])  # only the last one may be short


def _base(rng: np.random.Generator) -> dict[str, np.ndarray]:
    tokens, offsets = _ragged(rng)
    return {"tokens": tokens, "offsets": offsets}


BAD = {
    # name: (change of the base file, message)
    "offsets_decreasing": (lambda b: {**b, "offsets": np.concatenate([b["offsets"][:4], [b["offsets"][2]],
                                                                      b["offsets"][5:]])},
                           r"offsets not strictly increasing at sample 3"),
    "offsets_2d": (lambda b: {**b, "offsets": b["offsets"][None]}, r"'offsets' must be a 1-d integer dataset"),
    "dense_with_offsets": (lambda b: {"tokens": np.ones((2, 3, D)), "offsets": np.array([0, 3, 6])},
                           r"shape \(N, n, d\) but an 'offsets' dataset is present"),
    "ragged_without_offsets": (lambda b: {"tokens": b["tokens"]}, r"there is no 'offsets' dataset"),
    "targets_pos_wrong_T": (lambda b: {**b, "targets": np.ones((b["tokens"].shape[0] + 1, D))},
                            r"'targets' has shape .* or \(T, d\)"),
    "targets_dense_wrong": (lambda b: {"tokens": np.ones((4, 3, D)), "targets": np.ones((4, 2, D))},
                            r"'targets' has shape \(4, 2, 3\).* or \(N, n, d\) = \(4, 3, 3\)"),
    "targets_group": (lambda b: {**b, "targets/x": np.ones(3)}, r"'targets' is a group"),
    "weights_wrong_shape": (lambda b: {**b, "weights": np.ones(N + 1)}, r"'weights' has shape \(24,\)"),
    "weights_per_pos_with_seq_targets": (
        lambda b: {**b, "targets": np.ones((N, D)), "weights": np.ones(b["tokens"].shape[0])},
        r"but the targets are per sequence"),
    "weights_per_seq_with_pos_targets": (
        lambda b: {**b, "targets": np.ones((b["tokens"].shape[0], D)), "weights": np.ones(N)},
        r"but the targets are per position"),
    "weights_strings": (lambda b: {**b, "weights": np.array([b"x"] * N)}, r"dataset 'weights' has dtype"),
    "tokens_d0": (lambda b: {"tokens": np.ones((4, 0)), "offsets": np.array([0, 4])}, r"token dimension"),
    "dense_n0": (lambda b: {"tokens": np.ones((2, 0, 3))}, r"sequences need >= 1 token"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_inspect_tokens_rules(tmp_path: Path, case: str) -> None:
    make, msg = BAD[case]
    path = _write(tmp_path / "t.h5", **make(_base(np.random.default_rng(0))))
    with pytest.raises(InputError, match=msg) as exc:
        inspect_tokens(path)
    assert str(path) in str(exc.value)


def test_ragged_tokens_with_one_token_each_are_last_token_data(tmp_path: Path) -> None:
    """T = N: targets (T, d) = (N, d) and weights (T,) = (N,) mean one target per sequence."""
    path = _write(tmp_path / "t.h5", tokens=np.ones((5, 2)), offsets=np.arange(6), targets=np.ones((5, 2)),
                  weights=np.ones(5))
    info = inspect_tokens(path)
    assert info.per_position is False and info.has_weights


@pytest.mark.parametrize("bad", [-1.0, np.nan, np.inf])
def test_bad_weights_are_refused_naming_the_sample(tmp_path: Path, bad: float) -> None:
    rng = np.random.default_rng(1)
    base = _base(rng)
    w = np.ones(N)
    w[9] = bad
    path = _write(tmp_path / "t.h5", **base, targets=rng.standard_normal((N, D)), weights=w)
    with pytest.raises(InputError, match=r"weights of sample 9 is .*finite and >= 0"):
        featurize(path)
    # per position: sample and position named
    T = base["tokens"].shape[0]
    wp = np.ones(T)
    wp[base["offsets"][4] + 0] = bad
    path2 = _write(tmp_path / "p.h5", **base, targets=rng.standard_normal((T, D)), weights=wp)
    with pytest.raises(InputError, match=r"weights of sample 4, position 0"):
        featurize(path2)
    # check_weights directly, on a chunk starting at sample 10
    off = np.array([0, 2, 5])
    with pytest.raises(InputError, match=r"sample 11, position 1"):
        check_weights(np.array([1.0, 1.0, 1.0, bad, 1.0]), off, 10, True, "x.h5")
    check_weights(np.array([0.0, 2.0]), off, 10, False, "x.h5")  # zero weights are allowed


@pytest.mark.parametrize("dtype,value", [("int64", 2**53 + 1), ("int64", -(2**62)), ("uint64", 2**64 - 1)])
def test_integer_tokens_float64_cannot_hold_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        dtype: str, value: int) -> None:
    """int64 / uint64 tokens beyond 2^53 (tokens.MAX_EXACT_INT) would be rounded by the float64 sums:
    featurize, certify, predict and the estimator refuse them with one line naming the file and the
    sample; 2^53 itself (exact) is accepted."""
    from mhla_cli import MHLA
    from mhla_cli.cli import run
    from mhla_cli.numerics import MAX_EXACT_INT

    rng = np.random.default_rng(4)
    X = rng.integers(0, 50, size=(40, 3, 2)).astype(dtype)
    y = rng.standard_normal((40, 2))
    ok = tmp_path / "ok.h5"
    X[7, 1, 0] = MAX_EXACT_INT
    with h5py.File(ok, "w") as f:
        f["tokens"], f["targets"] = X, y
    assert featurize(ok).n_samples == 40  # 2^53 is held exactly
    bad = tmp_path / "big.h5"
    X[23, 2, 1] = value
    with h5py.File(bad, "w") as f:
        f["tokens"], f["targets"] = X, y
    with pytest.raises(InputError, match=r"tokens of sample 23 hold .* beyond 2\^53") as e:
        featurize(bad)
    assert str(bad) in str(e.value)
    for cmd in (["featurize", str(bad), "-o", str(tmp_path / "f.h5")], ["certify", str(bad)]):
        capsys.readouterr()
        assert run(cmd) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"mhla: error: {bad}: tokens of sample 23"), err
    with pytest.raises(InputError, match="beyond 2"):
        MHLA().fit(X, y)


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_cut_min_weight(factor: float) -> None:
    """A positive weight at factor x float64's smallest normal number (MIN_WEIGHT): accepted at 2 x,
    refused at 0.5 x (subnormal) naming the sample and the remedy; 0 is always a weight."""
    from mhla_cli.io.tokens import MIN_WEIGHT

    w = np.array([1.0, 0.0, factor * MIN_WEIGHT])
    off = np.arange(4)
    if factor > 1:
        check_weights(w, off, 10, False, "f.h5")
    else:
        with pytest.raises(InputError, match=r"weights of sample 12 is 1.11e-308, below float64's smallest normal"):
            check_weights(w, off, 10, False, "f.h5")


def test_weights_of_any_normal_scale_give_the_same_answer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's row: every weight x 1e-315 made certify and fit exit 3 ("eigenvalue bounds ... nan"): a
    clear refusal now (exit 2, one line). Weights carry no units: x 1e-300 and x 1e300 give the numbers of
    x 1 (certificate, fit, train R^2)."""
    import json

    from mhla_cli.cli import run
    from mhla_cli.model import synthetic

    ds, _ = synthetic.generate_teacher(3, 2, 200, seq_len=(2, 6), seed=3, noise=0.1)
    w = np.random.default_rng(0).uniform(0.5, 2.0, 200)
    out = {}
    for c in (1.0, 1e-300, 1e300, 1e-315):
        data = tmp_path / f"w{c:g}.h5"
        with h5py.File(data, "w") as f:
            f["tokens"], f["offsets"], f["targets"], f["weights"] = ds.tokens, ds.offsets, ds.targets, w * c
        capsys.readouterr()
        codes = (run(["certify", str(data), "--json"]), run(["fit", str(data), "-o", str(tmp_path / "m.h5"), "--json"]))
        cap = capsys.readouterr()
        if c == 1e-315:
            assert codes == (2, 2) and cap.err.count("mhla: error:") == 2 and "smallest normal number" in cap.err
            assert "internal error" not in cap.err
            continue
        assert codes == (0, 0)
        cert, fit = (json.loads(line) for line in cap.out.strip().splitlines())
        out[c] = (cert["lambda_min"], cert["lambda_max"], fit["train_mse"], fit["train_r2"])
    for c in (1e-300, 1e300):
        np.testing.assert_allclose(out[c], out[1.0], rtol=1e-10)
