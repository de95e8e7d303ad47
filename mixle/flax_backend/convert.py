"""convert() for Flax: stored integer codes + scales from a QAT model, with mixle's own numerics.

Representation. A converted kernel is a ``QuantizedValue``: a jax pytree whose leaves are the
stored ``codes`` (``jnp.int4``, which XLA packs two per byte, or int8) and ``scale``, and whose
static part is the spec, the kernel's own shape and the axis order to mixle's ``(out, in)``
matrix (``fake_quant.weight_layout``). The codes are that ``(out, in)`` matrix, with ``(1, S,
1)`` scales (``mixle.core.numerics.block_shape``), except group-wise ones, which keep the
kernel's own layout in the view of its groups (``stored_view``); either way a TPU reads 4 bits a
weight and dequantizes inside the product. Reading it
(``value[...]``, ``jnp.asarray(value)``) dequantizes: ``codes * scale`` in the kernel's layout.
Files hold the matrix (``codes_matrix``, ``scale_matrix``; int4 packed in pairs by
``mixle.core.packing``).

* NNX: ``convert(model)`` returns a copy of the model, back in the user's own class, in which
  each quantized kernel Param became a ``QuantizedKernel`` (an ``nnx.Variable`` subclass, not a
  ``Param``: optimizers and ``nnx.state(model, nnx.Param)`` leave it alone) holding a
  ``QuantizedValue``. Layers read ``self.kernel[...]`` as before and get the dequantized
  kernel, so every layer type (Linear, Einsum, LinearGeneral, Conv, Embed lookups and
  ``attend``) runs its own unchanged code; ``nnx.split``/``merge``/``jit`` carry codes and
  scales as state.
* Linen: ``convert_linen(module, variables)`` returns ``(module, variables)`` whose quantized
  kernels are ``QuantizedValue`` leaves; the module is a subclass of the user's class whose
  ``apply`` dequantizes those leaves and runs the user's code, so ``module.apply(variables,
  x)`` (also under ``jax.jit``) computes from the stored codes.

The QAT forward fake-quantizes each kernel with ``fake_quantize_weight`` (the same transpose,
``quantize_linear_weight`` codes times scale, and transpose back) before the same matmul, so
the converted forward equals the QAT forward bit for bit where both run the same XLA program
(eagerly, or both under ``jit``); between an eager and a jitted run only XLA's own float
reassociation differs.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx
from flax.typing import MISSING

from mixle.core.array_ops import is_tracer
from mixle.core.layer_weights import quantize_linear_weight
from mixle.core.numerics import QuantizedArray, dequantize_array, quantize_array
from mixle.core.packing import pack_int4, packed_int4_nbytes
from mixle.flax_backend.fake_quant import as_matrix, from_matrix, kept_on_cpu, kernel_blocks, weight_layout
from mixle.flax_backend import int_matmul
from mixle.flax_backend.group_view import give_group_view, groups_in_view, linear_with_product, plain_linear
from mixle.flax_backend.provider import QUANTIZED, uses_mixle_numerics

__all__ = ["QuantizedValue", "QuantizedKernel", "quantize_kernel", "convert", "convert_linen", "stored_view",
           "dequantize_variables", "run_stored_products"]


def stored_view(shape, perm, out_count, spec):
    """``(view shape, axis)`` a converted kernel's codes and scales are stored in, or None.

    Group-wise codes (``group_size``, where the kernel's input axes are adjacent and the grid
    dequantizes as ``codes * scale``) keep the kernel's own layout in its group view
    (``kernel_blocks``: ``(in / group_size, group_size, out)`` for a Linear), the scales
    broadcasting along the groups: dequantizing is the fake quantizer's last multiply and a
    reshape, which XLA fuses into the product. In the ``(out, in)`` matrix the groups would lie
    along a TPU's 128-lane axis, each scale broadcast across it. Otherwise (None) the codes are
    the ``(out, in)`` matrix and the scales ``(1, S, 1)``: per channel, whose contracting axis
    is then the minor one, XLA's TPU cost model charges the 470M model's 16-token forward 1.64 GiB
    for int4 codes this way, 2.01 GiB in the kernel's layout.

    >>> from mixle.core.spec import QuantSpec
    >>> stored_view((512, 2048), (1, 0), 1, QuantSpec(bits=4, group_size=32))
    ((16, 32, 2048), 1)
    """
    if not groups_in_view(spec):
        return None
    return kernel_blocks(shape, perm[out_count:], spec)


def _scale_to_view(scale, view):
    """The ``(1, S, 1)`` scales of the ``(out, in)`` matrix in a group view (length 1 along its
    axis): S runs ``(out, group)``, the view ``(before, group, 1, after)``."""
    view_shape, axis = view
    before, groups = math.prod(view_shape[: axis - 1]), view_shape[axis - 1]
    scale = scale.reshape(before, -1, groups).transpose(0, 2, 1)
    return scale.reshape(view_shape[:axis] + (1,) + view_shape[axis + 1 :])


def _scale_to_matrix(scale, view):
    """Inverse of ``_scale_to_view``."""
    view_shape, axis = view
    before, groups = math.prod(view_shape[: axis - 1]), view_shape[axis - 1]
    return scale.reshape(before, groups, -1).transpose(0, 2, 1).reshape(1, -1, 1)


@jax.tree_util.register_pytree_node_class
class QuantizedValue:
    """A kernel stored as integer codes and scales (see the module docstring).

    Build one with ``QuantizedValue.of_matrix`` (or ``quantize_kernel``); the constructor takes
    the stored arrays as they are.

    Args:
        codes: the codes in ``stored_view``'s view (or the ``(out, in)`` matrix): ``jnp.int4``
            for signed 4-bit grids (XLA packs two per byte), else int8.
        scale: ``(1, S, 1)`` float scales, or broadcasting over the view's group axis.
        spec: the QuantSpec the codes were made with.
        shape: the kernel's own shape.
        perm: the axis order laying the kernel out as ``out + in`` (``weight_layout``).
        out_count: how many of the permuted axes are outputs.
        parts: a grid's offsets and sub-block scales (``QuantizedArray``'s), matrix layout only.
    """

    def __init__(self, codes, scale, spec, shape, perm, out_count, parts=None):
        self.codes, self.scale = codes, scale
        self.spec, self.shape, self.perm, self.out_count = spec, tuple(shape), tuple(perm), int(out_count)
        self.parts = dict(parts or {})

    @classmethod
    def of_matrix(cls, codes, scale, spec, shape, perm, out_count, parts=None):
        """The stored value of int8 codes ``(out, in)`` and ``(1, S, 1)`` scales (numpy or jax).

        >>> from mixle.core.spec import QuantSpec
        >>> v = QuantizedValue.of_matrix(np.array([[7, -8]], np.int8), np.ones((1, 1, 1), np.float32),
        ...                              QuantSpec(bits=4), (2, 1), (1, 0), 1)
        >>> v.codes.dtype.name, v.codes.shape, v.codes_matrix().tolist()
        ('int4', (1, 2), [[7, -8]])
        """
        parts = {name: jnp.asarray(part) for name, part in (parts or {}).items()}
        value = cls(codes, scale, spec, shape, perm, out_count, parts)  # its layout (view) follows from these
        if not (is_tracer(codes) or is_tracer(scale)):  # numpy's own reshapes: no XLA compile per shape
            codes, scale = np.asarray(codes), np.asarray(scale)
        if value.view is not None:
            codes = from_matrix(codes, value.shape, value.perm).reshape(value.view[0])
            scale = _scale_to_view(scale, value.view)
        if spec.bits == 4 and spec.code_min < 0:
            codes = codes.astype(jnp.int4)
        value.codes, value.scale = jnp.asarray(codes), jnp.asarray(scale)
        return value

    def tree_flatten(self):
        names = tuple(sorted(self.parts))
        return (self.codes, self.scale, *(self.parts[n] for n in names)), (self.spec, self.shape, self.perm,
                                                                            self.out_count, names)

    @classmethod
    def tree_unflatten(cls, aux, children):
        *static, names = aux
        return cls(children[0], children[1], *static, dict(zip(names, children[2:])))

    @property
    def view(self):
        """``stored_view``'s ``(view shape, axis)`` the codes are stored in, or None: the matrix."""
        return None if self.parts else stored_view(self.shape, self.perm, self.out_count, self.spec)

    @property
    def matrix_shape(self):
        """``(out, in)``: the kernel as the 2-D weight mixle's numerics and files use."""
        transposed = [self.shape[a] for a in self.perm]
        return math.prod(transposed[: self.out_count]), math.prod(transposed[self.out_count :])

    @property
    def dtype(self):
        return self.scale.dtype

    @property
    def ndim(self):
        return len(self.shape)

    def codes_matrix(self):
        """The int8 codes as the ``(out, in)`` matrix."""
        if self.view is None:
            return self.codes.astype(np.int8)
        return as_matrix(self.codes.reshape(self.shape), self.perm, self.out_count).astype(np.int8)

    def kernel_codes(self):
        """``(codes, scale)`` in a 2-D kernel's ``(in, out)`` layout (``int_matmul.weight_codes``'),
        the group view kept: what ``int_matmul.integer_product`` multiplies."""
        if self.view is not None:
            return self.codes, self.scale
        return from_matrix(self.codes, self.shape, self.perm), self.scale.reshape(1, -1)

    def scale_matrix(self):
        """The scales as files and ``QuantizedArray`` hold them: ``(1, S, 1)``."""
        return self.scale if self.view is None else _scale_to_matrix(self.scale, self.view)

    def on_host(self):
        """A copy whose arrays are numpy's (its matrices are then numpy's too)."""
        return jax.tree.map(np.asarray, self)

    def file_codes(self):
        """The codes as files store them (numpy): int4 packed in pairs (``pack_int4``), or int8."""
        codes = self.on_host().codes_matrix()
        return pack_int4(codes) if self.spec.bits == 4 else codes

    def quantized_array(self):
        """The ``QuantizedArray`` of the ``(out, in)`` matrix."""
        return QuantizedArray(self.codes_matrix(), self.scale_matrix(), self.spec, 0, 1, **self.parts)

    def dequantize(self):
        """The float kernel, ``codes * scale`` in its own layout (``dequantize_array``); eagerly
        (no leaf traced) by numpy's own operations, the values the traced program computes."""
        if not any(is_tracer(leaf) for leaf in jax.tree.leaves(self)):
            return jnp.asarray(from_matrix(dequantize_array(self.on_host().quantized_array()), self.shape, self.perm))
        if self.view is None:  # a CPU keeps the (out, in) values and its product reads them transposed:
            # 2048 x 8192 int8 kernel, 16 tokens, 2 cores: 55 ms instead of 95 with the transposed copy kept
            return from_matrix(kept_on_cpu(dequantize_array(self.quantized_array())), self.shape, self.perm)
        return kept_on_cpu((self.codes.astype(self.scale.dtype) * self.scale).reshape(self.shape))

    def __jax_array__(self):
        return self.dequantize()

    def __getitem__(self, index):
        return self.dequantize()[index]

    def __repr__(self):
        layout = "int4" if self.codes.dtype == jnp.int4 else "int8"
        return f"QuantizedValue(shape={self.shape}, {self.spec.short()}, {layout} codes)"


