"""The in-place LoRA passes on torch models: apply adapters, merge them into the base, report."""

import torch

from mixle.core.numerics import block_shape
from mixle.core.report import LayerDecision, QATReport
from mixle.torch_backend.layers.expert_layers import LORA_REASON, ExpertsType
from mixle.torch_backend.layers.qat import QATWrapper, check_supported, plain_linear
from mixle.torch_backend.layers.lora import LoRALinear, QATLoRALinear
from mixle.torch_backend.transforms.apply import decide_layers, plan_inputs, unblocked
from mixle.torch_backend.transforms.swap import Change

REPORT_ATTRIBUTE = "_mixle_lora_report"


def _parameter_holders(entries):
    """id(Parameter) -> [(path, module)] of every distinct module holding it directly."""
    holders, seen = {}, set()
    for path, module in entries:
        if id(module) in seen:
            continue
        seen.add(id(module))
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append((path, module))
    return holders


def _sharing_note(module, holders):
    """Text naming another module that holds this layer's weight or bias, or ''."""
    for param in (module.weight, module.bias):
        if param is None:
            continue
        others = [p for p, m in holders.get(id(param), []) if m is not module]
        if others:
            return f"its weight is shared with {others[0]!r}"
    return ""


def _check_layer(path, module, lora):
    """Raise ValueError if ``lora`` cannot be applied to this layer's shape."""
    limit = min(module.in_features, module.out_features)
    if lora.rank > limit:
        raise ValueError(
            f"rank={lora.rank} is larger than min(in_features, out_features)={limit} of layer {path!r} "
            f"({module.in_features} -> {module.out_features}): use rank <= {limit}, or exclude the layer"
        )
    spec = lora.adapter_spec
    if spec is not None:
        check_supported(spec)
        for name, shape in (("lora_A", (lora.rank, module.in_features)), ("lora_B", (module.out_features, lora.rank))):
            try:
                block_shape(shape, spec)
            except ValueError as err:
                raise ValueError(f"adapter_spec does not fit {path!r}.{name}: {err}") from None


def apply_lora(model, selector, train_base):
    """Torch half of ``apply_lora``: plan every decision, then swap, so failures change nothing."""
    # Fused experts are listed too, to be reported (and refused when named) with the reason.
    entries, parent_of, linears = plan_inputs(
        model, selector, lambda m: isinstance(m, torch.nn.Linear) or ExpertsType.base_of(m) is not None, "nn.Linear")
    holders = _parameter_holders(entries)

    replacements = {}

    def choose(path, module, decided):
        kind = type(module).__name__
        if not isinstance(module, torch.nn.Linear):
            return LayerDecision(path=path, kind=kind, action="skipped", reason=LORA_REASON)
        lora, reason = unblocked(selector.decide(path), module, parent_of.get(id(module)))
        shared = _sharing_note(module, holders)
        if lora is not None and shared:
            lora, reason = None, f"{shared}: merging an adapter would change it there too"
        if lora is None:
            if isinstance(module, LoRALinear):
                raise ValueError(
                    f"layer {path!r} has a LoRA adapter but is not selected now ({reason}); apply_lora "
                    f"does not remove adapters: merge_lora(model) folds them into the weights"
                )
            return LayerDecision(path=path, kind=kind, action="skipped", reason=reason)
        _check_layer(path, module, lora)
        if isinstance(module, LoRALinear):
            if module.lora_spec != lora:
                raise ValueError(
                    f"layer {path!r} already has an adapter ({module.lora_spec.short()}), not "
                    f"{lora.short()}: merge_lora(model) first, then apply_lora with the new settings"
                )
            return LayerDecision(path=path, kind=kind, action="unchanged", reason=reason, spec=lora)
        if isinstance(module, QATWrapper) and getattr(module, "importance", None) is not None:
            raise ValueError(f"layer {path!r} is fake-quantized with an importance matrix, which LoRA layers do not "
                             f"carry: apply_lora before apply_qat(importance=) is refused too, so leave this layer "
                             f"out (exclude=[{path!r}]) or apply_qat without importance")
        if isinstance(module, QATWrapper):
            replacements[id(module)] = QATLoRALinear(plain_linear(module), lora, module.spec, enabled=module.enabled)
        else:
            replacements[id(module)] = LoRALinear(module, lora)
        return LayerDecision(path=path, kind=kind, action="wrapped", reason=reason, spec=lora)

    decisions = decide_layers(linears, choose)

    if not any(d.action != "skipped" for d in decisions):
        reasons = sorted({f"{d.path!r}: {d.reason}" for d in decisions})[:6]
        raise ValueError(f"apply_lora selected no nn.Linear layer it can adapt, so nothing would train: {reasons}")

    adapters = {id(p) for m in model.modules() if isinstance(m, LoRALinear) for p in (m.lora_A, m.lora_B)}
    adapters |= {id(p) for m in replacements.values() for p in (m.lora_A, m.lora_B)}
    to_freeze = [] if train_base else [p for p in model.parameters() if p.requires_grad and id(p) not in adapters]

    with Change() as change:
        root = change.swap(model, replacements)
        for param in to_freeze:
            change.requires_grad(param, False)
        change.set(root, REPORT_ATTRIBUTE, QATReport(decisions, done="adapted", left="without adapter"))
    return root


def merge_lora(model):
    """Torch half of ``merge_lora``: check everything, then fold and swap layer by layer."""
    entries = list(model.named_modules(remove_duplicate=False))
    layers = {}
    for path, module in entries:
        if isinstance(module, LoRALinear):
            layers.setdefault(id(module), (path, module))
    if not layers:
        raise ValueError("merge_lora found no LoRA adapters in the model: add them with apply_lora(model, rank=..., alpha=...)")
    holders = _parameter_holders(entries)
    for path, module in layers.values():
        shared = _sharing_note(module, holders)
        if shared:
            raise ValueError(f"cannot merge the adapter of {path!r}: {shared}, which would change too")
        if not all(bool(torch.isfinite(p).all()) for p in (module.lora_A, module.lora_B)):
            raise ValueError(f"cannot merge the adapter of {path!r}: lora_A or lora_B holds NaN or infinity, "
                             f"which would spread into the base weight; find where training diverged")
    replacements = {key: module.base_layer() for key, (_, module) in layers.items()}

    with Change() as change:
        for _, module in layers.values():
            change.copy_(module.weight, module.merged_weight())
        root = change.swap(model, replacements)
        change.delete(root, REPORT_ATTRIBUTE)  # it described adapters that no longer exist
    return root


def lora_report(model):
    report = getattr(model, REPORT_ATTRIBUTE, None)
    if report is None:
        raise ValueError("the model has no LoRA report: call apply_lora(model, rank=..., alpha=...) first")
    return report


def lora_parameters(model):
    layers = {id(m): m for m in model.modules() if isinstance(m, LoRALinear)}
    if not layers:
        raise ValueError("the model has no LoRA adapters: call apply_lora(model, rank=..., alpha=...) first")
    return [p for m in layers.values() for p in (m.lora_A, m.lora_B)]
