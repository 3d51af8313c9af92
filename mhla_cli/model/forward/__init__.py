"""The MHLA forward pass: last-token and all-position outputs, from coef p or from heads.

The package, by job (every name is re-exported here: ``forward.<name>`` is the one way in):

- `evaluate`: the function a model or heads file evaluates and its outputs on tokens in memory (last token,
  every position of the whole window, every prefix; heads evaluated directly, factored ones included);
- `stream`: `predict_file`, the same pass streamed over a tokens file (chunks, workers, the device, the
  affine map of the wide tokens, the scores against last-token or per-position targets);
- `rollout`: autoregressive generation (`mhla rollout`).
"""

from .evaluate import (
    DIRECT_CHUNK_BYTES, DIRECT_COEF_BYTES, HeadsFn, OUTPUT_BLOCKS, OUTPUT_BLOCK_ROWS, as_ragged, causal_chunk,
    direct, evaluated, fitted_samples, forward_heads, function_of, heads_chunk, in_basis, in_width, out_width,
    predict, predict_causal, predict_chunk, predict_samples, sample_outputs,
)
from .stream import Predictions, causal_range, positions_range, predict_file, predict_range, scored
from .rollout import SNAP_BLOCK_ENTRIES, load_codebook, rollout_chunk, rollout_file, snap_to

__all__ = [
    "DIRECT_CHUNK_BYTES", "DIRECT_COEF_BYTES", "HeadsFn", "OUTPUT_BLOCKS", "OUTPUT_BLOCK_ROWS", "Predictions",
    "SNAP_BLOCK_ENTRIES", "as_ragged", "causal_chunk", "causal_range", "direct", "evaluated", "fitted_samples",
    "forward_heads", "function_of", "heads_chunk", "in_basis", "in_width", "load_codebook", "out_width",
    "positions_range", "predict", "predict_causal", "predict_chunk", "predict_file", "predict_samples",
    "predict_range", "rollout_chunk", "rollout_file", "sample_outputs", "scored", "snap_to",
]
