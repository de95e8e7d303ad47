"""Fused mixture-of-experts modules of transformers (Qwen3-MoE, Mixtral): QAT per expert, convert,
save/load, the report, selection and LoRA, on tiny random configs (no downloads)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from mixle.api import (apply_lora, apply_qat, convert, get_lora_report, get_qat_report, load_quantized,  # noqa: E402
                       model_nbytes, save_quantized, set_fake_quant_enabled)
from mixle.core.grids import GRIDS  # noqa: E402
from mixle.core.layer_weights import quantize_linear_weight  # noqa: E402
from mixle.core.spec import QuantSpec  # noqa: E402
from mixle.torch_backend.layers.expert_layers import LORA_REASON, stored_arrays  # noqa: E402
from mixle.torch_backend.layers.qat import QATWrapper  # noqa: E402
from tests.test_numerics import reference_codes_scales  # noqa: E402
from tests.test_qat_cache import calls, reset  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("exact_converted_layers")
IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def qwen3_moe(seed=0, hidden=32, inter=32, layers=1, experts=4, impl="grouped_mm"):
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=64, moe_intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=experts, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[])
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    model.set_experts_implementation(impl)
    return model


def mixtral(seed=0):
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config).eval()


def tokens(seed=1):
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))


def linear_path(w, spec):
    """Each expert's matrix fake-quantized as an nn.Linear weight (the QATWrapper path)."""
    rows = []
    for matrix in w.detach():
        linear = nn.Linear(matrix.shape[1], matrix.shape[0], bias=False)
        linear.weight = nn.Parameter(matrix.clone())
        rows.append(QATWrapper(linear, spec).quantized_weight().detach())
    return torch.stack(rows)


def with_weights(model, weights):
    """A float copy of ``model`` whose expert weights hold ``weights`` ({path.name: tensor})."""
    out = copy.deepcopy(model)
    params = dict(out.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    return out


GRID_SPECS = [QuantSpec(bits=4), QuantSpec(bits=8, group_size=16), QuantSpec(bits=4, grid="qwix"),
              QuantSpec(bits=4, clip_percentile=99.0)] + [QuantSpec(grid=g) for g in ("q4_0", "q8_0", "q4_1", "q5_0", "mxfp4", "nf4")]


@pytest.mark.parametrize("spec", GRID_SPECS, ids=lambda s: s.short())
def test_each_expert_gets_the_codes_of_its_matrix_as_a_linear(spec):
    model = qwen3_moe(hidden=64, inter=64)
    experts = model.model.layers[0].mlp.experts
    weights = {n: getattr(experts, n) for n in ("gate_up_proj", "down_proj")}
    qat = apply_qat(model, spec=spec, patterns=[".*experts"])
    layer = qat.model.layers[0].mlp.experts
    arrays = stored_arrays(layer)
    for name, param in weights.items():
        assert layer._parameters[name] is param  # shared, not copied
        assert torch.equal(layer.quantized_weights()[name].detach(), linear_path(param, spec))  # bit for bit
        for e in range(param.shape[0]):
            own = quantize_linear_weight(param.detach()[e], spec)
            assert torch.equal(arrays[name].codes[e], own.codes)
            assert torch.equal(arrays[name].scale[e].reshape(-1), own.scale.reshape(-1))
    if spec.grid == "symmetric" and spec.granularity == "channel" and spec.clip_percentile is None:  # numpy oracle
        w = weights["down_proj"].detach().numpy()
        expected = np.stack([reference_codes_scales(m, 4, "channel", None)[2] for m in w])
        np.testing.assert_array_equal(layer.quantized_weights()["down_proj"].detach().numpy(), expected)


@pytest.mark.parametrize("grid", ["q4_k", "q6_k"])
def test_k_quants_per_expert_as_a_linear(grid):
    config = transformers.Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=256, num_experts=2)
    experts = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
    nn.init.normal_(experts.gate_up_proj, std=0.02)
    nn.init.normal_(experts.down_proj, std=0.02)
    holder = nn.ModuleDict({"experts": experts})
    layer = apply_qat(holder, spec=QuantSpec(grid=grid))["experts"]
    spec = layer.spec
    for name, fake in layer.quantized_weights().items():
        assert torch.equal(fake.detach(), linear_path(getattr(experts, name), spec))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_forward_is_the_float_forward_on_the_fake_quantized_weights_and_toggles_exactly(impl):
    float_model = qwen3_moe(impl=impl)
    keys = list(float_model.state_dict())
    model = apply_qat(copy.deepcopy(float_model), bits=4, group_size=16)
    assert list(model.state_dict()) == keys
    x = tokens()
    layer = model.model.layers[0].mlp.experts
    fake = {f"model.layers.0.mlp.experts.{n}": w.detach() for n, w in layer.quantized_weights().items()}
    others = {n: m.quantized_weight().detach() for n, m in model.named_modules() if isinstance(m, QATWrapper)}
    reference = with_weights(float_model, fake | {f"{n}.weight": w for n, w in others.items()})
    assert torch.equal(model(x).logits, reference(x).logits)
    set_fake_quant_enabled(model, False)
    assert torch.equal(model(x).logits, float_model(x).logits)


