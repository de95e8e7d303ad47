"""Importance matrices for torch models: collect what ``llama-imatrix`` collects, and quantize with it.

``calibrate_importance`` runs batches through a model with a forward pre-hook on each given
matrix layer and adds, as ``llama-imatrix``'s ``collect_imatrix`` does for every product of a
weight with a batch of at least 16 input rows, the squares of each row's inputs to one sum per
input column and the row count to the layer's count (``mixle.core.imatrix.Imatrix``, keyed by
model path). mixle sums in float64 and stores float32; llama.cpp sums float32 as it goes, and its
activations come from ggml's forward, so the two files agree to rounding, not bit for bit.

``with_importance`` re-quantizes a converted model's ``QuantizedLinear`` layers from the float
weights with an importance per layer (``quantize_array(..., importance=)``: ggml's weighted
search, bit for bit as ``llama-quantize --imatrix``). Layers of other kinds (fused experts,
convolutions, embeddings) are refused.
"""

import numpy as np
import torch
from torch import nn

from mixle.core.imatrix import Imatrix
from mixle.core.numerics import quantize_array
from mixle.torch_backend.layers import PATH_ATTRIBUTE
from mixle.torch_backend.quantized import QuantizedLinear, to_storage
from mixle.torch_backend.swap import Change

__all__ = ["calibrate_importance", "with_importance", "MIN_ROWS"]

MIN_ROWS = 16  # llama-imatrix skips products with fewer input rows ("small batches")


def _matrix_layers(model, layers):
    modules = dict(model.named_modules())
    found = {}
    for path in layers:
        module = modules.get(path)
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            what = "no such module" if module is None else f"a {type(module).__name__} without a 2-D weight"
            raise ValueError(f"calibrate_importance: layer {path!r} is {what}: only matrix layers (nn.Linear and their "
                             f"QAT wrappers) are calibrated; fused expert weights are not handled yet")
        found[path] = module
    return found


def calibrate_importance(model, batches, *, layers, dataset="mixle.calibrate_importance"):
    """Sum the squared inputs of each input column of ``layers`` over ``batches``, as llama-imatrix.

    Args:
        model: a torch model (float or QAT-wrapped); it runs in eval mode under ``no_grad`` and is
            left in the mode it had.
        batches: an iterable of inputs: a tensor (e.g. token ids ``(B, T)``) is called as
            ``model(batch)``, a dict as ``model(**batch)``.
        layers: the model paths of the matrix layers to collect (``mixle.calibrate_importance``
            passes every matrix ``save_gguf`` writes).
        dataset: the calibration text's name, recorded as the file's ``imatrix.datasets``.

    Returns:
        ``Imatrix`` keyed by path: float32 sums ``(1, in)``, int64 counts ``(1,)``, ``chunk_count``
        the batches run and ``chunk_size`` the first batch's last dimension.

    Raises:
        ValueError: a path that is no matrix layer, or no batch reached a layer with 16 rows.

    >>> net = nn.Sequential(nn.Linear(4, 2))
    >>> m = calibrate_importance(net, [torch.ones(16, 4)], layers=["0"])
    >>> m.sums["0"].tolist(), m.counts["0"].tolist()
    ([[16.0, 16.0, 16.0, 16.0]], [16])
    """
    found = _matrix_layers(model, layers)
    sums = {path: torch.zeros(m.weight.shape[1], dtype=torch.float64) for path, m in found.items()}
    counts = dict.fromkeys(found, 0)

    def hook_for(path):
        def hook(_module, inputs):
            rows = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
            if rows.shape[0] >= MIN_ROWS:
                sums[path] += rows.to(torch.float64).square().sum(0).cpu()
                counts[path] += rows.shape[0]
        return hook

    modes = {m: m.training for m in model.modules()}
    handles = [module.register_forward_pre_hook(hook_for(path)) for path, module in found.items()]
    n_batches, chunk = 0, 0
    try:
        model.eval()
        with torch.no_grad():
            for batch in batches:
                model(**batch) if isinstance(batch, dict) else model(batch)
                n_batches += 1
                chunk = chunk or int(next(iter(batch.values())).shape[-1] if isinstance(batch, dict) else batch.shape[-1])
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in modes.items():
            module.train(mode)
    empty = sorted(path for path, count in counts.items() if count == 0)
    if empty:
        raise ValueError(f"calibrate_importance: layers {empty[:3]} saw no batch of at least {MIN_ROWS} input rows "
                         f"(llama-imatrix skips smaller ones): pass batches of at least {MIN_ROWS} tokens")
    return Imatrix({p: s.to(torch.float32).numpy()[None] for p, s in sums.items()},
                   {p: np.array([c], np.int64) for p, c in counts.items()}, (str(dataset),), n_batches, chunk)


def with_importance(converted, float_model, importance):
    """``converted`` (a private copy made by ``quantize_model``) with each layer of ``importance``
    re-quantized from ``float_model``'s weight by ggml's importance-weighted search, in place.

    Args:
        converted: the converted model; its ``QuantizedLinear`` layers are replaced.
        float_model: the float model it was made from (same paths).
        importance: ``{layer path: float32 (in,) importance}``.

    Raises:
        ValueError: a path that is no ``QuantizedLinear`` of ``converted`` (not selected, tied to an
            embedding, or another kind), or an importance that does not fit its weight.
    """
    modules, floats = dict(converted.named_modules()), dict(float_model.named_modules())
    replacements = {}
    for path, values in importance.items():
        layer = modules.get(path)
        if type(layer) is not QuantizedLinear or any(b is layer.codes for m in modules.values()
                                                     if m is not layer for b in m.buffers(recurse=False)):
            raise ValueError(f"importance given for layer {path!r}, which quantize_model did not make a QuantizedLinear "
                             f"of its own ({type(layer).__name__}): only untied linear layers take an importance")
        weight = floats[path].weight.detach().to(torch.float32)
        q = quantize_array(weight, layer.spec, importance=values, name=f"layer {path!r}")
        codes, scale, parts = to_storage(q)
        new = QuantizedLinear(codes, scale, layer.spec, layer.weight_shape, bias=layer.bias, **parts)
        new.train(layer.training)
        setattr(new, PATH_ATTRIBUTE, path)
        replacements[id(layer)] = new
    with Change() as change:
        return change.swap(converted, replacements)
