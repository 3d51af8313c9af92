"""A layer as a sum of MHLA blocks, each reading the tokens through its own map (docs/blocks.md): `HeadsSum`.

Block b is factored heads (mhla_cli.model.heads.Heads with maps P_b (D, r_b) and U_b (D_out, r_out_b)): an MHLA of
the reduced tokens x~_b = P_b^T x whose outputs U_b y~_b are in the model's coordinates. The sum of the blocks
(plus, optionally, an affine map of the wide token) is the layer's output:

    yhat_t = sum_b U_b sum_h V_bh (X P_b)^T (X P_b) Q_bh P_b^T x_t  (+ affine_weight x_t + affine_bias).

In the model's coordinates every block is an ordinary MHLA of D-dim tokens (`Heads.dense`: V = U_b V_bh P_b^T,
Q = P_b Q_bh P_b^T), so the sum is one MHLA with all the blocks' heads; kept factored it costs the sum of the
blocks' reduced heads. It comes from `fit_blocks` (all blocks fitted jointly on the layer's output:
mhla_cli.solve.blocks) or from `sum_of_blocks` (blocks fitted one by one, each on its own targets, e.g. a head's
output before W_O, its output map the head's columns of W_O).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError
from ..io import formats
from ..samples import Samples, fitted_layout, layout_info
from .forward.evaluate import as_ragged, predict_samples
from .heads import Heads

__all__ = ["HeadsSum", "sum_of_blocks", "load_blocks"]

KIND = "blocks"
BLOCK_ARRAYS = ("V", "Q", "P", "U")


@dataclass
class HeadsSum:
    """A sum of blocks of factored heads (module docstring), with the same token width D, output width D_out,
    layout and normalisation; `affine_weight` (D_out, D) and `affine_bias` (D_out,) the affine map of the wide
    token beside them (both or none)."""

    parts: list[Heads]
    info: dict[str, Any] = field(default_factory=dict)
    affine_weight: np.ndarray | None = None
    affine_bias: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not self.parts:
            raise InputError("a sum of blocks needs at least one block")
        D, e = self.parts[0].d, self.parts[0].d_out
        for b, h in enumerate(self.parts):
            if h.P is None or h.U is None:
                raise InputError(f"block {b} is not factored heads (maps P and U): put it in the model's "
                                 "coordinates first (unreduce_heads)")
            if (h.d, h.d_out) != (D, e):
                raise InputError(f"block {b} maps {h.d}-dim tokens to {h.d_out} outputs, block 0 {D} to {e}: "
                                 "the blocks of a sum share the tokens and the outputs")
            if str(h.info.get("normalize", "none")) != self.normalize or layout_info(h.info) != layout_info(
                    self.parts[0].info):
                raise InputError(f"block {b} was fitted with another normalisation or layout than block 0")
        if (self.affine_weight is None) != (self.affine_bias is None):
            raise InputError("affine_weight and affine_bias are given together")
        if self.affine_weight is not None and (np.shape(self.affine_weight) != (e, D)
                                               or np.shape(np.asarray(self.affine_bias)) != (e,)):
            raise InputError(f"the affine map must be ({e}, {D}) and ({e},), got {np.shape(self.affine_weight)} "
                             f"and {np.shape(np.asarray(self.affine_bias))}")

    @property
    def d(self) -> int:
        """D, the tokens' width."""
        return int(self.parts[0].d)

    @property
    def d_out(self) -> int:
        return int(self.parts[0].d_out)

    @property
    def n_blocks(self) -> int:
        return len(self.parts)

    @property
    def n_heads(self) -> int:
        return sum(h.n_heads for h in self.parts)

    @property
    def normalize(self) -> str:
        return str(self.parts[0].info.get("normalize", "none"))

    @property
    def layout(self) -> Samples:
        """The layout the blocks were fitted on (their info's `attention`)."""
        return fitted_layout(self.parts[0].info)

    def __repr__(self) -> str:  # the sizes, not the arrays
        dims = ", ".join(str(h.reduced_dim) for h in self.parts)
        return (f"HeadsSum({self.n_blocks} blocks of d = {dims}, {self.n_heads} heads, D = {self.d}, "
                f"D_out = {self.d_out}{', affine' if self.affine_weight is not None else ''})")

    def predict(self, tokens: np.ndarray, offsets: np.ndarray | None = None, layout: Samples | None = None
                ) -> np.ndarray:
        """The outputs at every sample of `layout` (None: the layout fitted on): (T, D_out) at every position of a
        per-position layout, (N, D_out) at the last tokens otherwise; tokens (T, D) with offsets, or (N, n, D)."""
        X, off = as_ragged(np.asarray(tokens, dtype=np.float64), offsets)
        samples = self.layout if layout is None else layout
        out = sum(predict_samples(h, X, off, samples) for h in self.parts)
        assert isinstance(out, np.ndarray)
        if self.affine_weight is not None:
            q = samples.queries(X, off).x
            out = out + q @ self.affine_weight.T + self.affine_bias
        return out

    def dense(self) -> Heads:
        """One MHLA of D-dim tokens with every block's heads (V (H, D_out, D), Q (H, D, D)): the same function
        without the affine map (D^2 numbers a head: for export to tools that take plain heads)."""
        if self.affine_weight is not None:
            raise InputError("the sum has an affine map beside its heads: plain heads cannot hold it")
        parts = [h.dense() for h in self.parts]
        return Heads(V=np.concatenate([h.V for h in parts]), Q=np.concatenate([h.Q for h in parts]),
                     info=dict(self.parts[0].info))

    def to_torch(self, dtype: Any = None, layout: Any = None, offset: Any = None) -> Any:
        """A torch module for `mhla_cli.model.splice` (forward(X, attention_mask=None) -> (B, n, D_out) at every
        position): the sum of the blocks' `Replacement`s and the affine map. Needs torch (the [torch] extra)."""
        from .splice import BlocksReplacement

        return BlocksReplacement(self, layout=layout, offset=offset, dtype=dtype)

    def save(self, path: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = ()) -> None:
        """Write an HDF5 blocks file atomically: V_b, Q_b, P_b, U_b of every block b, the affine map's arrays."""
        arrays: dict[str, np.ndarray] = {}
        for b, h in enumerate(self.parts):
            arrays.update({f"{k}_{b}": np.ascontiguousarray(v, dtype=np.float64)
                           for k, v in zip(BLOCK_ARRAYS, (h.V, h.Q, h.P, h.U))})
        if self.affine_weight is not None and self.affine_bias is not None:
            arrays.update({"affine_weight": self.affine_weight, "affine_bias": self.affine_bias})
        attrs = {"n_blocks": self.n_blocks, "d": self.d, "d_out": self.d_out, "normalize": self.normalize,
                 **layout_info(self.parts[0].info)}
        for k in ("fitted", "ridge", "n_features", "n_samples", "n_tokens"):
            if isinstance(self.info.get(k), (int, float, str)):
                attrs[k] = self.info[k]
        formats.write_file(path, KIND, arrays, attrs, inputs)


