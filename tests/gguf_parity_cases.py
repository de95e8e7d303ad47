"""The small models whose GGUF files llama.cpp ran for the committed parity fixtures.

Shared by ``benchmarks/make_llama_cpp_fixtures.py`` (runs llama.cpp, writes the fixtures) and
``tests/test_gguf_parity_fixtures.py`` (CI: today's ``save_gguf`` must write the same tensors, and
mixle's forward must still match llama.cpp's stored logits). Every model is built from a fixed
seed on the CPU, so each run makes the same weights.
"""

import hashlib

import numpy as np
import torch

# Token ids fed to both runtimes (all below the smallest vocabulary).
IDS = [5, 17, 3, 3, 40, 12, 0, 29, 8, 33, 2, 1]
FIXTURE = "tests/fixtures/llama_cpp_parity.npz"


def gpt2_model(activation, grid=None):
    import mixle

    torch.manual_seed(0)
    lm = mixle.build_causal_lm(vocab=48, d_model=64, n_layer=2, n_head=2, block=16, activation=activation)
    if grid is not None:
        # act_bits=8: activations as the Q8_0 blocks ggml's CPU path makes of each product's input.
        lm = mixle.apply_qat(lm, bits=4 if grid == "q4_0" else 8, grid=grid, act_bits=8)
    return lm.eval()


def hf_model(family):
    import transformers

    torch.manual_seed(0)
    fields = dict(vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=16, rms_norm_eps=1e-5)
    config = (transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config)(**fields)
    model = (transformers.LlamaForCausalLM if family == "llama" else transformers.Qwen2ForCausalLM)(config).eval()
    with torch.no_grad():  # sharp attention, so a wrong rotary layout shows in the logits
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model


def moe_model(family):
    """A tiny random Qwen3-MoE or Mixtral: hidden 64, 2 layers, 4 experts, top-2, untied head."""
    import transformers

    torch.manual_seed(0)
    fields = dict(vocab_size=48, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=16, tie_word_embeddings=False)
    if family == "qwen3moe":
        config = transformers.Qwen3MoeConfig(**fields, intermediate_size=96, moe_intermediate_size=64, head_dim=16,
                                             num_experts=4, norm_topk_prob=True, rms_norm_eps=1e-6)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(**fields, intermediate_size=64, num_local_experts=4, rms_norm_eps=1e-5)
        model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():  # sharp attention and routing, and logits of a few units
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
            layer.mlp.gate.weight.normal_(0.0, 0.5)
        model.lm_head.weight.mul_(8)
    return model.eval()


def moe_arrays(model, grid, head="q8_0"):
    """``save_gguf``'s ``quantized=`` for a MoE model: attention and experts on ``grid``, the token
    embedding on ``q8_0`` and the head on ``head`` (keys: module paths, and the expert parameters')."""
    from mixle.core.layer_weights import quantize_linear_weight

    arrays = {"model.embed_tokens": quantize_linear_weight(model.model.embed_tokens.weight.detach(), grid="q8_0"),
              "lm_head": quantize_linear_weight(model.lm_head.weight.detach(), grid=head)}
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}"
        for attr in ("q_proj", "k_proj", "v_proj", "o_proj"):
            weight = getattr(layer.self_attn, attr).weight.detach()
            arrays[f"{prefix}.self_attn.{attr}"] = quantize_linear_weight(weight, grid=grid)
        for attr in ("gate_up_proj", "down_proj"):
            weight = getattr(layer.mlp.experts, attr).detach()
            arrays[f"{prefix}.mlp.experts.{attr}"] = quantize_linear_weight(weight, grid=grid, batch_axis_count=1)
    return arrays


def _q8_experts_forward(experts, spec):
    """The experts' forward with the inputs of both products as ggml's Q8_0 blocks (llama.cpp's CPU path)."""
    from mixle.torch_backend.layers.activations import fake_quant_activations

    def forward(hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for expert in range(experts.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == expert)
            if len(token):
                x = fake_quant_activations(hidden[token], spec)
                gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[expert]).chunk(2, dim=-1)
                inner = fake_quant_activations(torch.nn.functional.silu(gate) * up, spec)
                down = torch.nn.functional.linear(inner, experts.down_proj[expert])
                out.index_add_(0, token, down * top_k_weights[token, slot, None])
        return out

    return forward


