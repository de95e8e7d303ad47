"""llama.cpp's grids on Flax: a kernel's blocks are numpy's (and so llama-quantize's) for the same
weights, under jit and with the TPU's kinds of division; the gradient is straight-through; mixes
pick torch's types; the GGUF and compressed-tensors files equal the torch model's byte for byte."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")

import jax.numpy as jnp  # noqa: E402

from mixle.api import apply_qat, convert, get_qat_report  # noqa: E402
from mixle.core.array_ops import JaxOps  # noqa: E402
from mixle.core.numerics import quantize_array, quantize_dequantize_array  # noqa: E402
from mixle.core.spec import QuantSpec  # noqa: E402
from mixle.core.stored import QuantizedArray  # noqa: E402
from mixle.flax_backend.fake_quant import fake_quantize_weight, kernel_rows  # noqa: E402
from tests.test_flax_fake_quant import _tpu_like_quotient, stand_in  # noqa: E402

GRIDS = ("q4_0", "q8_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


def _kernel(shape=(256, 3), seed=0):
    """An (in, out) kernel with an all-zero block, a signed extreme and repeated magnitudes."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    w[:32, 0] = 0.0
    w[7, 1], w[9, 1] = 0.4, -0.4
    w[:, 2] *= np.exp(rng.uniform(-3, 3, shape[0])).astype(np.float32)
    return w


@stand_in
@pytest.mark.parametrize("grid", GRIDS)
def test_jitted_rows_equal_numpys_blocks_when_xla_divides_as_the_tpu_does(monkeypatch, grid):
    monkeypatch.setattr(JaxOps, "quotient", _tpu_like_quotient)
    w = _kernel()
    spec = QuantSpec(grid=grid)
    want = quantize_array(w.T.copy(), spec)  # torch's (out, in) rows: blocks along the input axis
    got = jax.jit(lambda k: kernel_rows(k, (0,), spec).parts())(jnp.asarray(w))
    assert sorted(got) == sorted(want.parts())
    for part, value in want.parts().items():
        np.testing.assert_array_equal(np.asarray(got[part]), value, err_msg=part)
    deq = np.asarray(jax.jit(lambda k: fake_quantize_weight(k, (0,), spec))(jnp.asarray(w)))
    np.testing.assert_array_equal(deq, want.dequantize().T)  # values (XLA may keep a -0.0 code times a scale)


@pytest.mark.parametrize("grid", ["q4_0", "q5_1", "q6_k"])
def test_importance_weighted_search_equals_numpys(grid):
    w = _kernel(seed=1)
    importance = np.abs(np.random.default_rng(2).standard_normal(256)).astype(np.float32)
    spec = QuantSpec(grid=grid)
    want = quantize_array(w.T.copy(), spec, importance=importance).dequantize().T
    got = jax.jit(lambda k: fake_quantize_weight(k, (0,), spec, importance=importance))(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(got), want)
    assert not np.array_equal(want, quantize_dequantize_array(w.T.copy(), spec).T)  # the weights matter