def load_blocks(path: str | os.PathLike) -> HeadsSum:
    """Read and validate a blocks file (`HeadsSum.save`): every array checked against the file's manifest."""
    with formats.open_input(path) as f:
        formats.expect_kind(f, path, KIND)
        n = formats.read_attr_int(f, "n_blocks", path)
        if n < 1:
            raise InputError(f"'n_blocks' = {n}: a blocks file holds at least one block", path)
        normalize = formats.read_normalize(f, path)
        fitted = layout_info(f.attrs)
        info: dict[str, Any] = {"normalize": normalize, **fitted}
        parts = []
        for b in range(n):
            missing = [f"{k}_{b}" for k in BLOCK_ARRAYS if f"{k}_{b}" not in f]
            if missing:
                raise InputError(f"block {b} has no {', '.join(repr(k) for k in missing)}; the file is incomplete",
                                 path)
            V, Q, P, U = (formats.read_array(f, f"{k}_{b}", path).astype(np.float64) for k in BLOCK_ARRAYS)
            parts.append(_block(V, Q, P, U, dict(info), b, path))
        affine = {k: formats.read_array(f, k, path).astype(np.float64) for k in ("affine_weight", "affine_bias")
                  if k in f}
        extra = {k: f.attrs[k] for k in ("fitted", "ridge") if k in f.attrs}
    if len(affine) == 1:
        raise InputError("holds one of 'affine_weight' and 'affine_bias' only; the file is incomplete", path)
    try:
        return HeadsSum(parts, info={**info, **{k: v.item() if hasattr(v, "item") else v for k, v in extra.items()}},
                        **affine)
    except InputError as exc:
        raise InputError(str(exc), path) from None


