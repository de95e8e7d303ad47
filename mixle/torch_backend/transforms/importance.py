"""Importance matrices for torch models: collect what ``llama-imatrix`` collects, and quantize with it.

``calibrate_importance`` runs batches through a model with a forward pre-hook on each given
matrix layer and adds, as ``llama-imatrix``'s ``collect_imatrix`` does for every product of a
weight with a batch of at least 16 input rows, the squares of each row's inputs to one sum per
input column and the row count to the layer's count (``mixle.core.imatrix.Imatrix``, keyed by
model path). Fused experts (``expert_layers``) are llama.cpp's ``MUL_MAT_ID`` products, which
``llama-imatrix`` collects at any batch size, per expert: for ``<experts>.gate_up_proj`` (its
``ffn_gate_exps`` and ``ffn_up_exps``, which share an input) the squared hidden states of the
tokens routed to each expert, for ``<experts>.down_proj`` the squared ``act(gate) * up`` of each,
and per expert the (token, expert) pairs routed: sums ``(E, in)``, counts ``(E,)``. A forward hook
on the experts module reads its inputs (hidden states and the router's top-k indices) and
recomputes ``act(gate) * up`` with the weights the module's forward reads (float, fake-quantized
or dequantized), as transformers' expert loop does. mixle sums in float64 and stores float32; llama.cpp sums float32 as it goes, and its
activations come from ggml's forward, so the two files agree to rounding, not bit for bit.

``with_importance`` re-quantizes a converted model's ``QuantizedLinear`` layers from the float
weights with an importance per layer (``quantize_array(..., importance=)``: ggml's weighted
search, bit for bit as ``llama-quantize --imatrix``). Layers of other kinds (fused experts,
embeddings) are refused; converted fused experts are re-quantized per expert with one
importance vector each (``quantize_array(..., batch_ndim=1, importance=(E, in))``).
"""

import dataclasses

import numpy as np
import torch
from torch import nn

from mixle.core.imatrix import Imatrix
from mixle.core.numerics import quantize_array
from mixle.torch_backend.layers.expert_layers import (ExpertsType, QuantizedFusedWeight, forward_weights, fused_weight_names,
                                               is_fused)
from mixle.torch_backend.layers.qat import PATH_ATTRIBUTE
from mixle.torch_backend.layers.quantized import QuantizedLinear, to_storage
from mixle.torch_backend.transforms.swap import Change

__all__ = ["calibrate_importance", "with_importance", "MIN_ROWS"]

MIN_ROWS = 16  # llama-imatrix skips products with fewer input rows ("small batches")


def _matrix_layers(model, layers):
    """``({path: dense matrix module}, {experts module path: (module, [weight attributes])})``."""
    modules = dict(model.named_modules())
    found, experts = {}, {}
    for path in layers:
        module = modules.get(path)
        parent, _, attr = path.rpartition(".")
        owner = modules.get(parent)
        if module is None and _is_experts(owner) and attr in fused_weight_names(owner):
            experts.setdefault(parent, (owner, []))[1].append(attr)
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            what = "no such module" if module is None else f"a {type(module).__name__} without a 2-D weight"
            raise ValueError(f"calibrate_importance: layer {path!r} is {what}: only matrix layers (nn.Linear and their "
                             f"QAT wrappers) and fused expert weights ('<experts>.gate_up_proj', '<experts>.down_proj')"
                             f" are calibrated")
        found[path] = module
    return found, experts


def _is_experts(module):
    return module is not None and is_fused(module) and ExpertsType.base_of(module) is not None


def _accumulators(found, experts):
    """Zero float64 sums ``(n_mat, in)`` and int64 counts ``(n_mat,)`` per collected path."""
    sums = {path: torch.zeros(1, m.weight.shape[1], dtype=torch.float64) for path, m in found.items()}
    counts = {path: np.zeros(1, np.int64) for path in found}
    for parent, (module, attrs) in experts.items():
        for attr in attrs:
            weight = getattr(module, attr)  # (E, out, in): a Parameter, or a converted layer's stored weight
            shape = tuple(getattr(weight, "array_shape", None) or weight.shape)
            sums[f"{parent}.{attr}"] = torch.zeros(shape[0], shape[-1], dtype=torch.float64)
            counts[f"{parent}.{attr}"] = np.zeros(shape[0], np.int64)
    return sums, counts


def _dense_hook(path, sums, counts):
    """A forward pre-hook adding a matrix's squared input rows (batches of ``MIN_ROWS`` or more)."""
    def hook(_module, inputs):
        rows = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
        if rows.shape[0] >= MIN_ROWS:
            sums[path][0] += rows.to(torch.float64).square().sum(0).cpu()
            counts[path][0] += rows.shape[0]
    return hook


def _expert_hook(module, attrs, sums, counts, prefix):
    """A forward hook adding each expert's squared inputs of ``attrs`` (and its routed pairs) to
    ``sums[prefix + attr]`` (``(E, in)``) and ``counts[...]`` (``(E,)``), as llama-imatrix's MUL_MAT_ID."""
    def hook(_module, args, kwargs, _output):
        hidden = args[0] if args else kwargs["hidden_states"]
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        hidden = hidden.detach().reshape(-1, hidden.shape[-1])
        index = index.reshape(hidden.shape[0], -1)
        weights = forward_weights(module) if "down_proj" in attrs else None
        for expert in range(counts[prefix + attrs[0]].shape[0]):
            rows = torch.where(index == expert)[0]
            if rows.numel() == 0:
                continue
            x = hidden[rows]
            inputs = {"gate_up_proj": x}
            if weights is not None:
                gate, up = nn.functional.linear(x, weights["gate_up_proj"][expert]).chunk(2, dim=-1)
                inputs["down_proj"] = module.act_fn(gate) * up
            for attr in attrs:
                sums[prefix + attr][expert] += inputs[attr].to(torch.float64).square().sum(0).cpu()
                counts[prefix + attr][expert] += rows.numel()
    return hook


