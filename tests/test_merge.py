"""Shards and merge (mhla_cli.statistics.merge): the merged statistics equal a single pass; bad sets of parts are refused."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import pytest

from conftest import assert_same_stats
from mhla_cli.model import synthetic
from mhla_cli.cli import run
from mhla_cli.errors import InputError
from mhla_cli.statistics.merge import merge_features
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.stream import featurize

@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """d = 3, ragged lengths 1..15, N = 203 (not a multiple of the shard counts), float32."""
    ds, _ = synthetic.generate_teacher(3, 2, 203, "1:15", seed=5)
    path = tmp_path_factory.mktemp("shards") / "data.h5"
    ds.save(path, dtype="float32")
    return path


@pytest.fixture(scope="module")
def other_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ds, _ = synthetic.generate_teacher(3, 2, 203, "1:15", seed=6)
    path = tmp_path_factory.mktemp("shards_other") / "other.h5"
    ds.save(path, dtype="float32")
    return path


def make_parts(data: Path, out: Path, m: int, which: list[int] | None = None, extra: list[str] = ()) -> list[Path]:
    parts = []
    for i in which if which is not None else range(m):
        p = out / f"part_{i}of{m}.h5"
        assert run(["featurize", str(data), "--shard", f"{i}/{m}", "-o", str(p), "-q", "--chunk-size", "17",
                    *extra]) == 0
        parts.append(p)
    return parts


def test_merge_equals_single_pass(data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    single = featurize(data)
    parts = make_parts(data, tmp_path, 4)
    out = tmp_path / "merged.h5"
    # order on the command line does not matter
    assert run(["merge", *map(str, parts[::-1]), "-o", str(out), "--json", "-q"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["n_samples"] == 203 and rep["partial"] is False and rep["missing"] == []
    assert rep["covered"] == [[0, 203]] and rep["n_parts"] == 4
    merged = Features.load(out)
    assert_same_stats(merged, single)
    assert merged.sample_range == (0, 203)
    assert merged.source["fingerprint"] == single.source["fingerprint"]
    assert merged.source["n_samples"] == 203
    # each part records its range and its shard
    ranges = [Features.load(p).sample_range for p in parts]
    assert ranges == [(0, 50), (50, 101), (101, 152), (152, 203)]
    assert Features.load(parts[2]).extra_attrs["shard"] == "2/4"


def test_missing_shard_is_refused(data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parts = make_parts(data, tmp_path, 4, [0, 1, 3])
    out = tmp_path / "merged.h5"
    assert run(["merge", *map(str, parts), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "missing samples 101..152" in err and "allow a partial merge" in err
    assert not out.exists()
    # the last shard missing is detected too (the source's N is recorded in every part)
    assert run(["merge", *map(str, parts[:2]), "-o", str(out)]) == 2
    assert "missing samples 101..203" in capsys.readouterr().err


def test_allow_partial_then_complete(data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parts = make_parts(data, tmp_path, 4, [0, 1, 3])
    partial = tmp_path / "partial.h5"
    assert run(["merge", *map(str, parts), "-o", str(partial), "--allow-partial", "--json", "-q"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["partial"] is True and rep["missing"] == [[101, 152]] and rep["n_samples"] == 152
    expect = featurize(data, shard=(0, 4)) + featurize(data, shard=(1, 4)) + featurize(data, shard=(3, 4))
    assert_same_stats(Features.load(partial), expect)
    with h5py.File(partial) as f:
        assert json.loads(f.attrs["sample_ranges"]) == [[0, 101], [152, 203]]
    # a partial merge plus the missing shard is the whole file
    [rest] = make_parts(data, tmp_path, 4, [2])
    full = tmp_path / "full.h5"
    assert run(["merge", str(partial), str(rest), "-o", str(full), "-q"]) == 0
    assert_same_stats(Features.load(full), featurize(data))


def test_overlapping_parts_are_refused(data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    halves = make_parts(data, tmp_path, 2)
    thirds = make_parts(data, tmp_path, 3, [1])
    out = tmp_path / "m.h5"
    assert run(["merge", str(halves[0]), str(halves[1]), str(thirds[0]), "-o", str(out), "--allow-partial"]) == 2
    err = capsys.readouterr().err
    assert "overlaps" in err and "counted twice" in err
    assert run(["merge", str(halves[0]), str(halves[0]), str(halves[1]), "-o", str(out)]) == 2
    assert "listed twice" in capsys.readouterr().err
    assert not out.exists()


def test_different_sources_are_refused(data: Path, other_data: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    a = make_parts(data, tmp_path, 2, [0])
    (tmp_path / "o").mkdir()
    b = make_parts(other_data, tmp_path / "o", 2, [1])
    out = tmp_path / "m.h5"
    assert run(["merge", str(a[0]), str(b[0]), "-o", str(out), "--allow-partial"]) == 2
    err = capsys.readouterr().err
    assert "different source" in err and str(b[0]) in err
    with pytest.raises(InputError, match="different source"):
        merge_features([a[0], b[0]])


def test_parts_without_provenance_are_refused(data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    feats = featurize(data)
    feats.source = None
    bare = tmp_path / "bare.h5"
    feats.save(bare)
    assert run(["merge", str(bare), "-o", str(tmp_path / "m.h5")]) == 2
    assert "records no source or sample range" in capsys.readouterr().err
    # a tokens file is not a part
    assert run(["merge", str(data), "-o", str(tmp_path / "m.h5")]) == 2
    assert "expected features" in capsys.readouterr().err


def test_shards_with_workers_equal_serial(data: Path, tmp_path: Path) -> None:
    serial = make_parts(data, tmp_path, 2)
    (tmp_path / "w").mkdir()
    pooled = make_parts(data, tmp_path / "w", 2, extra=["--workers", "2"])
    for s, p in zip(serial, pooled):
        a, b = Features.load(s), Features.load(p)
        assert_same_stats(b, a)
        assert a.sample_range == b.sample_range


def test_zero_weight_sequences_and_scaled_weights_change_no_number(tmp_path: Path, capsys) -> None:
    """The issue's case through files (featurize's sampled basis, shards, merge, folds): the plain data,
    the same file with 300 large zero-weight sequences appended, and every weight x 10 give the same
    certificate, the same fit and the same train MSE as the reference on the plain data."""
    import numpy as np

    from _reference import canonical, predict_canonical, predict_own, ratio, min_norm_function
    from mhla_cli.statistics.folds import featurize_folds, load_folds, save_with_folds
    from mhla_cli import certify
    from mhla_cli.solve.lstsq import fit

    rng = np.random.default_rng(23)
    d, N = 3, 80
    L = rng.integers(2, 9, N)
    off = np.concatenate([[0], np.cumsum(L)]).astype(np.int64)
    X = rng.standard_normal((int(off[-1]), d))
    y = rng.standard_normal((N, d))
    w = rng.uniform(0.5, 2.0, N)
    Lz = rng.integers(1, 30, 300)
    Xz = 50.0 * rng.standard_normal((int(Lz.sum()), d))
    def shuffled(tok, o, yy, ww):  # the zero-weight sequences spread over the file (every shard has samples)
        order = np.random.default_rng(1).permutation(o.size - 1)
        seqs = [tok[o[i]:o[i + 1]] for i in order]
        return (np.concatenate(seqs), np.concatenate([[0], np.cumsum([len(q) for q in seqs])]).astype(np.int64),
                yy[order], ww[order])

    files = {}
    for name, (tok, o, yy, ww) in {
        "plain": (X, off, y, w),
        "zeros": shuffled(np.concatenate([X, Xz]), np.concatenate([off, off[-1] + np.cumsum(Lz)]),
                          np.concatenate([y, 1e3 * rng.standard_normal((300, d))]), np.concatenate([w, np.zeros(300)])),
        "x10": (X, off, y, 10.0 * w),
    }.items():
        files[name] = tmp_path / f"{name}.h5"
        with h5py.File(files[name], "w") as f:
            f["tokens"], f["offsets"], f["targets"], f["weights"] = tok, o, yy, ww
    ref = canonical(X, off, y, weights=w)
    Zs = [rng.standard_normal((n, d)) for n in (1, 3, 6)]
    want = predict_canonical(min_norm_function(ref, rcond=1e-12), ref["A"], Zs)
    base_mse = None
    for name, path in files.items():
        parts = []
        for i in range(3):
            parts.append(tmp_path / f"{name}{i}.h5")
            featurize(path, shard=(i, 3), chunk_size=7).save(parts[-1])
        for feats in (featurize(path), merge_features(parts).features):
            cert = certify(feats)
            assert abs(cert.lambda_min - ref["eigenvalues"][0]) <= 1e-10 * ref["eigenvalues"][0], name
            assert cert.identifiable and cert.n_samples == N
            model = fit(feats)
            assert ratio(predict_own(model.coef, Zs), want) < 1e-9, name
            base_mse = model.info["train_mse"] if base_mse is None else base_mse
            assert abs(model.info["train_mse"] - base_mse) <= 1e-10 * base_mse, name
        total, folds = featurize_folds(path, 3)
        out = tmp_path / f"{name}_folds.h5"
        save_with_folds(total, folds, out)
        back = load_folds(out)
        assert [f.weight for f in back] == [f.weight for f in folds]
        assert abs(sum(f.weight for f in back) - total.weight) <= 1e-12 * total.weight
    # the CLI quotes the same lambda_min for the three files
    got = []
    for path in files.values():
        capsys.readouterr()
        assert run(["certify", str(path), "--json"]) == 0
        got.append(json.loads(capsys.readouterr().out)["lambda_min"])
    assert max(got) - min(got) <= 1e-10 * got[0]


@pytest.mark.parametrize("weak", [1.0, 1e-2, 1e-3])
def test_what_merge_keeps_and_what_it_does_not(tmp_path: Path, weak: float) -> None:
    """docs/cluster.md's promise, as tested: shards + merge give the single pass's own-coordinate sums to
    1e-12; the canonical datasets are another whitening of the same data (A_merged = A_single M, M
    orthogonal), so basis* may differ entry by entry, while the spectrum of Lambda~ agrees to 1e-12 of
    lambda_max and the fitted function (coef, predictions) to eps64 times the condition number of Lambda~."""
    import numpy as np

    from mhla_cli.model.forward import predict
    from mhla_cli.solve.lstsq import fit

    rng = np.random.default_rng(7)
    d, N = 3, 300
    off = np.concatenate([[0], np.cumsum(rng.integers(1, 5, N))])
    T = np.linalg.qr(rng.standard_normal((d, d)))[0] @ np.diag([1.0, 0.1, weak])
    X = rng.standard_normal((int(off[-1]), d)) @ T
    data = tmp_path / "d.h5"
    with h5py.File(data, "w") as f:
        f["tokens"], f["offsets"], f["targets"] = X, off, rng.standard_normal((N, d))
    single = featurize(data)
    merged = merge_features(make_parts(data, tmp_path, 4)).features
    for k in Features.SUMS:
        a, b = getattr(merged, k), getattr(single, k)
        assert np.abs(a - b).max() <= 1e-12 * np.abs(b).max(), k
    A, B = single.basis, merged.basis
    M = np.linalg.solve(A, B)
    assert np.abs(M.T @ M - np.eye(d)).max() <= 1e-12
    ea = np.linalg.eigvalsh(single.basis_gram / single.weight)
    eb = np.linalg.eigvalsh(merged.basis_gram / merged.weight)
    assert np.abs(ea - eb).max() <= 1e-12 * ea[-1]
    cond = ea[-1] / ea[0]
    fa, fb = fit(single), fit(merged)
    bound = 10 * np.finfo(float).eps * cond
    assert np.abs(fb.coef - fa.coef).max() <= bound * np.abs(fa.coef).max(), (cond,)
    pa, pb = predict(fa, X, off), predict(fb, X, off)
    assert np.abs(pb - pa).max() <= bound * np.abs(pa).max()


def _with_empty_block(path: Path, lo: int, hi: int, N: int = 100, seed: int = 31) -> tuple:
    """A weighted last-token file whose samples lo..hi all have weight 0 (a contiguous block: a whole shard)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    off = np.concatenate([[0], np.cumsum(rng.integers(2, 7, N))]).astype(np.int64)
    X = rng.standard_normal((int(off[-1]), 2)) + 0.3
    y = rng.standard_normal((N, 2))
    w = rng.uniform(0.5, 2.0, N)
    w[lo:hi] = 0.0
    with h5py.File(path, "w") as f:
        f["tokens"], f["offsets"], f["targets"], f["weights"] = X, off, y, w
    return X, off, y, w


