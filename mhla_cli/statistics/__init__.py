"""Layer 3, statistics: the sufficient statistics of the data, streamed.

basis (canonical coordinates: the whitening A), structure (the data's own symmetries that shrink psi), features
(the Features record), algebra (its sums and change of basis), features_file (its file), accumulate (the
accumulator of one pass; its per-chunk moments come from mhla_cli.kernels), ranges (chunk sizing, the accumulation
over sample ranges, the basis estimate), spans (the passes that find the data's spans), shards (sample ranges of
shards and workers), stream (featurize / load_features), parallel (worker pools), merge (shards -> one features
file), folds (per-fold statistics for cross-validation).
"""
