"""LoRA on Flax NNX models: float low-rank adapters beside (fake-quantized) ``nnx.Linear`` kernels.

``apply_lora`` turns each selected ``nnx.Linear`` into a ``LoRALinear`` in place (its class is
swapped, as ``apply_qat`` swaps classes): the same object at the same path, holding the same
``kernel``/``bias`` Variables, plus an adapter child ``lora`` (an ``nnx.LoRA`` without base
module: ``lora_a`` (in, r) and ``lora_b`` (r, out), both ``nnx.LoRAParam``). The layer computes
``base(x) + (x @ A) @ B * alpha/rank``; under QAT the base kernel is fake-quantized (its path and
its Qwix rule are unchanged) and the adapter stays float, reported with kind ``"adapter"``.
``apply_qat`` before or after gives the same model.

``merge_lora`` folds ``W + (A @ B) * alpha/rank`` into the kernel and makes the layer an
``nnx.Linear`` again, so ``convert`` / ``save_quantized`` store the merged weights.

NNX has no ``requires_grad``: what trains is what the optimizer takes, so the adapters alone
train with ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)`` (``lora_parameters`` lists them).
"""

import weakref

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from mixle.core.report import LayerDecision, QATReport
from mixle.flax_backend import qat as flax_qat
from mixle.flax_backend import qwix_seam
from mixle.flax_backend.provider import dotted_path

# root model -> QATReport of its last apply_lora. Not an attribute: a static attribute of an NNX
# module is part of its graph definition, which must stay hashable for nnx.jit.
_REPORTS = weakref.WeakKeyDictionary()

# Adapters start as nnx.LoRA's defaults draw them (B is zero, so outputs do not change at first).
SEED = 0

LAYER_KIND = "nnx.Linear"


class LoRALinear(nnx.Linear):
    """An ``nnx.Linear`` plus a float low-rank adapter: ``kernel product + (x @ A) @ B * alpha/rank``.

    Made in place by ``apply_lora`` from an existing ``nnx.Linear`` (same Variables, same path);
    ``lora`` is the adapter (an ``nnx.LoRA``), ``lora_spec`` its LoRASpec.

    >>> from flax import nnx
    >>> from mixle.experimental.program.lora import apply_lora
    >>> model = apply_lora(nnx.Sequential(nnx.Linear(8, 4, rngs=nnx.Rngs(0))), rank=2, alpha=4)
    >>> type(model.layers[0]).__name__, model.layers[0].lora.lora_a.shape
    ('LoRALinear', (8, 2))
    """

    def __call__(self, inputs, **kwargs):
        out = nnx.Linear.__call__(self, inputs, **kwargs)
        return out + self.lora(inputs) * self.lora_spec.scaling


def _check_options(path, lora):
    if lora.dropout or lora.adapter_spec is not None or lora.quantize_merged:
        raise ValueError(
            f"layer {path!r}: {lora.short()} asks for dropout, adapter_spec or quantize_merged, which the Flax "
            f"backend does not implement (torch does): use dropout=0, adapter_spec=None, quantize_merged=False"
        )


def _variable_holders(modules):
    """id(Variable) -> paths of the modules holding it directly."""
    holders = {}
    for path, module in modules.items():
        for value in vars(module).values():
            if isinstance(value, nnx.Variable):
                holders.setdefault(id(value), []).append(path)
    return holders


def _sharing_note(path, module, holders):
    for name in ("kernel", "bias"):
        value = vars(module).get(name)
        others = [p for p in holders.get(id(value), []) if p != path] if value is not None else []
        if others:
            return f"its {name} is shared with {others[0]!r}"
    return ""


def _is_ours(module):
    return flax_qat.float_class_of(module) is LoRALinear


def _class_for(float_class, state, enabled):
    """The class a module of ``float_class`` takes: its QAT variant while QAT is on."""
    if state is None:
        return float_class
    if float_class not in state.variants:
        state.variants[float_class] = flax_qat.qat_variant(float_class, state.provider)
    return state.variants[float_class] if enabled else float_class


