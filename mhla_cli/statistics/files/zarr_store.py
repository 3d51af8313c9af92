"""The Zarr features store: statistics whose Gram is tiled, written by many workers at once.

`featurize --scheduler ... -o FEATS.zarr` writes the statistics accumulated on a cluster
(mhla_cli.statistics.distributed.tiled_statistics) as a Zarr store, a directory or any fsspec URL the workers reach
(s3://..., gs://...; the suffix .zarr names the format). HDF5 stays the single-machine form.

Layout (docs/formats.md, "The Zarr features store"): the root group's attributes are those of an
HDF5 features file (mhla_kind = "features", the format version, the provenance: command, inputs,
version, time; d, n_samples, n_tokens, n_features, weight totals, normalize, per_position, source,
sample range, shard, ...) plus `gram_storage` = "tiles" and `tile_features` (the side of a tile). Its
arrays: the small sums of the HDF5 file (`basis`, `basis_moments`, `basis_token_gram`,
`basis_last_token_gram`, `token_gram`, `last_token_gram`, `moments`, `target_gram`, `target_sum`),
and `basis_gram_lower`: the canonical Gram sum w Ht Ht^T (psi x psi), chunked by tiles, of which only
the lower tiles (i >= j) are written, each by the worker that holds it (the upper chunks are absent:
read the Gram as the lower tiles and their transposes).

The store is written under a temporary name next to the target and moved in when complete and verified,
so that a failed or interrupted featurize leaves nothing, and an earlier store is removed only after
(mhla_cli.statistics.files.store_location: what an output may replace, the commit). A store is read back as
tiles on a cluster (`load_tiled`: every worker reads its tiles itself) or on one machine out of core
(`load_tiled` without a client: the tasks of dask's threaded scheduler read the tiles they need), or whole on one machine
(`load_features`, refused up front when the Gram cannot fit). `merge` sums stores of shards of one tokens file tile by tile.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import numpy as np

from mhla_cli.statistics import basis as basis_mod
from mhla_cli.statistics.files import store_location
from mhla_cli.statistics.files.store_location import SUFFIX, check_output, is_store, require_zarr, store_kind
from mhla_cli.statistics.files.store_location import location as _url, temporary as _temporary
from mhla_cli.errors import InputError, Refused
from mhla_cli.feature_map import n_features
from mhla_cli.io import formats
from mhla_cli.io.formats import manifest
from mhla_cli.linalg.memory import check_load
from mhla_cli.linalg.task_graph import Stored
from mhla_cli.linalg.tiled_matrix import TiledMatrix
from mhla_cli.numerics import SINGULAR_BASIS_COND
from mhla_cli.samples import ReadSpec, Samples, from_attrs
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.files.features_file import EXTRA_ATTRS, WEIGHT_ATTRS
from mhla_cli.statistics.distributed.tiled_statistics import TiledStatistics

__all__ = ["SUFFIX", "TILES", "check_output", "dims", "inspect", "is_store", "load_features", "load_tiled", "part_info",
           "require_zarr", "save", "store_kind", "sum_stores", "tile_bytes"]

# The array of the Gram's lower tiles.
TILES = "basis_gram_lower"
# The small sums (a few d x d or psi x d arrays), written and read by the client.
SMALL = ("basis", "basis_moments", "basis_token_gram", "basis_last_token_gram", "token_gram", "last_token_gram",
         "moments", "target_gram", "target_sum")


def _verify(url: str) -> None:
    """Refuse (InputError) a written store that does not open as a complete mhla features store: its header,
    the small sums every store has and the array of tiles (their numbers are checked by their readers; a store
    of no samples, an empty shard, is complete)."""
    g = _open(url)
    attrs = _attrs(g, url)
    for name in ("basis", "basis_token_gram", "basis_last_token_gram", "token_gram", "last_token_gram"):
        if name not in g:
            raise InputError(f"has no array '{name}'; the store is incomplete", url)
    _tiles_array(g, n_features(int(attrs["d"])), int(attrs["tile_features"]), url)


def _commit(tmp: str, url: str) -> None:
    """Put the written store `tmp` at `url`, verified (`_verify`) before an earlier store there is removed
    (store_location.commit)."""
    store_location.commit(tmp, url, _verify)


def _remove(url: str) -> None:
    store_location.remove(url)


def _write_tile(url: str, i: int, j: int, side: int, tile: np.ndarray) -> str:
    """Task: write the lower tile (i, j) of the Gram into the store (run by the worker that holds it); its
    checksum for the manifest."""
    import zarr

    arr = zarr.open_array(store=url, path=TILES, mode="r+")
    arr[i * side:i * side + tile.shape[0], j * side:j * side + tile.shape[1]] = tile
    return manifest.digest(tile)


def _write_tile_at(url: str, side: int, i: int, j: int, tile: np.ndarray) -> str:
    """Task: `_write_tile` with the arguments in the order TiledMatrix.per_tile passes them."""
    return _write_tile(url, i, j, side, tile)


def _tile(arr: Any, i: int, j: int, side: int, expected: str | None, url: str) -> np.ndarray:
    """The lower tile (i, j) of the Gram array `arr`, refused when it cannot be read (a truncated chunk), is not
    finite, or is not the tile written (`expected`: its checksum in the manifest; None: a store without one)."""
    try:
        tile = np.ascontiguousarray(arr[i * side:(i + 1) * side, j * side:(j + 1) * side], dtype=np.float64)
    except Exception as exc:  # noqa: BLE001 (zarr and its codecs raise many types for a damaged chunk)
        raise manifest.corrupted(f"tile ({i}, {j}) of the Gram cannot be read ({type(exc).__name__}: "
                                 f"{' '.join(str(exc).split())[:200]})", url, store=True) from None
    if not formats.all_finite(tile):
        raise InputError(f"'{TILES}' tile ({i}, {j}) contains NaN or Inf; the store is corrupted", url)
    manifest.check_tile(expected, i, j, tile, url)
    return tile


def _read_tile(url: str, i: int, j: int, side: int, expected: str | None = None) -> np.ndarray:
    """Task: the lower tile (i, j) of the Gram read from the store and checked (`_tile`)."""
    import zarr

    return _tile(zarr.open_array(store=url, path=TILES, mode="r"), i, j, side, expected, url)


def _seal(zarr: Any, tmp: str, tiles: dict[str, str]) -> None:
    """Write the manifest of the complete store at `tmp`: its small arrays' and tiles' checksums, its header's."""
    g = zarr.open_group(store=tmp, mode="r+")
    arrays = {name: (tuple(g[name].shape), manifest.digest(np.asarray(g[name][...], dtype=np.float64)))
              for name in g.array_keys() if name != TILES}
    g.attrs[manifest.MANIFEST_ATTR] = manifest.seal(dict(g.attrs), arrays, tiles)


