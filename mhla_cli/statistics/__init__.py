"""Layer 3, statistics: the sufficient statistics of the data, streamed.

basis (canonical coordinates: the whitening A), structure (the data's own symmetries that shrink psi), stats
(the Features record and its algebra), stream (the streaming reduction over chunk spans), parallel (worker
pools), merge (shards -> one features file), folds (per-fold statistics for cross-validation).
"""
