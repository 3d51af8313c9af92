"""The accumulation spread over processes: worker pools, a Dask scheduler, the Gram as tiles on a cluster.

- `parallel`: worker pools (local processes or Dask) for featurize;
- `scheduler`: a Dask scheduler for mhla's work and bounds on every wait on it;
- `tiled_statistics`: the statistics of a tokens file accumulated on a Dask cluster, the Gram as tiles.
"""
