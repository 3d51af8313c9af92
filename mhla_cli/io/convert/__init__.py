"""Tokens files from other formats: NumPy .npy / .npz, safetensors, torch .pt, HDF5 activations,
Hugging Face `datasets` directories (.arrow), and in-memory arrays.

`write_tokens` writes arrays (a list of sequences, or tokens + offsets) as a tokens file and
`convert_files` does the same for files. Both copy the data in chunks of samples into the HDF5
output, so inputs larger than memory convert in bounded memory, and both validate like every reader
(`tokens.inspect_tokens` for shapes and offsets, `tokens.check_finite` and `tokens.check_weights` for
the values, chunk by chunk) before the output is renamed into place: a bad input leaves nothing.

Arrays are named as the datasets of a tokens file (docs/tokens.md): tokens, offsets, targets,
weights. The package, by job:

- `_source`: `_Source`, what every reader returns (a name, a shape, a dtype and a reader of rows
  [a, b)), and `Reader`, one input format;
- `_readers`: the registry of formats, one module per format below. A new format is a module
  defining a `Reader` and its line in `_readers.READERS`;
- `_numpy`: .npy, .npz;
- `_safetensors`: .safetensors;
- `_torch`: .pt;
- `_values`: tensors, arrays and lists of sequences in memory (of .pt files and `write_tokens`);
- `_hdf5`: HDF5 activations;
- `_arrow`: datasets directories, SAELens caches;
- `_roles`: dataset names, `--key ROLE=NAME[h]`, the hooks left out and the record of TransformerLens's
  compatibility mode;
- `_masks`: padded activations with a padding mask;
- `_join`: several files as one;
- `_writer`: the chunked copy, the `attention` attribute and `write_tokens`;
- `_driver`: `convert_files`.
"""

from ._driver import convert_files, expand_inputs, parse_input
from ._readers import READERS, SUFFIXES
from ..formats import COMPAT_ATTR, recorded_compatibility_mode
from ._roles import COMPAT_KEY, MASK_NAMES, NAMES, ROLES, TOKEN_ALIASES, parse_keys
from ._source import Reader
from ._writer import CHUNK_BYTES, write_tokens

__all__ = ["CHUNK_BYTES", "COMPAT_ATTR", "COMPAT_KEY", "MASK_NAMES", "NAMES", "READERS", "ROLES", "Reader", "SUFFIXES", "TOKEN_ALIASES",
           "convert_files", "expand_inputs", "parse_input", "parse_keys", "recorded_compatibility_mode",
           "write_tokens"]
