"""Fused mixture-of-experts modules of transformers: QAT and converted layers for their weights.

transformers 5 keeps a layer's experts as one module holding 3-D Parameters, e.g.
``Qwen3MoeExperts.gate_up_proj`` ``(experts, 2 * intermediate, hidden)`` and ``down_proj``
``(experts, hidden, intermediate)``, read by its forward (an eager loop, batched or grouped
matmuls: ``use_experts_implementation``); its router holds one ``(experts, hidden)`` weight.
Which classes these are is data (``EXPERTS``, ``ROUTERS``); mixle never imports transformers to
recognise them: a model holding one has imported its module already.

The QAT layer is the module's own class with a mixin in front (built on first use, as
``hf_layers``' Conv1D), sharing its Parameters under their names. Its forward is the class's own
forward, unchanged, reading the fake-quantized weights under those names: each weight attribute
is a property that, inside the forward, returns the weight the forward is run with. Every expert
matrix is fake-quantized on its own along its output rows: the codes of that expert's matrix
quantized as a Linear (``quantize_linear_weight(w, spec, batch_axis_count=1)``).

The per-version cache and the STE are ``fake_quant.fake_quantized_weight``'s, on the 3-D
Parameter itself: a per-channel spec is given as its equal on this layout, groups of a whole
input row (consecutive elements), which are exactly one expert's rows. Per-tensor scales (one
per expert) are refused: mixle's files store 2-D ``(rows, cols)`` arrays, and an expert weight is
stored as its ``(experts * out, in)`` rows. The fake-quantized weights are saved for the backward
by transformers' products (as by ``F.linear``), not rebuilt there as ``fake_quant.linear`` does: a
second fake-quant per weight and step costs more than the memory's first touch it would spare
(the freed buffers are reused by the allocator; ``benchmarks/moe_overhead.py`` counts the faults).

``act_bits`` (experts and routers): the input of each product fake-quantized per token as the
Linear layers do (``activations``; on q4_0 / q8_0 llama.cpp's Q8_0 blocks, what its CPU path
makes of the input of every expert's product): the hidden states the module is called with, and
the gated ``act_fn(gate) * up`` that ``down_proj`` multiplies, reached through transformers'
``_apply_gate`` (its grouped_mm and batched_mm forwards); its eager loop computes that product
inline, so act_bits there is refused with the reason.
"""

import dataclasses
import importlib
import math
import sys

import torch
from torch import nn

from mixle.core.layer_weights import quantize_linear_weight
from mixle.core.numerics import QuantizedArray, block_shape
from mixle.torch_backend.layers.activations import fake_quant_activations
from mixle.torch_backend.fake_quant import fake_quantized_weight, numerics_input
from mixle.torch_backend.layers.qat import QATLayerMixin, check_supported, named_error
from mixle.torch_backend.layers.quantized import GRID_PARTS, QuantizedWeight

__all__ = ["EXPERTS", "ROUTERS", "FusedClass", "ExpertsType", "RouterType", "QATExperts", "QATRouter",
           "QuantizedExperts", "QuantizedRouter", "QuantizedFusedWeight", "forward_weights", "stored_arrays",
           "is_fused", "fused_weight_names", "LORA_REASON", "wrap_fused", "check_fused_spec", "quantize_experts",
           "assemble_fused", "loaded_fused"]


@dataclasses.dataclass(frozen=True)
class FusedClass:
    """One transformers class whose forward reads fused weights.

    Attributes:
        module: the transformers module defining it (looked up in ``sys.modules``, never imported).
        name: the class name.
        weights: the attributes holding its quantizable weights, each ``batch + (out, in)``.
    """

    module: str
    name: str
    weights: tuple

    def real(self):
        """The class, if its module is loaded, else None."""
        return getattr(sys.modules.get(self.module), self.name, None)


EXPERTS = (
    FusedClass("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeExperts", ("gate_up_proj", "down_proj")),
    FusedClass("transformers.models.mixtral.modeling_mixtral", "MixtralExperts", ("gate_up_proj", "down_proj")),
)
ROUTERS = (
    FusedClass("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter", ("weight",)),
    FusedClass("transformers.models.mixtral.modeling_mixtral", "MixtralTopKRouter", ("weight",)),
)
LORA_REASON = ("fused experts: transformers' expert forward reads their 3-D weights directly (no nn.Linear to "
               "adapt) and mixle has no per-expert adapter, so they stay frozen without adapter")


def _entry(module, table):
    """``(FusedClass, real class)`` of the first table class ``module`` is an instance of, or None."""
    for entry in table:
        real = entry.real()
        if real is not None and isinstance(module, real):
            return entry, real
    return None