def _refuse_linen(model, purpose):
    if isinstance(model, nn.Module):
        raise TypeError(
            f"{purpose} takes NNX models; a Linen module's params live outside it, so there is no layer to add "
            f"an adapter to: build the model with flax.nnx (nnx.bridge.ToNNX wraps a Linen module)"
        )
    if not isinstance(model, nnx.Module):
        raise TypeError(f"expected a flax.nnx.Module, got {type(model).__name__}")


def _decide(path, module, selector, holders):
    """(LoRASpec to add or None, the LayerDecision) for one nnx.Linear; raises where it must refuse."""
    kind = flax_qat.float_class_of(module).__name__
    lora, reason = selector.decide(path)
    shared = _sharing_note(path, module, holders)
    if lora is not None and shared:
        lora, reason = None, f"{shared}: merging an adapter would change it there too"
    if lora is not None and isinstance(module, nnx.LoRALinear):
        lora, reason = None, "an nnx.LoRALinear has its own adapter (module.lora)"
    if lora is None:
        if _is_ours(module):
            raise ValueError(
                f"layer {path!r} has a LoRA adapter but is not selected now ({reason}); apply_lora "
                f"does not remove adapters: merge_lora(model) folds them into the weights")
        return None, LayerDecision(path=path, kind=kind, action="skipped", reason=reason)
    _check_options(path, lora)
    if _is_ours(module):
        if module.lora_spec != lora:
            raise ValueError(
                f"layer {path!r} already has an adapter ({module.lora_spec.short()}), not {lora.short()}: "
                f"merge_lora(model) first, then apply_lora with the new settings")
        return None, LayerDecision(path=path, kind=kind, action="unchanged", reason=reason, spec=lora)
    limit = min(module.in_features, module.out_features)
    if lora.rank > limit:
        raise ValueError(
            f"rank={lora.rank} is larger than min(in_features, out_features)={limit} of layer {path!r} "
            f"({module.in_features} -> {module.out_features}): use rank <= {limit}, or exclude the layer")
    return lora, LayerDecision(path=path, kind=kind, action="wrapped", reason=reason, spec=lora)


def _install(planned, adapters, state, layer_class):
    """Give every planned layer its adapter and class; on any failure put every layer back."""
    saved = {path: type(module) for path, (module, _) in planned.items()}
    try:
        for path, (module, lora) in planned.items():
            adapter = adapters[path]
            if state is not None:  # as apply_qat set them on every module: Qwix finds modules by these
                qwix_seam.mark_nnx_module(adapter, tuple(qwix_seam.nnx_module_path(module)) + ("lora",),
                                          qwix_seam.nnx_module_rngs(module))
            module.lora = adapter
            module.lora_spec = lora
            object.__setattr__(module, "__class__", layer_class)
    except BaseException:
        for path, (module, _) in planned.items():
            object.__setattr__(module, "__class__", saved[path])
            for name in ("lora", "lora_spec"):
                if name in vars(module):
                    delattr(module, name)
        raise


