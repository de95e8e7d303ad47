"""mixle's Qwix QtProvider: weight detection, mixle's numerics on the weights, tied heads, a record.

Qwix intercepts ``dot_general`` / ``einsum`` / ``conv`` inside the model call and decides per op
which operand is a weight. This subclass keeps Qwix's interception and its quantized matmul
(``dot_general_qt``: activation and gradient quantization) and changes what the measured
pitfalls and mixle's one-grid promise require:

* integer weights are fake-quantized with mixle's own numerics (``fake_quantize_weight``: the
  same codes as numpy and torch for every element, every granularity, ``clip_percentile``
  included, and the values ``convert`` stores), then multiplied in float; Qwix's quantizer
  (whose scale can be one ulp off mixle's, moving the -absmax tie of ``grid='qwix'``) is used
  only for fp8 weights, Qwix ``calibration`` methods and ``act_bits`` outside mixle's integer
  products (``int_matmul``; see ``uses_mixle_numerics``);
* a weight is the Param itself (identity) or, failing that, the one Param of its shape (a cast
  weight); Qwix's jit-only tracer lineage is not used, so a weight is quantized alike eagerly,
  under ``jit`` and under ``grad``, and an activation shaped like a kernel is not taken for a
  second weight (Qwix asserts there);
* on Qwix's path, ``clip_percentile`` clips each weight to the percentile of its live (traced)
  value before Qwix's absmax calibration, with a straight-through gradient, and group-wise
  (tiled) weights are fake-quantized before the matmul;
* ``granularity='tensor'`` is per tensor on the weight side only (activations stay per token);
* ``Embed.attend`` (NNX and Linen tied heads: a transposed weight Qwix misses under grad) is
  quantized explicitly, and the lookups of such a tied embedding use the same quantized table;
* a Param used by another module than its owner (where Qwix leaves it float) is noted;
* every weight the provider quantized or had to leave in float is recorded for the report,
  with its input (contracting) axes for ``convert``.
"""

import contextlib
import functools
import math
import re

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from mixle.core.checks import check_array
from mixle.core.imatrix import check_importance
from mixle.core.numerics import block_shape, clip_threshold
from mixle.flax_backend import int_matmul, qwix_seam
from mixle.flax_backend.activations import round_product_input
from mixle.flax_backend.fake_quant import fake_quantize_weight
from mixle.flax_backend.group_view import group_view_dot, takes_group_view
from mixle.flax_backend.rules import range_calibration


def _fake_quantize_jitted(*args, **kwargs):
    """``fake_quantize_weight`` with jit enabled inside the intercepted call.

    Qwix runs the intercepted module with jit disabled (see ``QATProvider``), which would
    inline every ``jax.numpy`` helper of mixle's quantizer: traced op by op, the block searches
    of llama.cpp's grids (K-quants, importance-weighted) took tens of seconds per kernel to
    trace (``apply_qat``'s probe, every ``jit``) and compiled into a graph ten times the size.
    The quantizer calls no intercepted op (no product, einsum or convolution), so no patched
    op is baked into those helpers' trace caches; the values are the same.
    """
    with jax.disable_jit(False):
        return fake_quantize_weight(*args, **kwargs)


def uses_mixle_numerics(spec):
    """True when the weight is fake-quantized by mixle's own numerics (``fake_quantize_weight``):
    integer weights with mixle's calibration, no activation and no gradient quantization.

    The products ``int_matmul.applies`` to (``act_bits`` on mixle's symmetric grid, a Linear's
    product) multiply mixle's codes as integers and are not fake-quantized. Qwix's quantizer is
    used for what mixle's numerics have no form of: fp8 weights, Qwix ``calibration`` methods,
    ``act_bits`` off llama.cpp's grids (on them the input is rounded as llama.cpp rounds it,
    ``round_product_input``, and the product stays float) and ``bwd_bits``, outside those products.

    >>> from mixle.core.spec import QuantSpec
    >>> uses_mixle_numerics(QuantSpec(bits=4, group_size=32)), uses_mixle_numerics(QuantSpec(bits=4, bwd_bits=8))
    (True, False)
    """
    return (spec.weight_format == "int" and spec.calibration is None and spec.bwd_bits is None
            and (spec.act_bits is None or spec.grid_record.activation_grid is not None))

