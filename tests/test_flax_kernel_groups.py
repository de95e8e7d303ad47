"""Kernel groups: one quantizer call per group of a wrapped Flax model's kernels gives every kernel the
values numpy's numerics give it alone, and the wrapped forward's logits and gradients exactly."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("qwix")
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from mixle.api import apply_qat, get_qat_report  # noqa: E402
from mixle.core.spec import QuantSpec  # noqa: E402
from mixle.flax_backend.kernel_groups import fake_quantize_groups, float_graphdef, kernel_groups  # noqa: E402
from mixle.flax_backend.qat import quantized_kernels  # noqa: E402
from mixle.lm.finetune_config import parse_target  # noqa: E402
from mixle.lm.flax_causal_lm import CausalLM, CausalLMConfig  # noqa: E402

SMALL = CausalLMConfig.from_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
                                  "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "tie_word_embeddings": True})
WIDE = CausalLMConfig.from_dict({**SMALL.__dict__, "hidden_size": 256, "intermediate_size": 256,
                                 "head_dim": 64})  # rows of 256: the K-quants' super-blocks
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)), jnp.int32)


def wrapped(config, spec):
    model = CausalLM(config, rngs=nnx.Rngs(0))
    apply_qat(model, example_inputs=(jnp.zeros((1, 4), jnp.int32),), spec=spec, exclude=("embed_tokens",))
    return model


def split(model):
    wanted = set(get_qat_report(model).wrapped)
    chosen = (lambda path, _: ".".join(map(str, path)) in wanted, ...)
    return (*nnx.split(model, *chosen), float_graphdef(model, *chosen))


def grouped_values(model):
    """The kernels' values from one quantizer call per group, checked against numpy's numerics on each
    kernel alone; returns the groups."""
    groups = kernel_groups(model)
    kernels = quantized_kernels(model)
    assert sorted(p for g in groups for p in g.paths) == sorted(f"{k.owner}.{k.name}" for k in kernels)
    params = split(model)[1]
    quantized = jax.jit(lambda p: fake_quantize_groups(groups, p))(params)
    values = {".".join(map(str, path)): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(quantized)}
    for kernel in kernels:
        expected = kernel.stored(np.asarray(kernel.param.get_raw_value(), np.float32))[1]
        np.testing.assert_array_equal(values[f"{kernel.owner}.{kernel.name}"], expected)

    def squares(p):  # straight through: its gradient is 2 * the quantized values
        return sum(jnp.sum(v.get_value() ** 2) for _, v in nnx.to_flat_state(fake_quantize_groups(groups, p)))

    grads = jax.jit(jax.grad(squares))(params)
    for path, grad in nnx.to_flat_state(grads):
        np.testing.assert_array_equal(np.asarray(grad.get_value()), 2 * values[".".join(map(str, path))])
    return groups


@pytest.mark.parametrize("target", ["q4_0", "int4"])
def test_one_call_per_input_size_and_the_wrapped_forward_and_gradient(target):
    model = wrapped(SMALL, parse_target(target))
    groups = grouped_values(model)
    assert sorted(sum(g.sizes) for g in groups) == [64, 64 + 64 + 32 + 32 + 128 + 128]  # down; the rest
    graphdef, params, frozen, float_graph = split(model)

    def logits(p, grouped):
        if grouped:
            return nnx.merge(float_graph, fake_quantize_groups(groups, p), frozen)(IDS)
        return nnx.merge(graphdef, p, frozen)(IDS)

    # The same float operations in the same order: equal, not close.
    np.testing.assert_array_equal(jax.jit(lambda p: logits(p, True))(params), jax.jit(lambda p: logits(p, False))(params))
    grads = [jax.jit(jax.grad(lambda p, g=g: jnp.sum(logits(p, g) ** 2)))(params) for g in (True, False)]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_array_equal(a, b)


def test_k_quants_group_too():
    # The weighted search's stacked groups are checked end to end against the file (test_finetune_jax.py).
    assert len(grouped_values(wrapped(WIDE, parse_target("q4_k")))) == 1


def test_per_tensor_scales_are_not_grouped():
    model = CausalLM(SMALL, rngs=nnx.Rngs(0))
    apply_qat(model, example_inputs=(jnp.zeros((1, 4), jnp.int32),), spec=QuantSpec(bits=8, granularity="tensor"),
              exclude=("embed_tokens",))
    assert kernel_groups(model) is None
    assert kernel_groups(CausalLM(SMALL, rngs=nnx.Rngs(0))) is None  # not wrapped


def test_a_stacked_groups_gradient_takes_memory_in_proportion_to_its_kernels():
    """The step's temporaries grow with the kernels, not with their square (each kernel's gradient is
    not a zero array of the whole stack's size)."""
    from mixle.flax_backend.kernel_groups import KernelGroup

    rng = np.random.default_rng(0)
    ratios = []
    for count in (4, 16):
        paths = tuple(f"k{i}" for i in range(count))
        group = KernelGroup(spec=parse_target("q4_0"), layout=(0,), paths=paths, sizes=(96,) * count,
                            importance=rng.uniform(0.1, 2, (count, 64)).astype(np.float32))
        state = nnx.State({path: nnx.Param(jnp.zeros((64, 96))) for path in paths})

        def squares(s, group=group):
            return sum(jnp.sum(v.get_value() ** 2) for _, v in nnx.to_flat_state(fake_quantize_groups((group,), s)))

        compiled = jax.jit(jax.grad(squares)).lower(state).compile()
        ratios.append(compiled.memory_analysis().temp_size_in_bytes / (count * 64 * 96 * 4))
    # Four times the kernels: the same temporaries per kernel (the TPU's compiler needs none here: 0 and 0).
    assert ratios[1] <= 1.5 * ratios[0], ratios


def test_the_float_graph_contracts_group_views_as_the_wrapped_forward_off_the_cpu(monkeypatch):
    # The TPU's program traced on this CPU: the wrapped forward multiplies groups of 128 in their view
    # (group_view), and so does the float graph of the grouped kernels: equal logits.
    model = wrapped(WIDE, parse_target("int4/group128"))
    groups = kernel_groups(model)
    graphdef, params, frozen, float_graph = split(model)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    grouped = jax.jit(lambda p: nnx.merge(float_graph, fake_quantize_groups(groups, p), frozen)(IDS))
    plain = jax.jit(lambda p: nnx.merge(graphdef, p, frozen)(IDS))
    viewed = [f.lower(params).as_text().count("contracting_dims = [2, 3] x [0, 1]") for f in (grouped, plain)]
    assert viewed == [7, 7]  # q, k, v, o, gate, up (256 inputs each), down (256): every Linear
    np.testing.assert_array_equal(grouped(params), plain(params))
