"""What mixle needs from Qwix, in one place: ``mixle/flax_backend/qwix_seam.py`` is the only module
that touches Qwix, and every private Qwix name it relies on is pinned here (exists, signature,
behaviour against a numpy reference), so a Qwix upgrade that moves one fails here, naming it."""

import ast
import dataclasses
import functools
import importlib
import inspect
import pathlib

import numpy as np
import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "mixle"
SEAM = PACKAGE / "flax_backend" / "qwix_seam.py"


# ------------------------------------------------------------------------------------------------
# The house rule: one seam (no Qwix needed)


def qwix_uses(tree):
    """``(line, text, private)`` for every import of Qwix, attribute of an imported Qwix name, and
    Qwix module name given as a string (``importlib.import_module("qwix...")``) in a module."""
    found, names = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "qwix":
                    found.append((node.lineno, f"import {alias.name}", "._" in f".{alias.name}"))
                    names.add(alias.asname or "qwix")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "qwix":
            for alias in node.names:
                text = f"from {node.module} import {alias.name}"
                found.append((node.lineno, text, "._" in f".{node.module}" or alias.name.startswith("_")))
                names.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names:
            found.append((node.lineno, f"{node.value.id}.{node.attr}", node.attr.startswith("_")))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("qwix.") \
                and node.value.replace(".", "").replace("_", "").isalnum():
            found.append((node.lineno, repr(node.value), "._" in f".{node.value}"))
    return found


def other_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != SEAM:
            yield path, ast.parse(path.read_text(), filename=str(path))


def test_only_the_seam_touches_qwix_internals():
    private = [f"{path.relative_to(PACKAGE.parent)}:{line} {text}" for path, tree in other_modules()
               for line, text, is_private in qwix_uses(tree) if is_private]
    assert private == [], "only mixle/flax_backend/qwix_seam.py may use qwix._src or a private Qwix name"


def test_only_the_seam_imports_qwix():
    # Public Qwix names go through the seam too, so a Qwix upgrade touches one file.
    uses = [f"{path.relative_to(PACKAGE.parent)}:{line} {text}" for path, tree in other_modules()
            for line, text, _ in qwix_uses(tree)]
    assert uses == [], "import Qwix's names from mixle.flax_backend.qwix_seam"


def test_the_seam_rule_sees_a_violation():
    tree = ast.parse("import qwix\nfrom qwix._src import model\nfrom qwix import QtRule\nqwix._src\nqwix.QtProvider\n"
                     "importlib.import_module('qwix._src.model')\n")
    found = sorted(qwix_uses(tree))
    assert [(line, private) for line, _, private in found] == [
        (1, False), (2, True), (3, False), (4, True), (5, False), (6, True)]
    # ... and the seam itself is where the private names are.
    assert any(private for _, _, private in qwix_uses(ast.parse(SEAM.read_text())))


# ------------------------------------------------------------------------------------------------
# What the seam needs from Qwix


# (module, name, the leading parameters the seam passes, in order): functions the seam calls.
PRIVATE_FUNCTIONS = [
    ("qwix._src.model", "_apply_interceptors", ("method", "provider", "output_transform")),
    ("qwix._src.interception", "disable_interceptions", ("fn",)),
    ("qwix._src.utils.flax_util", "get_current_module", ()),
    ("qwix._src.utils.flax_util", "get_current_module_path", ()),
    ("qwix._src.utils.flax_util", "unbox", ("maybe_boxed",)),
    ("qwix._src.utils.flax_util", "make_rng", ("rng_stream",)),
    ("qwix._src.core.stochastic_rounding", "get_noise_fn", ("method", "key", "channelwise_noise_axes")),
    ("qwix._src.core.dot_general_qt", "dot_general_qt", ("lhs", "rhs", "dimension_numbers", "config")),
    ("qwix._src.core.conv_general_qt", "conv_general_qt", (
        "lhs", "rhs", "config", "window_strides", "padding", "lhs_dilation", "rhs_dilation", "dimension_numbers",
        "feature_group_count", "batch_group_count", "out_sharding")),
]


