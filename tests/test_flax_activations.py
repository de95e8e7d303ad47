"""act_bits=8 on llama.cpp's grids in Flax: each quantized product's input rounded as llama.cpp's CPU path
rounds it (Q8_0 blocks of 32, Q8_K blocks of 256), checked against gguf-py's Q8_0 and a numpy
transcription of ggml's ``quantize_row_q8_K``; a Linear then computes ``rounded input @ its weight's
blocks``, and the float graph the finetune job runs (kernel groups) rounds what the wrapped forward
rounds, exactly.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
pytest.importorskip("qwix")
pytest.importorskip("torch")
pytest.importorskip("gguf")

import jax.numpy as jnp  # noqa: E402

import mixle  # noqa: E402
from mixle.core.array_ops import JaxOps  # noqa: E402
from mixle.core.numerics import quantize_dequantize_array  # noqa: E402
from mixle.core.spec import QuantSpec  # noqa: E402
from mixle.flax_backend.activations import round_product_input  # noqa: E402
from mixle.flax_backend.kernel_groups import float_graphdef, kernel_groups, quantized_state  # noqa: E402
from mixle.lm.flax_causal_lm import CausalLM, CausalLMConfig  # noqa: E402
from tests.test_flax_fake_quant import _tpu_like_quotient, stand_in  # noqa: E402
from tests.test_gguf_grids import gguf_round_trip  # noqa: E402
from tests.test_kquant_activations import _tokens, np_q8_0, np_q8_k  # noqa: E402

# (weight grid, bits) -> the numpy reference of its product input
REFERENCES = {("q4_0", 4): np_q8_0, ("q5_1", 5): np_q8_0, ("q4_k", 4): np_q8_k, ("q6_k", 6): np_q8_k}


def _inputs(grid):
    x = np.concatenate([_tokens(), _tokens()[::-1]], axis=1)  # two blocks of 256 per token
    return x[5:] if REFERENCES[grid] is np_q8_0 else x  # Q8_0: scales within float16's range


@pytest.mark.parametrize("grid, bits", list(REFERENCES))
def test_product_inputs_are_llama_cpps_blocks_bit_for_bit(grid, bits):
    x, spec = _inputs((grid, bits)), QuantSpec(bits=bits, grid=grid, act_bits=8)
    want = REFERENCES[grid, bits](x)
    np.testing.assert_array_equal(np.asarray(round_product_input(x, spec)), want)  # eager: numpy's operations
    jitted = jax.jit(lambda v: round_product_input(v, spec))
    np.testing.assert_array_equal(np.asarray(jitted(jnp.asarray(x))), want)
    bf16 = jnp.asarray(x).astype(jnp.bfloat16)  # rounded in float32, cast back
    np.testing.assert_array_equal(np.asarray(jitted(bf16)).astype(np.float32),
                                  np.asarray(jnp.asarray(REFERENCES[grid, bits](np.asarray(bf16, np.float32)))
                                             .astype(jnp.bfloat16)).astype(np.float32))


@stand_in
def test_q8_k_blocks_stay_exact_with_the_tpus_kind_of_division(monkeypatch):
    x, spec = _inputs(("q4_k", 4)), QuantSpec(bits=4, grid="q4_k", act_bits=8)
    monkeypatch.setattr(JaxOps, "quotient", _tpu_like_quotient)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: round_product_input(v, spec))(jnp.asarray(x))),
                                  np_q8_k(x))


def test_the_gradient_is_straight_through_and_bad_widths_are_refused():
    spec = QuantSpec(bits=4, grid="q4_0", act_bits=8)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 64)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.grad(lambda v: (round_product_input(v, spec) * 3.0).sum())(x)),
                                  np.full((3, 64), 3.0, np.float32))
    with pytest.raises(ValueError, match="48 values per token does not split into q8_0 blocks of 32"):
        round_product_input(jnp.ones((1, 48)), spec)
    with pytest.raises(ValueError, match="act_bits=8 with grid='symmetric'"):
        round_product_input(jnp.ones((1, 32)), QuantSpec(bits=4, act_bits=8))


@pytest.mark.parametrize("grid, bits", [("q4_0", 4), ("q4_k", 4)])
def test_a_linear_multiplies_the_rounded_input_by_its_weights_blocks(grid, bits):
    """``y = rounded(x) @ dequantized(W) + b``: gguf-py's Q4_0 blocks, mixle's Q4_K ones (checked
    against llama-quantize elsewhere), and llama.cpp's rounding of the input."""
    rng = np.random.default_rng(1)
    layer = nnx.Linear(256, 8, rngs=nnx.Rngs(0))
    layer.bias[...] = jnp.asarray(rng.standard_normal(8), jnp.float32)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    plain = nnx.clone(layer)
    mixle.apply_qat(layer, grid=grid, bits=bits, act_bits=8, example_inputs=(jnp.asarray(x),))
    mixle.apply_qat(plain, grid=grid, bits=bits, example_inputs=(jnp.asarray(x),))
    rows = np.asarray(layer.kernel[...]).T  # (out, in)
    blocks = gguf_round_trip(rows, grid) if grid == "q4_0" else quantize_dequantize_array(rows, QuantSpec(bits=bits,
                                                                                                          grid=grid))
    want = REFERENCES[grid, bits](x) @ blocks.T + np.asarray(layer.bias[...])
    tolerance = 256 * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(blocks).T).max()  # 256-term float32 sums
    for forward in (lambda: layer(jnp.asarray(x)), lambda: jax.jit(lambda m, v: m(v))(layer, jnp.asarray(x))):
        np.testing.assert_allclose(np.asarray(forward()), want, rtol=0, atol=tolerance)
    assert np.abs(np.asarray(plain(jnp.asarray(x))) - want).max() > 10 * tolerance  # the rounding matters


