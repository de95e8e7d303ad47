"""A QAT-wrapped Flax model's weight fake quantization as one quantizer call per group of kernels.

Inside a wrapped model's forward each kernel gets its own quantizer call, and XLA compiles each
call on its own: a 30-layer decoder's 210 kernels took minutes to compile on a CPU and longer on a
TPU, for a training step whose float twin compiles in seconds. Every grid whose blocks lie along
a kernel's input axis (ggml's block types, mixle's channel and group grids, with or without the
importance-weighted search) quantizes each ``(out, in)`` row on its own. So kernels of the same
spec, layout, input size and dtype are joined along their output axis and quantized by one
``fake_quantize_weight`` call: each row goes through the same operations as in its own kernel's
call, so every value is the same, and the straight-through gradient reaches each kernel. Kernels
searched with an importance (one per input, another for each kernel) are stacked instead, those of
one shape, and quantized by one ``quantize_array`` call in a loop over batches of them (``lax.map``),
each with its own importance: ggml's weighted search row by row, as each kernel's own call.

``kernel_groups`` makes the groups of a wrapped model (None where a kernel cannot be grouped:
per-tensor scales, Qwix's own quantizers for ``act_bits`` / ``bwd_bits`` / fp8, kernels of more
than two axes); ``fake_quantize_groups`` maps a state of the kernels to their fake-quantized
values; ``float_graphdef`` is the graph of the model's float classes, which runs the forward with
those values in place of the kernels (what a wrapped forward computes, with nothing intercepted;
with ``act_bits`` on llama.cpp's grids each quantized Linear first rounds its input as llama.cpp does,
``run_wrapped_products``, which also gives plain Linears the group view's product where
``contracts_group_view`` says).
"""

import dataclasses
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mixle.core.numerics import quantize_array
from mixle.flax_backend.activations import round_product_input
from mixle.flax_backend.fake_quant import fake_quantize_weight
from mixle.flax_backend.group_view import give_group_view
from mixle.flax_backend.provider import dotted_path, straight_through, uses_mixle_numerics
from mixle.flax_backend.qat import float_class_of, qat_state, quantized_kernels, restore_float_classes

