"""The fit and head-export dispatch (mhla_cli.api.learn: `mhla_cli.fit`, `mhla_cli.export_heads`)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

import _reference as ref
import mhla_cli
from mhla_cli.solve import lstsq
from mhla_cli.model import synthetic
from mhla_cli import featurize
from mhla_cli.errors import InputError
from mhla_cli.statistics.features import Features
from mhla_cli.samples import ReadSpec


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def one_head(tmp_path_factory: pytest.TempPathFactory) -> tuple[Features, np.ndarray]:
    """Statistics of realisable data from a 1-head d = 2 teacher, and the teacher's p."""
    ds, teacher = synthetic.generate_teacher(2, 1, 120, "2:8", seed=4)
    path = tmp_path_factory.mktemp("learn") / "d.h5"
    ds.save(path, dtype="float64")
    return featurize(path), teacher.coef


def test_fit_equals_solve_fit(one_head: tuple[Features, np.ndarray]) -> None:
    feats, p = one_head
    a, b = mhla_cli.fit(feats), lstsq.fit(feats)
    assert np.array_equal(a.coef, b.coef) and np.array_equal(a.W, b.W)
    assert rel(a.coef, p) <= 1e-8  # identifiable, realisable: the teacher's function
    ar, br = mhla_cli.fit(feats, ridge=0.1), lstsq.fit(feats, ridge=0.1)
    assert np.array_equal(ar.coef, br.coef) and ar.info["ridge"] == 0.1
    assert rel(ar.coef, p) > 1e-6  # the ridge does change the answer


def test_factorised_fit_with_one_head(one_head: tuple[Features, np.ndarray]) -> None:
    feats, p = one_head
    model = mhla_cli.fit(feats, heads=1, restarts=2)
    s = np.linalg.svd(model.W, compute_uv=False)
    assert s[1] <= 1e-10 * s[0]  # W has rank 1
    assert rel(model.coef, p) <= 1e-6
    assert model.info["n_heads"] == 1 and model.info["normalize"] == "none"


def test_fit_argument_rules(one_head: tuple[Features, np.ndarray]) -> None:
    feats, _ = one_head
    for kw in ({"heads": "auto"}, {"nuclear": "auto"}):
        with pytest.raises(InputError, match="folds"):
            mhla_cli.fit(feats, **kw)  # 'auto' without per-fold statistics
    with pytest.raises(InputError, match="ridge"):
        mhla_cli.fit(feats, ridge=0.1, heads=1)
    with pytest.raises(InputError, match="ridge"):
        mhla_cli.fit(feats, ridge=0.1, nuclear=1e-3)
    with pytest.raises(InputError):
        mhla_cli.fit(feats, heads=1, nuclear=1e-3)
    with pytest.raises(InputError, match="ridge"):
        mhla_cli.fit(feats, ridge=-1.0)


def test_export_heads_dispatch(one_head: tuple[Features, np.ndarray]) -> None:
    feats, p = one_head
    model = mhla_cli.fit(feats)
    fewest = mhla_cli.export_heads(model, fewest=True)
    assert fewest.n_heads == 1 and rel(fewest.coef, p) <= 1e-8
    svd = mhla_cli.export_heads(model)  # plain SVD of the min-norm W: more heads, same function
    assert svd.n_heads > 1 and rel(svd.coef, model.coef) <= 1e-12
    two = mhla_cli.export_heads(model, max_heads=2)
    assert two.n_heads == 2 and two.info["max_heads"] == 2
    with pytest.raises(InputError, match="fewest and max_heads"):
        mhla_cli.export_heads(model, fewest=True, max_heads=2)


@pytest.mark.parametrize("normalize", ["none", "length"])
def test_normalisation_is_propagated(tmp_path: Path, normalize: str) -> None:
    ds, teacher = synthetic.generate_teacher(2, 1, 60, "2:6", seed=5, read=ReadSpec(normalize=normalize))
    path = tmp_path / "d.h5"
    ds.save(path, dtype="float64")
    feats = featurize(path, normalize=normalize)
    model = mhla_cli.fit(feats)
    assert model.info["normalize"] == normalize
    assert rel(model.coef, teacher.coef) <= 1e-8
    for kw in ({}, {"fewest": True}, {"max_heads": 1}):
        h = mhla_cli.export_heads(model, **kw)
        assert h.info["normalize"] == normalize, kw
    # predictions of the exported heads use the normalisation: they reproduce the targets
    h = mhla_cli.export_heads(model, fewest=True)
    yhat = mhla_cli.predict(h, ds.tokens, ds.offsets)
    assert rel(yhat, ds.targets) <= 1e-8


