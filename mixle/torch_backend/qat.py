"""The torch half of apply_qat, set_fake_quant_enabled and get_qat_report.

``apply`` plans every decision first (which layers, which spec, why), then commits the plan
through one ``Change``, so a failure leaves the model exactly as it was. Which modules can be
wrapped, and how, comes from the records in ``layer_kinds``.
"""

from torch import nn

from mixle.core.numerics import block_shape
from mixle.core.report import LayerDecision, QATReport
from mixle.torch_backend.layer_kinds import QAT_TYPES, kind_of_float, kind_of_qat
from mixle.torch_backend.layers import check_supported
from mixle.torch_backend.swap import Change

REPORT_ATTRIBUTE = "_mixle_qat_report"
SELECTABLE = "nn.Linear"  # what patterns must match, in error messages


def float_reason(module, parent):
    """Why a Linear-like module cannot be fake-quantized by wrapping it, or None if it can.

    >>> float_reason(nn.Linear(2, 2), None) is None
    True
    """
    if isinstance(parent, nn.MultiheadAttention):
        return "nn.MultiheadAttention reads this weight directly, so a wrapper would never run"
    kind = kind_of_qat(module) or kind_of_float(module)
    if kind is not None and type(module) not in (kind.qat_type, *kind.float_types) and \
            type(module).forward not in {t.forward for t in kind.float_types}:
        return f"{type(module).__name__} overrides {kind.float_types[0].__name__}.forward; wrapping would change its maths"
    return None


def plan_inputs(model, selector):
    """``(named modules with repeats, parent of each module by id, its selectable layers)``, once
    every selector pattern is known to match a path (shared by apply_qat and apply_lora)."""
    entries = list(model.named_modules(remove_duplicate=False))
    parent_of = {}
    for _, module in entries:
        for child in module.children():
            parent_of.setdefault(id(child), module)
    layers = [(p, m) for p, m in entries if isinstance(m, nn.Linear)]
    selector.check_all_used([p for p, _ in layers], [p for p, _ in entries], SELECTABLE)
    return entries, parent_of, layers


def repeated_decision(path, kind, first):
    """The decision for a module met again under another path: the first one's, by reference."""
    return LayerDecision(path=path, kind=kind, action=first.action, reason=f"same module as {first.path!r}",
                         spec=first.spec)


def _tie_note(weight, tied):
    for path, module in tied:
        if module.weight is weight:
            return f"weight tied to embedding {path!r}"
    return ""


def apply(model, selector, reconfigure, example_inputs=None):
    """Torch half of ``apply_qat``: plan every decision, then swap, so failures change nothing."""
    if example_inputs is not None:
        raise ValueError(
            "example_inputs is only used for Flax models: the PyTorch backend wraps nn.Linear layers "
            "without running the model; drop example_inputs"
        )
    entries, parent_of, layers = plan_inputs(model, selector)
    tied = [(p, m) for p, m in entries if getattr(kind_of_qat(m) or kind_of_float(m), "tied_only", False)]
    enabled = _current_enabled(model)

    decisions, replacements, respecs, seen = [], {}, [], {}
    for path, module in layers:
        kind = type(module).__name__
        if id(module) in seen:
            decisions.append(repeated_decision(path, kind, seen[id(module)]))
            continue
        spec, reason = selector.decide(path)
        blocked = float_reason(module, parent_of.get(id(module)))
        if spec is not None and blocked:
            spec, reason = None, blocked
        if spec is None:
            if isinstance(module, QAT_TYPES):
                raise ValueError(
                    f"layer {path!r} is already fake-quantized but is not selected now ({reason}); "
                    f"apply_qat does not unwrap: use set_fake_quant_enabled(model, False) or rebuild the model"
                )
            decision = LayerDecision(path=path, kind=kind, action="skipped", reason=reason)
        else:
            action = _plan_layer(path, module, spec, reconfigure, enabled, replacements, respecs)
            decision = LayerDecision(path=path, kind=kind, action=action, reason=reason, spec=spec,
                                     note=_tie_note(module.weight, tied))
        seen[id(module)] = decision
        decisions.append(decision)

    decisions += _plan_tied(tied, layers, decisions, replacements, respecs, selector, enabled)

    with Change() as change:
        root = change.swap(model, replacements)
        for layer, spec in respecs:
            change.set(layer, "spec", spec)
        change.set(root, REPORT_ATTRIBUTE, QATReport(decisions))
    return root


