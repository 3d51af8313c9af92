"""The canonical basis (mhla_cli.statistics.basis): exact maps, and certify / fit invariant to the token units.

References are plain numpy on materialised features (`_features`, tests/_reference.py), never
mhla_cli.feature_map.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from _reference import canonical_features, teacher_p
from mhla_cli import numerics
from mhla_cli.statistics import basis
from mhla_cli.io import formats
from mhla_cli.model import synthetic
from mhla_cli.cli import run
from mhla_cli.statistics.merge import merge_features
from mhla_cli.model.forward import forward_heads
from mhla_cli import certify
from mhla_cli.solve.lstsq import fit
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.stream import featurize
from conftest import unseal


def _features(X: np.ndarray) -> np.ndarray:
    """H(X) in plain numpy: S[j,k] x_n[l] for j <= k, l fastest."""
    d = X.shape[1]
    S = X.T @ X
    return np.array([S[j, k] * X[-1, l] for j in range(d) for k in range(j, d) for l in range(d)])


def _ill_conditioned(d: int, cond: float, seed: int) -> np.ndarray:
    """A rotated matrix with singular values spread log-uniformly over [1/cond, 1]."""
    rng = np.random.default_rng(seed)
    U = np.linalg.qr(rng.standard_normal((d, d)))[0]
    V = np.linalg.qr(rng.standard_normal((d, d)))[0]
    return U @ np.diag(np.logspace(0, -np.log10(cond), d)) @ V.T


def test_maps_match_materialised_features() -> None:
    rng = np.random.default_rng(0)
    d = 3
    A = rng.standard_normal((d, d))
    Xs = [rng.standard_normal((n, d)) for n in (1, 2, 5, 9)]
    H = np.stack([_features(X) for X in Xs], axis=1)
    Hb = np.stack([canonical_features(X @ A) for X in Xs], axis=1)  # orthonormal coordinates
    assert np.abs(basis.features_to_basis(A, H) - Hb).max() < 1e-12 * np.abs(Hb).max()
    assert np.abs(basis.features_from_basis(A, Hb) - H).max() < 1e-12 * np.abs(H).max()
    assert np.abs(basis.feature_map(A) @ H - Hb).max() < 1e-12 * np.abs(Hb).max()
    # coef: p_b . H(X A) = (p_b M) . H(X)
    pb = rng.standard_normal((d, H.shape[0]))
    p = basis.coef_from_basis(A, pb)
    assert np.abs(p @ H - pb @ Hb).max() < 1e-12 * np.abs(pb @ Hb).max()
    assert np.abs(basis.coef_to_basis(A, p) - pb).max() < 1e-12 * np.abs(pb).max()
    Gb = basis.gram_to_basis(A, H @ H.T)
    assert np.abs(Gb - Hb @ Hb.T).max() < 1e-11 * np.abs(Hb @ Hb.T).max()


def test_orthonormal_coordinates_make_rotations_orthogonal() -> None:
    """For an orthogonal M the canonical feature map is orthogonal (the spectrum cannot move)."""
    rng = np.random.default_rng(9)
    for d in (2, 3, 5):
        M = np.linalg.qr(rng.standard_normal((d, d)))[0]
        O = np.kron(basis.orth_pair_map(M), M.T)
        assert np.abs(O @ O.T - np.eye(O.shape[0])).max() < 1e-13
        # and not in the upper-triangle coordinates of H (the old spectrum moved with rotations)
        P = basis.feature_map(M) / basis.feature_scale(d)[:, None]
        assert np.abs(P @ P.T - np.eye(P.shape[0])).max() > 1e-3


def test_whitening_is_float32_valued_and_whitens() -> None:
    rng = np.random.default_rng(1)
    X = rng.standard_normal((500, 4)) @ _ill_conditioned(4, 1e3, 2)
    A = basis.whitening(X.T @ X, 500)
    assert np.array_equal(A, A.astype(np.float32).astype(np.float64))
    Z = X @ A
    assert np.linalg.cond(Z.T @ Z) < 1.01
    # a coordinate that is 0 in every token keeps the scale of the largest direction (no blow-up)
    X[:, 1] = 0
    A = basis.whitening(X.T @ X, 500)
    assert np.isfinite(A).all() and np.linalg.cond(A) < 1e4


# --------------------------------------------------------------------------------------------
# issue 9.1: realisable d = 3 data in other units or an ill-conditioned rotated basis
# --------------------------------------------------------------------------------------------

TRANSFORMS = {
    "identity": lambda d: np.eye(d),
    "coordinate/300": lambda d: np.diag([1.0] * (d - 1) + [1 / 300]),
    "coordinate/1000": lambda d: np.diag([1.0] * (d - 1) + [1 / 1000]),
    "rotated cond 1e3": lambda d: _ill_conditioned(d, 1e3, 7),
}


@pytest.fixture(scope="module")
def teacher_data() -> tuple[synthetic.Dataset, object]:
    return synthetic.generate_teacher(3, 2, 400, "4:12", seed=11)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_certify_and_fit_do_not_depend_on_token_units(name: str, teacher_data, tmp_path: Path,
                                                      capsys) -> None:
    ds, teacher = teacher_data
    A0 = TRANSFORMS[name](3)
    data = tmp_path / "data.h5"
    with h5py.File(data, "w") as f:
        f["tokens"] = ds.tokens @ A0
        f["offsets"] = ds.offsets
        f["targets"] = ds.targets
    for domain in ("full", "observed"):
        assert run(["certify", str(data), "--domain", domain, "--json", "-q"]) == 0, name
        rep = json.loads(capsys.readouterr().out)
        assert rep["identifiable"] and rep["reasons"] == []
    model = tmp_path / "model.h5"
    assert run(["fit", str(data), "-o", str(model), "--json", "-q"]) == 0
    capsys.readouterr()
    with h5py.File(model) as f:
        p = f["coef"][()]
    # reference 1: the teacher's function (its own heads), on fresh inputs in the new units
    rng = np.random.default_rng(3)
    Zs = [rng.standard_normal((n, 3)) for n in (1, 3, 7, 20)]
    want = np.stack([forward_heads(teacher.V, teacher.Q, Z) for Z in Zs])
    got = np.stack([p @ _features(Z @ A0) for Z in Zs])
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), name
    # reference 2: the teacher's p carried to the new units through materialised features:
    # p' H(X A0) = p H(X) for all X  <=>  p' = p H_X pinv(H_XA) on generic X
    Xs = [rng.standard_normal((rng.integers(2, 6), 3)) for _ in range(60)]
    HX = np.stack([_features(X) for X in Xs], axis=1)
    HXA = np.stack([_features(X @ A0) for X in Xs], axis=1)
    p_teacher = teacher_p(teacher)
    p_ref = np.linalg.lstsq(HXA.T, (p_teacher @ HX).T, rcond=None)[0].T
    assert np.linalg.norm(p - p_ref) <= 1e-6 * np.linalg.norm(p_ref), name




def test_lstsq_reference_agrees_on_the_issue_case(teacher_data) -> None:
    """The issue's reproduction: coordinate 3 scaled by 1/300; plain lstsq on materialised features
    and mhla's fit agree with the teacher."""
    ds, teacher = teacher_data
    A0 = np.diag([1.0, 1.0, 1 / 300])
    tokens = ds.tokens @ A0
    F = np.stack([_features(tokens[a:b]) for a, b in zip(ds.offsets[:-1], ds.offsets[1:])])
    s = np.linalg.svd(F, compute_uv=False)
    assert s[-1] / s[0] < 1e-7  # the raw features really are badly conditioned
    p_lstsq = np.linalg.lstsq(F, ds.targets, rcond=None)[0].T
    from mhla_cli.statistics.accumulate import chunk_features

    p = fit(chunk_features(tokens, ds.offsets, ds.targets, 3)).coef
    assert np.linalg.norm(p - p_lstsq) <= 1e-6 * np.linalg.norm(p_lstsq)


