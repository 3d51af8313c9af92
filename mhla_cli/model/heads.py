"""Conversions W <-> p <-> heads (Algorithm 1, steps 2-3) and the heads file."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..io import formats
from ..errors import InputError, Refused
from ..feature_map import n_features, pair_index
from ._head_shapes import HeadShapes
from ..bias_terms import BIAS_ARRAYS, CENTRE_ARRAY, augmented_heads, centring, split_heads
from ..samples import layout_info

# The arrays of the token-wise affine map of the wide tokens beside the heads (mhla_cli.solve.affine_block).
AFFINE_ARRAYS = ("affine_weight", "affine_bias")


def _dims_of_W(W: np.ndarray) -> tuple[int, int]:
    """(D_out, d) of W (D_out d, d^2): the outputs' and the tokens' widths."""
    d = int(round(np.sqrt(W.shape[1]))) if W.ndim == 2 else 0
    if W.ndim != 2 or d < 1 or W.shape[1] != d * d or W.shape[0] % d or W.shape[0] == 0:
        raise ValueError(f"W must have shape (D_out d, d^2), got {W.shape}")
    return W.shape[0] // d, d


def d_of_coef(coef: np.ndarray) -> int:
    """The tokens' width d of coef p (D_out, psi), psi = d^2 (d + 1) / 2 (ValueError for another psi)."""
    psi = int(np.shape(coef)[-1])
    d = 1
    while n_features(d) < psi:
        d += 1
    if np.ndim(coef) != 2 or n_features(d) != psi or np.shape(coef)[0] < 1:
        raise ValueError(f"coef must have shape (D_out, psi), psi = d^2(d+1)/2, got {np.shape(coef)}")
    return d


def p_from_W(W: np.ndarray) -> np.ndarray:
    """coef p (D_out, psi): p[a,(j,k,l)] = W[a*d+j, k*d+l] + W[a*d+k, j*d+l] (j < k), W[a*d+j, j*d+l] (j = k)."""
    e, d = _dims_of_W(W)
    W4 = np.asarray(W, dtype=np.float64).reshape(e, d, d, d)  # [a, j, k, l]
    j, k = pair_index(d)
    P = W4[:, j, k, :] + W4[:, k, j, :]
    P[:, j == k, :] *= 0.5
    return P.reshape(e, -1)


def W_from_p(coef: np.ndarray) -> np.ndarray:
    """The minimum-Frobenius-norm W (D_out d, d^2) with p(W) = coef: each off-diagonal coefficient split
    equally."""
    coef = np.asarray(coef, dtype=np.float64)
    d, e = d_of_coef(coef), coef.shape[0]
    j, k = pair_index(d)
    P = coef.reshape(e, j.size, d)
    W4 = np.zeros((e, d, d, d))
    half = np.where(j == k, 1.0, 0.5)[None, :, None] * P
    W4[:, j, k, :] = half
    W4[:, k, j, :] = half
    return W4.reshape(e * d, d * d)


def W_from_heads(V: np.ndarray, Q: np.ndarray) -> np.ndarray:
    """W = sum_h vec(V_h) vec(Q_h)^T with row-major vec (V (H, D_out, d), Q (H, d, d))."""
    H, e, d = V.shape
    W: np.ndarray = V.reshape(H, e * d).T @ Q.reshape(H, d * d)
    return W


def p_from_heads(V: np.ndarray, Q: np.ndarray) -> np.ndarray:
    """coef p of the function computed by heads (V, Q)."""
    return p_from_W(W_from_heads(np.asarray(V, np.float64), np.asarray(Q, np.float64)))


def coef_of_heads(V: np.ndarray, Q: np.ndarray) -> np.ndarray:
    """coef p (d_out, psi) of heads V (H, d_out, d), Q (H, d, d), rectangular ones too (as p_from_W
    on W4[a, j, k, l] = sum_h V_h[a, j] Q_h[k, l])."""
    V, Q = np.asarray(V, dtype=np.float64), np.asarray(Q, dtype=np.float64)
    d = Q.shape[1]
    W4 = np.einsum("haj,hkl->ajkl", V, Q, optimize=True)
    j, k = pair_index(d)
    P = W4[:, j, k, :] + W4[:, k, j, :]
    P[:, j == k, :] *= 0.5
    out: np.ndarray = P.reshape(V.shape[1], -1)
    return out


