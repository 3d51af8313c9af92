"""Layer 3, statistics: the sufficient statistics of the data, streamed.

The package, by job. The record and its algebra:

- `features`: the `Features` record;
- `algebra`: its sums and its change of basis;
- `record_fields`: the record's fields as its mixins (`algebra`, `files.features_file`) see them, for mypy;
- `basis`: canonical coordinates, the whitening A of the data's own tokens;
- `structure`: the data's own symmetries that shrink psi (the spans, from partial traces);
- `affine_sums`: the sums of the token-wise affine block of the wide tokens;

its storages, its files and the distributed accumulation, each a folder:

- `storage`: where the canonical Gram lives (dense, distinct entries, tiles), one module each;
- `files`: the HDF5 features file and the Zarr features store;
- `distributed`: worker pools, the Dask scheduler, the Gram accumulated as tiles on a cluster;

and the pass over a tokens file on one machine:

- `accumulate`: the accumulator of one pass (its per-chunk moments come from mhla_cli.kernels);
- `ranges`: chunk sizing, the accumulation over sample ranges, the basis estimate;
- `spans`: the passes that find the data's spans;
- `shards`: sample ranges of shards and workers;
- `stream`: `featurize` / `load_features`;
- `merge`: shards -> one features file;
- `folds`: per-fold statistics for cross-validation.
"""
