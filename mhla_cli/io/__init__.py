"""Layer 2, io: files in and out.

The package, by job:

- `formats`: HDF5 helpers, format versions, manifests, atomic writes;
- `tokens`: token-sequence files, their validation and chunked reads;
- `convert`: npy / npz / safetensors / torch / HDF5 activations / datasets .arrow -> a tokens file.
"""
