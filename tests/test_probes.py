"""`certify --on PROBES` against a plain numpy range test (lstsq residual on the training features)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli.cli import run


def ref_H(X: np.ndarray, normalize: str = "none") -> np.ndarray:
    d = X.shape[1]
    S = X.T @ X / (X.shape[0] if normalize == "length" else 1)
    return np.array([S[j, k] * X[-1, l] for j in range(d) for k in range(j, d) for l in range(d)])


def prefix_features(X: np.ndarray, off: np.ndarray, normalize: str = "none") -> np.ndarray:
    return np.array([ref_H(X[off[i]:t + 1], normalize) for i in range(off.size - 1)
                     for t in range(off[i], off[i + 1])])


def range_residual(Htrain: np.ndarray, Hprobe: np.ndarray) -> np.ndarray:
    """||h - proj_{row space of Htrain} h|| / ||h|| by least squares (numpy.linalg.lstsq)."""
    coef, *_ = np.linalg.lstsq(Htrain.T, Hprobe.T, rcond=None)
    r = Hprobe.T - Htrain.T @ coef
    return np.linalg.norm(r, axis=0) / np.linalg.norm(Hprobe, axis=1)


def write(path: Path, **data: np.ndarray) -> Path:
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f[k] = v
    return path


def structured(rng: np.random.Generator, n_seq: int, n: int, d: int, dead: int) -> np.ndarray:
    """Tokens whose coordinate `dead` is 0 except in a few sequences (a rank-deficient gram)."""
    X = rng.standard_normal((n_seq, n, d))
    X[:, :, dead] = 0.0
    return X


@pytest.mark.parametrize("normalize", ["none", "length"])
def test_on_matches_numpy_range_test(tmp_path: Path, capsys: pytest.CaptureFixture[str], normalize: str) -> None:
    rng = np.random.default_rng(0)
    d, n = 3, 6
    # training data: per-position, coordinate 2 always 0 -> every feature touching it is unseen
    Xtr = structured(rng, 12, n, d, dead=2)
    off_tr = np.arange(13) * n
    Ytr = rng.standard_normal((12 * n, d))
    train = write(tmp_path / "train.h5", tokens=Xtr.reshape(-1, d), offsets=off_tr, targets=Ytr)
    # probes: half live in the training span (coordinate 2 = 0), half do not
    Xp = rng.standard_normal((10, n, d))
    Xp[:5, :, 2] = 0.0
    wp = (rng.random((10, n)) > 0.3).astype(float)
    probes = write(tmp_path / "probes.h5", tokens=Xp, weights=wp)  # per-position weights: every weighted prefix
    rep = tmp_path / "rep.h5"
    capsys.readouterr()
    code = run(["certify", str(train), "--on", str(probes), "-o", str(rep), "--json", "--normalize", normalize,
                "--chunk-size", "3"])
    out = json.loads(capsys.readouterr().out)
    Htr = prefix_features(Xtr.reshape(-1, d), off_tr, normalize)
    Hp = prefix_features(Xp.reshape(-1, d), np.arange(11) * n, normalize)[wp.reshape(-1) > 0]
    ref = range_residual(Htr, Hp)
    ref_und = ref > 1e-8
    assert out["n_probes"] == Hp.shape[0] and out["determined"] == (not ref_und.any())
    assert abs(out["n_undetermined"] - int(ref_und.sum())) <= 0.02 * Hp.shape[0]
    assert code == (1 if ref_und.any() else 0) and ref_und.any() and not ref_und.all()
    with h5py.File(rep) as f:
        assert f.attrs["mhla_kind"] == "probes"
        res, und = f["residual"][()], f["undetermined"][()]
        seq, pos = f["sequence"][()], f["position"][()]
    assert np.array_equal(np.flatnonzero(res > 1e-8), und)
    assert np.array_equal(und, np.flatnonzero(ref_und))
    # the residual values are relative components measured on the canonical features (as the
    # certificate): the same range test on the features of Z A in orthonormal coordinates
    from mhla_cli.statistics.basis import feature_scale
    from mhla_cli.statistics.stream import featurize

    A = featurize(train, normalize=normalize).basis
    D = feature_scale(d)
    Htr_b = prefix_features(Xtr.reshape(-1, d) @ A, off_tr, normalize) * D
    Hp_b = prefix_features(Xp.reshape(-1, d) @ A, np.arange(11) * n, normalize)[wp.reshape(-1) > 0] * D
    assert np.allclose(res, range_residual(Htr_b, Hp_b), atol=1e-7)
    ws, wpos = np.nonzero(wp)
    assert np.array_equal(seq, ws) and np.array_equal(pos, wpos)


def test_on_exit_zero_when_all_determined(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(1)
    d = 2
    X = rng.standard_normal((30, 4, d))
    train = write(tmp_path / "t.h5", tokens=X, targets=rng.standard_normal((30, d)))
    probes = write(tmp_path / "p.h5", tokens=rng.standard_normal((7, 3, d)))  # last-token probes
    capsys.readouterr()
    assert run(["certify", str(train), "--on", str(probes), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["determined"] and out["n_probes"] == 7 and out["n_undetermined"] == 0
    # from a features file too, and a rank-deficient one fails on generic probes
    feats = tmp_path / "f.h5"
    assert run(["featurize", str(train), "-o", str(feats), "-q"]) == 0
    assert run(["certify", str(feats), "--on", str(probes), "-q"]) == 0
    few = write(tmp_path / "few.h5", tokens=X[:2], targets=rng.standard_normal((2, d)))
    capsys.readouterr()
    assert run(["certify", str(few), "--on", str(probes), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["n_undetermined"] == 7
    # the training inputs themselves are always determined
    assert run(["certify", str(few), "--on", str(few), "-q"]) == 0


def test_on_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(2)
    train = write(tmp_path / "t.h5", tokens=rng.standard_normal((20, 3, 2)), targets=rng.standard_normal((20, 2)))
    other_d = write(tmp_path / "d3.h5", tokens=rng.standard_normal((4, 3, 3)))
    zero_w = write(tmp_path / "z.h5", tokens=rng.standard_normal((4, 3, 2)), weights=np.zeros((4, 3)))
    neg_w = write(tmp_path / "n.h5", tokens=rng.standard_normal((4, 3, 2)), weights=-np.ones((4, 3)))
    probes = write(tmp_path / "p.h5", tokens=rng.standard_normal((4, 3, 2)))
    rep = tmp_path / "r.h5"
    bad = [
        ["certify", str(train), "--on", str(other_d), "-o", str(rep)],
        ["certify", str(train), "--on", str(zero_w), "-o", str(rep)],
        ["certify", str(train), "--on", str(neg_w), "-o", str(rep)],
        ["certify", str(train), "--on", str(tmp_path / "missing.h5"), "-o", str(rep)],
        ["certify", str(train), "--on", str(probes), "-o", str(probes)],  # would overwrite an input
        ["certify", str(train), "-o", str(rep)],  # a report without --on
        ["certify", str(train), "--on", str(probes), "--domain", "observed", "-o", str(rep)],
        ["certify", str(train), "--on", str(probes), "--witness", str(tmp_path / "w.h5")],
    ]
    for args in bad:
        capsys.readouterr()
        assert run(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("mhla: error:") and err.count("\n") == 1, err
        assert not rep.exists()


def test_null_space_of_any_domain_gives_the_numpy_verdicts(tmp_path: Path) -> None:
    """mhla_cli.solve.probes directly: the full and the observed domain's null spaces decide every probe as
    the numpy range test does; a probe outside the observed domain counts its part outside as undetermined."""
    from mhla_cli.solve.probes import certify_probes, null_space
    from mhla_cli.statistics.stream import featurize

    rng = np.random.default_rng(1)
    d, n = 3, 5
    Xtr = structured(rng, 300, n, d, dead=1)  # last-token data, coordinate 1 always 0: observed dim U = 2
    Ytr = rng.standard_normal((300, d))
    train = write(tmp_path / "train.h5", tokens=Xtr, targets=Ytr)
    Xp = rng.standard_normal((12, n, d))
    Xp[:6, :, 1] = 0.0  # half in the observed domain
    probes = write(tmp_path / "probes.h5", tokens=Xp)
    ref = range_residual(np.stack([ref_H(x) for x in Xtr]), np.stack([ref_H(x) for x in Xp])) > 1e-8
    assert not ref[:6].any() and ref[6:].all()
    feats = featurize(train)
    assert null_space(feats, "observed").domain == "observed" and null_space(feats).row_maps is None
    for domain in ("full", "observed"):
        rep = certify_probes(feats, probes, domain=domain)
        assert np.array_equal(rep.residual > rep.tol, ref), domain
        assert rep.n_probes == 12 and not rep.determined
