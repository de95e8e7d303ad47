"""GPTQ post-training quantization of torch models onto mixle's grids (``mixle.gptq_quantize``).

mixle's own GPTQ (``mixle.core.gptq``; torchao 0.18's prototype ``GPTQConfig`` runs on CUDA only
and onto its own int4 grid with zero points). ``quantize_model`` makes the converted copy (layer
selection, ties and grid exactly as for round-to-nearest PTQ); each of its ``QuantizedLinear``
layers made from an ``nn.Linear`` then gets GPTQ's codes and scales, written into its buffers, so
``save_quantized``, ``model_nbytes``, ``save_gguf`` (``grid="q4_0"``) and the packed kernels take
it as they take any converted model.

Calibration: a forward pre-hook on the layer sums ``X^T X`` of its inputs in float64 (every row
of every batch). ``sequential=True`` (the default) quantizes the layers one by one in model order
(``named_modules``), each from inputs that ran through a float copy of the model whose earlier
layers already hold their GPTQ weights (GPTQ's sequential mode; the quantized layers GPTQ leaves
alone, a tied head and its embedding, hold their round-to-nearest weights there): one
calibration pass per layer. ``sequential=False`` collects every layer's Hessian in one pass of
the float model.
"""

import copy

import torch
from torch import nn

from mixle.core.gptq import DEFAULT_BLOCK_SIZE, DEFAULT_DAMP, check_gptq_options, check_gptq_spec, gptq_quantize_weight
from mixle.core.spec import resolve_spec
from mixle.torch_backend.transforms.convert import check_torch_model, quantize_model
from mixle.torch_backend.fake_quant import numerics_input
from mixle.torch_backend.layers.quantized import QuantizedLinear, QuantizedWeight, to_storage

__all__ = ["gptq_quantize", "TIED_CHOICES"]

# What happens to a selected layer whose codes are shared with another module (a head tied to an
# embedding): "round" keeps round-to-nearest codes, "gptq" gives it GPTQ's codes (the embedding,
# which reads the same codes, then has them too).
TIED_CHOICES = ("round", "gptq")


def _shares_codes(layer, modules):
    return any(b is layer.codes for m in modules.values() if m is not layer for b in m.buffers(recurse=False))


def _targets(converted, work, tied):
    """``[(path, converted layer, float layer of work)]`` GPTQ quantizes, in model order."""
    modules, floats = dict(converted.named_modules()), dict(work.named_modules())
    found = []
    for path, layer in modules.items():
        if type(layer) is not QuantizedLinear or (tied == "round" and _shares_codes(layer, modules)):
            continue
        source = floats.get(path)
        if type(source) is not nn.Linear or tuple(source.weight.shape) != layer.weight_shape:
            raise ValueError(f"gptq_quantize: layer {path!r} is a {type(source).__name__}, not an nn.Linear: GPTQ "
                             f"needs a linear layer's own inputs and weight; keep it out with exclude=({path!r},) "
                             f"(quantize_model rounds it to nearest)")
        check_gptq_spec(layer.spec, f"gptq_quantize (layer {path!r})")
        found.append((path, layer, source))
    if not found:
        raise ValueError("gptq_quantize found no untied linear layer to quantize: widen patterns, or pass "
                         "tied='gptq' to quantize a head tied to an embedding")
    return found


def _round_the_others(converted, work, targets):
    """Give ``work`` the round-to-nearest weights of the quantized layers GPTQ leaves alone (a tied head
    and its embedding), so that sequential calibration runs through what the result computes."""
    floats, skipped = dict(work.named_modules()), {path for path, _, _ in targets}
    with torch.no_grad():
        for path, layer in converted.named_modules():
            source = floats.get(path)
            if path in skipped or not isinstance(layer, QuantizedWeight) or source is None:
                continue
            weight = getattr(source, "weight", None)
            if isinstance(weight, torch.Tensor) and tuple(weight.shape) == layer.weight_shape:
                weight.copy_(layer.dequantized_weight().to(weight.dtype))


