"""A function in the canonical coordinates of its training data: heads solved there, changes measured on the data.

Coefficients in the tokens' own coordinates mix units (a coordinate in 0.01 and one in 100 differ by
1e6 in the cubic features), so a singular value of W or a norm ||p_kept - p|| / ||p|| there says
little about the function. A model from `mhla fit` keeps its canonical basis A (the tokens X A are
whitened), its coefficients p_b on the orthonormal features Ht(X A) and the Lambda~ of its training
data there (`canonical_gram_pairs`, docs/formats.md). With those:

- c = p_b D is the function as an MHLA of the whitened tokens Z = X A (coefficients on H(Z)). The
  head export, the spectrum and --fewest work on c and its W (d^2, d^2): for tokens X T in other
  units the whitened tokens are Z M with M orthogonal, which moves W by an orthogonal map, so the
  singular values, the head counts and the nuclear norm do not depend on T.
- A head (V^c, Q^c) of Z is the head (V^c A^T, A Q^c A^T) of X (`CanonicalFunction.heads`).
- The function change of c' against c is ||p_b' - p_b||_L / ||p_b||_L with
  ||x||_L^2 = sum_a x_a Lambda~ x_a^T = sum_i w_i ||x Ht_i||^2 / sum_i w_i: the RMS difference of the
  two functions' outputs over the training inputs, relative to the RMS output (weighted as the fit).
  It does not depend on the coordinates in which it is computed.

Without Lambda~ (a model file written before it, heads, a bare coef) the change is the coefficient
change ||p_b' - p_b||_F / ||p_b||_F in the coordinates at hand: "canonical" when the model keeps its
basis (unit-free, but a norm of coefficients, not of outputs), "own" otherwise (depends on the units).
Both are reported under that name (`coef_change`), never as a function change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..bias_terms import centred_basis
from ..errors import InputError, Refused
from ..linalg import symgram
from ..numerics import LAMBDA_FLOOR_FRACTION, numerical_tolerance
from ..statistics.basis import feature_scale, kron_apply, orth_pair_map, transition
from .heads import Heads, W_from_heads, W_from_p, coef_of_heads, d_of_coef, heads_from_W, p_from_heads

__all__ = ["CanonicalFunction", "DataGram", "canonical_function", "coef_in_basis", "data_gram", "gram_pairs_of",
           "heads_in_basis", "map_W", "truncated_heads"]


# A Lambda~ (block) of at most this many features is expanded once and kept (36 MiB at d = 16); a wider one
# is read from its distinct entries a block of rows at a time for each quadratic form.
EXPAND_FEATURES = 2176


@dataclass
class DataGram:
    """Lambda~ of a model's training data on the canonical features Ht(X A), held as its distinct entries K
    (symgram: Lambda~[(a,l),(b,m)] = K[(a<=b), (l<=m)]), expanded when first used.

    With `span_pairs` E (q, a) and `span_last` F (d, b) (a fit on the data's spans, statistics.structure)
    K is that of the block E^T (x) F^T Lambda~ E (x) F: Lambda~ is zero outside it, so a quadratic form
    needs only the projection of the coefficients onto it (no psi x psi array)."""

    pairs: np.ndarray
    d: int
    lambda_min: float | None = None  # the fit's (a hint for `floor`; None: computed)
    span_pairs: np.ndarray | None = None
    span_last: np.ndarray | None = None
    _block: np.ndarray | None = field(default=None, repr=False)

    @property
    def widths(self) -> tuple[int, int]:
        """(a, b): the widths of the pair and token factors of the block (q, d without spans)."""
        if self.span_pairs is None or self.span_last is None:
            return self.d * (self.d + 1) // 2, self.d
        return int(self.span_pairs.shape[1]), int(self.span_last.shape[1])

    @property
    def block(self) -> np.ndarray:
        """Lambda~ on the block (psi x psi without spans)."""
        if self._block is None:
            self._block = symgram.gram_from_pairs(self.pairs, *self.widths)
        return self._block

    @property
    def full(self) -> bool:
        """Whether the block is every feature (no spans, or spans of full width)."""
        return self.widths == (self.d * (self.d + 1) // 2, self.d)

    def project(self, x_b: np.ndarray) -> np.ndarray:
        """Coefficients x_b (m, psi) on Ht as coefficients on the block's features (m, a b)."""
        x_b = np.asarray(x_b, dtype=np.float64)
        if self.span_pairs is None or self.span_last is None:
            return x_b
        return kron_apply(self.span_pairs.T, self.span_last.T, np.ascontiguousarray(x_b.T)).T

    @property
    def matrix(self) -> np.ndarray:
        """Lambda~ (psi, psi) on every feature (expanded from the block when the model has spans)."""
        if self.span_pairs is None or self.span_last is None:
            return self.block
        E, F = self.span_pairs, self.span_last
        half = kron_apply(E, F, self.block)  # (psi, ab)
        return kron_apply(E, F, np.ascontiguousarray(half.T))

    def sq(self, x_b: np.ndarray) -> float:
        """sum_a x_a Lambda~ x_a^T for coefficients x_b (m, psi) on Ht: the mean squared output of x over
        the training inputs times m (>= 0; rounding below 0 is cut). A block wider than EXPAND_FEATURES is
        read from K a block of rows at a time (memory flat in psi^2)."""
        y = self.project(x_b)
        a, b = self.widths
        if self._block is not None or a * b <= EXPAND_FEATURES:
            return max(float(np.sum((y @ self.block) * y)), 0.0)
        total = 0.0
        for r0, rows in symgram.gram_rows(self.pairs, a, b, rows=max(1, (64 << 20) // (8 * a * b))):
            total += float(np.sum(y[:, r0:r0 + rows.shape[0]] * (y @ rows.T)))
        return max(total, 0.0)

    def floor(self) -> float:
        """A proven t <= lambda_min(Lambda~) (0 when none above the rank cut is proven, and for a block
        narrower than every feature: Lambda~ is singular there): t = LAMBDA_FLOOR_FRACTION times the computed
        lambda_min, proven by a Cholesky of Lambda~ - t I."""
        import scipy.linalg  # here, not at import (start-up)

        if not self.full:
            return 0.0
        lam = self.block
        psi = lam.shape[0]
        top = float(scipy.linalg.eigh(lam, eigvals_only=True, subset_by_index=[psi - 1, psi - 1])[0])
        low = self.lambda_min
        if low is None or not np.isfinite(low):
            low = float(scipy.linalg.eigh(lam, eigvals_only=True, subset_by_index=[0, 0])[0])
        t = LAMBDA_FLOOR_FRACTION * low
        if not t > numerical_tolerance(top, psi):
            return 0.0
        try:
            scipy.linalg.cholesky(lam - t * np.eye(psi), lower=True, check_finite=False)
        except np.linalg.LinAlgError:
            return 0.0
        return t


def gram_pairs_of(feats: Any) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(K, E, F): the distinct entries of Lambda~ = basis_gram / sum w of statistics in their canonical basis
    (after `solver_stats`), and the spans E, F of the block K is held on (None: every feature)."""
    d = feats.d
    q = d * (d + 1) // 2
    w = feats.weight if feats.weight > 0 else 1.0
    E = F = None
    if feats.on_spans:
        E, F = np.array(feats.span_pairs), np.array(feats.span_last)
        q, d = E.shape[1], F.shape[1]
    K = feats.gram_storage.pairs(q, d)  # as held, or from the array (mhla_cli.statistics.storage.gram_storage)
    return np.asarray(K, dtype=np.float64) / w, E, F


def _pow2(x: float) -> float:
    """The power of 2 nearest to x > 0 (1 for 0 or non-finite x): scaling by it is exact."""
    if not (x > 0 and np.isfinite(x)):
        return 1.0
    return math.ldexp(1.0, round(math.log2(x)))


def _norm(x: np.ndarray) -> float:
    """||x||_F without overflow or underflow of the squares."""
    m = float(np.max(np.abs(x))) if x.size else 0.0
    if m == 0.0 or not np.isfinite(m):
        return m
    return m * float(np.linalg.norm(x / m))


def map_W(W: np.ndarray, A: np.ndarray, inverse: bool = False) -> np.ndarray:
    """W (d_out d, d^2) of the tokens X -> of the whitened tokens X A (heads V A^-T, A^-1 Q A^-T), or back
    with `inverse` (V A^T, A Q A^T): W' = kron(I, B) W kron(B, B)^T with B = A^-1 (A^T with `inverse`)."""
    d = A.shape[0]
    B = np.asarray(A, dtype=np.float64).T if inverse else np.linalg.inv(A)
    d_out = W.shape[0] // d
    W4 = np.asarray(W, dtype=np.float64).reshape(d_out, d, d, d)  # [a, j, k, l]
    return np.einsum("ajkl,Jj,Kk,Ll->aJKL", W4, B, B, B, optimize=True).reshape(d_out * d, d * d)


def heads_in_basis(V: np.ndarray, Q: np.ndarray, A: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Heads (V (H, d_out, d), Q (H, d, d)) of the tokens X as heads of the whitened tokens X A:
    V A^-T and A^-1 Q A^-T (solves with A, no inverse formed)."""
    A = np.asarray(A, dtype=np.float64)
    Vc = np.linalg.solve(A, np.swapaxes(np.asarray(V, dtype=np.float64), 1, 2))  # A^-1 V_h^T
    Qc = np.linalg.solve(A, np.asarray(Q, dtype=np.float64))  # A^-1 Q_h
    Qc = np.swapaxes(np.linalg.solve(A, np.swapaxes(Qc, 1, 2)), 1, 2)  # (A^-1 (A^-1 Q_h)^T)^T
    return np.swapaxes(Vc, 1, 2), Qc


def coef_in_basis(fn: Any, A: np.ndarray) -> np.ndarray:
    """The coefficients p_b (d_out, psi) on Ht(X A) of a model (its canonical coefficients, changed from its
    own canonical basis when that is another), of square heads (mapped into X A first) or of a coef p."""
    from .model import Model

    A = np.asarray(A, dtype=np.float64)
    d = A.shape[0]
    D = feature_scale(d)
    if isinstance(fn, Model) and fn.coef_b is not None and fn.basis is not None:
        if np.array_equal(fn.basis, A):
            return np.array(fn.coef_b)
        # X A = (X A2) C, so Ht(X A2) = O_C^-1 Ht(X A) and p_b = p_b2 O_C^-1, O_C^-1 = kron(D P_Ci D^-1, Ci^T)
        Ci = np.linalg.inv(transition(fn.basis, A))
        return kron_apply(orth_pair_map(Ci).T, Ci, np.ascontiguousarray(fn.coef_b.T)).T
    if isinstance(fn, Heads):
        if fn.factored:
            raise Refused(_no_coef(fn) + " on d x d features", unreduced={})
        if fn.bias_terms:  # the heads of the tokens (x, 1) (centred: of (x - c, 1), Z = (x - c, 1) A_c)
            if A.shape[0] != fn.d + 1:
                raise Refused(f"heads with the bias terms take the tokens (x, 1) of width {fn.d + 1}, not "
                              f"{A.shape[0]}: compare them with a model fitted with {{bias_terms}}", bias_terms={})
            Ac = A if fn.token_centre is None else centred_basis(A, fn.token_centre)
            Vc, Qc = heads_in_basis(*fn.augmented_centred(), Ac)
            p = coef_of_heads(Vc, Qc) / D
            return np.vstack([p, np.zeros((1, p.shape[1]))])  # the padded output, exactly 0
        Vc, Qc = heads_in_basis(fn.V, fn.Q, A)
        return coef_of_heads(Vc, Qc) / D
    from ..statistics.basis import coef_to_basis

    coef = fn.coef if isinstance(fn, Model) else np.asarray(fn, dtype=np.float64)
    return coef_to_basis(A, coef)


@dataclass
class CanonicalFunction:
    """A function as an MHLA of the tokens Z = X A: `coef` c (d, psi) on the features H(Z) and its `W`
    (d^2, d^2), both divided by `scale` (a power of 2 that brings max |c| near 1, so that no norm or
    SVD over- or underflows); `basis` A (None: the tokens' own coordinates, A = I) and `gram`, the
    training data's Lambda~ on Ht(Z) (None: not known; changes are then coefficient changes)."""

    coef: np.ndarray
    W: np.ndarray
    basis: np.ndarray | None = None
    gram: DataGram | None = None
    scale: float = 1.0
    _ref: float | None = field(default=None, repr=False)
    # the heads of a bias-terms function are given of the tokens (x - centre, 1) (mhla_cli.bias_terms: centred
    # heads keep float64 accuracy far from the origin); None: of (x, 1) itself
    centre: np.ndarray | None = None

    @property
    def d(self) -> int:
        return d_of_coef(self.coef)

    @property
    def coordinates(self) -> str:
        """"canonical" (the whitened tokens of the model's data) or "own" (the tokens' own coordinates)."""
        return "own" if self.basis is None else "canonical"

    @property
    def metric(self) -> np.ndarray | None:
        """G (psi, psi) with sum_a c_a G c_a^T = ||c / D||_L^2 (Lambda~ on the coefficients c of H(Z)), or None
        without Lambda~ (polish_heads' metric)."""
        if self.gram is None:
            return None
        inv = 1.0 / feature_scale(self.d)
        return self.gram.matrix * inv[:, None] * inv[None, :]  # psi x psi: for the d of a head search

    def _b(self, c: np.ndarray) -> np.ndarray:
        return np.asarray(c, dtype=np.float64) / feature_scale(self.d)[None, :]

    def coef_change(self, c_new: np.ndarray) -> float:
        """||p_b' - p_b||_F / ||p_b||_F for c' (divided by `scale` like `coef`): 0 when both vanish."""
        ref = _norm(self._b(self.coef))
        diff = _norm(self._b(np.asarray(c_new) - self.coef))
        return diff / ref if ref > 0 else (0.0 if diff == 0 else float("inf"))

    def function_change(self, c_new: np.ndarray) -> float | None:
        """RMS output change over the training inputs / RMS output, for c' (None without Lambda~)."""
        if self.gram is None:
            return None
        if self._ref is None:
            self._ref = self.gram.sq(self._b(self.coef))
        diff = self.gram.sq(self._b(np.asarray(c_new) - self.coef))
        if self._ref > 0:
            return float(np.sqrt(diff / self._ref))
        return 0.0 if diff == 0 else float("inf")

    def change(self, c_new: np.ndarray) -> float:
        """What head counts are cut on: the function change, or the coefficient change without Lambda~."""
        f = self.function_change(c_new)
        return self.coef_change(c_new) if f is None else f

    def radius(self, tol: float) -> float:
        """r with ||p_b' - p_b||_F <= r for every c' whose `change` is <= tol (`head_lower_bound`'s
        threshold): tol ||p_b||_L / sqrt(t) with t <= lambda_min(Lambda~) proven (inf when Lambda~ is
        singular: the data then leave some change free), or tol ||p_b||_F without Lambda~."""
        if self.gram is None:
            return tol * _norm(self._b(self.coef))
        t = self.gram.floor()
        if t <= 0:
            return float("inf")
        if self._ref is None:
            self._ref = self.gram.sq(self._b(self.coef))
        return tol * float(np.sqrt(self._ref / t))

    def record(self, c_new: np.ndarray) -> dict[str, Any]:
        """function_change, coef_change and coordinates of c' (`heads.info`, the JSON records)."""
        return {"function_change": self.function_change(c_new), "coef_change": self.coef_change(c_new),
                "coordinates": self.coordinates}

    def heads(self, Vm: np.ndarray, Qm: np.ndarray) -> Heads:
        """Heads of these coordinates (Vm (H, D_out d), Qm (H, d^2), scaled like `coef`) as heads of the tokens X:
        V_h = V^c_h A^T, Q_h = A Q^c_h A^T times the scale, each head balanced (||V_h|| = ||Q_h||, the same
        W); InputError when an entry exceeds float64 in the tokens' units."""
        d, H = self.d, Vm.shape[0]
        V = np.array(Vm, dtype=np.float64).reshape(H, -1, d)  # (H, D_out, d); copies: balanced in place below
        Q = np.array(Qm, dtype=np.float64).reshape(H, d, d)
        e = 0  # the exponent of 2 the heads' product carries beyond V, Q
        if self.basis is not None:
            basis = self.basis if self.centre is None else centred_basis(self.basis, self.centre)
            alpha = _pow2(float(np.max(np.abs(basis))))
            Ah = basis / alpha  # exact
            V = V @ Ah.T
            Q = np.einsum("ij,hjk,lk->hil", Ah, Q, Ah, optimize=True)
            e += 3 * round(math.log2(alpha))
        e += round(math.log2(self.scale))
        for h in range(H):  # balance: the same W, no factor far larger than the other
            nv, nq = _norm(V[h]), _norm(Q[h])
            if nv > 0 and nq > 0:
                r = math.sqrt(nq / nv)
                V[h] *= r
                Q[h] /= r
        ev = e // 2
        with np.errstate(over="ignore"):
            V = np.ldexp(V, ev)
            Q = np.ldexp(Q, e - ev)
        if not (np.isfinite(V).all() and np.isfinite(Q).all()):
            raise InputError(f"the heads' entries exceed float64 in the units of the tokens (their product carries "
                             f"2^{e}); rescale the tokens towards 1 and fit again")
        return Heads(V=V, Q=Q)


def canonical_function(fn: Any) -> CanonicalFunction:
    """A model (its canonical coefficients, basis and Lambda~ when it has them), square heads or a coef p
    (the tokens' own coordinates, no Lambda~) as a `CanonicalFunction`.

    The W is the minimum-norm W of c, or the model's own low-rank W in these coordinates (`Model.W_b`)."""
    from .model import Model

    basis = gram = None
    if isinstance(fn, Model) and fn.coef_b is not None and fn.basis is not None:
        basis = np.array(fn.basis, dtype=np.float64)
        c = fn.coef_b * feature_scale(fn.d)[None, :]
        W = fn.W_b if fn.W_b is not None else W_from_p(c)
        gram = data_gram(fn)
    elif isinstance(fn, Model):
        c, W = fn.coef, fn.W
    elif isinstance(fn, Heads):
        if fn.factored:
            raise Refused(_no_coef(fn) + " (d, psi) on d x d features; they are evaluated directly",
                          unreduced={})
        c, W = fn.coef, W_from_heads(fn.V, fn.Q)
    else:
        c = np.asarray(fn, dtype=np.float64)
        try:
            d_of_coef(c)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        W = W_from_p(c)
    c = np.asarray(c, dtype=np.float64)
    if not np.isfinite(c).all():
        raise InputError("the coefficients contain NaN or Inf")
    scale = _pow2(float(np.max(np.abs(c)))) if c.size else 1.0
    return CanonicalFunction(coef=c / scale, W=np.asarray(W, dtype=np.float64) / scale, basis=basis, gram=gram,
                             scale=scale)


def _no_coef(heads: Heads) -> str:
    """The words for heads without a coef: factored ones (export-heads --unreduce) or rectangular ones."""
    if heads.factored:
        return (f"factored heads ({heads.d}-dim tokens through {heads.reduced_dim} coordinates, {{unreduced}}; "
                "the model they were exported from has it) have no coef")
    return f"heads with {heads.d_out}-dim outputs of {heads.d}-dim tokens have no coef"


def data_gram(model: Any) -> DataGram | None:
    """The DataGram of a model that keeps its data's Lambda~ (None otherwise); the fit's lambda_min is its hint
    when the data were identifiable."""
    if model.gram_pairs is None:
        return None
    spans = model.gram_spans or (None, None)
    hint = _finite_or_none(model.info.get("lambda_min")) if model.info.get("identifiable") else None
    return DataGram(model.gram_pairs, model.d, hint, spans[0], spans[1])


def _finite_or_none(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if np.isfinite(v) else None


def truncated_heads(fn: Any, tol: float = 1e-12, max_heads: int | None = None) -> Heads:
    """Heads computing fn's function (Algorithm 1, step 3), from the SVD of its W in the canonical coordinates
    (`canonical_function`): singular values s_h > tol * s_max, at most `max_heads` of them (at least one).

    info: n_heads, the change of the function they make (`CanonicalFunction.record`: function_change on the
    training data, coef_change, coordinates), tol, max_heads and the singular values of that W.
    """
    if max_heads is not None and max_heads < 1:
        raise InputError(f"max_heads must be >= 1, got {max_heads}")
    if not (0 <= tol < 1):
        raise InputError(f"tol must be in [0, 1), got {tol}")
    cf = fn if isinstance(fn, CanonicalFunction) else canonical_function(fn)
    hc, s = heads_from_W(cf.W, tol=tol, max_heads=max_heads)
    heads = cf.heads(hc.V.reshape(hc.n_heads, -1), hc.Q.reshape(hc.n_heads, -1))
    heads.info = {"n_heads": heads.n_heads, **cf.record(p_from_heads(hc.V, hc.Q)), "tol": tol,
                  "max_heads": max_heads, "singular_values": (s * cf.scale).tolist()}
    return heads
