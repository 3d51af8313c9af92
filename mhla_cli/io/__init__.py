"""Layer 2, io: files in and out.

formats (HDF5 helpers, format versions, atomic writes), tokens (token-sequence files: validation, chunked
reads), convert (npy / npz / safetensors / torch / HDF5 activations / datasets .arrow -> a tokens
file).
"""
