"""`mhla featurize` and `mhla merge`: the sufficient statistics of a tokens file, in one pass or in shards."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from mhla_cli.linalg.device import check_device
from mhla_cli.errors import InputError
from mhla_cli.feature_map import check_normalize
from mhla_cli.statistics.folds import featurize_folds, save_with_folds
from mhla_cli.statistics.merge import merge_features
from mhla_cli.statistics.distributed.parallel import make_map
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.spans import check_spans
from mhla_cli.statistics.stream import featurize
from mhla_cli.statistics.shards import shard_samples
from mhla_cli.io.tokens import inspect_tokens
from mhla_cli.statistics.files.store_location import is_store
from mhla_cli.cli.console import emit_json, fmt, progress_bar, say, say_samples, warn, working
from mhla_cli.cli.options import CLUSTER_WORDS, AffineFromOpt, AttentionOpt, BiasTermsOpt, ChunkOpt, DeviceOpt, JsonOpt, NormalizeOpt, OutOpt, QuietOpt, SchedulerTimeoutOpt, check_hdf5_output, data_location, on_cluster, parse_shard, require_dask

if TYPE_CHECKING:
    from mhla_cli.samples import ReadSpec


def featurize_cmd(
    data: Annotated[Path, typer.Argument(help="Tokens file (tokens + offsets, or tokens (N, n, d)).")],
    output: OutOpt,
    chunk_size: ChunkOpt = None,
    shard: Annotated[str | None, typer.Option("--shard", help="Only the i-th of M contiguous sample ranges, as i/M (0-based).")] = None,
    folds: Annotated[int | None, typer.Option("--folds", min=2, help="Also store the statistics of K contiguous "
                                              "folds, each with its canonical sums (for `fit --ridge auto`, "
                                              "`--heads auto`, `--nuclear auto`: the same choice as from the "
                                              "tokens file, in any units).")] = None,
    workers: Annotated[int, typer.Option("--workers", "-j", min=0, help="Parallel local workers (0: one per "
                                         "core); the result equals the serial one up to summation order.")] = 1,
    scheduler: Annotated[str | None, typer.Option("--scheduler", help="Run on a Dask cluster: a scheduler address "
                                                  "(tcp://host:8786), a scheduler file (.json), or local / local:K "
                                                  "(needs the dask extra). With -o FEATS.zarr (the cluster extra) "
                                                  "the Gram stays tiled on the workers, which write it into the "
                                                  "Zarr store: for a Gram larger than one machine (docs/cluster.md).")] = None,
    scheduler_timeout: SchedulerTimeoutOpt = None,
    normalize: NormalizeOpt = None,
    attention: AttentionOpt = None,
    bias_terms: BiasTermsOpt = False,
    affine_from: AffineFromOpt = None,
    spans: Annotated[Literal["auto", "on", "off"], typer.Option("--spans", help="Accumulate only the features on the data's spans "
                                       "span{S_i} (x) span{x_n} (the rest are exact nulls): auto (psi >= 2048 and "
                                       "they hold at most half the features; a cheap first pass finds them), on, off.")] = "auto",
    device: DeviceOpt = "cpu",
    compact: Annotated[bool, typer.Option("--compact", help="Store the canonical Gram as its distinct entries "
                                          "only (about a quarter of the numbers; no 'gram' / 'basis_gram' "
                                          "datasets: mhla derives them on read, docs/formats_features.md). From d = 24 "
                                          "on the faster featurize, certify and fit "
                                          "(docs/performance_symmetry.md) when no reader needs 'gram' from h5py.")] = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Stream a tokens file into the feature statistics (gram, moments, ...), in float64.

    Per-position data (targets (T, d), or (N, n, d) with dense tokens): every position t with weight > 0
    is a sample (target y_t), read with --attention: causal (the prefix X[:t], a decoder's), or
    bidirectional (S of the whole window, an encoder's: at the cost of last-token data); default the
    file's 'attention' attribute, causal without one. Optional `weights` weigh samples ((T,) or (N, n):
    weight 0 masks a position, e.g. padding or a prompt).

    Memory is O(chunk + psi^2) whatever N is. For job arrays, run one --shard i/M per job and sum
    the parts with `mhla merge`.

    Structured tokens (one-hot, DFA / Turing-machine traces) leave most features outside the data's
    spans; featurize then finds the spans in a cheap first pass and accumulates only the block on
    them (--spans), so memory and time go with the block, not psi. certify, fit and certify --on
    use the block directly; commands that need every feature expand it.

    With --scheduler and -o FEATS.zarr the Gram stays tiled on the cluster's workers, each writing its
    tiles into the Zarr store (a directory or an fsspec URL the workers reach), which certify, fit,
    merge and inspect read (docs/cluster.md).

    Example (a GPU): mhla featurize data.h5 -o feats.h5 --device cuda
    Example: mhla featurize data.h5 -o feats.h5 --workers 4
    Example (job array): mhla featurize data.h5 --shard 3/8 -o part_3.h5 && mhla merge part_*.h5 -o feats.h5
    Example (an encoder's windows): mhla featurize bert_l1.h5 -o feats.h5 --attention bidirectional

    Example (a head with biases): mhla featurize enc.h5 -o feats.h5 --bias-terms

    Example (with the wide token's affine map): mhla featurize h8.h5 -o feats.h5 --affine-from hidden384.h5

    Example (a Dask cluster): mhla featurize data.h5 --scheduler tcp://10.0.0.5:8786 -o s3://bucket/feats.zarr
    """
    from mhla_cli.samples import ReadSpec  # the layouts need NumPy: not for --help

    read = ReadSpec(attention, check_normalize(normalize or "none"), bias_terms)  # how the tokens file is read
    store = is_store(data_location(output))
    dev = _check_options(data, output, store, folds, workers, scheduler, affine_from, device, compact, spans)
    if store:
        assert scheduler is not None  # _check_options: a store is written on a cluster
        with on_cluster(scheduler, scheduler_timeout, data):
            _featurize_store(data, data_location(output), scheduler, shard, chunk_size, read, json_out, quiet)
        return
    # the pool (workers or a scheduler) and the wide tokens of the affine block, beside the ReadSpec
    pool: dict[str, Any] = {"workers": workers, "scheduler": scheduler,
                            **({} if affine_from is None else {"affine_from": affine_from})}
    with on_cluster(scheduler, scheduler_timeout, data):
        feats, fold_feats = _featurize(data, shard, folds, chunk_size, spans, dev, read, pool, quiet)
    _write(feats, fold_feats, data, output, affine_from, compact, attention, json_out, quiet)


