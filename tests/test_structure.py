"""The data's spans (mhla_cli.statistics.structure): the block on span{S_i} (x) U_n gives the plain dense
eigendecomposition's verdict, rank, lambda_min / lambda_max (1e-10 of lambda_max), minimum-norm and
ridge functions and probe verdicts, against plain numpy on the materialised canonical features
(tests/_reference.py), on data whose spans hold a small block (one-hot, DFA traces, tokens in a
subspace, a dead coordinate) and where they hold every feature (dense Gaussian, length-1 sequences)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from _reference import canonical, min_norm_function, predict_canonical, predict_own, ratio, ridge_function

from mhla_cli.linalg import factorization
from mhla_cli.model import synthetic
from mhla_cli.statistics.basis import kron_apply
from mhla_cli.feature_map import n_features
from mhla_cli.solve.probes import certify_probes
from mhla_cli import certify
from mhla_cli.solve.domains import factorize
from mhla_cli.solve.lstsq import fit
from mhla_cli.solve.domains import OBSERVED
from mhla_cli.statistics.accumulate import chunk_features
from mhla_cli.statistics.structure import Structure, find_structure, partial_traces
from conftest import unseal
from mhla_cli.samples import ReadSpec, samples_of

EPS = float(np.finfo(np.float64).eps)


def _dfa(Q: int, S: int, n: int, L: int, seed: int) -> dict:
    """Per-position DFA traces (experiments/dfa_executor.py's embedding, d = QS + Q)."""
    rng = np.random.default_rng(seed)
    d = Q * S + Q
    toks, ys, ws, offs = [], [], [], [0]
    for _ in range(n):
        delta = rng.integers(0, Q, size=(Q, S))
        T = np.zeros((Q * S + L, d))
        Y = np.zeros_like(T)
        w = np.zeros(Q * S + L)
        for q in range(Q):
            for s in range(S):
                T[q * S + s, q * S + s] = 1.0
                T[q * S + s, Q * S + delta[q, s]] = 1.0
        state = 0
        for t, s in enumerate(rng.integers(0, S, size=L)):
            row = Q * S + t
            T[row, state * S + s] = 1.0
            state = int(delta[state, s])
            Y[row, Q * S + state] = 1.0
            w[row] = 1.0
        toks.append(T), ys.append(Y), ws.append(w)
        offs.append(offs[-1] + T.shape[0])
    return {"tokens": np.concatenate(toks), "offsets": np.array(offs), "targets": np.concatenate(ys),
            "weights": np.concatenate(ws), "per_position": True}


def _cases() -> dict[str, dict]:
    rng = np.random.default_rng(0)
    ds, _ = synthetic.generate_teacher(4, 2, 300, "2:9", seed=1)
    d5, _ = synthetic.generate_teacher(5, 2, 400, "3:8", seed=2)
    onehot = np.eye(5)[rng.integers(0, 5, size=d5.tokens.shape[0])]
    sub = rng.standard_normal((d5.tokens.shape[0], 3)) @ rng.standard_normal((3, 5))
    lastsub = d5.tokens.copy()
    lastsub[d5.offsets[1:] - 1] = rng.standard_normal((400, 2)) @ rng.standard_normal((2, 5))
    dead = d5.tokens.copy()
    dead[:, 2] = 0.0
    w = rng.uniform(0.5, 2.0, size=400)
    w[::3] = 0.0
    return {
        "dense gaussian (nothing reduced)": {"tokens": ds.tokens, "offsets": ds.offsets, "targets": ds.targets},
        "length-1 (nothing reduced, singular)": {"tokens": ds.tokens[:300], "offsets": np.arange(301),
                                                 "targets": ds.targets},
        "one-hot tokens": {"tokens": onehot, "offsets": d5.offsets, "targets": d5.targets},
        "tokens in a 3-d subspace": {"tokens": sub, "offsets": d5.offsets, "targets": d5.targets},
        "last tokens in a 2-d subspace": {"tokens": lastsub, "offsets": d5.offsets, "targets": d5.targets},
        "a dead coordinate, weighted": {"tokens": dead, "offsets": d5.offsets, "targets": d5.targets,
                                        "weights": w},
        "DFA traces Q=2 S=2": _dfa(2, 2, 60, 6, 3),
    }


def _feats(case: dict):
    return chunk_features(case["tokens"], case["offsets"], case.get("targets"), case["tokens"].shape[1],
                          weights=case.get("weights"), read=ReadSpec(samples_of(case.get("per_position", False))))


def _ref(case: dict, own_basis: bool = False) -> dict:
    A = None
    if own_basis or np.linalg.matrix_rank(case["tokens"]) < case["tokens"].shape[1]:
        # G singular: mhla's convention; or coordinates that must match mhla's (any whitening A R,
        # R orthogonal, has the same eigenvalues)
        A = _feats(case).basis
    return canonical(case["tokens"], case["offsets"], case.get("targets"), case.get("per_position", False),
                     case.get("weights"), A=A)


# the block each case must reduce to: (pairs kept, last-token coordinates kept), by construction
EXPECTED = {
    "dense gaussian (nothing reduced)": (10, 4),
    "length-1 (nothing reduced, singular)": (10, 4),
    "one-hot tokens": (5, 5),  # S is diagonal
    "tokens in a 3-d subspace": (6, 3),
    "last tokens in a 2-d subspace": (15, 2),
    "a dead coordinate, weighted": (10, 4),
    "DFA traces Q=2 S=2": None,  # checked against the reference's spans below
}


def _spans(ref: dict, d: int) -> tuple[int, int]:
    """Dimensions of span{s_i} and span{x_n,i} of the weighted samples, by numpy's matrix_rank."""
    Ht, q = ref["Ht"], d * (d + 1) // 2
    keep = ref["w"] > 0
    # h = s (x) x_n: s and x_n from the rank-1 reshape of each feature row
    rows = Ht[keep].reshape(-1, q, d)
    s = np.stack([np.linalg.svd(r)[0][:, 0] for r in rows if np.abs(r).max() > 0])
    x = np.stack([np.linalg.svd(r)[2][0] for r in rows if np.abs(r).max() > 0])
    return int(np.linalg.matrix_rank(s)), int(np.linalg.matrix_rank(x))


@pytest.mark.parametrize("name", list(_cases()))
@pytest.mark.parametrize("dense_max", [4096, 0])
def test_structured_certificate_and_fit_equal_plain_numpy(name: str, dense_max: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(factorization, "DENSE_MAX", dense_max)
    case = _cases()[name]
    d = case["tokens"].shape[1]
    psi = n_features(d)
    feats = _feats(case)
    ref = _ref(case)
    st = factorize(feats).structure
    want = EXPECTED[name] or _spans(ref, d)
    assert (st.a, st.b) == want
    assert st.is_identity == (want == (d * (d + 1) // 2, d))
    w_ref = ref["eigenvalues"]
    lmax = w_ref[-1]
    tol = psi * EPS * lmax
    cert = certify(feats)
    assert cert.n_features == psi
    assert cert.identifiable == bool(w_ref[0] > tol and ref["N"] >= psi)
    assert cert.rank == int((w_ref > tol).sum())
    assert abs(cert.lambda_max - lmax) <= 1e-10 * lmax
    assert abs(cert.lambda_min - w_ref[0]) <= 1e-10 * lmax
    if cert.eigenvalues is not None:
        assert np.abs(cert.eigenvalues - w_ref).max() <= 1e-10 * lmax
    if not cert.identifiable:  # the null space: orthonormal, of the right size, annihilated by the gram
        null = cert.null_vectors
        assert null.shape == (psi, psi - cert.rank)
        assert np.abs(null.T @ null - np.eye(null.shape[1])).max() < 1e-10
        assert np.linalg.norm(feats.gram @ null) <= 1e-8 * np.linalg.norm(feats.gram)
        assert cert.reasons
    # the function: minimum-norm and ridge least squares on the canonical features
    rng = np.random.default_rng(7)
    Zs = [rng.standard_normal((int(rng.integers(1, 6)), d)) for _ in range(20)]
    model = fit(feats)
    assert model.info["rank"] == cert.rank and model.info["identifiable"] == cert.identifiable
    rc = 1e-9 if name.startswith("DFA") else 1e-10
    want_f = predict_canonical(min_norm_function(ref, rcond=rc), ref["A"], Zs)
    assert ratio(predict_own(model.coef, Zs), want_f) < 1e-7
    lam = 1e-3 * lmax
    ridge = fit(feats, ridge=lam)
    assert ratio(predict_own(ridge.coef, Zs), predict_canonical(ridge_function(ref, lam), ref["A"], Zs)) < 1e-7


@pytest.mark.parametrize("name", list(_cases()))
def test_observed_domain_equals_the_restricted_dense_matrix(name: str) -> None:
    case = _cases()[name]
    feats = _feats(case)
    ref = _ref(case, own_basis=True)  # T is in mhla's canonical coordinates
    T, (r, s) = OBSERVED.map_b(feats), OBSERVED.dims(feats)
    lam = ref["lambda"] if T is None else T @ ref["lambda"] @ T.T
    w = np.linalg.eigvalsh(lam)
    m = lam.shape[0]
    tol = m * EPS * w[-1]
    cert = certify(feats, domain="observed")
    assert (cert.n_features, cert.dim_tokens, cert.dim_last_tokens) == (m, r, s)
    assert cert.identifiable == bool(w[0] > tol and ref["N"] >= m)
    assert cert.rank == int((w > tol).sum())
    assert abs(cert.lambda_min - w[0]) <= 1e-10 * w[-1]
    assert abs(cert.lambda_max - w[-1]) <= 1e-10 * w[-1]


def test_probe_verdicts_equal_the_reference_null_space(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    for name, case in _cases().items():
        d = case["tokens"].shape[1]
        ref = _ref(case)
        # probes: half drawn like the data (sequences of the training tokens), half generic
        toks = [case["tokens"][case["offsets"][i]:case["offsets"][i + 1]][:4] for i in range(10)]
        toks += [rng.standard_normal((3, d)) for _ in range(10)]
        probes = tmp_path / f"{abs(hash(name))}.h5"
        with h5py.File(probes, "w") as f:
            f["tokens"] = np.concatenate(toks)
            f["offsets"] = np.concatenate([[0], np.cumsum([len(t) for t in toks])])
        rep = certify_probes(_feats(case), probes)
        w, V = np.linalg.eigh(ref["lambda"])
        null = V[:, w <= n_features(d) * EPS * w[-1]]
        from _reference import canonical_features

        want = []
        for Z in toks:
            h = canonical_features(Z @ ref["A"])
            nh = np.linalg.norm(h)
            want.append(nh > 0 and np.linalg.norm(null.T @ h) / nh > 1e-8)
        assert list(rep.undetermined) == list(np.flatnonzero(want)), name
        assert rep.null_dim == null.shape[1], name


def test_partial_traces_and_the_block_maps() -> None:
    rng = np.random.default_rng(1)
    d, q = 3, 6
    X = rng.standard_normal((40, q * d))
    lam = X.T @ X
    tp, tl = partial_traces(lam, d)
    v = lam.reshape(q, d, q, d)
    assert np.allclose(tp, sum(v[:, i, :, i] for i in range(d)))
    assert np.allclose(tl, sum(v[a, :, a, :] for a in range(q)))
    E = np.linalg.qr(rng.standard_normal((q, q)))[0]
    F = np.linalg.qr(rng.standard_normal((d, d)))[0]
    st = Structure(E, F, 4, 2)
    Qm = np.kron(E[:, :4], F[:, :2])
    assert np.allclose(st.compress(lam), Qm.T @ lam @ Qm)
    assert np.allclose(st.embed(np.eye(8)), Qm)
    assert np.allclose(st.restrict(np.eye(q * d)), Qm.T)
    out = st.outside()
    assert out.shape == (q * d, q * d - 8)
    assert np.allclose(out.T @ out, np.eye(q * d - 8)) and np.abs(Qm.T @ out).max() < 1e-12
    s, x = rng.standard_normal((5, q)), rng.standard_normal((5, d))
    h = (s[:, :, None] * x[:, None, :]).reshape(5, q * d)
    inside, outside, norm2 = st.split_rows(s, x)
    assert np.allclose(inside, h @ Qm)
    assert np.allclose(outside, ((h - h @ Qm @ Qm.T) ** 2).sum(axis=1))
    assert np.allclose(norm2, (h**2).sum(axis=1))
    assert np.allclose(kron_apply(E, F, np.eye(q * d)), np.kron(E, F))


def test_all_zero_features_reduce_to_nothing() -> None:
    lam = np.zeros((40, 40))
    st = find_structure(lam, 4)
    assert st.n == 0 and st.n_full == 40
    feats = chunk_features(np.zeros((9, 4)), np.array([0, 3, 6, 9]), np.zeros((3, 4)), 4)
    cert = certify(feats)
    assert not cert.identifiable and cert.rank == 0 and cert.lambda_max == 0.0


# ------------------------------------------------------------------ featurize on the data's spans
def _save(case: dict, path: Path) -> Path:
    synthetic.Dataset(case["tokens"], case["offsets"], case["targets"], case.get("weights")).save(
        path, dtype="float64", compression=None)
    return path


def _summary(feats, probes: Path | None = None) -> dict:
    out = {}
    for domain in ("full", "observed"):
        c = certify(feats, domain=domain)
        out[domain] = (c.identifiable, c.rank, c.n_features, c.lambda_min, c.lambda_max)
    m = fit(feats)
    out["fit"] = (m.info["rank"], m.info["identifiable"], m.info["train_mse"])
    out["coef"] = m.coef
    out["ridge"] = fit(feats, ridge=1e-3 * out["full"][4]).coef
    if probes is not None:
        out["probes"] = list(certify_probes(feats, probes).undetermined)
    return out


def _same(a: dict, b: dict) -> None:
    for key in ("full", "observed"):
        assert a[key][:3] == b[key][:3], (key, a[key], b[key])
        lmax = b[key][4]
        assert abs(a[key][3] - b[key][3]) <= 1e-10 * lmax and abs(a[key][4] - lmax) <= 1e-10 * lmax
    assert a["fit"][:2] == b["fit"][:2]
    assert abs(a["fit"][2] - b["fit"][2]) <= 1e-9 * max(b["fit"][2], 1e-12) + 1e-14
    for key in ("coef", "ridge"):
        assert ratio(a[key], b[key]) < 1e-7, key  # p carries cond(tokens)^3: the shift case has 1e-4
    assert a.get("probes") == b.get("probes")


@pytest.mark.parametrize("name", [n for n in _cases() if EXPECTED[n] is None or EXPECTED[n][0] * EXPECTED[n][1]
                                  <= n_features(5) // 2])
def test_featurize_on_the_spans_equals_the_full_statistics(name: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from mhla_cli.statistics import spans
    from mhla_cli.statistics.features import Features
    from mhla_cli.statistics.stream import featurize

    monkeypatch.setattr(spans, "SPANS_MIN_FEATURES", 0)  # "auto" at these small psi too

    case = _cases()[name]
    data = _save(case, tmp_path / "d.h5")
    probes = tmp_path / "p.h5"
    d = case["tokens"].shape[1]
    rng = np.random.default_rng(5)
    toks = [case["tokens"][case["offsets"][i]:case["offsets"][i + 1]] for i in range(8)]
    toks += [rng.standard_normal((3, d)) for _ in range(4)]
    with h5py.File(probes, "w") as f:
        f["tokens"] = np.concatenate(toks)
        f["offsets"] = np.concatenate([[0], np.cumsum([len(t) for t in toks])])
    full = featurize(data, spans="off")
    assert not full.on_spans
    want = _summary(full, probes)
    for spans_opt, chunk in (("auto", None), ("on", 7)):
        red = featurize(data, spans=spans_opt, chunk_size=chunk)
        assert red.on_spans and red.basis_gram.shape[0] < n_features(d)
        _same(_summary(red, probes), want)
    red = featurize(data, spans="on")
    red.save(tmp_path / "f.h5")
    back = Features.load(tmp_path / "f.h5")
    assert back.on_spans
    with h5py.File(tmp_path / "f.h5") as f:
        assert "gram" not in f and "span_pairs" in f
    _same(_summary(back, probes), want)
    # every feature back from the block: the full sums, exactly
    back.expand()
    full.canonical()
    back.to_basis(full.basis)
    assert np.abs(back.basis_gram - full.basis_gram).max() <= 1e-10 * np.abs(full.basis_gram).max()
    assert np.abs(back.gram - full.gram).max() <= 1e-9 * np.abs(full.gram).max()


def test_featurize_spans_with_workers_shards_and_a_redone_pass(tmp_path: Path) -> None:
    from mhla_cli.statistics import basis
    from mhla_cli.statistics.stream import featurize

    # tokens in a 3-d subspace of R^5, and a distribution shift the basis estimate's sample misses
    rng = np.random.default_rng(2)
    d, N, n = 5, 30000, 10  # more tokens than the estimate's sample (basis.SAMPLE_TOKENS)
    Z = rng.standard_normal((N * n, 3))
    in_sample = np.zeros(N, dtype=bool)
    for a, b in basis.sample_blocks(N, N * n):
        in_sample[a:b] = True
    Z[np.repeat(in_sample, n), 2] *= 1e-4
    tokens = Z @ rng.standard_normal((3, d))
    offsets = np.arange(0, N * n + 1, n)
    targets = rng.standard_normal((N, d))
    data = _save({"tokens": tokens, "offsets": offsets, "targets": targets}, tmp_path / "d.h5")
    want = _summary(featurize(data, spans="off"))
    red = featurize(data, spans="on")
    # the spans were found in the whitening of all the tokens (the span pass redone), not in the estimate
    assert red.on_spans and red.basis_gram.shape[0] == 18
    assert red.extra_attrs["span_passes"] == 2 and red.extra_attrs["basis_passes"] == 1
    _same(_summary(red), want)
    _same(_summary(featurize(data, spans="on", workers=2, chunk_size=5000)), want)
    parts = [featurize(data, spans="on", shard=(i, 3)) for i in range(3)]
    total = parts[0] + parts[1] + parts[2]
    _same(_summary(total), want)


def test_spans_option_is_validated(tmp_path: Path) -> None:
    from mhla_cli.errors import InputError
    from mhla_cli.statistics.stream import featurize

    data = _save(_cases()["one-hot tokens"], tmp_path / "d.h5")
    with pytest.raises(InputError, match="spans"):
        featurize(data, spans="sometimes")
    assert not featurize(data).on_spans  # psi = 75 < SPANS_MIN_FEATURES: every feature, as before
    assert featurize(data, spans="on").on_spans
    assert not featurize(_save(_cases()["dense gaussian (nothing reduced)"], tmp_path / "g.h5"), spans="on").on_spans


def test_cli_featurize_spans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from mhla_cli.cli import run

    data = _save(_cases()["DFA traces Q=2 S=2"], tmp_path / "d.h5")
    out = tmp_path / "f.h5"
    capsys.readouterr()
    assert run(["featurize", str(data), "-o", str(out), "--spans", "sometimes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mhla: error: ") and "spans" in err[0] and not out.exists()
    assert run(["featurize", str(data), "-o", str(out), "--spans", "on", "--json", "-q"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["n_features"] == 126 and rep["span_features"] == 36 and rep["span_passes"] == 1
    assert run(["certify", str(out), "--json", "-q"]) == 1
    cert = json.loads(capsys.readouterr().out)
    assert (cert["rank"], cert["n_features"], cert["span_features"], cert["lambda_min"]) == (36, 126, 36, 0.0)
    assert run(["certify", str(data), "--on", str(data), "--json", "-q"]) == 0  # training positions: determined


@pytest.mark.parametrize("name", ["DFA traces Q=2 S=2", "tokens in a 3-d subspace", "one-hot tokens"])
def test_spans_are_basis_free(name: str, tmp_path: Path) -> None:
    """An invertible map of the token coordinates (cond up to 1e3), the order of the sequences and the
    chunk size change neither the spans found by featurize nor the certificate and the function."""
    from mhla_cli.statistics.stream import featurize

    case = _cases()[name]
    d = case["tokens"].shape[1]
    want = featurize(_save(case, tmp_path / "a.h5"), spans="on")
    cert = certify(want)
    rng = np.random.default_rng(11)
    U, _, V = np.linalg.svd(rng.standard_normal((d, d)))
    T = U @ np.diag(np.logspace(0, 3, d)) @ V
    moved = dict(case, tokens=case["tokens"] @ T)
    n = len(case["offsets"]) - 1
    order = rng.permutation(n)
    seqs = [moved["tokens"][case["offsets"][i]:case["offsets"][i + 1]] for i in order]
    per_pos = case.get("per_position", False)
    rows = (lambda i: slice(case["offsets"][i], case["offsets"][i + 1])) if per_pos else (lambda i: i)
    shuffled = dict(moved, tokens=np.concatenate(seqs),
                    offsets=np.concatenate([[0], np.cumsum([len(s) for s in seqs])]),
                    targets=np.concatenate([np.atleast_2d(case["targets"][rows(i)]) for i in order]))
    if case.get("weights") is not None:
        shuffled["weights"] = np.concatenate([np.atleast_1d(case["weights"][rows(i)]) for i in order])
    got = featurize(_save(shuffled, tmp_path / "b.h5"), spans="on", chunk_size=3)
    c2 = certify(got)
    assert got.basis_gram.shape == want.basis_gram.shape
    assert (c2.identifiable, c2.rank, c2.span_features) == (cert.identifiable, cert.rank, cert.span_features)
    assert abs(c2.lambda_max - cert.lambda_max) <= 1e-6 * cert.lambda_max
    # probes in the span of the tokens (outside it the whitening of singular data is a convention)
    Zs = [rng.standard_normal((3, 8)) @ case["tokens"][rng.integers(0, len(case["tokens"]), 8)] for _ in range(10)]
    # the minimum-norm function is canonical, so it moves with the tokens: p_T(Z T) = p(Z)
    assert ratio(predict_own(fit(got).coef, [Z @ T for Z in Zs]), predict_own(fit(want).coef, Zs)) < 1e-6


def _rewrite(src: Path, dst: Path, edit) -> Path:
    import shutil

    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        unseal(f)
        edit(f)
    return dst


def _replace(name: str, value: np.ndarray):
    def edit(f: h5py.File) -> None:
        del f[name]
        f[name] = value
    return edit


def test_a_broken_block_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One refusal (exit 2, one line naming the file) per rule of a features file on the data's spans."""
    from mhla_cli.cli import run
    from mhla_cli.statistics.stream import featurize

    good = tmp_path / "f.h5"
    featurize(_save(_cases()["DFA traces Q=2 S=2"], tmp_path / "d.h5"), spans="on").save(good)
    with h5py.File(good) as f:
        E, F, G, M = (f[k][()] for k in ("span_pairs", "span_last", "basis_gram", "basis_moments"))
    cases = {
        "no span_last": (lambda f: f.__delitem__("span_last"), "no span_last"),
        "no basis_gram": (lambda f: f.__delitem__("basis_gram"), "no basis_gram"),
        "span_pairs not orthonormal": (_replace("span_pairs", 2 * E), "'span_pairs' must have orthonormal columns"),
        "span_last too long": (_replace("span_last", np.vstack([F, F[:1]])), "'span_last' must have orthonormal"),
        "block of the wrong size": (_replace("basis_gram", G[:-1, :-1]), "'basis_gram' must be a finite symmetric"),
        "block not symmetric": (_replace("basis_gram", G + np.triu(np.ones_like(G), 1)),
                                "'basis_gram' must be a finite symmetric"),
        "block with NaN": (_replace("basis_gram", np.where(np.eye(len(G)) > 0, np.nan, G)),
                           "'basis_gram' contains NaN or Inf"),
        "moments of the wrong size": (_replace("basis_moments", M[:-1]), "'basis_moments' has shape"),
    }
    for name, (edit, msg) in cases.items():
        bad = _rewrite(good, tmp_path / f"{abs(hash(name))}.h5", edit)
        capsys.readouterr()
        assert run(["certify", str(bad)]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"mhla: error: {bad}: ") and msg in err[0], (name, err)


def test_a_certificate_of_changed_statistics_refuses_its_null_space(tmp_path: Path) -> None:
    """The null vectors are computed on first use: after the sums change they are refused, not wrong."""
    from mhla_cli.errors import InputError
    from mhla_cli.solve.witness import make_witness

    case = _cases()["one-hot tokens"]
    feats = _feats(case)
    cert = certify(feats)
    feats.add(_feats(case))
    with pytest.raises(InputError, match="changed"):
        cert.null_vectors
    # a witness from statistics on the spans works on expanded ones (a copy: the caller's stay on the
    # spans), with the same certificate's domain
    from mhla_cli.statistics.stream import featurize

    red = featurize(_save(case, tmp_path / "d.h5"), spans="on")
    wit = make_witness(red, cert=certify(red))
    assert red.on_spans is True and wit.info["kind"] in ("indistinguishable", "weakly_determined")


@pytest.mark.parametrize("margin", [1.0, 1e6])
def test_the_structure_cut_on_both_sides(margin: float) -> None:
    """from_traces drops a direction whose partial-trace energy is at most margin * STRUCTURE_FACTOR *
    psi * EPS * max(lambda_max(Tr_l) / d, lambda_max(Tr_s) / q), and keeps one a hair above."""
    from mhla_cli.numerics import EPS, STRUCTURE_FACTOR
    from mhla_cli.statistics.structure import from_traces

    rng = np.random.default_rng(3)
    q, d = 6, 3
    cut = margin * STRUCTURE_FACTOR * q * d * EPS * max(2.0 / d, 1.0 / q)
    # rotated (the cut is on eigenvalues, not entries) where the eigensolver's error, ~EPS lambda_max, is
    # well inside the 1e-6 of the cut that the two cases leave; on the axes at the cut itself
    Q = np.linalg.qr(rng.standard_normal((q, q)))[0] if margin > 1e3 else np.eye(q)
    for e, kept in ((cut * (1 + 1e-6), q), (cut * (1 - 1e-6), q - 1)):
        tp = Q @ np.diag([2.0, 1.0, 1.0, 1.0, 1.0, e]) @ Q.T
        st = from_traces(tp, np.eye(d), margin)
        assert (st.a, st.b) == (kept, d), (e, cut)
        assert st.on_spans == (kept < q)