def test_straight_through_gradients_equal_the_reference_model_s():
    float_model = qwen3_moe(impl="eager")
    model = apply_qat(copy.deepcopy(float_model), bits=4, patterns=[".*experts"])
    layer = model.model.layers[0].mlp.experts
    fake = {f"model.layers.0.mlp.experts.{n}": w.detach() for n, w in layer.quantized_weights().items()}
    reference = with_weights(float_model, fake)
    x = tokens()
    model(x).logits.square().mean().backward()
    reference(x).logits.square().mean().backward()
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(layer, name).grad, getattr(reference.model.layers[0].mlp.experts, name).grad)


def test_experts_quantized_once_per_step_across_micro_batches(calls):  # noqa: F811
    model = apply_qat(qwen3_moe(), bits=4, patterns=[".*experts"]).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes = sorted(p.numel() for n, p in model.named_parameters() if "experts" in n)
    for step in range(2):
        reset(calls)
        for seed in range(3):
            model(tokens(seed)).logits.square().mean().backward()
        if step:  # one reduction per expert weight and step
            assert sorted(calls["stats"]) == sizes
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("make, spec", [(qwen3_moe, QuantSpec(bits=4)), (qwen3_moe, QuantSpec(grid="q4_0")),
                                        (mixtral, QuantSpec(grid="q4_1")), (mixtral, QuantSpec(bits=8, group_size=16))],
                         ids=["qwen3_moe-int4", "qwen3_moe-q4_0", "mixtral-q4_1", "mixtral-int8-group16"])
def test_convert_equals_fake_quant_and_saves_and_loads(make, spec, tmp_path):
    model = apply_qat(make(), spec=spec, patterns=[".*experts", ".*gate"] if make is qwen3_moe else [".*experts"])
    x = tokens()
    fake = model(x).logits
    converted = convert(model)
    experts = converted.model.layers[0].mlp.experts
    assert type(experts).__name__.startswith("Quantized")
    assert torch.equal(converted(x).logits, fake)
    held, trained = stored_arrays(experts), stored_arrays(model.model.layers[0].mlp.experts)
    for name in held:
        assert torch.equal(held[name].codes, trained[name].codes) and torch.equal(held[name].scale, trained[name].scale)
    router = make is qwen3_moe
    counted = sum(p.numel() for n, p in model.named_parameters() if "experts" in n or (router and n.endswith("mlp.gate.weight")))
    nbytes = model_nbytes(converted)
    assert (nbytes.int4_code_bytes if spec.bits == 4 else nbytes.int8_code_bytes) == counted * spec.bits // 8
    path = tmp_path / "moe.safetensors"
    manifest = save_quantized(converted, path)
    assert {e["kind"] for e in manifest["layers"]} >= {"experts"}
    loaded = load_quantized(path, make(seed=7))
    assert torch.equal(loaded(x).logits, fake)
    assert model_nbytes(loaded) == nbytes


def test_report_experts_quantized_router_float_with_the_reason():
    model = qwen3_moe(layers=2)
    total = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    floats = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and ("mlp.gate" in n or "embed" in n))
    experts = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
    report = get_qat_report(apply_qat(model, bits=4))
    assert {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"} <= set(report.wrapped)
    for layer in range(2):
        decision = report[f"model.layers.{layer}.mlp.gate"]
        assert decision.action == "skipped" and decision.kind == "Qwen3MoeTopKRouter"
        assert decision.reason == "router stays float by default; opt in with opt_in=('router',)"
    assert report[f"model.layers.0.mlp.experts"].elements == experts // 2
    assert report.weight_share == (total - floats, total)
    assert experts / total > 0.5


def test_router_opt_in_is_quantized_as_a_linear():
    model = qwen3_moe()
    router = model.model.layers[0].mlp.gate
    qat = apply_qat(model, spec=QuantSpec(bits=4), opt_in=("router",))
    assert get_qat_report(qat).wrapped.count("model.layers.0.mlp.gate") == 1
    layer = qat.model.layers[0].mlp.gate
    assert layer._parameters["weight"] is router.weight
    assert torch.equal(layer.quantized_weights()["weight"].detach(), linear_path(router.weight[None], layer.spec)[0])


def test_a_single_expert_or_per_tensor_scales_cannot_be_honoured():
    model = qwen3_moe()
    with pytest.raises(ValueError, match=r"patterns entry 'model.layers.0.mlp.experts.3' cannot be honoured: it names "
                                         r"expert 3, but the experts of 'model.layers.0.mlp.experts' are one fused"):
        apply_qat(model, bits=4, patterns=["model.layers.0.mlp.experts.3"])
    with pytest.raises(ValueError, match=r"exclude entry '.*' cannot be honoured: it names expert 1"):
        apply_qat(model, bits=4, exclude=[r".*experts\.1"])
    with pytest.raises(ValueError, match="granularity='tensor' on fused experts"):
        apply_qat(model, bits=4, granularity="tensor", patterns=[".*experts"])
    assert type(model.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"  # unchanged


def test_lora_refuses_the_experts_with_the_reason():
    model = apply_lora(qwen3_moe(), rank=2, alpha=2)
    report = get_lora_report(model)
    assert report["model.layers.0.mlp.experts"].reason == LORA_REASON
    assert "model.layers.0.self_attn.q_proj" in report.wrapped
    with pytest.raises(ValueError, match="fused experts"):
        apply_lora(qwen3_moe(), rank=2, alpha=2, patterns=[".*experts"])


def test_compiled_qat_experts_give_the_eager_output_and_gradient():
    layer = apply_qat(qwen3_moe(), bits=4, group_size=16, patterns=[".*experts"]).model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(3)
    h, index, weights = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16, 2), generator=g), torch.rand(16, 2)
    eager = layer(h, index, weights)
    eager.sum().backward()
    grad, layer.gate_up_proj.grad = layer.gate_up_proj.grad, None
    compiled = torch.compile(layer, fullgraph=True)(h, index, weights)
    compiled.sum().backward()
    assert torch.equal(compiled, eager)
    torch.testing.assert_close(layer.gate_up_proj.grad, grad, rtol=1e-5, atol=1e-7)  # the compiled sums' order