QUANTIZED = "quantized"
FLOAT = "float"


def _rounded_input(x, contracting, spec, label):
    """The activation operand of a product with a ``spec`` weight, rounded as llama.cpp rounds it
    (``act_bits`` on its grids; ``x`` itself otherwise), along its contracted last axis."""
    if spec.act_bits is None:
        return x
    if tuple(contracting) != (x.ndim - 1,):
        raise ValueError(f"{label}: act_bits rounds the input along the axis the product contracts, which "
                         f"must be its last axis as in a Linear (this one contracts axes {tuple(contracting)} "
                         f"of {tuple(x.shape)}): leave act_bits out for this layer")
    return round_product_input(x, spec)


def _weight_product(module, name, side, spec, lhs, rhs, dimension_numbers, keywords):
    """A product with a fake-quantized weight: a plain Linear's contracts the group view off the CPU
    for few rows where ``takes_group_view`` says so (``group_view.group_view_dot``, as its
    converted layer does), any other is ``dot_general``."""
    user_class = getattr(type(module), qwix_seam.UNQUANTIZED_TYPE, type(module))
    if side == "rhs" and takes_group_view(module, name, spec, user_class):
        return group_view_dot(lhs, rhs, spec.group_size, **keywords)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, **keywords)


@jax.custom_vjp
def straight_through(w, value):
    """``value`` forward; the gradient goes to ``w`` unchanged (value carries none).

    >>> float(jax.grad(lambda w: straight_through(w, jnp.round(w)) * 3.0)(0.4))
    3.0
    """
    return value


def _straight_through_fwd(w, value):
    return value, None


def _straight_through_bwd(_, grad):
    return grad, jnp.zeros_like(grad)


straight_through.defvjp(_straight_through_fwd, _straight_through_bwd)


def clip_live(w, contracting, spec):
    """Clip ``w`` to ``[-c, c]``, ``c`` = spec.clip_percentile of ``|w|`` per mixle block.

    ``contracting`` are the weight's input axes; the others are output axes (one block per
    output channel, or per group of the last input axis, or one block for ``tensor``).
    The gradient is straight-through, or masked outside ``[-c, c]`` with ``clip_gradient``.
    """
    out_axes = [a for a in range(w.ndim) if a not in contracting]
    perm = out_axes + list(contracting)
    wt = jnp.transpose(w, perm)
    out_ndim = 0 if spec.granularity == "tensor" else len(out_axes)
    shape = block_shape(wt.shape, spec, 0, out_ndim)
    c = clip_threshold(wt, spec, out_ndim=out_ndim)
    blocks = wt.reshape(shape)
    clipped = jnp.clip(blocks, -c, c).reshape(wt.shape)
    inverse = [perm.index(a) for a in range(w.ndim)]
    clipped = jnp.transpose(clipped, inverse)
    if spec.clip_gradient:
        mask = jnp.transpose((abs(blocks) <= c).reshape(wt.shape), inverse)
        return jnp.where(mask, w, jax.lax.stop_gradient(clipped))
    return straight_through(w, jax.lax.stop_gradient(clipped))


def dotted_path(path):
    """A Flax module path (a tuple of names and indices) as mixle's dotted text."""
    return ".".join(str(p) for p in path)


def _own_params(module):
    """``{name: array}`` of the Params the module owns directly (what Qwix can detect)."""
    if isinstance(module, nn.Module):
        return {n: qwix_seam.unbox(v) for n, v in module.scope._collection("params").items()
                if isinstance(qwix_seam.unbox(v), jax.Array)}
    return {n: v.get_raw_value() for n, v in vars(module).items() if isinstance(v, nnx.Param)}


