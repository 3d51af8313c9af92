"""The widths of a set of heads, shared by the numpy `Heads` (model.heads) and the torch module
(model._heads_module), which cannot import each other (the torch module is optional)."""

from __future__ import annotations

from typing import Any


class HeadShapes:
    """The widths of heads V (H, r_out, r) and Q (H, r, r), and of factored heads (`mhla export-heads --unreduce`):
    those heads with the maps P (d, r) of the tokens and U (d_out, r_out) of the outputs, the function
    y = U (the heads of x~ = P^T x). Shared by `Heads` (numpy) and the torch module (model._heads_module.HeadsModule),
    whose V, Q of heads with the bias terms are those of the tokens (x, 1) (`constant`)."""

    V: Any
    Q: Any

    @property
    def factored(self) -> bool:
        """Whether the heads are factored: reduced heads and the maps P, U (their tokens are x~ = P^T x)."""
        return getattr(self, "P", None) is not None

    @property
    def reduced_dim(self) -> int:
        """Width of the tokens the heads V, Q themselves take (d unless factored)."""
        return int(self.Q.shape[1]) - int(bool(getattr(self, "constant", False)))

    @property
    def d(self) -> int:
        """Width of the tokens."""
        P = getattr(self, "P", None)
        return int(P.shape[0]) if P is not None else self.reduced_dim

    @property
    def d_out(self) -> int:
        """Width of the outputs (d unless the heads are rectangular)."""
        U = getattr(self, "U", None)
        return int(U.shape[0]) if U is not None else int(self.V.shape[1])

    def _shape_repr(self) -> str:
        out = f", d_out={self.d_out}" if self.d_out != self.d else ""
        red = f", factored through d = {self.reduced_dim}" if self.factored else ""
        return f"n_heads={int(self.V.shape[0])}, d={self.d}{out}{red}"
