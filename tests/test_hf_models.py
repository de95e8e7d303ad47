"""Real transformers and PEFT models (tiny random-init configs, no downloads): every weight a user
expects quantized is, the report accounts for the rest, and toggle, convert, save/load and PEFT's
merge stay exact."""

import copy
import warnings

import numpy as np
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

from mixle.api import (apply_qat, convert, get_qat_report, load_quantized, save_quantized,  # noqa: E402
                       set_fake_quant_enabled)
from tests.test_numerics import reference_codes_scales  # noqa: E402


# Converted layers run the exact dequantize-then-matmul path here (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("exact_converted_layers")

warnings.filterwarnings("ignore", module="transformers")

VOCAB = 64
SPEC = dict(bits=4, group_size=16)


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def llama(tied):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg)


def qwen2():
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    return transformers.Qwen2ForCausalLM(cfg)


def qwen3():
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=32, tie_word_embeddings=True)
    return transformers.Qwen3ForCausalLM(cfg)


def bert():
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=3)
    return transformers.BertForSequenceClassification(cfg)


MODELS = {"gpt2": gpt2, "llama_tied": lambda: llama(True), "llama_untied": lambda: llama(False),
          "qwen2": qwen2, "qwen3": qwen3, "bert": bert}


def build(name, seed=0):
    torch.manual_seed(seed)
    return MODELS[name]().eval()


def tokens(seed=1):
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def out(model, x):
    result = model(x)
    return result.logits


def expected_share(model):
    """(quantized, all) elements over the model's distinct float parameters with >= 2 dims, a
    parameter counting as quantized when a QAT layer holds it as its weight (independent of the report)."""
    qat_weights = {id(m.weight) for m in model.modules() if hasattr(m, "spec") and hasattr(m, "enabled")}
    params = {id(p): p for p in model.parameters() if p.is_floating_point() and p.dim() >= 2}
    done = sum(p.numel() for key, p in params.items() if key in qat_weights)
    return done, sum(p.numel() for p in params.values())


# Elements left float by default: position/segment embeddings and untied token tables (opt-in).
FLOAT_BY_DEFAULT = {
    "gpt2": ["transformer.wpe"],
    "llama_tied": [],
    "llama_untied": ["model.embed_tokens"],
    "qwen2": ["model.embed_tokens"],
    "qwen3": [],  # tied: the table follows lm_head
    "bert": ["bert.embeddings.word_embeddings", "bert.embeddings.position_embeddings",
             "bert.embeddings.token_type_embeddings"],
}


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_share_toggle_convert_and_save_load(name, tmp_path):
    float_model = build(name)
    x = tokens()
    expected_float = out(float_model, x)
    model = apply_qat(copy.deepcopy(float_model), **SPEC)
    report = get_qat_report(model)

    # Every float weight is in the report; the share is the independent count's.
    done, total = report.weight_share
    assert (done, total) == expected_share(model) and total > 0
    left = {d.path for d in report.decisions if d.action == "skipped"}
    assert left == set(FLOAT_BY_DEFAULT[name])
    modules = dict(float_model.named_modules())
    assert total - done == sum(modules[p].weight.numel() for p in left)
    assert "0 left in float" not in str(report) or not left
    print(f"\n{name}: {done / total:.1%} of {total} weight elements quantized")

    fake = out(model, x)
    assert not torch.equal(fake, expected_float)
    set_fake_quant_enabled(model, False)
    assert torch.equal(out(model, x), expected_float)  # toggle off: the float model, bit for bit
    set_fake_quant_enabled(model, True)

    converted = convert(model)
    assert torch.equal(out(converted, x), fake)  # same dequantized weights, same ops
    path = tmp_path / f"{name}.safetensors"
    save_quantized(converted, path)
    loaded = load_quantized(path, build(name, seed=9))
    assert torch.equal(out(loaded, x), fake)


