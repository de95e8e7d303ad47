"""int4 packing: two 4-bit codes per byte, for numpy arrays and torch tensors.

Byte layout (the on-disk and in-memory format of every packed int4 tensor in mixle):

* The codes are flattened in C (row-major) order to ``c[0], c[1], ..., c[n-1]``.
* Byte ``i`` holds ``c[2i]`` in its low nibble (bits 0-3) and ``c[2i+1]`` in its high nibble
  (bits 4-7): ``byte[i] = (c[2i] & 0xF) | ((c[2i+1] & 0xF) << 4)``.
* Each nibble is a 4-bit two's-complement integer: 0x0..0x7 are 0..7, 0x8..0xF are -8..-1.
* An odd count is padded with one zero nibble (the high nibble of the last byte), so ``n``
  codes take ``ceil(n / 2)`` bytes. The shape is not stored; ``unpack_int4`` is told it.
"""

import math

import numpy as np

from mixle.core.numerics import array_kind

__all__ = ["pack_int4", "unpack_int4", "packed_int4_nbytes", "INT4_MIN", "INT4_MAX"]

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


def pack_int4(codes):
    """Pack integer codes in -8..7 two per byte (see the module docstring for the nibble order).

    Args:
        codes: integer numpy array or torch tensor of any shape, values in ``[-8, 7]``.

    Returns:
        A 1-D uint8 array (numpy in, numpy out; torch in, torch out on the same device) of
        ``ceil(codes.size / 2)`` bytes.

    Raises:
        TypeError: codes is not an integer array.
        ValueError: a code lies outside -8..7.

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
    if count:
        low, high = int(flat.min()), int(flat.max())
        if low < INT4_MIN or high > INT4_MAX:
            raise ValueError(
                f"pack_int4 got codes in [{low}, {high}], outside the int4 range [-8, 7]: "
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


def unpack_int4(packed, shape):
    """Unpack bytes written by ``pack_int4`` to int8 codes of ``shape``.

    Args:
        packed: 1-D uint8 numpy array or torch tensor of ``ceil(prod(shape) / 2)`` bytes.
        shape: the shape of the codes (an int or a tuple of ints).

    Returns:
        int8 codes in -8..7 with that shape, in the same array library (and torch device).

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
        pairs = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(-1)[:count]
        # (n ^ 8) - 8 sign-extends a 4-bit two's-complement nibble: 0x7 -> 7, 0x8 -> -8, 0xF -> -1.
        return ((pairs.to(torch.int8) ^ 8) - 8).reshape(shape)
    pairs = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(-1)[:count]
    return ((pairs.astype(np.int8) ^ 8) - 8).reshape(shape)
