"""Layer 1, linalg: the dense linear algebra every layer above runs on.

device (the --device backends: host NumPy or torch), factorization (one Cholesky / eigendecomposition of a
Gram, reused: certificate, proof, solves), symgram (the Gram's distinct entries K = U^T V), memory (what fits
in memory: refused up front).
"""
