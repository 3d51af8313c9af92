"""The arrays' roles: the names of a tokens file's datasets, `--key ROLE=NAME[HEAD]`, and the check
that what remains is a tokens file's arrays.

`--key ROLE=NAME` reads the array NAME as ROLE. `NAME[h]` takes head h of an array of 4 axes
[batch, pos, head, d] (TransformerLens's `blocks.L.attn.hook_result`, `hook_z`, `hook_attn_in`);
`NAME[sum]` their sum over the heads (in float64). An array
picked by --key is used under its role only.

A TransformerLens 4 `TransformerBridge` computes Hugging Face's numerics, or, after
`enable_compatibility_mode()`, those of HookedTransformer's processed weights (LayerNorm folded, writing
weights centred, value biases folded: `hook_z` differs by the value bias); its keys are the same either way.
`compat_record` takes the record of which (the dict entry `COMPAT_KEY`, or `--compatibility-mode`),
written as the tokens file's attribute `formats.COMPAT_ATTR`; a bridge cache (`BRIDGE_HOOK`) without it is refused.

Hook points (a name whose last dotted part starts with `hook_`, as in a TransformerLens cache) and
the columns of a datasets directory are a store of many activations: those no --key picks are left
out; any other array must be named as a dataset of a tokens file.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._source import _Source
from ...errors import InputError, Refused

NAMES = ("tokens", "offsets", "targets", "weights")
# Names of a model's activations read as the tokens when no array is named `tokens` (Hugging Face).
TOKEN_ALIASES = ("last_hidden_state", "hidden_states")
# Names of a padding mask: attention_mask (N, n) of 0/1, or lengths (N,) (the first lengths[i] kept).
MASK_NAMES = ("attention_mask", "lengths")
# Names an array may take from its file (NAME=FILE, or a .npy file's stem).
FILE_NAMES = NAMES + MASK_NAMES
# Roles of --key ROLE=NAME.
ROLES = ("tokens", "targets", "weights", "offsets", "mask")
# Bytes of input rows read at once while one head (or the sum over heads) is taken from them.
_HEAD_BYTES = 16 << 20
# The dict entry of a torch file that records whether compatibility mode was on (bridge.compatibility_mode).
COMPAT_KEY = "compatibility_mode"
# Hook names of a TransformerLens 4 TransformerBridge cache that a HookedTransformer / HookedEncoder (2.x) lacks.
BRIDGE_HOOK = re.compile(r"^blocks\.\d+\.(hook_in|hook_out|(attn|mlp)\.hook_(in|out)|attn\.[qkvo]\.hook_(in|out))$")
_SELECTOR = re.compile(r"^(?P<name>.+)\[(?P<sel>[^\[\]]*)\]$")


@dataclass(frozen=True)
class Pick:
    """`--key ROLE=NAME[HEAD]`: the array NAME read as ROLE; HEAD None (all of it), a head's index,
    or "sum" (the sum over the heads)."""

    role: str
    name: str
    head: int | str | None = None

    def __str__(self) -> str:
        return f"{self.role}={self.name}" + ("" if self.head is None else f"[{self.head}]")


def parse_keys(keys: Sequence[str] | None) -> dict[str, Pick]:
    """--key options ROLE=NAME, ROLE=NAME[h] or ROLE=NAME[sum] -> {ROLE: Pick}."""
    out: dict[str, Pick] = {}
    for k in keys or ():
        role, sep, spec = str(k).partition("=")
        if not sep or not spec or role not in ROLES:
            raise Refused(f"{{key:{k}}}: expected ROLE=NAME with ROLE one of {', '.join(ROLES)} (e.g. "
                          "{key:tokens=hidden}, {key:targets=blocks.3.attn.hook_result[5]})", key={})
        name, head = spec, None
        m = _SELECTOR.match(spec)
        if m:
            name, sel = m["name"], m["sel"].strip()
            if sel != "sum" and not sel.isdigit():
                raise Refused(f"{{key:{k}}}: [{sel}] picks heads: a head's number (NAME[3]) or the sum over the "
                              "heads (NAME[sum])", key={})
            if role in ("offsets", "mask"):
                raise Refused(f"{{key:{k}}}: [{sel}] picks heads of tokens, targets or weights, not of {role}", key={})
            head = "sum" if sel == "sum" else int(sel)
        pick = Pick(role, name, head)
        if role in out:
            raise Refused(f"{{keys}}: more than one array given the role {role} ({out[role]} and {pick})", keys={})
        same = [p for p in out.values() if (p.name, p.head) == (name, head)]
        if same:
            raise Refused(f"{{keys}}: '{spec}' is given two roles ({same[0].role} and {role})", keys={})
        out[role] = pick
    return out


def is_spare(s: _Source) -> bool:
    """Whether `s` is one activation of a store of many, left out unless --key picks it."""
    return s.spare or s.name.rpartition(".")[2].startswith("hook_")


def _head(s: _Source, pick: Pick) -> _Source:
    """The array `s` under its role: whole, one head, or summed over the heads (axis 2 of 4)."""
    if pick.head is None:
        if len(s.shape) == 4 and pick.role in ("tokens", "targets"):
            raise Refused(f"'{s.name}' has shape {s.shape}, with an axis of {s.shape[-2]} heads: pick one head "
                          f"with {{key:{pick.role}={s.name}[h]}} (h = 0..{s.shape[-2] - 1}) or their sum with "
                          f"{{key:{pick.role}={s.name}[sum]}}", s.label, key={})
        return dataclasses.replace(s, name=pick.role, spare=False)
    if len(s.shape) != 4:  # (N, n, d) has no head axis: its axis -2 is the positions
        raise Refused(f"{{key:{pick}}}: '{s.name}' has shape {s.shape}; NAME[h] picks a head of an array of 4 axes "
                      "[batch, pos, head, d]", s.label, key={})
    H = s.shape[-2]
    if pick.head != "sum" and not int(pick.head) < H:
        raise Refused(f"{{key:{pick}}}: '{s.name}' has {H} heads (shape {s.shape}): heads are 0..{H - 1}", s.label,
                      key={})
    shape = s.shape[:-2] + s.shape[-1:]
    dtype = np.dtype(np.float64) if pick.head == "sum" else s.dtype
    head = -1 if pick.head == "sum" else int(pick.head)  # the head's index on axis 2 (-1: the sum)
    step = max(1, _HEAD_BYTES // max(1, s.row_bytes))

    def read(a: int, b: int) -> np.ndarray:
        out = np.empty((b - a, *shape[1:]), dtype)
        for lo in range(a, b, step):  # bounded: a block of rows of all heads at a time
            hi = min(b, lo + step)
            rows = np.asarray(s.read(lo, hi))
            out[lo - a:hi - a] = (rows.sum(axis=-2, dtype=np.float64) if pick.head == "sum"
                                  else np.take(rows, head, axis=2))  # rows (batch, pos, head, d)
        return out

    return _Source(pick.role, shape, dtype, read, s.label)


def _pick(sources: list[_Source], keymap: dict[str, Pick], mask: str | None) -> tuple[list[_Source], str | None]:
    """The sources under the roles --key gives them (the mask role names the mask) and the token
    aliases; the mask's name."""
    by = {s.name: s for s in sources}
    picked, used = [], set()
    for role, pick in keymap.items():
        s = by.get(pick.name)
        if s is None:
            continue  # in another input (convert_files refuses a name no input holds)
        if role == "mask":
            mask = pick.name
            continue
        used.add(pick.name)
        picked.append(_head(s, pick))
    out = [s for s in sources if s.name not in used] + picked
    names = [s.name for s in out]
    if "tokens" not in names:
        alias = [a for a in TOKEN_ALIASES if a in names]
        if alias:
            out = [dataclasses.replace(s, name="tokens") if s.name == alias[0] else s for s in out]
    return out, mask


