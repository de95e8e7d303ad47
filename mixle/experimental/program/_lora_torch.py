"""PyTorch LoRA layers (on a float or fake-quantized base) and the in-place apply/merge passes."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from mixle.models._qat_torch import (QATWrapper, _float_reason, _plan_inputs, _repeated, _swap_in, check_supported,
                                    fake_quantize_tensor)
from mixle.models.qat_report import LayerDecision, QATReport
from mixle.task.quantize import block_shape

REPORT_ATTRIBUTE = "_mixle_lora_report"
_MARK_PREFIX = "_mixle_"  # reports kept on a root module; they follow it when it is replaced


def _adopt(dst, linear):
    """Make a freshly initialised ``dst`` share ``linear``'s Parameters, hooks, mode and marks."""
    dst.in_features, dst.out_features = linear.in_features, linear.out_features
    dst.weight, dst.bias = linear.weight, linear.bias
    for name, value in vars(linear).items():
        if name.endswith(("hooks", "hooks_with_kwargs", "always_called")) or name.startswith(_MARK_PREFIX):
            setattr(dst, name, value)
    dst.training = linear.training
    return dst


def _copy_marks(src, dst):
    for name, value in vars(src).items():
        if name.startswith(_MARK_PREFIX):
            setattr(dst, name, value)
    return dst


def plain_linear(linear):
    """An ``nn.Linear`` sharing ``linear``'s Parameters and hooks (no adapter, no fake-quant)."""
    out = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(out)
    return _adopt(out, linear)


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus a low-rank adapter: ``base(x) + alpha/rank * B(A(dropout(x)))``.

    Shares the wrapped layer's ``weight``/``bias`` Parameters (base ``state_dict`` keys and
    tied references are unchanged); ``lora_A`` (rank x in) starts uniform in +-1/sqrt(in) like
    ``nn.Linear``, ``lora_B`` (out x rank) starts at zero, so the layer first computes exactly
    what the base layer computes. Made by ``apply_lora``.

    Args:
        linear: the ``nn.Linear`` to adapt (not already adapted, not a QATWrapper).
        lora: the LoRASpec.
        adapters: existing ``(lora_A, lora_B)`` Parameters to reuse instead of new ones.

    >>> from mixle.experimental.program.lora import LoRASpec
    >>> layer = LoRALinear(nn.Linear(6, 4), LoRASpec(rank=2, alpha=4))
    >>> layer.lora_A.shape, layer.lora_B.shape, layer.lora_spec.scaling
    (torch.Size([2, 6]), torch.Size([4, 2]), 2.0)
    """

    def __init__(self, linear, lora, *, adapters=None):
        if not isinstance(linear, nn.Linear) or isinstance(linear, (LoRALinear, QATWrapper)):
            raise TypeError(f"LoRALinear adapts a plain nn.Linear, got {type(linear).__name__}: use apply_lora")
        nn.Module.__init__(self)
        _adopt(self, linear)
        self._set_adapters(lora, adapters)

    def _set_adapters(self, lora, adapters):
        self.lora_spec = lora
        if adapters is None:
            w = self.weight
            bound = 1.0 / math.sqrt(self.in_features)
            a = torch.empty(lora.rank, self.in_features, dtype=w.dtype, device=w.device).uniform_(-bound, bound)
            b = torch.zeros(self.out_features, lora.rank, dtype=w.dtype, device=w.device)
            adapters = (nn.Parameter(a), nn.Parameter(b))
        self.lora_A, self.lora_B = adapters

    def adapter_weights(self):
        """``(A, B)`` as the forward uses them (fake-quantized in ``QATLoRALinear`` when asked)."""
        return self.lora_A, self.lora_B

    def forward(self, x):
        # super() is nn.Linear here and QATWrapper in QATLoRALinear: the base path is theirs.
        base = super().forward(x)
        a, b = self.adapter_weights()
        if self.lora_spec.dropout and self.training:
            x = F.dropout(x, self.lora_spec.dropout, training=True)
        h = F.linear(x, a)
        # One GEMM adds alpha/rank * h @ B^T onto the base output: no full-size scale or add pass,
        # and with B = 0 it adds exact zeros, so a fresh adapter leaves the output bit-identical.
        out = torch.addmm(base.reshape(-1, self.out_features), h.reshape(-1, h.shape[-1]), b.t(),
                          alpha=self.lora_spec.scaling)
        return out.view(base.shape)

    def merged_weight(self):
        """``W + (B @ A) * alpha/rank`` in W's dtype (summed in at least float32), no gradient."""
        with torch.no_grad():
            return self._merge(*self.adapter_weights())

    def _merge(self, a, b):
        # The one formula for the merged weight: merge_lora and the quantize_merged forward.
        dtype = torch.promote_types(self.weight.dtype, torch.float32)
        delta = (b.to(dtype) @ a.to(dtype)) * self.lora_spec.scaling
        return (self.weight.to(dtype) + delta).to(self.weight.dtype)

    def base_layer(self):
        """The adapter-free layer sharing this one's Parameters: ``nn.Linear`` (or ``QATWrapper``)."""
        return plain_linear(self)

    def extra_repr(self):
        return f"{super().extra_repr()}, {self.lora_spec.short()}"

    def _mixle_wrap_qat(self, spec, enabled):
        # apply_qat on an adapted layer: the fake-quantized version keeps the same adapters.
        return QATLoRALinear(plain_linear(self), self.lora_spec, spec, enabled=enabled,
                             adapters=(self.lora_A, self.lora_B))


