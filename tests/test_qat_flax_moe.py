"""Flax mixtures of experts: an expert product through jax.lax.ragged_dot stays float, reported with
the reason (Qwix would scale the stacked weight per output channel across all experts)."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
pytest.importorskip("qwix")

import jax.numpy as jnp  # noqa: E402

import mixle  # noqa: E402


class Experts(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(16, 16, rngs=rngs)
        self.experts = nnx.Param(jax.random.normal(rngs.params(), (4, 16, 32)))

    def __call__(self, x):
        sizes = jnp.array([2, 2, 2, 2], jnp.int32)  # tokens sorted by expert, 2 each
        return jax.lax.ragged_dot(self.proj(x), self.experts[...], sizes)


def test_ragged_dot_experts_stay_float_with_the_reason():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.float32)
    float_out = Experts(nnx.Rngs(0))(x)
    model = Experts(nnx.Rngs(0))
    mixle.apply_qat(model, bits=4, example_inputs=(x,))
    report = str(mixle.get_qat_report(model))
    assert "ragged_dot" in report and "per-expert scales" in report, report
    out = model(x)
    mixle.set_fake_quant_enabled(model, False)
    assert np.array_equal(np.asarray(model(x)), np.asarray(float_out))
    mixle.set_fake_quant_enabled(model, True)
    assert not np.array_equal(np.asarray(out), np.asarray(float_out))  # proj is fake-quantized
