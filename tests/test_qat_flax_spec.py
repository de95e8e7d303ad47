"""QuantSpec's Flax/Qwix-only options: validation, refused knobs, torch refusal, Qwix rule translation."""

import re

import numpy as np
import pytest

from mixle.core.spec import QuantSpec


def test_defaults_unchanged_and_plain_repr_hides_qwix_options():
    assert QuantSpec() == QuantSpec(act_bits=None, weight_format="int", bwd_bits=None, calibration=None)
    assert repr(QuantSpec()) == (
        "QuantSpec(bits=4, grid='symmetric', granularity='channel', group_size=None, "
        "clip_percentile=None, clip_gradient=False)"
    )
    assert "act_bits=8" in repr(QuantSpec(bits=8, act_bits=8))
    assert QuantSpec().qwix_only_options() == {}
    assert QuantSpec(bits=8, act_bits=4, bwd_bits=8).qwix_only_options() == {"act_bits": 4, "bwd_bits": 8}


@pytest.mark.parametrize("fields,reason", [
    (dict(act_static_scale=True), "calibration pass"),
    (dict(kv_cache_bits=8), "KV-cache quantization"),
    (dict(bits=8, grid="qwix", weight_format="float8_e4m3fnuz"), "AMD-only fp8"),
    (dict(bits=8, grid="qwix", weight_format="float8_e5m2fnuz"), "AMD-only fp8"),
])
def test_knobs_without_a_seam_are_refused_at_construction_with_the_reason(fields, reason):
    with pytest.raises(ValueError, match=reason):
        QuantSpec(**fields)


@pytest.mark.parametrize("fields,message", [
    (dict(act_bits=6), "act_bits=6 is not supported"),
    (dict(bwd_bits=2), "bwd_bits=2 is not supported"),
    (dict(bwd_stochastic_rounding="uniform"), "bwd_bits is None"),
    (dict(bwd_bits=8, bwd_stochastic_rounding="nearest"), "unknown"),
    (dict(weight_format="float8_e4m3fn"), "pass bits=8 and grid='qwix'"),
    (dict(weight_format="nf4"), "unknown"),
    (dict(calibration="absmax,0.9"), "needs grid='qwix'"),
    (dict(grid="qwix", calibration="percentile,99"), "clip_percentile=99"),
    (dict(grid="qwix", calibration="median"), "unknown method"),
    (dict(grid="qwix", calibration="rms"), "exactly one positive factor"),
    (dict(grid="qwix", calibration="absmax,-1"), "positive factor"),
    (dict(grid="qwix", calibration="fixed,1,2"), "containing 0"),
    (dict(grid="qwix", calibration="fixed,-2,2", granularity="channel"), "granularity='tensor'"),
    (dict(grid="qwix", calibration="absmax,x"), "non-numeric"),
    (dict(grid="qwix", calibration="absmax", clip_percentile=99.0), "keep one"),
    (dict(bits=8, grid="qwix", weight_format="float8_e4m3fn", calibration="minmax"), "asymmetric"),
])
def test_qwix_options_are_validated_naming_the_argument(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        QuantSpec(**fields)


def test_calibration_is_normalised_and_fixed_defaults_to_per_tensor():
    spec = QuantSpec(bits=8, grid="qwix", calibration=" Fixed, 2 ")
    assert spec.calibration == "fixed,-2.0,2.0" and spec.granularity == "tensor"
    assert QuantSpec(grid="qwix", calibration="minmax").calibration == "minmax"
    assert QuantSpec(bits=8, act_bits=8, bwd_bits=8, bwd_stochastic_rounding="uniform").short() == (
        "int8/channel/symmetric/a8/g8sr")


@pytest.mark.parametrize("fields", [
    dict(bits=8, grid="qwix", weight_format="float8_e4m3fn"), dict(bwd_bits=8),
    dict(grid="qwix", calibration="rms,3"),
])  # act_bits is honoured by the torch backend too (tests/test_activations.py)
def test_torch_backend_refuses_each_qwix_only_option(fields):
    torch = pytest.importorskip("torch")
    from mixle.models.qat import apply_qat

    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    before = net[0].weight.detach().clone()
    name = next(iter(QuantSpec(**fields).qwix_only_options()))
    with pytest.raises(ValueError, match=f"QuantSpec.{name}=.*not supported by the torch backend"):
        apply_qat(net, **fields)
    assert type(net[0]) is torch.nn.Linear and torch.equal(net[0].weight, before)


def test_fake_quantize_on_arrays_refuses_qwix_only_options():
    jnp = pytest.importorskip("jax.numpy")
    from mixle.models.qat import fake_quantize

    with pytest.raises(ValueError, match="act_bits"):
        fake_quantize(jnp.ones((2, 4)), bits=8, act_bits=8)


# ------------------------------------------------------------------------------- Qwix rules


def test_qwix_rules_translate_every_field():
    pytest.importorskip("qwix")
    import jax.numpy as jnp

    from mixle.flax_backend.rules import module_path_regex, qwix_rule, qwix_rules

    rule = qwix_rule(QuantSpec(bits=4, group_size=32), "fc")
    assert (rule.weight_qtype, rule.tile_size, rule.act_qtype, rule.bwd_qtype) == (jnp.int4, 32, None, None)
    assert rule.weight_calibration_method == f"absmax,{7.5 / 7!r}"
    assert rule.additional_qt_config == {"use_original_residuals": False}
    rule = qwix_rule(QuantSpec(bits=8, act_bits=8, bwd_bits=4, bwd_stochastic_rounding="low_bit_uniform",
                               granularity="tensor"), "x")
    assert (rule.weight_qtype, rule.act_qtype, rule.bwd_qtype) == (jnp.int8, jnp.int8, jnp.int4)
    assert rule.act_calibration_method == f"absmax,{127.5 / 127!r}" and rule.disable_channelwise_axes
    assert rule.bwd_stochastic_rounding == "low_bit_uniform" and rule.tile_size is None
    rule = qwix_rule(QuantSpec(bits=8, grid="qwix", weight_format="float8_e4m3fn", calibration="rms,3"))
    assert (rule.weight_qtype, rule.weight_calibration_method) == (jnp.float8_e4m3fn, "rms,3.0")
    assert qwix_rule(QuantSpec(clip_percentile=99.5)).weight_calibration_method == "percentile,99.5"
    assert qwix_rule(None, "head").weight_qtype is None
    rules = qwix_rules(QuantSpec(), patterns=[(r"head", None), (r"blocks\.0\..*", QuantSpec(bits=8)), ".*"])
    assert [r.module_path for r in rules] == ["head", "blocks/0/.*", ".*"]
    assert [r.weight_qtype for r in rules] == [None, jnp.int8, jnp.int4]
    assert module_path_regex(r"a\\\.b") == r"a\\/b" and module_path_regex("a.b") == "a.b"


def test_a_stock_qwix_provider_refuses_a_percentile_rule_instead_of_ignoring_it():
    pytest.importorskip("qwix")
    import jax
    import qwix
    from flax import nnx

    from mixle.flax_backend.rules import qwix_rules

    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="Unsupported calibration: percentile,99.0"):
        qwix.quantize_model(model, qwix.QtProvider(qwix_rules(clip_percentile=99)), jax.numpy.ones((2, 4)))


