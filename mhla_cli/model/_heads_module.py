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
                 constant: bool = False) -> None:
        super().__init__()
        # the bias terms (mhla_cli.bias_terms): V, Q are heads of the tokens (x, 1), the constant appended here
        self.constant = bool(constant)
        if normalize not in ("none", "length"):
            raise ValueError(f"normalize must be none or length, got {normalize!r}")
        self.V = nn.Parameter(torch.as_tensor(np.asarray(V, dtype=np.float64)).to(dtype))
        self.Q = nn.Parameter(torch.as_tensor(np.asarray(Q, dtype=np.float64)).to(dtype))
        self.normalize = normalize

    def extra_repr(self) -> str:
        return f"{self._shape_repr()}, normalize={self.normalize!r}" + (", bias_terms=True" if self.constant else "")

    def forward(self, X: torch.Tensor, all_positions: bool = False, causal: bool = False) -> torch.Tensor:
        if all_positions and causal:
            raise ValueError("give at most one of all_positions and causal")
        single = X.dim() == 2
        if single:
            X = X.unsqueeze(0)
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
        return out[0] if single else out

