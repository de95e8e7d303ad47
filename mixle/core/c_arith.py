"""Float32 arithmetic in C's operation order, on numpy arrays, torch tensors and jax arrays alike: the adapter
block numerics are written against so that they give C's bits (``c_ops``), and the small helpers
they share (rounding as C casts and ggml rounds, sequential sums, float16 bytes, block rows).

Block quantizers that must equal a C reference bit for bit (llama.cpp's, ``mixle.gguf.ggml_quants``;
NF4, ``mixle.core.nf4``) compute float32 throughout, every sum a sequential loop over a block's
elements (vectorized across blocks, never numpy's pairwise or torch's blocked reductions), products
and sums grouped as C groups them, with no fused multiply-add. The adapter extends
``mixle.core.array_ops``' numpy, torch and jax ops with what that needs: float32 constants, bit
views, correctly rounded ``log2`` and ``sqrt``, and on jax the running loops C writes over a block
as reductions and ordered loops XLA compiles quickly.
"""

import functools

import numpy as np

from mixle.core.array_ops import JaxOps, NumpyOps, TorchOps, array_ops

__all__ = ["ORDERED_SUMS", "NumpyC", "TorchC", "JaxC", "ieee", "c_ops", "float_blocks", "nearest_int", "c_int",
           "reciprocal", "to_half", "seq_sum", "first_absmax", "running_max", "as_numpy", "half_bytes", "half_from",
           "block_rows", "flat_rows"]


class NumpyC(NumpyOps):
    """numpy ops plus what the C emulation needs: float32 constants and bit views."""

    def __init__(self):
        super().__init__(np)

    def c(self, value):
        return np.float32(value)

    def zeros(self, like, name="float32"):
        return np.zeros(like.shape, dtype=name)

    def const(self, values, name):
        return np.asarray(values, dtype=name)

    def f32_bits(self, x):
        return x.view(np.int32)

    def bits_f32(self, i):
        return i.astype(np.int32).view(np.float32)

    def log2(self, x):
        # log2f as a correctly rounded float32: float64 log2 rounded once more.
        return np.log2(x.astype(np.float64)).astype(np.float32)

    def sqrt(self, x):
        return np.sqrt(x)

    def leading(self, x):  # the last axis first, contiguous
        return np.ascontiguousarray(np.moveaxis(x, -1, 0))

    def trailing(self, x):  # the first axis last
        return np.moveaxis(x, 0, -1)

    def assign(self, a, i, value):
        """``a[..., i] = value``, in place; returns ``a``."""
        a[..., i] = value
        return a

    def ordered_sum(self, terms, axis):
        """C's ``s = 0; for (i...) s += terms[i]`` along ``axis``, in order: numpy's ``accumulate``
        adds in order (its reductions may sum pairwise). Starting from the first term instead of 0
        changes only a sum of -0.0s (-0.0 where C's is +0.0), which the 0 added last restores."""
        return np.add.accumulate(terms, axis=axis).take(-1, axis=axis) + np.float32(0.0)


class TorchC(TorchOps):
    """torch ops with the same extensions, on the device of the input tensor."""

    def __init__(self, x):
        super().__init__()
        self.device = x.device

    def c(self, value):
        return self.torch.tensor(value, dtype=self.torch.float32, device=self.device)

    def zeros(self, like, name="float32"):
        return self.torch.zeros(like.shape, dtype=getattr(self.torch, name), device=self.device)

    def const(self, values, name):
        return self.torch.tensor(values, dtype=getattr(self.torch, name), device=self.device)

    def f32_bits(self, x):
        return x.contiguous().view(self.torch.int32)

    def bits_f32(self, i):
        return i.to(self.torch.int32).contiguous().view(self.torch.float32)

    def log2(self, x):
        return self.torch.log2(x.double()).float()

    def sqrt(self, x):
        # torch's float32 sqrt is not always correctly rounded (sqrtf is); via float64 it is.
        return self.torch.sqrt(x.double()).float()

    def leading(self, x):
        return x.movedim(-1, 0).contiguous()

    def trailing(self, x):
        return x.movedim(0, -1)

    def assign(self, a, i, value):
        a[..., i] = value
        return a


# How JaxC runs C's running sums on each XLA platform (the values are the same): a step of a
# ``fori_loop`` costs a TPU more than a CPU, and a row of an (elements, blocks) array spans a TPU's
# (8, 128) tiles; ``benchmarks/tpu_check.py --search`` times the three side by side.
ORDERED_SUMS = {"cpu": "loop", "gpu": "loop", "tpu": "unrolled"}


