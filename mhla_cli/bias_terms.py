"""The terms a head's biases add: the MHLA of the tokens (x, 1) (docs/bias_terms.md).

A head with biases computes sum_i (V x_i + b_v) ((K x_i + b_k)^T (Q x_t + b_q)). With the constant
coordinate appended, x~ = (x, 1), that is an MHLA of the tokens x~ with V~ = [V b_v], K~ = [K b_k],
Q~ = [Q b_q]: its S~ = sum_i x~_i x~_i^T holds S, m = sum_i x_i and n, and its features upper(S~) (x) x~_t
are S (x) x_t (the MHLA) and the lower-degree S, m (x) x_t, m, n x_t, n (divided by n with
normalize="length"). So the bias terms are the MHLA of d + 1 wide tokens: featurize reads every token as
(x, 1) and every target as (y, 0) (io.tokens.with_bias_terms; the padded output's coefficients are exactly
0), and everything else (the canonical certificate, the fit, the heads) is the MHLA's. This module holds
the few things that know the constant is there: the in-memory padding, the names of the features, and the
split of the heads of d + 1 wide tokens into the heads of the tokens and their bias terms.

A head of the tokens (x, 1), V~ (d_out, d + 1) and Q~ (d + 1, d + 1), is written as V = V~[:, :d],
Q = Q~[:d, :d] and the bias terms (`BIAS_ARRAYS`):

    value_bias  = V~[:, d]     (d_out,)  the value's bias b_v
    score_key   = Q~[:d, d]    (d,)      the score's term linear in the attended token x_i (K^T b_q)
    score_query = Q~[d, :d]    (d,)      the score's term linear in the query x_t (Q^T b_k)
    score_bias  = Q~[d, d]     ()        the score's constant (b_k . b_q)

so that the head's output at t is sum_i (V x_i + value_bias) (x_i^T Q x_t + score_key . x_i +
score_query . x_t + score_bias), the sum over i divided by n with normalize="length".
"""

from __future__ import annotations

import numpy as np

__all__ = ["BIAS_ARRAYS", "augmented_heads", "feature_names", "pad_targets", "split_heads", "with_constant"]

# The arrays of the bias terms of H heads, beside V (H, d_out, d) and Q (H, d, d), and their shapes.
BIAS_ARRAYS = ("value_bias", "score_key", "score_query", "score_bias")


def with_constant(tokens: np.ndarray) -> np.ndarray:
    """Tokens (..., d) -> (..., d + 1) with the constant coordinate 1 appended (float64 for float inputs)."""
    tokens = np.asarray(tokens)
    ones = np.ones((*tokens.shape[:-1], 1), dtype=tokens.dtype)
    return np.concatenate([tokens, ones], axis=-1)


def pad_targets(targets: np.ndarray | None) -> np.ndarray | None:
    """Targets (..., e) -> (..., e + 1) with a 0 appended (the padded output of the statistics), or None."""
    if targets is None:
        return None
    targets = np.asarray(targets, dtype=np.float64)
    return np.concatenate([targets, np.zeros((*targets.shape[:-1], 1))], axis=-1)


def token_name(i: int, d: int) -> str:
    """The name of coordinate i of the tokens (x, 1) of width d + 1 (d: the tokens' own width)."""
    return "1" if i == d else f"x[{i}]"


def feature_names(d: int) -> list[str]:
    """The names of the features upper(S~) (x) x~_t of the tokens x~ = (x, 1), d the tokens' own width:
    S[j,k]*x_t[l] (the MHLA), S[j,k] (S), m[j]*x_t[l], m[j] (m = sum_i x_i), n*x_t[l] and n, in the
    feature order of d + 1 wide tokens (j <= k, l fastest)."""
    names = []
    D = d + 1
    for j in range(D):
        for k in range(j, D):
            pair = "n" if j == d else f"m[{j}]" if k == d else f"S[{j},{k}]"
            for l in range(D):
                names.append(pair if l == d else f"{pair}*x_t[{l}]")
    return names


def split_heads(V: np.ndarray, Q: np.ndarray) -> dict[str, np.ndarray]:
    """Heads of the tokens (x, 1), V~ (H, d_out, d + 1) and Q~ (H, d + 1, d + 1), as the heads of the tokens
    and their bias terms: {"V": (H, d_out, d), "Q": (H, d, d), and `BIAS_ARRAYS`} (module docstring)."""
    V, Q = np.asarray(V, dtype=np.float64), np.asarray(Q, dtype=np.float64)
    d = Q.shape[1] - 1
    return {"V": np.ascontiguousarray(V[:, :, :d]), "Q": np.ascontiguousarray(Q[:, :d, :d]),
            "value_bias": np.ascontiguousarray(V[:, :, d]), "score_key": np.ascontiguousarray(Q[:, :d, d]),
            "score_query": np.ascontiguousarray(Q[:, d, :d]), "score_bias": np.ascontiguousarray(Q[:, d, d])}


def augmented_heads(V: np.ndarray, Q: np.ndarray, value_bias: np.ndarray, score_key: np.ndarray,
                    score_query: np.ndarray, score_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(V~ (H, d_out, d + 1), Q~ (H, d + 1, d + 1)): the heads of the tokens (x, 1) of heads with bias terms
    (the inverse of `split_heads`)."""
    H, d_out, d = V.shape
    Vt = np.empty((H, d_out, d + 1))
    Vt[:, :, :d], Vt[:, :, d] = V, value_bias
    Qt = np.empty((H, d + 1, d + 1))
    Qt[:, :d, :d], Qt[:, :d, d], Qt[:, d, :d], Qt[:, d, d] = Q, score_key, score_query, score_bias
    return Vt, Qt
