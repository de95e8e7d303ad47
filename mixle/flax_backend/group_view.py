"""Products that contract a group-wise kernel's group view, where a TPU fuses the dequantizing into them.

A Linear's group-wise kernel is quantized, and stored by ``convert``, in its group view ``(in / g, g,
out)`` (``fake_quant.kernel_blocks``). Reshaped back to ``(in, out)`` before the product, XLA's TPU
compiler writes the dequantized kernel out first; a product that contracts the view's two input axes
itself reads the codes and scales in its own fusion. On a TPU v5e, the 470M model of
``benchmarks/tpu_speed.py`` at 16 tokens: group 128 0.569x of the float forward's time reshaped,
0.393x contracting the view; group 32 1.299x contracting it in every Linear, as XLA re-lays out
32-wide groups first, but 0.506x instead of 0.598x in the 32,000-wide head alone (its reshaped
kernel is written out at the vocabulary's size). So groups that are whole multiples of the TPU's 128
lanes, and any groups of a kernel with at least ``GROUP_VIEW_WIDE_OUTPUTS`` outputs, contract their
view, off the CPU (where the plain product is faster), in products of at most ``GROUP_VIEW_MAX_ROWS``
input rows: decoding, where reading the kernel is the product's cost. Longer products multiply the
reshaped kernel: at 2048 tokens the forward took 0.983x of float's time reshaped and 0.998x
contracting the view, and a training step's gradients through the view cost more than the fused
read saves (the compiler's
estimate of ``tpu_speed.py``'s QAT step at group 128: 173.1 instead of 143.5 ms for the 110M model,
216.9 instead of 207.6 ms for the 470M one; on the chip 1.097x of the float step at 110M and 1.091x
at 470M with the view, 1.003x and 1.076x without). The QAT forward, the float graph of grouped kernels
(``kernel_groups``) and the converted model run the same product for the same input, so their
outputs stay equal on every backend.
"""

import functools
import math

import jax
from flax import nnx

__all__ = ["GROUP_VIEW_LANES", "GROUP_VIEW_MAX_ROWS", "GROUP_VIEW_WIDE_OUTPUTS", "contracts_group_view",
           "group_view_dot", "plain_linear", "takes_group_view", "groups_in_view", "linear_with_product",
           "group_view_class", "give_group_view"]

# A group size that is a multiple of this is contracted in its view off the CPU (a TPU's lane width).
GROUP_VIEW_LANES = 128
# A kernel with at least this many outputs (a vocabulary's head) contracts its view for any group size.
GROUP_VIEW_WIDE_OUTPUTS = 16384
# Products of more input rows than this (prefill, training) multiply the reshaped kernel.
GROUP_VIEW_MAX_ROWS = 256


def groups_in_view(spec):
    """Whether ``spec``'s kernels are quantized (and stored) in their group view: group-wise scales on a
    grid that dequantizes as ``codes * scale`` (no table, offset or second-level scales).

    >>> from mixle.core.spec import QuantSpec
    >>> groups_in_view(QuantSpec(bits=4, group_size=32)), groups_in_view(QuantSpec(bits=4))
    (True, False)
    """
    grid = spec.grid_record
    return (spec.granularity == "group" and grid.table is None and not grid.two_level and grid.offset is None)


def contracts_group_view(spec, outputs):
    """Whether a plain ``nnx.Linear``'s product with a ``spec`` kernel of ``outputs`` features contracts
    the group view (off the CPU, for few rows: ``group_view_dot``): groups in the view
    (``groups_in_view``) of a multiple of ``GROUP_VIEW_LANES`` weights, or of any size in a kernel of
    at least ``GROUP_VIEW_WIDE_OUTPUTS`` outputs.

    >>> from mixle.core.spec import QuantSpec
    >>> g32 = QuantSpec(bits=4, group_size=32)
    >>> contracts_group_view(QuantSpec(bits=4, group_size=128), 64)
    True
    >>> contracts_group_view(g32, 8192), contracts_group_view(g32, 32000)
    (False, True)
    """
    return groups_in_view(spec) and (spec.group_size % GROUP_VIEW_LANES == 0 or outputs >= GROUP_VIEW_WIDE_OUTPUTS)


# Captured at import: inside Qwix's interception ``jax.lax.dot_general`` may be another function.
_DOT_GENERAL = jax.lax.dot_general