def _hessians(work, batches, layers):
    """``{path: (float64 X^T X, rows)}`` of each ``(path, float layer)`` over one pass of ``batches``."""
    sums = {path: [torch.zeros(m.in_features, m.in_features, dtype=torch.float64), 0] for path, m in layers}

    def hook_for(path):
        def hook(module, inputs):
            rows = inputs[0].detach().reshape(-1, module.in_features).to(torch.float64).cpu()
            sums[path][0] += rows.T @ rows
            sums[path][1] += rows.shape[0]
        return hook

    handles = [module.register_forward_pre_hook(hook_for(path)) for path, module in layers]
    try:
        with torch.no_grad():
            for batch in batches:
                work(**batch) if isinstance(batch, dict) else work(batch)
    finally:
        for handle in handles:
            handle.remove()
    for path, (_, rows) in sums.items():
        if rows == 0:
            raise ValueError(f"gptq_quantize: no calibration batch reached layer {path!r}, so GPTQ has no inputs "
                             f"for it: pass batches that run it, or keep it out with exclude=({path!r},)")
    return sums


def _quantize_layer(path, layer, original, hessian, damp, block_size):
    """Write GPTQ's codes and scales of ``original``'s weight into ``layer``'s buffers (in place)."""
    weight = numerics_input(original.weight.detach()).cpu()
    q = gptq_quantize_weight(weight.numpy(), hessian.numpy(), layer.spec, damp=damp, block_size=block_size,
                             name=f"layer {path!r}")
    codes, scale, _ = to_storage(q)
    with torch.no_grad():
        layer.codes.copy_(torch.as_tensor(codes))
        layer.scale.copy_(torch.as_tensor(scale).to(layer.scale.dtype))


def _check_options(batches, damp, block_size, sequential, tied, opt_in):
    if tuple(opt_in):
        raise ValueError(f"gptq_quantize cannot take opt_in={tuple(opt_in)!r}: GPTQ compensates a linear layer's "
                         f"rounding over its inputs, which embeddings (lookups) and convolutions are not; quantize "
                         f"them with quantize_model(..., opt_in=...)")
    if not isinstance(sequential, bool):
        raise TypeError(f"sequential must be True or False, got {sequential!r}")
    if tied not in TIED_CHOICES:
        raise ValueError(f"tied={tied!r} is unknown: use 'round' (a head tied to an embedding keeps "
                         f"round-to-nearest codes) or 'gptq' (it gets GPTQ's codes, and so does the embedding)")
    if isinstance(batches, (torch.Tensor, dict)):
        raise TypeError("batches must be an iterable of batches (e.g. a list of token-id tensors), got a single "
                        f"{type(batches).__name__}: wrap it in a list")
    batches = list(batches)
    if not batches:
        raise ValueError("gptq_quantize needs at least one calibration batch: pass e.g. a list of token-id tensors")
    check_gptq_options(damp, block_size)
    return batches


def gptq_quantize(model, batches, spec=None, *, patterns=(".*",), exclude=(), opt_in=(), damp=DEFAULT_DAMP,
                  block_size=DEFAULT_BLOCK_SIZE, sequential=True, tied="round", **spec_fields):
    """GPTQ post-training quantization of a float torch model: a converted copy (see the module doc).

    >>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> q = gptq_quantize(net, [torch.randn(32, 8)], bits=4)
    >>> [type(m).__name__ for m in q]
    ['QuantizedLinear', 'ReLU', 'QuantizedLinear']
    """
    spec = resolve_spec(spec, spec_fields)
    check_torch_model(model, "gptq_quantize")
    check_gptq_spec(spec)
    batches = _check_options(batches, damp, block_size, sequential, tied, opt_in)
    converted = quantize_model(model, spec, patterns=patterns, exclude=exclude, opt_in=opt_in)
    work = copy.deepcopy(model).eval()  # the float copy calibration runs through (the user's model is untouched)
    targets = _targets(converted, work, tied)
    originals = dict(model.named_modules())
    if sequential:
        _round_the_others(converted, work, targets)
    else:
        sums = _hessians(work, batches, [(path, source) for path, _, source in targets])
    for path, layer, source in targets:
        hessian = (_hessians(work, batches, [(path, source)]) if sequential else sums)[path][0]
        _quantize_layer(path, layer, originals[path], hessian, damp, block_size)
        if sequential:  # later layers see this one's quantized outputs
            with torch.no_grad():
                source.weight.copy_(layer.dequantized_weight().to(source.weight.dtype))
    return converted
