"""The torch half of apply_qat, set_fake_quant_enabled and get_qat_report.

``apply`` plans every decision first (which layers, which spec, why), then commits the plan
through one ``Change``, so a failure leaves the model exactly as it was. Which modules can be
wrapped, and how, comes from the records in ``layer_kinds``.
"""

from torch import nn

from mixle.core.numerics import block_shape
from mixle.core.report import LayerDecision, QATReport
from mixle.torch_backend.layers.layer_kinds import OPT_IN, QAT_TYPES, kind_of_float, kind_of_qat
from mixle.torch_backend.layers import learned_scale
from mixle.torch_backend.layers.qat import PATH_ATTRIBUTE, QATWrapper, check_supported, checked_importance
from mixle.torch_backend.layers.lora import LoRALinear
from mixle.torch_backend.layers.mha_layers import unsupported_reason
from mixle.torch_backend.transforms.swap import Change

REPORT_ATTRIBUTE = "_mixle_qat_report"
# What patterns must match, in error messages.
SELECTABLE = "nn.Linear, Conv1D, nn.MultiheadAttention, nn.Embedding or nn.Conv1d/2d (or fused MoE experts/router)"
ADAPTER_REASON = "adapter: trained in float beside the quantized base; merge it before convert"


def float_reason(module, parent):
    """Why a Linear-like module cannot be fake-quantized by wrapping it, or None if it can.

    >>> float_reason(nn.Linear(2, 2), None) is None
    True
    """
    if isinstance(parent, nn.MultiheadAttention):
        return "nn.MultiheadAttention reads this weight directly, so a wrapper would never run"
    if isinstance(module, nn.MultiheadAttention):
        return unsupported_reason(module)
    kind = kind_of_qat(module) or kind_of_float(module)
    if kind is None:
        return None
    types = kind.forward_types(module)
    if type(module) not in types and type(module).forward not in {t.forward for t in types}:
        return f"{type(module).__name__} overrides {types[1].__name__}.forward; wrapping would change its maths"
    return None


def _kind(module):
    return kind_of_qat(module) or kind_of_float(module)


def _weight(module):
    return _kind(module).weight_of(module)


def _weights(module):
    return _kind(module).weights_of(module).values()


def _part_paths(layers):
    """``{path: why it cannot be selected}`` for the parts of a fused experts module a pattern may
    name (an expert ``<path>.<i>``, a weight ``<path>.<name>``): they are slices of one Parameter."""
    out = {}
    for path, module in layers:
        kind = _kind(module)
        if not kind.batch_axes:
            continue
        weights = kind.weights_of(module)
        shapes = ", ".join(f"{name} {list(w.shape)}" for name, w in weights.items())
        why = (f"the experts of {path!r} are one fused Parameter per weight ({shapes}), quantized with one spec: "
               f"select or exclude the whole module {path!r}")
        count = int(next(iter(weights.values())).shape[0])
        prefix = f"{path}." if path else ""
        out.update({f"{prefix}{i}": f"it names expert {i}, but {why}" for i in range(count)})
        out.update({f"{prefix}{name}": f"it names the weight {name!r}, but {why}" for name in weights})
    return out


def adapter_ids(model):
    """``(module ids, parameter ids)`` of the adapters in ``model``: PEFT tuner layers' adapter
    modules (found by PEFT's ``adapter_layer_names``, without importing peft) and mixle LoRA's."""
    modules, params = set(), set()
    for module in model.modules():
        names = getattr(module, "adapter_layer_names", None)
        if isinstance(names, tuple) and hasattr(module, "get_base_layer"):
            for name in names:
                holder = getattr(module, name, None)
                if isinstance(holder, nn.Module):
                    modules |= {id(m) for m in holder.modules()}
                    params |= {id(p) for p in holder.parameters()}
        if isinstance(module, LoRALinear):
            params |= {id(module.lora_A), id(module.lora_B)}
    return modules, params


