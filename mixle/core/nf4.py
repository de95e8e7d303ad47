"""QLoRA's NormalFloat-4 (bitsandbytes' blockwise 4-bit quantizer) as one format record, with its
block numerics.

NF4 follows bitsandbytes' blockwise 4-bit kernel (codes from the normalized value
``x * (1 / absmax)`` by the NF4 decision tree's midpoints, ``x > t`` taking the upper code;
values ``table[code] * absmax``), in blocks of 64, the bitsandbytes / QLoRA default. mixle's
NF4 block bytes are the float32 absmax (little-endian) then 32 code bytes, the first of each
pair of codes in the high nibble, as bitsandbytes packs them. An all-zero block is normalized
with a zero reciprocal (as ggml's ``d ? 1/d : 0``), so all its codes are that of 0.0. The
arithmetic is ``mixle.core.c_arith``'s, so numpy arrays and torch tensors give the same bits.

Importing this module registers the grid ``"nf4"`` (``register_grid``); ``import mixle`` does.
"""

from typing import NamedTuple

import numpy as np

from mixle.core.c_arith import as_numpy, block_rows, c_ops, first_absmax, flat_rows, float_blocks, ieee, reciprocal
from mixle.core.grids import BlockType, Grid, KernelKind, register_grid

__all__ = ["NF4_BLOCK", "NF4_TABLE", "NF4_THRESHOLDS", "NF4Fields", "quantize_nf4", "dequantize_nf4", "pack_nf4",
           "unpack_nf4", "NF4_BLOCK_TYPE", "NF4_GRID"]

NF4_BLOCK = 64  # bitsandbytes' (and QLoRA's) default NF4 blocksize

# bitsandbytes' NF4 code values and its decision tree's thresholds (midpoints), low to high.
NF4_TABLE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
NF4_THRESHOLDS = (
    -0.8480964004993439, -0.6106329262256622, -0.4599952697753906, -0.33967943489551544,
    -0.23460740596055984, -0.13791173323988914, -0.045525018125772476, 0.03979014977812767,
    0.1202552504837513, 0.2035212516784668, 0.2920137718319893, 0.3893125355243683,
    0.5016634166240692, 0.6427869200706482, 0.8614784181118011,
)  # fmt: skip


class NF4Fields(NamedTuple):
    """An NF4 block of 64: ``x = NF4_TABLE[codes] * absmax``.

    Attributes:
        codes: uint8 (..., n_blocks, 64), 0..15.
        absmax: float32 (..., n_blocks), the block's largest magnitude.
    """

    codes: object
    absmax: object


@ieee
def quantize_nf4(x):
    """QLoRA's NF4 (bitsandbytes' blockwise quantizer) of x (..., n), n a multiple of 64.

    Args:
        x: float32 numpy array or torch tensor (other floats are cast to float32).

    Returns:
        NF4Fields, arrays of x's library.

    >>> f = quantize_nf4(np.linspace(-2, 1, 64, dtype=np.float32))
    >>> f.codes[0, [0, 42, -1]].tolist(), float(f.absmax[0])
    ([0, 7, 12], 2.0)
    """
    o, xb = float_blocks(x, NF4_BLOCK)
    amax, _ = first_absmax(o, xb)
    normalized = xb * reciprocal(o, amax)[..., None]
    codes = o.zeros(xb, "int32")
    for t in NF4_THRESHOLDS:  # the decision tree's leaf: how many midpoints lie below
        codes = codes + o.to_named(normalized > o.c(t), "int32")
    return NF4Fields(o.to_named(codes, "uint8"), amax)


@ieee
def dequantize_nf4(fields):
    """float32 values (..., n) of NF4 fields: ``NF4_TABLE[code] * absmax``.

    >>> dequantize_nf4(quantize_nf4(np.linspace(-2, 1, 64, dtype=np.float32)))[[0, 42, -1]].tolist()
    [-2.0, 0.0, 0.8814196586608887]
    """
    o = c_ops(fields.codes)
    codes = o.to_named(fields.codes, "int64")
    y = o.const(NF4_TABLE, "float32")[codes] * o.to_named(fields.absmax, "float32")[..., None]
    return y.reshape(tuple(codes.shape[:-2]) + (codes.shape[-2] * NF4_BLOCK,))


def pack_nf4(fields):
    """mixle's NF4 block bytes (36 per block): absmax as float32, then codes two a byte (high
    nibble first, as bitsandbytes packs them).

    >>> pack_nf4(quantize_nf4(np.ones(64, np.float32))).tolist()[:5]
    [0, 0, 128, 63, 255]
    """
    codes, absmax = (as_numpy(v) for v in fields)
    c = codes.astype(np.uint8)
    pairs = ((c[..., 0::2] << 4) | c[..., 1::2]).astype(np.uint8)
    scale = np.ascontiguousarray(absmax.astype("<f4"))[..., None].view(np.uint8)
    return flat_rows(np.concatenate([scale, pairs], axis=-1))


def unpack_nf4(data):
    """NF4Fields (numpy) from mixle's NF4 block bytes (..., n_blocks * 36).

    >>> unpack_nf4(pack_nf4(quantize_nf4(np.ones(64, np.float32)))).absmax.tolist()
    [1.0]
    """
    b = block_rows(data, 36)
    pairs = b[..., 4:]
    codes = np.stack([pairs >> 4, pairs & 0xF], axis=-1).reshape(pairs.shape[:-1] + (NF4_BLOCK,))
    return NF4Fields(codes.astype(np.uint8), np.ascontiguousarray(b[..., :4]).view("<f4")[..., 0].astype(np.float32))


NF4_BLOCK_TYPE = BlockType("nf4", NF4_BLOCK, None, 36, quantize_nf4, dequantize_nf4, pack_nf4, unpack_nf4,
                           NF4Fields, (("codes", "codes"), ("scale", "absmax")))

NF4_GRID = register_grid(Grid(
    name="nf4", codes={4: (0, 15)}, divisor={4: 1.0}, scale_rule="absmax", rounding="table_nearest", zero_scale=None,
    block=NF4_BLOCK, packing="pairs", table=tuple(NF4_TABLE), block_type=NF4_BLOCK_TYPE, backends=("torch",),
    kernel=KernelKind(9, 64, indexes_table=True),
    summary="QLoRA's NormalFloat-4 (bitsandbytes): blocks of 64, w = NF4_TABLE[code] * absmax (float32); no GGUF type"))
