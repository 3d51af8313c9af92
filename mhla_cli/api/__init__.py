"""Layer 6, api: the library's entry points above the solvers.

The package, by job:

- `learn`: the one `certify` and the one `fit` for statistics of every storage, and `export_heads`, as the commands
  run them;
- `estimator`: the scikit-learn-style `MHLA`;
- `inspect`: what a file holds.
"""
