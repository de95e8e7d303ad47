"""llama.cpp's rounding of each product's input, for jax arrays (``QuantSpec.act_bits`` on its grids).

llama.cpp's CPU path rounds the input of a product with a quantized weight before multiplying, along
each token's inputs: to Q8_0 blocks of 32 before ``q4_0``, ``q8_0``, ``q4_1``, ``q5_0`` and ``q5_1``
weights, to Q8_K blocks of 256 before the K-quants. ``round_product_input`` gives a jax array those
values (``Grid.activation_record``) through the functions the torch backend's ``fake_quant_activations``
runs (``mixle.core.numerics.PRODUCT_INPUT_ROUNDINGS``): Q8_0 as the llama.cpp build
``QuantSpec.act_rounding`` names rounds it (ggml's reference C code unless set), Q8_K as ggml's
``quantize_row_q8_K``, their divisions rounded as IEEE rounds them on every XLA backend
(``JaxOps.divide``).

bfloat16 / float16 inputs are rounded in float32 and cast back. The gradient is the straight-through
estimator (identity). A concrete array (eager) runs numpy's operations, whose values the traced path
reproduces.
"""

import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from mixle.core.array_ops import JaxOps, NumpyOps, is_tracer
from mixle.core.numerics import PRODUCT_INPUT_ROUNDINGS, fake_quant_forward
from mixle.core.spec import QuantSpec

__all__ = ["product_input_grid", "round_product_input", "qwix_options"]


def product_input_grid(spec):
    """The block grid llama.cpp rounds the input of ``spec``'s products to, or None without ``act_bits``.

    Raises:
        ValueError: ``act_bits`` on a grid llama.cpp has no product for (those run Qwix's quantizer).

    >>> product_input_grid(QuantSpec(bits=4, grid="q4_k", act_bits=8)).name
    'q8_k'
    """
    if spec.act_bits is None:
        return None
    grid = spec.grid_record.activation_record()
    if grid.block is None or spec.act_bits not in grid.codes:
        raise ValueError(f"act_bits={spec.act_bits!r} with grid={spec.grid!r}: round_product_input makes "
                         f"llama.cpp's Q8_0 / Q8_K blocks, for llama.cpp's grids at act_bits=8")
    return grid


def qwix_options(spec):
    """The options of ``spec`` that only Qwix's quantizer runs (``QuantSpec.qwix_only_options``), less
    ``act_bits`` on llama.cpp's grids, whose product inputs ``round_product_input`` rounds.

    >>> qwix_options(QuantSpec(bits=4, grid="q4_0", act_bits=8)), qwix_options(QuantSpec(bits=8, act_bits=8))
    ({}, {'act_bits': 8})
    """
    options = spec.qwix_only_options()
    if spec.grid_record.activation_grid is not None:
        options.pop("act_bits", None)
    return options


def _rounded(x, spec):
    grid = product_input_grid(spec)
    width = x.shape[-1]
    if width % grid.block:
        raise ValueError(f"a product input of {width} values per token does not split into {grid.name} blocks of "
                         f"{grid.block}: the layer's input size must be a multiple of {grid.block} for act_bits")
    traced = is_tracer(x)
    xp = jnp if traced else np
    rows = xp.asarray(x).astype(np.float32).reshape(-1, width)
    rule = PRODUCT_INPUT_ROUNDINGS.get((grid.scale_rule, grid.rounding))
    if rule is None:
        out = fake_quant_forward(rows, _block_spec(grid.name), out_ndim=1)[0]
    else:
        out = rule(JaxOps() if traced else NumpyOps(), rows, spec, grid, "a product's input")
    return jnp.asarray(out.reshape(x.shape)).astype(x.dtype)


@functools.cache
def _block_spec(grid):
    return QuantSpec(bits=8, grid=grid)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _straight_through(x, spec):
    return _rounded(x, spec)


_straight_through.defvjp(lambda x, spec: (_rounded(x, spec), None), lambda spec, _, grad: (grad,))


def round_product_input(x, spec):
    """``x`` (``(..., inputs)``) rounded as llama.cpp rounds the input of a product with a ``spec``
    weight (Q8_0 or Q8_K blocks along the last axis), straight-through gradient; ``x`` itself
    without ``act_bits``.

    Raises:
        ValueError: ``act_bits`` on a grid without llama.cpp's products, or a last axis that does not
            split into the blocks.

    >>> x = jnp.linspace(-1, 1, 32)[None]
    >>> y = round_product_input(x, QuantSpec(bits=4, grid="q4_0", act_bits=8))
    >>> round(float(y[0, 1]), 6)  # -0.9355 to code -119 times float16(1 / 127)
    -0.936951
    """
    if spec.act_bits is None:
        return x
    if not is_tracer(x):  # nothing to differentiate: numpy's values
        return _rounded(x, spec)
    key = (product_input_grid(spec).name, spec.act_rounding)
    source, last_key, result = _LAST_ROUNDED[0]
    if source() is x and last_key == key and result() is not None:  # q, k, v (gate, up) read one input
        return result()
    rounded = _straight_through(x, spec)
    _LAST_ROUNDED[0] = (weakref.ref(x), key, weakref.ref(rounded))
    return rounded


# The last traced input rounded, its rounding and the result (weakly: nothing outlives its trace): the
# projections that read the same tracer share one rounding, and the compiled program holds it once.
_LAST_ROUNDED = [(lambda: None, None, lambda: None)]
