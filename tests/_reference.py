"""Independent references in plain numpy on materialised features (never mhla_cli's own kernels).

The canonical certificate (docs/formats.md, "The canonical certificate"): tokens whitened with
G = sum_i w_i S_i / sum_i w_i n_i (S the sample's unnormalised X^T X, n_i its token count; for
per-position data every prefix is a sample, or for bidirectional data every position with the whole
window's S), features of the whitened tokens in orthonormal
coordinates (sqrt 2 on S[j,k], j < k), Lambda~ = sum_i w_i Ht_i Ht_i^T / sum_i w_i.
"""

from __future__ import annotations

import numpy as np


def features(X: np.ndarray, normalize: str = "none") -> np.ndarray:
    """H(X): S[j,k] x_n[l] for j <= k, l fastest (S / n with normalize="length")."""
    X = np.asarray(X, dtype=np.float64)
    d = X.shape[1]
    S = X.T @ X / (X.shape[0] if normalize == "length" else 1.0)
    return np.array([S[j, k] * X[-1, l] for j in range(d) for k in range(j, d) for l in range(d)])


def canonical_features(X: np.ndarray, normalize: str = "none") -> np.ndarray:
    """Ht(X): S[j,j] and sqrt(2) S[j,k] (j < k), times x_n[l] (orthonormal coordinates)."""
    X = np.asarray(X, dtype=np.float64)
    d = X.shape[1]
    S = X.T @ X / (X.shape[0] if normalize == "length" else 1.0)
    return np.array([S[j, k] * (1.0 if j == k else np.sqrt(2.0)) * X[-1, l]
                     for j in range(d) for k in range(j, d) for l in range(d)])


def samples(tokens: np.ndarray, offsets: np.ndarray, per_position: bool = False,
            weights: np.ndarray | None = None, attention: str = "causal", width: int | None = None
            ) -> list[tuple[np.ndarray, float, int]]:
    """Every sample as (its tokens X, its weight, its row in the targets). The features of a sample read
    S = X^T X and the query X[-1]: a causal sample is the prefix X[:t]; a bidirectional one is the whole
    window with position t moved last (S is a sum over the rows, so it is the window's); with `width` (any
    other attention: a sliding window, tests/test_toy_layout.py) the tokens X[t-width+1..t] of its window."""
    out = []
    row = 0
    for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        if per_position and width is not None:
            for t in range(a, b):
                out.append((tokens[max(a, t - width + 1):t + 1], 1.0 if weights is None else float(weights[t]), t))
        elif per_position and attention == "bidirectional":
            for t in range(a, b):
                X = np.concatenate([tokens[a:t], tokens[t + 1:b], tokens[t:t + 1]])
                out.append((X, 1.0 if weights is None else float(weights[t]), t))
        elif per_position:
            for t in range(a, b):
                out.append((tokens[a:t + 1], 1.0 if weights is None else float(weights[t]), t))
        else:
            out.append((tokens[a:b], 1.0 if weights is None else float(weights[i]), i))
        row += 1
    return out


def inv_sqrt(G: np.ndarray) -> np.ndarray:
    """The symmetric inverse square root of an SPD matrix (numpy's eigh)."""
    w, V = np.linalg.eigh(0.5 * (G + G.T))
    return (V / np.sqrt(w)) @ V.T


def canonical(tokens: np.ndarray, offsets: np.ndarray, targets: np.ndarray | None = None,
              per_position: bool = False, weights: np.ndarray | None = None,
              normalize: str = "none", A: np.ndarray | None = None, attention: str = "causal",
              width: int | None = None) -> dict[str, np.ndarray]:
    """Lambda~, its eigenvalues, the canonical moments and the whitening A, materialised.

    `A` replaces the whitening where G is singular (tokens in a subspace), where the canonical basis
    is a convention (mhla keeps the unexcited directions at the scale of the largest one).
    """
    tokens = np.asarray(tokens, dtype=np.float64)
    smp = samples(tokens, offsets, per_position, weights, attention, width)
    if A is None:
        G = sum(w * X.T @ X for X, w, _ in smp) / sum(w * X.shape[0] for X, w, _ in smp)
        A = inv_sqrt(G)
    rows = [(canonical_features(X @ A, normalize), w, r) for X, w, r in smp if w > 0]
    Ht = np.stack([h for h, _, _ in rows])
    w = np.array([w for _, w, _ in rows])
    N = len(rows)
    W = float(w.sum())  # sum w: the weights carry no units
    lam = (Ht * w[:, None]).T @ Ht / W
    out = {"lambda": lam, "eigenvalues": np.linalg.eigvalsh(lam), "A": A, "Ht": Ht, "w": w, "N": N, "W": W}
    if targets is not None:
        y = np.asarray(targets, dtype=np.float64)[[r for _, _, r in rows]]
        out["moments"] = (Ht * w[:, None]).T @ y / W
        out["y"] = y
    return out


