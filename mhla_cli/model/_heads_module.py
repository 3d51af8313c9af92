"""PyTorch module of an MHLA (optional: imported only by `Heads.to_torch`, which needs torch)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from ._head_shapes import HeadShapes


class HeadsModule(nn.Module, HeadShapes):
    """sum_h V_h S Q_h x_t with S = X^T X (or the prefix Gram S_t); V (H, d_out, d), Q (H, d, d) are parameters.

    forward(X, all_positions=False, causal=False): X (B, n, d) or (n, d). Last-token output (B, d);
    all_positions: (B, n, d) with the whole sequence's S; causal: (B, n, d), row t the last-token
    output of the prefix X[:t]. normalize="length" divides S (S_t) by n (t).
    """

    def __init__(self, V: np.ndarray, Q: np.ndarray, normalize: str = "none", dtype: Any = torch.float64,
                 constant: bool = False, affine: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        super().__init__()
        # the token-wise affine map of the wide tokens (mhla_cli.solve.affine_block): weight (d_out, D), bias
        self.affine_weight = self.affine_bias = None
        if affine is not None:
            self.affine_weight = nn.Parameter(torch.as_tensor(np.asarray(affine[0], dtype=np.float64)).to(dtype))
            self.affine_bias = nn.Parameter(torch.as_tensor(np.asarray(affine[1], dtype=np.float64)).to(dtype))
        # the bias terms (mhla_cli.bias_terms): V, Q are heads of the tokens (x, 1), the constant appended here
        self.constant = bool(constant)
        if normalize not in ("none", "length"):
            raise ValueError(f"normalize must be none or length, got {normalize!r}")
        self.V = nn.Parameter(torch.as_tensor(np.asarray(V, dtype=np.float64)).to(dtype))
        self.Q = nn.Parameter(torch.as_tensor(np.asarray(Q, dtype=np.float64)).to(dtype))
        self.normalize = normalize

    def extra_repr(self) -> str:
        return f"{self._shape_repr()}, normalize={self.normalize!r}" + (", bias_terms=True" if self.constant else "")

    def forward(self, X: torch.Tensor, all_positions: bool = False, causal: bool = False,
                wide: torch.Tensor | None = None) -> torch.Tensor:
        if all_positions and causal:
            raise ValueError("give at most one of all_positions and causal")
        single = X.dim() == 2
        if single:
            X = X.unsqueeze(0)
            wide = None if wide is None else wide.unsqueeze(0)
        if self.affine_weight is not None:
            out = self._heads(X, all_positions, causal)
            D = self.affine_weight.shape[1]
            if wide is None:
                if X.shape[-1] != D:
                    raise ValueError(f"the affine map takes the wide tokens (B, n, {D}): pass wide=")
                wide = X
            if wide.shape[:2] != X.shape[:2] or wide.shape[-1] != D:
                raise ValueError(f"expected wide tokens {tuple(X.shape[:2]) + (D,)}, got shape {tuple(wide.shape)}")
            f = wide.to(self.affine_weight.dtype)
            aff = f @ self.affine_weight.T + self.affine_bias
            out = out + (aff if all_positions or causal else aff[:, -1])
            return out[0] if single else out
        out = self._heads(X, all_positions, causal)
        return out[0] if single else out

    def _heads(self, X: torch.Tensor, all_positions: bool, causal: bool) -> torch.Tensor:
        """The heads' outputs of a batch X (B, n, d)."""
        width = self.d - int(self.constant)
        if X.dim() != 3 or X.shape[-1] != width or X.shape[1] < 1:
            raise ValueError(f"expected tokens (B, n, d) or (n, d) with d = {width} and n >= 1, "
                             f"got shape {tuple(X.shape)}")
        X = X.to(self.V.dtype)
        if self.constant:  # the tokens (x, 1) of the bias terms
            X = torch.cat([X, torch.ones(*X.shape[:-1], 1, dtype=X.dtype, device=X.device)], dim=-1)
        n = X.shape[1]
        if causal:
            # S_t = sum_{s<=t} x_s x_s^T (B, n, d, d), then M_t = sum_h V_h S_t Q_h and out_t = M_t x_t
            S = torch.cumsum(X.unsqueeze(-1) * X.unsqueeze(-2), dim=1)
            if self.normalize == "length":
                S = S / torch.arange(1, n + 1, dtype=X.dtype, device=X.device).view(1, n, 1, 1)
            out = torch.einsum("hab,Btbc,hcl,Btl->Bta", self.V, S, self.Q, X)  # a: d_out, b, c, l: d
        else:
            S = X.transpose(1, 2) @ X
            if self.normalize == "length":
                S = S / n
            M = torch.einsum("hab,Bbc,hcl->Bal", self.V, S, self.Q)
            out = torch.einsum("Bal,Btl->Bta", M, X) if all_positions else torch.einsum("Bal,Bl->Ba", M, X[:, -1])
        return out

