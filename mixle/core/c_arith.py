"""The float32 C arithmetic of mixle's ggml quantizers on numpy, torch and jax arrays.

``c_ops(x)`` gives the C-emulation adapter of x's library: ``mixle.core.array_ops``' ops plus what
emulating ggml-quants.c needs (float32 constants, bit views, correctly rounded square roots, and
on jax the running loops C writes over a block as reductions and ordered loops XLA compiles
quickly). ``mixle.core.ggml_kquants`` and ``mixle.core.ggml_quants`` write their arithmetic once
against it.
"""

import functools

import numpy as np

from mixle.core.array_ops import JaxOps, NumpyOps, TorchOps, array_ops

__all__ = ["NumpyC", "TorchC", "JaxC", "c_ops", "ieee"]


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
        """C's ``s = 0; for (i...) s += terms[i]`` along ``axis``, in order (one loop, not unrolled)."""
        terms = self.xp.moveaxis(self.rounded(terms), axis, 0)
        body = lambda i, acc: acc + self.jax.lax.dynamic_index_in_dim(terms, i, keepdims=False)  # noqa: E731
        return self.jax.lax.fori_loop(1, terms.shape[0], body, self.c(0.0) + terms[0])

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
