"""The widths of a set of heads, shared by the numpy `Heads` (model.heads) and the torch module
(model._heads_module), which cannot import each other (the torch module is optional)."""

from __future__ import annotations

from typing import Any


class HeadShapes:
    """The widths of heads V (H, d_out, d) and Q (H, d, d): shared by `Heads` (numpy) and the torch module
    (model._heads_module.HeadsModule)."""

    V: Any
    Q: Any

    @property
    def d(self) -> int:
        """Width of the tokens."""
        return int(self.Q.shape[1])

    @property
    def d_out(self) -> int:
        """Width of the outputs (d unless the heads are rectangular)."""
        return int(self.V.shape[1])

    def _shape_repr(self) -> str:
        out = f", d_out={self.d_out}" if self.d_out != self.d else ""
        return f"n_heads={int(self.V.shape[0])}, d={self.d}{out}"