def test_fit_and_export_rules_are_the_librarys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The rules of a fit / export request live in api.learn (RequestError and its `rule`); `mhla fit` and
    `mhla export-heads` word them in their flags (cli.fit.FLAG_WORDS): one line, exit 2, no output."""
    from mhla_cli.api.learn import (RULES, RequestError, check_export_options, check_fit_file, check_fit_options,
                                    check_fit_targets, needs_folds)
    from mhla_cli.cli import run
    from mhla_cli.cli.fit import FLAG_WORDS

    assert set(FLAG_WORDS) == set(RULES)
    assert needs_folds(ridge="auto") and needs_folds(heads="auto") and not needs_folds(0.5, 2, None)
    for kw in ({"ridge": 0.1, "heads": 1}, {"ridge": "auto", "nuclear": 1e-3}):
        with pytest.raises(RequestError, match="ridge penalty") as exc:
            check_fit_options(**kw)
        assert exc.value.rule == "ridge_with_lowrank"
    check_fit_options(ridge=0.0, heads=2)
    with pytest.raises(RequestError) as exc:
        check_export_options(max_heads=2, fewest=True)
    assert exc.value.rule == "fewest_with_max_heads"
    ds, _ = synthetic.generate_teacher(2, 1, 60, "2:6", seed=5)
    data, bare, feats = tmp_path / "d.h5", tmp_path / "bare.h5", tmp_path / "f.h5"
    ds.save(data, dtype="float64")
    with h5py.File(bare, "w") as f:
        f["tokens"], f["offsets"] = ds.tokens, ds.offsets
    featurize(data).save(feats)
    with pytest.raises(InputError, match="has no 'targets'"):
        check_fit_targets(bare)
    with pytest.raises(RequestError) as exc:
        check_fit_file(feats, heads="auto")
    assert exc.value.rule == "auto_without_folds" and exc.value.path == str(feats)
    with pytest.raises(RequestError) as exc:
        check_fit_file(data, ridge="auto", normalize="length")
    assert exc.value.rule == "auto_with_normalize"
    check_fit_file(data, ridge="auto")
    out = tmp_path / "m.h5"
    for args, rule, path in ((["fit", str(data), "--ridge", "1", "--heads", "2"], "ridge_with_lowrank", None),
                             (["fit", str(feats), "--nuclear", "auto"], "auto_without_folds", feats),
                             (["fit", str(data), "--heads", "auto", "--normalize", "length"], "auto_with_normalize",
                              None),
                             (["export-heads", str(data), "--fewest", "--max-heads", "2"], "fewest_with_max_heads",
                              None)):
        capsys.readouterr()
        assert run([*args, "-o", str(out if args[0] == "fit" else tmp_path / "h.h5")]) == 2
        want = FLAG_WORDS[rule] if path is None else f"{path}: {FLAG_WORDS[rule]}"
        assert capsys.readouterr().err.strip() == f"mhla: error: {want}"
        assert not out.exists()


# ---------------------------------------------------------------------------------------------
# one `certify` and one `fit` for statistics of every storage (mhla_cli.api.learn)

def _lower_tiles(G: np.ndarray, side: int) -> tuple[dict[tuple[int, int], np.ndarray], list[int]]:
    sizes = [side] * (G.shape[0] // side)
    o = np.concatenate([[0], np.cumsum(sizes)])
    return ({(i, j): np.ascontiguousarray(G[o[i]:o[i + 1], o[j]:o[j + 1]]) for i in range(len(sizes))
             for j in range(i + 1)}, sizes)


@pytest.fixture(scope="module")
def teacher_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, np.ndarray, np.ndarray]:
    """A d = 3 teacher's tokens file (ragged, last-token samples) and its tokens, offsets, targets."""
    ds, _ = synthetic.generate_teacher(3, 2, 150, "2:7", seed=11)
    path = tmp_path_factory.mktemp("dispatch") / "data.h5"
    ds.save(path, dtype="float64")
    with h5py.File(path) as f:
        X = f["tokens"][...]
        off = f["offsets"][...] if "offsets" in f else np.arange(X.shape[0] + 1) * X.shape[1]
        Y = f["targets"][...]
    return path, X.reshape(-1, X.shape[-1]), off, Y


