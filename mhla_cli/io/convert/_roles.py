"""The arrays' roles: the names of a tokens file's datasets, `--key ROLE=NAME`, and the check that
what remains is a tokens file's arrays."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ._source import _Source
from ...errors import InputError

NAMES = ("tokens", "offsets", "targets", "weights")
# Names of a model's activations read as the tokens when no array is named `tokens` (Hugging Face).
TOKEN_ALIASES = ("last_hidden_state", "hidden_states")
# Names of a padding mask: attention_mask (N, n) of 0/1, or lengths (N,) (the first lengths[i] kept).
MASK_NAMES = ("attention_mask", "lengths")
# Roles of --key ROLE=NAME.
ROLES = ("tokens", "targets", "weights", "offsets", "mask")


def parse_keys(keys: Sequence[str] | None) -> dict[str, str]:
    """--key options ROLE=NAME -> {NAME: ROLE} (ROLE: tokens, targets, weights, offsets, mask)."""
    out: dict[str, str] = {}
    for k in keys or ():
        role, sep, name = str(k).partition("=")
        if not sep or not name or role not in ROLES:
            raise InputError(f"--key {k}: expected ROLE=NAME with ROLE one of {', '.join(ROLES)} (e.g. "
                             "--key tokens=hidden)")
        if name in out and out[name] != role:
            raise InputError(f"--key: '{name}' is given two roles ({out[name]} and {role})")
        out[name] = role
    roles = list(out.values())
    dup = sorted({r for r in roles if roles.count(r) > 1})
    if dup:
        raise InputError(f"--key: more than one array given the role {', '.join(dup)}")
    return out


def _rename(sources: list[_Source], keymap: dict[str, str], mask: str | None) -> tuple[list[_Source], str | None]:
    """Sources renamed by --key (the mask role names the mask) and the token aliases; the mask's name."""
    out = []
    for s in sources:
        role = keymap.get(s.name)
        if role == "mask":
            mask = s.name
        elif role is not None:
            s = dataclasses.replace(s, name=role)
        out.append(s)
    names = [s.name for s in out]
    if "tokens" not in names:
        alias = [a for a in TOKEN_ALIASES if a in names]
        if alias:
            out = [dataclasses.replace(s, name="tokens") if s.name == alias[0] else s for s in out]
    return out, mask


def _check_names(sources: list[_Source], where: str) -> None:
    names = [s.name for s in sources]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InputError(f"more than one array named {', '.join(repr(d) for d in dup)}", where)
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise InputError(f"unknown array{'s' if len(unknown) > 1 else ''} {', '.join(repr(u) for u in unknown)}: "
                         "a tokens file holds only tokens, offsets, targets and weights (rename the arrays, map "
                         "them with --key ROLE=NAME, or name a .npy file NAME=FILE)", where)
    if "tokens" not in names:
        found = ", ".join(repr(n) for n in names) or "nothing"
        raise InputError(f"no 'tokens' array (found {found}; name one with --key tokens=NAME)", where)