class QATLoRALinear(LoRALinear, QATWrapper):
    """A ``QATWrapper`` (fake-quantized base weight) with a float LoRA adapter.

    ``apply_qat`` then ``apply_lora`` and the reverse order both give this layer.
    ``set_fake_quant_enabled`` toggles the base (and the adapters, with ``adapter_spec``);
    off, it computes exactly what ``LoRALinear`` computes. With ``quantize_merged`` the
    forward fake-quantizes ``W + alpha/rank * B @ A`` as one weight instead.

    >>> from mixle.experimental.program.lora import LoRASpec, QuantSpec
    >>> layer = QATLoRALinear(nn.Linear(6, 4), LoRASpec(rank=2, alpha=2), QuantSpec(bits=4))
    >>> layer.spec.bits, layer.lora_spec.rank, isinstance(layer, QATWrapper)
    (4, 2, True)
    """

    def __init__(self, linear, lora, spec, *, enabled=True, adapters=None):
        if isinstance(linear, (LoRALinear, QATWrapper)):
            raise TypeError(f"QATLoRALinear takes a plain nn.Linear, got {type(linear).__name__}: use apply_lora")
        QATWrapper.__init__(self, linear, spec, enabled=enabled)
        _copy_marks(linear, self)
        self._set_adapters(lora, adapters)

    def forward(self, x):
        if self.enabled and self.lora_spec.quantize_merged:
            merged = self._merge(self.lora_A, self.lora_B)
            return F.linear(x, fake_quantize_tensor(merged, self.spec), self.bias)
        return super().forward(x)

    def adapter_weights(self):
        spec = self.lora_spec.adapter_spec
        if spec is None or not self.enabled:
            return self.lora_A, self.lora_B
        return fake_quantize_tensor(self.lora_A, spec), fake_quantize_tensor(self.lora_B, spec)

    def base_layer(self):
        return _copy_marks(self, QATWrapper(plain_linear(self), self.spec, enabled=self.enabled))


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


def apply_lora_torch(model, selector, train_base):
    """Torch half of ``apply_lora``: plan every decision, then swap, so failures change nothing."""
    entries, parent_of, linears = _plan_inputs(model, selector)
    holders = _parameter_holders(entries)

    decisions, replacements, seen = [], {}, {}
    for path, module in linears:
        kind = type(module).__name__
        if id(module) in seen:
            decisions.append(_repeated(path, kind, seen[id(module)]))
            continue
        lora, reason = selector.decide(path)
        blocked = _float_reason(module, parent_of.get(id(module)))
        shared = _sharing_note(module, holders)
        if lora is not None and (blocked or shared):
            lora, reason = None, blocked or f"{shared}: merging an adapter would change it there too"
        if lora is None:
            if isinstance(module, LoRALinear):
                raise ValueError(
                    f"layer {path!r} has a LoRA adapter but is not selected now ({reason}); apply_lora "
                    f"does not remove adapters: merge_lora(model) folds them into the weights"
                )
            decision = LayerDecision(path=path, kind=kind, action="skipped", reason=reason)
        else:
            _check_layer(path, module, lora)
            if isinstance(module, LoRALinear):
                if module.lora_spec != lora:
                    raise ValueError(
                        f"layer {path!r} already has an adapter ({module.lora_spec.short()}), not "
                        f"{lora.short()}: merge_lora(model) first, then apply_lora with the new settings"
                    )
                action = "unchanged"
            else:
                action = "wrapped"
                if isinstance(module, QATWrapper):
                    new = QATLoRALinear(plain_linear(module), lora, module.spec, enabled=module.enabled)
                else:
                    new = LoRALinear(module, lora)
                replacements[id(module)] = new
            decision = LayerDecision(path=path, kind=kind, action=action, reason=reason, spec=lora)
        seen[id(module)] = decision
        decisions.append(decision)

    if not any(d.action != "skipped" for d in decisions):
        reasons = sorted({f"{d.path!r}: {d.reason}" for d in decisions})[:6]
        raise ValueError(f"apply_lora selected no nn.Linear layer it can adapt, so nothing would train: {reasons}")

    adapters = {id(p) for m in model.modules() if isinstance(m, LoRALinear) for p in (m.lora_A, m.lora_B)}
    adapters |= {id(p) for m in replacements.values() for p in (m.lora_A, m.lora_B)}
    to_freeze = [] if train_base else [p for p in model.parameters() if p.requires_grad and id(p) not in adapters]

    def freeze():
        frozen = []
        try:
            for param in to_freeze:
                param.requires_grad_(False)
                frozen.append(param)
        except BaseException:
            for param in frozen:
                param.requires_grad_(True)
            raise

    _swap_in(entries, replacements, then=freeze)
    root = replacements.get(id(model), model)
    setattr(root, REPORT_ATTRIBUTE, QATReport(decisions, done="adapted", left="without adapter"))
    return root


def merge_lora_torch(model):
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
    replacements = {key: module.base_layer() for key, (_, module) in layers.items()}

    with torch.no_grad():
        for _, module in layers.values():
            module.weight.copy_(module.merged_weight())
    for _, module in entries:
        for name, child in list(module.named_children()):
            if id(child) in replacements:
                setattr(module, name, replacements[id(child)])
    root = replacements.get(id(model), model)
    if REPORT_ATTRIBUTE in vars(root):
        delattr(root, REPORT_ATTRIBUTE)  # it described adapters that no longer exist
    return root


def report_torch(model):
    report = getattr(model, REPORT_ATTRIBUTE, None)
    if report is None:
        raise ValueError("the model has no LoRA report: call apply_lora(model, rank=..., alpha=...) first")
    return report


def adapter_parameters(model):
    layers = {id(m): m for m in model.modules() if isinstance(m, LoRALinear)}
    if not layers:
        raise ValueError("the model has no LoRA adapters: call apply_lora(model, rank=..., alpha=...) first")
    return [p for m in layers.values() for p in (m.lora_A, m.lora_B)]
