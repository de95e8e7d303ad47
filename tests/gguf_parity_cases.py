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


def gpt2_logits(lm):
    with torch.no_grad():
        return lm(torch.tensor([IDS]), all_positions=True)[0].numpy()


def hf_logits(model):
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].numpy()


# name -> (build the model, its save_gguf keywords, mixle's logits of IDS, packages it needs)
CASES = {
    "gpt2_f32": (lambda: gpt2_model("gelu_tanh"), {"float_matrices": "f32"}, gpt2_logits, ()),
    "gpt2_q4_0_act8": (lambda: gpt2_model("gelu_tanh_f16", "q4_0"), {}, gpt2_logits, ()),
    "gpt2_q8_0_act8": (lambda: gpt2_model("gelu_tanh_f16", "q8_0"), {}, gpt2_logits, ()),
    "llama_f32": (lambda: hf_model("llama"), {"float_matrices": "f32"}, hf_logits, ("transformers",)),
    "qwen2_f32": (lambda: hf_model("qwen2"), {"float_matrices": "f32"}, hf_logits, ("transformers",)),
}


def tensor_digests(path):
    """{tensor name: (ggml type name, shape, sha256 of its bytes)} of a GGUF file, read with gguf-py."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, [int(n) for n in t.shape], hashlib.sha256(np.asarray(t.data).tobytes()).hexdigest())
            for t in reader.tensors}
