"""Real low-bit torch layers (QuantizedLinear, QuantizedEmbedding), convert() after QAT, and PTQ.

PTQ is ``convert(apply_qat(copy of the model))``: the codes of a post-training-quantized layer
come from the very function the QAT forward calls, so PTQ and QAT cannot use different grids.
"""

import copy
import sys

from mixle._optional import require

torch = require("torch", extra="torch", purpose="mixle.task.ptq")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from mixle.models._qat_torch import REPORT_ATTRIBUTE, QATEmbedding, QATWrapper, check_supported  # noqa: E402
from mixle.task.packing import pack_int4, packed_int4_nbytes, unpack_int4  # noqa: E402
from mixle.task.quantize import (  # noqa: E402
    QuantizedArray,
    _resolve_spec,
    block_shape,
    dequantize_array,
    quantize_embedding_weight,
    quantize_linear_weight,
)
from mixle.task.spec import QuantSpec  # noqa: E402

__all__ = ["QuantizedLinear", "QuantizedEmbedding", "convert", "quantize_model", "quantize_mlp",
           "check_quantized_storage"]

_QAT_LAYERS = (QATWrapper, QATEmbedding)


def stored_codes_layout(spec, weight_shape):
    """``(dtype, shape)`` of the stored codes: packed uint8 bytes for int4, int8 for int8.

    >>> stored_codes_layout(QuantSpec(bits=4), (3, 5))
    (torch.uint8, (8,))
    """
    if spec.bits == 4:
        count = 1
        for d in weight_shape:
            count *= d
        return torch.uint8, (packed_int4_nbytes(count),)
    return torch.int8, tuple(weight_shape)


def scale_shape(spec, weight_shape):
    """Shape ``(1, S, 1)`` of the scales of a 2-D ``(rows, cols)`` weight under ``spec``.

    >>> scale_shape(QuantSpec(bits=4, group_size=2), (3, 4))
    (1, 6, 1)
    """
    batch, rows, _ = block_shape(weight_shape, spec, 0, 1)
    return (batch, rows, 1)


def check_quantized_storage(codes, scale, spec, weight_shape, name="layer"):
    """Validate codes and scales of one quantized weight before they are used.

    Checks the codes' dtype and shape for ``spec.bits``, that every code lies on the spec's grid
    (``[code_min, code_max]``; for int4 also that an odd count's pad nibble is zero), and that
    the scales have the block shape, a floating dtype and finite positive values.

    Raises:
        TypeError: spec is not a QuantSpec, or codes/scale are not torch tensors.
        ValueError: anything above disagrees; the message names ``name``.

    >>> check_quantized_storage(torch.tensor([[7, -7]], dtype=torch.int8), torch.ones(1, 1, 1),
    ...                         QuantSpec(bits=8), (1, 2))
    >>> check_quantized_storage(torch.tensor([[-128, 7]], dtype=torch.int8), torch.ones(1, 1, 1),
    ...                         QuantSpec(bits=8), (1, 2), name="fc")
    Traceback (most recent call last):
    ValueError: fc: codes span [-128, 7], outside the int8/channel/symmetric grid [-127, 127]: the data is corrupt or was written with another spec
    """
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{name}: spec must be a mixle QuantSpec, got {type(spec).__name__}")
    try:
        check_supported(spec)  # integer weight codes only: what the torch QAT backend trains
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    if not isinstance(codes, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name}: codes and scale must be torch tensors, got {type(codes).__name__} "
                        f"and {type(scale).__name__}")
    weight_shape = tuple(int(d) for d in weight_shape)
    if len(weight_shape) != 2 or min(weight_shape) < 1:
        raise ValueError(f"{name}: weight_shape must be (rows, cols) with positive sizes, got {weight_shape}")
    dtype, shape = stored_codes_layout(spec, weight_shape)
    if codes.dtype != dtype or tuple(codes.shape) != shape:
        raise ValueError(
            f"{name}: bits={spec.bits} for a weight of shape {list(weight_shape)} needs {dtype} codes of "
            f"shape {list(shape)}, got {codes.dtype} of shape {list(codes.shape)}"
        )
    values = unpack_int4(codes, weight_shape) if spec.bits == 4 else codes
    low, high = int(values.min()), int(values.max())
    if low < spec.code_min or high > spec.code_max:
        raise ValueError(
            f"{name}: codes span [{low}, {high}], outside the {spec.short()} grid "
            f"[{spec.code_min}, {spec.code_max}]: the data is corrupt or was written with another spec"
        )
    count = weight_shape[0] * weight_shape[1]
    if spec.bits == 4 and count % 2 and int(codes[-1]) >> 4:
        raise ValueError(f"{name}: the pad nibble after the last of {count} int4 codes is not zero: the data is corrupt")
    try:
        want = scale_shape(spec, weight_shape)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    if tuple(scale.shape) != want or not scale.is_floating_point():
        raise ValueError(
            f"{name}: {spec.short()} scales of a {list(weight_shape)} weight are floats of shape {list(want)}, "
            f"got {scale.dtype} of shape {list(scale.shape)}"
        )
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise ValueError(f"{name}: scales must be finite and positive; the data is corrupt")