def coef_inner(Va: np.ndarray, Qa: np.ndarray, Vb: np.ndarray, Qb: np.ndarray,
               maps_a: tuple[np.ndarray, np.ndarray] | None = None,
               maps_b: tuple[np.ndarray, np.ndarray] | None = None) -> float:
    """<p_A, p_B> (Frobenius) of the coef of two sets of heads, without forming either coef (psi
    d_out entries): sum_{h,g} <Va_h, Vb_g> <Qa_h, Qb_g> + tr(M N) - sum_j M_jj N_jj with
    M = Va_h^T Vb_g, N = Qa_h Qb_g^T (d x d). O(H_a H_b d^2 (d + d_out)); for heads too wide for a coef.

    `maps_a`, `maps_b`: (P, U) of factored heads (the heads U V_h P^T, P Q_h P^T; None: the heads themselves).
    Every product is then taken through the reduced widths r: with C_P = P_a^T P_b and C_U = U_a^T U_b,
    M = P_a X P_b^T (X = Va_h^T C_U Vb_g) and N = P_a Y P_b^T (Y = Qa_h C_P Qb_g^T), so tr(M N) =
    tr(X C_P^T Y C_P^T) and the diagonals are row sums of (P_a X) * P_b: O(H_a H_b r^2 (r + d)) instead of
    O(H_a H_b d^3)."""
    if maps_a is None and maps_b is None:
        total = 0.0
        for h in range(Va.shape[0]):
            M = np.einsum("aj,gak->gjk", Va[h], Vb, optimize=True)  # (Hb, d, d)
            N = np.einsum("kl,gjl->gkj", Qa[h], Qb, optimize=True)  # N[g, k, j] = (Qa_h Qb_g^T)[k, j]
            vv = np.einsum("aj,gaj->g", Va[h], Vb)
            qq = np.einsum("kl,gkl->g", Qa[h], Qb)
            total += float(vv @ qq) + float(np.einsum("gjk,gkj->", M, N)) - float(
                np.einsum("gjj,gjj->", M, N))
        return total
    Pa, Ua = maps_a if maps_a is not None else (np.eye(Qa.shape[1]), np.eye(Va.shape[1]))
    Pb, Ub = maps_b if maps_b is not None else (np.eye(Qb.shape[1]), np.eye(Vb.shape[1]))
    CP, CU = Pa.T @ Pb, Ua.T @ Ub
    total = 0.0
    for h in range(Va.shape[0]):
        X = np.einsum("aj,ab,gbk->gjk", Va[h], CU, Vb, optimize=True)  # Va_h^T C_U Vb_g (Hb, ra, rb)
        Y = np.einsum("jk,kl,gml->gjm", Qa[h], CP, Qb, optimize=True)  # Qa_h C_P Qb_g^T (Hb, ra, rb)
        vv = np.einsum("gjk,jk->g", X, CP)  # tr(Va_h^T C_U Vb_g C_P^T)
        qq = np.einsum("jk,jm,gmn,kn->g", Qa[h], CP, Qb, CP, optimize=True)  # tr(Qa_h^T C_P Qb_g C_P^T)
        trace = np.einsum("gjk,lk,glm,jm->g", X, CP, Y, CP, optimize=True)
        dM = np.einsum("Dj,gjk,Dk->gD", Pa, X, Pb, optimize=True)
        dN = np.einsum("Dj,gjk,Dk->gD", Pa, Y, Pb, optimize=True)
        total += float(vv @ qq) + float(trace.sum()) - float(np.einsum("gD,gD->", dM, dN))
    return total


# The datasets of factored heads' maps (`mhla export-heads --unreduce`): the names the reduced tokens file uses.
MAP_ARRAYS = ("reduce_P", "reduce_U")