def _create(zarr: Any, tmp: str, feats: Features, inputs: tuple[Any, ...], side: int) -> Any:
    """A new store at `tmp`: the header and the record's attributes, its small sums, and the empty psi x psi
    array of tiles of `side` features (returned), which the caller fills."""
    g = zarr.open_group(store=tmp, mode="w")
    attrs = {**formats.header("features", inputs), **feats.file_attrs(), "gram_storage": "tiles",
             "tile_features": side}
    g.attrs.update({k: manifest.plain(v) for k, v in attrs.items() if v is not None})
    for name in SMALL:
        a = getattr(feats, name)
        if a is not None:
            g.create_array(name, shape=a.shape, dtype="f8", chunks=a.shape or None)[...] = a
    psi = feats.n_features
    return g.create_array(TILES, shape=(psi, psi), chunks=(side, side), dtype="f8", fill_value=0.0)


def save(stats: TiledStatistics, out: Any, inputs: tuple[Any, ...] = ()) -> str:
    """Write tiled statistics as a Zarr store (module docstring): the small sums by this process, each
    lower tile by the task that holds it (a worker's, or a thread's); under a temporary name, renamed when
    complete."""
    zarr = require_zarr()
    url = _url(out)
    tmp = _temporary(url)
    feats, side = stats.sums, stats.tile
    try:
        _create(zarr, tmp, feats, tuple(inputs), side)
        keys = sorted(stats.matrix.tiles)
        sums = stats.matrix.per_tile("write-tile", _write_tile_at, tmp, side, index=True)
        _seal(zarr, tmp, {f"{i},{j}": h for (i, j), h in zip(keys, sums)})
        _commit(tmp, url)
    except BaseException:
        _remove(tmp)
        raise
    return url


