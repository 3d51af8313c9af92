"""The nuclear-norm fit: the convex relaxation of the factorised fit, by FISTA with singular-value thresholding."""

from __future__ import annotations

import numpy as np

from ...errors import InputError
from ...model.heads import p_from_W
from mhla_cli.statistics.features import Features
from mhla_cli.numerics import EPS
from ._numerics import _serial_blas
from ._solver import solver_info
from .affine import p_adjoint, svt
from .losses import _need_targets, mse, sse
from .result import LowRankFit


def _lipschitz(G: np.ndarray, d: int, iters: int = 40) -> float:
    """||W -> A^T (A(W) G)||_2 by power iteration, +5 %, capped by the bound 2 lambda_max(G)."""
    import scipy.linalg  # here, not at import: `import mhla_cli` and start-up stay without SciPy's LAPACK

    bound = 2.0 * float(scipy.linalg.eigh(G, eigvals_only=True, subset_by_index=[G.shape[0] - 1] * 2)[0])
    W = np.random.default_rng(0).standard_normal((d * d, d * d))
    est = 0.0
    for _ in range(iters):
        W2 = p_adjoint(p_from_W(W) @ G)
        n2 = float(np.linalg.norm(W2))
        if n2 == 0:
            return max(bound, 1e-300)
        est = n2 / float(np.linalg.norm(W))
        W = W2 / n2
    return max(min(1.05 * est, bound), 1e-300)


def nuclear_lambda_max(feats: Features) -> float:
    """The smallest LAMBDA for which W = 0 is optimal: ||grad at 0||_2 = (2/N) ||A^T M^T||_2."""
    feats.expand()  # every feature (a block on the data's spans is expanded)
    _need_targets(feats)
    assert feats.moments is not None  # has_targets
    G0 = (2.0 / feats.weight) * p_adjoint(feats.moments.T)
    return float(np.linalg.norm(G0, 2))


@_serial_blas
def fit_nuclear(feats: Features, lam: float, max_iter: int = 5000, tol: float = 1e-9,
                W0: np.ndarray | None = None) -> LowRankFit:
    """Minimise (1/N) sum_i ||p(W) H_i - y_i||^2 + lam ||W||_* by FISTA with singular-value thresholding.

    The gradient (2/N) A^T (p G - M^T) is Lipschitz with L = (2/N) ||A^T (. G) A|| <= 4 lambda_max(G) / N
    (||A||^2 = 2); L from a power iteration (+5 %, capped by the bound); step 1/L, momentum with the gradient-based adaptive restart (O'Donoghue & Candes 2015).
    Stops when ||W_{k+1} - W_k|| <= tol ||W_k||.
    """
    feats.expand()  # every feature (a block on the data's spans is expanded)
    _need_targets(feats)
    if lam < 0 or not np.isfinite(lam):
        raise InputError(f"the nuclear-norm weight must be a finite number >= 0, got {lam}")
    d = feats.d
    N = feats.weight  # sum w (Features.weight): the mean loss
    assert feats.gram is not None and feats.moments is not None  # expanded, has_targets
    G, Mt = feats.gram, feats.moments.T
    L = _lipschitz(G, d) * 2.0 / N
    W = np.zeros((d * d, d * d)) if W0 is None else np.array(W0, dtype=np.float64)
    Y = W.copy()
    t = 1.0
    converged = False
    it = 0
    res = float("inf")
    for it in range(1, max_iter + 1):
        p = p_from_W(Y)
        grad = (2.0 / N) * p_adjoint(p @ G - Mt)
        W_new, _ = svt(Y - grad / L, lam / L)
        t_new = 0.5 * (1 + np.sqrt(1 + 4 * t * t))
        step = W_new - W
        if float(np.sum((Y - W_new) * step)) > 0:  # momentum points uphill: restart
            t_new = 1.0
            Y = W_new.copy()
        else:
            Y = W_new + ((t - 1) / t_new) * step
        nstep = float(np.linalg.norm(step))
        W, t = W_new, t_new
        res = nstep / max(float(np.linalg.norm(W)), 1e-300)
        if res <= tol:
            converged = True
            break
    coef = p_from_W(W)
    s = np.linalg.svd(W, compute_uv=False)
    obj = sse(feats, coef) / N + lam * float(s.sum())
    info = {"method": "nuclear", "nuclear_lambda": float(lam), "objective": obj, "train_mse": mse(feats, coef),
            "iterations": it, "converged": converged, "final_residual": res,
            "solver": solver_info("FISTA (nuclear-norm fit)", converged, it, max_iter, res,
                                  "||W_k+1 - W_k|| / ||W_k+1|| (last proximal-gradient step)", tol),
            "rank": int((s > d * d * EPS * max(s[0], 0)).sum()), "singular_values": s.tolist()}
    return LowRankFit(coef=coef, W=W, info=info)
