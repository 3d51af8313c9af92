"""Layer 5, solve: from statistics to a certificate and a fit.

The package, by job:

- `domains`: the full and observed certificate domains (map, dimensions, names, factorization);
- `certificate`: `Certificate`, the certificate of statistics in memory (`certify_features`) or tiled on a cluster
  (`certify_tiled`), and its explanation;
- `lstsq`: the least-squares / ridge fit;
- `affine_block`: the certificate and the fit of the features extended by the token-wise affine block of the wide
  tokens (`certify_extended`, `fit_extended`);
- `blocks`: a sum of MHLA blocks, each on its own token map: the joint statistics over a tokens file, their
  certificate and least squares (`block_statistics`, `certify_blocks`, `fit_blocks`);
- `cluster`: the statistics tiled on a Dask cluster and their fit (`open_statistics`, `fit_tiled`: the identifiable
  path);
- `probes`: certificates on probe sequences;
- `witness`: a counterexample pair of functions;
- `ridge_cv`: `--ridge auto` by K-fold cross-validation;
- `lowrank`: few-head and nuclear-norm fits, the fewest heads;
- `spectrum`: the head count from W's spectrum.
"""
