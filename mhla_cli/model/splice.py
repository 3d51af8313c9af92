"""Fitted heads spliced into a Hugging Face model in place of one attention head or a whole attention layer
(optional: torch; `import mhla_cli` does not import this module).

`Replacement` is the fitted function as a torch module: the layer's input X (B, n, D) -> its output (B, n, d_out)
at every position, in the layout the heads were fitted in (bidirectional: every position reads the whole window;
causal: the prefix), with padded batches (`attention_mask`). `splice(model, heads, layer, head)` puts it in the
model: one head's columns of the context before the output projection W_O (d_out = the head's width), or (head
None) the projection's output W_O context, its bias still added (d_out = the model's width). The result is a
context manager that removes its hooks on exit, also on an exception (`attach()` / `remove()` for a lasting
splice). `tl_hooks` gives the same replacement as TransformerLens hook functions (`hook_z` of a head,
`hook_attn_out` of a layer).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import numpy as np

try:
    import torch
    from torch import nn
except ImportError:  # pragma: no cover - the message names the extra
    raise ImportError("mhla_cli.model.splice needs PyTorch: pip install 'torch>=2.1' (mhla's [torch] extra)") from None

from ..errors import InputError
from ..samples import BIDIRECTIONAL, CAUSAL, Samples, fitted_layout, named
from .heads import Heads

# Where a Hugging Face model keeps its layers (the first path that exists), and in each layer the attention module
# (its first argument: the tokens X the heads read) and the output projection W_O (its input: the heads' outputs
# side by side, the context): BERT-like, GPT-2, Llama-like and GPT-NeoX models.
LAYER_PATHS = ("encoder.layer", "bert.encoder.layer", "roberta.encoder.layer", "transformer.h", "h",
               "model.layers", "layers", "gpt_neox.layers")
ATTENTION_PATHS = (("attention.self", "attention.output.dense"), ("attn", "attn.c_proj"),
                   ("self_attn", "self_attn.o_proj"), ("attention", "attention.dense"))


def _layout(heads: Heads, layout: str | Samples | None) -> Samples:
    """The per-position layout of the replacement: `layout` (a name or a Samples), else the one the heads record."""
    if layout is None:
        fitted = fitted_layout(heads.info)
        if not fitted.per_position:
            raise InputError("the heads record no per-position layout (fitted at the last token): give "
                             "layout='causal' or 'bidirectional'")
        return fitted
    out = named(layout) if isinstance(layout, str) else layout
    if not out.per_position:
        raise InputError(f"layout {out.name!r} is not a per-position layout")
    return out


def load_heads_any(heads: Heads | str | os.PathLike) -> Heads:
    """Heads, or the heads of a heads file (any format of `mhla export-heads`)."""
    if isinstance(heads, Heads):
        return heads
    from .model import load_function

    fn = load_function(heads)
    if not isinstance(fn, Heads):
        raise InputError("is a model file: splice its heads (mhla export-heads MODEL -o heads.h5, put back in "
                         "the wide coordinates for heads fitted on reduced tokens)", heads)
    return fn


class Replacement(nn.Module):
    """Fitted heads as the replacement of an attention head or layer: forward(X, attention_mask=None) maps the
    layer's input X (B, n, D) (or (n, D)) to the outputs (B, n, d_out) at every position, float64.

    `heads`: Heads, or a heads file; factored heads (`mhla export-heads --unreduce`) take the model's
    tokens as they are, and `reduction` (a `Reduction` or maps (P, U)) puts reduced heads back in the model's
    coordinates (the same). `layout`: "bidirectional", "causal" or a Samples (default: the heads' own).
    `offset` (d_out,): added at every unmasked position (e.g. the training mean in the output directions a
    reduction drops). Masked positions (attention_mask 0) are no tokens and output 0.
    """

    def __init__(self, heads: Heads | str | os.PathLike, layout: str | Samples | None = None,
                 offset: Any = None, reduction: Any = None, dtype: Any = None) -> None:
        super().__init__()
        h = load_heads_any(heads)
        if reduction is not None:
            from .reduce import Reduction, unreduce_heads

            if not isinstance(reduction, Reduction):
                P, U = reduction
                reduction = Reduction(np.asarray(P, dtype=np.float64), np.asarray(U, dtype=np.float64))
            red = reduction
            h = unreduce_heads(h, red)
        self.heads = h
        self.layout = _layout(h, layout)
        dtype = torch.float64 if dtype is None else dtype
        self.module: Any = h.to_torch(dtype)
        self.d, self.d_out = h.d, h.d_out
        if offset is not None and np.shape(offset) != (h.d_out,):
            raise InputError(f"offset has shape {np.shape(offset)}, expected ({h.d_out},) (the heads' outputs)")
        self.offset: torch.Tensor | None
        self.register_buffer("offset", None if offset is None else torch.as_tensor(
            np.asarray(offset, dtype=np.float64)).to(dtype))

    @classmethod
    def constant(cls, value: Any, d: int, layout: str | Samples | None = None) -> Replacement:
        """The replacement that outputs `value` (d_out,) at every unmasked position of d-dim tokens (an ablation:
        zero, or the mean output)."""
        value = np.asarray(value, dtype=np.float64)
        zero = Heads(V=np.zeros((1, 1, 1)), Q=np.zeros((1, 1, 1)), P=np.zeros((int(d), 1)),
                     U=np.zeros((value.size, 1)))
        return cls(zero, layout=BIDIRECTIONAL if layout is None else layout, offset=value)

    def extra_repr(self) -> str:
        return f"d={self.d}, d_out={self.d_out}, layout={self.layout.name!r}"

    def forward(self, X: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        single = X.dim() == 2
        if single:
            X = X.unsqueeze(0)
            attention_mask = None if attention_mask is None else torch.as_tensor(attention_mask).unsqueeze(0)
        if X.dim() != 3 or X.shape[-1] != self.d:
            raise InputError(f"the replacement takes tokens (B, n, {self.d}), got shape {tuple(X.shape)}: splice "
                             f"it where the layer's input has {self.d} dimensions")
        mask = None if attention_mask is None else torch.as_tensor(attention_mask, device=X.device)
        Z = X.to(self.module.V.dtype)
        wide = Z if self.heads.affine_weight is not None else None
        out = self.module(Z, layout=self.layout, attention_mask=mask, wide=wide)
        if self.offset is not None:
            add = self.offset.expand_as(out)
            out = out + (add if mask is None else add * mask.to(out.dtype).unsqueeze(-1))
        return out[0] if single else out


class BlocksReplacement(nn.Module):
    """A sum of blocks (mhla_cli.model.heads_sum.HeadsSum) as a replacement: forward(X, attention_mask=None) -> (B, n,
    D_out), the sum of every block's `Replacement`, the affine map of the token and `offset` at every unmasked
    position (masked positions output 0)."""

    def __init__(self, blocks: Any, layout: str | Samples | None = None, offset: Any = None, dtype: Any = None
                 ) -> None:
        super().__init__()
        dtype = torch.float64 if dtype is None else dtype
        parts = [Replacement(h, layout=layout, dtype=dtype) for h in blocks.parts]
        self.parts = nn.ModuleList(parts)
        self.layout, self.d, self.d_out = parts[0].layout, parts[0].d, parts[0].d_out
        self.weight: torch.Tensor | None
        self.bias: torch.Tensor | None
        affine = blocks.affine_weight is not None
        self.register_buffer("weight", torch.as_tensor(blocks.affine_weight).to(dtype) if affine else None)
        self.register_buffer("bias", torch.as_tensor(blocks.affine_bias).to(dtype) if affine else None)
        if offset is not None and np.shape(offset) != (self.d_out,):
            raise InputError(f"offset has shape {np.shape(offset)}, expected ({self.d_out},) (the blocks' outputs)")
        self.offset: torch.Tensor | None
        self.register_buffer("offset", None if offset is None else torch.as_tensor(
            np.asarray(offset, dtype=np.float64)).to(dtype))

    def extra_repr(self) -> str:
        return f"blocks={len(self.parts)}, d={self.d}, d_out={self.d_out}, layout={self.layout.name!r}"

    def forward(self, X: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        out = sum(part(X, attention_mask) for part in self.parts)
        assert isinstance(out, torch.Tensor)
        add = None
        if self.weight is not None:
            assert self.bias is not None  # set with the weight
            add = X.to(self.weight.dtype) @ self.weight.T + self.bias
        if self.offset is not None:
            add = self.offset if add is None else add + self.offset
        if add is not None:
            add = add.expand_as(out)
            if attention_mask is not None:
                mask = torch.as_tensor(attention_mask, device=X.device).to(out.dtype)
                add = add * mask.unsqueeze(-1)
            out = out + add
        return out


def _path(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def locate(model: Any, layer: int) -> tuple[Any, Any, int]:
    """(the attention module, the output projection, the number of heads) of `layer` of a Hugging Face model."""
    layers = next((found for p in LAYER_PATHS if (found := _path(model, p)) is not None), None)
    if layers is None:
        raise InputError(f"cannot find the layers of a {type(model).__name__} (tried {', '.join(LAYER_PATHS)}): "
                         "pass attention= and projection=")
    if not 0 <= int(layer) < len(layers):
        raise InputError(f"layer {layer}: the model has {len(layers)} layers (0 to {len(layers) - 1})")
    for att, proj in ATTENTION_PATHS:
        a, p = _path(layers[int(layer)], att), _path(layers[int(layer)], proj)
        if a is not None and p is not None:
            cfg = getattr(model, "config", None)
            n_heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
            return a, p, int(n_heads) if n_heads else 0
    raise InputError(f"cannot find the attention of layer {layer} of a {type(model).__name__}: pass attention= "
                     "and projection=")


class Splice:
    """A replacement spliced into a Hugging Face model (`splice`): a context manager (the hooks are removed on exit,
    also on an exception) or, with `attach()` / `remove()`, a lasting splice. `label` names it in judgements."""

    def __init__(self, model: Any, replacement: Callable[..., torch.Tensor], layer: int, head: int | None,
                 attention: Any, projection: Any, n_heads: int, label: str = "spliced") -> None:
        self.model, self.replacement, self.layer, self.head = model, replacement, int(layer), head
        self.attention, self.projection, self.label = attention, projection, label
        self.n_heads = n_heads
        self._handles: list[Any] = []
        self._state: dict[str, Any] = {}

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> Splice:
        """Register the hooks (the model computes with the replacement until `remove()`)."""
        if self._handles:
            raise RuntimeError("this splice is attached already")
        st = self._state

        # the position of attention_mask among the model's arguments (GPT-2's second is past_key_values)
        names = list(inspect.signature(self.model.forward).parameters)
        at = names.index("attention_mask") if "attention_mask" in names else None

        def model_pre(module: Any, args: tuple, kwargs: dict) -> None:
            mask = kwargs.get("attention_mask", args[at] if at is not None and len(args) > at else None)
            st["mask"] = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

        def attention_pre(module: Any, args: tuple, kwargs: dict) -> None:
            st["X"] = args[0] if args else kwargs["hidden_states"]

        self._handles = [self.model.register_forward_pre_hook(model_pre, with_kwargs=True),
                         self.attention.register_forward_pre_hook(attention_pre, with_kwargs=True)]
        if self.head is None:
            self._handles.append(self.projection.register_forward_hook(self._layer_hook))
        else:
            self._handles.append(self.projection.register_forward_pre_hook(self._head_hook))
        return self

    def remove(self) -> None:
        """Remove the hooks: the model computes as before."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._state.clear()

    def __enter__(self) -> Splice:
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def outputs(self) -> torch.Tensor:
        """The replacement's outputs on the layer's input of the current forward pass (B, n, d_out)."""
        X = self._state.get("X")
        if X is None:
            raise RuntimeError("the attention module did not run before its output projection")
        mask = self._state.get("mask")
        if mask is not None and tuple(mask.shape) != tuple(X.shape[:2]):
            raise InputError(f"attention_mask has shape {tuple(mask.shape)} but the layer's input {tuple(X.shape)}"
                             " (a cache of earlier positions cannot be spliced: run the whole sequence)")
        return self.replacement(X, mask)

    def _head_hook(self, module: Any, args: tuple) -> tuple:
        context = args[0]
        dh = context.shape[-1] // self.n_heads
        y = self.outputs()
        if y.shape[-1] != dh:
            raise InputError(f"the replacement outputs {y.shape[-1]} dimensions but a head of layer {self.layer} has "
                             f"{dh}")
        new, h = context.clone(), int(self.head or 0)
        new[..., h * dh:(h + 1) * dh] = y.to(context.dtype)
        return (new, *args[1:])

    def _layer_hook(self, module: Any, args: tuple, output: torch.Tensor) -> torch.Tensor:
        y = self.outputs()
        if y.shape[-1] != output.shape[-1]:
            raise InputError(f"the replacement outputs {y.shape[-1]} dimensions but layer {self.layer}'s attention "
                             f"outputs {output.shape[-1]}")
        bias = getattr(module, "bias", None)
        y = y.to(output.dtype)
        return y if bias is None else y + bias


def splice(model: Any, heads: Heads | str | os.PathLike | Callable[..., Any], layer: int, head: int | None = None,
           *, layout: str | Samples | None = None, offset: Any = None, reduction: Any = None,
           attention: Any = None, projection: Any = None, label: str = "spliced") -> Splice:
    """`heads` (Heads, a heads file, a `Replacement`, or any callable (X (B, n, D), mask (B, n) or None) ->
    (B, n, d_out)) in place of head `head` of `layer` of a Hugging Face model (its columns of the context before
    W_O) or, `head` None, of the layer's attention output before the projection's bias (W_O context). Use as
    `with splice(...):` (the hooks are removed on exit) or `.attach()` / `.remove()`. The padding mask is the
    `attention_mask` the model is called with. `attention` / `projection`: the attention module (its first
    argument the tokens the heads read) and W_O, for models `locate` does not know."""
    if attention is None or projection is None:
        found_att, found_proj, n_heads = locate(model, layer)
        attention, projection = attention or found_att, projection or found_proj
    else:
        cfg = getattr(model, "config", None)
        n_heads = int(getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", 0) or 0)
    if head is not None and not 0 <= int(head) < max(n_heads, 1):
        raise InputError(f"head {head}: layer {layer} has {n_heads} heads (0 to {n_heads - 1})")
    rep: Callable[..., Any]
    if callable(heads) and not isinstance(heads, Heads):  # a replacement given as a module or function
        if layout is not None or offset is not None or reduction is not None:
            raise InputError("layout=, offset= and reduction= are the heads' (splice(model, heads, ...) or "
                             "Replacement(heads, ...)); a replacement given as a module or function has its own")
        rep = heads
    elif hasattr(heads, "parts") and not isinstance(heads, (str, os.PathLike)):  # a sum of blocks (model.heads_sum)
        if reduction is not None:
            raise InputError("reduction= is for reduced heads; the blocks of a sum are in the model's coordinates")
        rep = BlocksReplacement(heads, layout=layout, offset=offset)
    else:
        rep = Replacement(heads, layout=layout, offset=offset, reduction=reduction)
    return Splice(model, rep, layer, None if head is None else int(head), attention, projection, n_heads, label)


def ablate(model: Any, layer: int, head: int | None = None, mean: Any = None) -> Splice:
    """The head (or the layer's attention output) replaced by zero, or by `mean` (its mean output): the ablation
    of the loss recovered (`mhla_cli.model.judge`); label "zero-ablated" or "mean-ablated"."""
    _, proj, n_heads = locate(model, layer)
    width = int(mean.shape[-1]) if mean is not None else None
    if width is None:
        weight = getattr(proj, "weight")
        full = int(weight.shape[0]) if isinstance(proj, nn.Linear) else int(weight.shape[1])
        width = full if head is None else full // n_heads
    value = np.zeros(width) if mean is None else np.asarray(mean, dtype=np.float64)
    d_in = int(getattr(model.config, "hidden_size", None) or model.config.n_embd)
    return splice(model, Replacement.constant(value, d_in), layer, head,
                  label="mean-ablated" if mean is not None else "zero-ablated")


def tl_hooks(replacement: Callable[..., Any], layer: int, head: int | None = None, *,
             input_hook: str | None = None, output_hook: str | None = None, attention_mask: Any = None,
             bias: Any = None) -> list[tuple[str, Callable[..., Any]]]:
    """The replacement as TransformerLens hook functions for `model.run_with_hooks(fwd_hooks=...)`: the first
    records the layer's input at `input_hook` (default `blocks.{layer}.ln1.hook_normalized`), the second replaces
    `hook_z[:, :, head]` (the head's output before W_O) or, head None, `hook_attn_out` (then `bias`, e.g. b_O,
    is added). `attention_mask` (B, n): the padding of the batch."""
    seen: dict[str, Any] = {}
    input_hook = input_hook or f"blocks.{layer}.ln1.hook_normalized"
    output_hook = output_hook or (f"blocks.{layer}.attn.hook_z" if head is not None else f"blocks.{layer}.hook_attn_out")

    def record(x: torch.Tensor, hook: Any = None) -> None:
        seen["X"] = x

    def replace(act: torch.Tensor, hook: Any = None) -> torch.Tensor:
        y = replacement(seen["X"], attention_mask).to(act.dtype)
        if head is None:
            return y if bias is None else y + torch.as_tensor(bias, dtype=act.dtype, device=act.device)
        new = act.clone()
        if act.dim() == 4:  # (B, n, H, d_head)
            new[:, :, int(head)] = y
        else:  # the heads side by side (B, n, H d_head)
            new[..., int(head) * y.shape[-1]:(int(head) + 1) * y.shape[-1]] = y
        return new

    return [(input_hook, record), (output_hook, replace)]


# The safetensors file of a replacement (`save_replacement`): its metadata "format", and the version of its layout.
REPLACEMENT_FORMAT = "mhla-replacement"
REPLACEMENT_VERSION = 1


def replacement_arrays(rep: Replacement) -> dict[str, np.ndarray]:
    """The arrays of the replacement file (docs/splice.md): V (H, r_out, r + 1), Q (H, r + 1, r + 1) of the tokens
    z = ((x P - centre), 1) (the bias terms in the last row / column: zero without them), P (D, r), centre (r,),
    U (d_out, r_out), affine_weight (d_out, D), affine_bias (d_out,), offset (d_out,); float64."""
    h = rep.heads
    V, Q = h.augmented_centred()
    if not h.bias_terms:  # pad to the tokens (z, 1): no term of the constant
        V = np.concatenate([V, np.zeros((*V.shape[:2], 1))], axis=2)
        Q = np.pad(Q, ((0, 0), (0, 1), (0, 1)))
    r, D, d_out = Q.shape[1] - 1, h.d, h.d_out
    P = h.P if h.P is not None else np.eye(D)
    U = h.U if h.U is not None else np.eye(d_out)
    arrays = {"V": V, "Q": Q, "P": P, "centre": np.zeros(r) if h.token_centre is None else h.token_centre, "U": U,
              "affine_weight": np.zeros((d_out, D)) if h.affine_weight is None else h.affine_weight,
              "affine_bias": np.zeros(d_out) if h.affine_bias is None else h.affine_bias,
              "offset": np.zeros(d_out) if rep.offset is None else rep.offset.detach().cpu().double().numpy()}
    return {k: np.ascontiguousarray(v, dtype=np.float64) for k, v in arrays.items()}


def replacement_config(rep: Replacement, layer: int, head: int | None) -> dict[str, Any]:
    """The config of the replacement file: the hook points it reads and replaces, its layout and widths."""
    if rep.layout not in (BIDIRECTIONAL, CAUSAL):
        raise InputError(f"a replacement file holds a bidirectional or causal replacement, not {rep.layout.name!r}")
    h = rep.heads
    what = "head" if head is not None else "layer"
    hf_out = (f"the input columns {head} * d_out to ({head} + 1) * d_out of the output projection W_O"
              if head is not None else "the output of the output projection W_O, before its bias")
    return {"format": REPLACEMENT_FORMAT, "version": REPLACEMENT_VERSION, "replaces": what, "layer": int(layer),
            "head": None if head is None else int(head), "attention": rep.layout.name,
            "normalize": str(h.info.get("normalize", "none")), "d_model": h.d, "d_out": h.d_out,
            "n_heads": h.n_heads, "bias_terms": h.bias_terms, "affine": h.affine_weight is not None,
            "factored": h.factored,
            "hook_points": {
                "transformers": {"reads": "the first argument (hidden_states) of the layer's attention module",
                                 "replaces": hf_out},
                "transformer_lens": {"reads": f"blocks.{layer}.ln1.hook_normalized",
                                     "replaces": f"blocks.{layer}.attn.hook_z[:, :, {head}]" if head is not None
                                     else f"blocks.{layer}.hook_attn_out (less b_O)"}}}


def save_replacement(path: str | os.PathLike, replacement: Replacement, layer: int, head: int | None = None) -> None:
    """Write the replacement of head `head` (None: the attention output) of `layer` as a .safetensors file
    (`replacement_arrays`; metadata "format" = "mhla-replacement", "config" = `replacement_config` as JSON), atomically;
    an existing file is replaced only when mhla wrote it. Loadable with torch and safetensors alone (docs/splice.md)."""
    import json

    from ..io import formats
    from .export import safetensors_module

    st = safetensors_module()
    if not str(path).endswith(".safetensors"):
        raise InputError("a replacement file is a .safetensors file: give a name ending in .safetensors", path)
    formats.check_output_path(path, (), "replacement")
    config = replacement_config(replacement, layer, head)
    arrays = replacement_arrays(replacement)
    with formats.atomic_path(path) as tmp:
        st.save_file(arrays, str(tmp), metadata={"format": REPLACEMENT_FORMAT, "config": json.dumps(config)})
