"""convert() after QAT and post-training quantization (PTQ), for torch models.

PTQ is ``convert(apply_qat(copy of the model))``: the codes of a post-training-quantized layer
come from the very function the QAT forward calls, so PTQ and QAT cannot use different grids.
"""

import copy
import sys

from torch import nn

from mixle.core.spec import resolve_spec
from mixle.core.selection import LayerSelector
from mixle.torch_backend.layers import learned_scale
from mixle.torch_backend.transforms import apply as qat
from mixle.torch_backend.layers.layer_kinds import QUANTIZED_TYPES, kind_of_qat, qat_importance, stored_array
from mixle.torch_backend.layers.qat import PATH_ATTRIBUTE
from mixle.torch_backend.layers.quantized import to_storage
from mixle.torch_backend.transforms.swap import Change

__all__ = ["convert", "quantize_model", "quantize_mlp", "check_torch_model"]


def check_torch_model(model, purpose):
    """Refuse what a whole-model transform cannot take: non-torch models, DDP wrappers, shards."""
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
    storage = {}  # (id(weight), spec) -> (codes, scale, parts): a tied weight is quantized and stored once
    replacements = {}
    paths = {id(module): path for path, module in model.named_modules()}
    for layer in qat.qat_layers(model):
        kind = kind_of_qat(layer)
        path = paths.get(id(layer), getattr(layer, PATH_ATTRIBUTE, None))
        try:  # e.g. a scale that does not fit float16 on llama.cpp's grids
            stored = {}
            importance = qat_importance(layer)
            for name, weight in kind.weights_of(layer).items():
                key = (id(weight), layer.spec, id(importance))
                if key not in storage:
                    if learned_scale.is_learned(layer.spec):  # exactly the trained scales
                        storage[key] = to_storage(learned_scale.quantized_array(layer))
                    else:
                        storage[key] = _stored(kind, weight.detach(), layer.spec, importance)
                stored[name] = storage[key]
            if kind.assemble is not None:  # several weights (fused experts)
                new = kind.assemble(layer, stored)
            else:
                new = kind.to_quantized(layer, *stored[kind.weight_name])
        except ValueError as err:
            raise ValueError(f"layer {path!r}: {err}") from None
        new.train(layer.training)
        setattr(new, PATH_ATTRIBUTE, path)  # run-time errors (activations) name it
        replacements[id(layer)] = new
    with Change() as change:
        root = change.swap(model, replacements)
        change.delete(model, qat.REPORT_ATTRIBUTE)  # the QAT report no longer describes this model
    return root


def _stored(kind, weight, spec, importance=None):
    """``(codes, scale, parts)`` of ``weight`` as the QAT forward made them: bfloat16/float16 weights run
    the numerics in float32 and keep its float32 scales; with an ``importance``, ggml's weighted
    search."""
    return to_storage(stored_array(kind, weight, spec, importance))


def check_convertible(model):
    """Refuse QAT layers whose forward computes more than the quantized weight (e.g. mixle LoRA),
    and PEFT DoRA adapters (they read the base weight). PEFT LoRA adapters over a QAT base layer
    convert: they stay float over the int base, exactly as they ran over the fake-quant one."""
    for path, layer in model.named_modules():
        dora = getattr(layer, "use_dora", None)
        if isinstance(dora, dict) and any(dora.values()) and kind_of_qat(layer.get_base_layer()) is not None:
            raise ValueError(f"layer {path!r} has a PEFT DoRA adapter, whose forward reads the base layer's float "
                             f"weight, which convert replaces by int codes: merge it first with "
                             f"model = model.merge_and_unload(), then convert")
        kind = kind_of_qat(layer)
        if kind is None:
            continue
        if kind.quantized_type is None:
            raise ValueError(f"layer {path!r} is a {type(layer).__name__}: convert refuses it because "
                             f"{kind.not_convertible}")
        own = {*kind.names_of(layer), kind.bias_name} | {f"{c}.{n}" for c in kind.linear_children
                                                         for n in ("weight", "bias")}
        own.add(learned_scale.SCALE_PARAMETER)
        extra = [name for name, _ in layer.named_parameters() if name not in own]
        if type(layer).forward is not kind.qat_type.forward or extra:
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

    >>> from mixle.api import apply_qat
    >>> trained = apply_qat(nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)), bits=4)
    >>> [type(m).__name__ for m in convert(trained)]
    ['QuantizedLinear', 'ReLU', 'QuantizedLinear']
    """
    check_torch_model(model, "convert")
    if not qat.qat_layers(model):
        raise ValueError(
            f"convert found no QAT layers in this {type(model).__name__}: prepare it with "
            f"apply_qat(model, ...) and train, or quantize a float model directly with quantize_model(model, ...)"
        )
    check_convertible(model)
    return _convert_in_place(copy.deepcopy(model))


def quantize_model(model, spec=None, *, patterns=(".*",), exclude=(), opt_in=(), example_inputs=None,
                   **spec_fields):
    """Post-training quantization: a copy of a float model with real int Linear layers.

    It is ``convert(apply_qat(copy, spec=..., patterns=..., exclude=...))``: the same layer
    selection, tie handling and grid as QAT, so PTQ and QAT results are directly comparable.

    Args:
        model: a float torch model (not QAT-wrapped: use ``convert`` for that).
        spec: a QuantSpec; or its fields as keywords (default int4 per-channel symmetric).
        patterns, exclude, opt_in: layer selection as in ``apply_qat``.

    Returns:
        The quantized copy; ``model`` is untouched.

    >>> net = quantize_model(nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)), bits=8, exclude=("2",))
    >>> [type(m).__name__ for m in net]
    ['QuantizedLinear', 'ReLU', 'Linear']
    """
    spec = resolve_spec(spec, spec_fields)
    check_torch_model(model, "quantize_model")
    if qat.qat_layers(model):
        raise ValueError("quantize_model got a QAT-wrapped model: use convert(model) to keep its trained spec")
    if any(isinstance(m, QUANTIZED_TYPES) for m in model.modules()):
        raise ValueError("quantize_model got a model that already has quantized layers: quantize its float original")
    selector = LayerSelector(patterns=patterns, exclude=exclude, default_spec=spec, opt_in=opt_in)
    prepared = qat.apply(copy.deepcopy(model), selector, False, example_inputs)  # refuses example_inputs
    if not qat.qat_layers(prepared):
        raise ValueError(
            f"quantize_model selected no {qat.SELECTABLE} layer with patterns={tuple(patterns)!r}, "
            f"exclude={tuple(exclude)!r}: widen patterns or shrink exclude"
        )
    check_convertible(prepared)
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
    check_torch_model(model, "quantize_mlp")
    problem = _mlp_problem(model)
    if problem:
        raise ValueError(f"quantize_mlp takes an MLP (Linear layers and activations), but {problem}: "
                         f"use quantize_model(model, ...) for other models")
    return quantize_model(model, spec, patterns=patterns, exclude=exclude, **spec_fields)