class QuantizedKernel(nnx.Variable):
    """An NNX variable holding a ``QuantizedValue``; reading it gives the dequantized kernel.

    Read-only: assigning to it raises (re-quantize the float model instead).
    """

    def get_value(self, *, index=MISSING):
        value = self.get_raw_value().dequantize()
        return value if index is MISSING or index is Ellipsis else value[index]

    def set_value(self, value, *, index=MISSING):
        raise TypeError("a QuantizedKernel holds stored integer codes and is read-only: change the float model "
                        "and convert it again")


def quantize_kernel(kernel, input_axes, spec, importance=None):
    """A ``QuantizedValue`` of ``kernel`` contracted over ``input_axes``, with mixle's numerics.

    >>> from mixle.core.spec import QuantSpec
    >>> q = quantize_kernel(jnp.array([[0.7, 0.1], [0.04, 0.2]]), (0,), QuantSpec(bits=4))
    >>> q.codes_matrix().tolist(), q[...].tolist()[1]
    ([[7, 0], [4, 7]], [0.0, 0.20000000298023224])
    """
    perm, out_count = weight_layout(kernel.ndim, input_axes)
    if is_tracer(kernel):  # under jit: jax's ops
        q = quantize_linear_weight(as_matrix(kernel, perm, out_count), spec)
    else:  # numpy's own operations on the concrete kernel, as its values are defined: no XLA compile
        q = quantize_array(as_matrix(np.asarray(kernel), perm, out_count), spec, importance=importance)
    parts = {n: v for n, v in q.parts().items() if n not in ("codes", "scale")}
    return QuantizedValue.of_matrix(q.codes, q.scale, spec, kernel.shape, perm, out_count, parts)


