"""The backends (mhla_cli.linalg.backends): the same cases over every installed backend (numpy always,
torch on the CPU when it is importable): the matrix's decompositions equal NumPy's, a Cholesky of a
matrix that is not positive definite is refused, the factorization and the reduction's Gram give the
numpy backend's numbers."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import _reference
from conftest import relerr
from mhla_cli.linalg import backends
from mhla_cli.linalg.factorization import Factorization
from mhla_cli.statistics.accumulate import _Accumulator

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
    assert m.cholesky(2.0 * w_ref[0]) is None  # an eigenvalue below the shift: not positive definite
    assert relerr(m.shifted_solve(0.5, 0.1, x), np.linalg.solve(0.5 * a + 0.1 * np.eye(a.shape[0]), x)) < 1e-10
    np.testing.assert_array_equal(a, _spd())  # the matrix is never written


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
        acc = _Accumulator(d, True, np.eye(d), device=None if dev == "cpu" else backend.device)
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