def test_observed_domain_verdict_invariant_for_subspace_tokens(tmp_path: Path) -> None:
    """Tokens in a 2-d subspace of R^3, then an ill-conditioned change of units: the observed-domain
    verdict and dimensions do not change; the full-domain verdict is 'no' in both."""
    rng = np.random.default_rng(4)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(3, 9, size=300))])
    tokens = rng.standard_normal((int(offsets[-1]), 2)) @ rng.standard_normal((2, 3))
    out = []
    for A0 in (np.eye(3), _ill_conditioned(3, 1e3, 1)):
        path = tmp_path / "t.h5"
        with h5py.File(path, "w") as f:
            f["tokens"], f["offsets"] = tokens @ A0, offsets
        feats = featurize(path)
        full, obs = certify(feats), certify(feats, domain="observed")
        out.append((full.identifiable, obs.identifiable, obs.dim_tokens, obs.dim_last_tokens))
    assert out[0] == out[1] == (False, True, 2, 2)


def test_shards_merge_and_chunks_end_in_the_whitening_of_the_data(teacher_data, tmp_path: Path) -> None:
    ds, _ = teacher_data
    data = tmp_path / "data.h5"
    with h5py.File(data, "w") as f:
        f["tokens"] = ds.tokens @ _ill_conditioned(3, 1e3, 5)
        f["offsets"] = ds.offsets
        f["targets"] = ds.targets
    whole = featurize(data)
    parts = []
    for i in range(3):
        part = featurize(data, shard=(i, 3), chunk_size=17)
        parts.append(tmp_path / f"p{i}.h5")
        part.save(parts[-1])
    merged = merge_features(parts).features
    for name in ("gram", "moments", "token_gram", "last_token_gram"):
        a, b = getattr(merged, name), getattr(whole, name)
        assert np.abs(a - b).max() <= 1e-9 * np.abs(b).max(), name
    for f in (whole, merged):  # the basis whitens the data's token Gram
        G = f.basis.T @ (f.token_gram / f.n_tokens) @ f.basis
        assert np.abs(G - np.eye(3)).max() < 1e-6
    a, b = certify(merged), certify(whole)
    assert abs(a.lambda_min - b.lambda_min) <= 1e-9 * b.lambda_max and a.rank == b.rank
    np.testing.assert_allclose(fit(merged).coef, fit(whole).coef, rtol=0,
                               atol=1e-7 * np.abs(fit(whole).coef).max())


