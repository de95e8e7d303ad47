"""Flax QAT through Qwix: same numbers as torch/numpy, exact toggle, complete report, the Qwix pitfalls."""

import functools
import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
qwix = pytest.importorskip("qwix")

import jax.numpy as jnp  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from mixle.models.qat import (  # noqa: E402
    QuantSpec,
    apply_qat,
    fake_quantize,
    get_qat_report,
    set_fake_quant_enabled,
)
from mixle.flax_backend.provider import uses_mixle_numerics  # noqa: E402
from mixle.flax_backend.rules import qwix_rules  # noqa: E402
from tests.test_numerics import GRANULARITIES, reference_codes_scales  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

RNG = np.random.default_rng(0)
W1 = RNG.standard_normal((32, 48)).astype(np.float32)  # torch layout (out, in)
B1 = RNG.standard_normal(32).astype(np.float32)
W2 = RNG.standard_normal((16, 32)).astype(np.float32)
B2 = RNG.standard_normal(16).astype(np.float32)
X = RNG.standard_normal((5, 48)).astype(np.float32)


def _linear(w, b=None):
    """An nnx.Linear holding torch-layout weights (kernel = w.T)."""
    layer = nnx.Linear(w.shape[1], w.shape[0], use_bias=b is not None, rngs=nnx.Rngs(0))
    layer.kernel[...] = jnp.asarray(w.T)
    if b is not None:
        layer.bias[...] = jnp.asarray(b)
    return layer


class Single(nnx.Module):
    """One bias-free Linear: model(eye) is exactly its (fake-quantized) kernel."""

    def __init__(self, w):
        self.fc = _linear(w)

    def __call__(self, x):
        return self.fc(x)


class Stack(nnx.Module):
    def __init__(self):
        self.fc1 = _linear(W1, B1)
        self.fc2 = _linear(W2, B2)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


