"""Layer 3, statistics: the sufficient statistics of the data, streamed.

The package, by job:

- `basis`: canonical coordinates, the whitening A of the data's own tokens;
- `structure`: the data's own symmetries that shrink psi (the spans, from partial traces);
- `features`: the `Features` record;
- `algebra`: its sums and its change of basis;
- `features_file`: its HDF5 file;
- `gram_storage`: where the canonical Gram lives, the one interface of its storages;
- `gram_dense`: the Gram dense in memory;
- `gram_pairs`: the Gram as its distinct entries (a compact features file);
- `gram_tiled`: the Gram as tiles on a Dask cluster;
- `affine_sums`: the sums of the token-wise affine block of the wide tokens;
- `accumulate`: the accumulator of one pass (its per-chunk moments come from mhla_cli.kernels);
- `ranges`: chunk sizing, the accumulation over sample ranges, the basis estimate;
- `spans`: the passes that find the data's spans;
- `shards`: sample ranges of shards and workers;
- `stream`: `featurize` / `load_features`;
- `parallel`: worker pools (local or Dask) for featurize;
- `scheduler`: a Dask scheduler for mhla's work and bounds on every wait on it;
- `tiled_gram`: the statistics of a tokens file accumulated on a Dask cluster, the Gram as tiles;
- `zarr_store`: the Zarr features store of statistics whose Gram is tiled;
- `store_location`: where a Zarr store is written, and its commit once complete and verified;
- `merge`: shards -> one features file;
- `folds`: per-fold statistics for cross-validation.
"""