def test_features_file_round_trip_and_version_1(teacher_data, tmp_path: Path) -> None:
    ds, _ = teacher_data
    data = tmp_path / "data.h5"
    ds.save(data, dtype="float64")
    feats = featurize(data)
    path = tmp_path / "f.h5"
    feats.save(path)
    with h5py.File(path) as f:
        assert int(f.attrs["mhla_format_version"]) == formats.FORMAT_VERSION >= 3
        assert {"basis", "basis_gram", "basis_moments", "basis_token_gram", "basis_last_token_gram", "gram",
                "moments"} <= set(f)
        # gram keeps its meaning: sum over samples of H H^T in the tokens' own coordinates
        F = np.stack([_features(ds.tokens[a:b]) for a, b in zip(ds.offsets[:-1], ds.offsets[1:])])
        assert np.abs(f["gram"][()] - F.T @ F).max() <= 1e-12 * np.abs(F.T @ F).max()
        assert np.abs(f["moments"][()] - F.T @ ds.targets).max() <= 1e-12 * np.abs(F.T @ ds.targets).max()
    back = Features.load(path)
    assert np.array_equal(back.basis, feats.basis) and np.array_equal(back.basis_gram, feats.basis_gram)
    assert certify(back).lambda_min == certify(feats).lambda_min  # canonical already: nothing changes
    # a version-2 file (basis sums in upper-triangle coordinates, no basis token Grams): converted
    v2 = tmp_path / "v2.h5"
    D = basis.feature_scale(3)
    with h5py.File(path) as f, h5py.File(v2, "w") as g:
        for k in f:
            if k not in ("basis_token_gram", "basis_last_token_gram"):
                g[k] = f[k][()]
        g["basis_gram"][...] = f["basis_gram"][()] / D[:, None] / D[None, :]
        g["basis_moments"][...] = f["basis_moments"][()] / D[:, None]
        for k, v in f.attrs.items():
            g.attrs[k] = v
        unseal(g)
        g.attrs["mhla_format_version"] = 2
    c2, c3 = certify(Features.load(v2)), certify(feats)
    assert abs(c2.lambda_min - c3.lambda_min) <= 1e-9 * c3.lambda_min
    # a version-1 file (no basis): read, and changed to the canonical basis from the own sums
    old = tmp_path / "old.h5"
    with h5py.File(path) as f, h5py.File(old, "w") as g:
        for k in ("gram", "moments", "target_gram", "token_gram", "last_token_gram"):
            g[k] = f[k][()]
        for k, v in f.attrs.items():
            g.attrs[k] = v
        unseal(g)
        g.attrs["mhla_format_version"] = 1
    v1 = Features.load(old)
    assert v1.basis is None and certify(v1).basis == "canonical"
    assert abs(certify(v1).lambda_min - c3.lambda_min) <= 1e-6 * c3.lambda_min
    np.testing.assert_allclose(fit(v1).coef, fit(feats).coef, rtol=0, atol=1e-8 * np.abs(fit(feats).coef).max())
    # a file with a basis but no basis_gram is refused
    bad = tmp_path / "bad.h5"
    with h5py.File(path) as f, h5py.File(bad, "w") as g:
        for k in f:
            if k != "basis_gram":
                g[k] = f[k][()]
        for k, v in f.attrs.items():
            g.attrs[k] = v
        unseal(g)
    assert run(["certify", str(bad)]) == 2


