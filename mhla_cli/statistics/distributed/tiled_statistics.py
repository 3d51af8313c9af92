"""The statistics of a tokens file accumulated on a Dask cluster, the Gram as tiles that stay on the workers.

`accumulate(path, client)` is the cluster's featurize (docs/cluster.md, "The Gram on the cluster"):

1. the canonical whitening first: the d x d token Gram of the data, summed on the workers by the one
   chunk reduction of mhla (ranges.accumulate_ranges over parallel.DaskMap, accumulating a block of zero
   features: only the token Grams, counts and weight totals), A = its whitening (basis.whitening, not
   rounded); then the same sums in basis A (and every sum the record holds but the Gram: the
   targets' Gram and sum), until A is the whitening of the data to basis.correction's tolerance
   (the first pass already is, but for data whose directions float64 hardly resolves);
2. the tiles of the canonical Gram sum_i w_i Ht_i Ht_i^T: tile (I, J) holds the features of the
   pair block I times those of J (every token coordinate l: a tile is |I| d x |J| d, `tile_pairs`),
   and each task reads its share of the tokens file itself (`_tile_part`: a range of samples, its
   chunks read by io.tokens.iter_chunks and turned into the samples' rows by kernels.sample_rows on
   X A), computing only the distinct entries of the symmetric form (linalg.symgram: the Gram is
   symmetric in the pairs (a, b) and in the token coordinates (l, m) separately): on a diagonal tile
   the K = U^T V of symgram.SymGram (which also gives the tile rows' moments), elsewhere
   K_IJ[(a, b), (l <= m)] = sum_i w_i s_ia s_ib x_il x_im for every a in I, b in J, one GEMM per
   panel of U; each tile is expanded from its K on the worker. Only the lower tiles (I >= J) exist;
   the parts of a tile from different sample ranges are summed pairwise on the workers.

The client receives the d x d sums, the moments (psi x d) and nothing of the Gram; the tiles are
futures of a mhla_cli.linalg.tiled_matrix.TiledMatrix. Every sample layout (mhla_cli.samples: last
token, causal prefixes, every position of a bidirectional window; weights, --normalize length) and the
bias terms (the reader's constant coordinate) give their rows as on one machine (`Samples.rows`, in the
accumulator's order: canonical scale, then the length): one sample per row (K's token factor the pairs
of sqrt(w) x) or a window per row (its X^T W X, symgram.SymGram.add_windows). The affine block of
--affine-from is not tiled: it is refused on a cluster (solve.cluster.RULES).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from mhla_cli.statistics import basis as basis_mod
from mhla_cli.statistics.distributed import parallel
from mhla_cli.errors import InputError
from mhla_cli.io import formats
from mhla_cli.io.tokens import TokensInfo, inspect_tokens, iter_chunks, read_as, with_bias_terms
from mhla_cli.linalg import symgram
from mhla_cli.linalg.memory import check_floor
from mhla_cli.linalg.factorization import Factorization
from mhla_cli.linalg.tiled_matrix import TiledMatrix
from mhla_cli.statistics.storage.gram_tiled import TiledGram
from mhla_cli.statistics.distributed.scheduler import check_worker_memory
from mhla_cli.samples import ReadSpec
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.shards import shard_samples, work_ranges
from mhla_cli.statistics.structure import Structure
from mhla_cli.statistics.ranges import default_chunk_size, accumulate_ranges

__all__ = ["BASIS_PASSES", "BASIS_RANGES", "TILE_BYTES", "TiledStatistics", "accumulate", "tile_pairs"]

# The tiles' size: about this many bytes each (float64), i.e. about 2048 features a side. A task holds
# a few tiles (a tile, its distinct entries K and, in the Cholesky, up to four tiles) and one chunk's rows.
TILE_BYTES = 32 * 2**20
# Passes over the tokens (d x d sums only) to reach the whitening of the data before the tiles are
# accumulated (`accumulate`): the first whitening is exact to rounding; a second is for data whose
# token Gram float64 hardly resolves.
BASIS_PASSES = 3
# The whole-file passes that find the basis are cut into this many sample ranges (at most; one chunk at least
# each) whatever the cluster's size, so that the basis, summed in a fixed order, is the same bit for bit
# on every cluster and for every shard of one file (their tiles then add: zarr_store.sum_stores).
BASIS_RANGES = 64
# Bytes of one panel of U (the pair products s_a s_b of an off-diagonal tile, for a chunk's rows).
PANEL_BYTES = 32 * 2**20


def tile_pairs(d: int, tile_features: int | None = None) -> int:
    """Pairs per tile: the divisor of q = d (d + 1) / 2 nearest to tile_features / d (default from
    TILE_BYTES), so that every tile has the same side (as the blocked Cholesky and dask.array take them)."""
    q = d * (d + 1) // 2
    target = (math.isqrt(TILE_BYTES // 8) if tile_features is None else int(tile_features)) / d
    divisors = [k for k in range(1, q + 1) if q % k == 0]
    return min(divisors, key=lambda k: (abs(math.log(k / max(target, 1e-9))), -k))


@dataclass
class TiledStatistics:
    """Sufficient statistics whose canonical Gram is tiled on a Dask cluster (module docstring).

    `sums`: a Features record of every sum but the Gram (its `basis_gram` is None), in the canonical
    basis (the whitening of its own data); `matrix`: the lower tiles of basis_gram = sum w Ht Ht^T
    (Lambda~ = basis_gram / sums.weight); `pairs`: pair indices per tile (every tile is pairs * d
    features a side)."""

    sums: Features
    matrix: TiledMatrix
    pairs: int
    _factorization: Factorization | None = field(default=None, init=False, repr=False, compare=False)

    def factorization(self) -> Factorization:
        """The factorization of the canonical Lambda~ = basis_gram / sum w over the tiles (no structure:
        every feature is in the block), made once and reused by certify and fit."""
        if self._factorization is None:
            d = self.d
            fac = self.gram.factorization(1.0 / (self.sums.weight or 1.0), self.n_features)
            fac.structure = Structure.identity(d * (d + 1) // 2, d)
            self._factorization = fac
        return self._factorization

    @property
    def gram(self) -> TiledGram:
        """The tiles as a Gram storage (mhla_cli.statistics.storage.gram_storage): the algebra and the factorization
        over them, never gathered."""
        return TiledGram(self.matrix)

    @property
    def d(self) -> int:
        return self.sums.d

    @property
    def n_features(self) -> int:
        return self.sums.n_features

    @property
    def tile(self) -> int:
        """Features per tile side."""
        return self.pairs * self.sums.d

    def release(self) -> None:
        """Free the tiles on the cluster."""
        self.matrix.release()


def _zero_block(d: int) -> tuple[np.ndarray, np.ndarray]:
    """Spans of zero width (statistics.ranges.accumulate_range): the pass accumulates no feature, only the
    token Grams, the targets' Gram and sum, the counts and the weight totals."""
    return np.zeros((d * (d + 1) // 2, 0)), np.zeros((d, 0))


def _stamp(path: str) -> tuple[int, int]:
    """What tells whether the tokens file changed between the passes: its size and modification time."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def accumulate(path: str | os.PathLike, client: Any, chunk_size: int | None = None, read: ReadSpec | None = None,
               shard: tuple[int, int] | None = None, tile_features: int | None = None) -> TiledStatistics:
    """The statistics of the tokens file `path` (of its --shard i/M) on the Dask `client`'s cluster
    (module docstring), its samples read as `read` says (mhla_cli.samples.ReadSpec: the layout, the
    normalisation, the bias terms; None: as the file says, S not normalised, no bias terms) as
    statistics.stream.featurize reads them. The basis is the whitening of the whole file's tokens, so that
    every shard of one file is accumulated in the same basis and their tiles add (`zarr_store.merge`)."""
    read = ReadSpec() if read is None else read
    normalize = read.normalize or "none"
    info = read_as(inspect_tokens(path), read.layout)
    if read.bias_terms:
        info = with_bias_terms(info)
    check_floor(info.d, path, "featurize")
    lo, hi = shard_samples(info.n_samples, shard, path)
    winfo = replace(info, path=os.path.abspath(info.path))  # the workers open the file themselves
    size = chunk_size or default_chunk_size(info)
    stamp = _stamp(winfo.path)
    with parallel.make_map(scheduler=client) as pmap:
        check_worker_memory(pmap.client, 8 * (tile_pairs(info.d, tile_features) * info.d) ** 2)

        def small(A: np.ndarray | None, sample_range: tuple[int, int]) -> Features:
            return accumulate_ranges(winfo, work_ranges(*sample_range, size, BASIS_RANGES, per_worker=1), map=pmap,
                                chunk_size=size, normalize=normalize, basis=A, finalize=False,
                                spans=_zero_block(info.d))
        whole = small(None, (0, info.n_samples))
        A = basis_mod.whitening(whole.token_gram, whole.token_weight, round32=False)
        cond, passes = 1.0, 0
        for passes in range(1, BASIS_PASSES + 1):
            whole = small(A, (0, info.n_samples))
            assert whole.basis_token_gram is not None  # accumulated in the basis A
            C, c = basis_mod.correction(whole.basis_token_gram, whole.token_weight)
            cond = max(cond, c) if passes == 1 else cond
            if C is None:
                break
            A = A @ C
        sums = whole if (lo, hi) == (0, info.n_samples) else small(A, (lo, hi))
        if sums.n_samples == 0 and shard is None:  # a shard of no weight is an empty part: zero sums that add
            raise InputError(f"every weight of samples {lo}..{hi} is 0: there is no sample to learn from", path)
        matrix, pairs, moments = _tiles(client, winfo, (lo, hi), A, size, normalize, stamp, tile_features,
                                        pmap.n_workers)
    if _stamp(winfo.path) != stamp:
        raise InputError("changed while it was read; run the command again", path)
    return TiledStatistics(_record(sums, info, path, (lo, hi), shard, A, moments, passes, cond), matrix, pairs)


def _record(part: Features, info: TokensInfo, path: str | os.PathLike, sample_range: tuple[int, int],
            shard: tuple[int, int] | None, A: np.ndarray, moments: np.ndarray | None, passes: int,
            cond: float) -> Features:
    """The Features record of the sums (no Gram), with the provenance of a features file."""
    d = info.d
    with np.errstate(over="ignore", invalid="ignore"):
        own = None if moments is None else basis_mod.features_from_basis(A, moments)
    for what, a in (("moments", own), ("basis moments", moments), ("target Gram", part.target_gram)):
        if a is not None and not formats.all_finite(a):
            raise InputError(f"the statistics of the data overflow float64 ({what}; tokens or targets too large); "
                             "rescale the data", path)
    feats = Features(d=d, n_samples=part.n_samples, n_tokens=part.n_tokens, gram=None, token_gram=part.token_gram,
                     last_token_gram=part.last_token_gram, moments=own, target_gram=part.target_gram,
                     token_dtype=info.dtype, sample_range=sample_range, basis=np.array(A),
                     basis_moments=moments, basis_token_gram=part.basis_token_gram,
                     basis_last_token_gram=part.basis_last_token_gram,
                     read=ReadSpec(part.samples, part.normalize, info.constant), n_sequences=part.n_sequences,
                     target_sum=part.target_sum, weight_sum=part.weight, token_weight_sum=part.token_weight)
    feats.source = dict(formats.source_identity(path), n_samples=info.n_samples)
    feats.extra_attrs.update(basis_passes=passes, basis_correction_cond=float(cond), span_passes=0)
    if shard is not None:
        feats.extra_attrs["shard"] = f"{shard[0]}/{shard[1]}"
    return feats


def _tiles(client: Any, info: TokensInfo, sample_range: tuple[int, int], A: np.ndarray, size: int, normalize: str,
           stamp: tuple[int, int], tile_features: int | None, n_workers: int
           ) -> tuple[TiledMatrix, int, np.ndarray | None]:
    """The lower tiles of the canonical Gram of samples `sample_range` (futures, summed over the sample ranges on the
    workers) and the canonical moments (gathered: psi x d)."""
    d = info.d
    q = d * (d + 1) // 2
    k = tile_pairs(d, tile_features)
    nb = q // k
    n_tiles = nb * (nb + 1) // 2
    # the data in one part per tile when the tiles give every worker a few tasks; in more when they are few
    ranges = work_ranges(*sample_range, size, max(1, math.ceil(2 * n_workers / n_tiles)), per_worker=1)
    # A (d x d) travels inside every task (not scattered): a task lost with its worker runs again from its spec
    A = np.ascontiguousarray(A)
    tiles: dict[tuple[int, int], Any] = {}
    moment_rows: list[Any] = []
    tasks = 0
    for i in range(nb):
        for j in range(i + 1):
            parts = [client.submit(_tile_part, info, s, A, (i * k, (i + 1) * k), (j * k, (j + 1) * k), size,
                                   normalize, stamp, key=f"mhla-tile-{i}-{j}-{n}-{_token()}", pure=False)
                     for n, s in enumerate(ranges)]
            tasks += len(parts)
            while len(parts) > 1:  # pairwise sums on the workers: a task holds two parts
                nxt = [client.submit(_add_parts, a, b, key=f"mhla-tile-sum-{i}-{j}-{_token()}", pure=False)
                       for a, b in zip(parts[0::2], parts[1::2])]
                tasks += len(nxt)
                parts = nxt + ([parts[-1]] if len(parts) % 2 else [])
            tiles[i, j] = client.submit(_tile_of, parts[0], key=f"mhla-tile-final-{i}-{j}-{_token()}", pure=False)
            if i == j and info.has_targets:
                moment_rows.append(client.submit(_moments_of, parts[0], key=f"mhla-moments-{i}-{_token()}",
                                                 pure=False))
    matrix = TiledMatrix(client, tiles, [k * d] * nb)
    matrix.tasks["accumulate"] = tasks + len(tiles) + len(moment_rows)
    moments = np.concatenate(client.gather(moment_rows), axis=0) if moment_rows else None
    # one flag per tile comes back, not the tile
    finite = client.gather([client.submit(formats.all_finite, t, key=f"mhla-tile-finite-{_token()}", pure=False)
                            for t in tiles.values()])
    if not all(finite):
        raise InputError("the statistics of the data overflow float64 (tokens or targets too large); "
                         "rescale the data", info.path)
    return matrix, k, moments


def _token() -> str:
    import uuid

    return uuid.uuid4().hex[:16]


# --------------------------------------------------------------------------------------------
# tasks (run on the workers)
# --------------------------------------------------------------------------------------------


def _rows(tokens: np.ndarray, offsets: np.ndarray, targets: np.ndarray | None, weights: np.ndarray | None,
          A: np.ndarray, info: TokensInfo, normalize: str) -> tuple[np.ndarray, np.ndarray, Any]:
    """The chunk's rows as factors of the canonical features, as statistics.accumulate adds them (the layout's
    `Samples.rows` of X A): (s_t (q, R): D upper(S), divided by the length with normalize="length"; V (d (d + 1)
    / 2, R): the pairs l <= m of the token factor, x_l x_m of sqrt(w) x for one sample per row, (X^T W X)_lm
    for a window per row; the Rows themselves, whose targets give the moments)."""
    X = np.asarray(tokens, dtype=np.float64) @ A
    rows = info.samples.rows(X, offsets, weights, targets)
    d = A.shape[0]
    upper = rows.upper * basis_mod.pair_scale(d)
    if normalize == "length":
        upper /= rows.lengths[:, None]
    jl, jm = np.triu_indices(d)  # the token pairs l <= m, in the order of symgram.pair_positions
    if rows.xx is not None:
        V = np.take(rows.xx.reshape(rows.n_rows, d * d), jl * d + jm, axis=1).T
    else:
        assert rows.x is not None  # one sample per row
        x = rows.x if rows.w is None else rows.x * np.sqrt(rows.w)[:, None]
        V = (x[:, jl] * x[:, jm]).T
    return np.ascontiguousarray(upper.T), np.ascontiguousarray(V), rows


def _tile_part(info: TokensInfo, sample_range: tuple[int, int], A: np.ndarray, rows_i: tuple[int, int],
               rows_j: tuple[int, int], chunk_size: int, normalize: str, stamp: tuple[int, int]) -> Any:
    """The part of samples `sample_range` of the tile (pair block rows_i x pair block rows_j): on a diagonal tile
    the symgram.SymGram of the block (K, the moments, the targets' Gram); elsewhere K_IJ (module docstring).
    The tokens file is read here, chunk by chunk."""
    if _stamp(info.path) != stamp:
        raise InputError("changed while it was read; run the command again", info.path)
    d = info.d
    a0, a1 = rows_i
    b0, b1 = rows_j
    diagonal = rows_i == rows_j
    part: Any = symgram.SymGram(a1 - a0, d, info.out_dim if info.has_targets else 0) if diagonal else \
        np.zeros(((a1 - a0) * (b1 - b0), d * (d + 1) // 2))
    for _, _, tokens, offsets, targets, weights in iter_chunks(info, sample_range, chunk_size, with_weights=True):
        s_t, V, rows = _rows(tokens, offsets, targets if info.has_targets else None, weights, A, info, normalize)
        if rows.n_rows == 0:
            continue
        if diagonal:
            s_block = np.ascontiguousarray(s_t[a0:a1])
            if rows.xx is not None:
                part.add_windows(s_block, rows.xx, rows.xy, rows.yy)
            else:
                sw = None if rows.w is None else np.sqrt(rows.w)
                x_t = rows.x.T if sw is None else (rows.x * sw[:, None]).T
                y_t = None if rows.y is None else (rows.y.T if sw is None else (rows.y * sw[:, None]).T)
                part.add(s_block, np.ascontiguousarray(x_t), None if y_t is None else np.ascontiguousarray(y_t))
            continue
        si, sj = s_t[a0:a1], s_t[b0:b1]
        R = s_t.shape[1]
        per = max(1, PANEL_BYTES // (8 * max(1, (b1 - b0) * R)))  # pair rows a of U per panel
        for p0 in range(0, a1 - a0, per):
            p1 = min(a1 - a0, p0 + per)
            U = (si[p0:p1, None, :] * sj[None, :, :]).reshape((p1 - p0) * (b1 - b0), R)
            part[p0 * (b1 - b0):p1 * (b1 - b0)] += U @ V.T
    if diagonal:
        part.release_work()
        return ("diagonal", part.K, part.moments(), a1 - a0)
    return ("off", part, a1 - a0, b1 - b0)


def _add_parts(a: Any, b: Any) -> Any:
    """The sum of two parts of one tile (from disjoint sample ranges)."""
    if a[0] == "diagonal":
        return ("diagonal", a[1] + b[1], None if a[2] is None else a[2] + b[2], a[3])
    return ("off", a[1] + b[1], a[2], a[3])


def _tile_of(part: Any) -> np.ndarray:
    """The tile (|I| d x |J| d) expanded from its distinct entries."""
    if part[0] == "diagonal":
        _, K, _, k = part
        d = _token_dim(K.shape[1])
        return symgram.gram_from_pairs(K, k, d)
    _, K, ki, kj = part
    d = _token_dim(K.shape[1])
    pos = symgram.pair_positions(d)
    # tile[(a, l), (b, m)] = K[(a, b), pos(l, m)]
    return np.ascontiguousarray(K[:, pos].reshape(ki, kj, d, d).transpose(0, 2, 1, 3).reshape(ki * d, kj * d))


def _moments_of(part: Any) -> np.ndarray:
    """The canonical moments of a diagonal tile's pair block: (|I| d, d)."""
    return part[2]


def _token_dim(pairs: int) -> int:
    """d from d (d + 1) / 2."""
    return (math.isqrt(8 * pairs + 1) - 1) // 2


