"""The statistics of the whitened tokens X A, in which the low-rank fits run (mhla_cli.model.canonical).

A factorised or nuclear-norm fit on the tokens' own Gram inherits its conditioning, cond(T)^6 for
tokens X T in other units (rotated units of condition 1e3: a numerically singular Gauss-Newton system).
On the whitened tokens Z = X A the features are H(Z) = D^-1 Ht(X A), so their sums are the canonical
ones rescaled by D^-1: no change of basis, no rounding beyond the canonical sums'. A head (V^c, Q^c) of
Z is the head (V^c A^T, A Q^c A^T) of X; the fit's W there is kept as the model's `W_b`.
"""

from __future__ import annotations

import numpy as np

from ...model.canonical import map_W
from ...model.heads import W_from_p, p_from_W
from ...statistics.basis import coef_from_basis, feature_scale
from ...statistics.features import Features


def whitened(feats: Features, A: np.ndarray) -> Features:
    """The statistics of the tokens X A as own statistics (basis I), from those of X held in basis A (every
    feature: not a block on the data's spans). `feats` is not changed."""
    feats.expand()
    feats.to_basis(A)
    inv = 1.0 / feature_scale(feats.d)
    gram_b, moments_b = feats.basis_gram, feats.basis_moments
    assert gram_b is not None  # to_basis
    return feats.with_sums(gram=gram_b * inv[:, None] * inv[None, :], token_gram=np.array(feats.basis_token_gram),
                           last_token_gram=np.array(feats.basis_last_token_gram),
                           moments=None if moments_b is None else moments_b * inv[:, None],
                           target_gram=None if feats.target_gram is None else np.array(feats.target_gram),
                           basis=np.eye(feats.d), basis_gram=np.array(gram_b),
                           basis_moments=None if moments_b is None else np.array(moments_b),
                           basis_token_gram=np.array(feats.basis_token_gram),
                           basis_last_token_gram=np.array(feats.basis_last_token_gram),
                           target_sum=None if feats.target_sum is None else np.array(feats.target_sum))


def to_tokens(coef_c: np.ndarray, W_c: np.ndarray, A: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(coef, W, p_b) on the tokens X of a fit's coef and W on X A: p_b = c / D, coef = p_b M_A and the W of
    the heads V A^T, A Q A^T, made consistent with coef to rounding (its p equals coef, as a model file
    requires)."""
    coef_b = coef_c / feature_scale(A.shape[0])[None, :]
    coef = coef_from_basis(A, coef_b)
    W = map_W(W_c, A, inverse=True)
    return coef, W + W_from_p(coef - p_from_W(W)), coef_b