def plan_inputs(model, selector, selectable=None, label=SELECTABLE):
    """``(named modules with repeats, parent of each module by id, its selectable layers)``, once
    every selector pattern is known to match a path (shared by apply_qat and apply_lora).

    ``selectable(module)`` picks the layers (default: every module a layer kind takes, adapters
    excepted); ``label`` names them in the error for a pattern that matches none.
    """
    entries = list(model.named_modules(remove_duplicate=False))
    parent_of = {}
    for _, module in entries:
        for child in module.children():
            parent_of.setdefault(id(child), module)
    if selectable is None:
        adapters = adapter_ids(model)[0]
        selectable = lambda m: _kind(m) is not None and id(m) not in adapters  # noqa: E731
    layers = [(p, m) for p, m in entries if selectable(m)]
    fused = [(p, m) for p, m in entries if _kind(m) is not None and _kind(m).batch_axes]
    selector.check_all_used([p for p, _ in layers], [p for p, _ in entries], label, _part_paths(fused))
    return entries, parent_of, layers


def decide_layers(layers, choose, skip=frozenset()):
    """One decision per selectable layer (shared by apply_qat and apply_lora).

    ``choose(path, module, decided) -> LayerDecision`` decides a layer met for the first time
    (``decided``: the decisions so far, by module id); a module met again under another path
    repeats its first decision by reference; modules whose id is in ``skip`` are left out.
    """
    decisions, decided = [], {}
    for path, module in layers:
        if id(module) in skip:
            continue
        first = decided.get(id(module))
        if first is not None:
            decisions.append(LayerDecision(path=path, kind=type(module).__name__, action=first.action,
                                           reason=f"same module as {first.path!r}", spec=first.spec))
            continue
        decided[id(module)] = decision = choose(path, module, decided)
        decisions.append(decision)
    return decisions


def unblocked(choice, module, parent):
    """The selector's ``(spec, reason)`` for a layer, or ``(None, why)`` when it cannot be wrapped."""
    blocked = float_reason(module, parent)
    return (None, blocked) if choice[0] is not None and blocked else choice


def _tie_note(weight, tied):
    for path, module in tied:
        if _weight(module) is weight:
            return f"weight tied to embedding {path!r}"
    return ""


def _opt_in_names(selector):
    unknown = [name for name in selector.opt_in if name not in OPT_IN]
    if unknown:
        raise ValueError(f"opt_in={selector.opt_in!r} names {unknown}, which are not opt-in layer kinds of the "
                         f"torch backend: choose from {list(OPT_IN)}")
    return set(selector.opt_in)


def _naming_rules(selector, layers):
    """Patterns that match only opt-in layers: they select them even without ``opt_in``."""
    broad = selector.matching_rules([p for p, m in layers if not _kind(m).opt_in])
    return selector.matching_rules([p for p, m in layers if _kind(m).opt_in]) - broad


def _decide(path, module, selector, opt_in, naming):
    """``(spec or None, reason)`` for one layer: the selector's, unless its kind is opt-in and
    was not asked for."""
    spec, reason = selector.decide(path)
    kind = _kind(module)
    if spec is None or not kind.opt_in:
        return spec, reason
    if kind.opt_in_name in opt_in:
        return spec, f"{reason}; opt_in={kind.opt_in_name!r}"
    if kind_of_qat(module) is not None:  # opted in before: applying again keeps it
        return spec, f"{reason}; already fake-quantized"
    if selector.rule_for(path) in naming:
        return spec, reason
    return None, kind.opt_in_reason or (f"not selected: {kind.opt_in_name} layers are opt-in (pass opt_in=({kind.opt_in_name!r},) "
                                        f"or a pattern matching only them)")