def torch_stack(spec):
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(torch.nn.Linear(48, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    with torch.no_grad():
        for layer, w, b in ((net[0], W1, B1), (net[2], W2, B2)):
            layer.weight.copy_(torch.from_numpy(w))
            layer.bias.copy_(torch.from_numpy(b))
    return apply_qat(net, spec=spec)


def flax_weight(w, spec):
    model = Single(w)
    apply_qat(model, spec=spec, example_inputs=(jnp.eye(w.shape[1]),))
    return np.asarray(model(jnp.eye(w.shape[1]))).T


# ------------------------------------------------------------------------------- cross-backend


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("granularity,group_size", GRANULARITIES)
@pytest.mark.parametrize("percentile", [None, 99.0])
def test_flax_weights_and_outputs_equal_torch_and_numpy(bits, granularity, group_size, percentile):
    spec = QuantSpec(bits=bits, granularity=granularity, group_size=group_size, clip_percentile=percentile)
    codes, scale, expected = reference_codes_scales(W1, bits, granularity, group_size, percentile)
    got = flax_weight(W1, spec)
    # Same integer codes; values equal up to float32 rounding of the scale (Qwix computes
    # absmax * (qmax + 0.5) / qmax / (qmax + 0.5), mixle absmax / qmax).
    blocks = got.reshape(scale.shape[0], -1)
    np.testing.assert_array_equal(np.rint(blocks / scale).reshape(W1.shape), codes)
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-7 * np.abs(W1).max())

    net = torch_stack(spec)
    np.testing.assert_allclose(got, net[0].quantized_weight().detach().numpy(), rtol=0, atol=2e-7 * np.abs(W1).max())
    model = Stack()
    apply_qat(model, spec=spec, example_inputs=(jnp.asarray(X),))
    out = np.asarray(model(jnp.asarray(X)))
    # and the numpy reference of the whole stack, within float32 sums of 48 and 32 products in
    # any order (a TPU's full-precision matmul adds its passes in another order than a CPU)
    w2 = reference_codes_scales(W2, bits, granularity, group_size, percentile)[2]
    hidden = np.maximum(X @ expected.T + B1, 0)
    ref = hidden @ w2.T + B2
    magnitude = (np.abs(X) @ np.abs(expected).T + np.abs(B1)) @ np.abs(w2).T + np.abs(B2)
    bound = 2 * (48 + 32) * np.finfo(np.float32).eps * magnitude
    torch_out = net(__import__("torch").from_numpy(X)).detach().numpy()
    assert (np.abs(out - torch_out) <= bound).all() and (np.abs(out - ref) <= bound).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("granularity,group_size", GRANULARITIES)
def test_qwix_grid_gives_numpys_codes_for_every_element_and_qwixs_away_from_its_ties(bits, granularity, group_size):
    spec = QuantSpec(bits=bits, grid="qwix", granularity=granularity, group_size=group_size)
    codes, scale, expected = reference_codes_scales(W1, bits, granularity, group_size, grid="qwix")
    got = flax_weight(W1, spec)
    # mixle's own numerics: the numpy reference's codes for all 32 x 48 weights, exactly.
    got_codes = np.rint(got.reshape(scale.shape[0], -1) / scale).reshape(W1.shape)
    assert int((got_codes == codes).sum()) == W1.size
    np.testing.assert_array_equal(got, expected)
    # Stock Qwix agrees except where w / scale is the -absmax rounding tie (-7.5 or -127.5),
    # which its scale (one ulp off) may land on either side of.
    stock_model = qwix.quantize_model(Single(W1), qwix.QtProvider(qwix_rules(spec), disable_jit=True),
                                      jnp.eye(W1.shape[1]))
    stock = np.asarray(stock_model(jnp.eye(W1.shape[1]))).T
    tie = np.isclose(np.abs(W1.reshape(scale.shape[0], -1)) / scale, 2 ** (bits - 1) - 0.5).reshape(W1.shape)
    np.testing.assert_allclose(stock[~tie], expected[~tie], rtol=0, atol=2e-7 * np.abs(W1).max())
    assert np.all(np.abs(stock[tie] - expected[tie]) <= scale.max() * 1.0001)


# ------------------------------------------------------------------------------- gradients


def _input_and_kernel_grads(model, x, r):
    def loss(m, x):
        return jnp.sum(m(x) * r)

    return nnx.grad(loss, argnums=(0, 1))(model, x)


@pytest.mark.parametrize("granularity,group_size", [("channel", None), ("group", 16)])
def test_textbook_straight_through_estimator(granularity, group_size):
    spec = QuantSpec(bits=4, granularity=granularity, group_size=group_size)
    x, r = jnp.asarray(X), jnp.asarray(RNG.standard_normal((5, 32)).astype(np.float32))
    wq = reference_codes_scales(W1, 4, granularity, group_size)[2]
    model = Single(W1)
    apply_qat(model, spec=spec, example_inputs=(x,))
    grads, dx = _input_and_kernel_grads(model, x, r)
    np.testing.assert_allclose(dx, np.asarray(r) @ wq, rtol=1e-5, atol=1e-5)  # g @ q(W), not g @ W
    np.testing.assert_allclose(grads.fc.kernel[...], X.T @ np.asarray(r), rtol=1e-5, atol=1e-5)
    if granularity == "channel":
        # Qwix's default for a forward-only rule keeps the float weight as the residual.
        stock_rule = [qwix.QtRule(module_path=".*", weight_qtype=jnp.int4,
                                  weight_calibration_method=f"absmax,{7.5 / 7!r}")]
        stock = qwix.quantize_model(Single(W1), qwix.QtProvider(stock_rule, disable_jit=True), x)
        _, dx_stock = _input_and_kernel_grads(stock, x, r)
        np.testing.assert_allclose(dx_stock, np.asarray(r) @ W1, rtol=1e-5, atol=1e-5)
        assert np.abs(np.asarray(dx_stock) - np.asarray(dx)).max() > 1e-2
    else:
        # Qwix falls back to the float weight for tiled residuals even with use_original_residuals
        # False; that is why mixle fake-quantizes group-wise weights before the matmul.
        stock = qwix.quantize_model(Single(W1), qwix.QtProvider(qwix_rules(spec), disable_jit=True), x)
        _, dx_stock = _input_and_kernel_grads(stock, x, r)
        np.testing.assert_allclose(dx_stock, np.asarray(r) @ W1, rtol=1e-5, atol=1e-5)


def test_percentile_clip_gradient_masks_clipped_weights_from_the_live_weight():
    spec = QuantSpec(bits=4, clip_percentile=90.0, clip_gradient=True)
    x, r = jnp.asarray(X), jnp.asarray(RNG.standard_normal((5, 32)).astype(np.float32))
    model = Single(W1)
    apply_qat(model, spec=spec, example_inputs=(x,))
    _, scale, _ = reference_codes_scales(W1, 4, "channel", None, 90.0)
    mask = np.abs(W1) <= scale * 7
    grads, _ = _input_and_kernel_grads(model, x, r)
    np.testing.assert_allclose(grads.fc.kernel[...], (X.T @ np.asarray(r)) * mask.T, rtol=1e-5, atol=1e-6)
    assert 0.05 < 1 - mask.mean() < 0.2
    # The threshold follows the weight as it trains (not frozen at apply time).
    w_new = W1 * np.linspace(0.5, 2.0, 48, dtype=np.float32)
    model.fc.kernel[...] = jnp.asarray(w_new.T)
    got = np.asarray(model(jnp.eye(48))).T
    np.testing.assert_allclose(got, reference_codes_scales(w_new, 4, "channel", None, 90.0)[2],
                               rtol=0, atol=2e-7 * np.abs(w_new).max())


# ------------------------------------------------------------------------------- toggle / state


@pytest.fixture(scope="module")
def toggled():
    x = jnp.asarray(X)
    float_model = Stack()
    model = Stack()
    optimizer_state_before = nnx.state(model, nnx.Param)
    apply_qat(model, bits=4, group_size=8, example_inputs=(x,))
    return float_model, model, x, optimizer_state_before


def test_apply_qat_keeps_the_class_hierarchy_and_the_float32_state_tree(toggled):
    float_model, model, x, before = toggled
    assert isinstance(model, Stack) and type(model) is not Stack
    after = nnx.state(model, nnx.Param)
    assert jax.tree.structure(after) == jax.tree.structure(before)
    assert jax.tree.structure(nnx.state(model)) == jax.tree.structure(nnx.state(float_model))
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
        assert a.dtype == jnp.float32 and a is b  # the very same arrays: nothing copied or cast


def test_toggle_is_exact_eagerly_and_under_nnx_jit(toggled):
    float_model, model, x, _ = toggled
    call = nnx.jit(lambda m, x: m(x))
    grad = nnx.grad(lambda m: jnp.sum(m(x) ** 2))
    fresh = Stack()
    apply_qat(fresh, bits=4, group_size=8, example_inputs=(x,))
    on_eager, on_jit = model(x), call(model, x)
    assert not np.allclose(on_eager, float_model(x), atol=1e-3)
    np.testing.assert_array_equal(on_eager, fresh(x))
    np.testing.assert_array_equal(on_jit, call(fresh, x))
    set_fake_quant_enabled(model, False)
    assert isinstance(model, Stack)
    np.testing.assert_array_equal(model(x), float_model(x))
    np.testing.assert_array_equal(call(model, x), call(float_model, x))
    g_off, g_float = grad(model), grad(float_model)
    for a, b in zip(jax.tree.leaves(nnx.state(g_off)), jax.tree.leaves(nnx.state(g_float))):
        np.testing.assert_array_equal(a, b)
    set_fake_quant_enabled(model, True)
    np.testing.assert_array_equal(model(x), on_eager)
    np.testing.assert_array_equal(call(model, x), on_jit)


def test_checkpoints_load_both_ways(toggled):
    float_model, model, x, _ = toggled
    qat_state = nnx.state(model)
    target = Stack()
    target.fc1.kernel[...] = target.fc1.kernel[...] * 0
    nnx.update(target, qat_state)  # a QAT checkpoint restores into the float model
    np.testing.assert_array_equal(target(x), float_model(x))
    other = Stack()
    apply_qat(other, bits=4, group_size=8, example_inputs=(x,))
    other.fc2.bias[...] = other.fc2.bias[...] + 1
    nnx.update(other, nnx.state(float_model))  # and a float checkpoint into a QAT model
    np.testing.assert_array_equal(other(x), model(x))


def test_reapply_is_idempotent_and_a_new_spec_needs_reconfigure(toggled):
    _, _, x, _ = toggled
    model = Stack()
    apply_qat(model, bits=4, example_inputs=(x,))
    cls, out = type(model), model(x)
    apply_qat(model, bits=4, example_inputs=(x,))
    assert type(model) is cls and {d.action for d in get_qat_report(model).decisions} == {"unchanged"}
    with pytest.raises(ValueError, match="already set up for QAT as int4/channel/symmetric, not int8"):
        apply_qat(model, bits=8, example_inputs=(x,))
    assert type(model) is cls
    np.testing.assert_array_equal(model(x), out)
    set_fake_quant_enabled(model, False)
    apply_qat(model, bits=8, reconfigure=True, example_inputs=(x,))
    assert {d.action for d in get_qat_report(model).decisions} == {"reconfigured"}
    np.testing.assert_array_equal(model(x), Stack()(x))  # stays off after reconfiguring
    set_fake_quant_enabled(model, True)
    fresh = Stack()
    apply_qat(fresh, bits=8, example_inputs=(x,))
    np.testing.assert_array_equal(model(x), fresh(x))


def test_linen_toggle_report_and_same_params():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16, name="fc2")(nn.relu(nn.Dense(32, name="fc1")(x)))

    x = jnp.asarray(X)
    module = MLP()
    params = {"params": {"fc1": {"kernel": jnp.asarray(W1.T), "bias": jnp.asarray(B1)},
                         "fc2": {"kernel": jnp.asarray(W2.T), "bias": jnp.asarray(B2)}}}
    spec = QuantSpec(bits=4, group_size=8, clip_percentile=95.0)
    qat = apply_qat(module, spec=spec, example_inputs=(x,))
    assert isinstance(qat, MLP) and type(module) is MLP
    assert get_qat_report(qat).wrapped == ["fc1.kernel", "fc2.kernel"]
    w1, w2 = (reference_codes_scales(w, 4, "group", 8, 95.0)[2] for w in (W1, W2))
    out = qat.apply(params, x)
    np.testing.assert_allclose(out, np.maximum(X @ w1.T + B1, 0) @ w2.T + B2, rtol=1e-5, atol=1e-5)
    set_fake_quant_enabled(qat, False)
    np.testing.assert_array_equal(qat.apply(params, x), module.apply(params, x))
    set_fake_quant_enabled(qat, True)
    np.testing.assert_array_equal(qat.apply(params, x), out)
    fresh = apply_qat(module, spec=spec, example_inputs=(x,))
    np.testing.assert_array_equal(jax.jit(qat.apply)(params, x), jax.jit(fresh.apply)(params, x))