@pytest.mark.parametrize("how", ["lanes", "unrolled"])
@pytest.mark.parametrize("grid", ["q4_0", "q5_1"])
def test_every_way_of_running_cs_sums_gives_numpys_search(monkeypatch, grid, how):
    # ORDERED_SUMS picks per platform how JaxC runs C's running sums; each must be the same
    # in-order float32 additions. 128 kernel rows: the blocks' count divides into 128 lanes.
    from mixle.core import c_arith

    monkeypatch.setitem(c_arith.ORDERED_SUMS, jax.default_backend(), how)
    w = _kernel(shape=(256, 128), seed=3)
    importance = np.abs(np.random.default_rng(4).standard_normal(256)).astype(np.float32)
    spec = QuantSpec(grid=grid)
    want = quantize_array(w.T.copy(), spec, importance=importance).dequantize().T
    got = jax.jit(lambda k: fake_quantize_weight(k, (0,), spec, importance=importance))(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_blocks_equal_gguf_pys_quantizer():
    gguf = pytest.importorskip("gguf")
    from mixle.gguf.blocks import pack_array

    w = _kernel()
    for grid, kind in (("q4_0", "Q4_0"), ("q8_0", "Q8_0"), ("q4_1", "Q4_1"), ("q5_0", "Q5_0"), ("q5_1", "Q5_1")):
        spec = QuantSpec(grid=grid)
        parts = jax.jit(lambda k: kernel_rows(k, (0,), spec).parts())(jnp.asarray(w))
        numpy_q = QuantizedArray(np.asarray(parts.pop("codes")), np.asarray(parts.pop("scale")), spec, 0, 1,
                                 **{n: np.asarray(v) for n, v in parts.items()})
        want = gguf.quants.quantize(w.T.copy(), getattr(gguf.GGMLQuantizationType, kind))
        np.testing.assert_array_equal(pack_array(numpy_q, grid), want, err_msg=grid)


class _Net(nnx.Module):
    def __init__(self):
        self.fc = nnx.Linear(256, 4, use_bias=False, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.fc(x)


@pytest.mark.parametrize("grid", ["q8_0", "q5_0", "q4_k"])
def test_qat_forward_runs_on_the_rows_and_the_gradient_is_straight_through(grid):
    net = _Net()
    w = np.asarray(net.fc.kernel[...])
    x = jnp.asarray(np.random.default_rng(3).standard_normal((5, 256)).astype(np.float32))
    apply_qat(net, grid=grid, example_inputs=(x,))
    assert get_qat_report(net).wrapped == ["fc.kernel"]
    deq = quantize_dequantize_array(w.T.copy(), QuantSpec(grid=grid)).T  # rows of torch's (out, in)
    out = jax.jit(lambda m, v: m(v))(net, jnp.eye(256))
    np.testing.assert_array_equal(np.asarray(out), deq)
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(net)
    np.testing.assert_allclose(np.asarray(grads.fc.kernel[...]), np.asarray(x).T @ (2 * (np.asarray(x) @ deq)),
                               rtol=1e-5, atol=1e-5)
    converted = convert(net)
    np.testing.assert_array_equal(np.asarray(converted.fc.kernel[...]), deq)


def test_qwix_only_options_are_refused_on_llama_cpp_grids():
    net = _Net()
    with pytest.raises(ValueError, match=r"module 'fc'.*llama.cpp's Q4_K.*bwd_bits"):
        apply_qat(net, grid="q4_k", bwd_bits=8, example_inputs=(jnp.ones((2, 256)),))
    with pytest.raises(ValueError, match=r"grid='nf4'.*not supported by the flax backend"):
        apply_qat(net, grid="nf4", example_inputs=(jnp.ones((2, 256)),))


# ---------------------------------------------------------------------------------------- files

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _checkpoint(tmp_path, tied, hidden=256):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=32, tie_word_embeddings=tied, rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _twins(directory):
    from mixle.lm.flax_causal_lm import load_causal_lm

    return transformers.LlamaForCausalLM.from_pretrained(directory).eval(), load_causal_lm(directory)


IDS = (jnp.zeros((1, 4), jnp.int32),)


@pytest.mark.parametrize("tied, qat, convert_flax", [(False, dict(grid="q4_0"), False),
                                                     (True, dict(grid="q5_k"), True),
                                                     (False, dict(gguf_mix="Q4_K_M"), False)])
def test_gguf_from_flax_equals_the_torch_file_byte_for_byte(tmp_path, tied, qat, convert_flax):
    gguf = pytest.importorskip("gguf")
    from mixle.gguf.writer import save_gguf

    torch_model, flax_model = _twins(_checkpoint(tmp_path, tied))
    apply_qat(torch_model, **qat)
    apply_qat(flax_model, example_inputs=IDS, **qat)
    if convert_flax:
        flax_model = convert(flax_model)
    mix = {"gguf_mix": qat["gguf_mix"]} if "gguf_mix" in qat else {}
    (tmp_path / "torch").mkdir(), (tmp_path / "flax").mkdir()
    types = save_gguf(torch_model, tmp_path / "torch" / "m.gguf", **mix)
    assert save_gguf(flax_model, tmp_path / "flax" / "m.gguf", **mix) == types
    assert (tmp_path / "flax" / "m.gguf").read_bytes() == (tmp_path / "torch" / "m.gguf").read_bytes()
    reader = gguf.GGUFReader(tmp_path / "flax" / "m.gguf")
    assert {t.name: t.tensor_type.name for t in reader.tensors} == types


def test_mix_picks_torchs_types_for_the_flax_model(tmp_path):
    from mixle.gguf.writer import gguf_mix_specs

    torch_model, flax_model = _twins(_checkpoint(tmp_path, tied=True))
    apply_qat(flax_model, gguf_mix="Q4_K_M", example_inputs=IDS)
    torch_specs = gguf_mix_specs(torch_model, "Q4_K_M")
    flax_specs = {d.path.rpartition(".")[0]: d.spec for d in get_qat_report(flax_model).decisions}
    assert flax_specs["embed_tokens"] == torch_specs["model.embed_tokens"] == torch_specs["lm_head"]
    for path, spec in torch_specs.items():
        if path != "lm_head":
            assert flax_specs[path.removeprefix("model.")] == spec, path
    assert {s.grid for s in flax_specs.values()} == {"q4_k", "q6_k"}


@pytest.mark.parametrize("tied", [False, True])
def test_compressed_tensors_from_flax_equal_the_torch_files(tmp_path, tied):
    pytest.importorskip("compressed_tensors")
    from mixle.exports.compressed_tensors import save_pretrained_compressed

    torch_model, flax_model = _twins(_checkpoint(tmp_path, tied, hidden=64))
    apply_qat(torch_model, bits=4, group_size=32)
    apply_qat(flax_model, bits=4, group_size=32, example_inputs=IDS)
    save_pretrained_compressed(torch_model, tmp_path / "torch")
    save_pretrained_compressed(flax_model, tmp_path / "flax")
    names = sorted(p.name for p in (tmp_path / "torch").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "flax").iterdir()) and "model.safetensors" in names
    for name in names:
        assert (tmp_path / "flax" / name).read_bytes() == (tmp_path / "torch" / name).read_bytes(), name


def test_a_qat_models_weighted_forward_under_jit_is_numpys_search_and_compiles_as_loops():
    # Qwix runs the product with jit disabled, where lax loops unroll: the weighted search's loops
    # over trials and elements compiled for minutes. Now it compiles as loops, in seconds.
    import time

    from mixle.lm.flax_causal_lm import CausalLM, CausalLMConfig

    config = CausalLMConfig.from_dict({"model_type": "llama", "vocab_size": 16, "hidden_size": 32,
                                       "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                                       "tie_word_embeddings": True})
    quantized, reference = CausalLM(config, rngs=nnx.Rngs(0)), CausalLM(config, rngs=nnx.Rngs(0))
    down = np.asarray(quantized.layers[0].mlp.down_proj.kernel[...])  # (in 64, out 32)
    importance = np.abs(np.random.default_rng(6).standard_normal(64)).astype(np.float32)
    spec = QuantSpec(grid="q4_0")
    others = ("embed_tokens", *(f"layers.0.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")))
    apply_qat(quantized, spec=spec, exclude=others, importance={"layers.0.mlp.down_proj": importance},
              example_inputs=(jnp.zeros((1, 4), jnp.int32),))
    assert get_qat_report(quantized).wrapped == ["layers.0.mlp.down_proj.kernel"]
    want = quantize_array(down.T.copy(), spec, importance=importance).dequantize().T
    assert not np.array_equal(want, quantize_array(down.T.copy(), spec).dequantize().T)  # the importance matters
    reference.layers[0].mlp.down_proj.kernel[...] = jnp.asarray(want)
    ids = jnp.asarray(np.random.default_rng(7).integers(0, 16, (2, 8)), jnp.int32)
    graphdef, state = nnx.split(quantized)
    began = time.perf_counter()
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids)).lower(state, ids).compile()
    assert time.perf_counter() - began < 30  # unrolled: minutes on 2 CPU cores
    plain_graphdef, plain_state = nnx.split(reference)
    plain = jax.jit(lambda state, ids: nnx.merge(plain_graphdef, state)(ids))
    np.testing.assert_array_equal(np.asarray(forward(state, ids)), np.asarray(plain(plain_state, ids)))