def apply(model, selector, reconfigure, example_inputs=None, importance=None):
    """Torch half of ``apply_qat``: plan every decision, then swap, so failures change nothing.
    ``importance``: ``{layer path: values}`` the linear layers hold (``QATWrapper(importance=)``)."""
    if example_inputs is not None:
        raise ValueError(
            "example_inputs is only used for Flax models: the PyTorch backend wraps nn.Linear layers "
            "without running the model; drop example_inputs"
        )
    opt_in = _opt_in_names(selector)
    entries, parent_of, layers = plan_inputs(model, selector)
    naming = _naming_rules(selector, layers)
    leaders = {id(_weight(m)) for _, m in layers if not _kind(m).follows_tie}
    tied = [(p, m) for p, m in layers if _kind(m).follows_tie and id(_weight(m)) in leaders]
    tied_ids = {id(m) for _, m in tied}
    enabled = _current_enabled(model)

    replacements, respecs, counted = {}, [], set()

    def choose(path, module, decided):
        kind = type(module).__name__
        parent = parent_of.get(id(module))
        if isinstance(parent, nn.MultiheadAttention) and module is parent.out_proj:
            return _out_proj_decision(path, module, decided.get(id(parent)), selector, counted)
        spec, reason = unblocked(_decide(path, module, selector, opt_in, naming), module, parent)
        elements = sum(_count(w, counted) for w in _weights(module))
        if spec is None:
            if isinstance(module, QAT_TYPES):
                raise ValueError(
                    f"layer {path!r} is already fake-quantized but is not selected now ({reason}); "
                    f"apply_qat does not unwrap: use set_fake_quant_enabled(model, False) or rebuild the model"
                )
            return LayerDecision(path=path, kind=kind, action="skipped", reason=reason, elements=elements)
        action = _plan_layer(path, module, spec, reconfigure, enabled, replacements, respecs)
        return LayerDecision(path=path, kind=kind, action=action, reason=reason, spec=spec,
                             note=_tie_note(_weight(module), tied), elements=elements)

    # tied modules follow the layer they share their weight with: planned below
    decisions = decide_layers(layers, choose, skip=tied_ids)
    asked = lambda path, module: _decide(path, module, selector, opt_in, naming)[0] is not None  # noqa: E731
    decisions += _plan_tied(tied, layers, decisions, replacements, respecs, selector, enabled, asked)
    decisions += _unquantizable(model, counted)
    held = _plan_importance(importance or {}, decisions, dict(layers), replacements, reconfigure)

    with Change() as change:
        root = change.swap(model, replacements)
        for layer, spec in respecs:
            change.set(layer, "spec", spec)
        for layer, values in held:
            change.set(layer, "importance", values)
        change.set(root, REPORT_ATTRIBUTE, QATReport(decisions))
    return root


def _plan_importance(importance, decisions, modules, replacements, reconfigure):
    """``[(QAT linear layer, float32 importance or None)]`` for ``importance``'s entries, each checked
    (layer, grid, values) before anything changes."""
    planned, held = {d.path: d for d in decisions}, []
    for path, values in importance.items():
        decision, module = planned.get(path), modules.get(path)
        if decision is None or decision.spec is None or module is None:
            why = "no layer apply_qat takes has this path" if decision is None else decision.reason
            raise ValueError(f"importance has an entry for layer {path!r}, which apply_qat does not fake-quantize "
                             f"({why}): drop the entry or select the layer")
        layer = replacements.get(id(module), module)
        if type(layer) is not QATWrapper or decision.note:
            what = decision.note or f"a {type(module).__name__} ({_kind(module).name} layer)"
            if not isinstance(layer, QATWrapper) and isinstance(module, nn.Linear) and not decision.note:
                what = decision.reason
            raise ValueError(f"layer {path!r}: importance= is taken only by plain linear layers, quantized on their "
                             f"own as llama-quantize --imatrix quantizes one matrix, and this one is {what}: drop "
                             f"its entry")
        try:
            values = checked_importance(decision.spec, values, tuple(layer.weight.shape), name="weight",
                                        learned=learned_scale.is_learned(decision.spec))
        except ValueError as err:
            raise ValueError(f"layer {path!r}: {err}") from None
        old = layer._buffers.get("importance")
        if id(module) not in replacements and not reconfigure and not _same(old, values):
            raise ValueError(f"layer {path!r} is already fake-quantized with another importance (or none): pass "
                             f"reconfigure=True to change it")
        held.append((layer, None if values is None else values.to(layer.weight.device)))
    return held


def _same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and bool((a.cpu() == b).all()))


def _out_proj_decision(path, module, attention, selector, counted):
    """An MHA's ``out_proj`` is read by the MHA itself: it is fake-quantized with it, or not at all."""
    kind, elements = type(module).__name__, _count(module.weight, counted)
    if attention is None or attention.spec is None:
        where = f" {attention.path!r}" if attention is not None else ""
        return LayerDecision(path=path, kind=kind, action="skipped", elements=elements,
                             reason=f"nn.MultiheadAttention{where} reads this weight directly and is not "
                                    f"quantized, so neither is this weight")
    own = selector.decide(path)[1]
    if own.startswith("excluded"):
        raise ValueError(f"layer {path!r} is {own}, but its nn.MultiheadAttention {attention.path!r} is selected "
                         f"and fake-quantizes in_proj and out_proj together: exclude both or neither")
    return LayerDecision(path=path, kind=kind, action=attention.action, spec=attention.spec, elements=elements,
                         reason=f"read by nn.MultiheadAttention {attention.path!r}: quantized with it")