@pytest.mark.parametrize("name", ["llama_untied", "qwen2", "bert"])
def test_untied_embeddings_opt_in_per_row(name, tmp_path):
    float_model = build(name)
    model = apply_qat(copy.deepcopy(float_model), opt_in=("embedding",), **SPEC)
    report = get_qat_report(model)
    assert report.weight_share[0] == report.weight_share[1]  # nothing left float
    apply_qat(model, **SPEC)  # applying again without opt_in keeps the opted-in tables
    assert {d.action for d in get_qat_report(model).decisions} == {"unchanged"}
    table = next(m for p, m in model.named_modules() if p == FLOAT_BY_DEFAULT[name][0])
    w = table.weight.detach().numpy()
    rows = torch.tensor([[3, 0, 63]])
    # lookups return the per-row fake-quantized table (numpy reference, groups of 16 per row)
    np.testing.assert_array_equal(table(rows).detach().numpy(),
                                  reference_codes_scales(w, 4, "group", 16)[2][rows.numpy()])
    x = tokens()
    fake = out(model, x)
    converted = convert(model)
    assert torch.equal(out(converted, x), fake)
    save_quantized(converted, tmp_path / "m.safetensors")
    assert torch.equal(out(load_quantized(tmp_path / "m.safetensors", build(name, seed=3)), x), fake)


def test_a_pattern_naming_an_embedding_or_conv1d_selects_it():
    model = apply_qat(build("llama_untied"), patterns=(r".*embed_tokens",), **SPEC)
    assert get_qat_report(model).wrapped == ["model.embed_tokens"]
    model = apply_qat(build("gpt2"), patterns=(r".*c_attn",), **SPEC)
    assert get_qat_report(model).wrapped == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]
    with pytest.raises(ValueError, match="matches no nn.Linear, Conv1D, nn.MultiheadAttention, nn.Embedding or nn.Conv1d/2d"):
        apply_qat(build("gpt2"), patterns=(r".*c_atn",))
    with pytest.raises(ValueError, match=r"opt_in=\('conv2d',\) names \['conv2d'\].*choose from \['conv', 'embedding', 'router'\]"):
        apply_qat(build("gpt2"), opt_in=("conv2d",))


def test_conv1d_is_quantized_per_output_column_and_shares_its_parameters():
    torch.manual_seed(0)
    conv = Conv1D(48, 32)  # weight (in=32, out=48)
    net = nn.Sequential(conv)
    model = apply_qat(net, bits=4, group_size=8)
    layer = model[0]
    assert isinstance(layer, Conv1D) and layer.weight is conv.weight and layer.bias is conv.bias
    assert list(model.state_dict()) == ["0.weight", "0.bias"]
    w = conv.weight.detach().numpy()
    expected = reference_codes_scales(np.ascontiguousarray(w.T), 4, "group", 8)[2].T  # groups along inputs
    np.testing.assert_array_equal(layer.quantized_weight().t().detach().numpy(), expected)
    x = torch.randn(3, 5, 32)
    torch.testing.assert_close(layer(x), x @ torch.from_numpy(expected) + conv.bias, rtol=0, atol=1e-5)
    # The straight-through gradient reaches the shared Parameter: it is the gradient w.r.t. a leaf
    # holding the fake-quantized weight, here laid out (out, in) and used transposed as the QAT
    # forward does, so the reference runs the same ops in the same order: equal bit for bit.
    upstream = torch.randn(3, 5, 48)
    (layer(x) * upstream).sum().backward()
    leaf = torch.from_numpy(np.ascontiguousarray(expected.T)).requires_grad_()
    bias = conv.bias.detach().clone().requires_grad_()
    (torch.addmm(bias, x.view(-1, 32), leaf.t()).view(3, 5, 48) * upstream).sum().backward()
    assert torch.equal(conv.weight.grad, leaf.grad.t()) and torch.equal(conv.bias.grad, bias.grad)
    assert conv.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------- PEFT

