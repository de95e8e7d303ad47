"""llama.cpp's block quantizers bit for bit: Q4_1, Q5_0, Q5_1, MXFP4 (here), Q4_K, Q5_K, Q6_K
(``mixle.gguf.ggml_kquants``), and the table ``BLOCK_TYPES`` of all of them.

``quantize_<type>(x)`` gives the fields a block stores (a NamedTuple of arrays of x's library,
numpy or torch), ``dequantize_<type>(fields)`` the float32 values ggml's ``dequantize_row_*``
computes from them, ``pack_<type>(fields)`` ggml's block bytes (numpy uint8, shape
``(..., n_blocks * bytes_per_block)``, as ``gguf.quants.quantize`` gives) and
``unpack_<type>(bytes)`` the fields back. For float32 input, quantize then dequantize equals
ggml's reference quantize (``quantize_row_*_ref``: no importance matrix) then dequantize bit for
bit, and the packed bytes equal ggml's: every function follows ggml-quants.c's float32
operation order (``mixle.core.c_arith`` holds the shared C arithmetic). Their grid records are
``mixle.gguf.formats``'.
"""

from typing import NamedTuple

import numpy as np

from mixle.core.c_arith import (
    as_numpy,
    block_rows,
    c_int,
    c_ops,
    first_absmax,
    flat_rows,
    float_blocks,
    half_bytes,
    half_from,
    ieee,
    reciprocal,
    to_half,
)
from mixle.core.grids import BlockType
from mixle.core.scale_codecs import e8m0_half  # noqa: F401  (ggml's E8M0 decoding, MXFP4's scale)
from mixle.gguf.ggml_kquants import KFields, Q6KFields  # noqa: F401  (the K-quants are re-exported)
from mixle.gguf.ggml_kquants import dequantize_q4_k, pack_q4_k, quantize_q4_k, unpack_q4_k  # noqa: F401
from mixle.gguf.ggml_kquants import dequantize_q5_k, pack_q5_k, quantize_q5_k, unpack_q5_k  # noqa: F401
from mixle.gguf.ggml_kquants import dequantize_q6_k, pack_q6_k, quantize_q6_k, unpack_q6_k  # noqa: F401

