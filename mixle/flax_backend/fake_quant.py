"""Fake quantization of jax arrays with a straight-through gradient (needs jax only, not qwix)."""

import functools
import math

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from mixle.core.array_ops import is_tracer
from mixle.core.checks import check_array
from mixle.core.numerics import block_shape, fake_quant_blocks, fake_quant_forward, quantize_array


# The name every traced fake-quantized kernel carries (``jax.ad_checkpoint.checkpoint_name``), for
# rematerialization: a block under ``jax.checkpoint`` / ``nnx.remat`` with the policy
# ``jax.checkpoint_policies.save_only_these_names(QUANTIZED_KERNEL)`` keeps each quantized kernel for
# its backward instead of quantizing the float32 master weight again in the recomputed forward.
QUANTIZED_KERNEL = "mixle_quantized_kernel"


def _refuse_qwix_only(spec):
    options = spec.qwix_only_options()
    if options:
        raise ValueError(
            f"fake_quantize computes mixle's integer grids, which have no {sorted(options)} option "
            f"(got {options}); those are applied by apply_qat on a Flax model through Qwix"
        )


def _forward(x, spec, with_mask=False):
    """``fake_quant_forward``; on a concrete array (an eager grad's primal) by numpy's own operations."""
    if is_tracer(x):
        return fake_quant_forward(x, spec, with_mask=with_mask)
    deq, mask = fake_quant_forward(np.asarray(x), spec, with_mask=with_mask)
    return jax.numpy.asarray(deq), None if mask is None else jax.numpy.asarray(mask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _fake_quant(x, spec):
    return _forward(x, spec)[0]


def _fake_quant_fwd(x, spec):
    return _forward(x, spec, with_mask=spec.clip_gradient)


def _fake_quant_bwd(spec, mask, grad):
    if mask is None:
        return (grad,)
    return (grad * mask.astype(grad.dtype),)


_fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


def fake_quantize(x, spec):
    """Quantize-dequantize a jax array; the gradient is the straight-through estimator.

    The forward is ``mixle.core.numerics.quantize_dequantize_array(x, spec)`` (the same values
    as the numpy and torch paths); the backward passes the gradient unchanged, or zeroes it
    where ``|x|`` exceeds the ``clip_percentile`` threshold when ``clip_gradient=True``.
    Works eagerly (a concrete array runs numpy's own operations) and under ``jax.jit`` / ``jax.grad``.

    >>> import jax.numpy as jnp
    >>> from mixle.core.spec import QuantSpec
    >>> fake_quantize(jnp.array([0.7, 0.1, 0.04]), QuantSpec(bits=4)).tolist()
    [0.699999988079071, 0.10000000149011612, 0.0]
    """
    _refuse_qwix_only(spec)
    check_array(x)
    if not is_tracer(x):  # nothing to differentiate: numpy's values, no XLA compile per shape
        return _forward(x, spec)[0]
    return _fake_quant(x, spec)


def weight_layout(ndim, input_axes):
    """``(perm, out_count)``: the axis order that lays a kernel out as mixle's ``out + in``.

    A flax kernel keeps its input (contracting) axes wherever its layer puts them (``(in, out)``
    for ``nnx.Linear``, ``(vocab, dim)`` for an ``Embed`` used by ``attend``, ``(kh, kw, in,
    out)`` for a conv); mixle's numerics read ``out + in``. ``perm`` transposes the kernel
    into that order (the output axes first, each group in its original order).

    >>> weight_layout(2, (0,))
    ((1, 0), 1)
    """
    input_axes = tuple(sorted(int(a) for a in input_axes))
    out_axes = tuple(a for a in range(ndim) if a not in input_axes)
    return out_axes + input_axes, len(out_axes)


def as_matrix(w, perm, out_count):
    """The kernel transposed by ``perm`` and flattened to ``(prod(out), prod(in))`` (an array of
    w's library: numpy or jax)."""
    wt = w.transpose(perm)
    return wt.reshape(math.prod(wt.shape[:out_count]), math.prod(wt.shape[out_count:]))


def from_matrix(matrix, shape, perm):
    """Inverse of ``as_matrix``: the ``(out, in)`` matrix back in the kernel's own ``shape``."""
    transposed_shape = tuple(shape[a] for a in perm)
    inverse = tuple(perm.index(a) for a in range(len(perm)))
    return matrix.reshape(transposed_shape).transpose(inverse)


def fake_quantize_weight(w, input_axes, spec, name="kernel", importance=None, dtype=None):
    """Fake-quantize a kernel contracted over ``input_axes`` with mixle's own numerics.

    The kernel is quantized as its ``(out, in)`` matrix would be (see ``weight_layout``) by
    ``mixle.core.numerics`` (one scale per output row, per ``group_size`` consecutive inputs, or
    per tensor; ``clip_percentile`` included), but in its own layout where the input axes are
    adjacent (``kernel_blocks``), so no transpose runs in the training step. The gradient is
    the straight-through estimator (masked outside the clip threshold with ``clip_gradient``).
    These are the values ``convert`` stores as codes and scales, so the converted forward is
    the same computation. A bfloat16/float16 kernel runs the float32 numerics, its values
    rounded once to its dtype. Eagerly, a kernel that would dequantize to infinity raises a
    ScaleOverflowError calling it ``name`` (under ``jit`` values cannot be read: no check).
    A concrete kernel (eager, not traced by ``jit`` or ``grad``) runs numpy's own operations,
    whose values the traced path reproduces, instead of compiling each jax op for its shape.
    ``dtype`` (e.g. bfloat16, what a layer computes in) casts the values once, in the same pass
    as the quantizer, instead of keeping a float32 copy of the kernel for the layer to cast.
    Traced, the result is named ``QUANTIZED_KERNEL`` for rematerialization policies.

    llama.cpp's grids with block numerics (``q4_1`` ... ``q6_k``), and any grid given an
    ``importance`` (one non-negative weight per input, numpy: ggml's weighted search, as
    ``llama-quantize --imatrix``), quantize the kernel's ``(out, in)`` rows as ggml quantizes a
    torch weight's rows (``kernel_rows``): the blocks run along the input axes, and the codes
    are llama-quantize's for the same weights.

    >>> import jax.numpy as jnp
    >>> from mixle.core.spec import QuantSpec
    >>> fake_quantize_weight(jnp.array([[0.7, 0.1], [0.04, 0.2]]), (0,), QuantSpec(bits=4)).tolist()
    [[0.699999988079071, 0.11428571492433548], [0.0, 0.20000000298023224]]
    """
    axes = tuple(sorted(int(a) for a in input_axes))
    dtype = w.dtype if dtype is None else jax.numpy.dtype(dtype)
    if not is_tracer(w):  # nothing to differentiate: numpy's values, no XLA compile per kernel shape
        value = None if importance is None else _Fixed(importance).value
        return jax.numpy.asarray(_concrete_forward(np.asarray(w), axes, spec, name, value)).astype(dtype)
    if spec.grid_record.numerics is not None or importance is not None:
        value = _fake_quant_rows(w, axes, spec, name, None if importance is None else _Fixed(importance)).astype(dtype)
    else:
        value = _fake_quant_kernel(w, axes, spec, name, dtype)
    return checkpoint_name(value, QUANTIZED_KERNEL)


def _concrete_forward(w, input_axes, spec, name, importance):
    """``fake_quantize_weight``'s forward on a numpy kernel (``importance``: float32 numpy or None):
    the traced path's steps on numpy."""
    if spec.grid_record.numerics is not None or importance is not None:
        perm, _ = weight_layout(w.ndim, input_axes)
        deq = kernel_rows(w, input_axes, spec, importance, name).dequantize().astype(w.dtype)
        return from_matrix(deq, w.shape, perm)
    blocks, axis, back = _kernel_blocks(w, input_axes, spec)
    return back(fake_quant_blocks(blocks, spec, axis=axis, name=name)[0])


class _Fixed:
    """A numpy array passed as a static argument (hashed by identity): an importance is fixed data."""

    def __init__(self, value):
        self.value = np.asarray(value, np.float32)


def kernel_rows(w, input_axes, spec, importance=None, name="kernel"):
    """The ``QuantizedArray`` of a kernel's ``(out, in)`` matrix (``weight_layout``): its rows
    quantized as llama.cpp quantizes a torch weight's rows, blocks along the inputs (``importance``:
    ggml's weighted search). Runs under ``jit``; the record holds arrays of w's library.

    >>> import jax.numpy as jnp
    >>> from mixle.core.spec import QuantSpec
    >>> kernel_rows(jnp.ones((32, 2)), (0,), QuantSpec(grid="q5_0")).codes.shape
    (2, 32)
    """
    perm, out_count = weight_layout(w.ndim, input_axes)
    matrix = as_matrix(w, perm, out_count)
    return quantize_array(matrix, spec, name=name, importance=importance)


def _rows_forward(w, input_axes, spec, name, importance):
    if not is_tracer(w):  # the primal of an eager grad: numpy's values, no XLA compile per shape
        value = None if importance is None else importance.value
        return jax.numpy.asarray(_concrete_forward(np.asarray(w), input_axes, spec, name, value))
    perm, _ = weight_layout(w.ndim, input_axes)
    value = None if importance is None else importance.value
    q = kernel_rows(w, input_axes, spec, value, name)
    deq = q.dequantize().astype(w.dtype)
    return jax.lax.optimization_barrier(from_matrix(deq, w.shape, perm))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _fake_quant_rows(w, input_axes, spec, name, importance):
    return _rows_forward(w, input_axes, spec, name, importance)


def _fake_quant_rows_fwd(w, input_axes, spec, name, importance):
    return _rows_forward(w, input_axes, spec, name, importance), None


def _fake_quant_rows_bwd(input_axes, spec, name, importance, residual, grad):
    return (grad,)


_fake_quant_rows.defvjp(_fake_quant_rows_fwd, _fake_quant_rows_bwd)


def kernel_blocks(shape, input_axes, spec):
    """``(view shape, axis)`` laying a kernel's scale blocks along one axis without a transpose.

    The blocks of the kernel's ``(out, in)`` matrix (``weight_layout``) are slices of its input
    axes flattened in order; when those axes are adjacent, merging them (and splitting off the
    groups of ``group_size``) is a reshape. ``None`` when they are not adjacent.

    >>> from mixle.core.spec import QuantSpec
    >>> kernel_blocks((512, 2048), (0,), QuantSpec(bits=4, group_size=32))
    ((16, 32, 2048), 1)
    """
    input_axes = tuple(sorted(input_axes))
    first, last = input_axes[0], input_axes[-1]
    if input_axes != tuple(range(first, last + 1)):
        return None
    if spec.granularity == "tensor":
        return (math.prod(shape),), 0
    before, inputs, after = shape[:first], math.prod(shape[first : last + 1]), shape[last + 1 :]
    # block_shape raises mixle's message (naming divisors) when group_size does not divide the input.
    _, _, size = block_shape((math.prod(before) * math.prod(after), inputs), spec)
    if spec.granularity == "channel":
        return before + (inputs,) + after, len(before)
    return before + (inputs // size, size) + after, len(before) + 1


def _kernel_blocks(w, input_axes, spec):
    """``(blocks view, axis, back)``: the view for ``fake_quant_blocks`` and the map back."""
    view = kernel_blocks(w.shape, input_axes, spec)
    if view is not None:
        shape, axis = view
        return w.reshape(shape), axis, lambda v: v.reshape(w.shape)
    perm, out_count = weight_layout(w.ndim, input_axes)
    matrix = as_matrix(w, perm, out_count)
    blocks = matrix.reshape(block_shape(matrix.shape, spec))
    return blocks, -1, lambda v: from_matrix(v.reshape(matrix.shape), w.shape, perm)


def kept_on_cpu(kernel):
    """``kernel`` kept as its own value (an optimization barrier) on a CPU only.

    Where an XLA version fused a kernel's quantizer into the matmul's operand, the CPU matmul ran
    about twice as slow. Other backends fuse it and gain (a TPU v5e: 470M model, int8, 1.032x the
    float step instead of 1.069x with the barrier).

    >>> float(kept_on_cpu(jax.numpy.float32(2.0)))
    2.0
    """
    return jax.lax.optimization_barrier(kernel) if jax.default_backend() == "cpu" else kernel


def _kernel_forward(w, input_axes, spec, name, dtype):
    if not is_tracer(w):  # the primal of an eager grad: numpy's values, no XLA compile per shape
        blocks, axis, back = _kernel_blocks(np.asarray(w), input_axes, spec)
        deq, threshold = fake_quant_blocks(blocks, spec, axis=axis, name=name)
        return jax.numpy.asarray(back(deq)).astype(dtype), jax.numpy.asarray(threshold)
    blocks, axis, back = _kernel_blocks(w, input_axes, spec)
    deq, threshold = fake_quant_blocks(blocks, spec, axis=axis, name=name)
    deq = deq.astype(dtype)
    if spec.granularity == "group" and jax.default_backend() != "cpu":
        # Its own value in the group view: otherwise XLA moves the reshape back to the kernel's
        # shape ahead of the quantizer's arithmetic and materializes every per-group array
        # broadcast to the kernel's size (on a TPU v5e, 8192 x 2048 kernel: 1.3 GiB moved instead of 0.56).
        return back(jax.lax.optimization_barrier(deq)), threshold
    return kept_on_cpu(back(deq)), threshold


# One straight-through node around the whole kernel: the gradient reaches the kernel as is (or
# masked), without running back through the quantizer.
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _fake_quant_kernel(w, input_axes, spec, name, dtype):
    return _kernel_forward(w, input_axes, spec, name, dtype)[0]


def _fake_quant_kernel_fwd(w, input_axes, spec, name, dtype):
    deq, threshold = _kernel_forward(w, input_axes, spec, name, dtype)
    # With clip_gradient the mask is recomputed from the kernel and the small per-block
    # threshold in the backward pass instead of being kept as a residual of the kernel's size.
    # The marker carries the kernel's dtype, which the gradient is returned in.
    return deq, ((w, threshold) if spec.clip_gradient else jax.numpy.zeros((0,), w.dtype))


def _fake_quant_kernel_bwd(input_axes, spec, name, dtype, residual, grad):
    if not isinstance(residual, tuple):
        return (grad.astype(residual.dtype),)
    w, threshold = residual
    blocks, _, back = _kernel_blocks(w, input_axes, spec)
    return (jax.numpy.where(back(abs(blocks) <= threshold), grad, jax.numpy.zeros_like(grad)).astype(w.dtype),)


_fake_quant_kernel.defvjp(_fake_quant_kernel_fwd, _fake_quant_kernel_bwd)
