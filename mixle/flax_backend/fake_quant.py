"""Fake quantization of jax arrays with a straight-through gradient (needs jax only, not qwix)."""

import functools

import jax

from mixle.core.numerics import check_array, fake_quant_forward


def _refuse_qwix_only(spec):
    options = spec.qwix_only_options()
    if options:
        raise ValueError(
            f"fake_quantize computes mixle's integer grids, which have no {sorted(options)} option "
            f"(got {options}); those are applied by apply_qat on a Flax model through Qwix"
        )


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _fake_quant(x, spec):
    return fake_quant_forward(x, spec)[0]


def _fake_quant_fwd(x, spec):
    deq, mask = fake_quant_forward(x, spec, with_mask=spec.clip_gradient)
    return deq, mask


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
    Works eagerly and under ``jax.jit`` / ``jax.grad``.

    >>> import jax.numpy as jnp
    >>> from mixle.core.spec import QuantSpec
    >>> fake_quantize(jnp.array([0.7, 0.1, 0.04]), QuantSpec(bits=4)).tolist()
    [0.699999988079071, 0.10000000149011612, 0.0]
    """
    _refuse_qwix_only(spec)
    check_array(x)
    return _fake_quant(x, spec)