class _QuantizedWeight(nn.Module):
    """Shared storage of a quantized 2-D weight: ``codes`` and ``scale`` buffers plus its spec."""

    def _set_storage(self, codes, scale, spec, weight_shape):
        check_quantized_storage(codes, scale, spec, weight_shape, name=type(self).__name__)
        self.spec = spec
        self.weight_shape = tuple(int(d) for d in weight_shape)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)

    def quantized_array(self):
        """The weight as a QuantizedArray of int8 codes (int4 codes unpacked) and scales."""
        codes = unpack_int4(self.codes, self.weight_shape) if self.spec.bits == 4 else self.codes
        return QuantizedArray(codes, self.scale, self.spec, 0, 1)

    def dequantized_weight(self):
        """The float weight ``codes * scale`` through the shared numerics (``dequantize_array``)."""
        return dequantize_array(self.quantized_array())

    def _storage_repr(self):
        packing = "packed int4, 2 per byte" if self.spec.bits == 4 else "int8"
        return f"{self.spec.short()} ({packing})"


def _quantized_storage(q):
    """Codes to store (int4 packed two per byte, int8 as is) and scales of a QuantizedArray."""
    codes = pack_int4(q.codes) if q.spec.bits == 4 else q.codes
    return codes, q.scale


class QuantizedLinear(_QuantizedWeight):
    """An inference ``Linear`` that stores integer codes and scales and dequantizes in its forward.

    Buffers: ``codes`` (uint8, two int4 codes per byte in the nibble order of
    ``mixle.task.packing``; or int8 codes of shape ``(out, in)``), ``scale`` (float, shape
    ``(1, S, 1)``, see ``block_shape``) and ``bias`` (float, or None). The forward computes
    ``F.linear(x, dequantize_array(codes, scale), bias)``: exactly the QAT fake-quant forward.

    Args:
        codes: stored codes as above.
        scale: scales in the weight's float dtype.
        spec: the QuantSpec the codes were made with.
        weight_shape: ``(out_features, in_features)``.
        bias: float bias of shape ``(out_features,)`` or None.

    >>> layer = quantize_model(nn.Linear(4, 2), bits=4)
    >>> type(layer).__name__, layer.codes.dtype, tuple(layer.codes.shape)
    ('QuantizedLinear', torch.uint8, (4,))
    """

    def __init__(self, codes, scale, spec, weight_shape, bias=None):
        super().__init__()
        self._set_storage(codes, scale, spec, weight_shape)
        self.out_features, self.in_features = self.weight_shape
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or tuple(bias.shape) != (self.out_features,):
                raise ValueError(f"QuantizedLinear: bias must be a float tensor of shape ({self.out_features},), got {bias!r:.80}")
            bias = bias.detach()
        self.register_buffer("bias", bias)

    def forward(self, x):
        return F.linear(x, self.dequantized_weight(), self.bias)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self._storage_repr()}")


class QuantizedEmbedding(_QuantizedWeight):
    """An inference ``Embedding`` whose table is stored as integer codes and scales.

    ``convert`` creates one for an embedding tied to a quantized head; both modules then hold
    the *same* ``codes`` and ``scale`` tensors, so the tied weight is stored once. Lookups use
    the dequantized table, exactly like ``QATEmbedding``'s fake-quant forward.

    Args:
        codes, scale, spec: as for ``QuantizedLinear``; codes describe ``(num_embeddings, dim)``.
        weight_shape: ``(num_embeddings, embedding_dim)``.
        padding_idx, max_norm, norm_type, scale_grad_by_freq: as for ``nn.Embedding``.
    """

    def __init__(self, codes, scale, spec, weight_shape, padding_idx=None, max_norm=None, norm_type=2.0,
                 scale_grad_by_freq=False):
        super().__init__()
        self._set_storage(codes, scale, spec, weight_shape)
        self.num_embeddings, self.embedding_dim = self.weight_shape
        self.padding_idx = padding_idx
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq

    def forward(self, x):
        return F.embedding(x, self.dequantized_weight(), self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, False)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}, {self._storage_repr()}"