@pytest.mark.parametrize("act_rounding", ["x86"])  # not the default: the option reaches every product's rounding
def test_the_float_graph_and_the_ptq_rows_round_what_the_wrapped_forward_rounds(act_rounding):
    """The finetune job's step runs the float graph on the kernels' fake-quantized values, and its PTQ
    rows a float copy holding them: with act_bits both round each quantized product's input (the Q5_0
    and Q8_0 Linears of the Q4_K_M mix at this width, and the tied embedding's ``attend``), so their
    logits are the wrapped forward's, exactly, and not those of the same values without the rounding."""
    pytest.importorskip("transformers")  # apply_qat(gguf_mix=...) needs it (mixle[hf])
    from mixle.lm.finetune_jax import _with_stored_values

    config = CausalLMConfig.from_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 64,
                                       "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
                                       "tie_word_embeddings": True})
    model = CausalLM(config, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.arange(12).reshape(2, 6) % 64, jnp.int32)
    wrapped = nnx.clone(model)
    mixle.apply_qat(wrapped, gguf_mix="Q4_K_M", act_bits=8, act_rounding=act_rounding, example_inputs=(ids[:, :4],))
    groups = kernel_groups(wrapped)
    assert {group.spec.act_rounding for group in groups} == {act_rounding}
    assert {group.spec.grid for group in groups} == {"q5_0", "q8_0"} and any(
        path.startswith("embed_tokens") for group in groups for path in group.paths)
    state = quantized_state(groups, nnx.state(wrapped))
    got = jax.jit(lambda s, graphdef=float_graphdef(wrapped): nnx.merge(graphdef, s)(ids))(state)
    forward = jax.jit(lambda m: m(ids))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(forward(wrapped)))
    np.testing.assert_array_equal(np.asarray(forward(_with_stored_values(model, wrapped))), np.asarray(got))
    unrounded = forward(nnx.merge(nnx.graphdef(model), state))
    assert np.abs(np.asarray(unrounded) - np.asarray(got)).max() > 1e-4


def test_convert_refuses_act_bits_on_llama_cpps_grids():
    layer = nnx.Linear(64, 8, rngs=nnx.Rngs(0))
    mixle.apply_qat(layer, grid="q4_0", act_bits=8, example_inputs=(jnp.ones((1, 64)),))
    with pytest.raises(ValueError, match="act_bits=8, the rounding of its input llama.cpp applies"):
        mixle.convert(layer)


@pytest.mark.parametrize("build", ["reference", "x86", "arm"])
def test_each_llama_cpp_builds_q8_0_rounding_is_its_c_loop_bit_for_bit(build, monkeypatch):
    """``act_rounding`` in jax, eager, jit, and jit with the TPU's kind of division (on other backends)."""
    from tests.test_act_rounding import c_q8_0, tie_tokens

    x, spec = tie_tokens(16), QuantSpec(bits=4, grid="q4_0", act_bits=8, act_rounding=build)
    want = c_q8_0(x, build)
    np.testing.assert_array_equal(np.asarray(round_product_input(x, spec)), want)
    jitted = jax.jit(lambda v: round_product_input(v, spec))
    np.testing.assert_array_equal(np.asarray(jitted(jnp.asarray(x))), want)
    if jax.default_backend() != "tpu":
        monkeypatch.setattr(JaxOps, "quotient", _tpu_like_quotient)
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: round_product_input(v, spec))(jnp.asarray(x))),
                                      want)


def test_a_linear_trains_on_the_x86_builds_rounding_of_its_input():
    from tests.test_act_rounding import c_q8_0, tie_tokens

    x = tie_tokens(3)
    layer = nnx.Linear(256, 8, rngs=nnx.Rngs(0))
    mixle.apply_qat(layer, grid="q4_0", act_bits=8, act_rounding="x86", example_inputs=(jnp.asarray(x),))
    blocks = gguf_round_trip(np.asarray(layer.kernel[...]).T, "q4_0")
    tolerance = 256 * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(blocks).T).max()  # 256-term float32 sums
    got = np.asarray(jax.jit(lambda m, v: m(v))(layer, jnp.asarray(x)))
    np.testing.assert_allclose(got, c_q8_0(x, "x86") @ blocks.T + np.asarray(layer.bias[...]), rtol=0, atol=tolerance)
    assert np.abs(got - (c_q8_0(x, "reference") @ blocks.T + np.asarray(layer.bias[...]))).max() > 10 * tolerance


def test_projections_reading_one_input_share_its_rounding(monkeypatch):
    """q, k and v (gate and up) read the same tracer: the compiled forward rounds it once, so a layer
    holds four roundings (q/k/v, o, gate/up, down), not seven, plus the tied head's."""
    pytest.importorskip("transformers")  # apply_qat(gguf_mix=...) needs it (mixle[hf])
    from mixle.flax_backend import activations

    config = CausalLMConfig.from_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 64,
                                       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                                       "tie_word_embeddings": True})
    ids = jnp.asarray(np.arange(12).reshape(2, 6) % 64, jnp.int32)
    model = CausalLM(config, rngs=nnx.Rngs(0))
    mixle.apply_qat(model, gguf_mix="Q4_0", act_bits=8, example_inputs=(ids[:, :4],))
    rounded, original = [], activations._rounded
    monkeypatch.setattr(activations, "_rounded", lambda x, spec: rounded.append(x.shape) or original(x, spec))
    graphdef, state = float_graphdef(model), quantized_state(kernel_groups(model), nnx.state(model))
    got = jax.jit(lambda s: nnx.merge(graphdef, s)(ids))(state)
    assert len(rounded) == 4 * 2 + 1, rounded
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(lambda m: m(ids))(model)))