def _write(feats: Features, fold_feats: list[Features] | None, data: Path, output: Path, affine_from: Path | None,
           compact: bool, attention: str | None, json_out: bool, quiet: bool) -> None:
    """Write the features file (with its folds), and say what it holds (its JSON record)."""
    if fold_feats is not None:
        save_with_folds(feats, fold_feats, output, inputs=(data,))
    else:
        feats.save(output, inputs=(data,) + ((affine_from,) if affine_from is not None else ()), compact=compact)
    _say_featurize(feats, output, quiet)
    say_samples(feats, data, attention, quiet)
    if json_out:
        emit_json(_featurize_record(feats, output, compact))


def _check_options(data: Path, output: Path, store: bool, folds: int | None, workers: int, scheduler: str | None,
                   affine_from: Path | None, device: str, compact: bool, spans: str) -> str | None:
    """The rules of featurize's options, before any work (a Zarr store `output` is written on a cluster); the
    device."""
    if scheduler is not None and workers != 1:
        raise InputError("--workers and --scheduler cannot be combined (the Dask cluster sets the workers)")
    if store:
        if scheduler is None:
            raise InputError("a Zarr store is written by the workers of a Dask cluster: give --scheduler (or write "
                             "-o FEATS.h5 on one machine)", output)
        if folds is not None or compact or device != "cpu" or spans == "on":
            raise InputError("a Zarr store holds every feature, tiled: it cannot be combined with --folds, "
                             "--compact, --device or --spans on", output)
        if affine_from is not None:
            raise InputError(CLUSTER_WORDS["affine"], affine_from)
        return None
    dev = check_device(device, data)
    if dev is not None and affine_from is not None:
        raise InputError("--affine-from accumulates on the CPU: featurize without --device")
    if dev is not None and folds is not None:
        raise InputError("--folds runs on the CPU: featurize the folds without --device")
    if compact and folds is not None:
        raise InputError("--compact and --folds cannot be combined (the folds' sums are stored whole)")
    check_hdf5_output(output, (data, affine_from), "a features file", "features")
    require_dask(scheduler)
    return dev