class JaxC(JaxOps):
    """jax.numpy ops with the same extensions, exact on every XLA backend: constants are numpy
    float32 scalars (sums of constants are computed here, in float32), quotients go through
    ``JaxOps.divide`` (the TPU's division is not IEEE), products that feed a sum through ``rounded``
    (XLA's CPU backend contracts them into FMAs), square roots are corrected to the nearest float."""

    def c(self, value):
        return np.float32(value)

    def zeros(self, like, name="float32"):
        return self.xp.zeros(like.shape, dtype=name)

    def const(self, values, name):
        return self.xp.asarray(np.asarray(values, dtype=name))

    def f32_bits(self, x):
        return self.jax.lax.bitcast_convert_type(x, self.xp.int32)

    def bits_f32(self, i):
        return self.jax.lax.bitcast_convert_type(i.astype(self.xp.int32), self.xp.float32)

    def log2(self, x):
        raise TypeError("log2 (MXFP4's exponent) has no exact jax form here: quantize MXFP4 with numpy or torch")

    def sqrt(self, x):
        return self.exact_sqrt(x)

    def leading(self, x):
        return self.xp.moveaxis(x, -1, 0)

    def trailing(self, x):
        return self.xp.moveaxis(x, 0, -1)

    def assign(self, a, i, value):
        return a.at[..., i].set(value)

    # C's running loops over a block's elements as reductions and loops XLA compiles quickly (an
    # unrolled chain of selects, fused with what reads it, took minutes to compile), same values.

    def ordered_sum(self, terms, axis):
        """C's ``s = 0; for (i...) s += terms[i]`` along ``axis``, in order, as ``ORDERED_SUMS`` says for
        the default backend: ``"loop"`` (one ``fori_loop`` over the elements), ``"lanes"`` (the same
        loop over a ``(elements, -1, 128)`` view, whose every step reads whole TPU tiles) or
        ``"unrolled"`` (one chain of adds, which XLA fuses with what computes the terms)."""
        terms = self.xp.moveaxis(self.rounded(terms), axis, 0)
        total = self.c(0.0) + terms[0]
        how = ORDERED_SUMS.get(self.jax.default_backend(), "loop")
        if how == "unrolled":
            for i in range(1, terms.shape[0]):
                total = total + terms[i]
            return total
        shape = total.shape
        if how == "lanes" and total.size % 128 == 0:
            terms, total = terms.reshape(terms.shape[0], -1, 128), total.reshape(-1, 128)
        body = lambda i, acc: acc + self.jax.lax.dynamic_index_in_dim(terms, i, keepdims=False)  # noqa: E731
        return self.jax.lax.fori_loop(1, terms.shape[0], body, total).reshape(shape)

    def first_of(self, x, index, axis=-1):
        return self.xp.take_along_axis(x, self.xp.expand_dims(index, axis), axis=axis).squeeze(axis)

    def min_max(self, x, axis=-1):
        """The first smallest and the first largest value (C's strict comparisons keep the first)."""
        return self.first_of(x, x.argmin(axis=axis), axis), self.first_of(x, x.argmax(axis=axis), axis)

    def first_absmax(self, x):
        amax = abs(x).max(axis=-1)
        vmax = self.first_of(x, abs(x).argmax(axis=-1))
        return amax, self.xp.where(amax > 0, vmax, self.c(0.0))

    def running_max(self, x):
        top = x.max(axis=-1)
        return self.xp.where(top > 0, top, self.c(0.0))


def ieee(func):
    """func with numpy's floating-point warnings off: C's overflows, infinities and NaNs are part
    of what is emulated.

    >>> float(ieee(lambda: np.float32(1e30) * np.float32(1e30))())
    inf
    """

    @functools.wraps(func)
    def quiet(*args, **kwargs):
        with np.errstate(all="ignore"):
            return func(*args, **kwargs)

    return quiet


def c_ops(x):
    """The C-emulation adapter for x (a numpy array or torch tensor).

    >>> type(c_ops(np.zeros(2, np.float32))).__name__
    'NumpyC'
    """
    base = array_ops(x)
    if isinstance(base, TorchOps):
        return TorchC(x)
    if isinstance(base, JaxOps):
        return JaxC()
    if type(base) is NumpyOps:
        return NumpyC()
    raise TypeError(f"ggml quantizers run on numpy arrays, torch tensors and jax arrays, not {type(x).__name__}")


