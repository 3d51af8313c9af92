"""Layer 6, api: the library's entry points above the solvers.

The package, by job:

- `learn`: fit / export_heads as the commands run them;
- `estimator`: the scikit-learn-style `MHLA`;
- `inspect`: what a file holds.
"""
