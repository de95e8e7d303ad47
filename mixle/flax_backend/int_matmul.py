"""Integer matmuls for ``act_bits`` / ``bwd_bits`` on mixle's own weight grid (Flax).

A layer's product ``x @ W`` (``x``: ``(..., K)``, ``W``: an ``(K, N)`` kernel) with ``act_bits=8``
runs on integer operands: the weight's codes and scales are mixle's (``mixle.core.numerics`` on the
float32 master weight: the codes ``convert`` stores), the activations are quantized per token on the
weight's grid kind (``scale = absmax / qmax``, ``code = round_half_even(x * (qmax / absmax))``), and
the int32 sums are scaled back: ``y = (qx @ qw) * sx * sw``. Int8 (and int4) operands run on a
TPU's integer matrix units.

With ``bwd_bits`` the two backward products are integer too: ``dx = g @ W^T`` multiplies the
gradient, shifted by the weight's per-channel scales and quantized per token, with the weight's
codes; ``dW = x^T @ g`` multiplies the activations and the gradient, each quantized per column
over the tokens. The weight's gradient is the straight-through estimator's (the master weight
receives ``dW``). Without ``bwd_bits`` both backward products are float, with the fake-quantized
weight (the textbook STE).

Scales of group-wise weights sit along the contraction: the forward then sums per-group integer
products (one batched product over the groups); ``dx`` is float for them (a per-group shift of
the gradient would copy it once per group).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mixle.core.array_ops import array_ops, is_tracer
from mixle.core.numerics import quantize_blocks
from mixle.flax_backend.fake_quant import kernel_blocks

__all__ = ["applies", "int_matmul", "integer_product", "quantize_rows", "spec_applies", "weight_codes"]


def spec_applies(spec):
    """Whether ``spec``'s products run on integer operands (``int_matmul``): ``act_bits`` set, a
    symmetric integer grid of mixle's own numerics (codes -qmax..qmax, as the activations and
    gradients get; no clipping).

    >>> from mixle.core.spec import QuantSpec
    >>> spec_applies(QuantSpec(bits=8, act_bits=8)), spec_applies(QuantSpec(bits=4, grid="q4_0", act_bits=8))
    (True, False)
    """
    return (spec.act_bits is not None and spec.weight_format == "int"
            and spec.calibration is None and spec.clip_percentile is None and spec.bwd_stochastic_rounding is None
            and spec.act_symmetric and spec.grid_record.numerics is None and spec.grid_record.offset is None
            and spec.grid_record.activation_grid is None  # llama.cpp's grids round their inputs to its blocks
            and spec.grid_record.scale_rule == "absmax" and spec.code_min == -spec.code_max)


def applies(spec, lhs, rhs, dimension_numbers, side):
    """Whether ``int_matmul`` computes this product: an ``(K, N)`` weight on the right contracted
    over its first axis with the last axis of the activations, no batch axes, and ``spec_applies``.

    >>> from mixle.core.spec import QuantSpec
    >>> applies(QuantSpec(bits=8, act_bits=8), jnp.zeros((2, 4)), jnp.zeros((4, 3)), (((1,), (0,)), ((), ())), "rhs")
    True
    """
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
    return (side == "rhs" and rhs.ndim == 2 and tuple(rhs_c) == (0,) and tuple(lhs_c) == (lhs.ndim - 1,)
            and not lhs_b and not rhs_b and spec_applies(spec))


def weight_codes(w, spec):
    """``(codes int8, scale float32)`` of a ``(K, N)`` kernel, as mixle's numerics store them:
    ``codes`` in the kernel's view ``(K, N)`` (channel, tensor) or ``(K // g, g, N)`` (group), ``scale``
    broadcasting against it.

    >>> from mixle.core.spec import QuantSpec
    >>> codes, scale = weight_codes(jnp.array([[0.7, 0.1], [0.35, -0.2]]), QuantSpec(bits=4))
    >>> codes.tolist(), scale.ravel().tolist()
    ([[7, 4], [4, -7]], [0.10000000149011612, 0.02857142873108387])
    """
    shape, axis = kernel_blocks(tuple(w.shape), (0,), spec)
    concrete = not is_tracer(w)  # eager: numpy's own operations, no XLA compile per kernel shape
    view = (np.asarray(w) if concrete else w).astype(np.float32).reshape(shape)
    codes, scale, _ = quantize_blocks(array_ops(view), view, spec, axis=axis)
    if spec.granularity == "tensor":
        codes, scale = codes.reshape(w.shape), scale.reshape(1, 1)
    codes = codes.astype(np.int8)
    return (jnp.asarray(codes), jnp.asarray(scale)) if concrete else (codes, scale)


def quantize_rows(x, bits, axis=-1):
    """Symmetric per-row codes of ``x`` along ``axis`` (an axis or a tuple of them): ``(codes int8,
    scale float32)`` with
    ``scale = absmax / qmax`` and ``codes = round_half_even(x * (qmax / absmax))`` (0 for a zero row).

    >>> codes, scale = quantize_rows(jnp.array([[1.0, -0.5, 0.25]]), 8)
    >>> codes.tolist(), scale.tolist()
    ([[127, -64, 32]], [[0.007874015718698502]])
    """
    qmax = 2 ** (bits - 1) - 1
    x = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    safe = jnp.where(absmax == 0, 1.0, absmax)
    # The TPU's division misses the nearest float for some quotients and XLA multiplies by the
    # reciprocal of a constant divisor: the multiplier and the scale, one each per row, are the
    # correctly rounded quotients, as numpy divides, on every backend.
    ops = array_ops(safe)
    divisor = ops.divisor(qmax, safe)
    codes = jnp.clip(jnp.round(x * ops.divide(divisor, safe)), -qmax, qmax).astype(jnp.int8)
    return codes, jnp.where(absmax == 0, 0.0, ops.divide(safe, divisor))


def _int_dot(a, b, dims):
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.int32).astype(jnp.float32)


def integer_product(x, codes, scale, spec):
    """``y`` float32 of the integer product of ``x`` ``(..., K)`` and a weight's codes and scales
    (``weight_codes``' layout; int4 or int8 codes): ``x`` quantized per token at ``spec.act_bits``.

    The activations keep their leading axes (no reshape to rows): the product's output keeps the
    layer's layout, which XLA otherwise copies into the layout the next op wants (on a TPU v5e,
    the attention's q/k/v: 5% of the 110M model's step).

    >>> from mixle.core.spec import QuantSpec
    >>> integer_product(jnp.array([[1.0, 2.0]]), jnp.array([[127], [64]], jnp.int8),
    ...                 jnp.array([[0.5 / 127]]), QuantSpec(bits=8, act_bits=8)).tolist()
    [[1.0078740119934082]]
    """
    codes = codes.astype(jnp.int8)
    qx, sx = quantize_rows(x, spec.act_bits)
    if codes.ndim == 3:  # groups along the contraction: one product per group, summed
        groups, size, n = codes.shape
        tiles = qx.reshape(x.shape[:-1] + (groups, size))
        partial = _int_dot(tiles, codes, (((x.ndim,), (1,)), ((x.ndim - 1,), (0,))))  # (groups, ..., N)
        y = (partial * scale.reshape((groups,) + (1,) * (x.ndim - 1) + (n,))).sum(axis=0)
    else:
        y = _int_dot(qx, codes, (((x.ndim - 1,), (0,)), ((), ()))) * scale
    return y * sx


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _product(x, w, spec):
    codes, scale = weight_codes(w, spec)
    return integer_product(x, codes, scale, spec).astype(x.dtype)


def _product_fwd(x, w, spec):
    codes, scale = weight_codes(w, spec)
    return integer_product(x, codes, scale, spec).astype(x.dtype), (x, codes, scale, jnp.zeros((0,), w.dtype))


def _float_dot(a, b, contracting):
    """A float product in the operands' own dtype (bfloat16 where the layer computes in it, as
    the float model's backward), summed in float32."""
    return jax.lax.dot_general(a, b.astype(a.dtype), (contracting, ((), ())), preferred_element_type=jnp.float32)