# ------------------------------------------------------------------------------------------------
# What apply_qat quantized


def _quantized_kernels(state, what):
    """``[(owner path, param name, spec, input axes)]`` of every kernel the QAT model quantizes."""
    kernels = []
    for decision in state.report.decisions:
        if decision.action == "skipped":
            continue
        owner, _, name = decision.path.rpartition(".")
        spec = state.specs[owner]
        record = state.provider.records.get((owner, name), (None,))[0]
        if record != QUANTIZED:
            continue
        if not (uses_mixle_numerics(spec) or int_matmul.spec_applies(spec)):
            raise ValueError(
                f"{what}: kernel {decision.path!r} trains as {spec.short()}, whose forward is Qwix's own "
                f"quantizer ({_qwix_fields(spec)}), which stored mixle codes and scales do not reproduce: "
                f"convert supports integer weights with mixle's grids (channel, group, tensor, "
                f"clip_percentile); apply_qat without those options for the layers you export"
            )
        if spec.act_bits is not None and not int_matmul.spec_applies(spec):
            raise ValueError(
                f"{what}: kernel {decision.path!r} trains as {spec.short()} with act_bits={spec.act_bits}, the "
                f"rounding of its input llama.cpp applies, which convert's layers (a float input times the "
                f"stored weight) do not: write the model with save_gguf, whose llama.cpp applies it, or "
                f"apply_qat without act_bits for the layers you convert")
        layout = state.provider.layouts.get((owner, name))
        if layout is None:
            raise ValueError(f"{what}: kernel {decision.path!r} was reported quantized but its input axes were "
                             f"not recorded; call apply_qat again with example_inputs")
        kernels.append((owner, name, spec, layout))
    return kernels