@dataclass
class Heads(HeadShapes):
    """An MHLA: value matrices V (H, d_out, d) and merged key-query matrices Q (H, d, d).

    d_out = d for the heads mhla fits; d_out != d for heads put back in a model's coordinates. Heads put back
    there by `mhla export-heads --unreduce` are **factored**: V (H, r, r) and Q (H, r, r) are the heads fitted in
    reduced coordinates and P (d, r), U (d_out, r) the maps of `mhla reduce`; the function is y = U (sum_h V_h
    S~ Q_h x~_t) of the reduced tokens x~ = P^T x (S~ = P^T S P), evaluated at the cost of the reduced heads
    (`dense()` gives the d x d matrices V = U V_h P^T, Q = P Q_h P^T of the same function). Rectangular and
    factored heads are evaluated directly (forward.HeadsFn); they have no coef (d, psi).
    """

    V: np.ndarray
    Q: np.ndarray
    info: dict[str, Any] = field(default_factory=dict)
    # The bias terms (mhla_cli.bias_terms, docs/bias_terms.md), all four or none: value_bias (H, d_out), score_key
    # (H, d), score_query (H, d), score_bias (H,) (widths of V and Q: the reduced ones of factored heads); head h
    # outputs at t sum_i (V_h x_i + value_bias_h) (x_i^T Q_h x_t + score_key_h . x_i + score_query_h . x_t +
    # score_bias_h).
    value_bias: np.ndarray | None = None
    score_key: np.ndarray | None = None
    score_query: np.ndarray | None = None
    score_bias: np.ndarray | None = None
    # Centred heads (mhla_cli.bias_terms, `export-heads` writes them so): V, Q and the bias terms are of the tokens
    # x - token_centre (d,) (of the heads' own, reduced, coordinates for factored heads); None: of x itself.
    token_centre: np.ndarray | None = None
    # The token-wise affine map of the wide tokens beside the heads (mhla_cli.solve.affine_block), both or none:
    # the output gains affine_weight x_wide + affine_bias at every query, affine_weight (d_out, D), affine_bias
    # (d_out,); x_wide the query's token in the model's own coordinates (the tokens themselves for heads put back
    # there with --unreduce).
    affine_weight: np.ndarray | None = None
    affine_bias: np.ndarray | None = None
    # The maps of factored heads, both or none: P (d, r) takes the tokens to the heads' r coordinates (x~ = P^T x),
    # U (d_out, r_out) their outputs back (y = U y~).
    P: np.ndarray | None = None
    U: np.ndarray | None = None

    @property
    def n_heads(self) -> int:
        return int(self.V.shape[0])

    @property
    def bias_terms(self) -> bool:
        """Whether the heads carry the bias terms (their arrays are set)."""
        return self.value_bias is not None

    def bias_arrays(self) -> dict[str, np.ndarray]:
        """The bias terms' arrays by name (mhla_cli.bias_terms.BIAS_ARRAYS; {} without them)."""
        if not self.bias_terms:
            return {}
        centre = {} if self.token_centre is None else {CENTRE_ARRAY: self.token_centre}
        return {**{k: getattr(self, k) for k in BIAS_ARRAYS}, **centre}

    def _maps(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(P, U) of factored heads (set together); None for heads that are not factored."""
        if self.P is None:
            return None
        assert self.U is not None, "P and U are set together"
        return self.P, self.U

    def map_arrays(self) -> dict[str, np.ndarray]:
        """The maps of factored heads by name (`MAP_ARRAYS`: reduce_P (d, r), reduce_U (d_out, r_out)); {} for
        heads that are not factored."""
        maps = self._maps()
        return {} if maps is None else {"reduce_P": maps[0], "reduce_U": maps[1]}

    def augmented(self) -> tuple[np.ndarray, np.ndarray]:
        """(V~ (H, d_out, d + 1), Q~ (H, d + 1, d + 1)): the heads of the tokens (x, 1) that compute these heads
        with their bias terms (mhla_cli.bias_terms); (V, Q) without them. Of the reduced tokens for factored
        heads (`augmented_maps`)."""
        V, Q = self.augmented_centred()
        if self.token_centre is None:
            return V, Q
        T = centring(self.token_centre)  # the heads of x~ = (x, 1): of x~ T = (x - c, 1)
        return np.einsum("hak,jk->haj", V, T, optimize=True), np.einsum("ij,hjk,lk->hil", T, Q, T, optimize=True)

    def augmented_centred(self) -> tuple[np.ndarray, np.ndarray]:
        """`augmented` of the centred tokens (x - token_centre, 1) (the arrays themselves; no term of the size
        of the centre): what `augmented_maps` takes the tokens (x, 1) to."""
        if not self.bias_terms:
            return self.V, self.Q
        return augmented_heads(self.V, self.Q, **{k: getattr(self, k) for k in BIAS_ARRAYS})

    def uncentred(self) -> Heads:
        """These heads with their bias terms of the tokens x themselves (token_centre folded in: exact up to the
        rounding of terms of the size of the centre)."""
        if self.token_centre is None:
            return self
        V, Q = self.augmented()
        parts: dict[str, Any] = split_heads(V, Q)
        return dataclasses.replace(self, V=parts.pop("V"), Q=parts.pop("Q"), token_centre=None, **parts)

    def augmented_maps(self) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The maps (P~, U) of the `augmented` heads of factored heads: P~ = [[P, 0], [0, 1]] takes the tokens
        (x, 1) to (P^T x, 1) with the bias terms, P itself without; None for heads that are not factored."""
        if self.token_centre is not None:  # (x, 1) -> (x P - c, 1): the tokens of `augmented_centred`
            return centring(self.token_centre, self.P), self.U
        maps = self._maps()
        if maps is None:
            return None
        if not self.bias_terms:
            return maps
        P, U = maps
        D, r = P.shape
        Pa = np.zeros((D + 1, r + 1))
        Pa[:D, :r], Pa[D, r] = P, 1.0
        return Pa, U

    def dense(self) -> Heads:
        """These heads with d x d matrices: factored heads as V = U V_h P^T (H, d_out, d), Q = P Q_h P^T (H, d, d)
        and their bias terms value_bias -> U b_v, score_key -> P c, score_query -> P r (the same function; d^2
        numbers a head instead of r^2, and evaluating them costs d / r times more per token and (d / r)^2 per
        window); the heads themselves when they are not factored."""
        maps = self._maps()
        if maps is None:
            return self
        if self.token_centre is not None:
            return self.uncentred().dense()
        P, U = maps
        bias = {}
        if self.bias_terms:
            bias = {"value_bias": self.value_bias @ U.T, "score_key": self.score_key @ P.T,
                    "score_query": self.score_query @ P.T, "score_bias": np.array(self.score_bias)}
        return Heads(V=np.ascontiguousarray(np.einsum("ij,hjk,lk->hil", U, self.V, P, optimize=True)),
                     Q=np.ascontiguousarray(np.einsum("ij,hjk,lk->hil", P, self.Q, P, optimize=True)),
                     info=dict(self.info), affine_weight=self.affine_weight, affine_bias=self.affine_bias,
                     **{k: np.ascontiguousarray(v) for k, v in bias.items()})

    def __repr__(self) -> str:  # the sizes, not V and Q
        norm = self.info.get("normalize")
        return f"Heads({self._shape_repr()}" + (f", normalize={norm!r})" if norm else ")")

    @property
    def coef(self) -> np.ndarray:
        if self.P is not None:
            raise Refused(f"factored heads (d = {self.d} tokens through d = {self.reduced_dim}, {{unreduced}}) have "
                          "no coef (d, psi); they are evaluated directly", unreduced={})
        if self.bias_terms:  # the coef of a model with the bias terms: of the tokens (x, 1), the padded output 0
            p = coef_of_heads(*self.augmented())
            return np.vstack([p, np.zeros((1, p.shape[1]))])
        return coef_of_heads(self.V, self.Q)  # (D_out, psi): rectangular heads too

    def save(self, path: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = ()) -> None:
        """Write a heads file atomically."""
        attrs = {"d": self.d, "n_heads": self.n_heads}
        if self.d_out != self.d:
            attrs["d_out"] = self.d_out
        if self.P is not None:
            attrs["reduced_dim"] = self.reduced_dim
        for k in ("function_change", "coef_change", "coordinates", "tol", "max_heads", "normalize", "unreduced",
                  formats.COMPAT_ATTR):
            if self.info.get(k) is not None:
                attrs[k] = self.info[k]
        attrs.update(layout_info(self.info))  # the layout fitted on, with its parameters (mhla_cli.samples)
        if self.bias_terms:
            attrs["bias_terms"] = 1
        if self.affine_weight is not None:
            attrs["affine_width"] = int(self.affine_weight.shape[1])
        formats.write_file(path, "heads", {"V": self.V, "Q": self.Q, **self.bias_arrays(), **self.affine_arrays(),
                                           **self.map_arrays()}, attrs, inputs)

    def affine_arrays(self) -> dict[str, np.ndarray]:
        """The affine map's arrays by name ({} without it): affine_weight (d_out, D), affine_bias (d_out,)."""
        affine = self._affine()
        return {} if affine is None else {"affine_weight": affine[0], "affine_bias": affine[1]}

    def _affine(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(affine_weight, affine_bias) of the affine map (set together); None without it."""
        if self.affine_weight is None:
            return None
        assert self.affine_bias is not None, "affine_weight and affine_bias are set together"
        return self.affine_weight, self.affine_bias

    @classmethod
    def load(cls, path: str | os.PathLike) -> Heads:
        """Read and validate a heads file."""
        with formats.open_input(path) as f:
            formats.expect_kind(f, path, "heads")
            V = formats.read_array(f, "V", path).astype(np.float64)
            Q = formats.read_array(f, "Q", path).astype(np.float64)
            normalize = formats.read_normalize(f, path)
            fitted = layout_info(f.attrs)
            bias = read_bias_arrays({k: formats.read_array(f, k, path) for k in (*BIAS_ARRAYS, CENTRE_ARRAY) if k in f},
                                    formats.read_bias_terms(f.attrs, path), path)
            affine = {k: formats.read_array(f, k, path) for k in AFFINE_ARRAYS if k in f}
            maps = {k: formats.read_array(f, k, path) for k in MAP_ARRAYS if k in f}
            widths = {k: int(f.attrs[k]) for k in ("d", "d_out") if k in f.attrs}
            compat = f.attrs.get(formats.COMPAT_ATTR)  # "on" / "off" (a str, or bytes as h5py may give it)
        heads = cls.from_arrays(V, Q, normalize, path, bias=bias, affine=affine or None, maps=maps or None)
        check_widths(heads, widths, path)
        if fitted.get("attention") is not None:  # the per-position samples fitted on (mhla_cli.samples)
            heads.info.update({k: v.item() if hasattr(v, "item") else v for k, v in fitted.items()})
        if compat is not None:  # the TransformerLens compatibility mode of the activations fitted on
            heads.info[formats.COMPAT_ATTR] = compat.decode() if isinstance(compat, bytes) else str(compat)
        return heads

    @classmethod
    def from_arrays(cls, V: Any, Q: Any, normalize: str = "none", path: str | os.PathLike | None = None,
                    bias: dict[str, Any] | None = None, affine: dict[str, Any] | None = None,
                    maps: dict[str, Any] | None = None) -> Heads:
        """Validated heads from arrays V (H, d_out, d), Q (H, d, d) (any real dtype; stored as float64),
        `bias`, the bias terms' arrays by name (mhla_cli.bias_terms.BIAS_ARRAYS) or None, `affine`, the
        affine map's (AFFINE_ARRAYS) or None, and `maps`, the maps of factored heads (MAP_ARRAYS: reduce_P
        (D, d), reduce_U (D_out, d_out)) or None."""
        V = np.asarray(V)
        Q = np.asarray(Q)
        for name, a in (("V", V), ("Q", Q)):
            if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
                raise InputError(f"'{name}' has dtype {a.dtype}, expected real numbers", path)
        V, Q = V.astype(np.float64), Q.astype(np.float64)
        if V.ndim != 3:
            raise InputError(f"'V' has shape {V.shape}, expected (H, d_out, d)", path)
        if Q.ndim != 3 or Q.shape[1] != Q.shape[2]:
            raise InputError(f"'Q' has shape {Q.shape}, expected (H, d, d)", path)
        if V.ndim != 3 or V.shape[0] != Q.shape[0] or V.shape[2] != Q.shape[2]:
            raise InputError(f"'Q' has shape {Q.shape} but 'V' has shape {V.shape}; expected V (H, d_out, d) "
                             "beside Q (H, d, d)", path)
        if V.shape[0] == 0:
            raise InputError("no heads (H = 0)", path)
        if not (np.isfinite(V).all() and np.isfinite(Q).all()):
            raise InputError("'V' or 'Q' contains NaN or Inf", path)
        if normalize not in ("none", "length"):
            raise InputError(f"attribute 'normalize' is '{normalize}', expected none or length", path)
        heads = cls(V=V, Q=Q, info={"normalize": normalize})
        if maps:
            heads.P, heads.U = _read_maps(maps, V.shape, path)
        if bias:
            H, d_out, d = V.shape
            shapes = {"value_bias": (H, d_out), "score_key": (H, d), "score_query": (H, d), "score_bias": (H,)}
            for k, shape in shapes.items():
                a = np.asarray(bias[k])
                if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
                    raise InputError(f"'{k}' has dtype {a.dtype}, expected real numbers", path)
                if a.shape != shape:
                    raise InputError(f"'{k}' has shape {a.shape}, expected {shape} beside V {V.shape}", path)
                a = a.astype(np.float64)
                if not np.isfinite(a).all():
                    raise InputError(f"'{k}' contains NaN or Inf", path)
                setattr(heads, k, a)
            if bias.get(CENTRE_ARRAY) is not None:
                c = np.asarray(bias[CENTRE_ARRAY])
                if c.shape != (d,) or not np.issubdtype(c.dtype, np.floating) or not np.isfinite(c).all():
                    raise InputError(f"'{CENTRE_ARRAY}' has shape {c.shape} or is not finite, expected ({d},) finite "
                                     "real numbers", path)
                heads.token_centre = c.astype(np.float64)
        elif CENTRE_ARRAY in (bias or {}):
            raise InputError(f"holds '{CENTRE_ARRAY}' but no bias terms", path)
        if affine:
            missing = [k for k in AFFINE_ARRAYS if k not in affine]
            if missing:
                raise InputError(f"holds {', '.join(k for k in AFFINE_ARRAYS if k in affine)} but no "
                                 f"{', '.join(repr(k) for k in missing)}; the file is incomplete", path)
            Wa, ba = (np.asarray(affine[k]) for k in AFFINE_ARRAYS)
            d_out = heads.d_out
            if Wa.ndim != 2 or Wa.shape[0] != d_out or ba.shape != (d_out,):
                raise InputError(f"'affine_weight' {Wa.shape} and 'affine_bias' {ba.shape} are not an affine map to "
                                 f"the heads' {d_out} outputs", path)
            if heads.P is not None and Wa.shape[1] != heads.d:
                raise InputError(f"'affine_weight' {Wa.shape} takes {Wa.shape[1]}-dim tokens but the factored heads "
                                 f"take {heads.d}-dim ones (their affine map acts on the tokens themselves)", path)
            Wa, ba = Wa.astype(np.float64), ba.astype(np.float64)
            if not (np.isfinite(Wa).all() and np.isfinite(ba).all()):
                raise InputError("'affine_weight' or 'affine_bias' contains NaN or Inf", path)
            heads.affine_weight, heads.affine_bias = Wa, ba
        return heads

    def to_torch(self, dtype: Any = None) -> Any:
        """A `torch.nn.Module` computing these heads' function (V, Q as trainable parameters; the maps P, U of
        factored heads as buffers, evaluated as x~ = P^T x and y = U y~: the cost of the reduced heads).

        `module(X)` for X (B, n, d) or (n, d): last-token outputs (B, d_out) (or (d_out,));
        `module(X, all_positions=True)`: sum_h V_h S Q_h x_t at every position (B, n, d_out);
        `module(X, causal=True)`: the last-token output of every prefix X[:t] (B, n, d_out).
        `module(X, layout=L)`: the output at every position in a per-position layout L (mhla_cli.samples: S_t of the
        positions its query at t reads, `Samples.spans`) (B, n, d_out).
        S = X^T X, divided by the (prefix) length when the heads were fitted with normalize="length".
        Padded batches: `attention_mask=` (B, n) of 0/1 (left, right or any padding) or `lengths=` (B,) (the first
        lengths[b] positions, right padding): a masked position is neither a token of S nor counted in the length;
        the last-token output is the one at the last unmasked position, and outputs at masked positions are 0.
        `wide=` the wide tokens of heads with the affine map of them (the tokens themselves for factored heads).
        `dtype` defaults to torch.float64. Needs torch >= 2.1 (mhla's [torch] extra).
        """
        try:
            import torch
        except ImportError:
            raise ImportError("Heads.to_torch needs PyTorch: pip install 'torch>=2.1' (mhla's [torch] extra)") from None
        from ._heads_module import HeadsModule

        V, Q = self.augmented_centred()  # with the bias terms: the heads of the tokens (x - c, 1)
        return HeadsModule(V, Q, str(self.info.get("normalize", "none")), torch.float64 if dtype is None else dtype,
                           constant=self.bias_terms, affine=self._affine(), maps=self._maps(), centre=self.token_centre)


def _read_maps(maps: dict[str, Any], shape: tuple[int, ...], path: str | os.PathLike | None
               ) -> tuple[np.ndarray, np.ndarray]:
    """(P (D, r), U (D_out, r_out)) of factored heads V (H, r_out, r), validated (both present, real, finite)."""
    missing = [k for k in MAP_ARRAYS if k not in maps]
    if missing:
        raise InputError(f"holds {', '.join(k for k in MAP_ARRAYS if k in maps)} but no "
                         f"{', '.join(repr(k) for k in missing)}; the factored heads are incomplete", path)
    out = []
    for k, r in zip(MAP_ARRAYS, (shape[2], shape[1])):
        a = np.asarray(maps[k])
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
            raise InputError(f"'{k}' has dtype {a.dtype}, expected real numbers", path)
        if a.ndim != 2 or a.shape[1] != r or a.shape[0] < 1:
            raise InputError(f"'{k}' has shape {a.shape}, expected (D, {r}) beside V {tuple(shape)}", path)
        a = a.astype(np.float64)
        if not np.isfinite(a).all():
            raise InputError(f"'{k}' contains NaN or Inf", path)
        out.append(a)
    return out[0], out[1]


def check_widths(heads: Heads, widths: dict[str, int], path: str | os.PathLike | None) -> None:
    """The widths a heads file's metadata states ({"d": ..., "d_out": ...}, those present) are the arrays'."""
    for key, value in (("d", heads.d), ("d_out", heads.d_out)):
        if key in widths and int(widths[key]) != value:
            raise InputError(f"metadata '{key}' = {widths[key]} but the arrays have {key} = {value}", path)


def heads_from_W(W: np.ndarray, tol: float = 1e-12, max_heads: int | None = None
                 ) -> tuple[Heads, np.ndarray]:
    """SVD of W (D_out d, d^2) into heads V_h = sqrt(s_h) U_h, Q_h = sqrt(s_h) V_h^T (reshaped D_out x d, d x d).

    Keeps singular values s_h > tol * s_max, at most `max_heads` of them (always at least one).
    Returns the heads and all singular values.
    """
    e, d = _dims_of_W(W)
    U, s, Vt = np.linalg.svd(W, full_matrices=False)
    smax = float(s[0]) if s.size else 0.0
    keep = int((s > tol * smax).sum()) if smax > 0 else 0
    if max_heads is not None:
        keep = min(keep, int(max_heads))
    keep = max(keep, 1)
    r = np.sqrt(s[:keep])
    V = (U[:, :keep] * r).T.reshape(keep, e, d)
    Q = (Vt[:keep].T * r).T.reshape(keep, d, d)
    return Heads(V=V, Q=Q), s


def read_bias_arrays(arrays: dict[str, Any], flagged: bool, path: str | os.PathLike | None = None
                     ) -> dict[str, Any] | None:
    """The bias terms' arrays of a heads file (mhla_cli.bias_terms.BIAS_ARRAYS): all four, with the file's
    `bias_terms` flag, or none; None without them. InputError for a partial set or a flag without them."""
    have = [k for k in BIAS_ARRAYS if k in arrays]
    if not have and not flagged:
        if CENTRE_ARRAY in arrays:
            raise InputError(f"holds '{CENTRE_ARRAY}' but no bias terms", path)
        return None
    missing = [k for k in BIAS_ARRAYS if k not in arrays]
    if missing:
        raise InputError(f"holds the bias terms ({', '.join(have) or 'bias_terms = 1'}) but no "
                         f"{', '.join(repr(k) for k in missing)}; the file is incomplete", path)
    return {k: arrays[k] for k in (*BIAS_ARRAYS, CENTRE_ARRAY) if k in arrays}


def with_bias_terms(heads: Heads, centre: np.ndarray | None = None) -> Heads:
    """Heads of the tokens (x, 1) with the padded output (V (H, d + 1, d + 1), Q (H, d + 1, d + 1): the SVD of
    a bias-terms model's W) as heads of the tokens with their bias terms (mhla_cli.bias_terms.split_heads),
    the padded output dropped; info kept. `centre`: the heads are of the tokens (x - centre, 1) (centred heads).
    The targets of a bias-terms fit are always padded (y, 0), whatever their width: the last output is dropped."""
    V = heads.V[:, :-1, :]
    parts = split_heads(V, heads.Q)
    out = Heads(V=parts.pop("V"), Q=parts.pop("Q"), info=dict(heads.info), **parts,
                token_centre=None if centre is None else np.array(centre, dtype=np.float64))
    out.info["bias_terms"] = True
    return out

