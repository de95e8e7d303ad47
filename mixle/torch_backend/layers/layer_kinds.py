"""Layer kinds as data: which torch modules mixle quantizes, and how each is wrapped, converted,
saved and loaded.

apply_qat, convert, save_quantized and load_quantized walk ``KINDS``; adding a layer type is one
``LayerKind`` entry (plus its QAT and quantized classes and tests), not a branch in each of them.
Order matters: the first kind whose types match a module takes it (subclasses first).
"""

import math
from dataclasses import dataclass
from typing import Callable

from torch import nn

from mixle.core.layer_weights import quantize_embedding_weight, quantize_linear_weight
from mixle.core.numerics import quantize_array
from mixle.torch_backend.layers.expert_layers import (ExpertsType, QATExperts, QATRouter, QuantizedExperts, QuantizedRouter,
                                               RouterType, assemble_fused, check_fused_spec, fused_weight_names,
                                               quantize_experts, stored_arrays, wrap_fused)
from mixle.torch_backend.layers.conv_layers import QuantizedConv, QATConvMixin, quantize_conv_matrix, wrap_conv
from mixle.torch_backend.layers.hf_layers import Conv1DType, QuantizedConv1D, QATConv1DMixin, wrap_conv1d
from mixle.torch_backend.fake_quant import numerics_input
from mixle.torch_backend.layers.qat import QATEmbedding, QATWrapper, plain_linear
from mixle.torch_backend.layers.lora import LoRALinear, QATLoRALinear
from mixle.torch_backend.layers.mha_layers import OPTIONS as MHA_OPTIONS
from mixle.torch_backend.layers.mha_layers import QATMultiheadAttention, QuantizedMultiheadAttention, wrap_mha
from mixle.torch_backend.layers.quantized import QuantizedEmbedding, QuantizedLinear, QuantizedWeight, to_storage
from mixle.torch_backend.layers.scaled_embedding import (QATScaledEmbedding, QuantizedScaledEmbedding,
                                                         ScaledEmbeddingType, wrap_scaled_embedding)