def _cast_master(module, name, w):
    """The Param ``name`` of ``module`` when ``w`` is that Param cast to a narrower float dtype,
    else ``w`` itself."""
    master = _own_params(module).get(name)
    if (master is None or master is w or tuple(master.shape) != tuple(w.shape)
            or not jnp.issubdtype(master.dtype, jnp.floating)
            or jnp.dtype(master.dtype).itemsize <= jnp.dtype(w.dtype).itemsize):
        return w
    return master


def _shape_match(params, x):
    """The one Param with ``x``'s shape (Qwix's fallback for cast weights), else None."""
    names = [n for n, v in params.items() if tuple(v.shape) == tuple(getattr(x, "shape", ()))]
    return names[0] if len(names) == 1 else None


class QATProvider(qwix_seam.QtProviderBase):
    """A Qwix ``QtProvider`` for ``MixleQtRule``s (see the module docstring).

    Args:
        rules: ``mixle.flax_backend.rules.qwix_rule(...)`` rules, first match wins.

    ``disable_jit`` is always True: Qwix's patched ``dot_general`` would otherwise be baked
    into the trace cache of jitted helpers (``jnp.dot``, ``@``) and leak into user code.
    """

    def __init__(self, rules):
        super().__init__(rules, disable_jit=True)
        self.records = {}  # (module path, param name) -> (QUANTIZED | FLOAT, reason)
        self.tied = set()  # module paths of Embeds whose attend() is quantized
        self.notes = {}  # (module path, param name) -> set of remarks for the report
        self.layouts = {}  # (module path, param name) -> the weight's input (contracting) axes
        self.conv_modules = set()  # module paths whose kernels are convolved
        self.importance = {}  # module path -> ggml's importance (numpy, one per input) its kernel is searched with
        self.probing = False  # apply_qat's abstract probe: the records are wanted, not the values
        self._probed = set()  # the quantizer signatures the probe traced
        self._root = None
        self._params_by_id = None

    def process_model_inputs(self, model, model_args, model_kwargs):
        self._root, self._params_by_id = model, None
        return super().process_model_inputs(model, model_args, model_kwargs)

    def _foreign_weight(self, x, current):
        """``(owner, name)`` if ``x`` is a Param of another NNX module than ``current``, else None."""
        if self._params_by_id is None:
            self._params_by_id = {}
            if isinstance(self._root, nnx.Module):
                for path, node in nnx.iter_graph(self._root):
                    if isinstance(node, nnx.Param):
                        self._params_by_id[id(node.get_raw_value())] = (dotted_path(path[:-1]), str(path[-1]))
        found = self._params_by_id.get(id(x))
        return found if found is not None and found[0] != current else None

    def _note_foreign(self, *operands):
        """Record a Param of another module used in a matmul here: Qwix leaves that use in float."""
        try:
            _, current = self._module_and_path()
        except (ValueError, AttributeError):
            return
        for x in operands:
            found = self._foreign_weight(x, current)
            if found is not None:
                self.notes.setdefault(found, set()).add(
                    f"also used directly by module {current or '<root>'!r}, where it stays float "
                    f"(Qwix quantizes a weight only in the module that owns it)")

    # -- bookkeeping --------------------------------------------------------------------------

    def _record(self, module_path, name, state, reason="", layout=None):
        key = (module_path, name)
        if layout is not None:
            self.layouts[key] = tuple(int(a) for a in layout)
        if self.records.get(key, (None,))[0] == FLOAT and state == QUANTIZED:
            return  # a weight left in float by one op stays reported as float
        self.records[key] = (state, reason)

    def _module_and_path(self):
        module = qwix_seam.current_module()
        return module, dotted_path(qwix_seam.current_module_path())

    def _find_weight(self, module, lhs, rhs):
        """``('lhs' | 'rhs' | None, param name)``: which operand is a weight of ``module``.

        Identity first, then a unique shape match (a cast weight). Unlike Qwix, jit tracer
        lineage is not followed: it exists under ``jit`` but not under ``grad``, so a transposed
        or reshaped weight would be quantized in evaluation and left float in training.
        """
        params = _own_params(module)
        by_id = {id(v): n for n, v in params.items()}
        strong = [by_id.get(id(lhs)), by_id.get(id(rhs))]
        if strong[0] and strong[1]:
            return None, None  # a product of two weights (e.g. a regulariser): keep it float
        if strong[0] or strong[1]:
            return ("lhs", strong[0]) if strong[0] else ("rhs", strong[1])
        weak = [_shape_match(params, lhs), _shape_match(params, rhs)]
        if weak[0] and weak[1] and weak[0] == weak[1]:
            # An activation shaped like the kernel, and a kernel cast (e.g. to bf16) so it is no longer
            # the Param itself: flax layers put the kernel on the right, so that one is the weight.
            self.notes.setdefault((self._module_and_path()[1], weak[1]), set()).add(
                "told from a same-shaped activation by position (flax layers put the kernel on the right)")
            return "rhs", weak[1]
        if weak[0] and weak[1]:
            raise ValueError(
                f"in module {self._module_and_path()[1]!r} both operands of a matmul have the shape of "
                f"a parameter ({weak[0]!r}: {lhs.shape}, {weak[1]!r}: {rhs.shape}) and neither is the "
                f"parameter itself, so the weight cannot be told from the activation: use an input "
                f"whose shape differs from the weights, or contract the parameter value directly"
            )
        if weak[0] or weak[1]:
            return ("lhs", weak[0]) if weak[0] else ("rhs", weak[1])
        return None, None

    # -- dot_general / einsum -----------------------------------------------------------------

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                    *, out_sharding=None):
        rule = self.current_rule("dot_general")
        plain = functools.partial(jax.lax.dot_general, lhs, rhs, dimension_numbers, precision=precision,
                                  preferred_element_type=preferred_element_type, out_sharding=out_sharding)
        if rule is None or rule.weight_qtype is None:
            self._note_foreign(lhs, rhs)
            return plain()
        return self._quantized_dot(rule, lhs, rhs, dimension_numbers, plain)

    def einsum(self, einsum_str, *operands, precision=None, preferred_element_type=None,
               _dot_general=jax.lax.dot_general, out_sharding=None):
        rule = self.current_rule("einsum")
        kwargs = dict(precision=precision, preferred_element_type=preferred_element_type, out_sharding=out_sharding)
        if rule is None or rule.weight_qtype is None or len(operands) != 2:
            self._note_foreign(*operands)
            return jnp.einsum(einsum_str, *operands, _dot_general=_dot_general, **kwargs)

        def quantized_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
            plain = functools.partial(jax.lax.dot_general, lhs, rhs, dimension_numbers, precision=precision,
                                      preferred_element_type=preferred_element_type, **kw)
            return self._quantized_dot(rule, lhs, rhs, dimension_numbers, plain)

        with jax.disable_jit():
            return jnp.einsum(einsum_str, *operands, _dot_general=quantized_dot_general, **kwargs)

    def _quantized_dot(self, rule, lhs, rhs, dimension_numbers, plain, weight=None):
        spec = rule.spec
        module, path = self._module_and_path()
        side, name = weight if weight else self._find_weight(module, lhs, rhs)
        if side is None:
            self._note_foreign(lhs, rhs)
        if side is None and rule.act_qtype is None:
            return plain()
        (lhs_ca, rhs_ca), _ = dimension_numbers
        w = {"lhs": lhs, "rhs": rhs}.get(side)
        contracting = lhs_ca if side == "lhs" else rhs_ca
        weight_qtype = None
        tile_size = spec.group_size if spec.granularity == "group" else None
        if side is not None:
            # As torch's QAT forward: NaN/inf weights raise (eagerly; traced values are abstract).
            check_array(w, f"module {path!r}, weight {name!r}")
            if tile_size is not None and len(contracting) != 1:
                self._record(path, name, FLOAT, (
                    f"group_size needs one input axis, but this weight is contracted over {len(contracting)} "
                    f"axes {tuple(contracting)}: give it granularity='channel' with a (regex, spec) pattern"))
                return plain()
            if tile_size is not None:
                # Raises mixle's message (naming divisors) when group_size does not divide the input.
                try:
                    block_shape((w.shape[contracting[0]],), spec, 0, 0)
                except ValueError as err:
                    raise ValueError(f"module {path!r}, weight {name!r} {tuple(w.shape)}: {err}") from None
            if int_matmul.applies(spec, lhs, rhs, dimension_numbers, side):
                # Integer operands on mixle's weight grid (the float32 master weight's codes).
                self._record(path, name, QUANTIZED, layout=contracting)
                return int_matmul.int_matmul(lhs, _cast_master(module, name, w), spec)
            if uses_mixle_numerics(spec):
                # A layer computing in bfloat16 casts its float32 kernel before the product: the
                # float32 master weight is fake-quantized, and its values cast once, so training
                # sees the lattice convert stores.
                master = _cast_master(module, name, w)
                label, importance = f"module {path!r}, weight {name!r}", self.importance.get(path)
                if self._probe_traced(master, contracting, spec, label, importance):
                    w = master.astype(w.dtype)
                else:
                    w = _fake_quantize_jitted(master, contracting, spec, label, importance=importance, dtype=w.dtype)
                self._record(path, name, QUANTIZED, layout=contracting)
                lhs, rhs = (w, _rounded_input(rhs, rhs_ca, spec, label)) if side == "lhs" else (
                    _rounded_input(lhs, lhs_ca, spec, label), w)
                # The plain product of the two (its backward is the textbook STE), as convert's layer runs it.
                return _weight_product(module, name, side, spec, lhs, rhs, dimension_numbers, plain.keywords)
            else:
                if spec.clip_percentile is not None and spec.clip_percentile < 100:
                    w = clip_live(w, contracting, spec)
                if tile_size is not None:
                    w = self._fake_quantize_tiled(w, contracting, rule)
                else:
                    weight_qtype = rule.weight_qtype
            self._record(path, name, QUANTIZED, layout=contracting)
            lhs, rhs = (w, rhs) if side == "lhs" else (lhs, w)
        config = self._config(rule, side, weight_qtype, tile_size)
        with _naming_kernel(path, name, spec):
            return qwix_seam.quantized_dot_general(lhs, rhs, dimension_numbers, **config)

    def _probe_traced(self, master, contracting, spec, label, importance):
        """Whether the probe has already traced the quantizer for a kernel like this one (its shape, dtype,
        input axes, spec, with or without an importance): then its checks passed, and this kernel's
        importance is checked against it here. Tracing a weighted search for each of a 30-layer
        decoder's 210 kernels took most of apply_qat's time."""
        if not self.probing:
            return False
        key = (tuple(master.shape), str(master.dtype), tuple(int(a) for a in contracting), spec, importance is None)
        if key not in self._probed:
            self._probed.add(key)
            return False
        if importance is not None:
            inputs = math.prod(int(master.shape[a]) for a in contracting)
            check_importance(importance, (master.size // inputs, inputs), name=label)
        return True

    def _fake_quantize_tiled(self, w, contracting, rule):
        """Qwix's group-wise quantize-dequantize of a weight, straight-through gradient."""
        spec = rule.spec
        channelwise = [a for a in range(w.ndim) if a not in contracting]
        deq = qwix_seam.quantize_dequantize(jax.lax.stop_gradient(w), rule.weight_qtype, channelwise_axes=channelwise,
                                            tiled_axes={contracting[-1]: spec.group_size},
                                            calibration_method=range_calibration(spec))
        return straight_through(w, deq)

    def _config(self, rule, side, weight_qtype, tile_size):
        """The Qwix config fields of ``quantized_dot_general`` (``qwix_seam.DOT_GENERAL_QT_FIELDS``)."""
        spec = rule.spec
        act_qtype, act_method = rule.act_qtype, rule.act_calibration_method
        tensor = spec.granularity == "tensor"
        per_side = {}
        for s in ("lhs", "rhs"):
            is_weight = s == side
            per_side[s] = dict(
                qtype=weight_qtype if is_weight else act_qtype,
                method=range_calibration(spec) if is_weight else act_method,
                disable=tensor and is_weight,
            )
        noise_fn = None
        if rule.bwd_qtype is not None and rule.bwd_stochastic_rounding is not None:
            noise_fn = qwix_seam.stochastic_noise_fn(
                method=rule.bwd_stochastic_rounding,
                key=qwix_seam.make_rng("stochastic_rounding"),
                channelwise_noise_axes=rule.channelwise_noise_axes,
            )
        return dict(
            lhs_qtype=per_side["lhs"]["qtype"],
            rhs_qtype=per_side["rhs"]["qtype"],
            tile_size=tile_size if act_qtype is not None else None,
            lhs_calibration_method=per_side["lhs"]["method"] or "absmax",
            rhs_calibration_method=per_side["rhs"]["method"] or "absmax",
            lhs_disable_channelwise_axes=per_side["lhs"]["disable"],
            rhs_disable_channelwise_axes=per_side["rhs"]["disable"],
            dlhs_grad_qtype=rule.bwd_qtype,
            dlhs_grad_calibration_method=rule.bwd_calibration_method,
            dlhs_stochastic_rounding_noise_fn=noise_fn,
            drhs_grad_qtype=rule.bwd_qtype,
            drhs_grad_calibration_method=rule.bwd_calibration_method,
            drhs_stochastic_rounding_noise_fn=noise_fn,
            use_original_residuals=False,  # textbook STE: dx = g @ q(W)^T
        )

    # -- conv and ragged_dot ------------------------------------------------------------------

    def conv_general_dilated(self, lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                             dimension_numbers=None, feature_group_count=1, batch_group_count=1,
                             precision=None, preferred_element_type=None, out_sharding=None):
        rule = self.current_rule("conv_general_dilated", only_rule=True)
        geometry = (window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                    feature_group_count, batch_group_count)

        def plain(rhs=rhs):
            return jax.lax.conv_general_dilated(lhs, rhs, *geometry, precision=precision,
                                                preferred_element_type=preferred_element_type,
                                                out_sharding=out_sharding)

        if rule is None or rule.weight_qtype is None:
            return plain()
        spec = rule.spec
        module, path = self._module_and_path()
        side, name = self._find_weight(module, lhs, rhs)
        if side != "rhs":
            return plain()
        if spec.granularity == "group":
            self._record(path, name, FLOAT, "Qwix's convolution has no group-wise (tiled) scales: "
                                            "give this layer granularity='channel' with a (regex, spec) pattern")
            return plain()
        dnums = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
        inputs = [a for a in range(rhs.ndim) if a != dnums.rhs_spec[0]]
        self._record(path, name, QUANTIZED, layout=inputs)
        self.conv_modules.add(path)
        _check_conv_dtypes(spec, path, name)
        weight_qtype = rule.weight_qtype
        if uses_mixle_numerics(spec):
            if spec.act_bits is not None:
                raise ValueError(f"module {path!r}: act_bits on {spec.grid!r} rounds the inputs of matmuls as "
                                 f"llama.cpp does; a convolution has no llama.cpp product: leave act_bits out")
            rhs, weight_qtype = _fake_quantize_jitted(rhs, inputs, spec, f"module {path!r}, weight {name!r}"), None
            if rule.bwd_qtype is None:
                return plain(rhs)
        elif spec.clip_percentile is not None and spec.clip_percentile < 100:
            rhs = clip_live(rhs, inputs, spec)
        config = dict(
            lhs_qtype=rule.act_qtype,
            rhs_qtype=weight_qtype,
            lhs_calibration_method=rule.act_calibration_method or "absmax",
            rhs_calibration_method=range_calibration(spec),
            rhs_disable_channelwise_axes=spec.granularity == "tensor",
            dlhs_grad_qtype=rule.bwd_qtype,
            drhs_grad_qtype=rule.bwd_qtype,
            dlhs_grad_calibration_method=rule.bwd_calibration_method,
            drhs_grad_calibration_method=rule.bwd_calibration_method,
        )
        # Qwix's conv QT keeps the quantized operands as residuals: the textbook STE already.
        with _naming_kernel(path, name, spec):
            return qwix_seam.quantized_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation,
                                                            rhs_dilation, dimension_numbers, feature_group_count,
                                                            batch_group_count, out_sharding, **config)

    def ragged_dot(self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None):
        """Mixture-of-experts products stay float, reported with the reason: Qwix's ``ragged_dot_qt``
        scales the ``(experts, in, out)`` weight per output channel across all experts, where mixle's
        torch experts and llama.cpp's files have one scale per expert and channel."""
        rule = self.current_rule("ragged_dot", only_rule=True)
        if rule is not None and rule.weight_qtype is not None:
            module, path = self._module_and_path()
            name = self._find_weight(module, lhs, rhs)[1]
            if name is not None:
                self._record(path, name, FLOAT, (
                    "expert weights of jax.lax.ragged_dot: Qwix 0.1.8 gives them one scale per output channel "
                    "shared by all experts, not mixle's per-expert scales (torch's experts kind, llama.cpp's "
                    "files), so they stay float; exclude them to silence this"))
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision,
                                  preferred_element_type=preferred_element_type, group_offset=group_offset)

    # -- tied embeddings ----------------------------------------------------------------------

    def get_intercept_map(self):
        mapping = super().get_intercept_map()
        attend, lookup = qwix_seam.module_method(self.attend), qwix_seam.module_method(self.lookup)
        mapping["flax.nnx.nn.linear.Embed.attend"] = attend
        mapping["flax.nnx.nn.linear.Embed.__call__"] = lookup
        # Linen wraps methods (scope handling); patch the inner functions it calls.
        mapping["flax.linen.linear.Embed.attend.__wrapped__"] = attend
        mapping["flax.linen.linear.Embed.__call__.__wrapped__"] = lookup
        return mapping

    @staticmethod
    def _table(embed, *others, inexact=True):
        """The embedding table (and other arrays) promoted to the Embed's dtype, as flax does."""
        if isinstance(embed, nn.Module):
            return embed.promote_dtype(*others, embed.embedding, dtype=embed.dtype, inexact=inexact)
        return embed.promote_dtype((*others, embed.embedding.get_raw_value()), dtype=embed.dtype, inexact=inexact)

    @staticmethod
    def _original(embed, method):
        cls = nn.Embed if isinstance(embed, nn.Module) else nnx.Embed
        function = getattr(cls, method)
        return getattr(function, "__wrapped__", function)  # the patched code runs the original here

    def attend(self, embed, query, **kwargs):
        """``Embed.attend`` with the table contracted directly as the weight (channel = vocab row)."""
        rule = self.current_rule("dot_general")
        if rule is None or rule.weight_qtype is None:
            return self._original(embed, "attend")(embed, query, **kwargs)
        query, table = self._table(embed, query)
        path = self._module_and_path()[1]
        if uses_mixle_numerics(rule.spec):
            self._record(path, "embedding", QUANTIZED, layout=(1,))
            self.tied.add(path)
            # flax's own attend computation on the fake-quantized table: what the converted model runs.
            label = f"module {path!r}, embedding"
            return _dot_transposed(_rounded_input(query, (query.ndim - 1,), rule.spec, label),
                                   _fake_quantize_jitted(table, (1,), rule.spec, label), **kwargs)
        numbers = (((query.ndim - 1,), (1,)), ((), ()))
        plain = functools.partial(jax.lax.dot_general, query, table, numbers)
        out = self._quantized_dot(rule, query, table, numbers, plain, weight=("rhs", "embedding"))
        if self.records.get((path, "embedding"), (None,))[0] == QUANTIZED:
            self.tied.add(path)
        return out

    def _peek_rule(self, path):
        """The first rule matching a '/'-joined module path, without counting it as used."""
        return next((r for r in self.rules if re.fullmatch(r.module_path, path)), None)

    def lookup(self, embed, inputs, **kwargs):
        """Lookups of a tied embedding read the same quantized table as its ``attend``."""
        path = dotted_path(qwix_seam.current_module_path())
        # A lookup is not an intercepted op: it must not make an unused rule look used.
        rule = self._peek_rule(path.replace(".", "/"))
        if path not in self.tied or rule is None or rule.weight_qtype is None or embed.num_embeddings == 1:
            return self._original(embed, "__call__")(embed, inputs, **kwargs)
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError("Input type must be an integer or unsigned integer.")
        (table,) = self._table(embed, inexact=False)
        check_array(table, f"module {path!r}, embedding")
        spec = rule.spec
        if uses_mixle_numerics(spec):
            return jnp.take(_fake_quantize_jitted(table, (1,), spec, f"module {path!r}, embedding"), inputs, axis=0)
        if spec.clip_percentile is not None and spec.clip_percentile < 100:
            table = clip_live(table, (1,), spec)
        if spec.granularity == "group":
            table = self._fake_quantize_tiled(table, (1,), rule)
        else:
            deq = qwix_seam.quantize_dequantize(jax.lax.stop_gradient(table), rule.weight_qtype,
                                                channelwise_axes=[] if spec.granularity == "tensor" else [0],
                                                calibration_method=range_calibration(spec))
            table = straight_through(table, deq)
        return jnp.take(table, inputs, axis=0)