def _storages(path: Path) -> dict[str, object]:
    """The same statistics held dense, as pairs (symgram.Pairs), tiled (dask's threaded scheduler, no cluster),
    and as the features file and the tokens file themselves."""
    from mhla_cli.linalg import symgram
    from mhla_cli.linalg.tiled_matrix import TiledMatrix
    from mhla_cli.statistics.distributed.tiled_statistics import TiledStatistics

    dense = featurize(path, spans="off")
    G = np.asarray(dense.solver_stats()[1])  # the canonical Gram (basis_gram)
    d = dense.d
    q = d * (d + 1) // 2
    pairs = dense.copy()
    pairs.basis_gram = symgram.Pairs(symgram.pairs_from_gram(G, q, d), q, d)
    sums = dense.copy()
    sums.basis_gram = None
    tiles, sizes = _lower_tiles(G, 2 * d)  # two pairs a tile
    tiled = TiledStatistics(sums, TiledMatrix(None, tiles, sizes), 2)
    feats_file = path.with_name("feats.h5")
    dense.save(feats_file)
    return {"dense": dense, "pairs": pairs, "tiled": tiled, "features file": feats_file, "tokens file": path}


def test_one_certify_and_one_fit_for_every_storage(teacher_file: tuple) -> None:
    """mhla_cli.certify and mhla_cli.fit give the numpy reference's verdict, lambda_min and coef for the same data
    held dense, as pairs, tiled on dask's threaded scheduler (no cluster), and as a features or tokens file."""
    from mhla_cli.model.model import Model

    path, X, off, Y = teacher_file
    stats = _storages(path)
    assert stats["pairs"].gram_storage.__class__.__name__ == "PairsGram"
    A = stats["dense"].basis
    lam = ref.canonical(X, off, A=A)["eigenvalues"]
    H = np.stack([ref.features(X[a:b]) for a, b in zip(off[:-1], off[1:])])
    p = np.linalg.lstsq(H, Y, rcond=None)[0].T  # identifiable: the one least-squares solution
    for name, s in stats.items():
        cert = mhla_cli.certify(s)
        assert cert.identifiable and cert.proof == "cholesky of Lambda~ - t I", name
        assert abs(cert.lambda_min - lam[0]) <= 1e-8 * lam[0], name
        assert abs(cert.lambda_max - lam[-1]) <= 1e-7 * lam[-1], name
        assert bool(cert.tasks) == (name == "tiled"), name  # the tiled path ran over the tiles
        model = mhla_cli.fit(s)
        assert isinstance(model, Model) and rel(model.coef, p) <= 1e-8, name
        assert model.info["identifiable"], name
    ridge = {name: mhla_cli.fit(stats[name], ridge=1e-2).coef for name in ("dense", "tiled")}
    assert rel(ridge["tiled"], ridge["dense"]) <= 1e-10 and rel(ridge["dense"], p) > 1e-6


def test_statistics_in_memory_with_a_scheduler_are_refused(teacher_file: tuple) -> None:
    """A cluster takes a file or tiled statistics: Features in memory with a scheduler are refused before any work
    (no connection is tried), in the library's words (no option of the CLI)."""
    from mhla_cli.solve.cluster import ClusterRefused

    feats = featurize(teacher_file[0], spans="off")
    for call in (lambda: mhla_cli.certify(feats, scheduler="tcp://127.0.0.1:9"),
                 lambda: mhla_cli.fit(feats, scheduler="tcp://127.0.0.1:9")):
        with pytest.raises(ClusterRefused, match="on one machine") as exc:
            call()
        assert exc.value.rule == "in_memory" and "--" not in str(exc.value)