# ------------------------------------------------------------------------------- report / pitfalls


class TiedLM(nnx.Module):
    """Embedding, a Linear, and the head tied to the embedding through nnx.Embed.attend."""

    def __init__(self, rngs):
        self.emb = nnx.Embed(11, 8, rngs=rngs)
        self.fc = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, ids):
        return self.emb.attend(self.fc(self.emb(ids)))


def test_tied_head_is_quantized_under_grad_and_lookups_share_the_quantized_table():
    ids = jnp.asarray(RNG.integers(0, 11, (3, 4)), jnp.int32)
    model = TiedLM(nnx.Rngs(0))
    apply_qat(model, bits=4, example_inputs=(ids,))
    report = get_qat_report(model)
    assert report.wrapped == ["emb.embedding", "fc.kernel"] and "tied" in report["emb.embedding"].note
    table = np.asarray(model.emb.embedding[...])  # (vocab, features): one scale per vocabulary row
    tq = reference_codes_scales(table, 4, "channel")[2]
    wq = reference_codes_scales(np.asarray(model.fc.kernel[...]).T, 4, "channel")[2]
    expected = (tq[np.asarray(ids)] @ wq.T + np.asarray(model.fc.bias[...])) @ tq.T
    for run in (lambda m: m(ids), nnx.jit(lambda m: m(ids))):
        np.testing.assert_allclose(run(model), expected, rtol=1e-5, atol=1e-5)
    grads = nnx.grad(lambda m: jnp.sum(m(ids) ** 2))(model)
    assert np.abs(np.asarray(grads.emb.embedding[...])).min(axis=1).max() > 0
    # Stock Qwix leaves this head (and the lookups) in float outside plain jit: the transposed
    # table is neither the Param itself nor, eagerly or under grad, traceable to it.
    stock = qwix.quantize_model(TiedLM(nnx.Rngs(0)), qwix.QtProvider(qwix_rules(bits=4), disable_jit=True), ids)
    float_head = (table[np.asarray(ids)] @ wq.T + np.asarray(model.fc.bias[...])) @ table.T
    np.testing.assert_allclose(stock(ids), float_head, rtol=1e-5, atol=1e-5)
    assert np.abs(float_head - expected).max() > 1e-2


