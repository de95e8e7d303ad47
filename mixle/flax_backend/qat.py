"""Flax QAT backend: Qwix QAT on NNX and Linen models, exact toggling, and a complete report.

NNX: ``apply_qat`` changes the model in place: the class of every module with an entry point
becomes a subclass of the user's class (so ``isinstance`` holds) whose entry points
(``__call__``, the public methods of the user's classes, ``Embed.attend``) run inside Qwix's
interception, so calling a submodule, another method or a model rebuilt by ``nnx.merge`` is
fake-quantized too. Every Param stays the same float array in the same state tree, and the
model is traced once under ``jax.grad`` (abstractly, with ``jax.eval_shape``) to learn which
kernels are really quantized there. Toggling swaps those classes back and forth: off, the
model runs the user's own code (the root keeps a plain subclass that holds the QAT state).

Linen: ``apply_qat`` returns a new module; params stay outside and are shared by the float and
the QAT module. Its ``apply`` runs inside the interception as a whole (so ``apply(...,
method=...)`` is covered) and picks QAT or float by the module's current mode, also inside
functions jitted before a toggle (see ``_switching_apply``).

Adapters (``nnx.LoRA``, ``nnx.LoRALinear``'s ``lora`` params) stay float and are reported with
kind ``"adapter"``.

``bwd_stochastic_rounding`` draws from an ``nnx.Rngs(stochastic_rounding=0)`` that NNX models get
as ``qwix_rngs`` (part of their state then; reseed with
``model.set_attributes(qwix_rngs=nnx.Rngs(stochastic_rounding=seed))``); Linen users pass
``rngs={"stochastic_rounding": key}`` to ``apply``.
"""

import dataclasses
import inspect
import re

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from mixle.flax_backend import qwix_seam
from mixle.flax_backend.activations import qwix_options
from mixle.flax_backend.fake_quant import from_matrix, kernel_rows, weight_layout
from mixle.flax_backend.provider import FLOAT, QUANTIZED, QATProvider, dotted_path
from mixle.core.grids import importance_grid
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
    variants: dict = dataclasses.field(default_factory=dict)  # NNX: user class -> its QAT variant


