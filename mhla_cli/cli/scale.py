"""Commands for large and distributed runs: merge the shards of a job array."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .. import formats
from ..merge import merge_features
from ._common import JsonOpt, OutOpt, QuietOpt, emit_json, say, warn


def merge_cmd(
    parts: Annotated[list[Path], typer.Argument(metavar="PART...", help="Features files from "
                                                "`mhla featurize DATA --shard i/M`.")],
    output: OutOpt,
    allow_partial: Annotated[bool, typer.Option("--allow-partial", help="Merge even if some samples of the "
                                                "source are not covered (the output records which are).")] = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Sum shard statistics into one features file, equal to a single-pass featurize.

    Refuses (exit 2) parts of different sources, overlapping sample ranges, and missing ranges
    (unless --allow-partial).

    Example: mhla merge part_*.h5 -o feats.h5 --json
    """
    formats.check_output_path(output, tuple(parts))
    feats, report = merge_features(list(parts), allow_partial=allow_partial)
    feats.save(output, inputs=tuple(parts))
    out = {"output": str(output), "d": feats.d, "n_features": feats.n_features, "n_samples": feats.n_samples,
           "n_tokens": feats.n_tokens, "has_targets": feats.has_targets,
           "sample_range": list(feats.sample_range) if feats.sample_range else None, **report.to_dict()}
    if report.partial:
        warn(f"partial merge: missing samples {', '.join(f'{a}..{b}' for a, b in report.missing)}")
    say(f"wrote {output}: {len(parts)} parts, N = {feats.n_samples} samples"
        + (f" of {report.n_samples_source}" if report.n_samples_source is not None else "")
        + f", d = {feats.d}", quiet)
    if json_out:
        emit_json(out)


def register(app: typer.Typer) -> None:
    app.command("merge")(merge_cmd)