def _block(V: np.ndarray, Q: np.ndarray, P: np.ndarray, U: np.ndarray, info: dict[str, Any], b: int,
           path: str | os.PathLike) -> Heads:
    """One block's factored heads, their shapes checked against each other."""
    ok = (V.ndim == 3 and Q.ndim == 3 and P.ndim == 2 and U.ndim == 2 and V.shape[0] == Q.shape[0] >= 1
          and Q.shape[1] == Q.shape[2] == V.shape[2] == P.shape[1] and U.shape[1] == V.shape[1])
    if not ok:
        raise InputError(f"block {b} has arrays of inconsistent shapes: V {V.shape}, Q {Q.shape}, P {P.shape}, "
                         f"U {U.shape} (expected V (H, r_out, r), Q (H, r, r), P (D, r), U (D_out, r_out))", path)
    return Heads(V=V, Q=Q, info=info, P=P, U=U)


def sum_of_blocks(parts: Sequence[Heads], out_maps: Sequence[Any] | None = None, affine: tuple[Any, Any] | None = None
                  ) -> HeadsSum:
    """The sum of blocks fitted one by one: `parts` factored heads in the model's token coordinates (e.g. each
    head's MHLA fitted on its own output and put back by unreduce_heads), `out_maps[b]` (D_out, e_b) the map of
    block b's outputs into the layer's (e.g. W_O[:, head b's columns]; None: the identity); `affine`
    (weight (D_out, D), bias (D_out,)) an affine map of the wide token beside them."""
    maps = [None] * len(parts) if out_maps is None else list(out_maps)
    if len(maps) != len(parts):
        raise InputError(f"{len(parts)} blocks but {len(maps)} output maps")
    out = []
    for b, (h, O) in enumerate(zip(parts, maps)):
        if h.P is None or h.U is None:
            raise InputError(f"block {b} is not factored heads (maps P and U): put it in the model's coordinates "
                             "first (unreduce_heads)")
        if h.bias_terms or h.affine_weight is not None:
            raise InputError(f"block {b} carries bias terms or an affine map: give the affine map to the sum "
                             "(affine=) and fit the blocks without bias terms")
        if O is None:
            out.append(h)
            continue
        O = np.asarray(O, dtype=np.float64)
        if O.ndim != 2 or O.shape[1] != h.d_out or not np.isfinite(O).all():
            raise InputError(f"output map {b} has shape {O.shape}, expected (D_out, {h.d_out}) of finite numbers")
        out.append(dataclasses.replace(h, U=np.ascontiguousarray(O @ h.U), info=dict(h.info)))
    weight, bias = (None, None) if affine is None else (np.asarray(affine[0], dtype=np.float64),
                                                        np.asarray(affine[1], dtype=np.float64))
    return HeadsSum(out, info={"fitted": "block by block"}, affine_weight=weight, affine_bias=bias)
