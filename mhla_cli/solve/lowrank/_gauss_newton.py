"""Gauss-Newton normal equations of a loss on p(V, Q), from the statistics, and their damped solve.

Shared by the Levenberg-Marquardt loops of `fewest.polish_heads` and `factorised._als_lm`.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import numpy as np

from ...feature_map import pair_index


class GramSums(Protocol):
    """What `_normal_parts` reads of the statistics (Features, or fewest._Metric standing in for them)."""

    @property
    def gram(self) -> np.ndarray | None: ...

    @property
    def weight(self) -> float: ...


def _damped_solve(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Solve a damped (positive definite) normal-equation system; ill-conditioning is expected here."""
    import scipy.linalg  # here, not at import (start-up)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scipy.linalg.LinAlgWarning)
        return scipy.linalg.solve(A, b, assume_a="pos")


def _structure(Vm: np.ndarray, Qm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two linear structures of p in the factors, per pair i = (j, k) of the feature order.

    p[a, (i, l)] = sum_h sum_k' P[h, a, i, k'] Q_h[k', l]  (P[h,a,i,k'] = V_h[a,j] d(k,k') + m V_h[a,k] d(j,k'))
                 = sum_h sum_j' R[h, i, l, j'] V_h[a, j']  (R[h,i,l,j'] = d(j,j') Q_h[k,l] + m d(k,j') Q_h[j,l])
    with m = 1 for j < k, 0 for j = k.
    """
    H, dd = Vm.shape
    d = int(round(np.sqrt(dd)))
    jp, kp = pair_index(d)
    V3 = Vm.reshape(H, d, d)
    Q3 = Qm.reshape(H, d, d)
    P = np.zeros((H, d, jp.size, d))
    R = np.zeros((H, jp.size, d, d))
    for i, (j, k) in enumerate(zip(jp, kp)):
        P[:, :, i, k] += V3[:, :, j]
        R[:, i, :, j] += Q3[:, k, :]
        if j != k:
            P[:, :, i, j] += V3[:, :, k]
            R[:, i, :, k] += Q3[:, j, :]
    return P, R


def _normal_parts(feats: GramSums, Vm: np.ndarray, Qm: np.ndarray, Rp: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Gauss-Newton blocks of the data term (1/N) sum_i ||p H_i - y_i||^2 and J^T applied to Rp.

    Returns H_VV, H_QQ, H_VQ (times 2/N) and (2/N) J_V^T vec(Rp), (2/N) J_Q^T vec(Rp) for Rp (d, psi);
    with Rp = p G - M^T these are the gradient. Parameter order: V (h, a, j), Q (h, k, l). The
    block structure (H_VV is block diagonal over outputs a) avoids forming J.
    """
    H, dd = Vm.shape
    d = int(round(np.sqrt(dd)))
    npair = d * (d + 1) // 2
    psi = npair * d
    c = 2.0 / feats.weight  # sum w (Features.weight): the mean loss
    G = feats.gram
    assert G is not None  # every feature (expanded)
    P, R = _structure(Vm, Qm)
    Rf = R.transpose(1, 2, 0, 3).reshape(psi, H * d)  # rows (i, l), cols (h, j')
    GR = (G @ Rf).reshape(npair, d, H, d)  # [i', l', h, j]
    B = (Rf.T @ GR.reshape(psi, H * d)).reshape(H, d, H, d)
    H_VV = np.einsum("hjgk,ab->hajgbk", B, np.eye(d)).reshape(H * dd, H * dd)
    # X[h,a,k, l,i',m] = sum_i P[h,a,i,k] G4[i,l,i',m], G4 = gram reshaped (npair, d, npair, d)
    X = P.transpose(0, 1, 3, 2).reshape(H * d * d, npair) @ G.reshape(npair, d * psi)
    X = X.reshape(H, d, d, d, npair, d)
    # H_QQ[h,k,l, g,n,m] = sum_{a,i'} X[h,a,k,l,i',m] P[g,a,i',n]
    XQ = X.transpose(0, 2, 3, 5, 1, 4).reshape(H * d * d * d, d * npair) @ P.transpose(1, 2, 0, 3).reshape(
        d * npair, H * d)
    H_QQ = XQ.reshape(H, d, d, d, H, d).transpose(0, 1, 2, 4, 5, 3).reshape(H * dd, H * dd)
    # H_VQ[h,a,j, g,n,m] = sum_i' GR[i',m,h,j] P[g,a,i',n]
    VQ = GR.transpose(2, 3, 1, 0).reshape(H * d * d, npair) @ P.transpose(2, 0, 1, 3).reshape(npair, H * d * d)
    H_VQ = VQ.reshape(H, d, d, H, d, d).transpose(0, 4, 1, 3, 5, 2).reshape(H * dd, H * dd)
    R4 = Rp.reshape(d, npair, d)
    gV = np.matmul(Rp.reshape(d, psi)[None], R.reshape(H, psi, d)).reshape(-1)
    gQ = (P.transpose(0, 3, 1, 2).reshape(H, d, d * npair) @ R4.reshape(d * npair, d)).reshape(-1)
    return c * H_VV, c * H_QQ, c * H_VQ, c * gV, c * gQ