def _qwix_attr(module, name):
    qwix = pytest.importorskip("qwix")
    try:
        return functools.reduce(getattr, name.split("."), importlib.import_module(module))
    except (ImportError, AttributeError) as err:
        pytest.fail(f"Qwix {qwix.__version__} has no {module}.{name}, which mixle/flax_backend/qwix_seam.py "
                    f"uses ({err}): adapt the seam")


@pytest.mark.parametrize("module, name, params", PRIVATE_FUNCTIONS, ids=[f"{m}.{n}" for m, n, _ in PRIVATE_FUNCTIONS])
def test_private_qwix_function_exists_with_the_parameters_the_seam_passes(module, name, params):
    function = _qwix_attr(module, name)
    names = list(inspect.signature(function).parameters)
    assert names[:len(params)] == list(params), f"{module}.{name}{inspect.signature(function)}"


@pytest.mark.parametrize("module, name, fields", [
    ("qwix._src.core.dot_general_qt", "DotGeneralQtConfig", "DOT_GENERAL_QT_FIELDS"),
    ("qwix._src.core.conv_general_qt", "ConvGeneralQtConfig", "CONV_GENERAL_QT_FIELDS"),
])
def test_private_qwix_config_has_the_fields_the_seam_sets(module, name, fields):
    config = _qwix_attr(module, name)
    from mixle.flax_backend import qwix_seam

    missing = sorted(getattr(qwix_seam, fields) - {f.name for f in dataclasses.fields(config)})
    assert missing == [], f"{module}.{name} lost the fields {missing}"


def test_qt_provider_private_members_the_seam_uses():
    # QtProviderBase.current_rule and .rules (the behaviour: the interception tests below).
    qwix = pytest.importorskip("qwix")
    signature = inspect.signature(_qwix_attr("qwix", "QtProvider._get_current_rule_and_op_id"))
    assert list(signature.parameters)[:2] == ["self", "op_name"]
    assert signature.parameters["only_rule"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "_rules" in vars(qwix.QtProvider([])), f"Qwix {qwix.__version__}'s QtProvider keeps no _rules list"


def _seam():
    pytest.importorskip("qwix")
    from mixle.flax_backend import qwix_seam

    return qwix_seam


def _recorder(seam, rules, draw_rng=False):
    import jax

    class Recorder(seam.QtProviderBase):
        """Records, for every intercepted dot_general, the module Qwix says is running and its rule."""

        def __init__(self):
            super().__init__(rules, disable_jit=True)
            self.ops, self.calls, self.outputs, self.keys = [], [], [], []

        def process_model_inputs(self, model, model_args, model_kwargs):
            self.calls.append(model)
            return super().process_model_inputs(model, model_args, model_kwargs)

        def process_model_output(self, method_name, model_output):
            self.outputs.append(method_name)
            return super().process_model_output(method_name, model_output)

        def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                        out_sharding=None):
            rule = self.current_rule("dot_general")
            self.ops.append((seam.current_module(), tuple(seam.current_module_path()), rule and rule.module_path))
            if draw_rng:
                self.keys.append(seam.make_rng("stochastic_rounding"))
            return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                       preferred_element_type=preferred_element_type, out_sharding=out_sharding)

    return Recorder()


