"""Sum the statistics of shards (``mhla featurize --shard i/M``) into one features file.

The statistics are sums over samples, so disjoint parts of one source add up to the single-pass
result. Each part records the sample range it covers and the identity of its source (path, size,
content fingerprint, number of samples); `merge_features` refuses parts of different sources or
with overlapping ranges, and, unless `allow_partial`, parts that leave samples uncovered.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from mhla_cli.io import formats
from mhla_cli.errors import InputError, Refused
from mhla_cli.linalg.memory import check_memory, merge_bytes
from mhla_cli.samples import LAST, Samples, from_attrs
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.files import store_location, zarr_store
from mhla_cli.statistics.files.features_file import expect_features


@dataclass
class PartInfo:
    """What a features file says about itself (read from its attributes only)."""

    path: str
    d: int
    n_samples: int
    ranges: list[tuple[int, int]]
    source: dict[str, Any]
    shard: str | None = None
    normalize: str = "none"
    samples: Samples = LAST  # what a sample was (mhla_cli.samples)
    bias_terms: bool = False  # the statistics of the tokens (x, 1) (docs/bias_terms.md)

    @property
    def label(self) -> str:
        rng = ", ".join(f"{a}..{b}" for a, b in self.ranges)
        return f"{self.path} (samples {rng}{f', shard {self.shard}' if self.shard else ''})"


@dataclass
class MergeReport:
    """Outcome of a merge: the parts in sample order, what they cover and what is missing."""

    parts: list[PartInfo]
    n_samples_source: int | None
    covered: list[tuple[int, int]]
    missing: list[tuple[int, int]] = field(default_factory=list)

    @property
    def partial(self) -> bool:
        return bool(self.missing)

    def to_dict(self) -> dict[str, Any]:
        return {"n_parts": len(self.parts), "parts": [p.path for p in self.parts],
                "n_samples_source": self.n_samples_source, "covered": [list(r) for r in self.covered],
                "missing": [list(r) for r in self.missing], "partial": self.partial}


@dataclass
class MergeResult:
    """What `merge_features` returns: the summed statistics and the report of the parts."""

    features: Features
    report: MergeReport

    def to_dict(self) -> dict[str, Any]:
        """The summary of `mhla merge --json` (without the output path): counts, sample range and the report."""
        f = self.features
        return {"d": f.d, "n_features": f.n_features, "n_samples": f.n_samples, "n_tokens": f.n_tokens,
                "has_targets": f.has_targets, "sample_range": list(f.sample_range) if f.sample_range else None,
                **self.report.to_dict()}


def read_part_info(path: str | os.PathLike) -> PartInfo:
    """The sample ranges and source of a features file (or Zarr features store), with a clear error if it
    has none."""
    if store_location.is_store(path):
        d, n, ranges, source, shard, normalize, n_seq, samples, bias_terms = zarr_store.part_info(path)
        _check_ranges(ranges, n_seq, path)
        return PartInfo(str(path), d, n, ranges, source, shard, normalize, samples, bias_terms)
    with formats.open_input(path) as f:
        expect_features(f, path)
        d = formats.read_attr_int(f, "d", path)
        n = formats.read_attr_int(f, "n_samples", path)
        attrs = f.attrs
        if "source" not in attrs or "sample_lo" not in attrs or "sample_hi" not in attrs:
            raise InputError("records no source or sample range, so it cannot be checked against the "
                             "other parts; make parts as shards of one tokens file", path)
        try:
            source = json.loads(_text(attrs["source"]))
        except (TypeError, ValueError):
            raise InputError("attribute 'source' is not valid JSON; the file is corrupted", path) from None
        if "sample_ranges" in attrs:  # a partial merge: the ranges it holds
            ranges = [(int(a), int(b)) for a, b in json.loads(_text(attrs["sample_ranges"]))]
        else:
            ranges = [(int(attrs["sample_lo"]), int(attrs["sample_hi"]))]
        shard = _text(attrs["shard"]) if "shard" in attrs else None
        normalize = formats.read_normalize(f, path)
        samples = from_attrs(attrs, path)
        bias_terms = formats.read_bias_terms(attrs, path)
        # per-position or weighted data count positions (weight > 0) as samples: ranges are of sequences
        n_seq = int(attrs["n_sequences"]) if "n_sequences" in attrs else n
    _check_ranges(ranges, n_seq, path)
    return PartInfo(str(path), d, n, ranges, source, shard, normalize, samples, bias_terms)


def _check_ranges(ranges: list[tuple[int, int]], n_seq: int, path: str | os.PathLike) -> None:
    if sum(b - a for a, b in ranges) != n_seq:
        raise InputError(f"n_samples = {n_seq} does not match its sample ranges {ranges}; the file is corrupted",
                         path)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _same_source(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("fingerprint", "size", "n_samples")
    return all(a.get(k) == b.get(k) for k in keys if k in a or k in b)


def plan_merge(paths: list[str | os.PathLike], allow_partial: bool = False) -> MergeReport:
    """Check that the parts fit together (same source, no overlap, no gap unless allowed)."""
    if not paths:
        raise InputError("no parts to merge")
    parts = [read_part_info(p) for p in paths]
    first = parts[0]
    for p in parts[1:]:
        if p.bias_terms != first.bias_terms:
            raise Refused(f"was featurized {'with' if p.bias_terms else 'without'} {{bias_terms}} but {first.path} "
                          f"{'without' if p.bias_terms else 'with'}: the statistics do not add up (featurize every "
                          "shard with the same {bias_terms})", p.path, bias_terms={})
        if p.d != first.d:
            raise InputError(f"has d = {p.d} but {first.path} has d = {first.d}: parts of different data", p.path)
        if p.normalize != first.normalize:
            raise InputError(f"was featurized with normalisation {p.normalize} but {first.path} with "
                             f"{first.normalize}: the statistics of different normalisations do not add up",
                             p.path)
        if p.samples != first.samples:
            raise Refused(f"holds {p.samples.name} samples but {first.path} {first.samples.name} samples: the "
                          "statistics of different sample layouts do not add up (featurize every shard with "
                          "{attention})", p.path, attention={})
        if not _same_source(p.source, first.source):
            raise InputError(
                f"comes from a different source than {first.path}: {_describe(p.source)} vs "
                f"{_describe(first.source)}; merge only parts of one tokens file", p.path)
    pieces = sorted((r, p) for p in parts for r in p.ranges)
    for (r0, p0), (r1, p1) in zip(pieces, pieces[1:]):
        if r1[0] < r0[1]:
            what = "is listed twice" if p0 is p1 or p0.path == p1.path else f"overlaps {p0.label}"
            raise InputError(f"samples {r1[0]}..{r1[1]} {what}: the overlap would be counted twice", p1.path)
    covered: list[tuple[int, int]] = []
    for r, _ in pieces:
        if covered and covered[-1][1] == r[0]:
            covered[-1] = (covered[-1][0], r[1])
        else:
            covered.append(r)
    total = first.source.get("n_samples")
    total = int(total) if total is not None else None
    missing = []
    pos = 0
    for a, b in covered:
        if a > pos:
            missing.append((pos, a))
        pos = b
    if total is not None and pos < total:
        missing.append((pos, total))
    if total is not None and pos > total:
        raise InputError(f"covers samples up to {pos} but its source has {total}", pieces[-1][1].path)
    report = MergeReport(sorted(parts, key=lambda p: p.ranges[0]), total, covered, missing)
    if missing and not allow_partial:
        gaps = ", ".join(f"{a}..{b}" for a, b in missing[:5]) + (" ..." if len(missing) > 5 else "")
        of = f" of {total}" if total is not None else ""
        raise InputError(f"the parts do not cover every sample{of}: missing samples {gaps} (half-open "
                         "ranges); add the missing shards, or allow a partial merge of what is there")
    return report


def _describe(src: dict[str, Any]) -> str:
    return (f"{src.get('path', '?')} (size {src.get('size', '?')}, fingerprint "
            f"{str(src.get('fingerprint', '?'))[:12]}, N = {src.get('n_samples', '?')})")


def merge_features(paths: list[str | os.PathLike], allow_partial: bool = False) -> MergeResult:
    """Sum the parts after `plan_merge`; the result records the covered ranges and the source."""
    report = plan_merge(paths, allow_partial)
    check_memory(report.parts[0].d, path=report.parts[0].path, need=merge_bytes, what="merge")
    total: Features | None = None
    for part in report.parts:
        feats = Features.load(part.path, part=True)  # an empty shard adds nothing
        if total is None:
            total = feats
        else:
            if feats.has_targets != total.has_targets:
                raise InputError(f"{'has' if feats.has_targets else 'has no'} targets but "
                                 f"{report.parts[0].path} {'has not' if feats.has_targets else 'has'}",
                                 part.path)
            total.add(feats)
            if feats.token_dtype != total.token_dtype:
                total.token_dtype = "float64"
    assert total is not None
    if total.n_samples == 0:
        raise InputError("every weight of every part is 0: there is no sample to learn from",
                         report.parts[0].path)
    total.source = report.parts[0].source
    total.sample_range = (report.covered[0][0], report.covered[-1][1])
    total.extra_attrs = {}
    if report.partial:
        total.extra_attrs = {"partial": 1, "sample_ranges": json.dumps([list(r) for r in report.covered])}
    return MergeResult(total, report)


def merge_stores(paths: list[str], out: str, allow_partial: bool = False) -> MergeResult:
    """Sum Zarr features stores of shards into the store `out` after `plan_merge`, tile by tile
    (zarr_store.sum_stores: two tiles in memory, whatever psi)."""
    report = plan_merge(list(paths), allow_partial)
    extra = {"partial": 1, "sample_ranges": json.dumps([list(r) for r in report.covered])} if report.partial else {}
    total = zarr_store.sum_stores([p.path for p in report.parts], out, extra, report.parts[0].source,
                                  (report.covered[0][0], report.covered[-1][1]))
    return MergeResult(total, report)
