"""The sums of the token-wise affine block of the wide tokens (`featurize --affine-from`,
mhla_cli.statistics.affine_sums) against plain numpy on MATERIALISED features: [Ht, f] of every sample (the MHLA's
canonical features of the reduced tokens, f = (x_wide, 1) at its query), for every sample layout, with weights,
`--normalize length`, chunks, shards, merge and workers; the provenance check of the wide file, the features file,
and the algebra (a change of basis, sums of parts)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

import _reference as ref
from conftest import relerr
from mhla_cli.cli import run
from mhla_cli.cli.options import in_options
from mhla_cli.errors import InputError, Refused
from mhla_cli.io import formats
from mhla_cli.io.formats import identity
from mhla_cli.model.reduce import reduce_tokens
from mhla_cli.samples import CAUSAL, LAST
from mhla_cli.statistics.affine_sums import AffineSums, WideSource, affine_rows
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.merge import merge_features
from mhla_cli.statistics.stream import featurize

LAYOUTS = ("last", "causal", "bidirectional")


def wide_file(path: Path, layout: str, seed: int, D: int = 5, n_seq: int = 30, weighted: bool = False,
              dtype: str = "float64") -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A wide tokens file (correlated, not centred tokens; random wide targets); returns (tokens, offsets, weights)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 7, size=n_seq)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    T = int(off[-1])
    X = (rng.standard_normal((T, D)) @ rng.standard_normal((D, D)) / np.sqrt(D) + 0.3).astype(dtype)
    rows = T if layout != "last" else n_seq
    w = None
    if weighted:
        w = rng.uniform(0.3, 2.0, rows)
        w[rng.random(rows) < 0.25] = 0.0
    with h5py.File(path, "w") as f:
        f["tokens"], f["offsets"] = X, off
        f["targets"] = rng.standard_normal((rows, D + 1))
        if w is not None:
            f["weights"] = w
        if layout != "last":
            f.attrs["attention"] = layout
    return X.astype(np.float64), off, w


def reduced(tmp: Path, layout: str, seed: int, d: int = 2, **kw) -> tuple[Path, Path, dict]:
    wide = tmp / f"wide_{layout}_{seed}.h5"
    X, off, w = wide_file(wide, layout, seed, **kw)
    red = tmp / f"red_{layout}_{seed}.h5"
    reduce_tokens(wide, red, dim=d)
    with h5py.File(red) as f:
        Xr, Y = f["tokens"][...], f["targets"][...]
    return wide, red, {"X": X, "off": off, "w": w, "Xr": Xr, "Y": Y}


def materialised(dat: dict, layout: str, A: np.ndarray, normalize: str) -> dict:
    """Ht of the reduced tokens in basis A (the features' own basis) and f at the query, of every sample of weight
    > 0, with their weights and targets (tests/_reference.py)."""
    pp = layout != "last"
    Ht, F, ws, ys = [], [], [], []
    for Xs, wt, r in ref.samples(dat["Xr"], dat["off"], pp, dat["w"], attention=layout if pp else "causal"):
        if wt <= 0:
            continue
        Ht.append(ref.canonical_features(Xs @ A, normalize))
        q = r if pp else int(dat["off"][r + 1]) - 1  # the query's row among the tokens
        F.append(np.append(dat["X"][q], 1.0))
        ws.append(wt)
        ys.append(dat["Y"][r])
    return {"Ht": np.array(Ht), "F": np.array(F), "w": np.array(ws), "y": np.array(ys)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("normalize", ["none", "length"])
@pytest.mark.parametrize("weighted", [False, True])
def test_sums_match_numpy_on_the_materialised_features(tmp_path: Path, layout: str, normalize: str,
                                                       weighted: bool) -> None:
    wide, red, dat = reduced(tmp_path, layout, 5 + weighted, weighted=weighted)
    for chunk in (None, 4):
        f = featurize(red, chunk_size=chunk, normalize=normalize, affine_from=wide)
        m = materialised(dat, layout, f.basis, normalize)
        m["F"] = m["F"] @ f.affine.f_basis  # the sums are of f_b = A_w^T f, A_w a whitening estimate of f
        assert np.abs(f.affine.gram / m["w"].sum() - np.eye(6)).max() < 0.5
        w = m["w"][:, None]
        assert f.affine.width == 5 and f.affine.source["fingerprint"]
        assert relerr(f.affine.cross, (m["Ht"] * w).T @ m["F"]) < 1e-12
        assert relerr(f.affine.gram, (m["F"] * w).T @ m["F"]) < 1e-12
        assert relerr(f.affine.moments, (m["F"] * w).T @ m["y"]) < 1e-12
        assert relerr(f.affine.total, (m["F"] * w).sum(axis=0)) < 1e-12
        # the MHLA's own sums are those of a featurize without the block
        plain = featurize(red, chunk_size=chunk, normalize=normalize)
        assert relerr(f.gram, plain.gram) < 1e-12 and relerr(f.moments, plain.moments) < 1e-12
        assert relerr(f.target_gram, plain.target_gram) < 1e-12 and relerr(f.target_sum, plain.target_sum) < 1e-12


def test_shards_merge_workers_and_the_file(tmp_path: Path) -> None:
    wide, red, _ = reduced(tmp_path, "causal", 3, weighted=True)
    one = featurize(red, affine_from=wide)
    parts = []
    for i in range(3):
        parts.append(tmp_path / f"s{i}.h5")
        featurize(red, shard=(i, 3), chunk_size=3, affine_from=wide).save(parts[-1])
    merged = merge_features(parts).features
    pooled = featurize(red, workers=2, chunk_size=4, affine_from=wide)
    for other in (merged, pooled):
        other.to_basis(one.basis)
        np.testing.assert_array_equal(other.affine.f_basis, one.affine.f_basis)  # the same estimate everywhere
        assert relerr(other.affine.cross, one.affine.cross) < 1e-10
        assert relerr(other.affine.gram, one.affine.gram) < 1e-12
        assert relerr(other.affine.moments, one.affine.moments) < 1e-12
    one.save(tmp_path / "f.h5")
    back = Features.load(tmp_path / "f.h5")
    assert back.affine.width == 5 and back.affine.P.shape == (5, 2)
    for k in ("cross", "gram", "moments", "total", "basis"):
        np.testing.assert_array_equal(getattr(back.affine, k), getattr(one.affine, k))
    # the sums in another basis of f: back in the first, the same
    other = one.affine.copy()
    other.to_f_basis(np.eye(6))
    other.to_f_basis(one.affine.basis)
    assert relerr(other.cross, one.affine.cross) < 1e-10 and relerr(other.gram, one.affine.gram) < 1e-10
    # the sums change with the basis as the moments do: back in the first basis, the same
    moved = one.copy()
    moved.change_basis(np.array([[2.0, 1.0], [0.5, 3.0]]))
    moved.to_basis(one.basis)
    assert relerr(moved.affine.cross, one.affine.cross) < 1e-12
    # statistics with and without the block do not add up
    with pytest.raises(InputError, match="affine block"):
        one + featurize(red)


def test_the_sums_in_another_basis_of_f_and_of_two_parts_are_numpy_s() -> None:
    """AffineSums.to_f_basis and add against the sums written out: the rows Ht, f = (x, 1), targets y and weights w
    of two parts, their sums in one basis A (f_b = A^T f) moved to another, and the parts in different bases added."""
    rng = np.random.default_rng(9)
    D, nf, e = 3, 5, 2

    def part(m: int) -> tuple[np.ndarray, ...]:
        F = np.hstack([rng.standard_normal((m, D)) * [1.0, 3.0, 0.2] + 0.5, np.ones((m, 1))])
        return rng.standard_normal((m, nf)), F, rng.standard_normal((m, e)), rng.uniform(0.2, 2.0, m)

    def sums(H: np.ndarray, F: np.ndarray, y: np.ndarray, w: np.ndarray, A: np.ndarray) -> AffineSums:
        Fb = F @ A
        return AffineSums(H.T @ (w[:, None] * Fb), Fb.T @ (w[:, None] * Fb), Fb.T @ (w[:, None] * y), Fb.T @ w, D,
                          basis=A)

    A1, A2 = (rng.standard_normal((D + 1, D + 1)) + 2 * np.eye(D + 1) for _ in range(2))
    p, q = part(23), part(17)
    moved = sums(*p, A1)
    moved.to_f_basis(A2)
    want = sums(*p, A2)
    for k in ("cross", "gram", "moments", "total"):
        assert relerr(getattr(moved, k), getattr(want, k)) < 1e-12, k
    np.testing.assert_array_equal(moved.f_basis, A2)
    both = sums(*p, A1)
    both.add(sums(*q, A2))  # the other part's basis changed to this one's
    want = sums(*(np.concatenate([a, b]) for a, b in zip(p, q)), A1)
    for k in ("cross", "gram", "moments", "total"):
        assert relerr(getattr(both, k), getattr(want, k)) < 1e-12, k
    both.add(sums(*q, A1), sign=-1.0)  # a part taken away again
    for k in ("cross", "gram", "moments", "total"):
        assert relerr(getattr(both, k), getattr(sums(*p, A1), k)) < 1e-12, k


def test_the_wide_file_must_be_the_one_reduce_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wide, red, dat = reduced(tmp_path, "bidirectional", 7)
    other, _, _ = reduced(tmp_path, "bidirectional", 8)
    assert run(["featurize", str(red), "-o", str(tmp_path / "f.h5"), "--affine-from", str(other)]) == 2
    err = capsys.readouterr().err
    assert "was reduced from" in err and err.count("\n") == 1
    # a tokens file that mhla reduce did not write
    with h5py.File(tmp_path / "own.h5", "w") as g:
        g["tokens"], g["offsets"], g["targets"] = dat["Xr"], dat["off"], dat["Y"]
    assert run(["featurize", str(tmp_path / "own.h5"), "-o", str(tmp_path / "f.h5"), "--affine-from", str(wide)]) == 2
    assert "records no reduction" in capsys.readouterr().err
    # the same file under another name and chunking is the same data: accepted
    with h5py.File(wide) as f, h5py.File(tmp_path / "copy.h5", "w") as g:
        for k in f:
            g.create_dataset(k, data=f[k][...], chunks=True)
        for k, v in f.attrs.items():
            g.attrs[k] = v
    assert featurize(red, affine_from=tmp_path / "copy.h5").affine.width == 5
    # a features file without the block, or of other wide tokens, asked for them
    featurize(red).save(tmp_path / "plain.h5")
    assert run(["certify", str(tmp_path / "plain.h5"), "--affine-from", str(wide)]) == 2
    assert "without it" in capsys.readouterr().err
    # --domain is refused with it, before any work (--folds and --ridge auto: tests/test_affine_block.py)
    assert run(["certify", str(red), "--affine-from", str(wide), "--domain", "observed"]) == 2
    assert run(["fit", str(red), "-o", str(tmp_path / "m.h5"), "--affine-from", str(wide), "--heads", "2"]) == 2
    capsys.readouterr()


def test_lockstep_reading_refuses_other_sequences(tmp_path: Path) -> None:
    wide, red, dat = reduced(tmp_path, "causal", 4)
    src = WideSource.open(wide, red)
    chunk = next(src.chunks((0, 5), 5))
    off = chunk[3].copy()
    np.testing.assert_array_equal(src.rows(chunk, 0, off, CAUSAL)[:, :-1], dat["X"][:off[-1]])  # no basis: f
    off[2] += 1
    with pytest.raises(InputError, match="differ"):
        src.rows(chunk, 0, off, CAUSAL)


def test_affine_rows_take_the_query() -> None:
    X = np.arange(12.0).reshape(6, 2)
    off = np.array([0, 2, 6])
    np.testing.assert_array_equal(affine_rows(X, off, LAST), [[2.0, 3.0, 1.0], [10.0, 11.0, 1.0]])
    assert affine_rows(X, off, CAUSAL).shape == (6, 3)


def _unsampled_pair(off: np.ndarray) -> tuple[int, int]:
    """Two windows of the same length none of whose token rows the sampled fingerprint reads
    (identity._hash_dataset's blocks of one row with the constants the test sets)."""
    n = int(off[-1])
    seen = {0, n - 1, *(int(s) for s in np.linspace(0, n - 1, identity._SAMPLED_BLOCKS))}
    free: dict[int, int] = {}
    for i in range(off.size - 1):
        if not seen.intersection(range(off[i], off[i + 1])):
            L = int(off[i + 1] - off[i])
            if L in free:
                return free[L], i
            free[L] = i
    raise AssertionError("no two unsampled windows of one length")


@pytest.mark.parametrize("layout", ["last", "bidirectional"])
def test_every_window_of_the_wide_file_is_checked_at_any_size(tmp_path: Path, layout: str,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's row: a wide file above the fingerprint's sampling cut (the cut lowered here) with windows swapped
    outside the sampled rows has the recorded (sampled) fingerprint, yet fit and predict refuse it (exit 2): every
    window is checked against its digest as the pass reads it. The right file fits and predicts as before."""
    monkeypatch.setattr(identity, "FULL_FINGERPRINT_BYTES", 1024)
    monkeypatch.setattr(identity, "_BLOCK_BYTES", 40 * 16)  # rows of D = 5 float64: sampled blocks of one row
    wide, red, dat = reduced(tmp_path, layout, 11, n_seq=400)
    assert formats.source_identity(wide)["fingerprint_scope"] == "shapes, offsets and sampled rows"
    m = tmp_path / "m.h5"
    assert run(["fit", str(red), "-o", str(m), "--affine-from", str(wide), "--ridge", "1e-8", "-q"]) == 0
    assert run(["predict", str(m), str(red), "-o", str(tmp_path / "p.h5"), "--affine-from", str(wide), "-q"]) == 0
    capsys.readouterr()
    i, j = _unsampled_pair(dat["off"])
    before = formats.source_identity(wide)["fingerprint"]
    with h5py.File(wide, "r+") as f:
        X = f["tokens"][...]
        a, b = slice(dat["off"][i], dat["off"][i + 1]), slice(dat["off"][j], dat["off"][j + 1])
        X[a], X[b] = X[b].copy(), X[a].copy()
        f["tokens"][...] = X
    assert formats.source_identity(wide)["fingerprint"] == before  # the sampled fingerprint cannot see it
    for argv in (["fit", str(red), "-o", str(tmp_path / "m2.h5"), "--affine-from", str(wide), "--ridge", "1e-8"],
                 ["predict", str(m), str(red), "-o", str(tmp_path / "p2.h5"), "--affine-from", str(wide)],
                 ["featurize", str(red), "-o", str(tmp_path / "f.h5"), "--affine-from", str(wide), "--shard",
                  f"{i * 4 // 400}/4"]):
        assert run(argv) == 2, argv[0]
        err = capsys.readouterr().err
        assert f"window {min(i, j) if argv[0] != 'featurize' else i}" in err and err.count("\n") == 1, err
    assert not (tmp_path / "m2.h5").exists() and not (tmp_path / "p2.h5").exists()


def test_a_reduced_file_without_window_digests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An older mhla reduce's file (no digests): taken when its recorded fingerprint covers all data, refused
    (with the remedy) when it was sampled."""
    wide, red, _ = reduced(tmp_path, "last", 12)
    with h5py.File(red, "r+") as f:
        del f[formats.REDUCE_DIGESTS]
    assert featurize(red, affine_from=wide).affine.width == 5
    monkeypatch.setattr(identity, "FULL_FINGERPRINT_BYTES", 1024)
    wide, red, _ = reduced(tmp_path, "last", 13, n_seq=400)
    assert WideSource.open(wide, red).digests is not None
    with h5py.File(red, "r+") as f:
        del f[formats.REDUCE_DIGESTS]
    with pytest.raises(Refused, match="like=") as exc:  # the library's words; the CLI's name the option
        WideSource.open(wide, red)
    assert f"mhla reduce {wide} --like {red} -o NEW.h5" in str(in_options(exc.value))
