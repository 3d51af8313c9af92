"""Heads <-> parameters: the factors (V, Q) as (H, d^2) arrays and vectors, p(V, Q) and its Jacobians."""

from __future__ import annotations

import numpy as np

from ...model.heads import Heads, p_from_W
from .affine import _p_index


def _pack(V: np.ndarray, Q: np.ndarray) -> np.ndarray:
    return np.concatenate([V.reshape(-1), Q.reshape(-1)])


def _unpack(x: np.ndarray, H: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    n = H * d * d
    return x[:n].reshape(H, d * d), x[n:].reshape(H, d * d)


def _p_of(Vm: np.ndarray, Qm: np.ndarray) -> np.ndarray:
    return p_from_W(Vm.T @ Qm)


def _jacobians(Vm: np.ndarray, Qm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """dp/dV (E, H d^2) and dp/dQ (E, H d^2); p is linear in each factor, so p = J_V v = J_Q q."""
    H, dd = Vm.shape
    d = int(round(np.sqrt(dd)))
    r1, c1, r2, c2, m = _p_index(d)
    E = r1.size
    e = np.arange(E)
    JV = np.zeros((E, H, dd))
    JQ = np.zeros((E, H, dd))
    # p[e] = sum_h V_h[r1] Q_h[c1] + m V_h[r2] Q_h[c2]
    JV[e, :, r1] = Qm[:, c1].T
    JV[e, :, r2] += m[:, None] * Qm[:, c2].T
    JQ[e, :, c1] = Vm[:, r1].T
    JQ[e, :, c2] += m[:, None] * Vm[:, r2].T
    return JV.reshape(E, H * dd), JQ.reshape(E, H * dd)


def _balance(Vm: np.ndarray, Qm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rescale V_h, Q_h to equal norms (same W; the weight-decay optimum of the scale gauge)."""
    nv = np.linalg.norm(Vm, axis=1)
    nq = np.linalg.norm(Qm, axis=1)
    ok = (nv > 0) & (nq > 0)
    c = np.ones_like(nv)
    c[ok] = np.sqrt(nq[ok] / nv[ok])
    return Vm * c[:, None], Qm / c[:, None]


def _heads_from_svd(W: np.ndarray, H: int) -> tuple[np.ndarray, np.ndarray]:
    U, s, Vt = np.linalg.svd(W)
    r = np.sqrt(s[:H])
    return (U[:, :H] * r).T.copy(), (Vt[:H].T * r).T.copy()


def _to_heads(Vm: np.ndarray, Qm: np.ndarray, d: int) -> Heads:
    H = Vm.shape[0]
    return Heads(V=Vm.reshape(H, d, d).copy(), Q=Qm.reshape(H, d, d).copy())