def _product_bwd(spec, residuals, g):
    x, codes, scale, w_marker = residuals
    k, n = x.shape[-1], g.shape[-1]
    lead, last = tuple(range(x.ndim - 1)), ((x.ndim - 1,), (1,))
    if spec.bwd_bits is None or codes.ndim == 3:
        weight = (codes.astype(jnp.float32) * scale).reshape(k, n)
        dx = _float_dot(g, weight, last)
    else:
        qg, sg = quantize_rows(g.astype(jnp.float32) * scale.reshape(-1), spec.bwd_bits)
        dx = _int_dot(qg, codes, (last, ((), ()))) * sg
    if spec.bwd_bits is None:
        dw = _float_dot(x, g, (lead, lead))
    else:
        qxc, sxc = quantize_rows(x, spec.bwd_bits, axis=lead)
        qgc, sgc = quantize_rows(g, spec.bwd_bits, axis=lead)
        dw = _int_dot(qxc, qgc, ((lead, lead), ((), ()))) * sxc.reshape(-1, 1) * sgc.reshape(1, -1)
    return dx.astype(x.dtype), dw.astype(w_marker.dtype)


_product.defvjp(_product_fwd, _product_bwd)


def int_matmul(x, w, spec):
    """``x @ w`` on integer operands (see the module docstring), straight-through to ``w``.

    Args:
        x: activations ``(..., K)``.
        w: the float master kernel ``(K, N)`` (its codes are computed in float32).
        spec: the QuantSpec (``act_bits``, optional ``bwd_bits``; ``applies`` is True).

    Returns:
        ``(..., N)`` in ``x``'s dtype.

    >>> from mixle.core.spec import QuantSpec
    >>> x, w = jnp.array([[1.0, 2.0]]), jnp.array([[0.5], [0.25]])  # codes [64, 127] and [127, 64]
    >>> int_matmul(x, w, QuantSpec(bits=8, act_bits=8)).tolist()  # 2 * 64 * 127 * (2 / 127) * (0.5 / 127)
    [[1.0078740119934082]]
    """
    return _product(x, w, spec)