def _open(url: str) -> Any:
    """The store's root group, opened to read; an InputError when it is none."""
    zarr = require_zarr()
    try:
        return zarr.open_group(store=url, mode="r")
    except (FileNotFoundError, KeyError, ValueError, OSError) as exc:
        raise InputError(f"not a Zarr store ({' '.join(str(exc).split()) or type(exc).__name__})", url) from None


def _attrs(g: Any, url: str) -> dict[str, Any]:
    """The root attributes, checked: an mhla features store of a format this mhla reads, tiled."""
    attrs = dict(g.attrs)
    version = attrs.get("mhla_format_version")
    if version is not None and int(version) > formats.FORMAT_VERSION:
        raise InputError(f"written with mhla format version {int(version)}, this mhla reads version "
                         f"{formats.FORMAT_VERSION}; upgrade mhla", url)
    if attrs.get("mhla_kind") != "features":
        raise InputError(f"is a Zarr store but not an mhla features store (mhla_kind = {attrs.get('mhla_kind')!r})",
                         url)
    if attrs.get("gram_storage") != "tiles":
        raise InputError(f"gram_storage = {attrs.get('gram_storage')!r}, expected 'tiles'", url)
    attrs[manifest.MANIFEST_ATTR] = manifest.load(attrs, "features", url, store=True)  # the header checked
    for k in ("d", "n_samples", "n_tokens", "tile_features", *WEIGHT_ATTRS):
        if k not in attrs:
            raise InputError(f"has no attribute '{k}'; the store is incomplete", url)
    return attrs


def _array(g: Any, name: str, shape: tuple[int, ...], url: str, required: bool = True,
           man: dict[str, Any] | None = None) -> np.ndarray | None:
    if name not in g:
        if required:
            raise InputError(f"has no array '{name}'; the store is incomplete", url)
        return None
    try:
        a = np.asarray(g[name][...], dtype=np.float64)
    except Exception as exc:  # noqa: BLE001 (as `_tile`)
        raise manifest.corrupted(f"'{name}' cannot be read ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})",
                                 url, store=True) from None
    if a.shape != shape:
        raise InputError(f"'{name}' has shape {a.shape}, expected {shape}", url)
    if not formats.all_finite(a):
        raise InputError(f"'{name}' contains NaN or Inf; the store is corrupted", url)
    manifest.check_array(man, name, a, url, store=True)
    return a


