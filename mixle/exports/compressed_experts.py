"""Fused mixture-of-experts layers in compressed-tensors checkpoints (``save_pretrained_compressed``).

transformers 5 holds a layer's experts as one module of fused 3-D Parameters (``gate_up_proj``
``(E, 2I, H)``, ``down_proj`` ``(E, H, I)``), while compressed-tensors 0.20 packs 2-D Linear
weights only. transformers' compressed-tensors loader reads a MoE checkpoint in the per-expert
layout its own checkpoints have (``experts.N.gate_proj.weight_packed``, ``weight_scale``,
``weight_shape``, ...): it dequantizes each expert's Linear weights and merges them into the fused
Parameters (its conversion mapping for the model type). So a converted experts layer is written
as that layout: each expert's gate rows, up rows and down matrix become a ``QuantizedLinear`` of
exactly its codes and scales (whole rows: the per-row scales and groups move with them), which the
normal writer packs. The loaded model then computes with the fake-quantized expert weights.

Refused before anything is written, with the reason: float experts (transformers' loader drops
them beside a ``quantization_config``: "Concatenate on tensors destined for ...gate_up_proj.
Ckpt contains: 0"), an experts class whose checkpoint names are not in ``EXPERT_LINEAR_NAMES``,
and experts on another scheme than the model's other quantized Linear layers (the loader takes the
experts' scheme from the first class-targeted config group).
"""

from torch import nn

from mixle.core.numerics import QuantizedArray
from mixle.torch_backend.layers.expert_layers import ExpertsType, stored_arrays
from mixle.torch_backend.layers.quantized import QuantizedLinear, to_storage
from mixle.torch_backend.transforms.swap import Change

__all__ = ["EXPERT_LINEAR_NAMES", "check_experts", "unfuse_experts", "check_one_scheme"]

# experts class -> its checkpoint's per-expert Linear names of (gate rows, up rows, down), the ones
# transformers' conversion mapping merges into gate_up_proj / down_proj for the model type.
EXPERT_LINEAR_NAMES = {"Qwen3MoeExperts": ("gate_proj", "up_proj", "down_proj"),
                       "MixtralExperts": ("w1", "w3", "w2")}


def _fused(model):
    return [(path, module, ExpertsType.base_of(module)) for path, module in model.named_modules()
            if ExpertsType.base_of(module) is not None]


def check_experts(model):
    """Refuse fused experts a compressed-tensors checkpoint cannot hold (float ones, unknown classes).

    Returns:
        Whether ``model`` has fused experts (QAT or converted, of a known class).
    """
    found = _fused(model)
    for path, module, base in found:
        if base.__name__ not in EXPERT_LINEAR_NAMES:
            raise ValueError(
                f"layer {path!r} is a {base.__name__}, whose per-expert checkpoint names mixle does not know: "
                f"compressed-tensors stores experts as per-expert Linear weights, named as transformers' conversion "
                f"mapping reads them ({sorted(EXPERT_LINEAR_NAMES)} are known); nothing was written")
        if stored_arrays(module) is None:
            raise ValueError(
                f"save_pretrained_compressed cannot write this {type(model).__name__} with float experts ({path!r}, "
                f"a {type(module).__name__}): transformers' compressed-tensors loader reads a MoE checkpoint's experts "
                f"only as packed per-expert Linear weights and drops float ones beside a quantization_config "
                f"('Concatenate on tensors destined for ...gate_up_proj. Ckpt contains: 0'). Nothing was written: "
                f"quantize the experts too (apply_qat selects '.*experts'), or save_gguf / save_quantized")
    return bool(found)


def _expert_linears(arrays, spec, names):
    """``nn.ModuleList`` of per-expert holders of the three QuantizedLinear layers of one experts layer."""
    gate_up, down = arrays["gate_up_proj"], arrays["down_proj"]
    rows = gate_up.shape[1] // 2
    experts = nn.ModuleList()
    for expert in range(gate_up.shape[0]):
        holder = nn.Module()
        for name, array, take in ((names[0], gate_up, slice(0, rows)), (names[1], gate_up, slice(rows, 2 * rows)),
                                  (names[2], down, slice(None))):
            codes = array.codes[expert][take]
            scale = array.scale[expert].reshape(array.shape[1], -1)[take]  # whole rows: their scales move too
            stored_codes, stored_scale, parts = to_storage(QuantizedArray(codes, scale.reshape(1, -1, 1), spec, 0, 1))
            setattr(holder, name, QuantizedLinear(stored_codes, stored_scale, spec, tuple(codes.shape), **parts))
        experts.append(holder)
    return experts


def unfuse_experts(model):
    """Swap every converted experts layer of the private ``model`` for its per-expert QuantizedLinear
    layers (float experts, refused by ``check_experts``, are left as they are); returns how many.

    >>> unfuse_experts(nn.Sequential(nn.Linear(2, 2)))
    0
    """
    replacements = {id(module): _expert_linears(stored_arrays(module), module.spec, EXPERT_LINEAR_NAMES[base.__name__])
                    for _, module, base in _fused(model) if stored_arrays(module) is not None}
    if replacements:
        with Change() as change:
            change.swap(model, replacements)
    return len(replacements)


def check_one_scheme(groups, experts):
    """Refuse a MoE checkpoint whose experts and other quantized layers need two config groups.

    ``groups``: the writer's ``{weight args JSON: (args, [(path, layer)])}``; ``experts``: whether
    the model has fused experts (without, any number of groups loads).
    """
    if experts and len(groups) > 1:
        schemes = {json: sorted(path for path, _ in members)[:2] for json, (_, members) in groups.items()}
        raise ValueError(
            f"this mixture of experts would need {len(groups)} compressed-tensors config groups ({schemes}), but "
            f"transformers' loader dequantizes the experts with the first class-targeted group's scheme, so experts on "
            f"another scheme would load wrong; nothing was written: quantize the experts and the other Linear layers "
            f"with one spec")