def test_identically_zero_only_when_exactly_zero(tmp_path: Path, capsys) -> None:
    rng = np.random.default_rng(6)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(3, 9, size=200))])
    tokens = rng.standard_normal((int(offsets[-1]), 3))
    tokens[:, 2] = 0.0
    path = tmp_path / "z.h5"
    with h5py.File(path, "w") as f:
        f["tokens"], f["offsets"] = tokens, offsets
    assert run(["certify", str(path), "--json", "-q"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert any("identically zero in the data" in r for r in rep["reasons"])
    assert all(nf["identically_zero"] for nf in rep["null_features"] if nf["null_weight"] > 1 - 1e-6)
    # a tiny but nonzero coordinate: full rank, certified, no 'identically zero' reason
    tokens[:, 2] = 1e-3 * rng.standard_normal(tokens.shape[0])
    with h5py.File(path, "w") as f:
        f["tokens"], f["offsets"] = tokens, offsets
    assert run(["certify", str(path), "--json", "-q"]) == 0
    assert json.loads(capsys.readouterr().out)["reasons"] == []


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_exact_zeros_survive_the_derived_token_gram(tmp_path: Path, dtype: str) -> None:
    """Equal-length chunks derive the own token Gram from that of X A: a coordinate that is 0 in
    every token must still be exactly 0 there (the whitening keeps it apart)."""
    rng = np.random.default_rng(7)
    tokens = rng.standard_normal((600, 3)).astype(dtype)
    tokens[:, 2] = 0.0
    path = tmp_path / "z.h5"
    with h5py.File(path, "w") as f:
        f["tokens"], f["offsets"] = tokens, np.arange(0, 601, 6)
    feats = featurize(path, chunk_size=17)
    assert feats.token_gram[2, 2] == 0.0 and not feats.token_gram[2].any()
    assert feats.last_token_gram[2, 2] == 0.0
    X = tokens.astype(np.float64)
    assert np.abs(feats.token_gram - X.T @ X).max() <= 1e-12 * np.abs(X.T @ X).max()


# --------------------------------------------------------------------------------------------
# scalings without a floor (equilibration), and the float64 resolution of rotated directions
# --------------------------------------------------------------------------------------------


def _gauss(seed: int, N: int = 260, d: int = 4):
    rng = np.random.default_rng(seed)
    off = np.concatenate([[0], np.cumsum(rng.integers(2, 8, N))]).astype(np.int64)
    X = rng.standard_normal((int(off[-1]), d))
    teacher = synthetic.random_teacher(d, 2, rng)
    from mhla_cli.model.forward import predict

    y = predict(teacher, X, off) + 1e-3 * rng.standard_normal((N, d))
    return X, off, y


@pytest.mark.parametrize("s", [1e-4, 1e-6, 1e-8, 1e-10, 1e-12, 1e4, 1e6, 1e8, 1e10, 1e12])
def test_diagonal_scalings_up_to_1e12_change_no_number(s: float) -> None:
    """Gaussian tokens X diag(1, 1, 1, s): the same verdict, rank and lambda_min (1e-6) as the
    reference on the unscaled X (the canonical numbers are unit-free), and the same fitted function on
    inputs scaled alike. Before equilibration the whitening's floor lost 22 directions at 1/s = 1e8."""
    from _reference import canonical
    from mhla_cli.model.forward import predict
    from mhla_cli.statistics.accumulate import chunk_features

    X, off, y = _gauss(17)
    ref = canonical(X, off, y)
    w = ref["eigenvalues"]
    D = np.array([1.0, 1.0, 1.0, s])
    feats = chunk_features(X * D, off, y, 4)
    cert = certify(feats)
    assert cert.identifiable and cert.rank == 40 and w[0] > cert.threshold
    assert abs(cert.lambda_min - w[0]) <= 1e-6 * w[0] and abs(cert.lambda_max - w[-1]) <= 1e-6 * w[-1]
    G = feats.basis.T @ (feats.token_gram / feats.token_weight) @ feats.basis
    assert np.abs(G - np.eye(4)).max() < 1e-9
    Z = np.random.default_rng(3).standard_normal((30, 4))
    zoff = np.array([0, 1, 4, 12, 30])
    want = predict(fit(chunk_features(X, off, y, 4), ridge=1e-6), Z, zoff)
    got = predict(fit(feats, ridge=1e-6), Z * D, zoff)
    assert np.abs(got - want).max() <= 1e-8 * np.abs(want).max()


@pytest.mark.parametrize("s", [1e-12, 1e12])
def test_scaled_tokens_through_files_shards_merge_and_partial_fit(tmp_path: Path, s: float) -> None:
    """featurize (the sampled estimate, its correction), shards merged from their files, and
    MHLA.partial_fit in chunks give the reference's numbers for tokens scaled by 1e12 / 1e-12."""
    from _reference import canonical
    from mhla_cli import MHLA

    X, off, y = _gauss(29, N=300)
    w = canonical(X, off, y)["eigenvalues"]
    Xs = X * np.array([1.0, s, 1.0, 1.0])
    path = tmp_path / "s.h5"
    with h5py.File(path, "w") as f:
        f["tokens"], f["offsets"], f["targets"] = Xs, off, y
    parts = []
    for i in range(3):
        parts.append(tmp_path / f"p{i}.h5")
        featurize(path, shard=(i, 3), chunk_size=40).save(parts[-1])
    whole = featurize(path, chunk_size=50)
    assert whole.extra_attrs["basis_passes"] == 1
    est = MHLA()
    for a, b in ((0, 90), (90, 200), (200, 300)):
        est.partial_fit([Xs[off[i]:off[i + 1]] for i in range(a, b)], y[a:b])
    for cert in (certify(whole), certify(merge_features(parts).features), certify(Features.load(parts[0]) + Features.load(parts[1])
                                                                             + Features.load(parts[2])),
                 est.certificate_):
        assert cert.identifiable and cert.rank == 40
        assert abs(cert.lambda_min - w[0]) <= 1e-6 * w[0]


def test_rotated_directions_are_resolved_above_sqrt_d_eps_and_called_unresolvable_below() -> None:
    """A rotation keeps a floor: a direction of relative standard deviation s is resolved (lambda_min
    of the unrotated, unscaled data to 1e-6) while s^2 > d eps64 (s > 3e-8 at d = 4), and below it the
    certificate says the features along it are not resolvable in float64 (not "never excited")."""
    from _reference import canonical
    from mhla_cli.statistics.accumulate import chunk_features

    X, off, y = _gauss(31)
    w = canonical(X, off, y)["eigenvalues"]
    R = np.linalg.qr(np.random.default_rng(8).standard_normal((4, 4)))[0]
    assert np.sqrt(4 * numerics.EPS) == pytest.approx(2.98e-8, rel=1e-2)
    for s in (1e-6, 1e-7, 6e-8):
        f = chunk_features((X * np.array([1.0, 1.0, 1.0, s])) @ R, off, y, 4)
        cert = certify(f)
        assert basis.unresolved(f.token_gram) == 0
        assert cert.identifiable and cert.rank == 40 and abs(cert.lambda_min - w[0]) <= 1e-6 * w[0], s
    for s in (1e-8, 1e-10):
        f = chunk_features((X * np.array([1.0, 1.0, 1.0, s])) @ R, off, y, 4)
        cert = certify(f)
        assert basis.unresolved(f.token_gram) == 1 and not cert.identifiable
        text = " ".join(cert.reasons)
        assert "not resolvable in float64" in text and "never excited" not in text, text
    # an exactly-zero coordinate is zero, not unresolvable
    Z = X.copy()
    Z[:, 2] = 0.0
    f = chunk_features(Z, off, y, 4)
    assert basis.unresolved(f.token_gram) == 0 and "always 0" in " ".join(certify(f).reasons)


def test_unresolved_canonical_counts_where_the_whitening_left_directions() -> None:
    """The count in the canonical coordinates: an eigenvalue of A^T G A just inside UNRESOLVED_CANONICAL (of the
    largest) is an unresolved direction, just outside it is none; exact-zero coordinates are none; and on data it
    agrees with the whitening's own count (basis.unresolved) where that count is not flaky."""
    R = np.linalg.qr(np.random.default_rng(3).standard_normal((3, 3)))[0]
    cut = basis.UNRESOLVED_CANONICAL
    for w3, k in ((0.99 * cut, 1), (1.01 * cut, 0), (0.0, 1), (1e-17, 1), (0.5, 0)):
        G = R @ np.diag([1.0, 1.0, w3]) @ R.T
        assert basis.unresolved_canonical(7.0 * G) == k, w3
    Z = np.diag([1.0, 0.0, 1e-20])  # coordinate 1 exactly zero: not counted; coordinate 2 unresolved
    assert basis.unresolved_canonical(Z) == 1 and basis.unresolved_canonical(np.zeros((3, 3))) == 0
    X, off, y = _gauss(31)
    from mhla_cli.statistics.accumulate import chunk_features

    R4 = np.linalg.qr(np.random.default_rng(8).standard_normal((4, 4)))[0]
    for s, k in ((1e-6, 0), (1e-10, 1)):
        f = chunk_features((X * np.array([1.0, 1.0, 1.0, s])) @ R4, off, y, 4)
        assert basis.unresolved_canonical(f.basis_token_gram) == basis.unresolved(f.token_gram) == k, s


def test_equilibrated_whitening_and_transition_are_exact_for_scaled_grams() -> None:
    """whitening takes a diagonal scaling out exactly (A^T G A = I to 1e-12 at scales 1e-12..1e12, A
    float32-valued after its power-of-2 scaling); a well-scaled G keeps the symmetric inverse square
    root; transition between two such bases is exact though cond(A) ~ 1e24."""
    rng = np.random.default_rng(0)
    M = rng.standard_normal((500, 4))
    G0 = M.T @ M
    D = np.array([1e12, 1.0, 1e-12, 3.0])
    G = G0 * D[:, None] * D[None, :]
    A = basis.whitening(G, 500.0, round32=False)
    assert np.abs(A.T @ (G / 500.0) @ A - np.eye(4)).max() < 1e-12
    A32 = basis.whitening(G, 500.0)
    assert np.abs(A32.T @ (G / 500.0) @ A32 - np.eye(4)).max() < 1e-5
    r = basis.equilibrate(G)
    assert np.array_equal(A32 / r[:, None], (A32 / r[:, None]).astype(np.float32).astype(np.float64))
    sym = basis.whitening(G0, 500.0, round32=False)
    wv, V = np.linalg.eigh(G0 / 500.0)
    assert np.abs(sym - (V / np.sqrt(wv)) @ V.T).max() < 1e-12 * np.abs(sym).max()
    B = basis.whitening(G * 1.5, 400.0, round32=False)
    C = basis.transition(A, B)
    # X B = X A C row by row (each token coordinate at its own scale), and C is the scaled orthogonal
    # map between two whitenings: C^T C = B^T (G / 500) B = 400 / (1.5 * 500) I
    assert np.all(np.abs(A @ C - B) <= 1e-12 * np.abs(B).max(axis=1, keepdims=True))
    assert np.abs(C.T @ C - np.eye(4) * (400.0 / (1.5 * 500.0))).max() < 1e-10


def test_round32_keeps_rows_far_outside_float32_range() -> None:
    """The redone pass's basis is rounded to float32 values row by row (power-of-2 scales): rows of
    scale 1e-45 or 1e45 round to 2^-24 relative instead of flushing to 0 or overflowing."""
    A = np.array([[1e45, 2e44], [3e-46, 1e-45]])
    B = basis.round32(A)
    assert np.isfinite(B).all() and np.all(np.abs(B - A) <= 2.0**-23 * np.abs(A).max(axis=1, keepdims=True))
    M = np.random.default_rng(1).standard_normal((3, 3))
    assert np.array_equal(basis.round32(M), M.astype(np.float32).astype(np.float64))


def test_an_exactly_zero_coordinate_is_already_whitened() -> None:
    """A token coordinate that is 0 in every token stays its own (whitening): correction() asks no
    change for it, so canonicalising twice changes nothing; the live part is still cut at CANONICAL_TOL."""
    from mhla_cli.numerics import CANONICAL_TOL

    for live in (1.0, 1.0 + 0.5 * CANONICAL_TOL):
        assert basis.correction(np.diag([live, 0.0, 1.0]) * 7.0, 7.0) == (None, 1.0)
    C, cond = basis.correction(np.diag([1.0 + 2 * CANONICAL_TOL, 0.0, 1.0]), 1.0)
    assert C is not None and C[1, 0] == C[1, 2] == C[0, 1] == C[2, 1] == 0.0 and cond > 1.0


def test_canonical_is_idempotent_with_a_zero_coordinate(tmp_path) -> None:
    from conftest import write_tokens

    from mhla_cli import certify, featurize

    rng = np.random.default_rng(5)
    X = rng.standard_normal((300, 6, 3))
    X[:, :, 1] = 0
    feats = featurize(write_tokens(tmp_path / "z.h5", X, None, rng.standard_normal((300, 3))))
    assert feats.correction() == (None, 1.0)
    before = np.array(feats.basis_gram)
    first = certify(feats)
    feats.canonical()
    assert np.array_equal(feats.basis_gram, before)
    assert certify(feats).lambda_max == first.lambda_max
