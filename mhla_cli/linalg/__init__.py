"""Layer 1, linalg: the dense linear algebra every layer above runs on.

The package, by job:

- `backends`: one class per --device backend, host NumPy or torch, resolved once (`get_backend`);
- `device`: the torch backend's Gram and matrix, device spellings, the one import of torch;
- `factorization`: one Cholesky / eigendecomposition of a Gram, reused (certificate, proof, solves);
- `krylov`: block Lanczos, the top eigenvalue of an operator, several vectors a product;
- `symgram`: the Gram's distinct entries K = U^T V;
- `tiled_matrix`: a symmetric matrix as lower tiles (on a Dask cluster or in a local store), its blocked Cholesky;
- `task_graph`: Dask task graphs with deterministic keys, run on any Dask scheduler (threads or a cluster);
- `memory`: what fits in memory, refused up front.
"""
