"""`mhla inspect`: what an mhla file is and whether it is valid."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..api.inspect import inspect_file
from ..io.formats import MANIFEST_ATTR
from .console import emit_json, say
from .options import JsonOpt


def inspect_cmd(
    path: Annotated[Path, typer.Argument(help="Any mhla file (tokens, features, model, heads, predictions), or a Zarr features "
                                                 "store (.zarr).")],
    json_out: JsonOpt = False,
) -> None:
    """Say what kind of mhla file this is, its shapes and attributes, and whether it is valid.

    Exit 0 when valid, 2 otherwise. Example: mhla inspect feats.h5 --json
    """
    from rich.markup import escape

    from .options import data_location

    rep = inspect_file(data_location(path))
    if not rep["valid"]:
        rep["exit_code"] = 2
    if json_out:
        emit_json(rep)
    else:
        say(escape(f"{path}: {rep['kind'] or 'unknown'} file, {'valid' if rep['valid'] else 'INVALID'}"))
        for key in ("layout", "d", "d_out", "n_features", "n_samples", "n_tokens", "n_heads", "dtype", "has_targets",
                    "per_position", "attention", "has_weights", "normalize", "gram_form", "tile_features",
                    "n_undetermined"):
            if rep.get(key) is not None and not (key == "d_out" and rep[key] == rep.get("d")):
                say(escape(f"  {key} = {rep[key]}"))
        for name, ds in rep["datasets"].items():
            if "shape" in ds:
                say(escape(f"  {name}: shape {tuple(ds['shape'])}, {ds['dtype']}"))
            else:
                say(escape(f"  {name}: group"))
        for k, v in rep["attrs"].items():
            say(escape(f"  @{k} = {_manifest_words(v) if k == MANIFEST_ATTR else v}"))
    if not rep["valid"]:
        # The same one-line error the other commands print (stderr), after the report.
        sys.stderr.write(f"mhla: error: {' '.join(str(rep['error']).split())}\n")
        raise typer.Exit(2)


def _manifest_words(value: object) -> str:
    """The manifest in a few words (its checksums are in --json)."""
    try:
        m = json.loads(value) if isinstance(value, str) else dict(value)  # type: ignore[call-overload]  # an attribute mapping
        return (f"{m.get('hash', '?')} of {len(m.get('datasets', {}))} datasets"
                + (f", {len(m['tiles'])} tiles" if m.get("tiles") else "") + " and the header (--json: the checksums)")
    except (TypeError, ValueError):
        return str(value)


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect_cmd)
