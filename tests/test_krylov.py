"""Block Lanczos for the top eigenvalue (mhla_cli.linalg.krylov), against numpy.linalg.eigvalsh on
materialised matrices: hard spectra (clustered, graded, rotated, exact multiplicities), the tolerance's
cut from both sides, the basis's cap, an invariant Krylov space (the breakdown's random fill)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mhla_cli.linalg import krylov
from mhla_cli.numerics import EPS, LANCZOS_TOL


def rotated(w: np.ndarray, seed: int) -> np.ndarray:
    """Q diag(w) Q^T for a random orthogonal Q (symmetrised)."""
    Q = np.linalg.qr(np.random.default_rng(seed).standard_normal((w.size, w.size)))[0]
    a = (Q * w) @ Q.T
    return (a + a.T) / 2


def gemm(a: np.ndarray):
    return lambda X: a @ X


def check_bound(a: np.ndarray, top: krylov.TopEigenvalue) -> float:
    """theta is a Rayleigh quotient (<= lambda_max up to rounding) and, when converged, within its
    residual of lambda_max (the start block is not orthogonal to the top eigenvector); returns the
    relative error."""
    w = np.linalg.eigvalsh(a)
    scale = max(abs(w[0]), abs(w[-1]), 1e-300)
    rounding = 64 * a.shape[0] * EPS * scale
    assert top.value <= w[-1] + rounding, (top.value, w[-1])
    if top.converged:
        assert top.residual <= top.tol * abs(top.value) + rounding
        assert w[-1] - top.value <= top.residual + rounding, (top.value, w[-1], top.residual)
    return abs(top.value - w[-1]) / scale


def spectra(n: int = 240) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    out = {}
    w = np.sort(rng.uniform(1.0, 10.0, n))
    w[-6:] = 20 * (1 + np.arange(6) * 1e-3)  # a tight cluster at the top, wider than the residual
    out["top cluster 1e-3"] = rotated(w, 1)
    out["graded 1e-12..1"] = rotated(np.logspace(-12, 0, n), 2)
    w = np.ones(n)
    w[-1] = 1 + 1e-6  # a gap of 1e-6 relative over an (n-1)-fold eigenvalue
    out["near multiple"] = rotated(w, 3)
    out["identity"] = np.eye(n)
    w = np.repeat([1.0, 2.0, 5.0], n // 3)  # three eigenvalues: the Krylov space is invariant after 3 blocks
    out["three eigenvalues"] = rotated(w, 4)
    F = rng.standard_normal((2 * n, n))
    F[:, :5] *= 1e-4
    out["rotated small-variance"] = (F.T @ F) / (2 * n)
    return out


@pytest.mark.parametrize("name", list(spectra()))
def test_the_top_eigenvalue_of_hard_spectra_equals_eigvalsh(name: str) -> None:
    a = spectra()[name]
    top = krylov.top_eigenvalue(gemm(a), a.shape[0])
    assert top.converged
    assert check_bound(a, top) <= 1e-13, name


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), block=st.integers(1, 10), seed=st.integers(0, 2**16),
       log_cond=st.floats(0, 12), shift=st.floats(0, 1))
def test_the_top_eigenvalue_is_bounded_by_its_residual(n: int, block: int, seed: int, log_cond: float,
                                                       shift: float) -> None:
    """Any small PSD matrix, any block width (wider than n included): theta <= lambda_max and within
    the residual of it; the Krylov space exhausts R^n at the latest, so it always converges here."""
    rng = np.random.default_rng(seed)
    w = shift + np.logspace(-log_cond, 0, n) * rng.uniform(0.5, 1.0, n)
    a = rotated(w, seed)
    top = krylov.top_eigenvalue(gemm(a), n, block=block)
    assert top.converged and top.block == min(block, n)
    check_bound(a, top)


def test_the_same_operator_gives_the_same_value_bit_for_bit() -> None:
    a = spectra()["top cluster 1e-3"]
    assert krylov.top_eigenvalue(gemm(a), a.shape[0]) == krylov.top_eigenvalue(gemm(a), a.shape[0])


def test_an_orthogonal_change_of_coordinates_leaves_the_value() -> None:
    """Metamorphic: Q^T A Q has A's eigenvalues; the value agrees to rounding though the start differs."""
    a = spectra()["top cluster 1e-3"]
    Q = np.linalg.qr(np.random.default_rng(9).standard_normal(a.shape))[0]
    b = Q.T @ a @ Q
    b = (b + b.T) / 2
    x, y = (krylov.top_eigenvalue(gemm(m), m.shape[0]).value for m in (a, b))
    assert abs(x - y) <= 1e-13 * abs(x)


