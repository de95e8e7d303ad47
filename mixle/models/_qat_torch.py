"""PyTorch QAT backend: the straight-through fake-quant op and the QATWrapper Linear layer."""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from mixle.models.qat_report import LayerDecision, QATReport
from mixle.models.selection import LayerSelector
from mixle.models._fake_quant_torch import (  # noqa: F401  (fake_quantize_tensor is re-exported)
    _FakeQuantSTE,
    fake_quantize_tensor,
    fake_quantized_weight,
    invalidate_caches,
    linear,
)
from mixle.task.spec import QuantSpec

REPORT_ATTRIBUTE = "_mixle_qat_report"
# A Linear subclass defining this method (e.g. a LoRA layer) builds its own fake-quantized
# replacement, a QATWrapper subclass: method(spec, enabled) -> layer.
WRAP_HOOK = "_mixle_wrap_qat"


def check_supported(spec):
    """Refuse spec options this backend cannot honour (the torch backend does weights only)."""
    base = QuantSpec()
    torch_fields = {"bits", "grid", "granularity", "group_size", "clip_percentile", "clip_gradient"}
    for field in dataclasses.fields(spec):
        if field.name not in torch_fields and getattr(spec, field.name) != getattr(base, field.name):
            raise ValueError(
                f"QuantSpec.{field.name}={getattr(spec, field.name)!r} is not supported by the PyTorch "
                f"backend, which fake-quantizes Linear weights only: leave it at its default "
                f"({getattr(base, field.name)!r}) for torch models"
            )


def _adopt_hooks(wrapper, original):
    """Keep the user's hooks (forward, backward, state-dict) of ``original`` working on ``wrapper``."""
    for name, value in vars(original).items():
        if name.endswith("hooks") or name.endswith("hooks_with_kwargs") or name.endswith("always_called"):
            setattr(wrapper, name, value)


class QATWrapper(nn.Linear):
    """An ``nn.Linear`` whose weight is fake-quantized in the forward while enabled.

    It reuses the wrapped layer's ``weight`` and ``bias`` Parameter objects (no copies), so tied
    weights stay tied, ``state_dict()`` keys do not change and an existing optimizer keeps
    training the same tensors. Train and eval mode both fake-quantize while ``enabled``.

    Args:
        linear: the ``nn.Linear`` to wrap (not itself a QATWrapper).
        spec: QuantSpec; or pass its fields as keywords (default int4 per-channel symmetric).
        enabled: fake-quantize in the forward (False computes exactly ``nn.Linear``).

    >>> layer = QATWrapper(nn.Linear(4, 2), bits=8)
    >>> layer.weight.shape, layer.spec.bits
    (torch.Size([2, 4]), 8)
    """

    def __init__(self, linear, spec=None, *, enabled=True, **spec_fields):
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"QATWrapper wraps an nn.Linear, got {type(linear).__name__}")
        if isinstance(linear, QATWrapper):
            raise TypeError("linear is already a QATWrapper: wrappers never nest; change its .spec instead")
        if spec is None:
            spec = QuantSpec(**spec_fields)
        elif spec_fields:
            raise TypeError(f"pass either spec=... or its fields {sorted(spec_fields)}, not both")
        if not isinstance(spec, QuantSpec):
            raise TypeError(f"spec must be a mixle QuantSpec, got {type(spec).__name__}")
        check_supported(spec)
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be True or False, got {enabled!r}")
        if spec.granularity == "group":
            from mixle.task.quantize import block_shape

            block_shape(linear.weight.shape, spec)  # raises if group_size does not divide in_features
        nn.Module.__init__(self)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        _adopt_hooks(self, linear)
        self.training = linear.training
        self.spec = spec
        self.enabled = enabled

    def quantized_weight(self):
        """The fake-quantized weight (with STE gradient) this layer uses while enabled.

        Computed once per version of the weight and reused until an in-place change, an
        optimizer step or ``load_state_dict`` (see ``mixle.models._fake_quant_torch``).
        """
        return fake_quantized_weight(self.weight, self.spec)[0]

    def forward(self, x):
        if not self.enabled:
            return F.linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias, self.spec)

    def _load_from_state_dict(self, *args, **kwargs):
        invalidate_caches()  # loaded weights must be quantized afresh, even where FSDP2 hides the change
        super()._load_from_state_dict(*args, **kwargs)

    def extra_repr(self):
        state = "on" if self.enabled else "off"
        return f"{super().extra_repr()}, qat={self.spec.short()} ({state})"

    def unwrap(self):
        """A plain ``nn.Linear`` sharing this layer's Parameters."""
        linear = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = self.in_features, self.out_features
        linear.weight, linear.bias = self.weight, self.bias
        linear.training = self.training
        return linear