def qat_state(model):
    return type(model).__dict__.get(STATE_ATTRIBUTE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizedKernelParam:
    """One kernel a QAT-wrapped model quantizes: where it is, its Param, and how it is quantized."""

    owner: str  # the module path
    name: str  # the Param's name in the module
    param: object  # the nnx.Param
    spec: QuantSpec
    layout: object  # the provider's layout (``fake_quant.weight_layout``)
    importance: object  # numpy (in,) or None

    def stored(self, kernel):
        """``(QuantizedArray of the (out, in) rows, the values they stand for in the kernel's layout)`` of
        the numpy ``kernel`` (this Param's value or another of its shape), by numpy's numerics: the
        values the fake-quantized forward uses, as the jitted numerics compute them too."""
        stored = kernel_rows(kernel, self.layout, self.spec, self.importance, f"kernel {self.owner}.{self.name}")
        perm, _ = weight_layout(kernel.ndim, self.layout)
        return stored, from_matrix(np.asarray(stored.dequantize(), np.float32), kernel.shape, perm)


def quantized_kernels(model):
    """The kernels a QAT-wrapped Flax ``model`` quantizes with mixle's numerics, in path order; ``[]``
    for a model that is not wrapped.

    >>> quantized_kernels(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    []
    """
    state = qat_state(model)
    if state is None:
        return []
    modules = {".".join(str(p) for p in path): module for path, module in nnx.iter_modules(model)}
    return [QuantizedKernelParam(owner=owner, name=name, param=vars(modules[owner])[name], spec=state.specs[owner],
                                 layout=state.provider.layouts[(owner, name)],
                                 importance=state.provider.importance.get(owner))
            for (owner, name), (record, _) in sorted(state.provider.records.items())
            if record == QUANTIZED and state.specs.get(owner) is not None]


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


def _check_grids(specs):
    """Refuse grids and options Qwix has no form of (before anything is traced)."""
    for path, spec in specs.items():
        try:
            spec.check_backend("flax", SPEC_FIELDS, "quantizes through Qwix")
        except ValueError as err:
            raise ValueError(f"module {path or '<root>'!r}: {err}") from None
        options = qwix_options(spec)
        if spec.grid_record.ggml_type is not None and options:
            raise ValueError(
                f"module {path or '<root>'!r}: {spec.short()} is llama.cpp's {spec.grid_record.ggml_type}, which Flax "
                f"trains through mixle's block numerics (the blocks llama-quantize writes), but {options} would "
                f"run Qwix's own quantizer: drop them")


def _check_integer_products(specs, provider):
    """After the (abstract) probe: refuse integer products XLA cannot run, naming only kernels
    that really are quantized (a lookup-only Embed never multiplies): int4 x int4 matmuls off
    TPU. (int4 kernels convolved with int8 operands are refused by the provider during the
    probe, before XLA's own dtype check would fail.)"""
    quantized = {}
    for (path, name), (state, _) in provider.records.items():
        if state == QUANTIZED and path in specs:
            quantized.setdefault(path, []).append(name)
    for path, names in quantized.items():
        spec = specs[path]
        kernel = f"{path}.{names[0]}" if path else names[0]
        w4 = spec.bits == 4 and spec.weight_format == "int"
        if jax.default_backend() == "tpu":
            continue
        a4, g4 = spec.act_bits == 4, spec.bwd_bits == 4
        pair = ("weights", "activations") if w4 and a4 else ("gradients", "weights") if g4 and w4 else \
            ("gradients", "activations") if g4 and a4 else None
        if pair:
            raise ValueError(
                f"kernel {kernel!r}: {spec.short()} makes Qwix multiply int4 {pair[0]} by int4 "
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


def _checked_importance(importance, specs):
    """``{module path: float32 numpy}`` of the entries whose grids search with an importance (those on
    grids ggml ignores it on dropped); the values are checked against each kernel when it is traced."""
    kept = {}
    for path, values in importance.items():
        spec = specs.get(path)
        if spec is None:
            raise ValueError(f"importance has an entry for module {path!r}, which apply_qat does not fake-quantize: "
                             f"drop it, or select the module")
        if importance_grid(spec.grid, f"module {path!r}") == "weighted":
            kept[path] = np.asarray(values, np.float32)
    return kept


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
    kernels, adapters = [], []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and _is_kernel(path[-1], node.get_raw_value()):
            owner = modules.get(tuple(path[:-1]))
            adapter = isinstance(node, nnx.LoRAParam) or isinstance(owner, nnx.LoRA)
            (adapters if adapter else kernels).append((tuple(path), tuple(node.get_raw_value().shape)))
    kernels.sort(key=lambda item: [str(p) for p in item[0]])
    kinds = {dotted_path(p): type(m).__name__ for p, m in modules.items()}
    return modules, kernels, kinds, sorted(adapters, key=lambda item: [str(p) for p in item[0]])


ADAPTER_REASON = ("adapter (LoRA) weights stay float, as torch's adapters do: they train in full precision "
                  "beside the quantized base and are merged into it before export")


def adapter_decisions(adapters):
    return [LayerDecision(path=dotted_path(path), kind="adapter", action="skipped", reason=ADAPTER_REASON)
            for path, _ in adapters]


FLOAT_CLASS = "_mixle_float_class"
# Methods of flax's own layer classes a user calls directly (besides __call__).
FLAX_ENTRY_POINTS = ("attend",)


def entry_points(cls):
    """The methods through which a user can run a module of class ``cls``: ``__call__``, every
    public function its own (non-flax) classes define, and flax layers' ``attend``.

    >>> entry_points(nnx.Embed)
    ['__call__', 'attend']
    """
    names = set()
    for klass in cls.__mro__:
        from_flax = (klass.__module__ or "").startswith("flax.")
        for name, value in vars(klass).items():
            if not inspect.isfunction(value):
                continue
            if name == "__call__" or (not name.startswith("_") and (not from_flax or name in FLAX_ENTRY_POINTS)):
                names.add(name)
    return sorted(names)


def float_class_of(module):
    """The user's own class of a module, whether or not apply_qat swapped it."""
    return getattr(type(module), FLOAT_CLASS, type(module))


def qat_variant(float_class, provider):
    """A subclass of ``float_class`` whose entry points run inside Qwix's interception.

    Qwix intercepts only the root ``__call__``; with every module's entry points wrapped, a
    submodule called directly (``model.body(x)``), another method (``model.features(x)``) or a
    model rebuilt by ``nnx.merge`` (the class is in its graphdef) is fake-quantized too.
    Nested calls do not intercept twice (Qwix's interception is not re-entrant).
    """
    fields = {qwix_seam.UNQUANTIZED_TYPE: float_class, FLOAT_CLASS: float_class}
    for name in entry_points(float_class):
        fields[name] = qwix_seam.intercept_method(getattr(float_class, name), provider, name)
    return _name_like(type(float_class.__name__, (float_class,), fields), float_class)


def _nnx_classes(modules, provider, float_class):
    """``(root QAT class, root off class, {float class: QAT class} of every module with entry points)``."""
    variants = {}
    for module in modules.values():
        cls = float_class_of(module)
        if cls not in variants and entry_points(cls):
            variants[cls] = qat_variant(cls, provider)
    if float_class not in variants:
        variants[float_class] = qat_variant(float_class, provider)
    off_class = type(float_class.__name__, (float_class,), {qwix_seam.UNQUANTIZED_TYPE: float_class,
                                                            FLOAT_CLASS: float_class})
    return variants[float_class], _name_like(off_class, float_class), variants


def _set_module_classes(model, state, enabled):
    """Every module in its QAT variant (enabled) or back in the user's class; the root in its
    QAT or off class (which holds the state)."""
    for path, module in nnx.iter_modules(model):
        if not path:
            continue
        cls = float_class_of(module)
        object.__setattr__(module, "__class__", state.variants.get(cls, cls) if enabled else cls)
    object.__setattr__(model, "__class__", state.qat_class if enabled else state.off_class)


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


def _apply_nnx(model, selector, reconfigure, inputs, importance=None):
    state = qat_state(model)
    if state is None and qwix_seam.quantized_by_qwix(type(model)):
        raise ValueError(
            f"{type(model).__name__} was already quantized by qwix.quantize_model directly; apply_qat "
            f"needs the float model"
        )
    float_class = state.float_class if state else type(model)
    modules, kernels, kinds, adapters = _nnx_layout(model)
    plan = _plan(selector, kernels, [dotted_path(p) for p in modules], kinds)
    _check_grids(plan.specs)
    _check_reapply(state, plan, reconfigure)
    if state is not None and plan.specs == state.specs:
        report = QATReport(_mark_unchanged(state.report.decisions))
        state.report = report
        return model

    rules = _rules(plan.specs, "/")
    provider = QATProvider(rules)
    provider.importance = _checked_importance(importance or {}, plan.specs)
    enabled = state is None or type(model) is state.qat_class
    saved_classes = {path: type(m) for path, m in modules.items()}
    saved = {path: {k: m.__dict__[k] for k in qwix_seam.MODULE_ATTRIBUTES if k in m.__dict__}
             for path, m in modules.items()}
    rngs = nnx.Rngs(stochastic_rounding=0) if _needs_rng(plan.specs) else None
    try:
        qat_class, off_class, variants = _nnx_classes(modules, provider, float_class)
        for path, module in modules.items():
            qwix_seam.mark_nnx_module(module, path, rngs)
        probe_state = FlaxQATState(float_class, qat_class, off_class, provider, None, {}, variants)
        _set_module_classes(model, probe_state, True)
        provider.probing = True
        try:
            _probe_nnx(model, inputs)
        finally:
            provider.probing = False
        _check_integer_products(plan.specs, provider)
        _check_patterns_ran(plan, provider, rules)
        previous = state.specs if state else {}
        report = QATReport(_decisions(plan, provider, previous) + adapter_decisions(adapters))
    except BaseException:
        for path, module in modules.items():
            object.__setattr__(module, "__class__", saved_classes[path])
            for key in qwix_seam.MODULE_ATTRIBUTES:
                if key in saved[path]:
                    setattr(module, key, saved[path][key])
                elif key in module.__dict__:
                    delattr(module, key)
        raise
    new_state = FlaxQATState(float_class, qat_class, off_class, provider, report, dict(plan.specs), variants)
    setattr(qat_class, STATE_ATTRIBUTE, new_state)
    setattr(off_class, STATE_ATTRIBUTE, new_state)
    _set_module_classes(model, new_state, enabled)
    return model


def restore_float_classes(model, state):
    """Put an NNX model (a private copy) back in the user's own classes, without Qwix's attributes."""
    for _, module in nnx.iter_modules(model):
        object.__setattr__(module, "__class__", float_class_of(module))
        for key in qwix_seam.MODULE_ATTRIBUTES:
            if key in vars(module):
                delattr(module, key)


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
    state = qat_state(module)
    if state is None and qwix_seam.quantized_by_qwix(type(module)):
        raise ValueError(f"{type(module).__name__} was already quantized by qwix.quantize_model directly")
    float_class = state.float_class if state else type(module)
    float_module = module.copy()
    object.__setattr__(float_module, "__class__", float_class)
    kernels, module_paths, kinds = _linen_layout(float_module, inputs)
    plan = _plan(selector, kernels, module_paths, kinds)
    _check_grids(plan.specs)
    _check_reapply(state, plan, reconfigure)
    if state is not None and plan.specs == state.specs:
        state.report = QATReport(_mark_unchanged(state.report.decisions))
        return module
    rules = _rules(plan.specs, "/")
    provider = QATProvider(rules)
    qat_module = qwix_seam.quantize_model(float_module, provider)
    qat_class = _name_like(type(qat_module), float_class)
    # Qwix intercepts only the listed methods of the root; intercepting the whole apply also
    # covers apply(..., method=<any method or function>) and submodules called from it.
    qat_apply = qwix_seam.intercept_method(float_class.apply, provider, "apply")
    off_class = _name_like(type(float_class.__name__, (float_class,), {qwix_seam.UNQUANTIZED_TYPE: float_class}),
                           float_class)
    qat_class.apply = off_class.apply = _switching_apply(qat_apply, float_class, qat_class)
    # The probe records what was quantized on the traced (grad) path; it leaves nothing behind.
    _probe_linen(float_module, qat_module, inputs)
    _check_integer_products(plan.specs, provider)
    _check_patterns_ran(plan, provider, rules)
    report = QATReport(_decisions(plan, provider, state.specs if state else {}))
    new_state = FlaxQATState(float_class, qat_class, off_class, provider, report, dict(plan.specs))
    setattr(qat_class, STATE_ATTRIBUTE, new_state)
    setattr(off_class, STATE_ATTRIBUTE, new_state)
    enabled = state is None or type(module) is state.qat_class
    if not enabled:
        object.__setattr__(qat_module, "__class__", off_class)
    return qat_module


def _twin(module, cls):
    twin = module.clone()
    object.__setattr__(twin, "__class__", cls)
    return twin


def _switching_apply(qat_apply, float_class, qat_class):
    """A Linen ``apply`` that runs the QAT or the float computation by the module's current mode.

    Eagerly it picks by the module's class. Traced (under ``jax.jit``), the choice must not be
    frozen into the compiled function: a jitted closure or bound method over the module, or the
    module as a static argument (found again by identity), would otherwise keep the mode it was
    traced in after ``set_fake_quant_enabled``. So both computations are traced into one
    ``lax.cond`` whose predicate a host callback reads at every call (about 0.1 ms on CPU). The
    callback runs when the device reaches it, which can be after the call returned (asynchronous
    dispatch, inputs still being computed): it is an effect, and ``set_enabled`` waits for every
    pending one before it switches, so a call computes in the mode it was made in.
    """

    def apply(self, variables, *args, **kwargs):
        leaves = jax.tree.leaves((variables, args, kwargs.get("rngs")))
        if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            chosen = qat_apply if type(self) is qat_class else float_class.apply
            return chosen(self, variables, *args, **kwargs)
        enabled = jax.experimental.io_callback(lambda: np.bool_(type(self) is qat_class),
                                               jax.ShapeDtypeStruct((), jnp.bool_), ordered=False)
        # Each branch on a twin of its own class: Linen's apply calls type(module).__call__.
        as_qat, as_float = _twin(self, qat_class), _twin(self, float_class)
        return jax.lax.cond(enabled, lambda v: qat_apply(as_qat, v, *args, **kwargs),
                            lambda v: float_class.apply(as_float, v, *args, **kwargs), variables)

    apply.__doc__ = float_class.apply.__doc__
    return apply


# ------------------------------------------------------------------------------------------------
# Public entry points (called through mixle.backends)


def apply(model, selector, reconfigure, example_inputs=None, importance=None):
    """Flax half of ``apply_qat`` (see ``mixle.api.apply_qat``); ``importance``: ``{module path: values}``
    (NNX), each selected kernel's ggml importance-weighted search."""
    if importance and not isinstance(model, nnx.Module):
        raise TypeError("apply_qat(importance=...) takes NNX models on the Flax backend: a Linen module's kernels "
                        "live outside it")
    if selector.opt_in:
        raise ValueError(f"opt_in={selector.opt_in!r} is for torch models: the Flax backend quantizes the kernels "
                         f"Qwix's rules select; drop opt_in")
    inputs = _check_inputs(example_inputs, model)
    if not isinstance(model, (nnx.Module, nn.Module)):
        raise TypeError(f"expected a flax.nnx.Module or flax.linen.Module, got {type(model).__name__}")
    try:
        if isinstance(model, nnx.Module):
            return _apply_nnx(model, selector, reconfigure, inputs, importance or {})
        return _apply_linen(model, selector, reconfigure, inputs)
    except TypeError as err:  # JAX's own errors of tracing the model on inputs it does not take
        raise TypeError(
            f"apply_qat could not trace {type(model).__name__} on example_inputs={_describe(inputs)} ({err}): "
            f"pass the positional arguments of one forward call, e.g. example_inputs=(x,) with x an array of "
            f"the shape and dtype the model takes") from err


def _describe(inputs):
    parts = [f"{type(x).__name__} {getattr(x, 'dtype', '')}{list(getattr(x, 'shape', ()))}" if hasattr(x, "shape")
             else f"{type(x).__name__} {x!r:.20}" for x in inputs]
    return f"({', '.join(parts)})"


def set_enabled(model, enabled):
    """Swap the model's class: Qwix's QAT subclass (on) or a plain subclass of the user's (off)."""
    state = qat_state(model)
    if state is None:
        raise ValueError("the model has no QAT set up: call apply_qat(model, example_inputs=...) first")
    if isinstance(model, nnx.Module):
        _set_module_classes(model, state, enabled)
    else:
        jax.effects_barrier()  # calls already made finish in their mode (see _switching_apply)
        object.__setattr__(model, "__class__", state.qat_class if enabled else state.off_class)
    return model


def report(model):
    """The QATReport of the last ``apply_qat`` on this model."""
    state = qat_state(model)
    if state is None:
        raise ValueError("the model has no QAT report: call apply_qat(model, example_inputs=...) first")
    return state.report