def _qwix_fields(spec):
    fields = {"act_bits": spec.act_bits, "bwd_bits": spec.bwd_bits, "calibration": spec.calibration,
              "weight_format": None if spec.weight_format == "int" else spec.weight_format}
    return ", ".join(f"{k}={v!r}" for k, v in fields.items() if v is not None)


def _qat_state(model, what):
    from mixle.flax_backend.qat import qat_state

    state = qat_state(model)
    if state is None:
        raise ValueError(
            f"{what} found no QAT set up on this {type(model).__name__}: prepare it with "
            f"apply_qat(model, example_inputs=...) and train, or quantize a float model with "
            f"quantize_model(model, ..., example_inputs=...)"
        )
    return state


# ------------------------------------------------------------------------------------------------
# NNX


def convert(model):
    """Real int codes from a Flax NNX QAT model (a converted copy; ``model`` is untouched).

    Every kernel ``apply_qat`` quantizes becomes a ``QuantizedKernel`` (codes + scales, see the
    module docstring); the copy runs the user's own class and its forward equals the QAT
    forward. A tied ``Embed`` (used by ``attend``) stores its table once; its lookups read the
    same codes. Layers convert with their spec whether or not fake quant is enabled. An
    ``nnx.Linear`` trained with ``act_bits`` on integer operands (``int_matmul``) keeps them: its
    product multiplies the input's per-token codes by the stored codes (``run_stored_products``).

    Linen modules keep their parameters outside: use ``convert_linen(module, variables)``.

    Raises:
        ValueError: the model has no QAT set up, or a kernel trains with a Qwix-only option
            (fp8, ``calibration``, ``act_bits`` off mixle's integer products), naming it.

    >>> from mixle.api import apply_qat
    >>> model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    >>> _ = apply_qat(model, bits=4, example_inputs=(jnp.ones((2, 8)),))
    >>> type(convert(model).kernel).__name__, type(convert(model)).__name__
    ('QuantizedKernel', 'Linear')
    """
    if isinstance(model, nn.Module):
        raise TypeError("convert(model) takes an NNX model; a Linen module keeps its parameters outside: "
                        "use mixle.flax_backend.convert.convert_linen(module, variables)")
    if not isinstance(model, nnx.Module):
        raise TypeError(f"convert takes a flax.nnx.Module, got {type(model).__name__}")
    from mixle.flax_backend.qat import restore_float_classes

    state = _qat_state(model, "convert")
    kernels = _quantized_kernels(state, "convert")
    _refuse_lora(model)
    new = nnx.clone(model)
    restore_float_classes(new, state)
    modules = {".".join(str(p) for p in path): module for path, module in nnx.iter_modules(new)}
    for owner, name, spec, layout in kernels:
        module = modules[owner]
        run_stored_products(module, owner, name, spec)
        variable = vars(module)[name]
        value = quantize_kernel(variable.get_raw_value(), layout, spec, state.provider.importance.get(owner))
        setattr(module, name, QuantizedKernel(value))
    return new


