"""The files of the statistics, side by side: the HDF5 features file and the Zarr features store.

- `features_file`: the HDF5 features file (its datasets, attributes, manifest; `load` and `save`);
- `zarr_store`: the Zarr features store of statistics whose Gram is tiled;
- `store_location`: where a Zarr store is written, and its commit once complete and verified.
"""