class QATEmbedding(nn.Embedding):
    """An ``nn.Embedding`` tied to a fake-quantized head: lookups use the same quantized weight.

    A tied weight is stored once as integers after conversion, so training must see the
    quantized table in both uses. Created by ``apply_qat`` only for embeddings whose weight is
    shared with a wrapped Linear; shares the Parameter like ``QATWrapper``.
    """

    def __init__(self, embedding, spec, *, enabled=True):
        if embedding.sparse:
            raise ValueError("a sparse nn.Embedding cannot be fake-quantized (its gradient would be dense)")
        nn.Module.__init__(self)
        for name in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                     "scale_grad_by_freq", "sparse"):
            setattr(self, name, getattr(embedding, name))
        self.weight = embedding.weight
        _adopt_hooks(self, embedding)
        self.training = embedding.training
        self.spec = spec
        self.enabled = enabled

    def forward(self, x):
        # shared: the tied head uses this weight too, so its codes are kept for that second use.
        weight = fake_quantized_weight(self.weight, self.spec, shared=True)[0] if self.enabled else self.weight
        return F.embedding(x, weight, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)

    def _load_from_state_dict(self, *args, **kwargs):
        invalidate_caches()
        super()._load_from_state_dict(*args, **kwargs)

    def extra_repr(self):
        state = "on" if self.enabled else "off"
        return f"{super().extra_repr()}, qat={self.spec.short()} ({state}, tied)"


_QAT_LAYERS = (QATWrapper, QATEmbedding)


def _float_reason(module, parent):
    """Why a Linear cannot be fake-quantized by wrapping, or None if it can."""
    if isinstance(parent, nn.MultiheadAttention):
        return "nn.MultiheadAttention reads this weight directly, so a wrapper would never run"
    if hasattr(module, WRAP_HOOK):
        return None
    if type(module) not in (nn.Linear, QATWrapper) and type(module).forward is not nn.Linear.forward:
        return f"{type(module).__name__} overrides nn.Linear.forward; wrapping would change its maths"
    return None


def _tie_note(weight, embeddings):
    for path, emb in embeddings:
        if emb.weight is weight:
            return f"weight tied to embedding {path!r}"
    return ""


def _plan_inputs(model, selector):
    """``(named modules with repeats, parent of each module by id, its nn.Linear layers)``, once
    every selector pattern is known to match a path (shared by apply_qat and apply_lora)."""
    entries = list(model.named_modules(remove_duplicate=False))
    parent_of = {}
    for _, module in entries:
        for child in module.children():
            parent_of.setdefault(id(child), module)
    linears = [(p, m) for p, m in entries if isinstance(m, nn.Linear)]
    selector.check_all_used([p for p, _ in linears], [p for p, _ in entries], "nn.Linear")
    return entries, parent_of, linears


def _repeated(path, kind, first):
    """The decision for a module met again under another path: the first one's, by reference."""
    return LayerDecision(path=path, kind=kind, action=first.action, reason=f"same module as {first.path!r}",
                         spec=first.spec)


def _swap_in(entries, replacements, then=None):
    """Commit a plan: put each replacement (keyed by the id of the module it replaces) into every
    parent, then run ``then``. Nothing here fails on valid input; if anything does, the swaps are
    undone before the error propagates, so the model is as it was."""
    swapped = []
    try:
        for _, module in entries:
            for name, child in list(module.named_children()):
                if id(child) in replacements:
                    setattr(module, name, replacements[id(child)])
                    swapped.append((module, name, child))
        if then is not None:
            then()
    except BaseException:
        for module, name, child in reversed(swapped):
            setattr(module, name, child)
        raise


