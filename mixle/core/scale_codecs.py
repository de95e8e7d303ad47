"""How a grid stores its float scales (and mins): one record per storage format.

A grid's ``scale_dtype`` names one of ``SCALE_CODECS`` (``None``: the weight's own float dtype).
A codec says how a block type's stored field becomes float32 values (``decode``, on the C-emulation
adapter ``mixle.core.c_arith.c_ops`` of numpy or torch), how float32 values that are already
exact values of the format become that field again (``encode``, numpy), which values are not exact
(``inexact``, numpy), the dtype array libraries name it by (``dtype``: ``"float16"``; None where
numpy and torch have none) and the dtype mixle's own files store it in (``file_dtype``: None keeps
float32). ``register_scale_codec`` adds one (an FP8 scale, say) without touching any other module.
"""

from dataclasses import dataclass
from typing import Callable

import numpy as np

from mixle.core.c_arith import c_ops  # noqa: F401  (the examples' adapter)

__all__ = ["ScaleCodec", "SCALE_CODECS", "AS_FLOAT32", "register_scale_codec", "scale_codec", "e8m0_half"]


@dataclass(frozen=True, kw_only=True)
class ScaleCodec:
    """One storage format of float scales.

    Attributes:
        name: the ``Grid.scale_dtype`` value.
        decode: ``(o, field) -> float32 values`` (``o``: ``c_ops`` of the field).
        encode: ``float32 values (numpy) -> the block field (numpy)``; values are exact already.
        inexact: ``values (numpy float array) -> bool mask`` of values the format cannot hold exactly.
        dtype: the dtype name numpy, torch and jax know it by (rounds ``ops.to_named(x, dtype)``), or None.
        file_dtype: the torch dtype name mixle's safetensors files store it in, or None (float32).
        largest: the format's largest finite value, for messages (None: none worth naming).

    >>> SCALE_CODECS["float16"].inexact(np.array([0.1, 0.5], np.float32)).tolist()
    [True, False]
    """

    name: str
    decode: Callable
    encode: Callable
    inexact: Callable
    dtype: str | None = None
    file_dtype: str | None = None
    largest: float | None = None


def _float16_inexact(array):
    with np.errstate(over="ignore"):
        return array.astype(np.float16).astype(array.dtype) != array


def e8m0_half(o, e):
    """``ggml_e8m0_to_fp32_half``: 2**(e - 128) as float32 bits (subnormal for e < 2), with ``o``
    the C-emulation adapter (``c_ops``) of ``e``.

    >>> e8m0_half(c_ops(np.zeros(1)), np.array([127, 0], np.uint8)).tolist()
    [0.5, 2.938735877055719e-39]
    """
    e = o.to_named(e, "int32")
    return o.bits_f32(o.where(e < 2, 0x00200000 << e, (e - 1) << 23))


def _e8m0_inexact(array):
    """Not a power of two 2**-128 .. 2**127 (MXFP4's E8M0 exponent, halved)."""
    mantissa, exponent = np.frexp(array.astype(np.float64))
    return (mantissa != 0.5) | (exponent < -127) | (exponent > 128)


def _e8m0_encode(scale):
    """E8M0 exponent bytes of powers of two 2**(e - 128)."""
    mantissa, exponent = np.frexp(np.asarray(scale, np.float32))
    return (exponent.astype(np.int32) + 127).astype(np.uint8)


SCALE_CODECS = {}


def register_scale_codec(codec):
    """Add ``codec`` to ``SCALE_CODECS`` (a grid names it by ``scale_dtype``) and return it.

    Raises:
        ValueError: another codec already has its name.

    >>> register_scale_codec(SCALE_CODECS["float16"]).name
    'float16'
    """
    known = SCALE_CODECS.get(codec.name)
    if known is not None and known is not codec:
        raise ValueError(f"scale codec {codec.name!r} is already registered: give the new one another name")
    SCALE_CODECS[codec.name] = codec
    return codec


def scale_codec(name, default=None):
    """The codec a grid's ``scale_dtype`` names; ``default`` for None (the weight's own dtype;
    ``AS_FLOAT32`` for a block field held as float32).

    >>> scale_codec("e8m0").file_dtype is None, scale_codec(None), scale_codec(None, AS_FLOAT32).name
    (True, None, 'float32')
    """
    return default if name is None else SCALE_CODECS[name]


# A block field held as float32 values (NF4's absmax): the weight's own dtype, in ggml's float32.
AS_FLOAT32 = ScaleCodec(name="float32", decode=lambda o, v: o.to_named(v, "float32"),
                        encode=lambda v: np.asarray(v, np.float32), inexact=lambda a: np.zeros(a.shape, bool))
register_scale_codec(ScaleCodec(
    name="float16", decode=lambda o, v: o.to_named(v, "float32"),
    encode=lambda v: np.asarray(v, np.float32).astype(np.float16), inexact=_float16_inexact, dtype="float16",
    file_dtype="float16", largest=float(np.finfo(np.float16).max)))
register_scale_codec(ScaleCodec(name="e8m0", decode=e8m0_half, encode=_e8m0_encode, inexact=_e8m0_inexact))