def test_linen_tied_head_is_quantized_the_same_way_eagerly_under_jit_and_under_grad():
    class LinenTied(nn.Module):
        @nn.compact
        def __call__(self, ids):
            emb = nn.Embed(11, 8, name="emb")
            return emb.attend(nn.Dense(8, name="fc")(emb(ids)))

    ids = jnp.asarray(RNG.integers(0, 11, (3, 4)), jnp.int32)
    params = LinenTied().init(jax.random.key(0), ids)
    table, kernel = np.asarray(params["params"]["emb"]["embedding"]), np.asarray(params["params"]["fc"]["kernel"])
    tq, wq = (reference_codes_scales(w, 4, "channel")[2] for w in (table, kernel.T))
    expected = (tq[np.asarray(ids)] @ wq.T + np.asarray(params["params"]["fc"]["bias"])) @ tq.T
    qat = apply_qat(LinenTied(), bits=4, example_inputs=(ids,))
    assert "tied" in get_qat_report(qat)["emb.embedding"].note
    value = jax.value_and_grad(lambda p: jnp.sum(qat.apply(p, ids) ** 2))(params)[0]
    for got in (qat.apply(params, ids), jax.jit(qat.apply)(params, ids)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(value, np.sum(expected ** 2), rtol=1e-5)
    # Stock Qwix quantizes this head only under jit (through tracer lineage): evaluation and
    # training would see different models.
    stock = qwix.quantize_model(LinenTied(), qwix.QtProvider(qwix_rules(bits=4, patterns=["emb"]), disable_jit=True))
    float_out = LinenTied().apply(params, ids)
    assert np.abs(np.asarray(jax.jit(stock.apply)(params, ids)) - np.asarray(float_out)).max() > 1e-2
    stock_value = jax.value_and_grad(lambda p: jnp.sum(stock.apply(p, ids) ** 2))(params)[0]
    np.testing.assert_allclose(stock_value, jnp.sum(float_out ** 2), rtol=1e-6)


class CNN(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.fc = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return self.fc(self.conv(x).mean((1, 2)))


def test_convolutions_follow_qwix_and_group_size_is_reported_for_them():
    x = jnp.asarray(RNG.standard_normal((2, 6, 6, 3)), jnp.float32)
    model = CNN(nnx.Rngs(0))
    apply_qat(model, bits=4, grid="qwix", example_inputs=(x,))
    # The numpy reference per output channel (flax kernels are (kh, kw, in, out)), run through
    # the float model: same kernel values, same conv, so equal up to XLA's jit/eager differences.
    kernel = np.asarray(model.conv.kernel[...])
    rows = kernel.transpose(3, 0, 1, 2).reshape(8, -1)
    expected = reference_codes_scales(rows, 4, "channel", grid="qwix")[2].reshape(8, 3, 3, 3).transpose(1, 2, 3, 0)
    fc = np.asarray(model.fc.kernel[...])
    fcq = reference_codes_scales(fc.T, 4, "channel", grid="qwix")[2].T
    reference = CNN(nnx.Rngs(0))
    reference.conv.kernel[...] = jnp.asarray(expected)
    reference.fc.kernel[...] = jnp.asarray(fcq)
    run = nnx.jit(lambda m: m(x))
    np.testing.assert_allclose(run(model), run(reference), rtol=0, atol=1e-6)  # float32 sums of 27 products
    assert get_qat_report(model).wrapped == ["conv.kernel", "fc.kernel"]
    model = CNN(nnx.Rngs(0))
    apply_qat(model, bits=4, group_size=4, example_inputs=(x,))
    decision = get_qat_report(model)["conv.kernel"]
    assert decision.action == "skipped" and "no group-wise (tiled) scales" in decision.reason


class Leaky(nnx.Module):
    """Weights Qwix misses: a child's kernel used by the parent, and a sliced stacked Param."""

    def __init__(self, rngs):
        self.fc = nnx.Linear(8, 8, rngs=rngs)
        self.stack = nnx.Param(jax.random.normal(rngs.params(), (3, 8, 8)))
        self.emb = nnx.Embed(5, 8, rngs=rngs)

    def __call__(self, x):
        y = self.fc(x) + x @ self.fc.kernel[...]
        return jnp.einsum("bd,de->be", y, self.stack[...][1]) + self.emb(jnp.zeros(x.shape[0], jnp.int32))


def test_report_lists_every_kernel_with_the_reason_when_left_in_float():
    x = jnp.ones((2, 8))
    model = Leaky(nnx.Rngs(0))
    apply_qat(model, bits=4, exclude=("emb",), example_inputs=(x,))
    report = get_qat_report(model)
    assert [d.path for d in report.decisions] == ["emb.embedding", "fc.kernel", "stack"]
    assert report["emb.embedding"].action == "skipped" and "excluded by 'emb'" in report["emb.embedding"].reason
    assert report["fc.kernel"].action == "wrapped"
    assert "also used directly by module '<root>', where it stays float" in report["fc.kernel"].note
    assert report["stack"].action == "skipped" and "sliced" in report["stack"].reason
    assert "1 quantized, 2 left in float" in str(report)


def test_unmatched_patterns_raise_naming_them_and_leave_the_model_unchanged():
    x = jnp.ones((2, 8))
    model = Leaky(nnx.Rngs(0))
    with pytest.raises(ValueError, match="patterns entry 'fcc' matches no Flax module with a kernel"):
        apply_qat(model, patterns=("fcc",), example_inputs=(x,))
    # 'emb' has a kernel but is only looked up: its Qwix rule matches no operation.
    with pytest.raises(ValueError, match=r"patterns entry 'emb' selects \['emb'\], but no dot_general"):
        apply_qat(model, patterns=("emb", ("fc", None)), example_inputs=(x,))
    assert type(model) is Leaky and not hasattr(model.fc, "qwix_path")
    with pytest.raises(TypeError, match="needs example_inputs"):
        apply_qat(model)


def test_user_matmul_after_apply_qat_stays_float():
    """Qwix's patched dot_general must not leak into the trace cache of jnp.matmul / @."""

    class MatMul(nnx.Module):
        def __init__(self, n_in, n_out):
            self.w = nnx.Param(jnp.asarray(RNG.standard_normal((n_in, n_out)), jnp.float32))

        def __call__(self, x):
            return x @ self.w[...]

    def user_error(h, w):
        reference = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
        return max(float(np.abs(np.asarray(f(h, w)) - reference).max())
                   for f in (lambda a, b: a @ b, jnp.dot, jnp.matmul, jax.jit(lambda a, b: a @ b)))

    # Control: a stock provider with jit left on leaks (this is what the test must catch).
    h, w = jnp.asarray(RNG.standard_normal((3, 7)), jnp.float32), jnp.asarray(RNG.standard_normal((7, 9)), jnp.float32)
    stock = qwix.quantize_model(MatMul(7, 9), qwix.QtProvider(qwix_rules(bits=4), disable_jit=False), h)
    stock(h)
    assert user_error(h, w) > 1e-2
    jax.clear_caches()
    h, w = jnp.asarray(RNG.standard_normal((5, 6)), jnp.float32), jnp.asarray(RNG.standard_normal((6, 4)), jnp.float32)
    model = MatMul(6, 4)
    apply_qat(model, bits=4, example_inputs=(h,))
    model(h), nnx.jit(lambda m: m(h))(model), nnx.grad(lambda m: jnp.sum(m(h)))(model)
    assert not np.allclose(model(h), h @ model.w[...], atol=1e-3)  # the model itself is quantized
    assert user_error(h, w) < 1e-5


def test_activation_shaped_like_the_kernel_is_not_taken_for_the_weight():
    """Batch 16 into Linear(16, 16): Qwix's shape fallback would see two weights and assert."""
    x = jnp.asarray(RNG.standard_normal((16, 16)), jnp.float32)
    stock = qwix.quantize_model(nnx.Sequential(nnx.Linear(16, 16, rngs=nnx.Rngs(0))),
                                qwix.QtProvider(qwix_rules(bits=4), disable_jit=True), x[:5])
    with pytest.raises(AssertionError, match="lhs and rhs cannot be both weights"):
        stock(x)
    for dtype, note in ((jnp.float32, ""), (jnp.bfloat16, "by position")):
        model = nnx.Sequential(nnx.Linear(16, 16, dtype=dtype, rngs=nnx.Rngs(0)))
        apply_qat(model, bits=4, example_inputs=(x,))
        decision = get_qat_report(model)["layers.0.kernel"]
        assert decision.action == "wrapped" and note in decision.note
        if dtype == jnp.float32:
            w = np.asarray(model.layers[0].kernel[...]).T
            bias = np.asarray(model.layers[0].bias[...])
            expected = np.asarray(x) @ reference_codes_scales(w, 4, "channel")[2].T + bias
            np.testing.assert_allclose(model(x), expected, atol=1e-5, rtol=1e-5)
        else:
            # bf16 scales: compare with the same layer fed 5 rows, where the kernel is unambiguous.
            np.testing.assert_allclose(np.asarray(model(x)[:5], np.float32), np.asarray(model(x[:5]), np.float32),
                                       atol=2e-2, rtol=2e-2)
            assert not np.allclose(np.asarray(model(x), np.float32), np.asarray(nnx.Sequential(
                nnx.Linear(16, 16, dtype=dtype, rngs=nnx.Rngs(0)))(x), np.float32), atol=2e-2)


def test_group_size_that_does_not_divide_names_the_layer_and_divisors():
    model = Stack()
    with pytest.raises(ValueError, match=r"module 'fc2', weight 'kernel' \(32, 16\): group_size=5 does not divide"):
        apply_qat(model, bits=4, group_size=5, patterns=(("fc2", QuantSpec(group_size=5)), ("fc1", None)),
                  example_inputs=(jnp.asarray(X),))
    assert type(model) is Stack


@pytest.mark.parametrize("fields", [
    dict(bits=4, grid="qwix", act_bits=8),
    dict(bits=8, grid="qwix", weight_format="float8_e4m3fn"),
    dict(bits=4, bwd_bits=8),
    dict(bits=8, grid="qwix", calibration="rms,3"),
    dict(bits=8, grid="qwix", calibration="minmax,0.9"),
    dict(bits=4, grid="qwix", calibration="fixed,-1,1"),
])
def test_qwix_options_pass_through_to_qwix(fields):
    x, r = jnp.asarray(X), jnp.asarray(RNG.standard_normal((5, 16)).astype(np.float32))
    ours = Stack()
    apply_qat(ours, example_inputs=(x,), **fields)
    stock = qwix.quantize_model(Stack(), qwix.QtProvider(qwix_rules(**fields), disable_jit=True), x)
    if uses_mixle_numerics(QuantSpec(**fields)):
        # bwd_bits alone: mixle's numerics quantize the weight (Qwix's symmetric-grid scale is
        # absmax * 7.5/7 / 7.5, one float32 rounding away from absmax / 7; sums of 48 products).
        np.testing.assert_allclose(ours(x), stock(x), rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_array_equal(ours(x), stock(x))
    assert not np.allclose(ours(x), Stack()(x), atol=1e-4)
    if "act_bits" in fields or "bwd_bits" in fields:  # options that change the backward pass
        g_ours, g_stock = (nnx.grad(lambda m: jnp.sum(m(x) * r))(m) for m in (ours, stock))
        for a, b in zip(jax.tree.leaves(nnx.state(g_ours)), jax.tree.leaves(nnx.state(g_stock))):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_stochastic_rounding_of_gradients_draws_from_its_rng_stream():
    x = jnp.asarray(X)
    model = Stack()
    apply_qat(model, bits=4, bwd_bits=8, bwd_stochastic_rounding="uniform", example_inputs=(x,))
    step = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))
    g1, g2 = step(model), step(model)
    assert np.abs(np.asarray(g1.fc1.kernel[...]) - np.asarray(g2.fc1.kernel[...])).max() > 0
    plain = Stack()
    apply_qat(plain, bits=4, bwd_bits=8, example_inputs=(x,))
    np.testing.assert_array_equal(model(x), plain(x))  # forward unchanged; only gradients are noisy


@pytest.mark.parametrize("fields", [dict(bits=4, act_bits=4), dict(bits=4, bwd_bits=4),
                                    dict(bits=8, act_bits=4, bwd_bits=4)])
def test_int4_by_int4_products_are_refused_off_tpu(fields):
    if jax.default_backend() == "tpu":
        pytest.skip("TPUs run int4 x int4 matmuls")
    model = Stack()
    with pytest.raises(ValueError, match="makes Qwix multiply int4 .* by int4 .*use 8 bits for one of them"):
        apply_qat(model, example_inputs=(jnp.asarray(X),), **fields)
    assert type(model) is Stack
    # What the refusal saves the user from: XLA's verifier error deep inside the first call.
    stock = qwix.quantize_model(Stack(), qwix.QtProvider(qwix_rules(**fields), disable_jit=True), jnp.asarray(X),
                                skip_nnx_init=True)
    with pytest.raises(Exception, match="does not support custom element sizes"):
        jax.block_until_ready(nnx.grad(lambda m: jnp.sum(m(jnp.asarray(X))))(stock))


def test_fake_quantize_on_jax_arrays_matches_numpy_and_passes_gradients_straight_through():
    w = jnp.asarray(W1)
    # Same codes as numpy; values within one float32 ulp of the scale (XLA's CPU backend turns the
    # division by the constant qmax into a multiplication by its reciprocal).
    for spec in (QuantSpec(bits=4), QuantSpec(bits=8, group_size=16), QuantSpec(bits=4, granularity="tensor"),
                 QuantSpec(bits=4, grid="qwix"), QuantSpec(bits=4, clip_percentile=90.0)):
        codes, scale, expected = reference_codes_scales(W1, spec.bits, spec.granularity, spec.group_size,
                                                        spec.clip_percentile, grid=spec.grid)
        blocks = W1.reshape(scale.shape[0], -1)
        # On the qwix grid the -absmax element is a rounding tie (-7.5): one ulp decides -8 or -7.
        tie = np.isclose(np.abs(blocks) / scale, spec.qmax + 0.5) if spec.grid == "qwix" else blocks < -np.inf
        for got in (fake_quantize(w, spec=spec), jax.jit(lambda a: fake_quantize(a, spec=spec))(w)):
            got_codes = np.rint(np.asarray(got).reshape(blocks.shape) / scale)
            np.testing.assert_array_equal(got_codes[~tie], codes.reshape(blocks.shape)[~tie])
            assert set(got_codes[tie].tolist()) <= {-spec.qmax - 1.0, -spec.qmax, spec.qmax}
            np.testing.assert_allclose(np.asarray(got).reshape(blocks.shape)[~tie],
                                       expected.reshape(blocks.shape)[~tie], rtol=0, atol=3e-7 * np.abs(W1).max())
    spec = QuantSpec(bits=4, clip_percentile=90.0)
    np.testing.assert_array_equal(jax.grad(lambda a: jnp.sum(fake_quantize(a, spec=spec) * 3))(w), np.full(W1.shape, 3))
    masked = jax.grad(lambda a: jnp.sum(fake_quantize(a, spec=spec.replace(clip_gradient=True))))(w)
    _, scale, _ = reference_codes_scales(W1, 4, "channel", None, 90.0)
    np.testing.assert_array_equal(masked, (np.abs(W1) <= scale * 7).astype(np.float32))


def test_opt_in_is_refused_for_flax_models():
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"opt_in=\('embedding',\) is for torch models"):
        apply_qat(model, opt_in=("embedding",), example_inputs=(jnp.ones((1, 4)),))


