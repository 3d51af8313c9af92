"""The backends (mhla_cli.linalg.backends): the same cases over every installed backend (numpy always,
torch on the CPU when it is importable): the matrix's decompositions equal NumPy's, a Cholesky of a
matrix that is not positive definite is refused, the factorization and the pass's Gram give the
numpy backend's numbers."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import _reference
from conftest import relerr
from mhla_cli.cli.options import in_options
from mhla_cli.errors import Refused
from mhla_cli.linalg import backends
from mhla_cli.linalg.factorization import Factorization
from mhla_cli.statistics.accumulate import Accumulator

BACKENDS = ["cpu"] + (["torch:cpu"] if importlib.util.find_spec("torch") is not None else [])


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> backends.Backend:
    """Every installed backend, resolved from its spelling."""
    return backends.get_backend(request.param)


def _spd(n: int = 30, rank: int | None = None, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    F = rng.standard_normal((n if rank is None else rank, n)) * np.linspace(0.5, 2.0, n)
    return F.T @ F + (1e-3 * np.eye(n) if rank is None else 0.0)


def test_resolved_once_from_the_spelling() -> None:
    assert isinstance(backends.get_backend(None), backends.NumpyBackend)
    assert backends.get_backend("cpu") is backends.get_backend(None)
    b = backends.get_backend("torch:cpu")
    assert isinstance(b, backends.TorchBackend) and b.device == "torch:cpu"
    assert backends.get_backend(b) is b
    assert backends.get_backend(None).free_bytes() is None


def test_matrix_decompositions_equal_numpy(backend: backends.Backend) -> None:
    a = _spd()
    m = backend.matrix(a)
    w_ref = np.linalg.eigvalsh(a)
    assert relerr(m.eigvalsh(), w_ref) < 1e-12
    w, v = m.eigh()
    assert relerr(w, w_ref) < 1e-12 and relerr((v * w) @ v.T, a) < 1e-12
    x = np.random.default_rng(1).standard_normal(a.shape[0])
    assert relerr(m.matvec(x), a @ x) < 1e-14
    f = m.cholesky(0.5 * w_ref[0])
    ref = np.linalg.solve(a - 0.5 * w_ref[0] * np.eye(a.shape[0]), x)
    assert relerr(f.solve(x), ref) < 1e-10 and relerr(f.inverse_matvec(x), ref) < 1e-10
    X = np.random.default_rng(2).standard_normal((a.shape[0], 8))
    assert relerr(m.matmat(X), a @ X) < 1e-14  # blocks: block Lanczos (mhla_cli.linalg.krylov)
    assert relerr(f.inverse_matmat(X), np.linalg.solve(a - 0.5 * w_ref[0] * np.eye(a.shape[0]), X)) < 1e-10
    assert m.cholesky(2.0 * w_ref[0]) is None  # an eigenvalue below the shift: not positive definite
    assert relerr(m.shifted_solve(0.5, 0.1, x), np.linalg.solve(0.5 * a + 0.1 * np.eye(a.shape[0]), x)) < 1e-10
    np.testing.assert_array_equal(a, _spd())  # the matrix is never written


@pytest.mark.parametrize("order", ["C", "F"])
def test_a_shifted_cholesky_factors_one_copy_in_the_matrix_s_own_order(order: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """HostMatrix.cholesky(shift): one copy of a in a's memory order, factored in place (a C-ordered copy
    through its transpose, an upper U^T U as the unshifted factor): no transposing copy (415 MB at
    psi = 7200); the factor solves a - shift I (numpy), and a is not written."""
    import scipy.linalg

    a = np.asarray(_spd(), order=order)
    seen = []
    real = scipy.linalg.cho_factor

    def spy(m, lower=False, overwrite_a=False, check_finite=True):
        out = real(m, lower=lower, overwrite_a=overwrite_a, check_finite=check_finite)
        seen.append((bool(m.flags.f_contiguous), bool(lower), bool(overwrite_a), bool(np.shares_memory(out[0], m))))
        return out

    monkeypatch.setattr(scipy.linalg, "cho_factor", spy)
    m = backends.HostMatrix(a)
    t = 0.5 * np.linalg.eigvalsh(a)[0]
    f, f0 = m.cholesky(t), m.cholesky(0.0)
    # the shifted copy handed to LAPACK as it lies (F-contiguous: a C copy's transpose) and overwritten
    assert seen[0] == (True, order == "F", True, True), seen
    assert seen[1][1] == seen[0][1]  # the same form as the unshifted factor
    x = np.random.default_rng(4).standard_normal(a.shape[0])
    assert relerr(f.solve(x), np.linalg.solve(a - t * np.eye(a.shape[0]), x)) < 1e-10
    assert relerr(f.inverse_matvec(x), np.linalg.solve(a - t * np.eye(a.shape[0]), x)) < 1e-10
    assert relerr(f0.solve(x), np.linalg.solve(a, x)) < 1e-10
    # block products in both factor forms (upper U^T U from a C-ordered a, lower L L^T from an F one),
    # for C- and F-ordered blocks
    X = np.random.default_rng(5).standard_normal((a.shape[0], 5))
    for B in (X, np.asfortranarray(X)):
        assert relerr(f.inverse_matmat(B), np.linalg.solve(a - t * np.eye(a.shape[0]), X)) < 1e-10
        assert relerr(m.matmat(B), a @ X) < 1e-14
    np.testing.assert_array_equal(a, _spd())


@pytest.mark.parametrize("order", ["C", "F"])
def test_matvec_equals_numpy_and_reads_the_cholesky_s_triangle(order: str) -> None:
    """HostMatrix.matvec: a x for vectors (BLAS dsymv on one triangle) and blocks (GEMM) in either memory
    order; a vector's product reads the lower triangle, the one the Cholesky factors, so the fit's
    refinement residual and its factor see the same matrix even when a is symmetric only to rounding."""
    rng = np.random.default_rng(5)
    a = _spd()
    n = a.shape[0]
    x, X = rng.standard_normal(n), rng.standard_normal((n, 3))
    m = backends.HostMatrix(np.asarray(a, order=order))
    assert relerr(m.matvec(x), a @ x) < 1e-14 and relerr(m.matvec(X), a @ X) < 1e-14
    assert relerr(m.matvec(x[::2].repeat(2)), a @ x[::2].repeat(2)) < 1e-14
    b = a.copy()
    b[np.triu_indices(n, 1)] *= 1 + 1e-6  # the strict upper triangle off by 1e-6 relative
    lower = np.tril(b) + np.tril(b, -1).T  # the matrix of b's lower triangle
    mb = backends.HostMatrix(np.asarray(b, order=order))
    assert relerr(mb.matvec(x), lower @ x) < 1e-14 and relerr(mb.matvec(x), b @ x) > 1e-9
    t = 0.5 * np.linalg.eigvalsh(lower)[0]
    assert relerr(mb.cholesky(t).solve(x), np.linalg.solve(lower - t * np.eye(n), x)) < 1e-10


@pytest.mark.parametrize("dense_max", [4096, 0], ids=["dense", "cholesky-lanczos"])
@pytest.mark.parametrize("rank", [None, 20], ids=["definite", "singular"])
def test_factorization_equals_the_numpy_backend(backend: backends.Backend, dense_max: int, rank: int | None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from mhla_cli.linalg import factorization

    monkeypatch.setattr(factorization, "DENSE_MAX", dense_max)
    a = _spd(40, rank)
    ref, fac = Factorization(a, scale=0.5), Factorization(a, scale=0.5, device=backend.device)
    assert fac.backend is backend or type(fac.backend) is type(backend)
    lmax = ref.lambda_max()
    assert abs(fac.lambda_max() - lmax) <= 1e-10 * lmax
    assert abs(fac.lambda_min() - ref.lambda_min()) <= 1e-10 * lmax
    tol = 1e-8 * lmax
    assert fac.rank(tol) == ref.rank(tol) == (40 if rank is None else rank)
    assert fac.proves_above(0.0) is ref.proves_above(0.0) is (rank is None)
    rhs = a @ np.random.default_rng(2).standard_normal((40, 2))  # (n, targets), as fit's moments
    assert relerr(fac.ridge_solve(rhs, 1e-3 * lmax, tol), ref.ridge_solve(rhs, 1e-3 * lmax, tol)) < 1e-9
    assert relerr(fac.range_solve(rhs, tol), ref.range_solve(rhs, tol)) < 1e-8
    # one right-hand side as a vector: the same numbers as that column (the eigh fallback of a backend
    # without a range Cholesky, torch's, once broadcast a vector into an (n, n) matrix)
    for f in (fac, ref):
        one = f.range_solve(rhs[:, 0], tol)
        assert one.shape == (40,) and relerr(one, f.range_solve(rhs, tol)[:, 0]) < 1e-12
    if rank is None:
        assert relerr(fac.solve(rhs), ref.solve(rhs)) < 1e-9
    assert fac.null_space(tol)[1].shape == ref.null_space(tol)[1].shape


@pytest.mark.parametrize("d", [3, 12], ids=["syrk", "pairs"])
def test_gram_accumulation_equals_the_numpy_backend(backend: backends.Backend, d: int) -> None:
    rng = np.random.default_rng(3)
    off = np.concatenate([[0], np.cumsum(rng.integers(1, 6, size=30))]).astype(np.int64)
    X, Y = rng.standard_normal((int(off[-1]), d)), rng.standard_normal((30, d))
    w = rng.uniform(0.5, 2.0, size=30)
    parts = []
    for dev in ("cpu", backend):
        acc = Accumulator(d, True, np.eye(d), device=None if dev == "cpu" else backend.device)
        for a in range(0, 30, 7):
            b = min(30, a + 7)
            acc.add(X[off[a]:off[b]], off[a:b + 1] - off[a], Y[a:b], weights=w[a:b])
        parts.append(acc.result())
    for k in ("basis_gram", "basis_moments", "target_gram", "basis_token_gram"):
        assert relerr(getattr(parts[1], k), getattr(parts[0], k)) < 1e-12, k


@pytest.mark.parametrize("d", [1, 3])
def test_last_outputs_equal_the_materialised_features(backend: backends.Backend, d: int) -> None:
    """p . H(X_i) on every backend against the materialised features of tests/_reference.py."""
    rng = np.random.default_rng(d)
    B, n = 7, 4
    X = rng.standard_normal((B, n, d))
    S, last = np.einsum("bta,btc->bac", X, X), X[:, -1]
    psi = d * d * (d + 1) // 2
    coef = rng.standard_normal((d, psi))
    feats = np.stack([_reference.features(X[b]) for b in range(B)])  # materialised, plain numpy
    out = backend.last_outputs(coef, S, last)
    assert out.shape == (B, d) and relerr(out, feats @ coef.T) < 1e-12


def test_lapack_indexing_is_checked_above_46340() -> None:
    """A Cholesky of n > 46340 (n^2 >= 2^31) needs 64-bit indexing: an LP64 LAPACK behind a SciPy before
    1.13 is refused (one line naming --scheduler), an ILP64 one or a newer SciPy is not; n <= 46340 never."""
    n = backends.LP64_MAX_N
    assert n * n < 2**31 <= (n + 1) ** 2
    old = {"scipy": "1.12.0", "ilp64": False, "library": "scipy-openblas 0.3.21"}
    backends.check_lapack_indexing(n, old)
    with pytest.raises(Refused, match=r"n = 46341 > 46340 needs 64-bit indexing") as exc:
        backends.check_lapack_indexing(n + 1, old)
    # the library names no option; the CLI words the remedy in its own
    assert exc.value.remedies == {"cluster": {}} and "--" not in str(exc.value)
    assert str(in_options(exc.value)).endswith("--scheduler (docs/cluster.md)")
    backends.check_lapack_indexing(n + 1, {**old, "ilp64": True})
    backends.check_lapack_indexing(n + 1, {**old, "scipy": "1.13.0"})
    info = backends.lapack_indexing()  # this machine's, as scipy and numpy report it
    assert set(info) == {"scipy", "ilp64", "library", "numpy_ilp64"} and info["scipy"]
