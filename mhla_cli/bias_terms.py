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

Heads exported from a model are written **centred** (`CENTRE_ARRAY` token_centre, c (d,): the mean token of the
training data): V, Q and the bias terms are those of the tokens x - c, so that tokens far from the origin (a
shift of 1e6) lose no accuracy to the cancellation of the uncentred terms (score_bias ~ |c|^2 |Q| otherwise).
`centring(c)` is the map (x, 1) -> (x - c, 1); the uncentred heads of (x, 1) are V~ T^T, T Q~ T^T.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BIAS_ARRAYS", "CENTRE_ARRAY", "augmented_heads", "centred_basis", "centring", "feature_names",
           "pad_targets", "split_heads", "token_mean", "with_constant"]

# The arrays of the bias terms of H heads, beside V (H, d_out, d) and Q (H, d, d), and their shapes.
BIAS_ARRAYS = ("value_bias", "score_key", "score_query", "score_bias")
# The optional centre c (d,) of heads with the bias terms: they are the heads of the tokens x - c.
CENTRE_ARRAY = "token_centre"


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


def centring(c: np.ndarray, P: np.ndarray | None = None) -> np.ndarray:
    """T with (x, 1) T = (x P - c, 1) (P None: the identity): the tokens of heads centred at c (d,) (of factored
    heads: in their reduced coordinates). (D + 1, d + 1)."""
    c = np.asarray(c, dtype=np.float64)
    d = c.size
    D = d if P is None else P.shape[0]
    T = np.zeros((D + 1, d + 1))
    T[:D, :d] = np.eye(d) if P is None else P
    T[D, :d], T[D, d] = -c, 1.0
    return T


def token_mean(A: np.ndarray) -> np.ndarray:
    """The training tokens' weighted mean (d,) from A (d + 1, d + 1), the whitening of the tokens (x, 1) (A^T G A = I
    with G = E[(x, 1) (x, 1)^T]: G = A^-T A^-1, mean = G[:d, d] / G[d, d])."""
    B = np.linalg.inv(np.asarray(A, dtype=np.float64))
    G = B.T @ B
    return G[:-1, -1] / G[-1, -1]


def centred_basis(A: np.ndarray, c: np.ndarray) -> np.ndarray:
    """A_c = [[I, 0], [c, 1]] A: the whitened tokens Z = (x, 1) A = (x - c, 1) A_c, so that heads (V', Q') of
    the centred tokens are the heads V' A_c^-T, A_c^-1 Q' A_c^-T of Z (no term of the size of c)."""
    A = np.asarray(A, dtype=np.float64)
    out = np.array(A)
    out[-1] = np.asarray(c, dtype=np.float64) @ A[:-1] + A[-1]
    return out