def _featurize_store(data: Path, out: str, scheduler: str, shard: str | None, chunk_size: int | None,
                     read: ReadSpec, json_out: bool, quiet: bool) -> None:
    """`featurize --scheduler -o FEATS.zarr`: the statistics accumulated with the Gram tiled on the cluster
    (mhla_cli.statistics.distributed.tiled_statistics), each tile written into the store by its worker."""
    from mhla_cli.statistics.distributed import tiled_statistics
    from mhla_cli.statistics.files import zarr_store

    zarr_store.check_output(out, (data,))
    require_dask(scheduler)
    with make_map(scheduler=scheduler) as pmap, working(f"featurize on the cluster {scheduler}: the tiled Gram", quiet):
        stats = tiled_statistics.accumulate(data, pmap.client, chunk_size=chunk_size, read=read,
                                            shard=parse_shard(shard))
        try:
            zarr_store.save(stats, out, inputs=(data,))
        finally:
            stats.release()
    feats = stats.sums
    say(f"wrote {out}: d = {feats.d}, psi = {feats.n_features} features in tiles of {stats.tile}, N = "
        f"{feats.n_samples} {feats.samples.unit('samples')}, {feats.n_tokens} tokens"
        + ("" if feats.has_targets else " (no targets)"), quiet)
    say_samples(feats, data, read.attention, quiet)
    if json_out:
        rec = _featurize_record(feats, Path(out), False)
        rec.update(output=out, span_features=feats.n_features, gram_storage="tiles", tile_features=stats.tile,
                   tasks=dict(stats.matrix.tasks))
        emit_json(rec)


def _featurize(data: Path, shard: str | None, folds: int | None, chunk_size: int | None, spans: str,
               device: str | None, read: ReadSpec, pool: dict[str, Any], quiet: bool
               ) -> tuple[Features, list[Features] | None]:
    """The statistics of `data` (of its --shard i/M) read as `read` says, in the `pool` (workers, scheduler; and
    affine_from), with the per-fold statistics for --folds, under a progress bar."""
    info = inspect_tokens(data)
    shard_t = parse_shard(shard)
    lo, hi = shard_samples(info.n_samples, shard_t, data)
    with progress_bar("featurize", hi - lo, quiet) as advance:
        if folds is None:
            return featurize(data, chunk_size=chunk_size, shard=shard_t, progress=advance, spans=check_spans(spans),
                             device=device, read=read, **pool), None
        if shard_t is not None:
            raise InputError("--folds and --shard cannot be combined")
        return featurize_folds(data, folds, chunk_size=chunk_size, progress=advance, read=read, **pool)


def _say_featurize(feats: Features, output: Path, quiet: bool) -> None:
    """What `mhla featurize` says of the statistics it wrote (and of a redone pass, and of the spans' block)."""
    psi = feats.n_features
    dim = f"{feats.d - 1} + the constant (bias terms)" if feats.bias_terms else str(feats.d)
    say(f"wrote {output}: d = {dim}, psi = {psi} features, N = {feats.n_samples} "
        + ("positions" if feats.per_position else "samples") + f", {feats.n_tokens} tokens"
        + ("" if feats.has_targets else " (no targets)")
        + (", S normalised by length" if feats.normalize == "length" else ""), quiet)
    if int(feats.extra_attrs.get("basis_passes", 1)) > 1:
        say(f"  the basis estimated from a sample of the file did not whiten all its tokens (correction cond "
            f"{fmt(feats.extra_attrs['basis_correction_cond'])}): the pass was redone in the whitening of all "
            "the tokens", quiet)
    if feats.on_spans:
        assert feats.gram_storage is not None and feats.span_pairs is not None and feats.span_last is not None
        block = feats.gram_storage.n
        say(f"  only the block on the data's spans was accumulated: {block} of {psi} features (the "
            f"S matrices span {feats.span_pairs.shape[1]} of {psi // feats.d} dimensions, the last tokens "
            f"{feats.span_last.shape[1]} of {feats.d}; the other features are exact nulls; --spans off keeps them all)",
            quiet)