def _sums(g: Any, attrs: dict[str, Any], url: str, part: bool = False) -> tuple[Features, int]:
    """The small sums of a store as a Features record without its Gram, and the tile side."""
    d = int(attrs["d"])
    psi = n_features(d)
    side = int(attrs["tile_features"])
    if side < d or side % d or (psi // d) % (side // d):
        raise InputError(f"tile_features = {side} does not divide the {psi} features into tiles of whole pairs", url)
    man = attrs[manifest.MANIFEST_ATTR]
    if man is not None:
        manifest.check_names(man, {k: tuple(g[k].shape) for k in g.array_keys() if k != TILES}, url, store=True)
    has_targets = "basis_moments" in g
    dd = (d, d)
    e = int(g["basis_moments"].shape[-1]) if has_targets else d  # the targets' width D_out
    arrays = {name: _array(g, name, shape, url, required, man)
              for name, shape, required in (("basis", dd, True), ("basis_token_gram", dd, True),
                                            ("basis_last_token_gram", dd, True), ("token_gram", dd, True),
                                            ("last_token_gram", dd, True), ("basis_moments", (psi, e), has_targets),
                                            ("moments", (psi, e), False), ("target_gram", (e, e), has_targets),
                                            ("target_sum", (e,), False))}
    A, token_gram, last_token_gram = arrays["basis"], arrays["token_gram"], arrays["last_token_gram"]
    assert A is not None and token_gram is not None and last_token_gram is not None  # required: read or refused
    if basis_mod.row_scaled_cond(A) > SINGULAR_BASIS_COND:
        raise InputError("'basis' is singular; the store is corrupted", url)
    n, t = int(attrs["n_samples"]), int(attrs["n_tokens"])
    if n < 1 and not (part and n == 0):  # `part`: an empty shard (every weight 0) may be merged
        raise InputError(f"n_samples = {n}: no samples", url)
    weights = [float(attrs[k]) for k in WEIGHT_ATTRS]
    if not all(np.isfinite(w) and (w > 0 if n > 0 else w == 0) for w in weights):
        raise InputError(f"weight totals {weights}: expected finite numbers > 0 (0 with no sample)", url)
    extra = {k: attrs[k] for k in EXTRA_ATTRS if k in attrs}
    feats = Features(d=d, n_samples=n, n_tokens=t, gram=None, moments=arrays["moments"],
                     target_gram=arrays["target_gram"], token_gram=token_gram,
                     last_token_gram=last_token_gram, token_dtype=str(attrs.get("token_dtype", "float64")),
                     sample_range=(int(attrs["sample_lo"]), int(attrs["sample_hi"])) if "sample_lo" in attrs else None,
                     source=json.loads(attrs["source"]) if "source" in attrs else None, extra_attrs=extra,
                     basis=A, basis_moments=arrays["basis_moments"], basis_token_gram=arrays["basis_token_gram"],
                     basis_last_token_gram=arrays["basis_last_token_gram"],
                     read=ReadSpec(layout=from_attrs(attrs, url), bias_terms=formats.read_bias_terms(attrs, url),
                                   normalize=formats.read_normalize(_Attrs(attrs), url)),
                     n_sequences=int(attrs["n_sequences"]) if "n_sequences" in attrs else None,
                     target_sum=arrays["target_sum"], weight_sum=weights[0], token_weight_sum=weights[1])
    if feats.moments is None and feats.basis_moments is not None:
        feats.moments = basis_mod.features_from_basis(A, feats.basis_moments)
    return feats, side


class _Attrs:
    """`attrs` as formats.read_normalize reads them (an object with .attrs)."""

    def __init__(self, attrs: dict[str, Any]) -> None:
        self.attrs = attrs


def _tiles_array(g: Any, psi: int, side: int, url: str) -> Any:
    if TILES not in g:
        raise InputError(f"has no array '{TILES}'; the store is incomplete", url)
    arr = g[TILES]
    if tuple(arr.shape) != (psi, psi) or tuple(arr.chunks) != (side, side):
        raise InputError(f"'{TILES}' has shape {tuple(arr.shape)} and tiles {tuple(arr.chunks)}, expected "
                         f"({psi}, {psi}) in tiles ({side}, {side})", url)
    return arr


def load_tiled(path: Any, client: Any = None, spill: str | os.PathLike | None = None) -> TiledStatistics:
    """The statistics of a store with the Gram as tiles: the small sums here, and each lower tile read by a
    worker of `client` (checked finite there), or, with `client` None, left in the store as references that
    the tasks of dask's threaded scheduler read when they need the tile (the out-of-core path of one
    machine; `spill`: a local directory for the tiles the factorization makes, linalg.tiled_matrix).
    Refused when the sums are not in the whitening of their own data (a partial merge): changing the
    tiles' basis is not done over the tiles."""
    url = _url(path)
    g = _open(url)
    attrs = _attrs(g, url)
    feats, side = _sums(g, attrs, url)
    psi = feats.n_features
    _tiles_array(g, psi, side, url)
    C, _ = feats.correction()
    if C is not None:
        raise Refused("its sums are not in the whitening of their own tokens (a partial merge of shards): "
                      "certify or fit it on one machine ({no_cluster}), or merge every shard", url, no_cluster={})
    nb = psi // side
    man = attrs[manifest.MANIFEST_ATTR]
    if client is None:
        tiles = {(i, j): Stored(_read_tile, (url, i, j, side, manifest.tile_digest(man, i, j)))
                 for i in range(nb) for j in range(i + 1)}
    else:
        tiles = {(i, j): client.submit(_read_tile, url, i, j, side, manifest.tile_digest(man, i, j),
                                       key=f"mhla-read-tile-{i}-{j}-{uuid.uuid4().hex}", pure=False)
                 for i in range(nb) for j in range(i + 1)}
    return TiledStatistics(feats, TiledMatrix(client, tiles, [side] * nb, spill), side // feats.d)


def load_features(path: Any) -> Features:
    """The statistics of a store whole, on one machine (the Gram from its lower tiles, refused up front when
    it cannot fit in memory): the Features record a features file gives."""
    url = _url(path)
    g = _open(url)
    attrs = _attrs(g, url)
    check_load(int(attrs["d"]), path=url)
    feats, side = _sums(g, attrs, url)
    psi = feats.n_features
    arr = _tiles_array(g, psi, side, url)
    gram = np.empty((psi, psi))
    man = attrs[manifest.MANIFEST_ATTR]
    for i0 in range(0, psi, side):
        for j0 in range(0, i0 + 1, side):
            i, j = i0 // side, j0 // side
            tile = _tile(arr, i, j, side, manifest.tile_digest(man, i, j), url)
            gram[i0:i0 + side, j0:j0 + side] = tile
            if j0 != i0:
                gram[j0:j0 + side, i0:i0 + side] = tile.T
    feats.basis_gram = gram
    feats.finalize()
    return feats


def dims(path: Any) -> tuple[int, int]:
    """(d, n_samples) of a store, from its attributes."""
    url = _url(path)
    attrs = _attrs(_open(url), url)
    return int(attrs["d"]), int(attrs["n_samples"])


def tile_bytes(path: Any) -> int:
    """The bytes of one tile of a store's Gram (float64, `tile_features` a side), from its attributes."""
    url = _url(path)
    return 8 * int(_attrs(_open(url), url)["tile_features"]) ** 2


def part_info(path: Any) -> tuple[int, int, list[tuple[int, int]], dict[str, Any], str | None, str, int, Samples,
                                   bool]:
    """What a store says about itself for `mhla merge` (statistics.merge.read_part_info): (d, n_samples,
    sample ranges, source, shard, normalize, n_sequences, samples, bias_terms)."""
    url = _url(path)
    attrs = _attrs(_open(url), url)
    if "source" not in attrs or "sample_lo" not in attrs or "sample_hi" not in attrs:
        raise InputError("records no source or sample range, so it cannot be checked against the other parts; "
                         "make parts as shards of one tokens file", url)
    ranges = ([(int(a), int(b)) for a, b in json.loads(attrs["sample_ranges"])] if "sample_ranges" in attrs
              else [(int(attrs["sample_lo"]), int(attrs["sample_hi"]))])
    n = int(attrs["n_samples"])
    return (int(attrs["d"]), n, ranges, json.loads(attrs["source"]), attrs.get("shard"),
            formats.read_normalize(_Attrs(attrs), url), int(attrs.get("n_sequences", n)), from_attrs(attrs, url),
            formats.read_bias_terms(attrs, url))


def sum_stores(paths: list[Any], out: Any, extra_attrs: dict[str, Any], source: dict[str, Any],
               sample_range: tuple[int, int]) -> Features:
    """Write the sum of the stores `paths` (shards of one tokens file, checked by statistics.merge.plan_merge)
    to the store `out`, tile by tile (two tiles in memory); the parts must share their basis and tiles
    (stores of one file featurized on a cluster do: tiled_statistics.accumulate whitens every shard with the
    whole file's tokens). Returns the summed small sums."""
    zarr = require_zarr()
    opened = [(_url(p), _open(_url(p))) for p in paths]
    parts = [(url, g, *_sums(g, _attrs(g, url), url, part=True)) for url, g in opened]
    mans = [_attrs(g, url)[manifest.MANIFEST_ATTR] for url, g in opened]
    url0, _, total, side = parts[0]
    for url, _, feats, s in parts[1:]:
        if feats.d != total.d or s != side:
            raise InputError(f"has d = {feats.d} and tiles of {s} features, but {url0} d = {total.d} and {side}: "
                             "parts of different data", url)
        assert feats.basis is not None and total.basis is not None  # a store's statistics are in their basis
        if not np.array_equal(feats.basis, total.basis):
            raise InputError(f"is in another basis than {url0}: stores add tile by tile only in one basis; featurize "
                             "the shards of one tokens file on a cluster (they share the file's whitening)", url)
        if feats.has_targets != total.has_targets:
            raise InputError(f"{'has' if feats.has_targets else 'has no'} targets but {url0} "
                             f"{'has not' if feats.has_targets else 'has'}", url)
    for _, _, feats, _ in parts[1:]:
        total.add(feats)
    if total.n_samples == 0:
        raise InputError("every weight of every part is 0: there is no sample to learn from", url0)
    assert total.basis is not None  # a store's statistics are in their basis
    if total.basis_moments is not None:
        total.moments = basis_mod.features_from_basis(total.basis, total.basis_moments)
    total.source, total.sample_range, total.extra_attrs = source, sample_range, dict(extra_attrs)
    psi = total.n_features
    target = _url(out)
    tmp = _temporary(target)
    try:
        dst = _create(zarr, tmp, total, tuple(paths), side)
        srcs = [(_tiles_array(pg, psi, side, u), u, m) for (u, pg, _, _), m in zip(parts, mans)]
        sums = {}
        for i0 in range(0, psi, side):
            for j0 in range(0, i0 + 1, side):
                i, j = i0 // side, j0 // side
                acc = None
                for src, u, m in srcs:
                    tile = _tile(src, i, j, side, manifest.tile_digest(m, i, j), u)
                    acc = tile if acc is None else acc + tile
                assert acc is not None  # at least one part
                if not formats.all_finite(acc):
                    raise InputError(f"the sum of tile ({i}, {j}) is not finite; a part is "
                                     "corrupted or the sums overflow float64")
                dst[i0:i0 + side, j0:j0 + side] = acc
                sums[f"{i},{j}"] = manifest.digest(acc)
        _seal(zarr, tmp, sums)
        _commit(tmp, target)
    except BaseException:
        _remove(tmp)
        raise
    return total


def inspect(path: Any) -> dict[str, Any]:
    """`mhla inspect` of a store: its arrays and attributes, validated as certify and fit read it (every
    tile read once, checked finite)."""
    url = _url(path)
    rep: dict[str, Any] = {"path": str(path), "kind": None, "valid": False, "datasets": {}, "attrs": {},
                           "error": None}
    try:
        g = _open(url)
        rep["attrs"] = {k: manifest.plain(v) for k, v in dict(g.attrs).items()}
        for name in sorted(g.array_keys()):
            arr = g[name]
            rep["datasets"][name] = {"shape": list(arr.shape), "dtype": str(arr.dtype)}
        rep["kind"] = "features"
        attrs = _attrs(g, url)
        feats, side = _sums(g, attrs, url)
        psi = feats.n_features
        arr = _tiles_array(g, psi, side, url)
        for i in range(psi // side):
            for j in range(i + 1):
                _tile(arr, i, j, side, manifest.tile_digest(attrs[manifest.MANIFEST_ATTR], i, j), url)
        if isinstance(rep["attrs"].get("mhla_inputs"), str):
            rep["provenance"] = {"inputs": json.loads(rep["attrs"]["mhla_inputs"]),
                                 "command": rep["attrs"].get("mhla_command"),
                                 "mhla_version": rep["attrs"].get("mhla_version"),
                                 "created": rep["attrs"].get("mhla_created")}
        rep.update(d=feats.d, n_samples=feats.n_samples, n_features=psi, n_tokens=feats.n_tokens,
                   has_targets=feats.has_targets,
                   sample_range=list(feats.sample_range) if feats.sample_range else None,
                   per_position=feats.per_position, attention=feats.samples.attention, normalize=feats.normalize,
                   gram_form="tiles",
                   tile_features=side, valid=True)
    except InputError as exc:
        rep["error"] = str(exc)
    except (OSError, KeyError, ValueError, TypeError) as exc:
        rep["error"] = str(InputError(f"cannot read ({' '.join(str(exc).split())}); the store may be incomplete "
                                      "or corrupted", url))
    return rep