class _FusedType(type):
    """``isinstance(m, ExpertsType)``: m is a float module of a class of the table, without importing it."""

    def __instancecheck__(cls, instance):
        return _entry(instance, cls.TABLE) is not None and not isinstance(instance, (_QATFused, _QuantizedFused))

    def base_of(cls, module):
        """The table class ``module`` (float, QAT or quantized) is an instance of, or None."""
        found = _entry(module, cls.TABLE)
        return None if found is None else found[1]


class ExpertsType(metaclass=_FusedType):
    """Stands for the fused experts classes of ``EXPERTS`` in a layer kind's ``float_types``.

    >>> isinstance(nn.Linear(2, 2), ExpertsType)
    False
    """

    TABLE = EXPERTS
    BATCH_AXES = 1


class RouterType(metaclass=_FusedType):
    """Stands for the router classes of ``ROUTERS`` (one ``(experts, hidden)`` weight).

    >>> isinstance(nn.Linear(2, 2), RouterType)
    False
    """

    TABLE = ROUTERS
    BATCH_AXES = 0


def is_fused(module):
    """Whether ``module`` is a fused experts or router module (float, QAT or converted).

    >>> is_fused(nn.Linear(2, 2))
    False
    """
    return _entry(module, EXPERTS + ROUTERS) is not None


def fused_weight_names(module):
    """The weight attributes of a fused module (float, QAT or quantized), in the table's order.

    >>> fused_weight_names(nn.Linear(2, 2))
    ()
    """
    found = _entry(module, EXPERTS + ROUTERS)
    return () if found is None else found[0].weights


def _row_spec(spec, cols):
    """``spec`` on a ``batch + (out, in)`` weight seen with no batch axis: a per-channel scale is a
    group of ``cols`` consecutive elements, one expert's row (groups and grid blocks already are)."""
    if spec.granularity == "channel":
        return dataclasses.replace(spec, granularity="group", group_size=cols)
    return spec


def _live_property(name):
    """The weight attribute ``name``: inside a mixle forward the weight it runs with, else the
    Parameter (QAT) or the stored weight module (converted)."""

    def get(self):
        live = self.__dict__.get("_mixle_live")
        if live is not None:
            return live[name]
        found = self._parameters.get(name)
        return found if found is not None else self._modules[name]

    return property(get, doc=f"``{name}``: the weight the forward reads (fake-quantized while enabled)")


def _share_state(dst, src, skip=()):
    """``dst`` takes ``src``'s attributes (config, flags, hooks, mixle marks) and its Parameters and
    children (the same objects, in dicts of its own), except the Parameters named in ``skip``."""
    for key, value in vars(src).items():
        if key == "_mixle_specs":
            continue
        if key in ("_parameters", "_buffers", "_modules"):
            value = {k: v for k, v in value.items() if k not in skip}
        dst.__dict__[key] = value
    dst.__dict__["_mixle_live"] = None


class _FusedForward:
    """Runs the base class's (transformers') forward with given weights read under the weight names
    and, with ``spec.act_bits``, the input of each product fake-quantized per token
    (``activations``, llama.cpp's Q8_0 blocks on its grids): the hidden states the forward is
    called with (every expert's first product and the router read them, each token as it is) and,
    for experts, the gated activations (``_apply_gate``'s output, the input of ``down_proj``)."""

    BATCH_AXES = 0

    @property
    def weight_names(self):
        """The attributes of the weights this layer quantizes."""
        return fused_weight_names(self)

    def _run(self, weights, args, kwargs):
        act = self.spec if self.spec.act_bits is not None else None
        if act is not None:
            _check_act_route(self, act)
            if args:
                args = (fake_quant_activations(args[0], act),) + tuple(args[1:])
            else:
                kwargs = {**kwargs, "hidden_states": fake_quant_activations(kwargs["hidden_states"], act)}
        self.__dict__["_mixle_live"], self.__dict__["_mixle_act"] = weights, act
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.__dict__["_mixle_live"] = self.__dict__["_mixle_act"] = None

    def _apply_gate(self, gate_up_out):
        out = super()._apply_gate(gate_up_out)
        act = self.__dict__.get("_mixle_act")
        return out if act is None else fake_quant_activations(out, act)


# transformers' expert forwards that gate through ``_apply_gate`` (its output is down_proj's input);
# the eager loop computes ``act_fn(gate) * up`` inline, where nothing can quantize it.
ACT_ROUTES = ("grouped_mm", "batched_mm")


