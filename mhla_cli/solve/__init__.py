"""Layer 5, solve: from statistics to a certificate and a fit.

The package, by job:

- `domains`: the full and observed certificate domains (map, dimensions, names, factorization);
- `certificate`: `certify`, `Certificate` and its explanation;
- `lstsq`: the least-squares / ridge fit;
- `affine_block`: the certificate and the fit with the token-wise affine block of the wide tokens;
- `cluster`: certify and fit with the Gram tiled on a Dask cluster (the identifiable path);
- `probes`: certificates on probe sequences;
- `witness`: a counterexample pair of functions;
- `ridge_cv`: `--ridge auto` by K-fold cross-validation;
- `lowrank`: few-head and nuclear-norm fits, the fewest heads;
- `spectrum`: the head count from W's spectrum.
"""
