"""mhla's HDF5 file formats: names, versions, validation, provenance and atomic writes.

Every file mhla writes has root attributes ``mhla_kind``, ``mhla_format_version`` and
``mhla_version``; tokens files made by users need no attributes at all. See docs/formats.md.

The package, by job (every name is re-exported here: ``formats.<name>`` is the one way in):

- `reading`: the kinds and the format version, opening an input, reading and validating its arrays
  and attributes, the schema checks of the files mhla writes;
- `identity`: an input's identity (fingerprint; the maps of the reduction that wrote it) and the
  attributes saying which mhla, command and inputs made a file;
- `manifest`: the checksums of what a file holds, written with it and compared as it is read;
- `writing`: output paths, the atomic-write protocol, the header and `write_file`.
"""

from .reading import (
    FORMAT_NAME, FORMAT_VERSION, KINDS, PAIRS_DATASET, all_finite, check_numeric, check_stored_symmetric,
    d_from_psi_shape, dataset, expect_kind, file_kind, kind_of, not_hdf5_reason, open_input, read_array,
    read_attr_int, read_bias_terms, read_matrix, read_normalize, stored_block, value_text,
)
from .identity import (
    COMPAT_ATTR, FOREIGN_SUFFIXES, FULL_FINGERPRINT_BYTES, REDUCE_DIGESTS, command_line, provenance, recorded_compatibility_mode,
    recorded_inputs,
    set_command, source_identity, window_digests,
)
from .manifest import MANIFEST_ATTR, MANIFEST_FORMAT, MANIFEST_KINDS
from .writing import (
    Deferred, HDF5_SUFFIXES, IN_MEMORY_WRITE_BYTES, PNG_SOFTWARE, atomic_path, check_hdf5_suffix,
    check_output_directory, check_output_path, check_replaceable, create_output, hdf5_write_failed, header, overlaps,
    write_file, written_kind,
)

__all__ = [
    "COMPAT_ATTR", "Deferred", "FOREIGN_SUFFIXES", "FORMAT_NAME", "FORMAT_VERSION", "FULL_FINGERPRINT_BYTES", "HDF5_SUFFIXES",
    "IN_MEMORY_WRITE_BYTES", "KINDS", "MANIFEST_ATTR", "MANIFEST_FORMAT", "MANIFEST_KINDS", "PAIRS_DATASET",
    "PNG_SOFTWARE", "REDUCE_DIGESTS", "all_finite", "atomic_path", "check_hdf5_suffix", "check_numeric", "recorded_compatibility_mode",
    "check_output_directory", "check_output_path", "check_replaceable", "check_stored_symmetric", "command_line",
    "create_output",
    "d_from_psi_shape", "dataset", "expect_kind", "file_kind", "hdf5_write_failed", "header", "kind_of",
    "not_hdf5_reason", "open_input", "overlaps", "provenance", "read_array", "read_attr_int", "read_bias_terms",
    "read_matrix", "read_normalize", "recorded_inputs", "set_command", "source_identity", "stored_block",
    "value_text", "window_digests", "write_file", "written_kind",
]