def _check_names(sources: list[_Source], where: str) -> list[_Source]:
    """The arrays of the tokens file (spare hooks left out), refusing unknown names, a name twice and
    no tokens."""
    spare = [s.name for s in sources if is_spare(s)]
    sources = [s for s in sources if not is_spare(s)]
    names = [s.name for s in sources]
    if "tokens" not in names and spare:  # a store of hooks: say how to pick them before anything else
        listed = ", ".join(repr(n) for n in spare[:4]) + (f", ... ({len(spare)} in all)" if len(spare) > 4 else "")
        raise Refused(f"no 'tokens' array: pick the activations with {{key:tokens=NAME}} and {{key:targets=NAME}} "
                      f"(NAME[h]: head h of a [batch, pos, head, d] hook; NAME[sum]: their sum) from {listed}",
                      where, key={})
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InputError(f"more than one array named {', '.join(repr(d) for d in dup)}", where)
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise Refused(f"unknown array{'s' if len(unknown) > 1 else ''} {', '.join(repr(u) for u in unknown)}: "
                      "a tokens file holds only tokens, offsets, targets and weights (rename the arrays, map "
                      "them with {key:ROLE=NAME}, or name a .npy file NAME=FILE)", where, key={})
    if "tokens" not in names:
        found = ", ".join(repr(n) for n in names) or "nothing"
        raise Refused(f"no 'tokens' array (found {found}; name one with {{key:tokens=NAME}})", where, key={})
    return sources


def compat_record(sources: list[_Source], option: bool | None, where: str) -> str | None:
    """Whether TransformerLens's compatibility mode was on ("on" / "off"), as the inputs' `COMPAT_KEY`
    entries and `option` (--compatibility-mode) say; None for other inputs. Refused: records that
    disagree, and a TransformerBridge cache (a hook only it names) without a record."""
    said = {s.label: bool(np.asarray(s.read(0, 1)).reshape(-1)[0]) for s in sources if s.name == COMPAT_KEY}
    values = set(said.values()) | ({option} if option is not None else set())
    if len(values) > 1:
        told = [f"{label}: {'on' if v else 'off'}" for label, v in said.items()]
        told += [f"{{compat_{'on' if option else 'off'}}}"] if option is not None else []
        raise Refused(f"the records of TransformerLens's compatibility mode disagree ({'; '.join(told)}): "
                      "activations of both kinds differ (hook_z by the value bias) and cannot be one file", where,
                      compat_on={}, compat_off={})
    if values:
        return "on" if values.pop() else "off"
    bridge = next((s.name for s in sources if BRIDGE_HOOK.match(s.name)), None)
    if bridge is not None:
        raise Refused(f"a TransformerLens 4 TransformerBridge cache ('{bridge}'), without a record of whether "
                      f"compatibility mode was on (its hook_z differ by the value bias): save "
                      f"'{COMPAT_KEY}': bridge.compatibility_mode in the dict, or give {{compat_either}}",
                      where, compat_either={})
    return None