def _two_layers(seam, rngs=None):
    from flax import nnx

    class TwoLayers(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(2, 2, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.b(self.a(x))

    model = TwoLayers()
    for path, module in nnx.iter_modules(model):
        seam.mark_nnx_module(module, path, rngs)
    return model


def _numpy_forward(model, x):
    hidden = x @ np.asarray(model.a.kernel[...]) + np.asarray(model.a.bias[...])
    return hidden @ np.asarray(model.b.kernel[...]) + np.asarray(model.b.bias[...])


def test_intercepted_method_routes_ops_to_the_provider_with_module_path_and_rule():
    # _apply_interceptors, get_current_module(_path) by qwix_path, _get_current_rule_and_op_id and _rules.
    seam = _seam()
    import jax.numpy as jnp

    rules = [seam.QtRule(module_path="a"), seam.QtRule(module_path=".*"), seam.QtRule(module_path="never")]
    provider = _recorder(seam, rules)
    assert [r.module_path for r in provider.rules] == ["a", ".*", "never"]
    model = _two_layers(seam)
    x = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    out = seam.intercept_method(type(model).__call__, provider, "__call__")(model, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(out), _numpy_forward(model, x), rtol=1e-6)
    assert provider.ops == [(model.a, ("a",), "a"), (model.b, ("b",), ".*")]
    assert provider.calls == [model] and provider.outputs == ["__call__"]
    assert [r.module_path for r in provider.get_unused_rules()] == ["never"]


def test_the_rules_keep_their_class_and_qwix_defaults():
    # mixle's rules carry their QuantSpec; the provider reads act_calibration_method's default.
    seam = _seam()
    from mixle.core.spec import QuantSpec
    from mixle.flax_backend.rules import qwix_rule

    spec = QuantSpec(bits=4, group_size=2)
    (rule,) = seam.QtProviderBase([qwix_rule(spec, "fc")]).rules
    assert rule.spec == spec and rule.tile_size == 2 and rule.act_calibration_method == "absmax"


def test_interception_is_not_reentrant_and_can_be_switched_off():
    seam = _seam()
    import jax.numpy as jnp
    from flax import nnx

    provider = _recorder(seam, [seam.QtRule(module_path=".*")])
    model = _two_layers(seam)
    inner = seam.intercept_method(nnx.Linear.__call__, provider, "inner")
    outer = seam.intercept_method(lambda m, x: inner(m.b, inner(m.a, x)), provider, "outer")
    outer(model, jnp.ones((1, 3)))
    assert provider.calls == [model] and provider.outputs == ["outer"] and len(provider.ops) == 2

    provider.ops.clear()
    kernel = model.a.kernel[...]

    def products(m, x):
        return m.a(x), seam.not_intercepted(jnp.dot)(x, kernel)

    plain, hidden = seam.intercept_method(products, provider, "products")(model, jnp.ones((1, 3)))
    assert [op[1] for op in provider.ops] == [("a",)]  # the not_intercepted product reached no provider
    np.testing.assert_allclose(np.asarray(hidden), np.ones((1, 3)) @ np.asarray(kernel), rtol=1e-6)


def test_module_method_keeps_the_module_findable():
    # Qwix finds an NNX module as a calling frame's `self`: QATProvider's Embed.attend replacement.
    seam = _seam()
    import jax.numpy as jnp
    from flax import nnx

    original_attend = nnx.Embed.attend
    seen = []

    class AttendRecorder(seam.QtProviderBase):
        def get_intercept_map(self):
            mapping = super().get_intercept_map()
            mapping["flax.nnx.nn.linear.Embed.attend"] = seam.module_method(self.attend)
            return mapping

        def attend(self, embed, query):
            seen.append((seam.current_module(), tuple(seam.current_module_path())))
            return original_attend(embed, query)

    class Tied(nnx.Module):
        def __init__(self):
            self.embed = nnx.Embed(5, 3, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.embed.attend(x)

    model = Tied()
    for path, module in nnx.iter_modules(model):
        seam.mark_nnx_module(module, path, None)
    query = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    out = seam.intercept_method(Tied.__call__, AttendRecorder([]), "__call__")(model, jnp.asarray(query))
    assert seen == [(model.embed, ("embed",))]
    np.testing.assert_allclose(np.asarray(out), query @ np.asarray(model.embed.embedding[...]).T, rtol=1e-6)


def test_linen_modules_are_found_by_their_path():
    seam = _seam()
    import jax
    import jax.numpy as jnp
    from flax import linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2, name="fc")(x)

    provider = _recorder(seam, [seam.QtRule(module_path="fc")])
    x = jnp.ones((1, 3))
    variables = Net().init(jax.random.key(0), x)
    quantized = seam.quantize_model(Net(), provider)
    assert seam.quantized_by_qwix(type(quantized)) and not seam.quantized_by_qwix(Net)
    quantized.apply(variables, x)
    ((module, path, rule),) = provider.ops
    assert isinstance(module, nn.Dense) and path == ("fc",) and rule == "fc"


def test_unbox_returns_the_param_array_itself():
    # QATProvider tells a weight by identity: unbox must hand back the very array.
    seam = _seam()
    import jax.numpy as jnp
    from flax import linen as nn

    x = jnp.arange(4.0)
    assert seam.unbox(x) is x
    assert seam.unbox(nn.Partitioned(x, names=("a",))) is x


def test_make_rng_draws_from_the_marked_nnx_rngs():
    seam = _seam()
    import jax
    import jax.numpy as jnp
    from flax import nnx

    provider = _recorder(seam, [], draw_rng=True)
    model = _two_layers(seam, rngs=nnx.Rngs(stochastic_rounding=3))
    seam.intercept_method(type(model).__call__, provider, "__call__")(model, jnp.ones((1, 3)))
    expected = nnx.Rngs(stochastic_rounding=3)
    for key in provider.keys:  # one shared stream: successive keys
        np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(expected.stochastic_rounding()))
    assert len(provider.keys) == 2


def test_qwix_sets_and_reads_the_attributes_the_seam_names():
    seam = _seam()
    import jax.numpy as jnp
    import qwix
    from flax import nnx

    model = _two_layers(seam)
    for _, module in nnx.iter_modules(model):
        for key in seam.MODULE_ATTRIBUTES:
            delattr(module, key)
    before = {path: set(vars(m)) for path, m in nnx.iter_modules(model)}
    quantized = qwix.quantize_model(model, seam.QtProviderBase([]), jnp.ones((1, 3)))
    added = {path: set(vars(m)) - before[path] for path, m in nnx.iter_modules(quantized)}
    assert all(names == set(seam.MODULE_ATTRIBUTES) for names in added.values()), added
    float_class = getattr(type(quantized), seam.UNQUANTIZED_TYPE)
    assert float_class is type(model) and seam.quantized_by_qwix(type(quantized))
    # ... and Qwix reads the marker: a marked subclass is quantized as the class it names.
    marked = type("Marked", (float_class,), {seam.UNQUANTIZED_TYPE: float_class})
    object.__setattr__(model, "__class__", marked)
    again = qwix.quantize_model(model, seam.QtProviderBase([]), jnp.ones((1, 3)))
    assert type(again).__mro__[1] is float_class


def test_stochastic_noise_is_uniform_per_channel_and_a_pytree():
    seam = _seam()
    import jax
    import jax.numpy as jnp

    key = jax.random.key(7)
    noise_fn = seam.stochastic_noise_fn("uniform", key, channelwise_noise_axes=(0,))
    noise = noise_fn((3, 4))
    np.testing.assert_array_equal(np.asarray(noise), np.asarray(jax.random.uniform(key, (3, 1), jnp.float32, -0.5, 0.5)))
    # The key is a leaf (traced through jit inside a config), the method static.
    assert len(jax.tree.leaves(noise_fn)) == 1


# Qwix's 'absmax,f' calibration scales absmax by f over its bound 127.5: this f is mixle's symmetric
# grid (scale = absmax / 127, what rules.range_calibration gives). On Qwix's own grid ('absmax') the
# absmax element lands on the tie -127.5, whose side depends on the last bit of the scale.
SYMMETRIC = f"absmax,{127.5 / 127!r}"


def _int8_dequantized(w, reduce_axes):
    """numpy reference of the symmetric int8 grid: scale = absmax / 127, codes rounded half to even."""
    scale = np.abs(w).max(axis=reduce_axes, keepdims=True) / 127
    return np.clip(np.round(w / scale), -127, 127) * scale


DOT = (((1,), (0,)), ((), ()))


def _dot_case():
    rng = np.random.default_rng(0)
    return rng.standard_normal((2, 4)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)


@pytest.mark.parametrize("use_original_residuals", [False, True])
def test_quantized_dot_general_weight_grid_and_straight_through_gradient(use_original_residuals):
    seam = _seam()
    import jax
    import jax.numpy as jnp

    x, w = _dot_case()
    g = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)

    def loss(x, w):
        out = seam.quantized_dot_general(x, w, DOT, rhs_qtype=jnp.int8, rhs_calibration_method=SYMMETRIC,
                                         use_original_residuals=use_original_residuals)
        return jnp.sum(out * g), out

    (dx, dw), out = jax.grad(loss, argnums=(0, 1), has_aux=True)(jnp.asarray(x), jnp.asarray(w))
    deq = _int8_dequantized(w, 0)  # one scale per output channel (rhs's free axis)
    np.testing.assert_allclose(np.asarray(out), x @ deq, rtol=1e-5, atol=1e-6)
    # mixle passes use_original_residuals=False: the textbook STE dx = g @ q(W)^T.
    np.testing.assert_allclose(np.asarray(dx), g @ (w if use_original_residuals else deq).T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dw), x.T @ g, rtol=1e-5, atol=1e-6)