def _check_act_route(module, spec):
    """Refuse ``spec.act_bits`` on an experts forward whose down_proj input mixle cannot reach."""
    if spec.act_bits is None or ExpertsType.base_of(module) is None:
        return
    route = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if route not in ACT_ROUTES or not getattr(module, "has_gate", False):
        raise ValueError(
            f"act_bits={spec.act_bits} on a {ExpertsType.base_of(module).__name__} run by experts implementation "
            f"{route!r}: transformers' eager expert loop computes act_fn(gate) * up inline, where mixle cannot "
            f"quantize the input of down_proj; call model.set_experts_implementation('grouped_mm') (or "
            f"'batched_mm') first, or leave act_bits=None for the experts")


class _QATFused(_FusedForward, QATLayerMixin, nn.Module):
    """A fused module whose weights are fake-quantized per expert, per output row, while enabled.

    Shares the float module's Parameters (same names: ``state_dict`` keys unchanged) and runs its
    class's own forward; disabled, that forward exactly as the float module runs it.
    """

    def __init__(self, module, spec, *, enabled=True):
        nn.Module.__init__(self)
        _share_state(self, module)
        self.spec = spec
        self.enabled = enabled

    def _weight_specs(self):
        """``{name: the spec its Parameter is fake-quantized with}`` (``_row_spec``), kept while
        ``self.spec`` is the same object (reconfiguring assigns a new one)."""
        kept = self.__dict__.get("_mixle_specs")
        if kept is None or kept[0] is not self.spec:
            specs = {name: _row_spec(self.spec, int(self._parameters[name].shape[-1])) if self.BATCH_AXES else self.spec
                     for name in self.weight_names}
            kept = self.__dict__["_mixle_specs"] = (self.spec, specs)
        return kept[1]

    def quantized_weights(self):
        """``{name: fake-quantized weight (STE gradient)}``, each cached per version of its Parameter."""
        return {name: fake_quantized_weight(self._parameters[name], spec)[0]
                for name, spec in self._weight_specs().items()}

    def forward_weights(self):
        """``{name: the weight}`` the forward multiplies with: fake-quantized while enabled, else the
        Parameter."""
        if self.enabled:
            return self.quantized_weights()
        return {name: self._parameters[name] for name in self.weight_names}

    def forward(self, *args, **kwargs):
        if not self.enabled:
            return super().forward(*args, **kwargs)
        try:  # a scale that does not fit float16, a NaN weight, activations out of range: name the layer
            return self._run(self.quantized_weights(), args, kwargs)
        except ValueError as err:
            raise named_error(self, err) from None

    def extra_repr(self):
        return self.qat_state()


class QATExperts(_QATFused):
    """Mixin of the QAT fused experts classes (``QAT<ExpertsClass>``, built on first use)."""

    BATCH_AXES = 1


class QATRouter(_QATFused):
    """Mixin of the QAT router classes (``QAT<RouterClass>``): its ``(experts, hidden)`` weight is
    fake-quantized as a Linear's. Opt-in (``opt_in=("router",)``)."""


class QuantizedFusedWeight(QuantizedWeight):
    """The stored codes and scales of one fused weight, held as its ``(rows, in)`` matrix.

    A ``(experts, out, in)`` weight is stored as its ``experts * out`` rows: per-row scales and
    groups are laid out alike, so the codes, scales and grid parts are those of
    ``quantize_linear_weight(w, spec, batch_axis_count=1)``, reshaped. ``stacked_array`` gives them
    back in the weight's own shape.

    Args:
        codes, scale, spec, parts: as ``to_storage`` gives them for the weight (any layout).
        shape: the weight's shape, ``batch + (out, in)``.
        kind: the layer kind it is saved as (``"experts"`` or ``"router"``).
    """

    def __init__(self, codes, scale, spec, shape, kind, **parts):
        super().__init__()
        self.array_shape = tuple(int(d) for d in shape)
        rows, cols = math.prod(self.array_shape[:-1]), self.array_shape[-1]
        if spec.bits != 4:
            codes = codes.reshape(rows, cols)
        flat = {part: value.reshape(1, -1, value.shape[-1]) for part, value in parts.items() if value is not None}
        self.KIND = kind
        self._set_storage(codes, scale.reshape(1, -1, 1), spec, (rows, cols), **flat)

    def stacked_array(self):
        """The QuantizedArray in the weight's shape: codes ``batch + (out, in)``, scales ``(batch, S, 1)``."""
        flat = self.quantized_array()
        batch_ndim = len(self.array_shape) - 2
        batch = math.prod(self.array_shape[:batch_ndim])
        parts = {part: getattr(flat, part).reshape(batch, -1, getattr(flat, part).shape[-1])
                 for part in GRID_PARTS if getattr(flat, part) is not None}
        return QuantizedArray(flat.codes.reshape(self.array_shape), flat.scale.reshape(batch, -1, 1), self.spec,
                              batch_ndim, 1, **parts)

    def forward(self, *_):
        raise RuntimeError("a QuantizedFusedWeight holds a weight of its fused module, which reads it: call that module")

    def extra_repr(self):
        return f"shape={list(self.array_shape)}, {self._storage_repr()}"