def test_an_empty_shard_adds_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 43 row 8: a shard whose weights are all 0 is written (exit 0, zero sums) and merges; the merge of all
    shards (with or without --allow-partial) is the whole file's statistics (numpy's sums of the materialised
    features) and bitwise the partial merge of the non-empty shards; the empty shard alone is no data to certify
    or fit (exit 2), and neither is a merge of empty shards only."""
    import numpy as np

    data = tmp_path / "t.h5"
    X, off, y, w = _with_empty_block(data, 25, 50)
    parts = make_parts(data, tmp_path, 4)  # shard 1/4 is samples 25..50: every weight 0
    empty = Features.load(parts[1], part=True)
    assert empty.n_samples == 0 and empty.weight == 0 and not np.any(empty.gram) and not np.any(empty.moments)
    H = np.stack([np.concatenate([[X[a:b].T @ X[a:b]][0][np.triu_indices(2)][:, None] * X[b - 1][None, :]]).ravel()
                  for a, b in zip(off[:-1], off[1:])])
    merged = tmp_path / "all.h5"
    for extra in ([], ["--allow-partial"]):
        assert run(["merge", *map(str, parts), "-o", str(merged), "-q", *extra]) == 0
        m = Features.load(merged)
        assert m.n_samples == 75 and m.weight == pytest.approx(w.sum(), rel=1e-15)
        np.testing.assert_allclose(m.gram, (H * w[:, None]).T @ H, rtol=0, atol=1e-12 * np.abs(H).max() ** 2 * w.sum())
        np.testing.assert_allclose(m.moments, (H * w[:, None]).T @ y, rtol=0, atol=1e-12 * np.abs(H).max() * w.sum())
        assert_same_stats(m, featurize(data))
    assert run(["merge", *map(str, parts[:1] + parts[2:]), "-o", str(tmp_path / "p.h5"), "-q", "--allow-partial"]) == 0
    p = Features.load(tmp_path / "p.h5")
    for k in ("gram", "moments", "token_gram", "last_token_gram", "target_gram", "target_sum"):
        assert np.array_equal(getattr(p, k), getattr(m, k)), k
    capsys.readouterr()
    assert run(["inspect", str(parts[1]), "--json"]) == 0  # a valid file: an empty part
    assert json.loads(capsys.readouterr().out)["n_samples"] == 0
    for argv in (["certify", str(parts[1])], ["fit", str(parts[1]), "-o", str(tmp_path / "m.h5")],
                 ["merge", str(parts[1]), "-o", str(tmp_path / "e.h5"), "--allow-partial"]):
        assert run(argv) == 2, argv
        assert "no sample" in capsys.readouterr().err
    whole = tmp_path / "z.h5"
    _with_empty_block(whole, 0, 100)
    assert run(["featurize", str(whole), "-o", str(tmp_path / "zf.h5")]) == 2  # a whole file of no weight
    assert "no sample" in capsys.readouterr().err