__all__ = ["KernelGroup", "kernel_groups", "fake_quantize_groups", "quantized_state", "float_graphdef",
           "run_wrapped_products"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelGroup:
    """Kernels quantized by one call: their dotted Param paths and output sizes, in join order.

    Hashable (the importance by its digest), so a group can be a static argument of ``jax.jit``.
    """

    spec: object
    layout: tuple  # the input axes (the same for every kernel of the group)
    paths: tuple
    sizes: tuple  # each kernel's size along the joined (output) axis
    # float32 (kernels, in): each kernel's importance; the kernels are stacked, not joined
    importance: object = dataclasses.field(default=None, compare=False, hash=False, repr=False)
    importance_digest: str = dataclasses.field(init=False, default="")  # what equality and hashing see of it

    def __post_init__(self):
        if self.importance is not None:
            digest = hashlib.sha256(np.ascontiguousarray(self.importance, np.float32).tobytes()).hexdigest()
            object.__setattr__(self, "importance_digest", digest)

    @property
    def axis(self):
        """The output axis the kernels are joined along (a kernel has two axes, one of them input)."""
        return 1 - self.layout[0]


def _groupable(kernel, value, owner):
    spec = kernel.spec
    stacked = kernel.importance is not None  # its straight-through gradient has no clip mask
    rounded = spec.act_bits is None or _product_kind(float_class_of(owner), kernel.name) is not None
    return (value.ndim == 2 and len(kernel.layout) == 1 and uses_mixle_numerics(spec) and rounded
            and spec.granularity != "tensor" and not (stacked and spec.clip_gradient))


# The layer kinds whose product input ``act_bits`` rounds in the float graph: (the method taking that
# input, the weight it multiplies). An Embed's lookup multiplies nothing; its ``attend`` (a tied head) does.
PRODUCT_INPUTS = {nnx.Linear: ("__call__", "kernel"), nnx.Embed: ("attend", "embedding")}


def _product_kind(cls, name):
    return next((kind for kind, (_, weight) in PRODUCT_INPUTS.items() if issubclass(cls, kind) and name == weight),
                None)


@functools.cache
def _rounding_class(cls, kind):
    """``cls`` whose product method (``PRODUCT_INPUTS[kind]``) first rounds its input as llama.cpp rounds
    the input of the product (``product_input_spec``, a static attribute)."""
    method = PRODUCT_INPUTS[kind][0]
    original = getattr(cls, method)

    def rounded(self, inputs, *args, **kwargs):
        return original(self, round_product_input(inputs, self.product_input_spec), *args, **kwargs)

    return type(cls.__name__, (cls,), {method: rounded, "__module__": cls.__module__})


def run_wrapped_products(model, wrapped):
    """Give the modules of ``model`` (a float copy of the QAT-wrapped ``wrapped``, in the user's classes)
    the products the wrapped forward runs with the kernels ``wrapped`` quantizes, so the float graph
    computes what the wrapped forward does: a plain Linear contracts the group view off the CPU where
    ``contracts_group_view`` says (``group_view.give_group_view``), and with ``act_bits`` the input of the product is
    first rounded as llama.cpp rounds it (``round_product_input``).

    Raises:
        ValueError: a kernel with ``act_bits`` belongs to a module of no kind in ``PRODUCT_INPUTS``.

    >>> run_wrapped_products(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    """
    modules = {dotted_path(path): module for path, module in nnx.iter_modules(model)}
    for kernel in quantized_kernels(wrapped):
        module = modules[kernel.owner]
        give_group_view(module, kernel.name, kernel.spec)
        if kernel.spec.act_bits is None:
            continue
        kind = _product_kind(type(module), kernel.name)
        if kind is None:
            raise ValueError(f"module {kernel.owner!r} ({type(module).__name__}): act_bits rounds the product input "
                             f"of {[k.__name__ for k in PRODUCT_INPUTS]} layers here; evaluate the QAT-wrapped "
                             f"model itself instead")
        object.__setattr__(module, "__class__", _rounding_class(type(module), kind))
        module.product_input_spec = kernel.spec


def kernel_groups(model):
    """The groups of the kernels a QAT-wrapped Flax ``model`` fake-quantizes, or None when one of them
    cannot be grouped (per-tensor scales, Qwix's quantizers, kernels of more than two axes) or the
    model is not wrapped.

    >>> kernel_groups(nnx.Linear(2, 2, rngs=nnx.Rngs(0))) is None
    True
    """
    kernels = quantized_kernels(model)
    if not kernels:
        return None
    grouped, modules = {}, {dotted_path(path): module for path, module in nnx.iter_modules(model)}
    for kernel in kernels:
        value = kernel.param.get_raw_value()
        if not _groupable(kernel, value, modules[kernel.owner]):
            return None
        layout = tuple(int(a) for a in kernel.layout)
        weighted = kernel.importance is not None
        size = tuple(value.shape) if weighted else int(value.shape[layout[0]])
        entry = grouped.setdefault((kernel.spec, layout, size, str(value.dtype), weighted),
                                   {"paths": [], "sizes": [], "importance": []})
        entry["paths"].append(f"{kernel.owner}.{kernel.name}")
        entry["sizes"].append(int(value.shape[1 - layout[0]]))
        entry["importance"].append(kernel.importance)
    groups = []
    for (spec, layout, _, _, weighted), entry in grouped.items():
        importance = np.stack([np.asarray(v, np.float32) for v in entry["importance"]]) if weighted else None
        groups.append(KernelGroup(spec=spec, layout=layout, paths=tuple(entry["paths"]), sizes=tuple(entry["sizes"]),
                                  importance=importance))
    return tuple(groups)


# Weights searched at once by a stacked group's loop: the search's temporaries are about 28 bytes a
# weight (about 0.5 GB at this many).
_SEARCH_WEIGHTS = 2**24


def _search_batch(count, size):
    """How many of ``count`` kernels of ``size`` weights one step of the loop searches together: the
    most that divide ``count`` (no remainder compiled apart) within ``_SEARCH_WEIGHTS``. Each of the
    search's ordered sums is a loop over a block's elements, run once a batch instead of once a kernel.
    Measured, it saved nothing: SmolLM2's QAT step took 0.42 s on a TPU v5e either way, and on a CPU
    batches take the same time as single kernels (``benchmarks/search_speed.py`` times the search).

    >>> _search_batch(60, 576 * 1536), _search_batch(60, 64 * 64), _search_batch(7, 2**24)
    (15, 60, 1)
    """
    cap = max(1, _SEARCH_WEIGHTS // size)
    return max(d for d in range(1, count + 1) if count % d == 0 and d <= cap)


def _stacked(group, kernels, name):
    """The fake-quantized values of same-shape ``kernels`` (stacked on axis 0), each searched with its own
    row of ``group.importance``: one ``quantize_array`` call in a loop over batches of the kernels
    (compiled once; the search's temporaries are one batch's)."""
    order = (0, 2, 1) if group.layout == (0,) else (0, 1, 2)  # (kernels, out, in)
    rows = jnp.transpose(jax.lax.stop_gradient(kernels), order)

    def one(pair):
        return quantize_array(pair[0], group.spec, name=name, importance=pair[1]).dequantize()

    batch = _search_batch(kernels.shape[0], int(np.prod(kernels.shape[1:])))
    value = jax.lax.map(one, (rows, jnp.asarray(group.importance)), batch_size=batch if batch > 1 else None)
    return straight_through(kernels, jnp.transpose(value.astype(kernels.dtype), order))


def fake_quantize_groups(groups, state):
    """``state`` (an ``nnx.State`` holding every grouped kernel, and possibly other Params) with each
    grouped kernel replaced by its fake-quantized values (straight-through gradient), one quantizer
    call per group.

    >>> fake_quantize_groups((), nnx.State({}))
    State({})
    """
    flat = nnx.to_flat_state(state)
    values = {".".join(map(str, path)): variable.get_value() for path, variable in flat}
    quantized = {}
    for group in groups:
        name = f"{len(group.paths)} kernels ({group.paths[0]}, ...)"
        if group.importance is not None:
            out = _stacked(group, jnp.stack([values[path] for path in group.paths]), name)
            # split, not indexing: an index's gradient is a zero array of the whole stack's size
            quantized.update(zip(group.paths, (part[0] for part in jnp.split(out, len(group.paths)))))
            continue
        joined = jnp.concatenate([values[path] for path in group.paths], axis=group.axis)
        out = fake_quantize_weight(joined, group.layout, group.spec, name)
        ends = np.cumsum(group.sizes)[:-1].tolist()
        quantized.update(zip(group.paths, jnp.split(out, ends, axis=group.axis)))
    return nnx.from_flat_state([(path, variable.replace(quantized.get(".".join(map(str, path)),
                                                                       variable.get_value())))
                                for path, variable in flat])


@functools.partial(jax.jit, static_argnums=0)
def quantized_state(groups, state):
    """``fake_quantize_groups(groups, state)``, compiled (once per groups and state shapes).

    >>> quantized_state((), nnx.State({}))
    State({})
    """
    return fake_quantize_groups(groups, state)


def float_graphdef(model, *filters):
    """The graphdef of ``nnx.split(model, *filters)`` for the model's float classes (a copy put back
    in the user's classes): the forward with nothing intercepted, over the same state.

    >>> float_graphdef(nnx.Linear(2, 2, rngs=nnx.Rngs(0))) == nnx.graphdef(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    True
    """
    graphdef, state = nnx.split(model)
    # a copy of shapes only: the graph without a second copy of the weights
    copy = nnx.merge(graphdef, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))
    if qat_state(model) is not None:
        restore_float_classes(copy, qat_state(model))
        run_wrapped_products(copy, model)
    return nnx.split(copy, *filters)[0]
