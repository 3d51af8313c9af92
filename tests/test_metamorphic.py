"""Metamorphic tests of the canonical certificate and fit (hypothesis), each also against the plain
numpy reference on materialised canonical features (tests/_reference.py).

What cannot change the answer: an invertible (rotated, ill-conditioned) map of the token
coordinates, the order of the sequences, the chunk size, shards + merge, workers, partial_fit
chunking, duplicating every sequence. Structure whose truth is known: length-1 sequences never
certify, however their tokens are scaled or rotated.
"""

from __future__ import annotations


import h5py
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from _metamorphic import (FILE_SETTINGS, SETTINGS, Data, check_partial_fit, datasets, file_variants, predict_model,
                          probes, same_certificate, transform)
from _reference import canonical, min_norm_function, predict_canonical, predict_own, ratio
from mhla_cli.solve.probes import certify_probes
from mhla_cli import certify
from mhla_cli.solve.lstsq import fit
from mhla_cli.statistics.accumulate import chunk_features
from mhla_cli.statistics.stream import featurize
from mhla_cli.samples import ReadSpec, samples_of



# --------------------------------------------------------------------------------------------
# the reference, and invertible maps of the token coordinates
# --------------------------------------------------------------------------------------------


@pytest.fixture(params=["syrk", "pairs"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The pass's Gram as one syrk of the materialised rows ("syrk", the default below
    symgram.SYMGRAM_MIN_D) or as its distinct entries held through every change of basis, sum and file
    ("pairs", the default from SYMGRAM_MIN_D on), forced for the small d of these tests."""
    from mhla_cli.linalg import symgram

    if request.param == "pairs":
        monkeypatch.setattr(symgram, "SYMGRAM_MIN_D", 1)
    else:
        monkeypatch.setattr(symgram, "SYMGRAM_MIN_D", 10**9)
    return request.param


@SETTINGS
@given(data=datasets(), cond=st.sampled_from([1.0, 30.0, 1e3]), tseed=st.integers(0, 1000))
def test_certificate_and_fit_are_unit_free_and_match_the_reference(data: Data, cond: float, tseed: int,
                                                                    kernel: str) -> None:
    ref = canonical(data.tokens, data.offsets, data.targets, data.per_position, data.weights, data.normalize)
    feats = data.feats()
    cert = certify(feats)
    w = ref["eigenvalues"]
    assert abs(cert.lambda_max - w[-1]) <= 1e-9 * w[-1]
    assert abs(cert.lambda_min - w[0]) <= 1e-9 * (abs(w[0]) if cert.identifiable else w[-1])
    T = transform(data.d, cond, tseed)
    XT = data.tokens.astype(np.float64) @ T
    cert_T = certify(data.feats(XT))
    same_certificate(cert_T, cert)
    # the fitted function (least squares, minimum norm, ridge) on fresh inputs Z and Z T
    Zs = probes(data.d, tseed + 1)
    ZTs = [Z @ T for Z in Zs]
    for ridge in (0.0, 1e-3 * cert.lambda_max):
        f, f_T = fit(feats, ridge=ridge), fit(data.feats(XT), ridge=ridge)
        # the models' own predict (evaluated in their canonical coordinates, Model.evaluation): the
        # coefficients on the own features of X T carry cond(T)^3 eps of rounding
        want, got = predict_model(f, Zs), predict_model(f_T, ZTs)
        assert ratio(got, want) < 1e-8, (ridge, ratio(got, want))
    # the least-squares function against numpy's minimum-norm lstsq on the canonical features
    if cert.identifiable:
        want = predict_canonical(min_norm_function(ref, rcond=1e-12), ref["A"], Zs, data.normalize)
        assert ratio(predict_own(fit(feats).coef, Zs, data.normalize), want) < 1e-8


@SETTINGS
@given(data=datasets(min_n=110, max_n=140, dims=(5,)), cond=st.sampled_from([1.0, 30.0, 1e3]),
       tseed=st.integers(0, 1000), pseed=st.integers(0, 1000), chunk=st.integers(1, 40))
def test_block_lanczos_estimates_are_unit_free_and_match_the_reference(
        data: Data, cond: float, tseed: int, pseed: int, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimates above DENSE_MAX (block Lanczos on Lambda~ and on the inverse through the proof's
    factor, mhla_cli.linalg.krylov), forced here at psi = 75 (d = 5: 6-9 products of 8 vectors, short of
    the whole space; below 32 features every matrix is decomposed densely): equal to the reference's
    eigenvalues and
    unchanged by an invertible map of the token coordinates, the order of the sequences and the chunk
    size (the start block is fixed, Lambda~ moves at rounding level)."""
    from mhla_cli.linalg import factorization

    monkeypatch.setattr(factorization, "DENSE_MAX", 0)
    ref = canonical(data.tokens, data.offsets, data.targets, data.per_position, data.weights, data.normalize)
    w = ref["eigenvalues"]
    cert = certify(data.feats())
    # identifiable: both are block Lanczos estimates (otherwise lambda_min comes from the eigenvectors)
    assert cert.estimated == (["lambda_min", "lambda_max"] if cert.identifiable else [])
    assert abs(cert.lambda_max - w[-1]) <= 1e-9 * w[-1]
    assert abs(cert.lambda_min - w[0]) <= 1e-9 * (abs(w[0]) if cert.identifiable else w[-1])
    XT = data.tokens.astype(np.float64) @ transform(data.d, cond, tseed)
    same_certificate(certify(data.feats(XT)), cert)
    N = data.offsets.size - 1

    def part(seq: np.ndarray):
        """The statistics of the sequences `seq`, in that order."""
        lens = data.offsets[seq + 1] - data.offsets[seq]
        tok = np.concatenate([np.arange(data.offsets[i], data.offsets[i + 1]) for i in seq])
        rows = tok if data.per_position else seq
        return chunk_features(data.tokens[tok], np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                              data.targets[rows], data.d,
                              weights=None if data.weights is None else data.weights[rows],
                              read=ReadSpec(samples_of(data.per_position), data.normalize))

    same_certificate(certify(part(np.random.default_rng(pseed).permutation(N))), cert, rel=1e-8)
    chunks = [part(np.arange(a, min(N, a + chunk))) for a in range(0, N, chunk)]
    same_certificate(certify(sum(chunks[1:], chunks[0])), cert, rel=1e-8)


@SETTINGS
@given(data=datasets(min_n=3, max_n=6), cond=st.sampled_from([30.0, 1e3]), tseed=st.integers(0, 1000))
def test_minimum_norm_fit_of_non_identifiable_data_is_unit_free(data: Data, cond: float, tseed: int) -> None:
    """Fewer samples than features: the minimum-norm function is the canonical one, whatever the units."""
    feats = data.feats()
    if feats.n_samples == 0:
        return
    T = transform(data.d, cond, tseed)
    XT = data.tokens.astype(np.float64) @ T
    f, f_T = fit(feats), fit(data.feats(XT))
    assume(not f.info["identifiable"])  # per-position data of a few sequences may already certify
    assert not f_T.info["identifiable"]
    Zs = probes(data.d, tseed + 2)
    want = predict_model(f, Zs)
    assert ratio(predict_model(f_T, [Z @ T for Z in Zs]), want) < 1e-8
    ref = canonical(data.tokens, data.offsets, data.targets, data.per_position, data.weights, data.normalize)
    ref_fn = predict_canonical(min_norm_function(ref), ref["A"], Zs, data.normalize)
    assert ratio(want, ref_fn) < 1e-7


def _with_zero_weights(data: Data, n_zero: int, seed: int, c: float) -> Data:
    """The same data with every weight times c and n_zero sequences of weight 0 appended (large
    tokens, random targets: they would dominate any sum that counted them)."""
    rng = np.random.default_rng(seed)
    rows = int(data.offsets[-1]) if data.per_position else data.offsets.size - 1
    w = np.ones(rows) if data.weights is None else data.weights
    lengths = rng.integers(1, 9, size=n_zero)
    extra = (100.0 * rng.standard_normal((int(lengths.sum()), data.d))).astype(data.tokens.dtype)
    offsets = np.concatenate([data.offsets, data.offsets[-1] + np.cumsum(lengths)]).astype(np.int64)
    n_new = int(lengths.sum()) if data.per_position else n_zero
    y = np.concatenate([data.targets, 1e3 * rng.standard_normal((n_new, data.d))])
    return Data(np.concatenate([data.tokens, extra]), offsets, y, np.concatenate([c * w, np.zeros(n_new)]),
                data.per_position, data.normalize, data.d)


@SETTINGS
@given(data=datasets(), n_zero=st.integers(1, 40), c=st.sampled_from([1e-8, 1e-3, 7.0, 1e6]),
       zseed=st.integers(0, 1000))
def test_weights_carry_no_units(data: Data, n_zero: int, c: float, zseed: int) -> None:
    """Zero-weight samples change nothing and every weight times c changes nothing: the certificate
    and the fitted function equal the reference of the plain data (G = sum w S / sum w n, Lambda~ =
    sum w Ht Ht^T / sum w)."""
    ref = canonical(data.tokens, data.offsets, data.targets, data.per_position, data.weights, data.normalize)
    w = ref["eigenvalues"]
    other = _with_zero_weights(data, n_zero, zseed, c)
    feats = other.feats()
    assert feats.n_samples == ref["N"] and abs(feats.weight - c * ref["W"]) <= 1e-12 * c * ref["W"]
    cert = certify(feats)
    assert cert.identifiable == certify(data.feats()).identifiable
    assert abs(cert.lambda_max - w[-1]) <= 1e-10 * w[-1]
    assert abs(cert.lambda_min - w[0]) <= 1e-10 * (abs(w[0]) if cert.identifiable else w[-1])
    Zs = probes(data.d, zseed)
    want = predict_own(fit(data.feats()).coef, Zs, data.normalize)
    assert ratio(predict_own(fit(feats).coef, Zs, data.normalize), want) < 1e-10
    if cert.identifiable:
        ref_fn = predict_canonical(min_norm_function(ref, rcond=1e-12), ref["A"], Zs, data.normalize)
        assert ratio(want, ref_fn) < 1e-8
        assert ratio(predict_own(fit(feats).coef, Zs, data.normalize), ref_fn) < 1e-8


# --------------------------------------------------------------------------------------------
# what the accumulation cannot see: order, chunks, shards, workers, partial_fit, duplicates
# --------------------------------------------------------------------------------------------


@pytest.fixture(params=["exact", "estimate"])
def start(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The basis featurize starts in: the whitening of every token, read in many small blocks ("exact":
    ranges.exact_basis, forced), or the float32 estimate of a sample of part of the file, changed after
    the pass ("estimate")."""
    from mhla_cli.statistics import basis, ranges

    monkeypatch.setattr(basis, "SAMPLE_TOKENS", 64)  # 8 blocks of 8 tokens: part of these files
    monkeypatch.setattr(ranges, "EXACT_BASIS_FLOPS_PER_BYTE", 0.0 if request.param == "exact" else np.inf)
    return request.param


@FILE_SETTINGS
@given(data=datasets(), chunk=st.integers(1, 40), pseed=st.integers(0, 1000))
def test_order_chunks_shards_workers_and_duplicates_do_not_change_the_answer(
        data: Data, chunk: int, pseed: int, tmp_path_factory: pytest.TempPathFactory, kernel: str,
        start: str) -> None:
    tmp = tmp_path_factory.mktemp("m")
    path = data.write(tmp / "d.h5")
    base = featurize(path, normalize=data.normalize)
    cert = certify(base)
    # against the reference (plain numpy on the materialised canonical features), whichever start
    w = canonical(data.tokens, data.offsets, data.targets, data.per_position, data.weights,
                  data.normalize)["eigenvalues"]
    assert abs(cert.lambda_max - w[-1]) <= 1e-9 * w[-1]
    assert abs(cert.lambda_min - w[0]) <= 1e-9 * (abs(w[0]) if cert.identifiable else w[-1])
    # exact: no change after the pass (the whitening of the token Gram it accumulates, every layout and
    # weights); an estimate is always changed
    assert (base.extra_attrs["basis_correction_cond"] == 1.0) == (start == "exact")
    Zs = probes(data.d, pseed)
    fn = predict_own(fit(base).coef, Zs, data.normalize)
    variants = file_variants(data, path, tmp, chunk, pseed)
    for name, v in variants.items():
        same_certificate(certify(v), cert, rel=1e-8)
        assert ratio(predict_own(fit(v).coef, Zs, data.normalize), fn) < 1e-8, name
    # duplicating every sequence leaves Lambda~ itself unchanged (not only its spectrum)
    dup = variants["duplicated"]
    assert dup.n_samples == 2 * base.n_samples
    assert ratio(certify(dup).eigenvalues, cert.eigenvalues) < 1e-10


@pytest.mark.filterwarnings("ignore::UserWarning")
@SETTINGS
@given(data=datasets(), cuts=st.lists(st.integers(1, 39), min_size=1, max_size=4, unique=True),
       scale=st.sampled_from([1.0, 1e-4]))
def test_partial_fit_equals_the_fit_of_the_concatenation(data: Data, cuts: list[int], scale: float,
                                                         kernel: str) -> None:
    """Any chunking, whatever the first chunk holds (here optionally a tiny rotated direction)."""
    check_partial_fit(data, cuts, scale)


# --------------------------------------------------------------------------------------------
# structure whose truth is known
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(d=st.integers(2, 4), n=st.integers(60, 200), std=st.sampled_from([1.0, 1e-3, 1e-6]),
       scale=st.sampled_from([1e-3, 1.0, 1e3]), seed=st.integers(0, 10_000))
def test_length_one_sequences_never_certify(d: int, n: int, std: float, scale: float, seed: int,
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """Their features are symmetric cubic tensors: rank <= C(d+2, 3) < psi, whatever the tokens."""
    rng = np.random.default_rng(seed)
    R = np.linalg.qr(rng.standard_normal((d, d)))[0]
    Z = rng.standard_normal((n, d))
    Z[:, -1] *= std
    tokens = scale * Z @ R
    offsets = np.arange(n + 1)
    feats = chunk_features(tokens, offsets, None, d)
    cert = certify(feats)
    sym = (d + 2) * (d + 1) * d // 6
    assert not cert.identifiable and cert.rank <= sym < cert.n_features
    if n >= 3 * sym and std >= 1e-3:  # enough generic samples: exactly the symmetric tensors
        assert cert.rank == sym
    if d == 3 and seed % 4 == 0:  # certify --on: length-1 probes determined, longer ones not
        tmp = tmp_path_factory.mktemp("l1")
        f = tmp / "f.h5"
        featurize_from = tmp / "t.h5"
        with h5py.File(featurize_from, "w") as h:
            h["tokens"], h["offsets"] = tokens, offsets
        featurize(featurize_from).save(f)
        P = scale * rng.standard_normal((40, d)) @ R
        for length, determined in ((1, True), (4, False)):
            p = tmp / f"p{length}.h5"
            with h5py.File(p, "w") as h:
                h["tokens"], h["offsets"] = P, np.arange(0, 41, length)
            rep = certify_probes(featurize(featurize_from), p)
            if determined and std >= 1e-3 and n >= 3 * sym:
                assert rep.determined, rep.to_dict()
            if not determined:
                assert rep.undetermined.size == rep.n_probes