def _count(weight, counted):
    """``weight``'s element count the first time it is met, else 0 (a weight is counted once)."""
    if weight is None or id(weight) in counted or not weight.is_floating_point() or weight.dim() < 2:
        return 0
    counted.add(id(weight))
    return weight.numel()


def _unquantizable(model, counted):
    """Decisions for the floating-point parameters of two or more dimensions no layer kind took:
    adapters and the weights of layer types mixle does not quantize."""
    modules = dict(model.named_modules())
    adapters = adapter_ids(model)[1]
    extra = []
    for name, param in model.named_parameters():
        if id(param) in counted or not param.is_floating_point() or param.dim() < 2:
            continue
        owner = modules.get(name.rpartition(".")[0], model)
        if id(param) in adapters:
            reason = ADAPTER_REASON
        elif isinstance(owner, nn.MultiheadAttention):
            reason = f"unsupported type: nn.MultiheadAttention reads {name.rpartition('.')[2]} directly"
        else:
            reason = f"unsupported type: mixle has no QAT layer for {type(owner).__name__}"
        extra.append(LayerDecision(path=name, kind=type(owner).__name__, action="skipped", reason=reason,
                                   elements=_count(param, counted)))
    return extra


def _plan_layer(path, module, spec, reconfigure, enabled, replacements, respecs):
    """The action for one selected layer; records its replacement or new spec."""
    try:
        check_supported(spec)
        kind = kind_of_qat(module)
        (kind or kind_of_float(module)).check_spec(spec)
        if _weight(module).numel() == 0:
            raise ValueError(f"its weight is empty (shape {list(_weight(module).shape)}): there is nothing to "
                             f"quantize; leave it out with exclude=[{path!r}] or drop the layer")
        if kind is None:
            replacements[id(module)] = kind_of_float(module).wrap(module, spec, enabled)
            setattr(replacements[id(module)], PATH_ATTRIBUTE, path)
            return "wrapped"
        if module.spec == spec:
            return "unchanged"
        if not reconfigure:
            raise ValueError(
                f"it is already fake-quantized with {module.spec.short()}, not {spec.short()}: pass "
                f"reconfigure=True to change the spec"
            )
        for weight in _weights(module):  # raises if group_size does not divide the input size
            block_shape(kind.stored_shape(weight.shape[kind.batch_axes:]), spec)
        respecs.append((module, spec))
        return "reconfigured"
    except ValueError as err:
        raise ValueError(f"layer {path!r}: {err}") from None


def _plan_tied(tied, layers, decisions, replacements, respecs, selector, enabled, asked):
    """Modules sharing a weight with a quantized layer get the same spec (one stored copy)."""
    module_of, spec_of_weight, path_of_weight = dict(layers), {}, {}
    for path, module in layers:
        if not _kind(module).follows_tie:
            path_of_weight.setdefault(id(_weight(module)), path)
    for decision in decisions:
        if decision.spec is not None and decision.path in module_of:
            spec_of_weight.setdefault(id(_weight(module_of[decision.path])), (decision.path, decision.spec))
    extra, seen = [], set()
    for path, module in tied:
        kind_name = type(module).__name__
        if id(module) in seen:
            continue
        seen.add(id(module))
        if id(_weight(module)) not in spec_of_weight:
            if isinstance(module, QAT_TYPES):
                raise ValueError(f"embedding {path!r} is fake-quantized but its tied Linear is not selected now")
            if asked(path, module):  # asked for by name or opt_in: say why it stays float
                extra.append(LayerDecision(path=path, kind=kind_name, action="skipped",
                                           reason=f"tied: its weight is {path_of_weight[id(_weight(module))]!r}'s, "
                                                  f"which is not selected"))
            continue
        head_path, spec = spec_of_weight[id(_weight(module))]
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
            try:
                replacements[id(module)] = kind_of_float(module).wrap(module, spec, enabled)
                setattr(replacements[id(module)], PATH_ATTRIBUTE, path)
            except ValueError as err:
                raise ValueError(f"layer {path!r}: {err}") from None
        extra.append(LayerDecision(path=path, kind=kind_name, action=action, reason=reason, spec=spec))
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