def test_one_certify_and_one_fit_with_the_affine_block(tmp_path: Path) -> None:
    """The same call certifies and fits the extended features when the statistics hold the affine block of the
    wide tokens (a Features record, or the tokens file with affine_from): the fit is numpy's least squares over
    [H(X), (x_wide, 1)], the certificate counts both blocks."""
    from mhla_cli.model.reduce import reduce_tokens

    rng = np.random.default_rng(5)
    off = np.concatenate([[0], np.cumsum(rng.integers(2, 7, size=80))]).astype(np.int64)
    T, D = int(off[-1]), 4
    Xw = rng.standard_normal((T, D)) @ rng.standard_normal((D, D)) / 2 + 0.3
    with h5py.File(tmp_path / "wide.h5", "w") as f:
        f["tokens"], f["offsets"], f["targets"] = Xw, off, rng.standard_normal((off.size - 1, D))
    reduce_tokens(tmp_path / "wide.h5", tmp_path / "red.h5", dim=2)
    with h5py.File(tmp_path / "red.h5") as f:
        Xr, Yr = f["tokens"][...], f["targets"][...]
    feats = featurize(tmp_path / "red.h5", affine_from=tmp_path / "wide.h5")
    rows = np.stack([np.concatenate([ref.features(Xr[a:b]), Xw[b - 1], [1.0]]) for a, b in zip(off[:-1], off[1:])])
    sol = np.linalg.lstsq(rows, Yr, rcond=None)[0].T
    psi = feats.n_features
    for s, kw in ((feats, {}), (tmp_path / "red.h5", {"affine_from": tmp_path / "wide.h5"})):
        cert = mhla_cli.certify(s, **kw)
        assert cert.n_features == psi + D + 1 and cert.identifiable
        model = mhla_cli.fit(s, **kw)
        assert model.affine_coef is not None
        assert rel(model.coef, sol[:, :psi]) <= 1e-7 and rel(model.affine_coef, sol[:, psi:]) <= 1e-7
    with pytest.raises(InputError, match="full domain"):
        mhla_cli.certify(feats, domain="observed")


def test_fit_warnings_word_their_remedy_for_the_caller() -> None:
    """A fit the data determine only on the observed domain: the library's warning names the library's call, the
    CLI's (words=REMEDY_OPTIONS) its option."""
    from mhla_cli.api.learn import fit_warnings
    from mhla_cli.cli.options import REMEDY_OPTIONS

    info = {"identifiable": False, "identifiable_observed": True, "n_samples": 3, "n_features": 9, "ridge": 0.0}
    lib, cli = fit_warnings(info), fit_warnings(info, words=REMEDY_OPTIONS)
    assert "mhla_cli.certify(..., domain='observed')" in lib[0] and "--" not in lib[0]
    assert "`mhla certify --domain observed`" in cli[0]
    assert lib[0].replace("mhla_cli.certify(..., domain='observed')", "") == \
        cli[0].replace("`mhla certify --domain observed`", "")


# ------------------------------------------------------------------- a sum of blocks (mhla_cli.solve.blocks)


def test_certify_and_fit_take_a_sum_of_blocks_statistics(tmp_path: Path) -> None:
    """The one dispatcher of each verb sends a sum of blocks' statistics to mhla_cli.solve.blocks (the same
    certificate and fit as certify_blocks / fit_blocks), and refuses what does not apply to them."""
    from mhla_cli.api.learn import RequestError
    from mhla_cli.solve.blocks import certify_blocks, fit_blocks

    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((60, 4, 3)), rng.standard_normal((60, 2))
    mhla_cli.write_tokens(tmp_path / "t.h5", X, targets=Y)
    stats = mhla_cli.block_statistics(tmp_path / "t.h5", [np.eye(3)[:, :2], np.eye(3)[:, 2:]], folds=3)
    assert isinstance(stats, mhla_cli.BlockStatistics)
    got_cert, want_cert = (c.to_dict() for c in (mhla_cli.certify(stats), certify_blocks(stats)))
    assert got_cert.pop("seconds") is not None and want_cert.pop("seconds") is not None
    assert got_cert == want_cert
    got, want = mhla_cli.fit(stats, ridge="auto"), fit_blocks(stats, ridge="auto")
    assert isinstance(got, mhla_cli.HeadsSum) and got.info["ridge"] == want.info["ridge"]
    assert np.array_equal(got.predict(X), want.predict(X))
    for kw in ({"heads": 2}, {"nuclear": 1.0}, {"folds": [featurize(tmp_path / "t.h5")]}):
        with pytest.raises(RequestError) as exc:
            mhla_cli.fit(stats, **kw)  # type: ignore[arg-type]
        assert exc.value.rule == "blocks_least_squares"
    for call in (lambda: mhla_cli.fit(stats, device="cuda"), lambda: mhla_cli.certify(stats, domain="observed"),
                 lambda: mhla_cli.certify(stats, scheduler="local"), lambda: mhla_cli.fit(stats, chunk_size=7),
                 lambda: mhla_cli.certify(stats, affine_from=tmp_path / "t.h5")):
        with pytest.raises(RequestError) as exc:
            call()
        assert exc.value.rule == "blocks_in_memory"