@contextlib.contextmanager
def _naming_kernel(path, name, spec):
    """Re-raise an error from inside Qwix/XLA with the kernel and spec it happened on."""
    try:
        yield
    except Exception as err:
        kernel = f"{path}.{name}" if path and name else (name or path or "<root>")
        if f"kernel {kernel!r}" in str(err):
            raise
        try:
            named = type(err)(f"kernel {kernel!r} ({spec.short()}): {err}")
        except Exception:
            named = RuntimeError(f"kernel {kernel!r} ({spec.short()}): {type(err).__name__}: {err}")
        raise named from err


def _check_conv_dtypes(spec, path, name):
    """Refuse int4 kernels convolved with int8 activations or gradients, naming the kernel."""
    if spec.bits == 4 and spec.weight_format == "int" and 8 in (spec.act_bits, spec.bwd_bits):
        other = "activations" if spec.act_bits == 8 else "gradients"
        kernel = f"{path}.{name}" if path else name
        raise ValueError(
            f"kernel {kernel!r} is a convolution: {spec.short()} would make XLA convolve int4 weights with int8 "
            f"{other}, which lax.conv_general_dilated cannot (it needs one dtype for both operands); give the "
            f"convolutions 8-bit weights with a per-layer pattern, e.g. patterns=[({re.escape(path)!r}, "
            f"{spec.replace(bits=8)!r}), '.*']")


@qwix_seam.not_intercepted
def _dot_transposed(query, table, **kwargs):
    """``Embed.attend``'s product (``jnp.dot(query, table.T)``), not intercepted again."""
    return jnp.dot(query, table.T, **kwargs)