@dataclass(frozen=True, kw_only=True)
class LayerKind:
    """One kind of quantizable layer.

    Attributes:
        name: the kind's name, as saved in the file manifest.
        float_types: module classes it takes (``isinstance``).
        qat_type: the QAT layer class it becomes.
        wrap: ``(module, spec, enabled) -> QAT layer`` sharing the module's Parameters.
        quantize: the core quantizer of its weight (fixes the ``batch + out + in`` layout).
        output_axis: the weight's output-channel axis (one scale row per output channel); the
            codes are stored with it first, ``(out, in)``.
        options: constructor options of the quantized layer, saved in the manifest.
        quantized_type: the real low-bit layer ``convert`` makes, or None.
        not_convertible: why ``convert`` refuses this kind (when ``quantized_type`` is None).
        has_bias: the quantized layer takes the layer's bias.
        opt_in: selected only on request (``apply_qat(..., opt_in=(name,))`` or a pattern that
            matches only opt-in layers), never by a pattern that also matches Linear-like layers
            (such as the default ``.*``).
        follows_tie: when its weight is tied to a selected layer of another kind, it is wrapped
            with that layer's spec (a tied weight is stored once, so both uses must see the same
            quantized weight).
        weight_name, bias_name: the attributes holding its weight and bias.
        linear_children: child Linear layers whose weights the layer itself reads (and so
            fake-quantizes with its spec): convert makes each a ``QuantizedLinear``.
        spec_options: the non-weight QuantSpec options its QAT layer honours (``act_bits``,
            ``scale``); any other set away from its default is refused, not ignored.
        weight_names: ``(module) -> attribute names`` for a kind holding several weights (fused
            experts); None: the one ``weight_name``.
        batch_axes: leading axes of its weights that each get their own scales (experts: 1).
        assemble: ``(QAT layer, {weight name: (codes, scale, parts)}) -> quantized layer``, for
            kinds with ``weight_names`` (``to_quantized`` takes one weight).
        opt_in_reason: the report's reason for an opt-in layer not asked for (default: a generic one).
        opt_in_as: the ``opt_in`` name that selects an opt-in kind, when not its own (Gemma's scaled
            embeddings answer to ``"embedding"``).
    """

    name: str
    float_types: tuple
    qat_type: type
    wrap: Callable
    quantize: Callable
    output_axis: int = 0
    options: tuple = ()
    quantized_type: type | None = None
    not_convertible: str = ""
    has_bias: bool = False
    opt_in: bool = False
    follows_tie: bool = False
    weight_name: str = "weight"
    bias_name: str = "bias"
    linear_children: tuple = ()
    spec_options: tuple = ("act_bits", "scale")
    weight_names: Callable | None = None
    batch_axes: int = 0
    assemble: Callable | None = None
    opt_in_reason: str = ""
    opt_in_as: str = ""

    @property
    def opt_in_name(self):
        """The name ``apply_qat(opt_in=...)`` selects this kind by."""
        return self.opt_in_as or self.name

    def check_spec(self, spec):
        """Refuse the options of ``spec`` this kind's QAT layer would not honour.

        >>> from mixle.core.spec import QuantSpec
        >>> kind_named("conv").check_spec(QuantSpec(act_bits=8))
        Traceback (most recent call last):
        ...
        ValueError: a conv QAT layer fake-quantizes its weight only, so it cannot honour act_bits=8: leave it at its default for this layer (give it its own spec with patterns=[(path, QuantSpec(...))]) or exclude it
        """
        defaults = {"act_bits": None, "scale": "absmax"}
        unhonoured = [f"{name}={getattr(spec, name)!r}" for name, default in defaults.items()
                      if name not in self.spec_options and getattr(spec, name) != default]
        fused = check_fused_spec(spec, self.batch_axes)
        if fused:
            raise ValueError(fused)
        if unhonoured:
            article = "an" if self.name[0] in "aeiou" else "a"
            raise ValueError(f"{article} {self.name} QAT layer fake-quantizes its weight only, so it cannot honour "
                             f"{', '.join(unhonoured)}: leave {'it' if len(unhonoured) == 1 else 'them'} at "
                             f"{'its default' if len(unhonoured) == 1 else 'their defaults'} for this layer (give "
                             f"it its own spec with patterns=[(path, QuantSpec(...))]) or exclude it")

    def names_of(self, module):
        """The attributes holding the module's weights (``("weight",)`` for a Linear).

        >>> kind_named("linear").names_of(nn.Linear(2, 2))
        ('weight',)
        """
        return tuple(self.weight_names(module)) if self.weight_names is not None else (self.weight_name,)

    def weights_of(self, module):
        """``{attribute: weight Parameter}`` of the module, in ``names_of`` order."""
        return {name: getattr(module, name) for name in self.names_of(module)}

    def weight_of(self, module):
        """The module's (first) weight Parameter (``in_proj_weight`` for MHA)."""
        return getattr(module, self.names_of(module)[0])

    def forward_types(self, module):
        """The classes whose forward a module of this kind may have without changing its maths."""
        return (self.qat_type,) + tuple(getattr(t, "base_of", lambda m, t=t: t)(module) or t for t in self.float_types)

    def bias_of(self, module):
        return getattr(module, self.bias_name, None)

    def stored_shape(self, shape):
        """The ``(out, in)`` shape the codes are stored in, for a weight of ``shape`` (trailing
        input axes, e.g. a convolution's kernel, flattened into ``in``).

        >>> kind_named("conv1d").stored_shape((4, 3)), kind_named("conv").stored_shape((8, 3, 2, 2))
        ((3, 4), (8, 12))
        """
        shape = tuple(int(d) for d in shape)
        if self.batch_axes:  # stacked matrices: their rows one after another
            return (math.prod(shape[:-1]), shape[-1])
        if self.output_axis == 1:
            shape = shape[::-1]
        return (shape[0], math.prod(shape[1:]))

    def options_of(self, module):
        """The quantized layer's ``options`` as ``module`` (float, QAT or quantized) has them; an
        option a float module lacks is derived as the QAT class derives it (a property, e.g. a
        convolution's ``conv_shape``)."""
        values = {}
        for name in self.options:
            derived = getattr(self.qat_type, name, None)
            if not hasattr(module, name) and isinstance(derived, property):
                values[name] = derived.fget(module)
            else:
                values[name] = getattr(module, name)
        return values

    def to_quantized(self, layer, codes, scale, parts):
        """The quantized layer replacing QAT ``layer``, holding ``codes``, ``scale`` and the grid's
        other ``parts`` (``to_storage``)."""
        extra = self.options_of(layer)
        if parts and self.quantized_type not in (QuantizedLinear, QuantizedEmbedding, QuantizedScaledEmbedding):
            raise ValueError(f"grid={layer.spec.grid!r} stores {sorted(parts)} too, which a "
                             f"{self.quantized_type.__name__} cannot hold yet: use one of the grids without them "
                             f"(e.g. grid='q4_0') for this layer")
        extra.update(parts)
        if self.has_bias:
            bias = self.bias_of(layer)
            extra["bias"] = None if bias is None else bias.detach()
        for name in self.linear_children:
            child = getattr(layer, name)
            child_codes, child_scale, child_parts = to_storage(quantize_linear_weight(child.weight.detach(), layer.spec))
            extra[name] = QuantizedLinear(child_codes, child_scale, layer.spec, tuple(child.weight.shape),
                                          bias=None if child.bias is None else child.bias.detach(),
                                          dtype=child.weight.dtype, **child_parts)
        weight = self.weight_of(layer)
        return self.quantized_type(codes, scale, layer.spec, self.stored_shape(weight.shape), dtype=weight.dtype, **extra)


