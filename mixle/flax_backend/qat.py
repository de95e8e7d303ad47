"""Flax QAT backend: Qwix QAT on NNX and Linen models, exact toggling, and a complete report.

NNX: ``apply_qat`` changes the model in place: its class becomes Qwix's subclass of the user's
class (so ``isinstance`` holds), every Param stays the same float array in the same state tree,
and the model is traced once under ``jax.grad`` (abstractly, with ``jax.eval_shape``) to learn
which kernels Qwix really quantizes there. Toggling swaps the class between Qwix's subclass
and a plain subclass of the user's class: off, the model runs the user's own code.

Linen: ``apply_qat`` returns a new module (Qwix's subclass); params stay outside and are shared
by the float and the QAT module.

``bwd_stochastic_rounding`` draws from an ``nnx.Rngs(stochastic_rounding=0)`` that NNX models get
as ``qwix_rngs`` (part of their state then; reseed with
``model.set_attributes(qwix_rngs=nnx.Rngs(stochastic_rounding=seed))``); Linen users pass
``rngs={"stochastic_rounding": key}`` to ``apply``.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import qwix
from flax import linen as nn
from flax import nnx

from mixle.flax_backend.provider import FLOAT, QUANTIZED, QATProvider, dotted_path
from mixle.core.report import LayerDecision, QATReport
from mixle.core.spec import QuantSpec
from mixle.flax_backend.rules import qwix_rule

STATE_ATTRIBUTE = "_mixle_qat"
# Qwix calibrates activations by absmax only and recomputes weight scales, so the asymmetric
# activation choice and learned scales (torch only) are refused.
SPEC_FIELDS = tuple(field.name for field in dataclasses.fields(QuantSpec) if field.name not in ("act_symmetric", "scale"))
KERNEL_KIND = "Flax module with a kernel"


@dataclasses.dataclass
class FlaxQATState:
    """What apply_qat built for one model; stored on the generated classes."""

    float_class: type
    qat_class: type
    off_class: type
    provider: QATProvider
    report: QATReport
    specs: dict  # dotted module path -> QuantSpec of each selected module


def _state(model):
    return type(model).__dict__.get(STATE_ATTRIBUTE)


def _check_inputs(example_inputs, model):
    if example_inputs is None:
        raise TypeError(
            f"apply_qat on a Flax model ({type(model).__name__}) needs example_inputs, e.g. "
            f"apply_qat(model, example_inputs=(x,)): the model is traced once under jax.grad (shapes "
            f"only, nothing is computed) to find the weights Qwix quantizes"
        )
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    return tuple(example_inputs)


def _scalar(output):
    leaves = [x for x in jax.tree.leaves(output) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)]
    return sum((jnp.sum(x.astype(jnp.float32)) for x in leaves), jnp.float32(0))


@dataclasses.dataclass
class _Plan:
    """Module selection for one apply_qat call."""

    kernels: list  # (param path tuple, shape)
    kinds: dict  # dotted module path -> class name
    specs: dict  # dotted module path -> QuantSpec (selected modules only)
    reasons: dict  # dotted module path -> why selected or skipped
    rule_of: dict  # dotted module path -> regex of the pattern that selected it


def _plan(selector, kernels, module_paths, kinds):
    owners = sorted({dotted_path(path[:-1]) for path, _ in kernels})
    selector.check_all_used(owners, module_paths, KERNEL_KIND)
    specs, reasons, rule_of = {}, {}, {}
    for owner in owners:
        spec, reason = selector.decide(owner)
        reasons[owner] = reason
        if spec is not None:
            specs[owner] = spec
            rule_of[owner] = next(r for r, c, _ in selector.rules if c.fullmatch(owner))
    return _Plan(kernels, kinds, specs, reasons, rule_of)


def _check_backend_support(specs):
    """Refuse grids Qwix has no form of, and int4 x int4 products, which XLA's CPU and GPU
    backends reject (TPU runs them)."""
    for path, spec in specs.items():
        try:
            spec.check_backend("flax", SPEC_FIELDS, "quantizes through Qwix")
        except ValueError as err:
            raise ValueError(f"module {path or '<root>'!r}: {err}") from None
    if jax.default_backend() == "tpu":
        return
    for path, spec in specs.items():
        w4 = spec.bits == 4 and spec.weight_format == "int"
        a4, g4 = spec.act_bits == 4, spec.bwd_bits == 4
        pair = ("weights", "activations") if w4 and a4 else ("gradients", "weights") if g4 and w4 else \
            ("gradients", "activations") if g4 and a4 else None
        if pair:
            raise ValueError(
                f"module {path or '<root>'!r}: {spec.short()} makes Qwix multiply int4 {pair[0]} by int4 "
                f"{pair[1]}, which XLA's {jax.default_backend().upper()} backend rejects (only TPUs run "
                f"int4 x int4 matmuls); use 8 bits for one of them, e.g. act_bits=8 or bwd_bits=8"
            )


def _rules(specs, separator):
    """One Qwix rule per selected module, matching its exact path (Qwix joins paths with '/')."""
    return [qwix_rule(spec, re.escape(path.replace(".", separator))) for path, spec in specs.items()]


def _check_patterns_ran(plan, provider, rules):
    """A selecting pattern whose modules issued no intercepted op at all is an error."""
    unused = {rule.module_path for rule in provider.get_unused_rules()}
    ran = {path for path, rule in zip(plan.specs, rules) if rule.module_path not in unused}
    for regex in dict.fromkeys(plan.rule_of.values()):
        mods = [p for p, r in plan.rule_of.items() if r == regex]
        if not any(p in ran for p in mods):
            raise ValueError(
                f"patterns entry {regex!r} selects {mods[:8]}, but no dot_general, einsum or conv ran in "
                f"them when the model was traced with example_inputs (the Qwix rule matched nothing): "
                f"their kernels are only looked up or used by other modules; select the modules that "
                f"multiply by them, or drop the pattern"
            )


def _decisions(plan, provider, previous):
    decisions = []
    for path, shape in plan.kernels:
        owner, name = dotted_path(path[:-1]), str(path[-1])
        kind = plan.kinds.get(owner, "Module")
        spec = plan.specs.get(owner)
        full = dotted_path(path)
        if spec is None:
            decisions.append(LayerDecision(path=full, kind=kind, action="skipped", reason=plan.reasons[owner]))
            continue
        state, why = provider.records.get((owner, name), (None, ""))
        if state != QUANTIZED:
            why = why if state == FLOAT else (
                f"{plan.reasons[owner]}, but no matmul or conv of module {owner or '<root>'!r} used this "
                f"{'x'.join(map(str, shape))} weight directly under jax.grad (Qwix only quantizes a Param "
                f"that its own module contracts: not one sliced, transposed or used from another module)")
            notes = sorted(provider.notes.get((owner, name), ()))
            decisions.append(LayerDecision(path=full, kind=kind, action="skipped", reason=why, note="; ".join(notes)))
            continue
        old = previous.get(owner)
        action = "wrapped" if old is None else ("unchanged" if old == spec else "reconfigured")
        notes = sorted(provider.notes.get((owner, name), ()))
        if owner in provider.tied:
            notes.insert(0, "tied: embedding lookups use the same quantized table")
        note = "; ".join(notes)
        decisions.append(LayerDecision(path=full, kind=kind, action=action, reason=plan.reasons[owner],
                                       spec=spec, note=note))
    return decisions


def _check_reapply(state, plan, reconfigure):
    """Idempotent re-application; a different spec needs reconfigure=True."""
    if state is None or reconfigure:
        return
    for path in sorted(set(state.specs) | set(plan.specs)):
        old, new = state.specs.get(path), plan.specs.get(path)
        if old != new:
            was = old.short() if old else "float"
            now = new.short() if new else "float"
            raise ValueError(
                f"module {path or '<root>'!r} is already set up for QAT as {was}, not {now}: pass "
                f"reconfigure=True to change it"
            )


# ------------------------------------------------------------------------------------------------
# NNX


def _is_kernel(name, value):
    """A Param that can be a matmul/conv weight: 2-D or more and not a bias (flax's naming)."""
    return getattr(value, "ndim", 0) >= 2 and name != "bias"


def _name_like(cls, float_class):
    cls.__module__, cls.__qualname__ = float_class.__module__, float_class.__qualname__
    return cls


def _nnx_layout(model):
    modules = {path: module for path, module in nnx.iter_modules(model)}
    kernels = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and _is_kernel(path[-1], node.get_raw_value()):
            kernels.append((tuple(path), tuple(node.get_raw_value().shape)))
    kernels.sort(key=lambda item: [str(p) for p in item[0]])
    kinds = {dotted_path(p): type(m).__name__ for p, m in modules.items()}
    return modules, kernels, kinds


def _nnx_classes(model, provider, inputs, float_class):
    """Qwix's subclass of the user's class (built on a cheap clone) and the plain 'off' subclass."""
    view = nnx.clone(model)
    object.__setattr__(view, "__class__", float_class)
    qat_class = type(qwix.quantize_model(view, provider, *inputs, skip_nnx_init=True))
    off_class = type(float_class.__name__, (float_class,), {"_unquantized_type": float_class})
    return _name_like(qat_class, float_class), _name_like(off_class, float_class)


def _needs_rng(specs):
    return any(s.bwd_stochastic_rounding is not None for s in specs.values())


def _probe_nnx(model, inputs):
    graphdef, state = nnx.split(model)

    def probe(state):
        # Abstract (eval_shape) and on a merged copy: no compute, and BatchNorm statistics or RNG
        # counters of the user's model are not advanced.
        copy = nnx.merge(graphdef, state)
        nnx.grad(lambda m: _scalar(m(*inputs)))(copy)

    jax.eval_shape(probe, state)


def _apply_nnx(model, selector, reconfigure, inputs):
    state = _state(model)
    if state is None and hasattr(type(model), "_unquantized_type"):
        raise ValueError(
            f"{type(model).__name__} was already quantized by qwix.quantize_model directly; apply_qat "
            f"needs the float model"
        )
    float_class = state.float_class if state else type(model)
    modules, kernels, kinds = _nnx_layout(model)
    plan = _plan(selector, kernels, [dotted_path(p) for p in modules], kinds)
    _check_backend_support(plan.specs)
    _check_reapply(state, plan, reconfigure)
    if state is not None and plan.specs == state.specs:
        report = QATReport(_mark_unchanged(state.report.decisions))
        state.report = report
        return model

    rules = _rules(plan.specs, "/")
    provider = QATProvider(rules)
    enabled = state is None or type(model) is state.qat_class
    saved_class = type(model)
    saved = {path: {k: m.__dict__[k] for k in ("qwix_path", "disable_quant_stats_update", "qwix_rngs")
                    if k in m.__dict__} for path, m in modules.items()}
    rngs = nnx.Rngs(stochastic_rounding=0) if _needs_rng(plan.specs) else None
    try:
        qat_class, off_class = _nnx_classes(model, provider, inputs, float_class)
        for path, module in modules.items():
            module.qwix_path = path
            module.disable_quant_stats_update = False
            module.qwix_rngs = rngs
        object.__setattr__(model, "__class__", qat_class)
        _probe_nnx(model, inputs)
        _check_patterns_ran(plan, provider, rules)
        previous = state.specs if state else {}
        report = QATReport(_decisions(plan, provider, previous))
    except BaseException:
        object.__setattr__(model, "__class__", saved_class)
        for path, module in modules.items():
            for key in ("qwix_path", "disable_quant_stats_update", "qwix_rngs"):
                if key in saved[path]:
                    setattr(module, key, saved[path][key])
                elif key in module.__dict__:
                    delattr(module, key)
        raise
    new_state = FlaxQATState(float_class, qat_class, off_class, provider, report, dict(plan.specs))
    setattr(qat_class, STATE_ATTRIBUTE, new_state)
    setattr(off_class, STATE_ATTRIBUTE, new_state)
    object.__setattr__(model, "__class__", qat_class if enabled else off_class)
    return model


def _mark_unchanged(decisions):
    return [dataclasses.replace(d, action="unchanged") if d.action != "skipped" else d for d in decisions]


# ------------------------------------------------------------------------------------------------
# Linen


def _linen_layout(module, inputs):
    kinds = {}

    def record_kinds(next_fun, args, kwargs, context):
        kinds.setdefault(dotted_path(context.module.path), type(context.module).__name__)
        return next_fun(*args, **kwargs)

    key = jax.random.key(0)
    with nn.intercept_methods(record_kinds):
        variables = jax.eval_shape(lambda: module.init(_linen_rngs(key), *inputs))
    params = variables.get("params", {})
    kernels = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
        if _is_kernel(names[-1], leaf):
            kernels.append((names, tuple(leaf.shape)))
    module_paths = {""} | {dotted_path(p[:i]) for p, _ in kernels for i in range(len(p))}
    module_paths |= set(kinds)
    return kernels, sorted(module_paths), kinds


def _linen_rngs(key):
    return {"params": key, "dropout": key, "stochastic_rounding": key}


def _probe_linen(float_module, qat_module, inputs):
    key = jax.random.key(0)

    def run():
        variables = float_module.init(_linen_rngs(key), *inputs)
        params = variables["params"]
        rest = {k: v for k, v in variables.items() if k != "params"}

        def loss(params):
            out, _ = qat_module.apply({"params": params, **rest}, *inputs, rngs=_linen_rngs(key), mutable=True)
            return _scalar(out)

        return jax.grad(loss)(params)

    jax.eval_shape(run)


def _apply_linen(module, selector, reconfigure, inputs):
    state = _state(module)
    if state is None and hasattr(type(module), "_unquantized_type"):
        raise ValueError(f"{type(module).__name__} was already quantized by qwix.quantize_model directly")
    float_class = state.float_class if state else type(module)
    float_module = module.copy()
    object.__setattr__(float_module, "__class__", float_class)
    kernels, module_paths, kinds = _linen_layout(float_module, inputs)
    plan = _plan(selector, kernels, module_paths, kinds)
    _check_backend_support(plan.specs)
    _check_reapply(state, plan, reconfigure)
    if state is not None and plan.specs == state.specs:
        state.report = QATReport(_mark_unchanged(state.report.decisions))
        return module
    rules = _rules(plan.specs, "/")
    provider = QATProvider(rules)
    qat_module = qwix.quantize_model(float_module, provider)
    qat_class = _name_like(type(qat_module), float_class)
    off_class = _name_like(type(float_class.__name__, (float_class,), {"_unquantized_type": float_class}),
                           float_class)
    # The probe records what was quantized on the traced (grad) path; it leaves nothing behind.
    _probe_linen(float_module, qat_module, inputs)
    _check_patterns_ran(plan, provider, rules)
    report = QATReport(_decisions(plan, provider, state.specs if state else {}))
    new_state = FlaxQATState(float_class, qat_class, off_class, provider, report, dict(plan.specs))
    setattr(qat_class, STATE_ATTRIBUTE, new_state)
    setattr(off_class, STATE_ATTRIBUTE, new_state)
    enabled = state is None or type(module) is state.qat_class
    if not enabled:
        object.__setattr__(qat_module, "__class__", off_class)
    return qat_module


# ------------------------------------------------------------------------------------------------
# Public entry points (called through mixle.backends)


def apply(model, selector, reconfigure, example_inputs=None):
    """Flax half of ``apply_qat`` (see ``mixle.api.apply_qat``)."""
    inputs = _check_inputs(example_inputs, model)
    if isinstance(model, nnx.Module):
        return _apply_nnx(model, selector, reconfigure, inputs)
    if isinstance(model, nn.Module):
        return _apply_linen(model, selector, reconfigure, inputs)
    raise TypeError(f"expected a flax.nnx.Module or flax.linen.Module, got {type(model).__name__}")


def set_enabled(model, enabled):
    """Swap the model's class: Qwix's QAT subclass (on) or a plain subclass of the user's (off)."""
    state = _state(model)
    if state is None:
        raise ValueError("the model has no QAT set up: call apply_qat(model, example_inputs=...) first")
    object.__setattr__(model, "__class__", state.qat_class if enabled else state.off_class)
    return model


def report(model):
    """The QATReport of the last ``apply_qat`` on this model."""
    state = _state(model)
    if state is None:
        raise ValueError("the model has no QAT report: call apply_qat(model, example_inputs=...) first")
    return state.report