def run_stored_products(module, path, name, spec):
    """Give a module holding a stored kernel the product its ``spec`` trained with: with ``act_bits``
    on integer operands (``int_matmul.spec_applies``), an ``nnx.Linear`` multiplies its input's codes
    by the stored codes, as the QAT forward did (its class becomes a ``linear_with_product`` subclass
    running ``_integer_dot``); a plain ``nnx.Linear`` whose groups the QAT forward contracts in their view does too
    (``group_view.give_group_view``); otherwise nothing changes (the layer reads the dequantized kernel).

    Raises:
        ValueError: ``act_bits`` on a layer other than a plain ``nnx.Linear``, or with activations a
            converted Flax layer does not quantize (llama.cpp's grids, asymmetric), naming the kernel.

    >>> from mixle.core.spec import QuantSpec
    >>> layer = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    >>> run_stored_products(layer, "fc", "kernel", QuantSpec(bits=8, act_bits=8))
    >>> type(layer).dot_general.__class__.__name__
    'property'
    """
    if spec.act_bits is None:
        give_group_view(module, name, spec)
        return
    label, cls = f"{path}.{name}".lstrip("."), type(module)
    if not int_matmul.spec_applies(spec):
        raise ValueError(
            f"kernel {label!r} is stored as {spec.short()} with act_bits={spec.act_bits}, whose activation "
            f"rounding a converted Flax layer does not apply (it runs integer products only for act_bits on "
            f"mixle's symmetric integer grids): run this file with torch's load_quantized or llama.cpp")
    if not plain_linear(module, name):
        raise ValueError(
            f"kernel {label!r} is {spec.short()} with act_bits={spec.act_bits}: integer operands, which a "
            f"converted model runs only in an nnx.Linear with its own __call__ and dot_general (this is a "
            f"{cls.__name__}): apply_qat without act_bits for this layer to convert it")
    object.__setattr__(module, "__class__", _integer_product_class(cls))


def _integer_dot(self):
    """The product of a converted Linear trained on integer operands: ``int_matmul.integer_product``
    of its input and its kernel's stored codes and scales, what the QAT forward's integer product
    computes from the master kernel's codes (the same codes). Linear passes the dequantized kernel
    too, unused."""
    value = self.kernel.get_raw_value()

    def dot(inputs, kernel, dimension_numbers, **_):
        codes, scale = value.kernel_codes()
        return int_matmul.integer_product(inputs, codes, scale, value.spec).astype(inputs.dtype)

    return dot


_integer_product_class = functools.cache(lambda cls: linear_with_product(cls, _integer_dot))


