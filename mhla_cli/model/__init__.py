"""Layer 4, model: the learned function and what evaluates it.

The package, by job:

- `heads`: V, Q heads <-> coef p <-> W;
- `_head_shapes`: the widths of a set of heads, shared by `heads` and `_heads_module`;
- `_heads_module`: the PyTorch module of an MHLA (optional: torch);
- `model`: a fitted `Model` and its file;
- `export`: heads to HDF5 / npz / safetensors files;
- `forward`: the forward pass, predict over files, rollout;
- `scores`: MSE, R^2;
- `reduce`: wide tokens -> d (`mhla reduce`: the maps, the pass, the reduced file);
- `directions`: the token directions of `reduce --method` (PCA, supervised, weights) from second moments;
- `synthetic`: teachers and data;
- `compare`: the distance between two functions;
- `splice`: fitted heads spliced into a Hugging Face model in place of a head or a layer (a module, a context
  manager, TransformerLens hooks, a safetensors replacement file; optional: torch);
- `judge`: the original model against the spliced one (embeddings' cosines, Spearman, loss recovered; optional:
  torch);
- `heads_sum`: a layer as a sum of blocks of factored heads, each on its own token map (`HeadsSum`: predict, save,
  a torch module; `sum_of_blocks` of blocks fitted one by one);
- `canonical`: a function in the canonical coordinates of its data (heads found there, changes measured
  on it).
"""