__all__ = [
    "AffineFields",
    "ScaleFields",
    "MxFields",
    "KFields",
    "Q6KFields",
    "BLOCK_TYPES",
    "KVALUES_MXFP4",
    "e8m0_half",
] + [
    f"{verb}_{name}"
    for name in ("q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "mxfp4")
    for verb in ("quantize", "dequantize", "pack", "unpack")
]

QK = 32  # the block of Q4_1, Q5_0, Q5_1 and MXFP4

# ggml-common.h's kvalues_mxfp4: E2M1 values doubled (the scale is E8M0 halved).
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


class AffineFields(NamedTuple):
    """A Q4_1 / Q5_1 block of 32: ``x = codes * d + m``.

    Attributes:
        codes: uint8 (..., n_blocks, 32), 0..15 (Q4_1) or 0..31 (Q5_1).
        d: float16 (..., n_blocks), the scale.
        m: float16 (..., n_blocks), the block's min.
    """

    codes: object
    d: object
    m: object


class ScaleFields(NamedTuple):
    """A Q5_0 block of 32: ``x = (codes - 16) * d``.

    Attributes:
        codes: uint8 (..., n_blocks, 32), 0..31.
        d: float16 (..., n_blocks), the scale.
    """

    codes: object
    d: object


class MxFields(NamedTuple):
    """An MXFP4 block of 32: ``x = KVALUES_MXFP4[codes] * 2**(e - 128)``.

    Attributes:
        codes: uint8 (..., n_blocks, 32), indices 0..15 into ``KVALUES_MXFP4``.
        e: uint8 (..., n_blocks), the E8M0 exponent.
    """

    codes: object
    e: object



def _min_max(o, x):
    """C's ``min = FLT_MAX, max = -FLT_MAX; if (v < min) min = v; if (v > max) max = v;``."""
    if hasattr(o, "min_max"):  # jax: one reduction each, the same values
        return o.min_max(x)
    big = o.zeros(x[..., 0]) + o.c(3.4028234663852886e38)
    mn, mx = big, -big
    for i in range(x.shape[-1]):
        mn = o.where(x[..., i] < mn, x[..., i], mn)
        mx = o.where(x[..., i] > mx, x[..., i], mx)
    return mn, mx



@ieee
def _quantize_affine(x, bits):
    """``quantize_row_q4_1_ref`` / ``quantize_row_q5_1_ref``."""
    o, xb = float_blocks(x, QK)
    mn, mx = _min_max(o, xb)
    top = (1 << bits) - 1
    d = o.divide(mx - mn, o.c(float(top)))
    x0 = (xb - mn[..., None]) * reciprocal(o, d)[..., None]
    q = c_int(o, o.rounded(x0) + o.c(0.5))
    if bits == 4:  # MIN(15, (int8_t)(x0 + 0.5f)), stored as uint8_t
        q = o.clip(((q + 128) & 0xFF) - 128, -128, top) & 0xFF
    else:  # (uint8_t)(x0 + 0.5f); the block keeps 5 bits
        q = q & top
    return AffineFields(o.to_named(q, "uint8"), to_half(o, d), to_half(o, mn))


@ieee
def _dequantize_affine(f):
    """``x0*d + m`` (``dequantize_row_q4_1`` / ``_q5_1``): a product, then a sum."""
    o = c_ops(f.codes)
    # an infinite d stored by a huge block
    y = o.rounded(o.to_named(f.codes, "float32") * o.to_named(f.d, "float32")[..., None]) + o.to_named(f.m, "float32")[..., None]
    return y.reshape(tuple(f.codes.shape[:-2]) + (f.codes.shape[-2] * f.codes.shape[-1],))


def quantize_q4_1(x):
    """ggml's Q4_1 (``quantize_row_q4_1_ref``) of x (..., n), n a multiple of 32.

    Args:
        x: float32 numpy array or torch tensor (other floats are cast to float32).

    Returns:
        AffineFields, arrays of x's library.

    >>> f = quantize_q4_1(np.arange(32, dtype=np.float32))
    >>> f.codes[0, :4].tolist(), float(f.d[0]), float(f.m[0])
    ([0, 0, 1, 1], 2.06640625, 0.0)
    """
    return _quantize_affine(x, 4)


def quantize_q5_1(x):
    """ggml's Q5_1 (``quantize_row_q5_1_ref``) of x (..., n), n a multiple of 32.

    Args:
        x: float32 numpy array or torch tensor (other floats are cast to float32).

    Returns:
        AffineFields, arrays of x's library.

    >>> quantize_q5_1(np.arange(32, dtype=np.float32)).codes[0, -3:].tolist()
    [29, 30, 31]
    """
    return _quantize_affine(x, 5)


def dequantize_q4_1(fields):
    """float32 values (..., n) of Q4_1 fields.

    >>> dequantize_q4_1(quantize_q4_1(np.arange(32, dtype=np.float32)))[:3].tolist()
    [0.0, 0.0, 2.06640625]
    """
    return _dequantize_affine(fields)


def dequantize_q5_1(fields):
    """float32 values (..., n) of Q5_1 fields.

    >>> dequantize_q5_1(quantize_q5_1(np.arange(32, dtype=np.float32)))[:3].tolist()
    [0.0, 1.0, 2.0]
    """
    return _dequantize_affine(fields)


@ieee
def quantize_q5_0(x):
    """ggml's Q5_0 (``quantize_row_q5_0_ref``) of x (..., n), n a multiple of 32.

    Args:
        x: float32 numpy array or torch tensor (other floats are cast to float32).

    Returns:
        ScaleFields, arrays of x's library.

    >>> f = quantize_q5_0(np.linspace(-1, 2, 32, dtype=np.float32))
    >>> f.codes[0, [0, -1]].tolist(), float(f.d[0])
    ([24, 0], -0.125)
    """
    o, xb = float_blocks(x, QK)
    _, vmax = first_absmax(o, xb)
    d = o.divide(vmax, o.c(-16.0))
    q = c_int(o, o.rounded(xb * reciprocal(o, d)[..., None]) + o.c(16.5))
    q = o.clip(((q + 128) & 0xFF) - 128, -128, 31) & 0x1F  # MIN(31, (int8_t)...); 5 bits stored
    return ScaleFields(o.to_named(q, "uint8"), to_half(o, d))


@ieee
def dequantize_q5_0(fields):
    """float32 values (..., n) of Q5_0 fields: ``(code - 16) * d``.

    >>> dequantize_q5_0(quantize_q5_0(np.linspace(-1, 2, 32, dtype=np.float32)))[[0, -1]].tolist()
    [-1.0, 2.0]
    """
    o = c_ops(fields.codes)
    codes = fields.codes
    q = o.to_named(o.to_named(codes, "int32") - 16, "float32")
    y = q * o.to_named(fields.d, "float32")[..., None]
    return y.reshape(tuple(codes.shape[:-2]) + (codes.shape[-2] * QK,))


@ieee
def quantize_mxfp4(x):
    """ggml's MXFP4 (``quantize_row_mxfp4_ref``) of x (..., n), n a multiple of 32.

    Args:
        x: float32 numpy array or torch tensor (other floats are cast to float32).

    Returns:
        MxFields, arrays of x's library.

    >>> f = quantize_mxfp4(np.linspace(-6, 6, 32, dtype=np.float32))
    >>> f.codes[0, [0, 16, -1]].tolist(), int(f.e[0])
    ([15, 0, 7], 127)
    """
    o, xb = float_blocks(x, QK)
    amax, _ = first_absmax(o, xb)
    # (uint8_t)(floorf(log2f(amax)) - 2 + 127), or 0
    e = c_int(o, (o.floor(o.log2(amax)) - o.c(2.0)) + o.c(127.0)) & 0xFF
    e = o.where(amax > 0, e, o.zeros(e, "int32"))
    d = e8m0_half(o, e)[..., None]
    best = o.zeros(xb, "int32")
    # a wrapped e (amax below 2**-125) makes huge levels
    best_err = abs(o.c(float(KVALUES_MXFP4[0])) * d - xb)
    for i in range(1, 16):  # best_index_mxfp4: the first smallest error
        err = abs(o.c(float(KVALUES_MXFP4[i])) * d - xb)
        better = err < best_err
        best = o.where(better, o.zeros(best) + i, best)
        best_err = o.where(better, err, best_err)
    return MxFields(o.to_named(best, "uint8"), o.to_named(e, "uint8"))


@ieee
def dequantize_mxfp4(fields):
    """float32 values (..., n) of MXFP4 fields: ``kvalue * 2**(e - 128)``.

    >>> dequantize_mxfp4(quantize_mxfp4(np.linspace(-6, 6, 32, dtype=np.float32)))[[0, 16, -1]].tolist()
    [-6.0, 0.0, 6.0]
    """
    o = c_ops(fields.codes)
    codes = o.to_named(fields.codes, "int64")
    values = o.const([float(v) for v in KVALUES_MXFP4], "float32")[codes]
    y = values * e8m0_half(o, fields.e)[..., None]
    return y.reshape(tuple(codes.shape[:-2]) + (codes.shape[-2] * QK,))


# ------------------------------------------------------------------------------- packing


def _low_high(codes):
    """The 16 qs bytes of a block of 32: code j in the low nibble of byte j, code j + 16 high."""
    c = codes.astype(np.uint8)
    return (c[..., :16] | (c[..., 16:] << 4)).astype(np.uint8)


def _high_bits(codes):
    """The 4 qh bytes: bit 4 of code j at bit j of a little-endian uint32."""
    return np.packbits((codes.astype(np.uint8) >> 4) & 1, axis=-1, bitorder="little")


def _codes_from(qs, qh=None):
    """32 codes from 16 qs bytes (and the 4 qh bytes of their fifth bits)."""
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
    if qh is not None:
        codes = codes | (np.unpackbits(qh, axis=-1, bitorder="little") << 4)
    return codes.astype(np.uint8)


def pack_q4_1(fields):
    """ggml's ``block_q4_1`` bytes (20 per block): d, m, qs[16].

    >>> pack_q4_1(quantize_q4_1(np.zeros(64, np.float32))).shape
    (40,)
    """
    codes, d, m = (as_numpy(v) for v in fields)
    return flat_rows(np.concatenate([half_bytes(d), half_bytes(m), _low_high(codes)], axis=-1))


def unpack_q4_1(data):
    """AffineFields (numpy) from ``block_q4_1`` bytes (..., n_blocks * 20).

    >>> unpack_q4_1(pack_q4_1(quantize_q4_1(np.ones(32, np.float32)))).m.tolist()
    [1.0]
    """
    b = block_rows(data, 20)
    return AffineFields(_codes_from(b[..., 4:]), half_from(b[..., 0:2]), half_from(b[..., 2:4]))


def pack_q5_0(fields):
    """ggml's ``block_q5_0`` bytes (22 per block): d, qh[4], qs[16].

    >>> pack_q5_0(quantize_q5_0(np.zeros(32, np.float32))).tolist()[:8]  # d = -0.0; all codes 16
    [0, 128, 255, 255, 255, 255, 0, 0]
    """
    codes, d = (as_numpy(v) for v in fields)
    return flat_rows(np.concatenate([half_bytes(d), _high_bits(codes), _low_high(codes & 0xF)], axis=-1))


def unpack_q5_0(data):
    """ScaleFields (numpy) from ``block_q5_0`` bytes (..., n_blocks * 22).

    >>> unpack_q5_0(pack_q5_0(quantize_q5_0(np.zeros(32, np.float32)))).codes[0, 0]
    np.uint8(16)
    """
    b = block_rows(data, 22)
    return ScaleFields(_codes_from(b[..., 6:], b[..., 2:6]), half_from(b[..., 0:2]))


def pack_q5_1(fields):
    """ggml's ``block_q5_1`` bytes (24 per block): d, m, qh[4], qs[16].

    >>> pack_q5_1(quantize_q5_1(np.zeros((3, 32), np.float32))).shape
    (3, 24)
    """
    codes, d, m = (as_numpy(v) for v in fields)
    parts = [half_bytes(d), half_bytes(m), _high_bits(codes), _low_high(codes & 0xF)]
    return flat_rows(np.concatenate(parts, axis=-1))


def unpack_q5_1(data):
    """AffineFields (numpy) from ``block_q5_1`` bytes (..., n_blocks * 24).

    >>> unpack_q5_1(pack_q5_1(quantize_q5_1(np.arange(32, dtype=np.float32)))).codes[0, -1]
    np.uint8(31)
    """
    b = block_rows(data, 24)
    return AffineFields(_codes_from(b[..., 8:], b[..., 4:8]), half_from(b[..., 0:2]), half_from(b[..., 2:4]))


def pack_mxfp4(fields):
    """ggml's ``block_mxfp4`` bytes (17 per block): e, qs[16].

    >>> pack_mxfp4(quantize_mxfp4(np.ones(32, np.float32))).tolist()[:2]
    [125, 102]
    """
    codes, e = (as_numpy(v) for v in fields)
    return flat_rows(np.concatenate([e.astype(np.uint8)[..., None], _low_high(codes)], axis=-1))


def unpack_mxfp4(data):
    """MxFields (numpy) from ``block_mxfp4`` bytes (..., n_blocks * 17).

    >>> unpack_mxfp4(pack_mxfp4(quantize_mxfp4(np.ones(32, np.float32)))).e.tolist()
    [125]
    """
    b = block_rows(data, 17)
    return MxFields(_codes_from(b[..., 1:]), b[..., 0].copy())


# --------------------------------------------------------------------------------- table


_AFFINE_PARTS = (("codes", "codes"), ("scale", "d"), ("offset", "m"))
_K_PARTS = (("codes", "codes"), ("scale", "d"), ("offset", "dmin"), ("sub_scales", "scales"), ("sub_offsets", "mins"))

# llama.cpp's block numerics, by the name a grid's ``numerics`` gives them (``mixle.gguf.formats``).
BLOCK_TYPES = {bt.name: bt for bt in (
    BlockType("q4_1", QK, "Q4_1", 20, quantize_q4_1, dequantize_q4_1, pack_q4_1, unpack_q4_1, AffineFields,
              _AFFINE_PARTS),
    BlockType("q5_0", QK, "Q5_0", 22, quantize_q5_0, dequantize_q5_0, pack_q5_0, unpack_q5_0, ScaleFields,
              (("codes", "codes"), ("scale", "d")), -16),
    BlockType("q5_1", QK, "Q5_1", 24, quantize_q5_1, dequantize_q5_1, pack_q5_1, unpack_q5_1, AffineFields,
              _AFFINE_PARTS),
    BlockType("q4_k", 256, "Q4_K", 144, quantize_q4_k, dequantize_q4_k, pack_q4_k, unpack_q4_k, KFields, _K_PARTS),
    BlockType("q5_k", 256, "Q5_K", 176, quantize_q5_k, dequantize_q5_k, pack_q5_k, unpack_q5_k, KFields, _K_PARTS),
    BlockType("q6_k", 256, "Q6_K", 210, quantize_q6_k, dequantize_q6_k, pack_q6_k, unpack_q6_k, Q6KFields,
              (("codes", "codes"), ("scale", "d"), ("sub_scales", "scales")), -32),
    BlockType("mxfp4", QK, "MXFP4", 17, quantize_mxfp4, dequantize_mxfp4, pack_mxfp4, unpack_mxfp4, MxFields,
              (("codes", "codes"), ("scale", "e"))),
)}