peft = pytest.importorskip("peft")


def lora_config(name="llama_untied"):
    if name == "gpt2":  # Conv1D targets: PEFT merges the transposed delta into weight.data
        return peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True,
                               init_lora_weights=False)
    return peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def test_peft_either_order_quantizes_base_layers_never_adapters():
    x = tokens()
    first = apply_qat(peft.get_peft_model(build("llama_untied"), lora_config()), **SPEC)
    second = peft.get_peft_model(apply_qat(build("llama_untied"), **SPEC), lora_config())
    second = apply_qat(second, **SPEC)  # again on the PeftModel: base layers unchanged, adapters left alone
    torch.manual_seed(5)
    for model in (first, second):
        report = get_qat_report(model)
        adapters = [d for d in report.decisions if "lora_" in d.path]
        assert len(adapters) == 8 and all(d.action == "skipped" and d.reason.startswith("adapter") for d in adapters)
        assert not any(hasattr(m, "spec") for p, m in model.named_modules() if "lora_" in p)
        q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
        assert q_proj.base_layer.spec.group_size == 16
    s1, s2 = first.state_dict(), second.state_dict()
    assert list(s1) == list(s2) and all(torch.equal(s1[k], s2[k]) for k in s1)
    assert torch.equal(out(first, x), out(second, x))


@pytest.mark.parametrize("name", ["llama_untied", "gpt2"])
def test_peft_merge_and_unload_matches_a_fresh_qat_model_in_process_and_after_convert(name):
    x = tokens()
    model = peft.get_peft_model(apply_qat(build(name), **SPEC), lora_config(name))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for step in range(2):
        loss = model(tokens(seed=step), labels=tokens(seed=step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    before_merge = out(model, x)  # an eval forward: the cache holds this version of every weight
    out(model, x)
    merged = model.merge_and_unload()  # edits weight.data in place, behind the version counter
    in_process = out(merged, x)
    fresh = apply_qat(copy.deepcopy(merged), reconfigure=True, **SPEC)
    fresh_out = out(fresh, x)
    # The merged base is re-quantized: the output moves off the adapter-on-fake-quant-base output
    # by far more than float rounding (a few K * eps of the logits, K <= 64 the longest sum) could
    # move it, and lands exactly on a fresh QAT model of the merged weights (same weights, same ops).
    moved = (in_process - before_merge).abs().max()
    assert moved > 100 * 64 * np.finfo(np.float32).eps * before_merge.abs().max()
    assert torch.equal(in_process, fresh_out)
    assert torch.equal(out(convert(merged), x), in_process)


def test_peft_unmerged_convert_keeps_float_adapters_over_int_weights_and_errors_name_the_layer(tmp_path):
    x = tokens()
    model = apply_qat(peft.get_peft_model(build("llama_untied"), lora_config()), **SPEC)
    fake = out(model, x)
    converted = convert(model)
    q_proj = converted.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q_proj.base_layer).__name__ == "QuantizedLinear" and q_proj.lora_A["default"].weight.dtype == torch.float32
    assert torch.equal(out(converted, x), fake)
    save_quantized(converted, tmp_path / "peft.safetensors")
    skeleton = peft.get_peft_model(build("llama_untied", seed=5), lora_config())
    assert torch.equal(out(load_quantized(tmp_path / "peft.safetensors", skeleton), x), fake)
    with pytest.raises(ValueError, match=r"layer '.*q_proj\.base_layer': group_size=64 does not divide"):
        apply_qat(peft.get_peft_model(build("llama_untied"), lora_config()), bits=4, group_size=64)
    dora = apply_qat(peft.get_peft_model(build("llama_untied"), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj"], use_dora=True)), **SPEC)
    with pytest.raises(ValueError, match=r"q_proj' has a PEFT DoRA adapter.*merge_and_unload"):
        convert(dora)
