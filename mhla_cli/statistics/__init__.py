"""Layer 3, statistics: the sufficient statistics of the data, streamed.

basis (canonical coordinates: the whitening A), structure (the data's own symmetries that shrink psi), features
(the Features record), algebra (its sums and change of basis), features_file (its file; stats re-exports the
three), stream (the streaming reduction over chunk spans), parallel (worker pools), merge (shards -> one
features file), folds (per-fold statistics for cross-validation).
"""