# ------------------------------------------------------------------------ bad weights and inputs


@pytest.mark.parametrize("granularity", [dict(), dict(group_size=8)], ids=["channel", "group"])
def test_a_nan_kernel_raises_like_torch_naming_the_module(granularity):
    model = Stack()
    apply_qat(model, bits=4, example_inputs=(jnp.asarray(X),), **granularity)
    model.fc2.kernel[...] = model.fc2.kernel[...].at[3, 1].set(jnp.nan)
    with pytest.raises(ValueError, match=r"module 'fc2', weight 'kernel' contains NaN or infinity"):
        model(jnp.asarray(X))
    set_fake_quant_enabled(model, False)
    assert np.isnan(np.asarray(model(jnp.asarray(X)))).any()  # QAT off: the float model's NaN, as torch


def test_a_nan_embedding_table_raises_in_its_lookup():
    model = TiedLM(nnx.Rngs(0))
    ids = jnp.arange(6).reshape(2, 3)
    apply_qat(model, bits=8, example_inputs=(ids,))
    model.emb.embedding[...] = model.emb.embedding[...].at[0, 0].set(jnp.inf)
    with pytest.raises(ValueError, match=r"module 'emb', embedding contains NaN or infinity"):
        model(ids)


@pytest.mark.parametrize(
    "inputs,words",
    [((jnp.ones((2, 5)),), r"\(\w+ float32\[2, 5\]\) \(dot_general requires contracting dimensions"),
     (("text",), r"\(str 'text'\) \(Value 'text'"),
     ((jnp.ones((2, 48)), jnp.ones(3)), r"\(.*float32\[3\]\) \(.*takes 2 positional arguments but 3 were given")],
    ids=["wrong-shape", "not-an-array", "extra-argument"],
)
def test_bad_example_inputs_get_a_clear_error_and_leave_the_model(inputs, words):
    model = Stack()
    before = nnx.state(model)
    with pytest.raises(TypeError, match=r"apply_qat could not trace Stack on example_inputs=" + words):
        apply_qat(model, bits=4, example_inputs=inputs)
    assert type(model) is Stack
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), nnx.state(model), before))


