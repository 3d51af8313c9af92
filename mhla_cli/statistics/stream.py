"""Featurize a tokens file, load a features file: the streaming statistics' entry points.

`featurize` checks memory, estimates the basis, finds the data's spans (mhla_cli.statistics.spans), runs the
one accumulation `accumulate_range` serially or over workers (mhla_cli.statistics.distributed.parallel), and ends in the
whitening of all the data read (mhla_cli.statistics.basis). The jobs live in their own modules: per-chunk
kernels (kernels), the accumulator (accumulate), chunk sizing and the span passes (spans), shards
(shards); callers import those names from their own modules.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial

import numpy as np

from mhla_cli.statistics import basis as basis_mod
from mhla_cli.linalg import device as device_mod
from mhla_cli.linalg.backends import Backend, NumpyBackend, get_backend
from mhla_cli.io import formats
from mhla_cli.statistics.distributed import parallel
from mhla_cli.statistics import ranges as ranges_mod
from mhla_cli.statistics import spans as spans_mod
from mhla_cli.statistics import structure as structure_mod
from mhla_cli.statistics.files import store_location, zarr_store
from mhla_cli.errors import InputError, Refused
from mhla_cli.feature_map import check_normalize, n_features
from mhla_cli.linalg.memory import check_floor, check_memory, solve_need_of
from mhla_cli.samples import ReadSpec, Samples, check_attention
from mhla_cli.statistics.accumulate import basis_option
from mhla_cli.statistics.shards import shard_samples, work_ranges
from mhla_cli.statistics.ranges import default_chunk_size, device_pass_bytes, featurize_need, accumulate_ranges
from mhla_cli.statistics.spans import spans_block, check_spans, find_spans
from mhla_cli.statistics.affine_sums import WideSource
from mhla_cli.statistics.features import Features, check_overflow
from mhla_cli.io.tokens import TokensInfo, inspect_tokens, read_as, with_bias_terms



def featurize(path: str | os.PathLike, chunk_size: int | None = None,
              shard: tuple[int, int] | None = None,
              map: Callable[..., Iterable[Features]] | None = None,  # noqa: A002
              progress: Callable[[int], None] | None = None,
              workers: int = 1, scheduler: str | None = None, normalize: str = "none",
              basis: np.ndarray | str | None = "auto", spans: str = "auto", device: str | None = None,
              attention: str | Samples | None = None, bias_terms: bool = False,
              affine_from: str | os.PathLike | None = None, read: ReadSpec | None = None) -> Features:
    """Sufficient statistics of a tokens file, streamed in chunks of `chunk_size` samples.

    `shard=(i, M)` restricts to the i-th (0-based) of M contiguous sample ranges. Parallelism:
    `workers=K` (a local pool, see mhla_cli.statistics.distributed.parallel), `scheduler` (a Dask address, or "local" /
    "local:K"), or any `map` (builtin map, a pool's map, ...) over the sample ranges; all call `accumulate_range`.
    Per-position data (targets (T, d) or weights per position): every position with weight > 0 is a
    sample, read with `attention` (mhla_cli.samples): "causal" (S of the prefix X[:t]) or
    "bidirectional" (S of the whole window); None: as the file's `attention` attribute says, causal
    without it (an `attention` that contradicts the attribute is an InputError). `normalize="length"`
    divides S by its number of tokens.

    The basis: the pass accumulates in an estimate (`basis` "auto": `estimate_basis`, from the whole
    file whatever the shard, or for the whole file where `ranges.exact_basis` says so the whitening of
    every token itself; a (d, d) array; None / "identity": the tokens' own coordinates), which
    is then checked against the token Gram of all the data read (of the shard, for a shard): the
    sums are changed exactly to its whitening when that change is well conditioned
    (cond <= basis.CHANGE_COND), and otherwise the pass is redone in that whitening. The result is
    always in the whitening of its own data (`Features.canonical`).

    `device` (mhla_cli.linalg.device: "cpu" / None numpy, "cuda", "cuda:I", "torch:cpu"): where the features
    and their Gram are built (with workers, "cuda" gives each worker one GPU in turn); its free memory
    is checked before the pass.

    `bias_terms`: the statistics of the tokens (x, 1) and the targets (y, 0), i.e. of the MHLA with the
    terms a head's biases add (docs/bias_terms.md): `d` counts the constant coordinate. `affine_from`: the wide
    tokens file that `mhla reduce` read to make `path`; the sums of the affine block of its tokens at every
    sample's query are accumulated beside (mhla_cli.statistics.affine_sums, `Features.affine`). `read`
    (mhla_cli.samples.ReadSpec), given, replaces `attention`, `normalize` and `bias_terms` (the three as one value).

    `spans` ("auto", "on", "off"): statistics of only the block on the data's spans span{S_i} (x) span{x_n}
    (`Features.on_spans`; docs/formats_features.md, "Features on the data's spans"); "auto" looks for the
    spans from statistics.spans.SPANS_MIN_FEATURES features on.
    """
    normalize = (read := read or ReadSpec(attention, normalize, bias_terms)).normalize or "none"
    info, backend = _checked(path, read, spans, device)
    wide = _wide_source(affine_from, info, backend, path)
    serial = map is None and workers <= 1 and scheduler is None
    # every feature for sure: refused before any work (a pool's workers are counted once it is made);
    # otherwise after the cheap span pass, with the block it found
    whole = spans == "off" or (spans == "auto" and n_features(info.d) < spans_mod.SPANS_MIN_FEATURES)
    if serial and whole:
        check_memory(info.d, path=path, need=featurize_need(info, chunk_size), what="featurize")
    A = basis_option(basis, info.d, path)
    lo, hi = shard_samples(info.n_samples, shard, path)
    A = ranges_mod.estimate_basis(info, (lo, hi) if shard is None else None) if A is None else A
    size = chunk_size or default_chunk_size(info, 0 if wide is None else wide.width)
    # the data's spans (a cheap pass; none spent when the basis sample already fills psi)
    found, A, span_passes = find_spans(info, A, (lo, hi), size, normalize, spans)
    spans_in = partial(_spans_in, found, A)
    if serial:
        _check_serial_memory(info, path, chunk_size, size, spans_block(found), backend, host=not whole)

        def run(A: np.ndarray) -> Features:
            return ranges_mod.accumulate_range(info, (lo, hi), size, progress=progress, normalize=normalize, basis=A,
                                         finalize=False, spans=spans_in(A), device=backend.device, wide=wide)
        feats = _in_whitening(run, A)
    else:
        with parallel.make_map(workers=workers, scheduler=scheduler, map=map) as pmap:
            _check_workers_memory(info, path, chunk_size, size, pmap.local_copies, spans_block(found), backend)
            # workers (possibly on other hosts) open the file themselves: give them an absolute path
            winfo = replace(info, path=os.path.abspath(info.path))
            sample_ranges = work_ranges(lo, hi, size, pmap.n_workers)

            def run(A: np.ndarray) -> Features:
                return accumulate_ranges(winfo, sample_ranges, map=pmap, chunk_size=size, progress=progress,
                                    normalize=normalize, basis=A, finalize=False, spans=spans_in(A),
                                    device=backend.device, wide=_absolute(wide))
            feats = _in_whitening(run, A)
    feats.extra_attrs["span_passes"] = span_passes
    _stamp_affine(feats, wide)
    return _finished(feats, info, path, (lo, hi), shard)


def _stamp_affine(feats: Features, wide: WideSource | None) -> None:
    """The affine block's record of the wide tokens it came from: their identity, the map P and the basis."""
    if feats.affine is not None:
        assert wide is not None  # the affine block is of the wide tokens
        feats.affine.source, feats.affine.P, feats.affine.basis = wide.identity, wide.P, wide.basis


def _wide_source(affine_from: str | os.PathLike | None, info: TokensInfo, backend: Backend,
                 path: str | os.PathLike) -> WideSource | None:
    """The wide tokens file `affine_from` (None: none), its basis estimated: the sums accumulate nearly whitened."""
    if affine_from is None:
        return None
    if not isinstance(backend, NumpyBackend):
        raise InputError("the affine block of the wide tokens accumulates on the CPU: featurize it without a device",
                         path)
    wide = WideSource.open(affine_from, path)
    return replace(wide, basis=wide.estimate_basis(info.samples))


def _absolute(wide: WideSource | None) -> WideSource | None:
    """The wide source with an absolute path (workers, possibly on other hosts, open it themselves)."""
    return None if wide is None else replace(wide, info=replace(wide.info, path=os.path.abspath(wide.info.path)))


def _checked(path: str | os.PathLike, read: ReadSpec, spans: str, device: str | None
             ) -> tuple[TokensInfo, Backend]:
    """featurize's options and file checked before any work: (the tokens file's info, read as `read` says; the
    backend of the device, mhla_cli.linalg.backends)."""
    check_normalize(read.normalize or "none")
    check_spans(spans)
    backend = get_backend(device_mod.check_device(device, path))  # None resolved here, once
    info = tokens_info(path, read)
    check_floor(info.d, path, "featurize")  # wide tokens: before anything of their size (targets of any width)
    return info, backend


def _check_serial_memory(info: TokensInfo, path: str | os.PathLike, chunk_size: int | None, size: int,
                         block: int | None, backend: Backend, host: bool = True) -> None:
    """Refuse a serial pass of `block` features (None: all) that exceeds the device's memory, or with
    `host` the host's (once the span pass has told the block; a pass of every feature for sure was
    checked before any work)."""
    if host:
        check_memory(info.d, path=path, need=featurize_need(info, chunk_size, block=block), what="featurize")
    device_mod.check_device_memory(backend, device_pass_bytes(info, size, block), "featurize", path)


def _spans_in(found: tuple[np.ndarray, np.ndarray] | None, A: np.ndarray,
              A_run: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The spans `found` in the canonical coordinates of basis A, changed to those of the basis A_run (a
    redone pass changes it)."""
    if found is None or basis_mod.same(A_run, A):
        return found
    Ct = basis_mod.transition(A, A_run)
    return structure_mod.change(found[0], found[1], basis_mod.orth_pair_map(Ct), Ct.T)[:2]


def _check_workers_memory(info: TokensInfo, path: str | os.PathLike, chunk_size: int | None, size: int,
                          copies: int, block: int | None, backend: Backend) -> None:
    """Refuse a parallel pass whose `copies` local workers exceed the host's or the device's memory."""
    check_memory(info.d, copies=copies, path=path, need=featurize_need(info, chunk_size, copies, block=block),
                 what="featurize")
    # each worker holds its own Gram on its device (device.worker_device)
    device_mod.check_device_memory(
        backend, device_mod.workers_per_device(backend.device, copies) * device_pass_bytes(info, size, block),
        f"featurize ({copies} workers)", path)


def _finished(feats: Features, info: TokensInfo, path: str | os.PathLike, sample_range: tuple[int, int],
              shard: tuple[int, int] | None) -> Features:
    """The pass's statistics finalized and checked, with their sample range, token dtype and source. A shard
    whose weights are all 0 is an empty part (zero sums that add: `merge`); the whole file's, no sample."""
    lo, hi = sample_range
    if feats.n_samples == 0 and shard is None:
        raise InputError(f"every weight of samples {lo}..{hi} is 0: there is no sample to learn from", path)
    feats.finalize()
    check_overflow(feats, f"samples {lo}..{hi}", path)
    feats.sample_range = (lo, hi)
    feats.token_dtype = info.dtype
    feats.source = dict(formats.source_identity(path), n_samples=info.n_samples)
    if shard is not None:
        feats.extra_attrs["shard"] = f"{shard[0]}/{shard[1]}"
    return feats


def _in_whitening(run: Callable[[np.ndarray], Features], A: np.ndarray) -> Features:
    """run(A) (a pass accumulating in basis A), verified against the whitening of the data it read.

    The sums are changed exactly to that whitening when the change is well conditioned; otherwise
    the pass is redone once in it (its float32 rounding then needs only a tiny exact change).
    Records `basis_passes` (1 or 2) and `basis_correction_cond` (cond of the first correction) in
    extra_attrs (attributes of the features file).
    """
    feats = run(A)
    C, cond = feats.correction()
    passes = 1
    if C is not None and cond > basis_mod.CHANGE_COND:
        feats = run(basis_mod.round32(feats.basis @ C))
        passes = 2
    feats.extra_attrs.update(basis_passes=passes, basis_correction_cond=float(cond))
    return feats.canonical()


def data_kind(path: str | os.PathLike) -> str:
    """The kind of a data argument: "features" for a Zarr features store (read whole on one machine by
    `load_features`, or tiled on a cluster), else the HDF5 file's kind (io.formats.kind_of)."""
    return "features" if store_location.is_store(path) else formats.kind_of(path)


def tokens_info(path: str | os.PathLike, read: ReadSpec | None = None) -> TokensInfo:
    """The layout of a tokens file as featurize reads it (`read`, mhla_cli.samples.ReadSpec): per-position samples
    in its layout, and the tokens (x, 1) and targets (y, 0) with its bias terms (io.tokens.with_bias_terms)."""
    read = read or ReadSpec()
    info = read_as(inspect_tokens(path), read.layout if read.attention is not None else None)
    return with_bias_terms(info) if read.bias_terms else info


def solve_need(path: str | os.PathLike, ridge: float = 0.0, lowrank: bool = False,
               chunk_size: int | None = None, command: str = "certify", read: ReadSpec | None = None
               ) -> tuple[int, Callable[[int], int]] | None:
    """(d, need(d)): the peak bytes of certifying / fitting (`command`) the statistics of a features or
    tokens file (a tokens file is featurized first), for memory.check_memory; None for other kinds.

    The file's facts are read here; the policy is mhla_cli.linalg.memory.solve_need_of (the linalg layer
    reads no files: io and the featurize pass's own need sit above it)."""
    if store_location.is_store(path):  # read whole on one machine (zarr_store.load_features)
        d, n = zarr_store.dims(path)
        return d, solve_need_of(d, n, ridge, lowrank, command)
    kind = formats.kind_of(path)
    if kind == "features":
        with formats.open_input(path) as f:
            d = formats.read_attr_int(f, "d", path)
            n = formats.read_attr_int(f, "n_samples", path)
            block = formats.stored_block(f)
        return d, solve_need_of(d, n, ridge, lowrank, command, block=block)
    if kind == "tokens":
        info = tokens_info(path, read)
        check_floor(info.d, path, command)
        if n_features(info.d) >= spans_mod.SPANS_MIN_FEATURES and not lowrank:
            return None  # featurize may find a block on the data's spans: it checks its pass itself
        n = info.samples.count(info.n_samples, info.n_tokens)
        return info.d, solve_need_of(info.d, n, ridge, lowrank, command,
                                     pass_need=featurize_need(info, chunk_size, derive=False))
    return None


def check_solve_memory(path: str | os.PathLike, what: str, ridge: float = 0.0, lowrank: bool = False,
                       chunk_size: int | None = None, read: ReadSpec | None = None) -> None:
    """Refuse before any work a certify / fit of `path` that cannot fit in memory (`solve_need`; `read`: how a
    tokens file is read)."""
    job = solve_need(path, ridge, lowrank, chunk_size, command=what, read=read)
    if job is not None:
        check_memory(job[0], path=path, need=job[1], what=what)


def check_attention_of(feats: Features, attention: str | Samples | None, path: str | os.PathLike | None = None
                       ) -> None:
    """Refuse an `attention` (a per-position layout or its name) that the statistics' samples contradict (None:
    nothing asked)."""
    name = check_attention(attention)
    if name is None:
        return
    if feats.samples.attention != name or (isinstance(attention, Samples) and feats.samples != attention):
        attention = str(attention) if isinstance(attention, Samples) else name
        have = "last-token samples" if feats.samples.attention is None else f"attention '{feats.samples.attention}'"
        raise InputError(f"attention '{attention}' was asked but the statistics were featurized with {have}; "
                         "featurize the tokens file again with the attention wanted", path)


def check_bias_terms_of(feats: Features, bias_terms: bool | None, path: str | os.PathLike | None = None) -> None:
    """Refuse a features file featurized without the bias terms when they are asked (None / False: nothing
    asked; a file with them is read as it is)."""
    if bias_terms and not feats.bias_terms:
        raise Refused("{bias_terms} was asked but the statistics were featurized without them; featurize the "
                      "tokens file again with {bias_terms}", path, bias_terms={})


def check_affine_of(feats: Features, affine_from: str | os.PathLike | None, path: str | os.PathLike | None = None
                    ) -> None:
    """Refuse a features file without the affine block when --affine-from is asked, or with the block of another
    wide tokens file (its recorded fingerprint); None: nothing asked."""
    if affine_from is None:
        return
    if feats.affine is None:
        raise Refused("{affine_from} was asked but the statistics were featurized without it; featurize the "
                      "reduced tokens file again with {affine_from}", path, affine_from={})
    have = (feats.affine.source or {}).get("fingerprint")
    ident = formats.source_identity(affine_from)
    if have is not None and have != ident.get("fingerprint"):
        raise InputError(f"holds the affine block of another wide tokens file (fingerprint {str(have)[:12]}), not of "
                         f"{affine_from} ({str(ident.get('fingerprint'))[:12]})", path)


def load_features(path: str | os.PathLike, chunk_size: int | None = None, normalize: str | None = None,
                  progress: Callable[[int], None] | None = None, device: str | None = None,
                  attention: str | Samples | None = None, bias_terms: bool | None = None,
                  affine_from: str | os.PathLike | None = None, read: ReadSpec | None = None) -> Features:
    """The statistics of a features file, or of a tokens file (featurized here, streamed, on `device`).

    `normalize`, `attention` and `bias_terms` (if given; or `read`, mhla_cli.samples.ReadSpec, the three as one
    value) must match a features file's, and are applied to a tokens file.
    """
    if read is not None:
        attention, normalize, bias_terms = read.layout, read.normalize, read.bias_terms
    if normalize is not None:
        check_normalize(normalize)
    store = store_location.is_store(path)
    kind = data_kind(path)
    if kind == "features":
        feats = zarr_store.load_features(path) if store else Features.load(path)
        if normalize is not None and normalize != feats.normalize:
            raise InputError(f"was featurized with normalisation '{feats.normalize}', not '{normalize}'; "
                             "featurize it again with the normalisation wanted", path)
        check_attention_of(feats, attention, path)
        check_bias_terms_of(feats, bias_terms, path)
        check_affine_of(feats, affine_from, path)
        return feats
    if kind == "tokens":
        return featurize(path, chunk_size=chunk_size, progress=progress, device=device, affine_from=affine_from,
                         read=ReadSpec(attention, normalize or "none", bool(bias_terms)))
    raise InputError(f"is a {kind} file, expected a tokens or features file", path)