def _refuse_lora(model):
    """As torch's convert: a mixle LoRA layer computes more than its quantized kernel."""
    from mixle.flax_backend.lora import LoRALinear
    from mixle.flax_backend.qat import float_class_of

    for path, module in nnx.iter_modules(model):
        if float_class_of(module) is LoRALinear:
            raise ValueError(
                f"layer {'.'.join(map(str, path))!r} has a LoRA adapter: convert stores only the quantized kernel, "
                f"so fold the adapter in first with merge_lora(model), then convert")


# ------------------------------------------------------------------------------------------------
# Linen


def convert_linen(module, variables):
    """The Linen form of ``convert``: ``(float module, variables with quantized kernels)``.

    Args:
        module: the module ``apply_qat`` returned.
        variables: its variables, ``{"params": ...}`` (plus other collections), as trained.

    Returns:
        ``(module, variables)``: the user's module (its ``apply`` dequantizes, see the module
        docstring) and a copy of ``variables`` whose quantized kernels are ``QuantizedValue``
        leaves; ``module.apply(variables, x)`` equals the QAT forward.

    >>> from mixle.api import apply_qat
    >>> dense, x = nn.Dense(4), jnp.ones((2, 8))
    >>> variables = dense.init(jax.random.key(0), x)
    >>> plain, quantized = convert_linen(apply_qat(dense, bits=8, example_inputs=(x,)), variables)
    >>> type(quantized["params"]["kernel"]).__name__, plain.apply(quantized, x).shape
    ('QuantizedValue', (2, 4))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_linen takes a flax.linen.Module, got {type(module).__name__}")
    if not isinstance(variables, dict) or "params" not in variables:
        raise TypeError(f"convert_linen takes the module's variables {{'params': ...}}, got {type(variables).__name__}"
                        f"{'' if not isinstance(variables, dict) else ' without a params collection'}")
    state = _qat_state(module, "convert_linen")
    kernels = _quantized_kernels(state, "convert_linen")
    for owner, name, spec, _ in kernels:
        if int_matmul.spec_applies(spec):
            raise ValueError(
                f"convert_linen: kernel {f'{owner}.{name}'.lstrip('.')!r} trains with act_bits={spec.act_bits} "
                f"on integer operands, which a Linen module converted here (a float product of the dequantized "
                f"kernel) does not run: convert the NNX form of the model (convert runs nnx.Linear's integer "
                f"product), or apply_qat without act_bits for this layer")
    float_module = module.copy()
    object.__setattr__(float_module, "__class__", _dequantizing_class(state.float_class))
    params = jax.tree.map(lambda x: x, dict(variables["params"]))  # a fresh tree; leaves are immutable
    params = _thaw(params)
    for owner, name, spec, layout in kernels:
        node = params
        for part in [p for p in owner.split(".") if p]:
            node = node[part]
        node[name] = quantize_kernel(node[name], layout, spec)
    return float_module, {**variables, "params": params}


def dequantize_variables(variables):
    """``variables`` with every ``QuantizedValue`` leaf replaced by its dequantized kernel."""
    return jax.tree.map(lambda v: v.dequantize() if isinstance(v, QuantizedValue) else v, variables,
                        is_leaf=lambda v: isinstance(v, QuantizedValue))


_DEQUANTIZING = {}


def _dequantizing_class(float_class):
    """A subclass of the user's Linen class whose ``apply`` dequantizes ``QuantizedValue`` leaves
    first (Linen checks each stored param's shape against its initializer, so the layers cannot
    read the codes+scales pytree itself); under ``jit`` the codes are the inputs."""
    if float_class not in _DEQUANTIZING:
        def apply(self, variables, *args, **kwargs):
            return float_class.apply(self, dequantize_variables(variables), *args, **kwargs)

        cls = type(float_class.__name__, (float_class,), {"apply": apply})
        cls.__module__, cls.__qualname__ = float_class.__module__, float_class.__qualname__
        _DEQUANTIZING[float_class] = cls
    return _DEQUANTIZING[float_class]


def _thaw(tree):
    return {k: _thaw(v) for k, v in tree.items()} if isinstance(tree, dict) or hasattr(tree, "items") else tree


# ------------------------------------------------------------------------------------------------
# Byte counts


@dataclasses.dataclass
class _Counter:
    counts: dict = dataclasses.field(default_factory=lambda: {k: 0 for k in (
        "float_bytes", "int8_code_bytes", "int4_code_bytes", "scale_bytes", "other_bytes")})

    def add(self, value):
        if isinstance(value, QuantizedValue):
            if value.spec.bits == 4:  # as files store them: ceil(out * in / 2) bytes
                self.counts["int4_code_bytes"] += packed_int4_nbytes(math.prod(value.matrix_shape))
            else:
                self.counts["int8_code_bytes"] += value.codes.nbytes
            self.counts["scale_bytes"] += value.scale.nbytes
        elif isinstance(value, (jax.Array, np.ndarray)) and not jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            kind = "float_bytes" if jnp.issubdtype(value.dtype, jnp.floating) else "other_bytes"
            self.counts[kind] += value.size * value.dtype.itemsize


def model_nbytes(model, variables=None):
    """Real storage bytes of a Flax model by kind (float, int8 codes, packed int4 codes, scales).

    NNX: the model's variables (RNG state excluded), each shared variable counted once. Linen:
    pass the variables (``model_nbytes(module, variables)``). Float and QAT models count as float.

    >>> model = nnx.Linear(64, 32, use_bias=False, rngs=nnx.Rngs(0))
    >>> from mixle.api import apply_qat
    >>> nb = model_nbytes(convert(apply_qat(model, bits=4, example_inputs=(jnp.ones((1, 64)),))))
    >>> nb.int4_code_bytes, nb.scale_bytes, nb.total  # 64*32/2 code bytes, 32 fp32 scales
    (1024, 128, 1152)
    """
    from mixle.core.fileformat import ModelBytes

    counter = _Counter()
    if isinstance(model, nnx.Module):
        if variables is not None:
            raise TypeError("model_nbytes(nnx_model) counts the model's own variables: pass no variables")
        seen = set()
        for _, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Variable) and not isinstance(node, nnx.RngState) and id(node) not in seen:
                seen.add(id(node))
                counter.add(node.get_raw_value())
    elif isinstance(model, nn.Module):
        if variables is None:
            raise TypeError("a Linen module keeps its parameters outside: model_nbytes(module, variables)")
        for leaf in jax.tree.leaves(variables, is_leaf=lambda x: isinstance(x, QuantizedValue)):
            counter.add(leaf)
    else:
        raise TypeError(f"model_nbytes takes a Flax module, got {type(model).__name__}")
    return ModelBytes(**counter.counts)


def quantize_model(model, spec=None, *, patterns=(".*",), exclude=(), opt_in=(), example_inputs=None,
                   **spec_fields):
    """Post-training quantization of a float NNX model: ``convert(apply_qat(clone, ...))``.

    The same layer selection, tie handling and grid as QAT (see ``mixle.api.apply_qat``);
    ``example_inputs`` (one call's positional inputs) are needed to trace which kernels each
    layer multiplies by. ``model`` is untouched.

    >>> net = quantize_model(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), bits=8, example_inputs=(jnp.ones((1, 8)),))
    >>> net.kernel.get_raw_value().codes.dtype
    dtype('int8')
    """
    from mixle.core.spec import resolve_spec
    from mixle.core.selection import LayerSelector
    from mixle.flax_backend import qat

    spec = resolve_spec(spec, spec_fields)
    if isinstance(model, nn.Module):
        raise TypeError("quantize_model takes an NNX model; for Linen use convert_linen(apply_qat(module, ..., "
                        "example_inputs=...), variables)")
    if not isinstance(model, nnx.Module):
        raise TypeError(f"quantize_model takes a flax.nnx.Module, got {type(model).__name__}")
    if qat.qat_state(model) is not None:
        raise ValueError("quantize_model got a QAT model: use convert(model) to keep its trained spec")
    if example_inputs is None:
        raise TypeError("quantize_model on a Flax model needs example_inputs=(x,), the inputs of one call, to find "
                        "the kernels each layer multiplies by")
    selector = LayerSelector(patterns=patterns, exclude=exclude, default_spec=spec, opt_in=opt_in)
    prepared = qat.apply(nnx.clone(model), selector, False, example_inputs)
    return convert(prepared)