def _featurize_record(feats: Features, output: Path, compact: bool) -> dict[str, Any]:
    """The `mhla featurize --json` record."""
    return {"output": str(output), "d": feats.d, "n_features": feats.n_features,
            "span_features": feats.gram_storage.n if feats.on_spans and feats.gram_storage is not None
            else feats.n_features,
            "span_passes": int(feats.extra_attrs.get("span_passes", 0)), "n_samples": feats.n_samples,
            "n_tokens": feats.n_tokens, "has_targets": feats.has_targets,
            "per_position": feats.per_position, "attention": feats.samples.attention, "normalize": feats.normalize,
            "bias_terms": feats.bias_terms,
            "affine_width": None if feats.affine is None else feats.affine.width,
            "n_sequences": feats.n_sequences, "basis_passes": int(feats.extra_attrs.get("basis_passes", 1)),
            "compact": compact, "sample_range": list(feats.sample_range) if feats.sample_range else None}


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

    Zarr stores of shards (featurize --scheduler --shard i/M -o part_i.zarr) are summed tile by tile
    into a store (-o FEATS.zarr).

    Example: mhla merge part_*.h5 -o feats.h5 --json
    """
    stores = [is_store(data_location(p)) for p in parts]
    if any(stores) or is_store(data_location(output)):
        if not all(stores) or not is_store(data_location(output)):
            raise InputError("Zarr stores merge into a Zarr store, HDF5 files into an HDF5 file: give parts and -o "
                             "of one form", output)
        _merge_stores(parts, data_location(output), allow_partial, json_out, quiet)
        return
    check_hdf5_output(output, tuple(parts), "a features file", "features")
    merged = merge_features(list(parts), allow_partial=allow_partial)
    feats, report = merged.features, merged.report
    feats.save(output, inputs=tuple(parts))
    out = {"output": str(output), **merged.to_dict()}
    if report.partial:
        warn(f"partial merge: missing samples {', '.join(f'{a}..{b}' for a, b in report.missing)}")
    say(f"wrote {output}: {len(parts)} parts, N = {feats.n_samples} samples"
        + (f" of {report.n_samples_source}" if report.n_samples_source is not None else "")
        + f", d = {feats.d}", quiet)
    if json_out:
        emit_json(out)


def _merge_stores(parts: list[Path], out: str, allow_partial: bool, json_out: bool, quiet: bool) -> None:
    """`mhla merge` of Zarr stores (statistics.merge.merge_stores)."""
    from mhla_cli.statistics.files import zarr_store
    from mhla_cli.statistics.merge import merge_stores

    zarr_store.check_output(out, tuple(parts))
    merged = merge_stores([data_location(p) for p in parts], out, allow_partial=allow_partial)
    feats, report = merged.features, merged.report
    if report.partial:
        warn(f"partial merge: missing samples {', '.join(f'{a}..{b}' for a, b in report.missing)}")
    say(f"wrote {out}: {len(parts)} parts, N = {feats.n_samples} samples"
        + (f" of {report.n_samples_source}" if report.n_samples_source is not None else "") + f", d = {feats.d}",
        quiet)
    if json_out:
        emit_json({"output": out, **merged.to_dict()})


def register(app: typer.Typer) -> None:
    app.command("featurize")(featurize_cmd)
    app.command("merge")(merge_cmd)