# ------------------------------------------------------------------------------- entry points


class Features(nnx.Module):
    """A model users call in several ways: whole, a submodule, another method."""

    def __init__(self):
        self.body = _linear(W1, B1)
        self.head = _linear(W2, B2)

    def features(self, x):
        return jax.nn.relu(self.body(x))

    def __call__(self, x):
        return self.head(self.features(x))


def test_every_nnx_entry_point_is_fake_quantized_and_toggles():
    x = jnp.asarray(X)
    model = Features()
    apply_qat(model, bits=4, example_inputs=(x,))
    w1, w2 = (reference_codes_scales(w, 4, "channel")[2] for w in (W1, W2))
    body = X @ w1.T + B1
    expected = {"call": np.maximum(body, 0) @ w2.T + B2, "body": body, "features": np.maximum(body, 0)}
    graphdef, state = nnx.split(model)
    merged = nnx.merge(graphdef, state)
    runs = {
        "call": [lambda m: m(x), nnx.jit(lambda m: m(x))],
        "body": [lambda m: m.body(x), nnx.jit(lambda m: m.body(x)), lambda m: nnx.merge(*nnx.split(m.body))(x)],
        "features": [lambda m: m.features(x), nnx.jit(lambda m: m.features(x))],
    }
    for name, calls in runs.items():
        for run in calls:
            for m in (model, merged):
                np.testing.assert_allclose(run(m), expected[name], rtol=1e-5, atol=1e-5, err_msg=name)
    set_fake_quant_enabled(model, False)
    plain = Features()
    for name, calls in runs.items():
        for run in calls:
            np.testing.assert_array_equal(run(model), run(plain), err_msg=name)
    assert type(model.body) is nnx.Linear and type(model.head) is nnx.Linear


def test_linen_apply_with_method_is_fake_quantized():
    class Net(nn.Module):
        def setup(self):
            self.body = nn.Dense(32)
            self.head = nn.Dense(16)

        def features(self, x):
            return nn.relu(self.body(x))

        def __call__(self, x):
            return self.head(self.features(x))

    x = jnp.asarray(X)
    params = {"params": {"body": {"kernel": jnp.asarray(W1.T), "bias": jnp.asarray(B1)},
                         "head": {"kernel": jnp.asarray(W2.T), "bias": jnp.asarray(B2)}}}
    qat = apply_qat(Net(), bits=4, example_inputs=(x,))
    w1 = reference_codes_scales(W1, 4, "channel")[2]
    body = X @ w1.T + B1
    for method in (Net.features, "features", lambda m, x: nn.relu(m.body(x))):
        for apply in (qat.apply, jax.jit(qat.apply, static_argnames="method")):
            np.testing.assert_allclose(apply(params, x, method=method), np.maximum(body, 0), rtol=1e-5, atol=1e-5)