def min_norm_function(ref: dict[str, np.ndarray], rcond: float = 1e-10) -> np.ndarray:
    """The minimum-norm least-squares p_b on the canonical features (numpy's lstsq, weighted)."""
    sw = np.sqrt(ref["w"])[:, None]
    return np.linalg.lstsq(ref["Ht"] * sw, ref["y"] * sw, rcond=rcond)[0].T


def predict_canonical(pb: np.ndarray, A: np.ndarray, Zs: list[np.ndarray], normalize: str = "none") -> np.ndarray:
    """Outputs of the canonical coefficients p_b on inputs Z (in the tokens' own coordinates)."""
    return np.stack([pb @ canonical_features(Z @ A, normalize) for Z in Zs])


def predict_own(p: np.ndarray, Zs: list[np.ndarray], normalize: str = "none") -> np.ndarray:
    """Outputs of coefficients p on the own features H(Z)."""
    return np.stack([p @ features(Z, normalize) for Z in Zs])


def ratio(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| (max norm), the scaled error that tests compare with a tolerance."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def ridge_function(ref: dict[str, np.ndarray], lam: float) -> np.ndarray:
    """p_b solving (Lambda~ + lam I) p_b^T = m~ on the materialised canonical features."""
    return np.linalg.solve(ref["lambda"] + lam * np.eye(ref["lambda"].shape[0]), ref["moments"]).T


def teacher_p(teacher) -> np.ndarray:
    """The teacher's p from its heads: p[a,(j,k,l)] = W[aj,kl] + W[ak,jl] (j<k), W = sum_h V_h (x) Q_h."""
    V, Q = teacher.V, teacher.Q
    d = V.shape[1]
    W = np.einsum("haj,hkl->ajkl", V, Q)
    return np.array([[W[a, j, k, l] + (W[a, k, j, l] if j < k else 0.0)
                      for j in range(d) for k in range(j, d) for l in range(d)] for a in range(d)])


def observed_eigenvalues(tokens: np.ndarray, offsets: np.ndarray, A: np.ndarray, per_position: bool = False,
                         weights: np.ndarray | None = None, rel_tol: float = 1e-9,
                         normalize: str = "none", attention: str = "causal") -> tuple[np.ndarray, int, int]:
    """The observed-domain spectrum (docs/formats.md, "The observed domain"), materialised: orthonormal
    bases B, C of the whitened spans of all tokens and of the last tokens (singular values above rel_tol
    of the largest), the features upper(B^T S_A B) (sqrt 2 off the diagonal) (x) C^T A^T x_n of every
    sample of weight > 0 (S / n with normalize="length"), and the eigenvalues of sum w Ht' Ht'^T / sum w;
    with dim U and dim U_n."""
    tokens = np.asarray(tokens, dtype=np.float64)
    smp = [(X @ A, w) for X, w, _ in samples(tokens, offsets, per_position, weights, attention) if w > 0]

    def span(M: np.ndarray) -> np.ndarray:
        _, s, vt = np.linalg.svd(M, full_matrices=False)
        return vt[s > rel_tol * s[0]].T

    B = span(np.concatenate([X for X, _ in smp]))
    C = span(np.stack([X[-1] for X, _ in smp]))
    r = B.shape[1]
    rows = []
    for X, _ in smp:
        S = B.T @ (X.T @ X) @ B / (X.shape[0] if normalize == "length" else 1.0)
        upper = [S[j, k] * (1.0 if j == k else np.sqrt(2.0)) for j in range(r) for k in range(j, r)]
        rows.append(np.kron(upper, X[-1] @ C))
    H = np.array(rows)
    w = np.array([w for _, w in smp])
    return np.linalg.eigvalsh((H * w[:, None]).T @ H / w.sum()), r, C.shape[1]  # weights without units


def ridge_cv_path(X: np.ndarray, off: np.ndarray, Y: np.ndarray, K: int, grid: np.ndarray) -> np.ndarray:
    """Held-out MSE (grid, K) of K-fold CV of the ridge (contiguous folds, as `featurize --folds K`): the
    spectral ridge fit on each fold's training samples in their own canonical coordinates (eigenvalues
    at or below psi eps lambda_max dropped: r = 0 is the minimum-norm fit), scored on the held-out
    samples' materialised features. Unweighted last-token data."""
    eps = np.finfo(np.float64).eps
    N, d = Y.shape
    cuts = np.linspace(0, N, K + 1).astype(int)
    seqs = [np.asarray(X[off[i]:off[i + 1]], dtype=np.float64) for i in range(N)]
    out = np.empty((grid.size, K))
    for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        tr = [i for i in range(N) if not a <= i < b]
        G = sum(seqs[i].T @ seqs[i] for i in tr) / sum(seqs[i].shape[0] for i in tr)
        A = inv_sqrt(G)
        Ht = np.stack([canonical_features(seqs[i] @ A) for i in tr])
        lam = Ht.T @ Ht / len(tr)
        m = Ht.T @ Y[tr] / len(tr)
        w, V = np.linalg.eigh(lam)
        keep = w > lam.shape[0] * eps * w[-1]
        w, V = w[keep], V[:, keep]
        Hv = np.stack([canonical_features(seqs[i] @ A) for i in range(a, b)])
        for g, r in enumerate(grid):
            pb = (V @ ((V.T @ m) / (w + r)[:, None])).T
            out[g, k] = ((Hv @ pb.T - Y[a:b]) ** 2).sum() / ((b - a) * d)
    return out


def expanded_features(X: np.ndarray, normalize: str = "none") -> tuple[np.ndarray, list[str]]:
    """The features of a head with biases for the sample X (its query last), block by block as the expansion of
    sum_i (V x_i + b_v)((K x_i + b_k)^T (Q x_t + b_q)) gives them (docs/bias_terms.md, "The terms a
    head's biases add"): S (x) x_t (j <= k, l), S (j <= k), m (x) x_t, m, n x_t, n with m = sum_i x_i; S, m and n divided by n
    with normalize="length". Returns the values and their names."""
    X = np.asarray(X, dtype=np.float64)
    n, d = X.shape
    c = float(n) if normalize == "length" else 1.0
    S, m, nn, x = X.T @ X / c, X.sum(axis=0) / c, n / c, X[-1]
    vals, names = [], []
    for j in range(d):
        for k in range(j, d):
            for l in range(d):
                vals.append(S[j, k] * x[l])
                names.append(f"S[{j},{k}]*x_t[{l}]")
    for j in range(d):
        for k in range(j, d):
            vals.append(S[j, k])
            names.append(f"S[{j},{k}]")
    for j in range(d):
        for l in range(d):
            vals.append(m[j] * x[l])
            names.append(f"m[{j}]*x_t[{l}]")
    for j in range(d):
        vals.append(m[j])
        names.append(f"m[{j}]")
    for l in range(d):
        vals.append(nn * x[l])
        names.append(f"n*x_t[{l}]")
    vals.append(nn)
    names.append("n")
    return np.array(vals), names


def biased_heads_output(V: np.ndarray, Q: np.ndarray, value_bias: np.ndarray, score_key: np.ndarray,
                        score_query: np.ndarray, score_bias: np.ndarray, X: np.ndarray, t: int,
                        normalize: str = "none") -> np.ndarray:
    """sum_h sum_i (V_h x_i + value_bias_h) (x_i^T Q_h x_t + score_key_h . x_i + score_query_h . x_t + score_bias_h),
    / n with normalize="length", by loops over the tokens i of X (the whole window) for the query X[t]."""
    X = np.asarray(X, dtype=np.float64)
    out = np.zeros(V.shape[1])
    for h in range(V.shape[0]):
        for xi in X:
            score = xi @ Q[h] @ X[t] + score_key[h] @ xi + score_query[h] @ X[t] + score_bias[h]
            out += (V[h] @ xi + value_bias[h]) * score
    return out / (X.shape[0] if normalize == "length" else 1.0)


def affine_ridge_cv_path(X: np.ndarray, off: np.ndarray, Y: np.ndarray, Xw: np.ndarray, K: int,
                         grid: np.ndarray) -> np.ndarray:
    """ridge_cv_path of the extended features [Ht, f~] of last-token samples: Ht the training fold's canonical
    features, f = (x_wide, 1) of the query whitened by the training fold's second moment of f on its range
    (eigenvalues at or below 1e-9 of the largest dropped: the wide tokens' hyperplanes)."""
    eps = np.finfo(np.float64).eps
    N, d = Y.shape
    cuts = np.linspace(0, N, K + 1).astype(int)
    seqs = [np.asarray(X[off[i]:off[i + 1]], dtype=np.float64) for i in range(N)]
    F = np.hstack([Xw[np.asarray(off[1:]) - 1], np.ones((N, 1))])
    out = np.empty((grid.size, K))
    for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        tr = [i for i in range(N) if not a <= i < b]
        A = inv_sqrt(sum(seqs[i].T @ seqs[i] for i in tr) / sum(seqs[i].shape[0] for i in tr))
        ev, U = np.linalg.eigh(F[tr].T @ F[tr] / len(tr))
        keep = ev > 1e-9 * ev[-1]
        Af = U[:, keep] / np.sqrt(ev[keep])
        Z = np.hstack([np.stack([canonical_features(seqs[i] @ A) for i in tr]), F[tr] @ Af])
        lam, m = Z.T @ Z / len(tr), Z.T @ Y[tr] / len(tr)
        w, V = np.linalg.eigh(lam)
        keep = w > lam.shape[0] * eps * w[-1]
        w, V = w[keep], V[:, keep]
        Zv = np.hstack([np.stack([canonical_features(seqs[i] @ A) for i in range(a, b)]), F[a:b] @ Af])
        for g, r in enumerate(grid):
            pb = V @ ((V.T @ m) / (w + r)[:, None])
            out[g, k] = ((Zv @ pb - Y[a:b]) ** 2).sum() / ((b - a) * d)
    return out
