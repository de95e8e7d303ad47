"""ggml's Q4_0 / Q8_0 block layouts, written from mixle's codes and float16 scales (numpy only).

Nothing is re-quantized here: the codes and scales a QAT or converted layer holds are laid out
byte for byte as llama.cpp stores them. Per block of 32 consecutive weights of a row:

* Q4_0 (18 bytes): the float16 scale ``d``, then 16 bytes where byte ``j`` holds
  ``q[j] | q[j + 16] << 4`` with ``q = code + 8`` (codes -8..7 stored as 0..15).
* Q8_0 (34 bytes): the float16 scale ``d``, then the 32 codes as int8.

A row of ``cols`` weights takes ``cols / 32`` blocks; rows follow each other.
"""

import numpy as np

BLOCK = 32

__all__ = ["BLOCK", "GGML_TYPE_OF_GRID", "pack_blocks"]


def _scale_bytes(scale, blocks):
    """float16 bytes of the scales, which must already be float16 values (no rounding here)."""
    scale = np.asarray(scale, dtype=np.float32).reshape(blocks, 1)
    half = scale.astype(np.float16)
    if not np.array_equal(half.astype(np.float32), scale, equal_nan=False):
        raise ValueError("scales are not float16 values: they were not made on a llama.cpp grid")
    return half.view(np.uint8)


def _q4_0(codes, scale):
    q = (codes.reshape(-1, BLOCK).astype(np.int16) + 8).astype(np.uint8)
    packed = q[:, : BLOCK // 2] | (q[:, BLOCK // 2 :] << np.uint8(4))
    return np.concatenate([_scale_bytes(scale, q.shape[0]), packed], axis=1)


def _q8_0(codes, scale):
    q = codes.reshape(-1, BLOCK).astype(np.int8).view(np.uint8)
    return np.concatenate([_scale_bytes(scale, q.shape[0]), q], axis=1)


# grid name -> (ggml type name, packer, code range)
GGML_TYPE_OF_GRID = {"q4_0": ("Q4_0", _q4_0, (-8, 7)), "q8_0": ("Q8_0", _q8_0, (-127, 127))}


def pack_blocks(grid, codes, scale):
    """The ggml blocks of a ``(rows, cols)`` matrix of codes on ``grid`` with one scale per block.

    Args:
        grid: ``"q4_0"`` or ``"q8_0"``.
        codes: integer array ``(rows, cols)``, ``cols`` a multiple of 32, in the grid's range.
        scale: ``rows * cols / 32`` float16 values (any float dtype holding them exactly).

    Returns:
        uint8 array ``(rows, cols / 32 * bytes_per_block)``: what gguf's ``GGUFWriter.add_tensor``
        takes with ``raw_dtype`` set to the ggml type.

    >>> pack_blocks("q8_0", np.arange(-16, 16).reshape(1, 32), np.float32([0.5])).shape
    (1, 34)
    """
    if grid not in GGML_TYPE_OF_GRID:
        raise ValueError(f"grid={grid!r} has no ggml block type: use one of {sorted(GGML_TYPE_OF_GRID)}")
    _, packer, (low, high) = GGML_TYPE_OF_GRID[grid]
    codes = np.asarray(codes)
    if codes.ndim != 2 or codes.shape[1] % BLOCK:
        raise ValueError(f"codes must be (rows, cols) with cols a multiple of {BLOCK}, got shape {codes.shape}")
    if codes.size and (codes.min() < low or codes.max() > high):
        raise ValueError(f"{grid} codes lie in [{low}, {high}], got [{codes.min()}, {codes.max()}]")
    rows = codes.shape[0]
    return packer(codes, scale).reshape(rows, -1)