def test_importance_weighted_qat_from_flax_writes_the_torch_file(tmp_path):
    pytest.importorskip("gguf")
    from mixle.gguf.writer import save_gguf

    torch_model, flax_model = _twins(_checkpoint(tmp_path, tied=False))
    rng = np.random.default_rng(4)
    # Weighted: an attention and an MLP kernel (rows of 256 and of 512) and the head (outside
    # "model."); the other kernels keep the plain search, so each importance must reach its own path.
    paths = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "lm_head"]
    assert all(isinstance(torch_model.get_submodule(path), torch.nn.Linear) for path in paths)
    importance = {path: np.abs(rng.standard_normal(torch_model.get_submodule(path).in_features)).astype(np.float32)
                  for path in paths}
    apply_qat(torch_model, grid="q4_k", importance=importance)
    flax_importance = {path.removeprefix("model."): values for path, values in importance.items()}
    apply_qat(flax_model, grid="q4_k", importance=flax_importance, example_inputs=IDS)
    (tmp_path / "torch").mkdir(), (tmp_path / "flax").mkdir()
    save_gguf(torch_model, tmp_path / "torch" / "m.gguf")
    save_gguf(flax_model, tmp_path / "flax" / "m.gguf")
    assert (tmp_path / "flax" / "m.gguf").read_bytes() == (tmp_path / "torch" / "m.gguf").read_bytes()
    unweighted = tmp_path / "plain"
    unweighted.mkdir()
    save_gguf(apply_qat(_twins(tmp_path / "ckpt")[0], grid="q4_k"), unweighted / "m.gguf")
    assert unweighted.joinpath("m.gguf").read_bytes() != (tmp_path / "torch" / "m.gguf").read_bytes()
    (tmp_path / "converted").mkdir()
    save_gguf(convert(flax_model), tmp_path / "converted" / "m.gguf")  # convert keeps the weighted codes
    assert (tmp_path / "converted" / "m.gguf").read_bytes() == (tmp_path / "torch" / "m.gguf").read_bytes()