def test_it_stops_at_the_first_product_whose_residual_clears_the_tolerance() -> None:
    """LANCZOS_TOL from both sides: the run stops at the first block whose relative residual is <= tol;
    capped one block earlier, the same run is not converged and its residual is above the cut."""
    a = spectra()["top cluster 1e-3"]
    n = a.shape[0]
    top = krylov.top_eigenvalue(gemm(a), n)
    assert top.converged and top.products > 2
    assert top.residual <= LANCZOS_TOL * top.value
    early = krylov.top_eigenvalue(gemm(a), n, max_columns=top.vectors - krylov.BLOCK)
    assert not early.converged and early.products == top.products - 1
    assert early.residual > LANCZOS_TOL * early.value
    # the cut itself: a tolerance just above the stopped run's residual stops it no later, just below
    # it needs more
    rel = top.residual / top.value
    assert krylov.top_eigenvalue(gemm(a), n, tol=rel * 1.01).products <= top.products
    assert krylov.top_eigenvalue(gemm(a), n, tol=rel * 0.99).products > top.products


def test_the_basis_cap_is_reported_not_hidden() -> None:
    a = spectra()["top cluster 1e-3"]
    top = krylov.top_eigenvalue(gemm(a), a.shape[0], max_columns=16)
    assert not top.converged and top.vectors == 16 and top.products == 2
    assert top.record()["converged"] is False


def test_an_invariant_krylov_space_is_filled_and_stays_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """tol = 0 never stops on the residual: the basis grows past the invariant space of a matrix with
    three eigenvalues (the new blocks are rounding, replaced by random directions) up to all of R^n,
    and theta is then lambda_max to rounding, with an orthonormal basis (else Rayleigh-Ritz would not
    give an eigenvalue of A)."""
    import scipy.linalg as sl

    a = spectra(48)["three eigenvalues"]
    real, deficient, worst = krylov._orthonormal_block, [], [0.0]

    def spy(Z, Q, scale, rng):
        R = sl.qr(Z, mode="economic", pivoting=True)[1]
        deficient.append(int(np.sum(np.abs(np.diag(R)) <= krylov.BREAKDOWN * scale)))
        q = real(Z, Q, scale, rng)
        B = np.hstack([Q, q])
        worst[0] = max(worst[0], float(np.abs(B.T @ B - np.eye(B.shape[1])).max()))
        return q

    monkeypatch.setattr(krylov, "_orthonormal_block", spy)
    top = krylov.top_eigenvalue(gemm(a), 48, tol=0.0)
    assert top.vectors == 48 and not top.converged  # the cap (n): tol 0 is never met
    assert abs(top.value - 5.0) <= 1e-13 * 5
    assert max(deficient) == krylov.BLOCK  # the fourth block lay in the invariant space: all filled
    assert worst[0] <= 1e-13


def test_the_zero_matrix_and_empty_operators() -> None:
    top = krylov.top_eigenvalue(gemm(np.zeros((30, 30))), 30)
    assert top.value == 0.0 and top.converged
    assert krylov.top_eigenvalue(gemm(np.zeros((0, 0))), 0).value == 0.0


def test_basis_bytes_bounds_what_it_holds() -> None:
    n = 7200
    assert krylov.basis_bytes(n) == 8 * n * (2 * krylov.MAX_BASIS_COLUMNS + krylov.BLOCK)
    assert krylov.basis_bytes(10) == 8 * 10 * (2 * 10 + krylov.BLOCK)


@pytest.mark.parametrize("factor", [2.0, 0.5], ids=["just above BREAKDOWN: kept", "just below: replaced"])
def test_a_new_column_is_replaced_just_below_the_breakdown_cut(factor: float) -> None:
    """BREAKDOWN from both sides: a column of the new block (orthogonal to the basis) with norm factor *
    BREAKDOWN * scale is kept (2x) or replaced by a random direction (0.5x); the result is orthonormal
    and orthogonal to the basis either way."""
    rng = np.random.default_rng(3)
    n, scale = 40, 7.0
    B = np.linalg.qr(rng.standard_normal((n, 7)))[0]
    Q, D = B[:, :4], B[:, 4:]  # the basis and three directions orthogonal to it
    Z = np.asfortranarray(D * np.array([scale, scale, factor * krylov.BREAKDOWN * scale]))
    out = krylov._orthonormal_block(Z, Q, scale, np.random.default_rng(0))
    full = np.hstack([Q, out])
    assert np.abs(full.T @ full - np.eye(7)).max() <= 1e-13
    third = np.linalg.norm(out.T @ D[:, 2])  # how much of the small direction the block keeps
    if factor > 1:
        assert third == pytest.approx(1.0, abs=1e-12)
    else:
        assert third < 0.9  # a random direction took its place