def float_blocks(x, block):
    """``(ops, blocks)``: x as float32 viewed ``(..., n // block, block)``.

    >>> float_blocks(np.zeros((2, 64)), 32)[1].shape
    (2, 2, 32)
    """
    o = c_ops(x)
    if isinstance(o, TorchOps):
        x = x.detach()  # codes have no gradient
    elif not isinstance(o, JaxOps) or not isinstance(x, o.jax.core.Tracer):
        # a concrete jax array runs numpy's own operations (every grid, and numpy's values at
        # float32's limits, where the corrected quotients of the traced path overflow)
        x = np.asarray(x)
        o = c_ops(x)
    x = o.to_named(x, "float32")
    if x.ndim == 0 or x.shape[-1] % block:
        raise ValueError(f"the last axis ({tuple(x.shape)}) must be a multiple of the block, {block}")
    return o, x.reshape(tuple(x.shape[:-1]) + (x.shape[-1] // block, block))


def nearest_int(o, fval):
    """ggml's ``nearest_int``: add 1.5 * 2**23 in float32 and read the mantissa, as int32 (round
    half to even for |fval| < 2**22; the same bits as C beyond).

    >>> nearest_int(c_ops(np.zeros(0, np.float32)), np.array([0.5, 1.5, -2.5, 2.6], np.float32)).tolist()
    [0, 2, -2, 3]
    """
    return (o.f32_bits(o.rounded(fval) + o.c(12582912.0)) & 0x007FFFFF) - 0x00400000


def c_int(o, x):
    """``(int)x`` as x86-64 converts float32: truncation, INT_MIN for NaN or out of range. A C
    cast to (u)int8 keeps the low byte of this.

    >>> c_int(c_ops(np.zeros(0, np.float32)), np.array([2.9, -2.9, 3e9, np.nan], np.float32)).tolist()
    [2, -2, -2147483648, -2147483648]
    """
    inside = abs(x) < o.c(2147483648.0)
    return o.to_named(o.where(inside, o.trunc(x), o.c(-2147483648.0)), "int32")


def reciprocal(o, d):
    """C's ``d ? 1.0f/d : 0.0f``.

    >>> ieee(reciprocal)(c_ops(np.zeros(0, np.float32)), np.array([4.0, 0.0], np.float32)).tolist()
    [0.25, 0.0]
    """
    return o.where(d != 0, o.divide(o.c(1.0), d), o.zeros(d))


def to_half(o, x):
    """float16 store (round to nearest even, as ``GGML_FP32_TO_FP16``).

    >>> to_half(c_ops(np.zeros(0, np.float32)), np.array([1 + 2**-11, 1 + 3 * 2**-11], np.float32)).tolist()  # ties to even
    [1.0, 1.001953125]
    """
    return o.to_named(x, "float16")


def seq_sum(o, terms):
    """C's ``float s = 0; for (i...) s += terms[i];`` over the last axis, in order.

    >>> float(seq_sum(c_ops(np.zeros(0, np.float32)), np.array([1e8, 1.0, 1.0, -1e8], np.float32)))  # pairwise: 2.0
    0.0
    """
    if isinstance(o, (JaxC, NumpyC)):
        return o.ordered_sum(terms, -1)
    terms = o.rounded(terms)
    acc = o.c(0.0) + terms[..., 0]
    for i in range(1, terms.shape[-1]):
        acc = acc + terms[..., i]
    return acc


def first_absmax(o, x):
    """``(amax, max)`` of C's ``if (amax < fabsf(v)) { amax = fabsf(v); max = v; }`` from 0: the
    first largest magnitude and its signed value, over the last axis.

    >>> [float(v) for v in first_absmax(c_ops(np.zeros(0, np.float32)), np.array([1.0, -3.0, 3.0], np.float32))]
    [3.0, -3.0]
    """
    if isinstance(o, JaxC):
        return o.first_absmax(x)
    amax = o.zeros(x[..., 0])
    vmax = o.zeros(x[..., 0])
    for i in range(x.shape[-1]):
        v = x[..., i]
        larger = amax < abs(v)
        amax = o.where(larger, abs(v), amax)
        vmax = o.where(larger, v, vmax)
    return amax, vmax


def running_max(o, x):
    """C's ``if (v > m) m = v;`` from 0 over the last axis.

    >>> float(running_max(c_ops(np.zeros(0, np.float32)), np.array([-2.0, -1.0], np.float32)))
    0.0
    """
    if isinstance(o, JaxC):
        return o.running_max(x)
    m = o.zeros(x[..., 0])
    for i in range(x.shape[-1]):
        m = o.where(x[..., i] > m, x[..., i], m)
    return m


def as_numpy(field):
    """A field as a numpy array (torch tensors leave their device).

    >>> as_numpy([1, 2]).tolist()
    [1, 2]
    """
    return field.detach().cpu().numpy() if hasattr(field, "detach") else np.asarray(field)


def half_bytes(h):
    """float16 values as their little-endian bytes, on a new last axis of 2.

    >>> half_bytes(np.array([1.0, -2.0])).tolist()
    [[0, 60], [0, 192]]
    """
    return np.ascontiguousarray(as_numpy(h).astype("<f2"))[..., None].view(np.uint8)


def half_from(b):
    """float16 values from little-endian byte pairs (the last axis, of 2).

    >>> half_from(np.array([[0, 60], [0, 192]], np.uint8)).tolist()
    [1.0, -2.0]
    """
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float16)


def block_rows(b, bytes_per_block):
    """Packed bytes ``(..., n_blocks * bytes_per_block)`` viewed as ``(..., n_blocks, bytes_per_block)``.

    >>> block_rows(np.zeros(40, np.uint8), 20).shape
    (2, 20)
    """
    b = np.asarray(as_numpy(b), dtype=np.uint8)
    if b.ndim == 0 or b.shape[-1] % bytes_per_block:
        raise ValueError(f"the last axis ({b.shape}) must be a multiple of {bytes_per_block} bytes")
    return b.reshape(b.shape[:-1] + (b.shape[-1] // bytes_per_block, bytes_per_block))


def flat_rows(b):
    """``(..., n_blocks, bytes)`` blocks as rows ``(..., n_blocks * bytes)``.

    >>> flat_rows(np.zeros((3, 2, 20), np.uint8)).shape
    (3, 40)
    """
    return b.reshape(b.shape[:-2] + (b.shape[-2] * b.shape[-1],))