def apply_qat_torch(model, selector, reconfigure):
    """Torch half of ``apply_qat``: plan every decision, then swap, so failures change nothing."""
    entries, parent_of, linears = _plan_inputs(model, selector)
    embeddings = [(p, m) for p, m in entries if isinstance(m, nn.Embedding)]
    enabled = _current_enabled(model)

    decisions, replacements, respecs, seen = [], {}, [], {}
    for path, module in linears:
        kind = type(module).__name__
        if id(module) in seen:
            decisions.append(_repeated(path, kind, seen[id(module)]))
            continue
        spec, reason = selector.decide(path)
        blocked = _float_reason(module, parent_of.get(id(module)))
        if spec is not None and blocked:
            spec, reason = None, blocked
        if spec is None:
            if isinstance(module, QATWrapper):
                raise ValueError(
                    f"layer {path!r} is already fake-quantized but is not selected now ({reason}); "
                    f"apply_qat does not unwrap: use set_fake_quant_enabled(model, False) or rebuild the model"
                )
            decision = LayerDecision(path=path, kind=kind, action="skipped", reason=reason)
        else:
            check_supported(spec)
            note = _tie_note(module.weight, embeddings)
            if isinstance(module, QATWrapper):
                if module.spec == spec:
                    action = "unchanged"
                elif reconfigure:
                    action = "reconfigured"
                    if spec.granularity == "group":
                        QATWrapper(module.unwrap(), spec)  # validates group_size against this layer
                    respecs.append((module, spec))
                else:
                    raise ValueError(
                        f"layer {path!r} is already fake-quantized with {module.spec.short()}, not "
                        f"{spec.short()}: pass reconfigure=True to change the spec"
                    )
            else:
                action = "wrapped"
                hook = getattr(module, WRAP_HOOK, None)
                replacements[id(module)] = hook(spec, enabled) if hook else QATWrapper(module, spec, enabled=enabled)
            decision = LayerDecision(path=path, kind=kind, action=action, reason=reason, spec=spec, note=note)
        seen[id(module)] = decision
        decisions.append(decision)

    decisions += _plan_tied_embeddings(embeddings, linears, decisions, replacements, respecs, selector, enabled)

    def respec():
        for wrapper, spec in respecs:
            wrapper.spec = spec

    _swap_in(entries, replacements, then=respec)
    root = replacements.get(id(model), model)
    setattr(root, REPORT_ATTRIBUTE, QATReport(decisions))
    return root


def _plan_tied_embeddings(embeddings, linears, decisions, replacements, respecs, selector, enabled):
    """Embeddings sharing a weight with a quantized Linear get the same spec (one stored copy)."""
    spec_of_weight = {}
    for (path, module), decision in zip(linears, decisions):
        if decision.spec is not None:
            spec_of_weight.setdefault(id(module.weight), (path, decision.spec))
    extra, seen = [], set()
    for path, emb in embeddings:
        if id(emb) in seen:
            continue
        seen.add(id(emb))
        if id(emb.weight) not in spec_of_weight:
            if isinstance(emb, QATEmbedding):
                raise ValueError(f"embedding {path!r} is fake-quantized but its tied Linear is not selected now")
            continue
        head_path, spec = spec_of_weight[id(emb.weight)]
        own_reason = selector.decide(path)[1]
        if own_reason.startswith("excluded"):
            raise ValueError(
                f"embedding {path!r} shares its weight with {head_path!r}, which is selected, but it is "
                f"{own_reason}: a tied weight is stored once, so exclude both or neither"
            )
        reason = f"weight tied to {head_path!r}: lookups use the same quantized weight"
        if isinstance(emb, QATEmbedding):
            action = "unchanged" if emb.spec == spec else "reconfigured"
            if action == "reconfigured":
                respecs.append((emb, spec))
        else:
            action = "wrapped"
            replacements[id(emb)] = QATEmbedding(emb, spec, enabled=enabled)
        extra.append(LayerDecision(path=path, kind=type(emb).__name__, action=action, reason=reason, spec=spec))
    return extra


def _current_enabled(model):
    """New wrappers follow the model's toggle state if it already has wrappers."""
    states = {m.enabled for m in model.modules() if isinstance(m, _QAT_LAYERS)}
    return states.pop() if len(states) == 1 else True


def set_enabled_torch(model, enabled):
    wrappers = [m for m in model.modules() if isinstance(m, _QAT_LAYERS)]
    if not wrappers:
        raise ValueError("the model has no QAT layers to toggle: call apply_qat(model, ...) first")
    for wrapper in wrappers:
        wrapper.enabled = enabled
    return model


def report_torch(model):
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module  # apply_qat ran on the model before it was wrapped
    report = getattr(model, REPORT_ATTRIBUTE, None)
    if report is None:
        raise ValueError("the model has no QAT report: call apply_qat(model, ...) first")
    return report