def plain_linear(module, name, cls=None):
    """Whether ``module``'s product with its Param ``name`` is ``nnx.Linear``'s own: an ``nnx.Linear``
    whose class (``cls``: the user's class of a QAT-wrapped module) runs Linear's ``__call__`` with
    ``jax.lax.dot_general``, ``name`` its kernel.

    >>> plain_linear(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), "kernel")
    True
    """
    cls = type(module) if cls is None else cls
    return (isinstance(module, nnx.Linear) and name == "kernel" and cls.__call__ is nnx.Linear.__call__
            and vars(module).get("dot_general") is _DOT_GENERAL)


def takes_group_view(module, name, spec, cls=None):
    """Whether ``module``'s product with its ``spec`` kernel ``name`` contracts the group view off the
    CPU for few rows: a plain ``nnx.Linear`` (``plain_linear``, ``cls`` as there) whose kernel
    ``contracts_group_view`` at its ``out_features``.

    >>> from mixle.core.spec import QuantSpec
    >>> takes_group_view(nnx.Linear(256, 2, rngs=nnx.Rngs(0)), "kernel", QuantSpec(bits=4, group_size=128))
    True
    """
    return plain_linear(module, name, cls) and contracts_group_view(spec, module.out_features)


def group_view_dot(x, kernel, group_size, **keywords):
    """``x @ kernel`` (a Linear's product: ``x`` ``(..., K)``, ``kernel`` ``(K, N)``); off the CPU, for
    at most ``GROUP_VIEW_MAX_ROWS`` rows of ``x``, the two reshaped to ``(..., K / g, g)`` and ``(K /
    g, g, N)`` and contracted over both axes.

    >>> import jax.numpy as jnp
    >>> group_view_dot(jnp.ones((2, 256)), jnp.ones((256, 3)), 128).tolist()
    [[256.0, 256.0, 256.0], [256.0, 256.0, 256.0]]
    """
    lead = x.ndim - 1
    if jax.default_backend() == "cpu" or math.prod(x.shape[:-1]) > GROUP_VIEW_MAX_ROWS:
        return jax.lax.dot_general(x, kernel, (((lead,), (0,)), ((), ())), **keywords)
    groups = kernel.shape[0] // group_size
    tiles = x.reshape(x.shape[:-1] + (groups, group_size))
    view = kernel.reshape(groups, group_size, kernel.shape[1])
    return jax.lax.dot_general(tiles, view, (((lead, lead + 1), (0, 1)), ((), ())), **keywords)


def linear_with_product(cls, product_of):
    """A subclass of ``cls`` (an ``nnx.Linear``) whose ``__call__`` (Linear's own: dtype promotion,
    bias) multiplies by ``product_of(self)``, a function taking ``dot_general``'s arguments, instead
    of ``jax.lax.dot_general``. Named as ``cls``, so ``isinstance`` and reprs hold.

    >>> issubclass(linear_with_product(nnx.Linear, lambda self: jax.lax.dot_general), nnx.Linear)
    True
    """

    def keep(self, function):  # nnx sets the instance's own dot_general when it builds or copies the module
        vars(self)["dot_general"] = function

    return type(cls.__name__, (cls,), {"dot_general": property(product_of, keep), "__module__": cls.__module__})


@functools.cache
def group_view_class(cls, group_size):
    """``cls`` (an ``nnx.Linear``) whose product is ``group_view_dot`` with groups of ``group_size``.

    >>> issubclass(group_view_class(nnx.Linear, 128), nnx.Linear)
    True
    """

    def view_dot(self):
        return lambda inputs, kernel, dimension_numbers, **keywords: group_view_dot(inputs, kernel, group_size,
                                                                                   **keywords)

    return linear_with_product(cls, view_dot)


def give_group_view(module, name, spec):
    """Make a plain ``nnx.Linear`` with a ``spec`` kernel (``takes_group_view``) run ``group_view_dot``:
    its class becomes a subclass of its own (``isinstance`` holds). Returns whether it did.

    >>> from mixle.core.spec import QuantSpec
    >>> layer = nnx.Linear(256, 2, rngs=nnx.Rngs(0))
    >>> give_group_view(layer, "kernel", QuantSpec(bits=4, group_size=128)), isinstance(layer, nnx.Linear)
    (True, True)
    """
    if not takes_group_view(module, name, spec):
        return False
    object.__setattr__(module, "__class__", group_view_class(type(module), spec.group_size))
    return True
