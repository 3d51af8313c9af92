"""Bidirectional per-position data (every position of the whole window, an encoder's attention) against plain
numpy on MATERIALISED per-position features: statistics, the canonical certificate, fit and predict, with
weights that mask positions and `--normalize length`; metamorphic tests (hypothesis); structural cases; the
options and files of `--attention`.

The references (tests/_reference.py) build every position's sample as its window with that position moved
last, and its features with explicit loops: S of the whole window times x_t. They never call mhla_cli's
kernels.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import _reference as ref
from _metamorphic import (FILE_SETTINGS, SETTINGS, Data, check_partial_fit, datasets, file_variants, predict_model,
                          probes, same_certificate, transform)
from conftest import relerr
from mhla_cli import MHLA
from mhla_cli import fit as learn_fit
from mhla_cli.cli import run
from mhla_cli.model import synthetic
from mhla_cli.model.forward import forward_heads, predict_file, predict_samples
from mhla_cli.model.heads import Heads
from mhla_cli.samples import BIDIRECTIONAL, CAUSAL, LAST
from mhla_cli import certify
from mhla_cli.solve.lstsq import fit
from mhla_cli.solve.probes import certify_probes
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.accumulate import chunk_features
from mhla_cli.statistics.stream import featurize
from mhla_cli.errors import InputError
from mhla_cli.samples import ReadSpec, samples_of


def windows(rng: np.random.Generator, n_seq: int, d: int, lo: int = 1, hi: int = 8) -> tuple[np.ndarray, np.ndarray]:
    lengths = rng.integers(lo, hi + 1, size=n_seq)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return rng.standard_normal((int(off[-1]), d)), off


def write(path: Path, attention: str | None = "bidirectional", **data: np.ndarray) -> Path:
    """A tokens file as a user (or `mhla convert --attention`) writes it."""
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f[k] = v
        if attention is not None:
            f.attrs["attention"] = attention
    return path


def ref_stats(X: np.ndarray, off: np.ndarray, Y: np.ndarray, w: np.ndarray | None, normalize: str
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, float, float]:
    """gram, moments, target_gram (own features), the count of weighted positions, sum w and sum w n, over
    the materialised features of every position (S of its whole window, x_t)."""
    G = M = TG = 0.0
    n, W, Wn = 0, 0.0, 0.0
    for Xs, wt, t in ref.samples(X, off, True, w, attention="bidirectional"):
        h = ref.features(Xs, normalize)
        G = G + wt * np.outer(h, h)
        M = M + wt * np.outer(h, Y[t])
        TG = TG + wt * np.outer(Y[t], Y[t])
        n += wt > 0
        W += wt
        Wn += wt * Xs.shape[0]
    return G, M, TG, n, W, Wn


# --------------------------------------------------------------------------------------------
# statistics, certificate, fit and predict against the materialised reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", ["none", "length"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dense", [False, True])
def test_statistics_and_certificate_match_the_materialised_reference(tmp_path: Path, normalize: str,
                                                                     weighted: bool, dense: bool) -> None:
    rng = np.random.default_rng(11 + 2 * weighted + dense)
    d = 3
    if dense:
        X, off = rng.standard_normal((20 * 5, d)), np.arange(21, dtype=np.int64) * 5
    else:
        X, off = windows(rng, 25, d)
    Y = rng.standard_normal((X.shape[0], d))
    w = None
    if weighted:
        w = rng.uniform(0.2, 2.0, X.shape[0])
        w[rng.random(X.shape[0]) < 0.3] = 0.0  # masked positions (a prompt, padding)
    N = off.size - 1
    data = ({"tokens": X.reshape(N, 5, d), "targets": Y.reshape(N, 5, d)} if dense
            else {"tokens": X, "offsets": off, "targets": Y})
    if w is not None:
        data["weights"] = w.reshape(N, 5) if dense else w
    path = write(tmp_path / "b.h5", **data)
    G, M, TG, n, W, Wn = ref_stats(X, off, Y, w, normalize)
    for chunk in (3, None):
        f = featurize(path, chunk_size=chunk, normalize=normalize)
        assert f.samples is BIDIRECTIONAL and f.normalize == normalize
        assert f.n_samples == n and f.n_sequences == N and f.n_tokens == X.shape[0]
        assert abs(f.weight - W) <= 1e-12 * W and abs(f.token_weight - Wn) <= 1e-12 * Wn
        assert relerr(f.gram, G) < 1e-10 and relerr(f.moments, M) < 1e-10 and relerr(f.target_gram, TG) < 1e-10
        ww = np.ones(X.shape[0]) if w is None else w
        assert relerr(f.last_token_gram, np.einsum("t,ti,tj->ij", ww, X, X)) < 1e-12  # every query x_t
    # the canonical certificate: the spectrum of the materialised Lambda~
    r = ref.canonical(X, off, Y, True, w, normalize, attention="bidirectional")
    cert = certify(f)
    ev = r["eigenvalues"]
    assert cert.identifiable == (ev[0] > 1e-9 * ev[-1])
    assert abs(cert.lambda_max - ev[-1]) <= 1e-9 * ev[-1]
    assert abs(cert.lambda_min - ev[0]) <= 1e-9 * (ev[0] if cert.identifiable else ev[-1])
    # the observed domain: queries span the tokens' span
    wo, dim_u, dim_un = ref.observed_eigenvalues(X, off, f.basis, True, w, normalize=normalize,
                                                 attention="bidirectional")
    obs = certify(f, domain="observed")
    assert (obs.dim_tokens, obs.dim_last_tokens) == (dim_u, dim_un) == (d, d)
    assert abs(obs.lambda_min - wo[0]) <= 1e-9 * wo[-1]


@pytest.mark.parametrize("normalize", ["none", "length"])
def test_fit_and_predict_every_position_with_masked_positions(tmp_path: Path, normalize: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A 2-head teacher's outputs at every position (the whole window's S); a prompt of each window masked
    (weight 0, its targets garbage): the fit recovers the teacher, numpy's lstsq on the materialised
    features agrees, and predict writes and scores the outputs at every weighted position."""
    rng = np.random.default_rng(5)
    d = 3
    teacher = synthetic.random_teacher(d, 2, rng)
    teacher.info["normalize"] = normalize
    X, off = windows(rng, 14, d, 2, 9)
    Y = np.concatenate([forward_heads(teacher.V, teacher.Q, X[a:b], all_positions=True, normalize=normalize)
                        for a, b in zip(off[:-1], off[1:])])
    w = np.ones(X.shape[0])
    w[off[:-1]] = 0.0  # the first position of every window is a prompt: attended to, not scored
    Y[off[:-1]] = 1e3 * rng.standard_normal((off.size - 1, d))
    path = write(tmp_path / "t.h5", tokens=X, offsets=off, targets=Y, weights=w)
    feats = featurize(path, normalize=normalize)
    model = learn_fit(feats)  # mhla_cli.fit: the model records the attention
    assert model.info["identifiable"] and model.info["attention"] == "bidirectional"
    p_true = ref.teacher_p(teacher)
    assert relerr(model.coef, p_true) < 1e-8
    r = ref.canonical(X, off, Y, True, w, normalize, attention="bidirectional")
    Zs = probes(d, 3)
    want = ref.predict_canonical(ref.min_norm_function(r, rcond=1e-12), r["A"], Zs, normalize)
    assert ref.ratio(ref.predict_own(model.coef, Zs, normalize), want) < 1e-8
    # the CLI: fit records the attention, predict writes the outputs at every position and scores them
    mpath, out = tmp_path / "m.h5", tmp_path / "p.h5"
    args = ["--normalize", normalize]
    assert run(["fit", str(path), "-o", str(mpath), "-q", *args]) == 0
    with h5py.File(mpath) as f:
        assert f.attrs["attention"] == "bidirectional"
    capsys.readouterr()
    assert run(["predict", str(mpath), str(path), "-o", str(out), "--json", "--chunk-size", "4"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["n_scored"] == int((w > 0).sum()) and res["mse"] < 1e-20 and abs(res["r2"] - 1) < 1e-12
    with h5py.File(out) as f:
        outputs, pred, offsets = f["outputs"][()], f["predictions"][()], f["offsets"][()]
        assert f.attrs["attention"] == "bidirectional"
    full = np.concatenate([forward_heads(teacher.V, teacher.Q, X[a:b], True, normalize)
                           for a, b in zip(off[:-1], off[1:])])
    assert relerr(outputs, full) < 1e-9 and np.array_equal(offsets, off)
    assert relerr(pred, full[off[1:] - 1]) < 1e-9
    # the same through workers, and in memory
    out2 = tmp_path / "p2.h5"
    assert run(["predict", str(mpath), str(path), "-o", str(out2), "-q", "--workers", "2", "--chunk-size", "3"]) == 0
    with h5py.File(out2) as f:
        assert np.array_equal(f["outputs"][()], outputs)
    assert relerr(predict_samples(model, X, off), full) < 1e-9
    # a bidirectional model evaluated on prefixes is refused (one line naming the attention)
    capsys.readouterr()
    assert run(["predict", str(mpath), str(path), "-o", str(tmp_path / "x.h5"), "--causal"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bidirectional" in err and not (tmp_path / "x.h5").exists()


def test_spans_chunks_device_and_a_wide_window(tmp_path: Path) -> None:
    """Structured tokens (a coordinate always 0): the block on the data's spans, every chunk size and the
    torch path give the reference's statistics."""
    pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    d = 4
    X, off = windows(rng, 30, d, 1, 12)
    X[:, 2] = 0.0
    Y = rng.standard_normal((X.shape[0], d))
    w = rng.uniform(0.0, 1.0, X.shape[0])
    path = write(tmp_path / "s.h5", tokens=X, offsets=off, targets=Y, weights=w)
    G, M, TG, n, _, _ = ref_stats(X, off, Y, w, "length")
    base = featurize(path, normalize="length", spans="off")
    block = featurize(path, normalize="length", spans="on")
    assert block.on_spans and block.basis_gram_held.shape[0] < base.n_features
    dev = featurize(path, normalize="length", chunk_size=7, device="torch:cpu")
    dev_block = featurize(path, normalize="length", spans="on", device="torch:cpu")
    for f in (base, block.expand(), dev, dev_block.expand()):
        assert f.n_samples == n
        assert relerr(f.gram, G) < 1e-10 and relerr(f.moments, M) < 1e-10 and relerr(f.target_gram, TG) < 1e-10
    same_certificate(certify(block), certify(base), rel=1e-9)


# --------------------------------------------------------------------------------------------
# structural cases whose truth is known
# --------------------------------------------------------------------------------------------


def test_windows_of_length_one_are_last_token_samples(tmp_path: Path) -> None:
    """One token per window: S = x x^T and the query is x in every layout, so the three agree."""
    rng = np.random.default_rng(2)
    X = rng.standard_normal((40, 3))
    Y = rng.standard_normal((40, 3))
    off = np.arange(41)
    a, b, c = (chunk_features(X, off, Y, 3, read=ReadSpec(samples_of(pp, att)), basis="identity")
               for pp, att in ((False, None), (True, "causal"), (True, "bidirectional")))
    assert (a.samples, b.samples, c.samples) == (LAST, CAUSAL, BIDIRECTIONAL)
    for f in (b, c):
        for k in ("gram", "moments", "target_gram", "token_gram", "last_token_gram"):
            assert relerr(getattr(f, k), getattr(a, k)) < 1e-13, k
        assert f.n_samples == a.n_samples and f.weight == a.weight and f.token_weight == a.token_weight
    # and they never certify (symmetric cubic tensors), in the new layout too
    assert not certify(c).identifiable


def test_masking_all_but_the_last_position_gives_the_last_token_statistics(tmp_path: Path) -> None:
    """Weight 1 on each window's last position, 0 elsewhere: the bidirectional samples are the last-token
    samples (S of the window, x_n), sums and weight totals alike."""
    rng = np.random.default_rng(3)
    X, off = windows(rng, 30, 3, 1, 7)
    Y = rng.standard_normal((X.shape[0], 3))
    w = np.zeros(X.shape[0])
    w[off[1:] - 1] = 1.0
    bi = chunk_features(X, off, Y, 3, weights=w, read=ReadSpec(samples_of(True, "bidirectional"), "length"))
    last = chunk_features(X, off, Y[off[1:] - 1], 3, read=ReadSpec(samples_of(False), "length"))
    for k in ("gram", "moments", "target_gram", "token_gram", "last_token_gram"):
        assert relerr(getattr(bi, k), getattr(last, k)) < 1e-12, k
    assert (bi.n_samples, bi.weight, bi.token_weight) == (last.n_samples, last.weight, last.token_weight)


def test_a_constant_window_and_few_windows(tmp_path: Path) -> None:
    """Every position of a window shares its S: a bidirectional dataset of N windows has rank at most N
    times the token factor's, so few long windows never certify while the causal reading of the same
    tokens may (its prefixes' S differ)."""
    rng = np.random.default_rng(4)
    d = 3
    X, off = rng.standard_normal((4 * 20, d)), np.arange(5) * 20  # 4 windows < q = 6 pair coordinates
    Y = rng.standard_normal((X.shape[0], d))
    bi = certify(chunk_features(X, off, Y, d, read=ReadSpec(samples_of(True, "bidirectional"))))
    causal = certify(chunk_features(X, off, Y, d, read=ReadSpec(samples_of(True))))
    assert not bi.identifiable and bi.rank <= 4 * d
    assert causal.identifiable


# --------------------------------------------------------------------------------------------
# metamorphic: what cannot change the answer
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(data=datasets(attention="bidirectional"), cond=st.sampled_from([1.0, 30.0, 1e3]),
       tseed=st.integers(0, 1000))
def test_certificate_and_fit_are_unit_free_and_match_the_reference(data: Data, cond: float, tseed: int) -> None:
    """An invertible (rotated, ill-conditioned) map of the token coordinates changes neither the certificate
    nor the fitted function; both equal the materialised reference."""
    r = data.reference()
    feats = data.feats()
    assert feats.samples is BIDIRECTIONAL
    cert = certify(feats)
    w = r["eigenvalues"]
    assert abs(cert.lambda_max - w[-1]) <= 1e-9 * w[-1]
    assert abs(cert.lambda_min - w[0]) <= 1e-9 * (abs(w[0]) if cert.identifiable else w[-1])
    T = transform(data.d, cond, tseed)
    XT = data.tokens.astype(np.float64) @ T
    same_certificate(certify(data.feats(XT)), cert)
    Zs = probes(data.d, tseed + 1)
    for ridge in (0.0, 1e-3 * cert.lambda_max):
        want, got = predict_model(fit(feats, ridge=ridge), Zs), predict_model(fit(data.feats(XT), ridge=ridge),
                                                                              [Z @ T for Z in Zs])
        assert ref.ratio(got, want) < 1e-8, ridge
    if cert.identifiable:
        want = ref.predict_canonical(ref.min_norm_function(r, rcond=1e-12), r["A"], Zs, data.normalize)
        assert ref.ratio(ref.predict_own(fit(feats).coef, Zs, data.normalize), want) < 1e-8


@FILE_SETTINGS
@given(data=datasets(attention="bidirectional"), chunk=st.integers(1, 40), pseed=st.integers(0, 1000))
def test_order_chunks_shards_workers_and_duplicates_do_not_change_the_answer(
        data: Data, chunk: int, pseed: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp("b")
    path = data.write(tmp / "d.h5")
    base = featurize(path, normalize=data.normalize)  # the file's attribute says bidirectional
    assert base.samples is BIDIRECTIONAL
    cert = certify(base)
    w = data.reference()["eigenvalues"]
    assert abs(cert.lambda_min - w[0]) <= 1e-9 * (abs(w[0]) if cert.identifiable else w[-1])
    Zs = probes(data.d, pseed)
    fn = ref.predict_own(fit(base).coef, Zs, data.normalize)
    variants = file_variants(data, path, tmp, chunk, pseed)
    for name, v in variants.items():
        assert v.samples is BIDIRECTIONAL, name
        same_certificate(certify(v), cert, rel=1e-8)
        assert ref.ratio(ref.predict_own(fit(v).coef, Zs, data.normalize), fn) < 1e-8, name
    assert ref.ratio(certify(variants["duplicated"]).eigenvalues, cert.eigenvalues) < 1e-10


@pytest.mark.filterwarnings("ignore::UserWarning")
@SETTINGS
@given(data=datasets(attention="bidirectional"), cuts=st.lists(st.integers(1, 39), min_size=1, max_size=3,
                                                               unique=True))
def test_partial_fit_equals_the_fit_of_the_concatenation(data: Data, cuts: list[int]) -> None:
    check_partial_fit(data, cuts)
    if data.weights is not None and not (data.weights > 0).any():
        return
    # predict: the output at every token, with the whole window's S
    X = data.tokens.astype(np.float64)
    seqs = [X[a:b] for a, b in zip(data.offsets[:-1], data.offsets[1:])]
    est = MHLA(per_position=True, attention="bidirectional", normalize=data.normalize).fit(
        seqs, [data.targets[a:b] for a, b in zip(data.offsets[:-1], data.offsets[1:])], sample_weight=data.weights)
    assert relerr(est.predict(seqs), predict_samples(est.model_, X, data.offsets, BIDIRECTIONAL)) < 1e-12


# --------------------------------------------------------------------------------------------
# --attention: the options, the files' attribute, and what is refused
# --------------------------------------------------------------------------------------------


def _teacher_file(tmp_path: Path, name: str, attention: str | None, n: int = 40, seed: int = 1) -> Path:
    ds, _ = synthetic.generate_teacher(3, 2, n, "2:8", seed=seed, read=ReadSpec(samples_of(True, "bidirectional")))
    return write(tmp_path / name, attention=attention, tokens=ds.tokens, offsets=ds.offsets, targets=ds.targets)


def test_the_option_the_attribute_and_the_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marked = _teacher_file(tmp_path, "marked.h5", "bidirectional")
    plain = _teacher_file(tmp_path, "plain.h5", None)
    # the attribute is read without the option; the option reads an unmarked file; both say so
    fa, fb = tmp_path / "a.h5", tmp_path / "b.h5"
    capsys.readouterr()
    assert run(["featurize", str(marked), "-o", str(fa)]) == 0
    err = capsys.readouterr().err
    assert "every position of the whole window" in err and "by default" not in err
    assert run(["featurize", str(plain), "-o", str(fb), "--attention", "bidirectional", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["attention"] == "bidirectional"
    a, b = Features.load(fa), Features.load(fb)
    assert a.samples is b.samples is BIDIRECTIONAL and relerr(a.gram, b.gram) < 1e-13
    with h5py.File(fa) as f:
        assert f.attrs["attention"] == "bidirectional" and f.attrs["per_position"] == 1
    for p in (marked, fa):  # inspect says it
        assert run(["inspect", str(p), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["attention"] == "bidirectional"
    # no attribute and no option: causal, and the output says so (with the way to read it otherwise)
    assert run(["featurize", str(plain), "-o", str(tmp_path / "c.h5")]) == 0
    err = capsys.readouterr().err
    assert "causal prefixes" in err and "by default" in err and "--attention bidirectional" in err
    assert Features.load(tmp_path / "c.h5").samples is CAUSAL
    for cmd in (["fit", str(plain), "-o", str(tmp_path / "m.h5")], ["certify", str(plain)],
                ["featurize", str(plain), "-o", str(tmp_path / "q.h5"), "-q"], ["fit", str(plain), "-o",
                                                                              str(tmp_path / "mq.h5"), "-q"]):
        run(cmd)
        assert "warning" in (err := capsys.readouterr().err) and "by default" in err, cmd  # also with -q
    # an option that contradicts the attribute: exit 2, one line naming both
    for cmd in (["featurize", str(marked), "-o", str(tmp_path / "x.h5"), "--attention", "causal"],
                ["fit", str(marked), "-o", str(tmp_path / "x.h5"), "--attention", "causal"],
                ["certify", str(marked), "--attention", "causal"],
                ["fit", str(fa), "-o", str(tmp_path / "x.h5"), "--attention", "causal"]):
        assert run(cmd) == 2, cmd
        err = capsys.readouterr().err
        assert err.startswith("mhla: error:") and err.count("\n") == 1 and "causal" in err \
            and "bidirectional" in err, (cmd, err)
        assert not (tmp_path / "x.h5").exists()
    # --attention of last-token data (targets per sequence) is refused
    ds, _ = synthetic.generate_teacher(2, 1, 20, "2:5", seed=2)
    last = tmp_path / "last.h5"
    ds.save(last)
    assert run(["featurize", str(last), "-o", str(tmp_path / "x.h5"), "--attention", "bidirectional"]) == 2
    assert "per sequence" in capsys.readouterr().err


def test_layouts_do_not_add_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marked = _teacher_file(tmp_path, "marked.h5", "bidirectional")
    plain = _teacher_file(tmp_path, "plain.h5", None)
    p0, p1 = tmp_path / "p0.h5", tmp_path / "p1.h5"
    assert run(["featurize", str(marked), "--shard", "0/2", "-o", str(p0), "-q"]) == 0
    assert run(["featurize", str(plain), "--shard", "1/2", "-o", str(p1), "-q"]) == 0
    capsys.readouterr()
    assert run(["merge", str(p0), str(p1), "-o", str(tmp_path / "m.h5")]) == 2
    err = capsys.readouterr().err
    assert "bidirectional" in err and "causal" in err and err.count("\n") == 1
    with pytest.raises(InputError, match="bidirectional samples"):
        Features.load(p1) + Features.load(p0)
    with pytest.raises(InputError, match="per_position=True"):
        MHLA(attention="bidirectional").fit(np.ones((3, 2, 2)), np.ones((3, 2)))


def test_folds_ridge_auto_dask_and_probes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--ridge auto (folds featurized bidirectionally), featurize --folds, Dask, and certify --on: the
    probes of bidirectional statistics are every position of each window."""
    plain = _teacher_file(tmp_path, "plain.h5", None, n=30)
    m = tmp_path / "m.h5"
    capsys.readouterr()
    assert run(["fit", str(plain), "-o", str(m), "--ridge", "auto", "--attention", "bidirectional", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["attention"] == "bidirectional" and info["ridge_cv"]["n_folds"] == 5
    ff = tmp_path / "ff.h5"
    assert run(["featurize", str(plain), "-o", str(ff), "--folds", "3", "--attention", "bidirectional", "-q"]) == 0
    assert Features.load(ff).samples is BIDIRECTIONAL
    assert run(["fit", str(ff), "-o", str(m), "--heads", "auto", "-q"]) == 0
    # Dask: the same statistics as the serial pass
    pytest.importorskip("dask.distributed")
    whole = featurize(plain, attention="bidirectional")
    dk = featurize(plain, attention="bidirectional", scheduler="local:1", chunk_size=7)
    assert dk.samples is BIDIRECTIONAL and relerr(dk.gram, whole.gram) < 1e-12
    # certify --on: probe windows without weights (every position), then one position masked per window
    rng = np.random.default_rng(9)
    P, poff = windows(rng, 5, 3, 2, 6)
    probes_file = write(tmp_path / "probes.h5", attention=None, tokens=P, offsets=poff)
    rep = certify_probes(whole, probes_file)
    assert rep.samples is BIDIRECTIONAL and rep.n_probes == P.shape[0] and rep.determined
    wp = np.ones(P.shape[0])
    wp[poff[:-1]] = 0.0
    masked = write(tmp_path / "masked.h5", attention=None, tokens=P, offsets=poff, weights=wp)
    assert certify_probes(whole, masked).n_probes == int(wp.sum())
    assert run(["certify", str(plain), "--attention", "bidirectional", "--on", str(probes_file), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["attention"] == "bidirectional"
    # probes marked causal contradict bidirectional statistics
    causal_probes = write(tmp_path / "cp.h5", attention="causal", tokens=P, offsets=poff, weights=wp)
    with pytest.raises(InputError, match="causal"):
        certify_probes(whole, causal_probes)


def test_heads_and_teachers_keep_the_attention(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`generate teacher --attention bidirectional` writes the attribute and a teacher whose predict scores every
    position; export-heads keeps the attention in every heads format."""
    g, th = tmp_path / "g.h5", tmp_path / "th.h5"
    assert run(["generate", "teacher", "-o", str(g), "--dim", "3", "--heads", "2", "--n-samples", "12",
                "--seq-len", "2:9", "--per-position", "--attention", "bidirectional", "--dtype", "float64",
                "--teacher-out", str(th), "-q"]) == 0
    with h5py.File(g) as f:
        assert f.attrs["attention"] == "bidirectional"
    capsys.readouterr()
    assert run(["predict", str(th), str(g), "-o", str(tmp_path / "p.h5"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mse"] < 1e-20
    m = tmp_path / "m.h5"
    assert run(["fit", str(g), "-o", str(m), "-q"]) == 0
    for suffix in (".h5", ".npz"):
        h = tmp_path / f"h{suffix}"
        assert run(["export-heads", str(m), "-o", str(h), "-q"]) == 0
        from mhla_cli.model.model import load_function

        assert load_function(h).info["attention"] == "bidirectional"
    heads = Heads.load(tmp_path / "h.h5")
    res = predict_file(heads, g)
    assert res.n_scored == int(np.diff(h5py.File(g)["offsets"][()]).sum()) and res.mse < 1e-20


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e200])
def test_bad_tokens_are_refused_even_in_a_masked_window(tmp_path: Path, bad: float) -> None:
    """The token Grams of bidirectional rows come from the windows' S, not a pass over the tokens: NaN, Inf
    and overflowing tokens are still refused, naming the sample, also where every position weighs 0."""
    rng = np.random.default_rng(12)
    X, off = windows(rng, 12, 3, 2, 6)
    Y = rng.standard_normal((X.shape[0], 3))
    w = np.ones(X.shape[0])
    w[off[7]:off[8]] = 0.0  # window 7 is masked
    X[off[7] + 1, 2] = bad
    path = write(tmp_path / "bad.h5", tokens=X, offsets=off, targets=Y, weights=w)
    for chunk in (4, None):
        with pytest.raises(InputError, match="sample 7"):
            featurize(path, chunk_size=chunk, spans="off", basis="identity")  # no basis sample read first
