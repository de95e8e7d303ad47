"""LoRA on Flax NNX models: float adapters beside fake-quantized kernels, merge, report, atomic refusals."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("qwix")

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from mixle.api import apply_qat, convert, get_qat_report, set_fake_quant_enabled  # noqa: E402
from mixle.experimental.program.lora import apply_lora, get_lora_report, lora_parameters, merge_lora  # noqa: E402
from mixle.flax_backend.lora import LoRALinear  # noqa: E402
from tests.test_numerics import reference_codes_scales  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

RNG = np.random.default_rng(11)
X = RNG.standard_normal((6, 24)).astype(np.float32)
RANK, ALPHA = 2, 6.0  # scaling 3


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(24, 32, rngs=rngs), nnx.Linear(32, 8, rngs=rngs)])

    def __call__(self, x):
        return self.layers[1](jax.nn.relu(self.layers[0](x)))


def _trained_adapters(model):
    """Give every adapter non-zero A and B (fresh ones have B = 0)."""
    rng = np.random.default_rng(3)
    for layer in model.layers:
        for var in (layer.lora.lora_a, layer.lora.lora_b):
            var[...] = jnp.asarray(rng.standard_normal(var.shape).astype(np.float32) * 0.3)


def _numpy_forward(model, quantize):
    """x @ Q(W) + b + (x @ A) @ B * alpha/rank per layer, ReLU between (numpy, from the Variables)."""
    h = X.astype(np.float64)
    for i, layer in enumerate(model.layers):
        w = np.asarray(layer.kernel[...])
        if quantize:
            w = reference_codes_scales(w.T, 4, "channel")[2].T  # torch layout (out, in) per channel
        a, b = np.asarray(layer.lora.lora_a[...]), np.asarray(layer.lora.lora_b[...])
        h = h @ w + np.asarray(layer.bias[...]) + (h @ a) @ b * (ALPHA / RANK)
        if i == 0:
            h = np.maximum(h, 0)
    return h


def _tolerance(expected):
    return 1e-5 * np.abs(expected).max()  # fp32 sums of <= 32 products against float64


@pytest.mark.parametrize("order", ["qat_first", "lora_first"])
def test_forward_is_the_quantized_kernel_plus_the_float_adapter(order):
    x = jnp.asarray(X)
    model = MLP(nnx.Rngs(0))
    if order == "qat_first":
        apply_qat(model, bits=4, example_inputs=(x,))
        assert apply_lora(model, rank=RANK, alpha=ALPHA) is model
    else:
        apply_lora(model, rank=RANK, alpha=ALPHA)
        apply_qat(model, bits=4, example_inputs=(x,))
    assert all(isinstance(layer, LoRALinear) for layer in model.layers)
    np.testing.assert_array_equal(model.layers[0].kernel.shape, (24, 32))  # same Variables, same paths
    _trained_adapters(model)
    expected = _numpy_forward(model, quantize=True)
    np.testing.assert_allclose(model(x), expected, rtol=0, atol=_tolerance(expected))
    np.testing.assert_allclose(nnx.jit(lambda m, v: m(v))(model, x), expected, rtol=0, atol=_tolerance(expected))
    # Calling a layer directly is quantized too (no silent float through the swapped class).
    direct = X @ reference_codes_scales(np.asarray(model.layers[0].kernel[...]).T, 4, "channel")[2].T \
        + np.asarray(model.layers[0].bias[...]) \
        + (X @ np.asarray(model.layers[0].lora.lora_a[...])) @ np.asarray(model.layers[0].lora.lora_b[...]) * 3
    np.testing.assert_allclose(model.layers[0](x), direct, rtol=0, atol=_tolerance(direct))
    # The QAT report: both kernels quantized, the four adapter matrices float as adapters.
    report = get_qat_report(model)
    assert report.wrapped == ["layers.0.kernel", "layers.1.kernel"]
    assert sorted(d.path for d in report.decisions if d.kind == "adapter") == [
        "layers.0.lora.lora_a", "layers.0.lora.lora_b", "layers.1.lora.lora_a", "layers.1.lora.lora_b"]
    assert get_lora_report(model).wrapped == ["layers.0", "layers.1"]
    # Off: the float kernel plus the same adapter.
    set_fake_quant_enabled(model, False)
    expected = _numpy_forward(model, quantize=False)
    np.testing.assert_allclose(model(x), expected, rtol=0, atol=_tolerance(expected))


def test_a_fresh_adapter_leaves_the_output_unchanged_and_only_adapters_train():
    x, y = jnp.asarray(X), jnp.asarray(RNG.standard_normal((6, 8)).astype(np.float32))
    model = MLP(nnx.Rngs(1))
    apply_qat(model, bits=4, example_inputs=(x,))
    before = np.asarray(model(x))
    apply_lora(model, rank=RANK, alpha=ALPHA)
    np.testing.assert_array_equal(model(x), before)  # B = 0: the adapter adds exact zeros
    params = lora_parameters(model)
    assert [tuple(p.shape) for p in params] == [(24, 2), (2, 32), (32, 2), (2, 8)]
    assert all(isinstance(p, nnx.LoRAParam) for p in params)
    kernels = [np.asarray(layer.kernel[...]) for layer in model.layers]
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.LoRAParam)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2), argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(5)]
    assert losses[-1] < losses[0]
    for layer, kernel in zip(model.layers, kernels):
        np.testing.assert_array_equal(layer.kernel[...], kernel)
    assert float(jnp.abs(model.layers[1].lora.lora_b[...]).max()) > 0


def test_merge_lora_folds_the_adapter_into_the_kernel_and_qat_quantizes_the_merged_weight():
    x = jnp.asarray(X)
    model = MLP(nnx.Rngs(2))
    apply_qat(model, bits=4, example_inputs=(x,))
    apply_lora(model, rank=RANK, alpha=ALPHA)
    _trained_adapters(model)
    want = [np.asarray(layer.kernel[...]) + np.asarray(layer.lora.lora_a[...]) @ np.asarray(layer.lora.lora_b[...]) * 3
            for layer in model.layers]
    with pytest.raises(ValueError, match="'layers.0' has a LoRA adapter: .*merge_lora"):
        convert(model)
    assert merge_lora(model) is model
    for layer, kernel in zip(model.layers, want):
        assert type(layer).__mro__[1] is nnx.Linear and not hasattr(layer, "lora")
        np.testing.assert_allclose(layer.kernel[...], kernel, rtol=1e-6, atol=1e-6)
    assert not any(d.kind == "adapter" for d in get_qat_report(model).decisions)
    h = np.maximum(X @ reference_codes_scales(np.asarray(model.layers[0].kernel[...]).T, 4, "channel")[2].T
                   + np.asarray(model.layers[0].bias[...]), 0)
    expected = h @ reference_codes_scales(np.asarray(model.layers[1].kernel[...]).T, 4, "channel")[2].T \
        + np.asarray(model.layers[1].bias[...])
    np.testing.assert_allclose(model(x), expected, rtol=0, atol=_tolerance(expected))
    np.testing.assert_array_equal(convert(model)(x), model(x))  # stored codes: the merged QAT forward
    with pytest.raises(ValueError, match="no LoRA adapters"):
        merge_lora(model)
    with pytest.raises(ValueError, match="no LoRA report"):
        get_lora_report(model)


def _snapshot(model):
    graphdef, state = nnx.split(model)
    return graphdef, jax.tree.map(np.asarray, state)


def _assert_unchanged(model, snapshot):
    graphdef, state = nnx.split(model)
    assert graphdef == snapshot[0]
    jax.tree.map(np.testing.assert_array_equal, state, snapshot[1])


@pytest.mark.parametrize("kwargs,match", [
    (dict(rank=25), r"rank=25 is larger than min\(in_features, out_features\)=24 of layer 'layers.0'"),
    (dict(rank=2, dropout=0.1), "does not implement"),
    (dict(rank=2, patterns=("layers\\.9",)), "matches no nnx.Linear"),
    (dict(rank=2, exclude=("layers\\.[01]",)), "selected no nnx.Linear layer it can adapt"),
])
def test_refusals_leave_the_model_unchanged(kwargs, match):
    model = MLP(nnx.Rngs(0))
    apply_qat(model, bits=4, example_inputs=(jnp.asarray(X),))
    snapshot = _snapshot(model)
    with pytest.raises(ValueError, match=match):
        apply_lora(model, alpha=ALPHA, **kwargs)
    _assert_unchanged(model, snapshot)


def test_reapplying_is_unchanged_and_another_spec_or_linen_is_refused():
    model = apply_lora(MLP(nnx.Rngs(0)), rank=RANK, alpha=ALPHA)
    apply_lora(model, rank=RANK, alpha=ALPHA)
    assert [d.action for d in get_lora_report(model).decisions] == ["unchanged", "unchanged"]
    with pytest.raises(ValueError, match="already has an adapter"):
        apply_lora(model, rank=1, alpha=ALPHA)
    with pytest.raises(TypeError, match="takes NNX models"):
        apply_lora(nn.Dense(4), rank=1, alpha=1)