def test_linen_toggle_reaches_functions_jitted_before_it():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16, name="fc2")(nn.relu(nn.Dense(32, name="fc1")(x)))

    x = jnp.asarray(X)
    JIT_TOL = dict(rtol=1e-5, atol=1e-5)  # jit vs eager float32 sums of 48 and 32 products
    params = {"params": {"fc1": {"kernel": jnp.asarray(W1.T), "bias": jnp.asarray(B1)},
                         "fc2": {"kernel": jnp.asarray(W2.T), "bias": jnp.asarray(B2)}}}
    qat = apply_qat(MLP(), bits=4, example_inputs=(x,))
    quantized, plain = np.asarray(qat.apply(params, x)), np.asarray(MLP().apply(params, x))
    assert np.abs(quantized - plain).max() > 1e-2
    closure = jax.jit(lambda p, x: qat.apply(p, x))
    bound = jax.jit(qat.apply)
    static = jax.jit(lambda m, p, x: m.apply(p, x), static_argnums=0)
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(qat.apply(p, x))))
    for run in (closure, bound):
        np.testing.assert_allclose(run(params, x), quantized, **JIT_TOL)
    np.testing.assert_allclose(static(qat, params, x), quantized, **JIT_TOL)
    grad_on = grad(params, x)
    set_fake_quant_enabled(qat, False)
    for run in (closure, bound):  # jitted while on, called after the toggle: the float model
        np.testing.assert_allclose(run(params, x), plain, **JIT_TOL)
    for module in (qat, qat.clone()):
        np.testing.assert_allclose(static(module, params, x), plain, **JIT_TOL)
    grad_off = grad(params, x)
    float_grad = jax.grad(lambda p: jnp.sum(MLP().apply(p, x)))(params)
    np.testing.assert_allclose(grad_off["params"]["fc1"]["kernel"], float_grad["params"]["fc1"]["kernel"], rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(grad_on["params"]["fc1"]["kernel"]) - np.asarray(grad_off["params"]["fc1"]["kernel"])).max() > 1e-3
    set_fake_quant_enabled(qat, True)
    np.testing.assert_allclose(closure(params, x), quantized, **JIT_TOL)


def test_linen_call_made_before_the_toggle_computes_in_the_mode_it_was_made_in():
    # The call's input is still being computed when the toggle comes (asynchronous dispatch), so the
    # jitted program, and the host callback that reads the mode, run after set_fake_quant_enabled.
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16, name="fc2")(nn.relu(nn.Dense(32, name="fc1")(x)))

    x = jnp.asarray(X)
    params = {"params": {"fc1": {"kernel": jnp.asarray(W1.T), "bias": jnp.asarray(B1)},
                         "fc2": {"kernel": jnp.asarray(W2.T), "bias": jnp.asarray(B2)}}}
    qat = apply_qat(MLP(), bits=4, example_inputs=(x,))
    quantized = np.asarray(qat.apply(params, x))
    slow = jax.jit(lambda big: functools.reduce(lambda m, _: jnp.tanh(m @ m), range(8), big))
    run = jax.jit(lambda p, x, pending: qat.apply(p, x + 0 * pending[:1, :1]))
    big = jnp.asarray(RNG.standard_normal((700, 700)).astype(np.float32) / 30)
    run(params, x, slow(big)).block_until_ready()  # compiled
    made_on = run(params, x, slow(big))
    set_fake_quant_enabled(qat, False)
    np.testing.assert_allclose(np.asarray(made_on), quantized, rtol=1e-5, atol=1e-5)
    set_fake_quant_enabled(qat, True)


# ------------------------------------------------------------------------------- refusals, adapters


@pytest.mark.parametrize("fields", [dict(act_bits=8), dict(bwd_bits=8)])
def test_int4_convolutions_with_int8_operands_are_refused_naming_the_kernel_and_the_working_pattern(fields):
    x = jnp.asarray(RNG.standard_normal((2, 6, 6, 3)), jnp.float32)
    model = CNN(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"kernel 'conv.kernel' is a convolution: .*patterns=\[\('conv', QuantSpec\(bits=8") as err:
        apply_qat(model, bits=4, example_inputs=(x,), **fields)
    assert type(model) is CNN
    # the pattern the message proposes works
    working = eval(str(err.value).split("patterns=")[1].rstrip(), {"QuantSpec": QuantSpec})
    apply_qat(model, bits=4, patterns=working, example_inputs=(x,), **fields)
    assert get_qat_report(model).wrapped == ["conv.kernel", "fc.kernel"]
    jax.block_until_ready(nnx.grad(lambda m: jnp.sum(m(x)))(model))


def test_int4_by_int4_refusal_names_only_kernels_that_multiply():
    class LookupOnly(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(11, 48, rngs=rngs)
            self.fc = _linear(W1, B1)

        def __call__(self, ids):
            return self.fc(self.emb(ids))

    ids = jnp.asarray(RNG.integers(0, 11, (2, 3)))
    if jax.default_backend() == "tpu":  # the TPU multiplies int4 by int4: nothing to refuse
        model = apply_qat(LookupOnly(nnx.Rngs(0)), bits=4, act_bits=4, example_inputs=(ids,))
        assert np.isfinite(np.asarray(model(ids))).all()
        return
    with pytest.raises(ValueError, match=r"^kernel 'fc.kernel': int4.*int4 weights by int4 activations"):
        apply_qat(LookupOnly(nnx.Rngs(0)), bits=4, act_bits=4, example_inputs=(ids,))


class WithAdapters(nnx.Module):
    def __init__(self, rngs):
        self.base = nnx.LoRALinear(48, 32, lora_rank=4, rngs=rngs)
        self.extra = nnx.LoRA(32, 4, 16, rngs=rngs)

    def __call__(self, x):
        return self.extra(jax.nn.relu(self.base(x)))


def test_lora_adapters_stay_float_and_are_reported_as_adapters():
    x = jnp.asarray(X)
    model = WithAdapters(nnx.Rngs(0))
    model.base.lora.lora_b[...] = jnp.asarray(RNG.standard_normal((4, 32)), jnp.float32)
    model.extra.lora_b[...] = jnp.asarray(RNG.standard_normal((4, 16)), jnp.float32)
    apply_qat(model, bits=4, example_inputs=(x,))
    report = get_qat_report(model)
    assert report.wrapped == ["base.kernel"]
    for path in ("base.lora.lora_a", "base.lora.lora_b", "extra.lora_a", "extra.lora_b"):
        assert report[path].kind == "adapter" and report[path].action == "skipped"
    kernel = np.asarray(model.base.kernel[...])
    a1, b1 = np.asarray(model.base.lora.lora_a[...]), np.asarray(model.base.lora.lora_b[...])
    a2, b2 = np.asarray(model.extra.lora_a[...]), np.asarray(model.extra.lora_b[...])
    wq = reference_codes_scales(kernel.T, 4, "channel")[2].T
    h = np.maximum(X @ wq + np.asarray(model.base.bias[...]) + X @ a1 @ b1, 0)
    np.testing.assert_allclose(model(x), h @ a2 @ b2, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", [QuantSpec(bits=8), QuantSpec(bits=4, group_size=16), QuantSpec(bits=4, grid="qwix")])
def test_bfloat16_compute_trains_the_float32_master_weights_lattice(spec):
    # The usual TPU setting: float32 parameters, a layer computing in bfloat16. The product must
    # see numpy's fake-quant of the float32 kernel rounded once to bfloat16, the lattice convert
    # stores, not a fake-quant of the bfloat16-cast kernel.
    w = RNG.standard_normal((32, 48)).astype(np.float32)

    class Bf16(nnx.Module):
        def __init__(self):
            self.fc = nnx.Linear(48, 32, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                                 rngs=nnx.Rngs(0))
            self.fc.kernel[...] = jnp.asarray(w.T)

        def __call__(self, x):
            return self.fc(x)

    eye = jnp.eye(48, dtype=jnp.float32)
    model = apply_qat(Bf16(), spec=spec, example_inputs=(eye,))
    expected = reference_codes_scales(w, spec.bits, spec.granularity, spec.group_size, None, spec.grid)[2]
    expected = np.asarray(jnp.asarray(expected.T).astype(jnp.bfloat16).astype(jnp.float32))
    assert (expected != np.asarray(jnp.asarray(
        reference_codes_scales(np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32)), spec.bits,
                               spec.granularity, spec.group_size, None, spec.grid)[2].T))).any()
    np.testing.assert_array_equal(np.asarray(model(eye).astype(jnp.float32)), expected)
    jitted = nnx.jit(lambda m, x: m(x))
    np.testing.assert_array_equal(np.asarray(jitted(model, eye).astype(jnp.float32)), expected)
    grad = nnx.grad(lambda m: m(eye).astype(jnp.float32).sum())(model)
    np.testing.assert_array_equal(np.asarray(grad.fc.kernel[...]), np.ones((48, 32), np.float32))  # STE