def apply_lora(model, selector, train_base):
    """Flax half of ``apply_lora``: plan every decision, then change the model, so failures change nothing."""
    _refuse_linen(model, "apply_lora")
    modules = {dotted_path(p): m for p, m in nnx.iter_modules(model)}
    linears = {p: m for p, m in modules.items() if isinstance(m, nnx.Linear)}
    selector.check_all_used(list(linears), list(modules), LAYER_KIND)
    holders = _variable_holders(modules)
    state = flax_qat.qat_state(model)

    planned, decisions = {}, []
    for path, module in linears.items():
        lora, decision = _decide(path, module, selector, holders)
        decisions.append(decision)
        if lora is not None:
            planned[path] = (module, lora)
    if not any(d.action != "skipped" for d in decisions):
        reasons = sorted({f"{d.path!r}: {d.reason}" for d in decisions})[:6]
        raise ValueError(f"apply_lora selected no {LAYER_KIND} layer it can adapt, so nothing would train: {reasons}")
    if state is not None and "" in planned:
        raise ValueError("the root module is the nnx.Linear to adapt and already has QAT set up: apply_lora first, "
                         "then apply_qat (or wrap the layer in a container module)")

    rngs = nnx.Rngs(params=SEED)
    adapters = {path: nnx.LoRA(module.in_features, lora.rank, module.out_features, rngs=rngs,
                               param_dtype=module.kernel.get_raw_value().dtype)
                for path, (module, lora) in planned.items()}
    enabled = state is not None and type(model) is state.qat_class
    _install(planned, adapters, state, _class_for(LoRALinear, state, enabled))
    if state is not None:
        new = [((*path.split("."), "lora", name) if path else ("lora", name), None)
               for path in planned for name in ("lora_a", "lora_b")]
        state.report = QATReport(state.report.decisions + tuple(flax_qat.adapter_decisions(new)))
    _REPORTS[model] = QATReport(decisions, done="adapted", left="without adapter")
    return model


def merge_lora(model):
    """Flax half of ``merge_lora``: check everything, compute every merged kernel, then change the model."""
    _refuse_linen(model, "merge_lora")
    modules = {dotted_path(p): m for p, m in nnx.iter_modules(model)}
    layers = {p: m for p, m in modules.items() if _is_ours(m)}
    if not layers:
        raise ValueError("merge_lora found no LoRA adapters in the model: add them with apply_lora(model, rank=..., alpha=...)")
    holders = _variable_holders(modules)
    merged = {}
    for path, module in layers.items():
        shared = _sharing_note(path, module, holders)
        if shared:
            raise ValueError(f"cannot merge the adapter of {path!r}: {shared}, which would change too")
        a, b = module.lora.lora_a.get_raw_value(), module.lora.lora_b.get_raw_value()
        if not (bool(jnp.isfinite(a).all()) and bool(jnp.isfinite(b).all())):
            raise ValueError(f"cannot merge the adapter of {path!r}: lora_a or lora_b holds NaN or infinity, "
                             f"which would spread into the base weight; find where training diverged")
        w = module.kernel.get_raw_value()
        dtype = jnp.promote_types(w.dtype, jnp.float32)
        delta = jnp.matmul(a.astype(dtype), b.astype(dtype), precision=jax.lax.Precision.HIGHEST)
        merged[path] = (w.astype(dtype) + delta * module.lora_spec.scaling).astype(w.dtype)

    state = flax_qat.qat_state(model)
    enabled = state is not None and type(model) is state.qat_class
    linear_class = _class_for(nnx.Linear, state, enabled)
    for path, module in layers.items():
        module.kernel[...] = merged[path]
        del module.lora
        del module.lora_spec
        object.__setattr__(module, "__class__", linear_class)
    if state is not None:
        gone = tuple(f"{path}.lora." if path else "lora." for path in layers)
        state.report = QATReport([d for d in state.report.decisions
                                  if not (d.kind == "adapter" and d.path.startswith(gone))])
    _REPORTS.pop(model, None)  # it described adapters that no longer exist
    return model


def lora_report(model):
    _refuse_linen(model, "get_lora_report")
    report = _REPORTS.get(model)
    if report is None:
        raise ValueError("the model has no LoRA report: call apply_lora(model, rank=..., alpha=...) first")
    return report


def lora_parameters(model):
    """The adapters' ``nnx.LoRAParam`` Variables (``lora_a``, ``lora_b`` per adapted layer)."""
    _refuse_linen(model, "lora_parameters")
    layers = [m for _, m in nnx.iter_modules(model) if _is_ours(m)]
    if not layers:
        raise ValueError("the model has no LoRA adapters: call apply_lora(model, rank=..., alpha=...) first")
    return [v for m in layers for v in (m.lora.lora_a, m.lora.lora_b)]