def test_apply_qat_checks_every_kernels_importance_though_it_traces_one_search_per_shape():
    # apply_qat's probe traces the weighted search once for kernels alike (the second layer's is
    # not traced again); the second layer's importance is still checked, and a refusal leaves
    # the model as it was.
    from mixle.flax_backend.qat import qat_state
    from mixle.lm.flax_causal_lm import CausalLM, CausalLMConfig

    config = CausalLMConfig.from_dict({"model_type": "llama", "vocab_size": 16, "hidden_size": 32,
                                       "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2})
    model = CausalLM(config, rngs=nnx.Rngs(0))
    good = np.abs(np.random.default_rng(1).standard_normal(64)).astype(np.float32)
    negative = good.copy()
    negative[5] = -1.0
    before = type(model.layers[1].mlp.down_proj)
    for second, message in ((negative, "importance[5] = -1.0"), (good[:63], "importance has shape (63,)")):
        importance = {"layers.0.mlp.down_proj": good, "layers.1.mlp.down_proj": second}
        with pytest.raises(ValueError) as raised:
            apply_qat(model, grid="q4_0", patterns=(r".*down_proj",), importance=importance,
                      example_inputs=(jnp.zeros((1, 4), jnp.int32),))
        assert "layers.1.mlp.down_proj" in str(raised.value) and message in str(raised.value)
        assert type(model.layers[1].mlp.down_proj) is before and qat_state(model) is None
    importance["layers.1.mlp.down_proj"] = good[::-1].copy()
    reference = nnx.clone(model)
    apply_qat(model, grid="q4_0", patterns=(r".*down_proj",), importance=importance,
              example_inputs=(jnp.zeros((1, 4), jnp.int32),))
    for layer in (0, 1):  # outside the probe, each kernel is searched with its own importance
        kernel = np.asarray(reference.layers[layer].mlp.down_proj.kernel[...])
        values = importance[f"layers.{layer}.mlp.down_proj"]
        stored = quantize_array(kernel.T.copy(), QuantSpec(grid="q4_0"), importance=values).dequantize().T
        reference.layers[layer].mlp.down_proj.kernel[...] = jnp.asarray(stored)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 16, (2, 8)), jnp.int32)
    forward = nnx.jit(lambda model: model(ids))  # both compiled: XLA fuses both alike
    np.testing.assert_array_equal(np.asarray(forward(model)), np.asarray(forward(reference)))