class _QuantizedFused(_FusedForward, nn.Module):
    """A converted fused module: each weight a ``QuantizedFusedWeight`` child under the weight's name,
    the forward its class's own, run with the dequantized weights (the fake-quant forward's)."""

    def __init__(self, module, spec, stored, dtype):
        nn.Module.__init__(self)
        _share_state(self, module, skip=stored)
        for key in ("spec", "enabled"):
            self.__dict__.pop(key, None)
        self.spec, self.float_dtype = spec, dtype
        for name, child in stored.items():
            self._modules[name] = child  # not setattr: the class's property holds the name

    def forward_weights(self):
        """``{name: the dequantized weight}`` the forward multiplies with."""
        return {name: self._modules[name].dequantized_weight().reshape(self._modules[name].array_shape)
                .to(self.float_dtype) for name in self.weight_names}

    def forward(self, *args, **kwargs):
        return self._run(self.forward_weights(), args, kwargs)

    def extra_repr(self):
        return self.spec.short()


class QuantizedExperts(_QuantizedFused):
    """Mixin of the converted fused experts classes (``Quantized<ExpertsClass>``)."""

    BATCH_AXES = 1
    KIND = "experts"


class QuantizedRouter(_QuantizedFused):
    """Mixin of the converted router classes (``Quantized<RouterClass>``)."""

    KIND = "router"


_CLASSES = {}


def _built(mixin, real, prefix):
    """``<prefix><real name>``: ``mixin`` over the transformers class ``real`` (built once)."""
    key = (mixin, real)
    if key not in _CLASSES:
        weights = next(e.weights for e in EXPERTS + ROUTERS if e.real() is real)
        name = f"{prefix}{real.__name__}"
        attrs = {w: _live_property(w) for w in weights}
        attrs.update(__module__=__name__, __qualname__=name)
        _CLASSES[key] = type(name, (mixin, real), attrs)
    return _CLASSES[key]


def _mixins(module):
    """``(QAT mixin, quantized mixin, float type)`` for a fused module."""
    if ExpertsType.base_of(module) is not None:
        return QATExperts, QuantizedExperts, ExpertsType
    return QATRouter, QuantizedRouter, RouterType


def __getattr__(name):  # unpickling a built class finds it here (its transformers module is imported then)
    for entry in EXPERTS + ROUTERS:
        qat, quantized = (QATExperts, QuantizedExperts) if entry in EXPERTS else (QATRouter, QuantizedRouter)
        for mixin, prefix in ((qat, "QAT"), (quantized, "Quantized")):
            if name == f"{prefix}{entry.name}":
                return _built(mixin, getattr(importlib.import_module(entry.module), entry.name), prefix)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_layout(module, spec):
    """Refuse a fused module mixle's layer cannot quantize as its own Linear rows with ``spec``."""
    for flag in ("is_transposed", "has_bias"):
        if getattr(module, flag, False):
            raise ValueError(f"a {type(module).__name__} with {flag}=True is not supported yet: mixle quantizes "
                             f"(experts, out, in) weights without biases; exclude it")
    batch = _mixins(module)[2].BATCH_AXES
    for name in fused_weight_names(module):
        weight = module._parameters.get(name)
        if not isinstance(weight, torch.Tensor) or weight.dim() != batch + 2:
            raise ValueError(f"{type(module).__name__}.{name} must be a Parameter of {batch + 2} axes, got {weight!r:.60}")
        block_shape(tuple(weight.shape[batch:]), spec)  # group_size must divide the input size


def wrap_fused(module, spec, enabled):
    """The QAT layer for fused experts or router ``module`` (sharing its Parameters).

    >>> from transformers import Qwen3MoeConfig
    >>> from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    >>> from mixle.core.spec import QuantSpec
    >>> experts = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=2))
    >>> layer = wrap_fused(experts, QuantSpec(bits=4), True)
    >>> type(layer).__name__, layer.gate_up_proj is experts.gate_up_proj, isinstance(layer, Qwen3MoeExperts)
    ('QATQwen3MoeExperts', True, True)
    """
    check_supported(spec)
    _check_layout(module, spec)
    _check_act_route(module, spec)
    qat, _, float_type = _mixins(module)
    return _built(qat, float_type.base_of(module), "QAT")(module, spec, enabled=enabled)