def test_quantized_dot_general_per_tensor_scale():
    seam = _seam()
    import jax.numpy as jnp

    x, w = _dot_case()
    out = seam.quantized_dot_general(jnp.asarray(x), jnp.asarray(w), DOT, rhs_qtype=jnp.int8,
                                     rhs_calibration_method=SYMMETRIC, rhs_disable_channelwise_axes=True)
    np.testing.assert_allclose(np.asarray(out), x @ _int8_dequantized(w, None), rtol=1e-5, atol=1e-6)


def test_quantized_dot_general_activations_per_token_and_tiles():
    seam = _seam()
    import jax.numpy as jnp

    x, w = _dot_case()
    out = seam.quantized_dot_general(jnp.asarray(x), jnp.asarray(w), DOT, lhs_qtype=jnp.int8, rhs_qtype=jnp.int8,
                                     lhs_calibration_method=SYMMETRIC, rhs_calibration_method=SYMMETRIC, tile_size=2)
    # Both operands in tiles of 2 along the contracting axis: x per token, w per output channel.
    xq = _int8_dequantized(x.reshape(2, 2, 2), 2).reshape(2, 4)
    wq = _int8_dequantized(w.reshape(2, 2, 3), 1).reshape(4, 3)
    np.testing.assert_allclose(np.asarray(out), xq @ wq, rtol=1e-5, atol=1e-6)


