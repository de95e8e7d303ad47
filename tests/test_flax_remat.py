"""Rematerialization: the quantized kernels carry ``mixle.QUANTIZED_KERNEL``, so a remat policy keeps them."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("qwix")
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import mixle  # noqa: E402
from mixle.core.spec import QuantSpec  # noqa: E402
from tests.jaxpr_walk import equations  # noqa: E402

IN, HIDDEN = 64, 32


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(IN, HIDDEN, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, IN, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class Net(nnx.Module):
    def __init__(self, remat, rngs):
        self.blocks = nnx.List([Block(rngs), Block(rngs)])
        self.remat = remat  # "off", "all" or "kernels"

    def __call__(self, x):
        policy = jax.checkpoint_policies.save_only_these_names(mixle.QUANTIZED_KERNEL) if self.remat == "kernels" else None
        for block in self.blocks:
            x = block(x) if self.remat == "off" else nnx.remat(lambda b, x: b(x), policy=policy)(block, x)
        return x


def _gradient(net, remat, x, primitive):
    net.remat = remat
    graphdef, params, rest = nnx.split(net, nnx.Param, ...)

    def loss(params):
        return (nnx.merge(graphdef, params, rest)(x).astype(jnp.float32) ** 2).mean()

    quantizing = len(equations(jax.make_jaxpr(jax.grad(loss))(params).jaxpr, primitive))
    return quantizing, jax.tree.leaves(jax.jit(jax.grad(loss))(params))


# int4 in groups (the kernel's quantizer: one maximum per block), q4_1 (llama.cpp's block numerics,
# by rows: one argmax per block's maximum)
@pytest.mark.parametrize("spec,primitive", [(QuantSpec(bits=4, group_size=32), "reduce_max"),
                                            (QuantSpec(grid="q4_1"), "argmax")], ids=["int4-g32", "q4_1"])
def test_a_policy_keeping_the_named_kernels_quantizes_each_kernel_once_with_the_same_gradient(spec, primitive):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, IN)), jnp.float32)
    net = mixle.apply_qat(Net("off", nnx.Rngs(0)), spec=spec, example_inputs=(x,))
    plain, plain_grads = _gradient(net, "off", x, primitive)
    everything, _ = _gradient(net, "all", x, primitive)
    kept, kept_grads = _gradient(net, "kernels", x, primitive)
    # Recomputing everything quantizes every kernel again in the backward; keeping the named kernels
    # leaves the quantizer's steps where the step without remat has them.
    assert everything > plain > 0
    assert kept == plain
    for got, want in zip(kept_grads, plain_grads):
        got, want = np.asarray(got), np.asarray(want)
        if jax.default_backend() == "cpu":
            # The same float32 operations, possibly fused differently by XLA: a few ulps of sums over 64 inputs.
            np.testing.assert_allclose(got, want, rtol=64 * np.finfo(np.float32).eps, atol=1e-7)
        else:
            # Off the CPU XLA keeps a bfloat16 value in float32 inside a fusion (excess precision), and
            # remat fuses differently: each of the four layers the gradient passes may round its
            # bfloat16 output or not, half a bfloat16 ulp of the gradient's scale each.
            bound = 4 * float(jnp.finfo(jnp.bfloat16).eps) / 2 * np.abs(want).max()
            np.testing.assert_allclose(got, want, rtol=0, atol=bound)