# ----------------------------------------------------------------------------------------------
# convert and PTQ


def _check_torch_model(model, purpose):
    if not isinstance(model, nn.Module):
        raise TypeError(f"{purpose} takes a torch.nn.Module, got {type(model).__name__} "
                        f"(Flax models are not supported by {purpose} yet)")
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise TypeError(f"{purpose} got a {type(model).__name__} wrapper, which would be copied with its "
                        f"process group: pass the model inside it, {purpose}(model.module)")
    if _has_sharded_parameters(model):
        raise ValueError(
            f"{purpose} needs the whole model in one process, but this {type(model).__name__} has sharded "
            f"(FSDP2/DTensor) parameters: gather get_model_state_dict(model, options=StateDictOptions("
            f"full_state_dict=True, cpu_offload=True)), load it with strict=True into an unsharded copy of "
            f"the model (apply_qat with the same spec) on rank 0, and call {purpose} on that"
        )


def _has_sharded_parameters(model):
    dtensor = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is imported
    return dtensor is not None and any(isinstance(p, dtensor.DTensor) for p in model.parameters())


def _convert_in_place(model):
    """Swap every QAT layer of ``model`` (already a private copy) for its quantized module."""
    storage = {}  # (id(weight), spec) -> (codes, scale): a tied weight is quantized and stored once

    def weight_storage(layer, quantizer):
        key = (id(layer.weight), layer.spec)
        if key not in storage:
            storage[key] = _quantized_storage(quantizer(layer.weight.detach(), layer.spec))
        return storage[key]

    def replacement(layer):
        if isinstance(layer, QATWrapper):
            codes, scale = weight_storage(layer, quantize_linear_weight)
            bias = None if layer.bias is None else layer.bias.detach()
            new = QuantizedLinear(codes, scale, layer.spec, tuple(layer.weight.shape), bias)
        else:
            codes, scale = weight_storage(layer, quantize_embedding_weight)
            new = QuantizedEmbedding(codes, scale, layer.spec, tuple(layer.weight.shape), layer.padding_idx,
                                     layer.max_norm, layer.norm_type, layer.scale_grad_by_freq)
        new.train(layer.training)
        return new

    # Quantize the heads (QATWrapper) before the embeddings that share their weight.
    layers = [m for m in model.modules() if isinstance(m, QATWrapper)]
    layers += [m for m in model.modules() if isinstance(m, QATEmbedding)]
    new_of = {id(layer): replacement(layer) for layer in layers}
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if id(child) in new_of:
                setattr(module, name, new_of[id(child)])
    root = new_of.get(id(model), model)
    if REPORT_ATTRIBUTE in vars(model):
        delattr(model, REPORT_ATTRIBUTE)  # the QAT report no longer describes this model
    return root


def _count_qat_layers(model):
    return sum(isinstance(m, _QAT_LAYERS) for m in model.modules())


def _check_convertible(model):
    """Refuse QAT layers whose forward computes more than the quantized weight (e.g. LoRA)."""
    for path, layer in model.named_modules():
        if not isinstance(layer, _QAT_LAYERS):
            continue
        base = QATWrapper if isinstance(layer, QATWrapper) else QATEmbedding
        extra = [name for name, _ in layer.named_parameters() if name not in ("weight", "bias")]
        if type(layer).forward is not base.forward or extra:
            raise ValueError(
                f"layer {path!r} is a {type(layer).__name__} whose forward uses more than its quantized "
                f"weight (parameters {extra}): convert stores only that weight, so fold the rest in "
                f"first (for LoRA: merge_lora(model)), then convert"
            )


