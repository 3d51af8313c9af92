"""Layer 3, statistics: the sufficient statistics of the data, streamed.

basis (canonical coordinates: the whitening A), structure (the data's own symmetries that shrink psi), stats
(the Features record and its algebra), kernels (per-chunk moments), accumulate (the accumulator of one
reduction), spans (chunk sizing, the reduction over sample spans, the span passes), shards (sample ranges of
shards and workers), stream (featurize / load_features), parallel (worker pools), merge (shards -> one
features file), folds (per-fold statistics for cross-validation).
"""
