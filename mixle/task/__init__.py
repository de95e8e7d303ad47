"""Tasks: quantization numerics, PTQ, conversion and export."""