def check_fused_spec(spec, batch_axes):
    """Why ``spec`` cannot be honoured on weights with ``batch_axes`` leading expert axes, or ''.

    >>> from mixle.core.spec import QuantSpec
    >>> check_fused_spec(QuantSpec(bits=4, granularity="tensor"), 1)[:40]
    "granularity='tensor' on fused experts wo"
    """
    if batch_axes and spec.granularity == "tensor":
        return ("granularity='tensor' on fused experts would give one scale per expert, which mixle's files "
                "(2-D (rows, cols) arrays) cannot hold: use granularity='channel' or a group_size for them")
    return ""


def quantize_experts(w, spec):
    """An experts weight ``(E, out, in)`` quantized per expert as E Linear weights.

    >>> import numpy as np
    >>> from mixle.core.spec import QuantSpec
    >>> quantize_experts(np.array([[[0.7, -0.35]], [[0.1, 0.2]]], np.float32), QuantSpec(bits=4)).codes.tolist()
    [[[7, -4]], [[4, 7]]]
    """
    return quantize_linear_weight(w, spec, batch_axis_count=1)


def _array_of(weight, spec, batch_axes):
    """The QuantizedArray the QAT forward's weight is the round trip of (as ``convert`` stores it)."""
    return quantize_linear_weight(numerics_input(weight.detach()), spec, batch_axis_count=batch_axes)


def forward_weights(module):
    """``{attribute: weight}`` a fused module's forward multiplies with now: a float module's
    Parameters, a QAT layer's fake-quantized weights (while enabled), a converted layer's
    dequantized ones.

    >>> forward_weights(nn.Linear(2, 2))
    Traceback (most recent call last):
    ...
    TypeError: forward_weights takes a fused experts or router module, got Linear
    """
    if hasattr(module, "forward_weights"):
        return module.forward_weights()
    if not is_fused(module):
        raise TypeError(f"forward_weights takes a fused experts or router module, got {type(module).__name__}")
    return {name: getattr(module, name) for name in fused_weight_names(module)}


def stored_arrays(module):
    """``{weight attribute: QuantizedArray}`` of a QAT or converted fused module, None for others.

    A QAT layer's arrays are those its forward's fake-quantized weights are the round trip of
    (codes ``(E, out, in)`` for experts); a converted layer's are the ones it holds.

    >>> stored_arrays(nn.Linear(2, 2)) is None
    True
    """
    if isinstance(module, _QATFused):
        return {name: _array_of(module._parameters[name], module.spec, module.BATCH_AXES)
                for name in module.weight_names}
    if isinstance(module, _QuantizedFused):
        return {name: module._modules[name].stacked_array() for name in module.weight_names}
    return None


def assemble_fused(layer, stored):
    """The converted module of QAT ``layer``; ``stored``: ``{name: (codes, scale, parts)}`` as
    ``to_storage`` gives them (``convert`` calls it through the layer kind).

    >>> from transformers import Qwen3MoeConfig
    >>> from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    >>> from mixle.core.spec import QuantSpec
    >>> from mixle.torch_backend.layers.quantized import to_storage
    >>> layer = wrap_fused(Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=2)),
    ...                    QuantSpec(bits=8), True)
    >>> torch.nn.init.normal_(layer.gate_up_proj), torch.nn.init.normal_(layer.down_proj)  # doctest: +ELLIPSIS
    (...)
    >>> new = assemble_fused(layer, {n: to_storage(a) for n, a in stored_arrays(layer).items()})
    >>> type(new).__name__, torch.equal(stored_arrays(new)["down_proj"].codes, stored_arrays(layer)["down_proj"].codes)
    ('QuantizedQwen3MoeExperts', True)
    """
    _, quantized, float_type = _mixins(layer)
    children = {name: QuantizedFusedWeight(codes, scale, layer.spec, tuple(layer._parameters[name].shape),
                                           quantized.KIND, **parts)
                for name, (codes, scale, parts) in stored.items()}
    dtype = layer._parameters[next(iter(stored))].dtype
    return _built(quantized, float_type.base_of(layer), "Quantized")(layer, layer.spec, children, dtype)


def loaded_fused(module, children):
    """The converted module of float ``module`` from its loaded ``{name: QuantizedFusedWeight}``
    (``load_quantized`` builds the children from the file; ``assemble_fused`` shows the layout)."""
    _, quantized, float_type = _mixins(module)
    spec = next(iter(children.values())).spec
    dtype = module._parameters[next(iter(children))].dtype
    return _built(quantized, float_type.base_of(module), "Quantized")(module, spec, children, dtype)