def convert(model):
    """Real int codes from a QAT model: each QATWrapper becomes a QuantizedLinear.

    The result is an independent copy (``model`` is untouched). Embeddings tied to a quantized
    head (``QATEmbedding``) become ``QuantizedEmbedding`` sharing the head's one codes+scales
    buffer. Other modules stay float. Layers convert with their spec whether or not fake-quant
    is currently enabled, and the converted forward equals the QAT model's fake-quant forward
    (same dequantized weights, bit for bit).

    Args:
        model: a torch model prepared with ``apply_qat``.

    Returns:
        The converted model (a ``QuantizedLinear`` if ``model`` itself is a ``QATWrapper``).

    Raises:
        ValueError: the model has no QAT layers (use ``quantize_model`` for a float model).

    >>> from mixle.models.qat import apply_qat
    >>> qat = apply_qat(nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)), bits=4)
    >>> [type(m).__name__ for m in convert(qat)]
    ['QuantizedLinear', 'ReLU', 'QuantizedLinear']
    """
    _check_torch_model(model, "convert")
    if not _count_qat_layers(model):
        raise ValueError(
            f"convert found no QAT layers in this {type(model).__name__}: prepare it with "
            f"apply_qat(model, ...) and train, or quantize a float model directly with quantize_model(model, ...)"
        )
    _check_convertible(model)
    return _convert_in_place(copy.deepcopy(model))


def quantize_model(model, spec=None, *, patterns=(".*",), exclude=(), **spec_fields):
    """Post-training quantization: a copy of a float model with real int Linear layers.

    It is ``convert(apply_qat(copy, spec=..., patterns=..., exclude=...))``: the same layer
    selection, tie handling and grid as QAT, so PTQ and QAT results are directly comparable.

    Args:
        model: a float torch model (not QAT-wrapped: use ``convert`` for that).
        spec: a QuantSpec; or its fields as keywords (default int4 per-channel symmetric).
        patterns, exclude: layer selection as in ``apply_qat`` (regexes over module paths).

    Returns:
        The quantized copy; ``model`` is untouched.

    >>> net = quantize_model(nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)), bits=8, exclude=("2",))
    >>> [type(m).__name__ for m in net]
    ['QuantizedLinear', 'ReLU', 'Linear']
    """
    from mixle.models.qat import apply_qat

    spec = _resolve_spec(spec, spec_fields)
    _check_torch_model(model, "quantize_model")
    if _count_qat_layers(model):
        raise ValueError("quantize_model got a QAT-wrapped model: use convert(model) to keep its trained spec")
    if any(isinstance(m, _QuantizedWeight) for m in model.modules()):
        raise ValueError("quantize_model got a model that already has quantized layers: quantize its float original")
    prepared = apply_qat(copy.deepcopy(model), spec=spec, patterns=patterns, exclude=exclude)
    if not _count_qat_layers(prepared):
        raise ValueError(
            f"quantize_model selected no nn.Linear layer with patterns={tuple(patterns)!r}, "
            f"exclude={tuple(exclude)!r}: widen patterns or shrink exclude"
        )
    _check_convertible(prepared)
    return _convert_in_place(prepared)


_MLP_PARTS = (nn.Linear, nn.Sequential, nn.ModuleList, nn.Dropout, nn.Identity, nn.Flatten, nn.Unflatten)


def _mlp_problem(model):
    """Why ``model`` is not an MLP (Linear layers, activations, dropout), or None."""
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        return "it has no nn.Linear layer"
    for path, module in model.named_modules():
        if module is model or isinstance(module, _MLP_PARTS):
            continue
        if module.__module__.startswith("torch.nn.modules.activation") and not isinstance(module, nn.MultiheadAttention):
            continue
        has_state = any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))
        return f"{path!r} is a {type(module).__name__}" + (" with parameters" if has_state else "")
    for name, _ in model.named_parameters(recurse=False):
        return f"the root module holds its own parameter {name!r}"
    return None


def quantize_mlp(model, spec=None, *, patterns=(".*",), exclude=(), **spec_fields):
    """``quantize_model`` for a multi-layer perceptron, checking that the model is one.

    An MLP here is built from ``nn.Linear`` layers, activations, dropout and containers.

    Raises:
        ValueError: the model has other layers; use ``quantize_model`` for it.

    >>> mlp = quantize_mlp(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1)))
    >>> mlp[0].spec.short()
    'int4/channel/symmetric'
    """
    _check_torch_model(model, "quantize_mlp")
    problem = _mlp_problem(model)
    if problem:
        raise ValueError(f"quantize_mlp takes an MLP (Linear layers and activations), but {problem}: "
                         f"use quantize_model(model, ...) for other models")
    return quantize_model(model, spec, patterns=patterns, exclude=exclude, **spec_fields)