def test_symmetric_factor_reproduces_the_symmetric_grid_in_qwix_calibration():
    """Qwix quantizing with mixle's rule for the symmetric grid gets mixle's scale absmax / qmax
    (Qwix itself divides by qmax + 0.5: the rule's factor (qmax + 0.5) / qmax makes up for it)."""
    pytest.importorskip("qwix")
    import jax.numpy as jnp
    import qwix

    from mixle.flax_backend.rules import qwix_rule

    for bits in (4, 8):
        qmax = 2 ** (bits - 1) - 1
        kernel = np.random.default_rng(bits).normal(0, 1, (64, 48)).astype(np.float32)  # (in, out)
        kernel *= np.float32(np.random.default_rng(bits + 1).uniform(0.01, 10, 48))  # very different channels
        rule = qwix_rule(QuantSpec(bits=bits), "fc")
        quantized = qwix.quantize(jnp.asarray(kernel), rule.weight_qtype, channelwise_axes=[1],
                                  calibration_method=rule.weight_calibration_method)
        expected = np.abs(kernel).max(0, keepdims=True) / np.float32(qmax)  # mixle's symmetric grid
        # four float32 roundings of 2**-24 at most (the factor, absmax * factor, / (qmax + 0.5) there,
        # / qmax here), plus their second-order terms
        np.testing.assert_allclose(np.asarray(quantized.scale), expected, rtol=4.5 * 2.0 ** -24)
        codes = np.asarray(quantized.qvalue).astype(np.int32)
        assert codes.min() >= -qmax and codes.max() <= qmax and (np.abs(codes).max(0) == qmax).all()
