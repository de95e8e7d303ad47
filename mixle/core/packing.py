"""Code packing: two 4-bit codes per byte (mixle's files), and the codes of ggml's blocks.

Byte layout (the on-disk and in-memory format of every packed int4 tensor in mixle):

* The codes are flattened in C (row-major) order to ``c[0], c[1], ..., c[n-1]``.
* Byte ``i`` holds ``c[2i]`` in its low nibble (bits 0-3) and ``c[2i+1]`` in its high nibble
  (bits 4-7): ``byte[i] = (c[2i] & 0xF) | ((c[2i+1] & 0xF) << 4)``.
* Each nibble is a 4-bit two's-complement integer: 0x0..0x7 are 0..7, 0x8..0xF are -8..-1
  (``signed=False``, for grids whose codes are 0..15: the nibble is the code).
* An odd count is padded with one zero nibble (the high nibble of the last byte), so ``n``
  codes take ``ceil(n / 2)`` bytes. The shape is not stored; ``unpack_int4`` is told it.

Inside a grid's file blocks (GGUF) the codes follow ``Grid.packing`` (``pack_block_codes``):
``"pairs"`` as above within each block, ``"ggml_q4_0"`` ggml's Q4_0 order (byte ``j`` of a block
of 32 holds ``n[j] | n[j + 16] << 4`` with ``n = code - code_min``), ``"bytes"`` one int8 each.
"""

import math

import numpy as np

from mixle.core.array_ops import array_kind

__all__ = ["pack_int4", "unpack_int4", "packed_int4_nbytes", "pack_block_codes", "INT4_MIN", "INT4_MAX"]

INT4_MIN = -8
INT4_MAX = 7


def packed_int4_nbytes(count):
    """Bytes that ``count`` packed int4 codes occupy: ``ceil(count / 2)``.

    >>> packed_int4_nbytes(5)
    3
    """
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"count must be a non-negative int, got {count!r}")
    return (count + 1) // 2


def _is_integer_dtype(x, kind):
    if kind == "torch":
        return not x.is_floating_point() and not x.is_complex() and x.dtype is not _torch().bool
    return np.issubdtype(x.dtype, np.integer)


def _torch():
    import torch

    return torch


def pack_int4(codes, *, signed=True):
    """Pack integer codes in -8..7 two per byte (see the module docstring for the nibble order).

    Args:
        codes: integer numpy array or torch tensor of any shape, values in ``[-8, 7]``.
        signed: False packs codes in ``[0, 15]`` instead (their nibbles are the codes).

    Returns:
        A 1-D uint8 array (numpy in, numpy out; torch in, torch out on the same device) of
        ``ceil(codes.size / 2)`` bytes.

    Raises:
        TypeError: codes is not an integer array.
        ValueError: a code lies outside -8..7 (0..15 unsigned).

    >>> pack_int4(np.array([1, -1, 7], np.int8)).tolist()  # 0xF1, then 7 and a zero pad nibble
    [241, 7]
    """
    kind = array_kind(codes)
    if kind == "jax":
        codes = np.asarray(codes)
        kind = "numpy"
    if not _is_integer_dtype(codes, kind):
        raise TypeError(
            f"pack_int4 needs integer codes, got dtype {codes.dtype}: quantize first "
            f"(quantize_array(...).codes) or cast with .astype(np.int8)"
        )
    flat = codes.reshape(-1)
    count = flat.shape[0]
    lowest, highest = (INT4_MIN, INT4_MAX) if signed else (0, 15)
    if count:
        low, high = int(flat.min()), int(flat.max())
        if low < lowest or high > highest:
            kind = "int4" if signed else "uint4"
            raise ValueError(
                f"pack_int4 got codes in [{low}, {high}], outside the {kind} range [{lowest}, {highest}]: "
                f"quantize with bits=4 before packing, or store them as int8"
            )
    if kind == "torch":
        torch = _torch()
        nibbles = (flat.to(torch.int16) & 0xF).to(torch.uint8)
        if count % 2:
            nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
        pairs = nibbles.reshape(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)
    nibbles = (flat.astype(np.int16) & 0xF).astype(np.uint8)
    if count % 2:
        nibbles = np.concatenate([nibbles, np.zeros(1, np.uint8)])
    pairs = nibbles.reshape(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_int4(packed, shape, *, signed=True):
    """Unpack bytes written by ``pack_int4`` to int8 codes of ``shape``.

    Args:
        packed: 1-D uint8 numpy array or torch tensor of ``ceil(prod(shape) / 2)`` bytes.
        shape: the shape of the codes (an int or a tuple of ints).
        signed: False reads unsigned nibbles (codes 0..15), as ``pack_int4(..., signed=False)``.

    Returns:
        int8 codes in -8..7 (0..15) with that shape, in the same array library (and torch device).

    Raises:
        TypeError: packed is not uint8.
        ValueError: packed is not 1-D or has the wrong number of bytes for ``shape``.

    >>> unpack_int4(np.array([241, 7], np.uint8), (3,)).tolist()
    [1, -1, 7]
    """
    kind = array_kind(packed)
    if kind == "jax":
        packed = np.asarray(packed)
        kind = "numpy"
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"shape must be non-negative ints, got {shape!r}")
    dtype_name = str(packed.dtype).replace("torch.", "")
    if dtype_name != "uint8":
        raise TypeError(f"unpack_int4 needs the uint8 bytes from pack_int4, got dtype {packed.dtype}")
    count = math.prod(shape)
    expected = packed_int4_nbytes(count)
    if len(packed.shape) != 1 or packed.shape[0] != expected:
        raise ValueError(
            f"packed has shape {tuple(packed.shape)}, but {count} int4 codes of shape {shape} take "
            f"a 1-D array of {expected} bytes: pass the shape the codes had when packed"
        )
    if kind == "torch":
        torch = _torch()
        pairs = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(-1)[:count].to(torch.int8)
        # (n ^ 8) - 8 sign-extends a 4-bit two's-complement nibble: 0x7 -> 7, 0x8 -> -8, 0xF -> -1.
        return (((pairs ^ 8) - 8) if signed else pairs).reshape(shape)
    pairs = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(-1)[:count].astype(np.int8)
    return (((pairs ^ 8) - 8) if signed else pairs).reshape(shape)