# ------------------------------------------------------------------------------- act_bits


def q8_0_round_trip(x):
    """gguf-py's Q8_0 quantize-dequantize of each token (ggml's reference activation blocks)."""
    gguf = pytest.importorskip("gguf")
    kind = gguf.GGMLQuantizationType.Q8_0
    a = np.ascontiguousarray(x.detach().numpy())
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, kind), kind).reshape(a.shape))


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("grid", ["q4_0", "q8_0"])
def test_act_bits_quantize_each_expert_product_input_as_llama_cpp_s_q8_0(impl, grid):
    """Both inputs of every expert's products (the hidden states; act_fn(gate) * up) and the
    router's as Q8_0 blocks: bit for bit the float forward on the fake-quantized weights fed
    gguf-py's Q8_0 round trips."""
    model = qwen3_moe(hidden=64, inter=64, impl=impl)
    spec = QuantSpec(grid=grid, bits=4 if grid == "q4_0" else 8, act_bits=8)
    qat = apply_qat(copy.deepcopy(model), spec=spec, patterns=[".*experts", ".*gate"])
    layer, router = qat.model.layers[0].mlp.experts, qat.model.layers[0].mlp.gate
    reference = copy.deepcopy(model.model.layers[0].mlp.experts)
    with torch.no_grad():
        for name, fake in layer.quantized_weights().items():
            getattr(reference, name).copy_(fake)
    gate = type(reference)._apply_gate
    reference._apply_gate = lambda out: q8_0_round_trip(gate(reference, out))
    g = torch.Generator().manual_seed(5)
    h, index, weights = torch.randn(16, 64, generator=g), torch.randint(0, 4, (16, 2), generator=g), torch.rand(16, 2)
    with torch.no_grad():
        assert torch.equal(layer(h, index, weights), reference(q8_0_round_trip(h), index, weights))
        assert not torch.equal(layer(h, index, weights), reference(h, index, weights))  # the inputs do move
        logits = router(h)[0]
        assert torch.equal(logits, F.linear(q8_0_round_trip(h), router.quantized_weights()["weight"]))


def test_act_bits_convert_save_load_equal_the_fake_quant_forward(tmp_path):
    spec = QuantSpec(grid="q4_0", act_bits=8)
    model = apply_qat(qwen3_moe(), spec=spec, patterns=[".*experts"])
    x = tokens()
    fake = model(x).logits
    converted = convert(model)
    assert torch.equal(converted(x).logits, fake)
    save_quantized(converted, tmp_path / "moe.safetensors")
    loaded = load_quantized(tmp_path / "moe.safetensors", qwen3_moe(seed=7))
    assert loaded.model.layers[0].mlp.experts.spec.act_bits == 8
    assert torch.equal(loaded(x).logits, fake)
    set_fake_quant_enabled(model, False)
    assert not torch.equal(model(x).logits, fake)


def test_act_bits_on_the_eager_expert_loop_are_refused_with_the_reason():
    model = qwen3_moe(impl="eager")
    with pytest.raises(ValueError, match=r"act_bits=8 on a Qwen3MoeExperts run by experts implementation 'eager': "
                                         r"transformers' eager expert loop computes act_fn\(gate\) \* up inline"):
        apply_qat(model, grid="q4_0", act_bits=8, patterns=[".*experts"])
    assert type(model.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"  # unchanged
    qat = apply_qat(qwen3_moe(), grid="q4_0", act_bits=8, patterns=[".*experts"])
    qat.set_experts_implementation("eager")
    with pytest.raises(ValueError, match=r"layer 'model.layers.0.mlp.experts': act_bits=8 on a Qwen3MoeExperts"):
        qat(tokens())


def test_options_the_experts_cannot_honour_are_refused_in_english():
    with pytest.raises(ValueError, match=r"experts': an experts QAT layer fake-quantizes its weight only, so it "
                                         r"cannot honour scale='learned'"):
        apply_qat(qwen3_moe(), bits=4, scale="learned", patterns=[".*experts"])