def _rows(a, bits, axis=-1):
    """numpy: symmetric per-row codes and scales (absmax / qmax) along ``axis``."""
    qmax = 2 ** (bits - 1) - 1
    absmax = np.abs(a).max(axis=axis, keepdims=True).astype(np.float32)
    codes = np.clip(np.round(a * (np.float32(qmax) / absmax)), -qmax, qmax)
    return codes.astype(np.float32), absmax / np.float32(qmax)


@pytest.mark.parametrize("lead", [(6,), (2, 3)])
@pytest.mark.parametrize("spec", [QuantSpec(bits=8, act_bits=8), QuantSpec(bits=8, act_bits=8, bwd_bits=8),
                                  QuantSpec(bits=4, act_bits=8, bwd_bits=8), QuantSpec(bits=4, group_size=16, act_bits=8),
                                  QuantSpec(bits=8, granularity="tensor", act_bits=8, bwd_bits=8)])
def test_act_bits_multiply_mixles_weight_codes_by_activation_codes(spec, lead):
    # Integer operands: the weight's codes are numpy's of the float32 kernel, the activations'
    # per token; int32 sums scaled back. With bwd_bits both backward products are integer too.
    # Activations with several leading axes (batch, sequence) are the rows of their tokens.
    from mixle.flax_backend.int_matmul import int_matmul

    x = RNG.standard_normal((6, 48)).astype(np.float32)
    g = RNG.standard_normal((6, 32)).astype(np.float32)
    codes, scale, values = reference_codes_scales(W1, spec.bits, spec.granularity, spec.group_size)
    qx, sx = _rows(x, 8)
    if spec.granularity == "group":  # one integer product per group of 16 inputs, summed
        parts = [(qx[:, k:k + 16] @ codes[:, k:k + 16].T) * scale.reshape(32, -1)[:, k // 16] for k in range(0, 48, 16)]
        want = np.sum(parts, axis=0) * sx
    else:
        want = (qx @ codes.T) * scale.reshape(1, -1) * sx
    got, pullback = jax.vjp(lambda a, w: int_matmul(a, w, spec), jnp.asarray(x.reshape(lead + (48,))),
                            jnp.asarray(W1.T))
    assert got.shape == lead + (32,)
    np.testing.assert_allclose(np.asarray(got).reshape(6, 32), want, rtol=4 * np.finfo(np.float32).eps, atol=0)
    dx, dw = (np.asarray(a) for a in pullback(jnp.asarray(g.reshape(lead + (32,)))))
    dx = dx.reshape(6, 48)
    if spec.bwd_bits is None:
        np.testing.assert_allclose(dx, g @ values, rtol=1e-5, atol=1e-5)  # float STE: the fake-quantized weight
        np.testing.assert_allclose(dw, x.T @ g, rtol=1e-5, atol=1e-5)
        return
    qg, sg = _rows(g * scale.reshape(1, -1), 8)  # the gradient shifted by the weight's scales
    np.testing.assert_allclose(dx, (qg @ codes) * sg, rtol=4 * np.finfo(np.float32).eps, atol=0)
    qxc, sxc = _rows(x, 8, axis=0)
    qgc, sgc = _rows(g, 8, axis=0)
    np.testing.assert_allclose(dw, (qxc.T @ qgc) * sxc.reshape(-1, 1) * sgc, rtol=4 * np.finfo(np.float32).eps, atol=0)


def test_act_bits_models_train_on_mixles_weight_codes():
    x = jnp.asarray(X)
    model = Single(W1)
    apply_qat(model, bits=8, act_bits=8, bwd_bits=8, example_inputs=(x,))
    codes, scale, _ = reference_codes_scales(W1, 8, "channel")
    qx, sx = _rows(X, 8)
    # the same float32 operations in the same order after exact integer sums: equal
    np.testing.assert_array_equal(np.asarray(model(x)), (qx @ codes.T) * scale.reshape(1, -1) * sx)
    r = RNG.standard_normal((5, 32)).astype(np.float32)
    grad = nnx.grad(lambda m: jnp.sum(m(x) * r))(model)
    qxc, sxc = _rows(X, 8, axis=0)
    qgc, sgc = _rows(r, 8, axis=0)
    # two scalings of an exact integer sum, which XLA may associate either way: two roundings
    np.testing.assert_allclose(np.asarray(grad.fc.kernel[...]), (qxc.T @ qgc) * sxc.reshape(-1, 1) * sgc,
                               rtol=2 * np.finfo(np.float32).eps, atol=0)
    assert "1 quantized, 0 left in float" in str(get_qat_report(model))