def pack_block_codes(codes, grid, bits):
    """The code bytes of each of a grid's file blocks, laid out as its ``Grid.packing`` says.

    Args:
        codes: integer numpy array whose size is a multiple of ``grid.block``, on the grid.
        grid: a ``mixle.core.grids.Grid`` with a ``block``.
        bits: the code width.

    Returns:
        uint8 array ``(blocks, bytes of codes per block)``.

    >>> from mixle.core.grids import GRIDS
    >>> pack_block_codes(np.arange(-8, 8).repeat(2), GRIDS["q4_0"], 4)[0, :3].tolist()  # 0 | 8 << 4, ...
    [128, 128, 145]
    """
    low, high = grid.code_range(bits)
    blocks = np.asarray(codes).reshape(-1, grid.block)
    if blocks.size and (blocks.min() < low or blocks.max() > high):
        raise ValueError(f"grid {grid.name!r} codes lie in [{low}, {high}], got [{blocks.min()}, {blocks.max()}]")
    if grid.packing == "bytes" or bits > 4:
        return blocks.astype(np.int8 if low < 0 else np.uint8).view(np.uint8)
    if grid.packing == "ggml_q4_0":
        nibbles = (blocks.astype(np.int16) - low).astype(np.uint8)
        half = grid.block // 2
        return nibbles[:, :half] | (nibbles[:, half:] << np.uint8(4))
    return pack_int4(blocks, signed=low < 0).reshape(blocks.shape[0], -1)


def pack_scale_blocks(codes, scale, grid, bits):
    """A grid's file blocks of codes with one float16 scale per block, fields in the order of its
    ``Grid.ggml_fields`` (``"d"``: the scale; ``"qs"``: the codes, ``pack_block_codes``).

    Args:
        codes: integer numpy array ``(rows, cols)``, ``cols`` a multiple of ``grid.block``, on the grid.
        scale: ``rows * cols / block`` exact float16 values (any float dtype).
        grid: a ``mixle.core.grids.Grid`` with ``ggml_fields`` of ``d`` and ``qs`` only.
        bits: the code width.

    Returns:
        uint8 array ``(rows, cols / block * bytes per block)``.

    >>> from mixle.core.grids import GRIDS
    >>> pack_scale_blocks(np.zeros((1, 32), np.int8), np.float32([1.0]), GRIDS["q8_0"], 8)[0, :3].tolist()
    [0, 60, 0]
    """
    codes = np.asarray(codes)
    fields = {"d": np.asarray(scale, dtype=np.float32).reshape(-1, 1).astype(np.float16).view(np.uint8),
              "qs": pack_block_codes(codes, grid, bits)}
    return np.concatenate([fields[name] for name, _ in grid.ggml_fields], axis=1).reshape(codes.shape[0], -1)