def _quantize_transposed(w, spec):
    """A weight stored ``(in, out)``, quantized per output channel (per column)."""
    return quantize_linear_weight(w.t(), spec)


KINDS = (
    LayerKind(name="lora_linear", float_types=(LoRALinear,), qat_type=QATLoRALinear,
              wrap=lambda module, spec, enabled: QATLoRALinear(plain_linear(module), module.lora_spec, spec,
                                                               enabled=enabled, adapters=(module.lora_A, module.lora_B)),
              quantize=quantize_linear_weight,
              not_convertible="its forward adds a LoRA adapter that convert would drop: fold it in first with "
                              "merge_lora(model), then convert"),
    LayerKind(name="linear", float_types=(nn.Linear,), qat_type=QATWrapper,
              wrap=lambda module, spec, enabled: QATWrapper(module, spec, enabled=enabled),
              quantize=quantize_linear_weight, quantized_type=QuantizedLinear, has_bias=True),
    LayerKind(name="conv1d", float_types=(Conv1DType,), qat_type=QATConv1DMixin, wrap=wrap_conv1d,
              quantize=_quantize_transposed, output_axis=1, quantized_type=QuantizedConv1D, has_bias=True,
              spec_options=()),
    LayerKind(name="multihead_attention", float_types=(nn.MultiheadAttention,), qat_type=QATMultiheadAttention,
              wrap=wrap_mha, quantize=quantize_linear_weight, quantized_type=QuantizedMultiheadAttention,
              has_bias=True, weight_name="in_proj_weight", bias_name="in_proj_bias", linear_children=("out_proj",),
              options=MHA_OPTIONS, spec_options=()),
    LayerKind(name="conv", float_types=(nn.Conv1d, nn.Conv2d), qat_type=QATConvMixin, wrap=wrap_conv,
              quantize=quantize_conv_matrix, quantized_type=QuantizedConv, has_bias=True, opt_in=True, spec_options=(),
              options=("conv_shape", "stride", "padding", "dilation", "groups", "padding_mode", "reversed_padding")),
    # Gemma's scaled embeddings before plain ones (a subclass whose lookups are multiplied by a scale)
    LayerKind(name="scaled_embedding", float_types=(ScaledEmbeddingType,), qat_type=QATScaledEmbedding,
              wrap=wrap_scaled_embedding, quantize=quantize_embedding_weight, quantized_type=QuantizedScaledEmbedding,
              options=("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "embedding_scale"), opt_in=True,
              follows_tie=True, opt_in_as="embedding"),
    LayerKind(name="embedding", float_types=(nn.Embedding,), qat_type=QATEmbedding,
              wrap=lambda module, spec, enabled: QATEmbedding(module, spec, enabled=enabled),
              quantize=quantize_embedding_weight, quantized_type=QuantizedEmbedding,
              options=("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq"), opt_in=True,
              follows_tie=True),
    LayerKind(name="experts", float_types=(ExpertsType,), qat_type=QATExperts, wrap=wrap_fused,
              quantize=quantize_experts, quantized_type=QuantizedExperts, weight_names=fused_weight_names,
              batch_axes=1, assemble=assemble_fused, spec_options=("act_bits",), options=("array_shape",)),
    LayerKind(name="router", float_types=(RouterType,), qat_type=QATRouter, wrap=wrap_fused,
              quantize=quantize_linear_weight, quantized_type=QuantizedRouter, weight_names=fused_weight_names,
              assemble=assemble_fused, spec_options=("act_bits",), opt_in=True, options=("array_shape",),
              opt_in_reason="router stays float by default; opt in with opt_in=('router',)"),
)
OPT_IN = tuple(dict.fromkeys(kind.opt_in_name for kind in KINDS if kind.opt_in))

QAT_TYPES = tuple({kind.qat_type for kind in KINDS})
QUANTIZED_TYPES = tuple({kind.quantized_type for kind in KINDS if kind.quantized_type is not None})


def kind_of_float(module):
    """The kind that wraps float ``module`` (None for QAT layers and modules no kind takes).

    >>> kind_of_float(nn.Linear(2, 2)).name, kind_of_float(nn.ReLU())
    ('linear', None)
    """
    if isinstance(module, QAT_TYPES):
        return None
    return next((kind for kind in KINDS if isinstance(module, kind.float_types)), None)


def kind_of_qat(layer):
    """The kind of a QAT layer (None for other modules)."""
    return next((kind for kind in KINDS if isinstance(layer, kind.qat_type)), None)


def qat_importance(layer):
    """The importance a QAT layer's forward searches with (``QATWrapper(importance=)``), or None."""
    return layer._buffers.get("importance") if isinstance(layer, QATWrapper) else None


def stored_array(kind, weight, spec, importance=None):
    """The QuantizedArray of ``weight`` (a Parameter of a ``kind`` layer) that the fake-quant forward
    dequantizes: bfloat16/float16 weights quantized in float32 (``numerics_input``); with an
    ``importance`` (linear layers), ggml's importance-weighted search."""
    weight = numerics_input(weight.detach())
    if importance is not None:
        return quantize_array(weight, spec, importance=importance)
    return kind.quantize(weight, spec)


def qat_stored_array(layer):
    """The QuantizedArray ``convert`` stores for a QAT layer's (first) weight: the codes and scales
    its fake-quant forward trains on, importance included (what ``save_gguf`` writes).

    Raises:
        TypeError: ``layer`` is not a QAT layer.

    >>> layer = QATWrapper(nn.Linear(32, 2), grid="q4_0", bits=4, importance=[1.0] * 32)
    >>> qat_stored_array(layer).codes.shape
    torch.Size([2, 32])
    """
    kind = kind_of_qat(layer)
    if kind is None:
        raise TypeError(f"qat_stored_array takes a QAT layer (apply_qat's), got {type(layer).__name__}")
    return stored_array(kind, kind.weight_of(layer), layer.spec, qat_importance(layer))


def kind_named(name):
    """The kind saved as ``name``; ValueError naming the known kinds otherwise."""
    for kind in KINDS:
        if kind.name == name and kind.quantized_type is not None:
            return kind
    known = [kind.name for kind in KINDS if kind.quantized_type is not None]
    raise ValueError(f"unknown layer kind {name!r}: this mixle stores {known}")


def written_array(module, attr="weight"):
    """The QuantizedArray a file stores for ``module``'s weight ``attr``: a converted layer's own,
    a QAT layer's (the codes its fake-quant forward trains on, ``qat_stored_array``), a fused
    experts or router layer's ``attr``; None for a float layer.

    Raises:
        ValueError: the QAT layer's weight cannot be stored (the message starts ``layer ...`` where
            the layer names itself).

    >>> written_array(nn.Linear(2, 2)) is None
    True
    """
    fused = stored_arrays(module)
    if fused is not None:
        return fused[attr]
    if isinstance(module, QuantizedWeight):
        return module.quantized_array()
    if getattr(module, "spec", None) is not None and kind_of_qat(module) is not None:
        return qat_stored_array(module)
    return None