def moe_reference(model, arrays):
    """A copy of ``model`` computing what llama.cpp computes with ``arrays``: every given weight
    replaced by its dequantized values, and the input of each of their products as Q8_0 blocks
    (``act_bits=8``, as the dense tests); the router (F32 in the file) and norms stay float."""
    import copy

    from mixle.core.spec import QuantSpec
    from mixle.torch_backend.layers.activations import fake_quant_activations

    spec = QuantSpec(bits=8, grid="q8_0", act_bits=8)
    out = copy.deepcopy(model)
    modules = dict(out.named_modules())
    with torch.no_grad():
        for path, array in arrays.items():
            owner, _, attr = path.rpartition(".")
            target = getattr(modules[owner], attr) if attr.endswith("_proj") and owner.endswith("experts") else \
                modules[path].weight
            target.copy_(torch.as_tensor(array.dequantize()))
            if isinstance(modules.get(path), torch.nn.Linear) or path.endswith("mlp.gate"):
                modules[path].register_forward_pre_hook(lambda _, args: (fake_quant_activations(args[0], spec),))
    for path, module in modules.items():
        if path.endswith("mlp.experts"):
            module.forward = _q8_experts_forward(module, spec)
    return out


def moe_logits(family, grid):
    """``(model, arrays, reference logits of IDS)`` of a MoE case (``grid`` None: float)."""
    model = moe_model(family)
    arrays = {} if grid is None else moe_arrays(model, grid)
    return model, arrays, hf_logits(moe_reference(model, arrays) if arrays else model)


def gpt2_logits(lm):
    with torch.no_grad():
        return lm(torch.tensor([IDS]), all_positions=True)[0].numpy()


def hf_logits(model):
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].numpy()


def _moe_case(family, grid):
    """A MoE case: attention and experts on ``grid`` given through ``quantized=``; the reference
    forward quantizes the inputs of those products to Q8_0 as llama.cpp's CPU path does."""
    return (lambda: moe_model(family), lambda model: {"quantized": moe_arrays(model, grid)},
            lambda model: hf_logits(moe_reference(model, moe_arrays(model, grid))), ("transformers",))


# name -> (build the model, its save_gguf keywords (or a function of the model giving them), mixle's
# logits of IDS, packages it needs)
CASES = {
    "gpt2_f32": (lambda: gpt2_model("gelu_tanh"), {"float_matrices": "f32"}, gpt2_logits, ()),
    "gpt2_q4_0_act8": (lambda: gpt2_model("gelu_tanh_f16", "q4_0"), {}, gpt2_logits, ()),
    "gpt2_q8_0_act8": (lambda: gpt2_model("gelu_tanh_f16", "q8_0"), {}, gpt2_logits, ()),
    "llama_f32": (lambda: hf_model("llama"), {"float_matrices": "f32"}, hf_logits, ("transformers",)),
    "qwen2_f32": (lambda: hf_model("qwen2"), {"float_matrices": "f32"}, hf_logits, ("transformers",)),
    "qwen3moe_f32": (lambda: moe_model("qwen3moe"), {"float_matrices": "f32"}, hf_logits, ("transformers",)),
    "qwen3moe_q4_0_act8": _moe_case("qwen3moe", "q4_0"),
    "mixtral_q4_0_act8": _moe_case("mixtral", "q4_0"),
    "mixtral_q8_0_act8": _moe_case("mixtral", "q8_0"),
}


def save_options(options, model):
    """A case's ``save_gguf`` keywords for its built ``model``."""
    return options(model) if callable(options) else options


def tensor_digests(path):
    """{tensor name: (ggml type name, shape, sha256 of its bytes)} of a GGUF file, read with gguf-py."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, [int(n) for n in t.shape], hashlib.sha256(np.asarray(t.data).tobytes()).hexdigest())
            for t in reader.tensors}