def calibrate_importance(model, batches, *, layers, dataset="mixle.calibrate_importance"):
    """Sum the squared inputs of each input column of ``layers`` over ``batches``, as llama-imatrix.

    Args:
        model: a torch model (float or QAT-wrapped); it runs in eval mode under ``no_grad`` and is
            left in the mode it had.
        batches: an iterable of inputs: a tensor (e.g. token ids ``(B, T)``) is called as
            ``model(batch)``, a dict as ``model(**batch)``.
        layers: the model paths of the matrix layers to collect, and of fused expert weights
            (``"<experts>.gate_up_proj"``, ``"<experts>.down_proj"``); ``mixle.calibrate_importance``
            passes every matrix ``save_gguf`` writes.
        dataset: the calibration text's name, recorded as the file's ``imatrix.datasets``.

    Returns:
        ``Imatrix`` keyed by path: float32 sums ``(1, in)`` (experts: ``(E, in)``), int64 counts
        ``(1,)`` (experts: ``(E,)``, the tokens routed to each), ``chunk_count``
        the batches run and ``chunk_size`` the first batch's last dimension.

    Raises:
        ValueError: a path that is no matrix layer, or no batch reached a layer with 16 rows.

    >>> net = nn.Sequential(nn.Linear(4, 2))
    >>> m = calibrate_importance(net, [torch.ones(16, 4)], layers=["0"])
    >>> m.sums["0"].tolist(), m.counts["0"].tolist()
    ([[16.0, 16.0, 16.0, 16.0]], [16])
    """
    found, experts = _matrix_layers(model, layers)
    sums, counts = _accumulators(found, experts)
    modes = {m: m.training for m in model.modules()}
    handles = [module.register_forward_pre_hook(_dense_hook(path, sums, counts)) for path, module in found.items()] + [
        module.register_forward_hook(_expert_hook(module, attrs, sums, counts, f"{parent}."), with_kwargs=True)
        for parent, (module, attrs) in experts.items()]
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
    empty = sorted(path for path, count in counts.items() if not count.any())
    if empty:
        raise ValueError(f"calibrate_importance: layers {empty[:3]} saw no batch of at least {MIN_ROWS} input rows "
                         f"(llama-imatrix skips smaller ones), or no token was routed to them: pass batches of at "
                         f"least {MIN_ROWS} tokens")
    sums = {path: total.to(torch.float32).numpy() for path, total in sums.items()}
    return Imatrix(sums, counts, (str(dataset),), n_batches, chunk)


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
        parent, _, attr = path.rpartition(".")
        if isinstance(modules.get(parent), nn.Module) and isinstance(modules[parent]._modules.get(attr),
                                                                     QuantizedFusedWeight):
            _requantize_experts(modules[parent], attr, getattr(floats[parent], attr), values, path)
            continue
        layer = modules.get(path)
        if type(layer) is not QuantizedLinear or any(b is layer.codes for m in modules.values()
                                                     if m is not layer for b in m.buffers(recurse=False)):
            raise ValueError(f"importance given for layer {path!r}, which quantize_model did not make a QuantizedLinear "
                             f"of its own ({type(layer).__name__}): only untied linear layers take an importance")
        codes, scale, parts = to_storage(_weighted(floats[path].weight, layer.spec, values, path, 0))
        new = QuantizedLinear(codes, scale, layer.spec, layer.weight_shape, bias=layer.bias, dtype=layer.float_dtype,
                              **parts)
        new.train(layer.training)
        setattr(new, PATH_ATTRIBUTE, path)
        replacements[id(layer)] = new
    with Change() as change:
        return change.swap(converted, replacements)


def _weighted(weight, spec, values, path, batch_ndim):
    """``weight`` quantized by ggml's weighted search with ``values``, fields as torch tensors.

    The search runs on numpy (the same float32 operations as on torch, bit for bit, ~30x faster on CPU)."""
    array = weight.detach().to(torch.float32).cpu().numpy()
    values = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    q = quantize_array(array, spec, batch_ndim=batch_ndim, out_ndim=1, importance=values, name=f"layer {path!r}")
    fields = {name: torch.from_numpy(np.ascontiguousarray(getattr(q, name)))
              for name in ("codes", "scale", "offset", "sub_scales", "sub_offsets") if getattr(q, name) is not None}
    return dataclasses.replace(q, **fields)


def _requantize_experts(layer, attr, weight, values, path):
    """Replace converted experts ``layer``'s stored ``attr`` by ``weight`` quantized per expert with
    ``values`` ``(E, in)`` (one importance vector each), in place (a private copy's child)."""
    old = layer._modules[attr]
    codes, scale, parts = to_storage(_weighted(weight, old.spec, values, path, 1))
    new = QuantizedFusedWeight(codes, scale, old.spec, old.array_shape, old.KIND, **parts)
    new.train(old.training)
    layer._modules[attr] = new
