"""Where the canonical Gram lives: one interface and one module per storage.

- `gram_storage`: the interface every storage implements (its features-file datasets too), the registry
  (`BUILT_IN`, `register`, `wrap`, `file_storage`);
- `gram_dense`: the Gram dense in memory (the full form of a features file);
- `gram_pairs`: the Gram as its distinct entries (a compact features file);
- `gram_tiled`: the Gram as tiles of a Zarr store, factored by a task graph.
"""
