"""Public face: mixle.task.quantize (numerics, PTQ, convert, save and load)."""
