"""Framework-free floor: spec, grids, numerics, packing, selection, report and the file format."""
