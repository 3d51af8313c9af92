"""PyTorch module of an MHLA (optional: imported only by `Heads.to_torch`, which needs torch)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from ._head_shapes import HeadShapes
from ..samples import BIDIRECTIONAL, CAUSAL, Samples


def _tensor(a: Any, dtype: Any) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.float64)).to(dtype)


class HeadsModule(nn.Module, HeadShapes):
    """sum_h V_h S Q_h x_t with S = X^T X (or the prefix Gram S_t); V (H, d_out, d), Q (H, d, d) are parameters.

    forward(X, all_positions=False, causal=False, wide=None, attention_mask=None, lengths=None, layout=None): X
    (B, n, d) or (n, d). Last-token output (B, d_out); with a per-position `layout` (mhla_cli.samples) (B, n, d_out),
    row t the output at t with S_t of the positions the layout's query at t reads (`Samples.spans`): all_positions
    is BIDIRECTIONAL (the whole sequence's S), causal CAUSAL (row t the last-token output of the prefix X[:t]).
    normalize="length" divides S (S_t) by the tokens it sums.

    A mask (attention_mask (B, n) of 0/1, any padding; or lengths (B,), the first lengths[b] positions) takes the
    masked positions out: they are no tokens of S or S_t and not counted in n or t (the tokens are multiplied by
    the mask, the constant of the bias terms too), the last-token output is the one at the last unmasked
    position, and the outputs at masked positions are 0 (a window without unmasked positions outputs 0).

    Factored heads (`maps` P (D, r), U (D_out, r_out): buffers) take the tokens X (B, n, D) to x~ = P^T x first and
    map the outputs back by U at the end, so every head works in r dimensions. With the bias terms (`constant`)
    V, Q are the heads of the tokens (x~, 1); the affine map of the wide tokens (`affine`) adds
    weight x_wide + bias at every query.
    """

    # the buffers (register_buffer) and the optional parameters, for the type checker
    P: torch.Tensor | None
    U: torch.Tensor | None
    centre: torch.Tensor | None
    affine_weight: nn.Parameter | None
    affine_bias: nn.Parameter | None

    def __init__(self, V: np.ndarray, Q: np.ndarray, normalize: str = "none", dtype: Any = torch.float64,
                 constant: bool = False, affine: tuple[np.ndarray, np.ndarray] | None = None,
                 maps: tuple[np.ndarray, np.ndarray] | None = None, centre: np.ndarray | None = None) -> None:
        super().__init__()
        # the token-wise affine map of the wide tokens (mhla_cli.solve.affine_block): weight (d_out, D), bias
        self.affine_weight = self.affine_bias = None
        if affine is not None:
            self.affine_weight = nn.Parameter(_tensor(affine[0], dtype))
            self.affine_bias = nn.Parameter(_tensor(affine[1], dtype))
        # the bias terms (mhla_cli.bias_terms): V, Q are heads of the tokens (x, 1), the constant appended here
        self.constant = bool(constant)
        if normalize not in ("none", "length"):
            raise ValueError(f"normalize must be none or length, got {normalize!r}")
        self.V = nn.Parameter(_tensor(V, dtype))
        self.Q = nn.Parameter(_tensor(Q, dtype))
        # factored heads: the maps of mhla reduce, fixed (buffers: they move with .to() and are saved, not trained)
        self.register_buffer("P", None if maps is None else _tensor(maps[0], dtype))
        self.register_buffer("U", None if maps is None else _tensor(maps[1], dtype))
        # centred heads (mhla_cli.bias_terms): the tokens x - centre (of the heads' own coordinates), fixed
        self.register_buffer("centre", None if centre is None else _tensor(centre, dtype))
        self.normalize = normalize

    def extra_repr(self) -> str:
        return f"{self._shape_repr()}, normalize={self.normalize!r}" + (", bias_terms=True" if self.constant else "")

    def forward(self, X: torch.Tensor, all_positions: bool = False, causal: bool = False,
                wide: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None, layout: Samples | None = None) -> torch.Tensor:
        if int(all_positions) + int(causal) + int(layout is not None) > 1:
            raise ValueError("give at most one of all_positions, causal and layout")
        layout = BIDIRECTIONAL if all_positions else CAUSAL if causal else layout
        if layout is not None and not layout.per_position:
            layout = None  # the last-token output
        single = X.dim() == 2
        if single:
            X = X.unsqueeze(0)
            wide = None if wide is None else wide.unsqueeze(0)
            attention_mask = None if attention_mask is None else torch.as_tensor(attention_mask).unsqueeze(0)
            lengths = None if lengths is None else torch.as_tensor(lengths).reshape(1)
        if X.dim() != 3 or X.shape[-1] != self.d or X.shape[1] < 1:
            raise ValueError(f"expected tokens (B, n, d) or (n, d) with d = {self.d} and n >= 1, "
                             f"got shape {tuple(X.shape)}")
        mask = self._mask(X, attention_mask, lengths)
        # the index of every window's last unmasked position (0 for a window without one; its output is then 0)
        n = X.shape[1]
        pos = torch.arange(n, device=X.device)
        last = torch.where(mask > 0, pos, torch.full_like(pos, -1)).amax(dim=1) if mask is not None else None
        out = self._heads(X, mask, layout, last)
        if self.affine_weight is not None:
            D = self.affine_weight.shape[1]
            if wide is None:
                if X.shape[-1] != D:
                    raise ValueError(f"the affine map takes the wide tokens (B, n, {D}): pass wide=")
                wide = X
            if wide.shape[:2] != X.shape[:2] or wide.shape[-1] != D:
                raise ValueError(f"expected wide tokens {tuple(X.shape[:2]) + (D,)}, got shape {tuple(wide.shape)}")
            assert self.affine_bias is not None  # set with affine_weight
            aff = wide.to(self.affine_weight.dtype) @ self.affine_weight.T + self.affine_bias
            if mask is not None:
                aff = aff * mask.unsqueeze(-1)
            if layout is None:
                aff = aff[:, -1] if last is None else _at(aff, last)
            out = out + aff
        return out[0] if single else out

    def _mask(self, X: torch.Tensor, attention_mask: torch.Tensor | None, lengths: torch.Tensor | None
              ) -> torch.Tensor | None:
        """The mask (B, n) of 0/1 in the heads' dtype (None: every position is a token)."""
        if attention_mask is not None and lengths is not None:
            raise ValueError("give at most one of attention_mask and lengths")
        B, n = X.shape[:2]
        if lengths is not None:
            lengths = torch.as_tensor(lengths, device=X.device)
            if lengths.shape != (B,) or bool((lengths < 0).any()) or bool((lengths > n).any()):
                raise ValueError(f"lengths must have shape ({B},) with values in 0..{n}, got {lengths.tolist()}")
            return (torch.arange(n, device=X.device)[None, :] < lengths[:, None]).to(self.V.dtype)
        if attention_mask is None:
            return None
        m = torch.as_tensor(attention_mask, device=X.device)
        if m.shape != (B, n):
            raise ValueError(f"attention_mask must have shape {(B, n)} (the tokens' batch and positions), "
                             f"got {tuple(m.shape)}")
        m = m.to(self.V.dtype)
        if not bool(((m == 0) | (m == 1)).all()):
            raise ValueError("attention_mask must hold 0 (padding) and 1 (a token) only")
        return m

    def _heads(self, X: torch.Tensor, mask: torch.Tensor | None, layout: Samples | None,
               last: torch.Tensor | None) -> torch.Tensor:
        """The heads' outputs of a batch X (B, n, d): (B, d_out), or (B, n, d_out) with a per-position layout."""
        Z = X.to(self.V.dtype)
        if self.P is not None:  # factored heads: the reduced tokens x~ = P^T x
            Z = Z @ self.P
        if self.centre is not None:  # centred heads: of the tokens x - c
            Z = Z - self.centre
        if self.constant:  # the tokens (x, 1) of the bias terms
            Z = torch.cat([Z, torch.ones(*Z.shape[:-1], 1, dtype=Z.dtype, device=Z.device)], dim=-1)
        if mask is not None:  # masked positions: no tokens (their constant too)
            Z = Z * mask.unsqueeze(-1)
        n = Z.shape[1]
        spans = None if layout is None else [torch.as_tensor(np.asarray(v, dtype=np.int64), device=Z.device)
                                             for v in layout.spans(n)]
        if spans is not None and not bool((spans[0] == 0).all() and (spans[1] == n).all()):
            # S_t = sum_{start_t <= s < stop_t} z_s z_s^T (B, n, r, r) from the prefix sums, then M_t = sum_h V_h
            # S_t Q_h and out_t = M_t z_t
            start, stop = spans
            S = _span_sums(torch.cumsum(Z.unsqueeze(-1) * Z.unsqueeze(-2), dim=1), start, stop)
            if self.normalize == "length":
                count = _span_sums(torch.arange(1, n + 1, dtype=Z.dtype, device=Z.device).expand(Z.shape[0], n)
                                   if mask is None else torch.cumsum(mask, dim=1), start, stop)
                S = S / count.clamp(min=1.0).view(*count.shape, 1, 1)
            out = torch.einsum("hab,Btbc,hcl,Btl->Bta", self.V, S, self.Q, Z)  # a: outputs, b, c, l: tokens
        else:
            S = Z.transpose(1, 2) @ Z
            if self.normalize == "length":
                count = torch.full((Z.shape[0],), float(n), dtype=Z.dtype, device=Z.device) if mask is None \
                    else mask.sum(dim=1)
                S = S / count.clamp(min=1.0).view(-1, 1, 1)
            M = torch.einsum("hab,Bbc,hcl->Bal", self.V, S, self.Q)
            if spans is not None:  # every position reads the whole sequence's S
                out = torch.einsum("Bal,Btl->Bta", M, Z)
            else:
                query = Z[:, -1] if last is None else _at(Z, last)
                out = torch.einsum("Bal,Bl->Ba", M, query)
        if self.U is not None:  # factored heads: the outputs in the model's coordinates, y = U y~
            out = out @ self.U.T
        return out


def _span_sums(C: torch.Tensor, start: torch.Tensor, stop: torch.Tensor) -> torch.Tensor:
    """The sums over s in [start_t, stop_t) (B, n, ...) from the prefix sums C (B, n, ...) (C[:, t] = the sum over
    s <= t): C[:, stop_t - 1] less C[:, start_t - 1] where start_t > 0."""
    S = C[:, stop - 1]
    if bool((start > 0).any()):
        before = C[:, (start - 1).clamp(min=0)]
        keep = (start > 0).to(C.dtype).view(1, -1, *([1] * (C.dim() - 2)))
        S = S - before * keep
    return S


def _at(A: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A[b, index[b]] of A (B, n, k) (B, k); 0 where index[b] < 0 (a window without unmasked positions)."""
    rows = A[torch.arange(A.shape[0], device=A.device), index.clamp(min=0)]
    return torch.where((index >= 0).unsqueeze(-1), rows, torch.zeros_like(rows))