def _plan_layer(path, module, spec, reconfigure, enabled, replacements, respecs):
    """The action for one selected layer; records its replacement or new spec."""
    try:
        check_supported(spec)
        kind = kind_of_qat(module)
        if module.weight.numel() == 0:
            raise ValueError(f"its weight is empty (shape {list(module.weight.shape)}): there is nothing to "
                             f"quantize; leave it out with exclude=[{path!r}] or drop the layer")
        if kind is None:
            replacements[id(module)] = kind_of_float(module).wrap(module, spec, enabled)
            return "wrapped"
        if module.spec == spec:
            return "unchanged"
        if not reconfigure:
            raise ValueError(
                f"it is already fake-quantized with {module.spec.short()}, not {spec.short()}: pass "
                f"reconfigure=True to change the spec"
            )
        block_shape(module.weight.shape, spec)  # raises if group_size does not divide the input size
        respecs.append((module, spec))
        return "reconfigured"
    except ValueError as err:
        raise ValueError(f"layer {path!r}: {err}") from None


def _plan_tied(tied, layers, decisions, replacements, respecs, selector, enabled):
    """Modules sharing a weight with a quantized layer get the same spec (one stored copy)."""
    spec_of_weight = {}
    for (path, module), decision in zip(layers, decisions):
        if decision.spec is not None:
            spec_of_weight.setdefault(id(module.weight), (path, decision.spec))
    extra, seen = [], set()
    for path, module in tied:
        if id(module) in seen:
            continue
        seen.add(id(module))
        if id(module.weight) not in spec_of_weight:
            if isinstance(module, QAT_TYPES):
                raise ValueError(f"embedding {path!r} is fake-quantized but its tied Linear is not selected now")
            continue
        head_path, spec = spec_of_weight[id(module.weight)]
        own_reason = selector.decide(path)[1]
        if own_reason.startswith("excluded"):
            raise ValueError(
                f"embedding {path!r} shares its weight with {head_path!r}, which is selected, but it is "
                f"{own_reason}: a tied weight is stored once, so exclude both or neither"
            )
        reason = f"weight tied to {head_path!r}: lookups use the same quantized weight"
        if kind_of_qat(module) is not None:
            action = "unchanged" if module.spec == spec else "reconfigured"
            if action == "reconfigured":
                respecs.append((module, spec))
        else:
            action = "wrapped"
            replacements[id(module)] = kind_of_float(module).wrap(module, spec, enabled)
        extra.append(LayerDecision(path=path, kind=type(module).__name__, action=action, reason=reason, spec=spec))
    return extra


def qat_layers(model):
    """The QAT layers of a model (each once)."""
    return [m for m in model.modules() if isinstance(m, QAT_TYPES)]


def _current_enabled(model):
    """New wrappers follow the model's toggle state if it already has wrappers."""
    states = {m.enabled for m in qat_layers(model)}
    return states.pop() if len(states) == 1 else True


def set_enabled(model, enabled):
    """Torch half of ``set_fake_quant_enabled``."""
    wrappers = qat_layers(model)
    if not wrappers:
        raise ValueError("the model has no QAT layers to toggle: call apply_qat(model, ...) first")
    for wrapper in wrappers:
        wrapper.enabled = enabled
    return model


def report(model):
    """Torch half of ``get_qat_report``."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module  # apply_qat ran on the model before it was wrapped
    found = getattr(model, REPORT_ATTRIBUTE, None)
    if found is None:
        raise ValueError("the model has no QAT report: call apply_qat(model, ...) first")
    return found