def test_quantized_dot_general_refuses_a_field_the_seam_does_not_declare():
    seam = _seam()
    import jax.numpy as jnp

    x, w = _dot_case()
    with pytest.raises(TypeError, match="lhs_collect_quant_stat"):
        seam.quantized_dot_general(jnp.asarray(x), jnp.asarray(w), DOT, lhs_collect_quant_stat=None)


def test_quantized_conv_weight_grid_and_straight_through_gradient():
    seam = _seam()
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 2, 5)).astype(np.float32)  # N C W
    w = rng.standard_normal((3, 2, 2)).astype(np.float32)  # O I K
    g = np.linspace(-1, 1, 12, dtype=np.float32).reshape(1, 3, 4)

    def loss(x):
        out = seam.quantized_conv_general_dilated(x, jnp.asarray(w), (1,), "VALID", None, None, None, 1, 1, None,
                                                  rhs_qtype=jnp.int8, rhs_calibration_method=SYMMETRIC)
        return jnp.sum(out * g), out

    dx, out = jax.grad(loss, has_aux=True)(jnp.asarray(x))
    deq = _int8_dequantized(w, (1, 2))  # one scale per output channel
    windows = np.stack([x[:, :, t:t + 2] for t in range(4)], axis=-1)  # N I K T
    np.testing.assert_allclose(np.asarray(out), np.einsum("nikt,oik->not", windows, deq), rtol=1e-5, atol=1e-6)
    # Qwix keeps the quantized kernel as the residual: dx = conv^T(g, q(W)).
    expected = np.zeros_like(x)
    for t in range(4):
        expected[:, :, t:t + 2] += np.einsum("no,oik->nik", g[:, :, t], deq)
    np.testing.assert_allclose(np.asarray(dx), expected, rtol=1e-5, atol=1e-6)


def test_quantize_dequantize_channelwise_and_tiled():
    seam = _seam()
    import jax.numpy as jnp

    _, w = _dot_case()
    channel = seam.quantize_dequantize(jnp.asarray(w), jnp.int8, channelwise_axes=[1], calibration_method=SYMMETRIC)
    np.testing.assert_allclose(np.asarray(channel), _int8_dequantized(w, 0), rtol=1e-6)
    tiled = seam.quantize_dequantize(jnp.asarray(w), jnp.int8, channelwise_axes=[1], tiled_axes={0: 2},
                                     calibration_method=SYMMETRIC)
    np.testing.assert_allclose(np.asarray(tiled), _int8_dequantized(w.reshape(2, 2, 3), 1).reshape(4, 3), rtol=1e-6)
