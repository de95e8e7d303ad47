"""save_gguf for transformers' LlamaForCausalLM / Qwen2ForCausalLM: tensors, rotary row order, metadata."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from mixle.api import apply_qat, convert  # noqa: E402
from mixle.task.quantize import save_gguf  # noqa: E402

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 64, 4, 2, 96, 2, 80


def _model(family, tied, seed=0):
    torch.manual_seed(seed)
    fields = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=32,
                  tie_word_embeddings=tied, rms_norm_eps=1e-5)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**fields))
    with torch.no_grad():  # non-trivial norms and biases, so a misplaced one shows
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def _read(path):
    reader = gguf.GGUFReader(path)
    tensors = {}
    for t in reader.tensors:
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        tensors[t.name] = (t.tensor_type.name, values.reshape(tuple(int(d) for d in reversed(t.shape))))
    return reader, tensors


def _halves_from_pairs(rows, heads):
    """Undo llama.cpp's converter order: a head's row 2i + j came from row j * head_dim / 2 + i."""
    head_dim = rows.shape[0] // heads
    out = np.empty_like(rows)
    for h in range(heads):
        for i in range(head_dim // 2):
            for j in range(2):
                out[h * head_dim + j * head_dim // 2 + i] = rows[h * head_dim + 2 * i + j]
    return out


def _weight(module):
    if not hasattr(module, "spec"):  # left in float (an untied embedding): float_matrices="f32"
        return module.weight.detach().numpy()
    if hasattr(module, "quantized_weight"):
        return module.quantized_weight().detach().numpy()
    if hasattr(module, "dequantized_weight"):
        return module.dequantized_weight().numpy()
    from mixle.torch_backend.fake_quant import fake_quantized_weight

    return fake_quantized_weight(module.weight, module.spec)[0].detach().numpy()


@pytest.mark.parametrize("family, tied", [("llama", True), ("llama", False), ("qwen2", False), ("qwen2", True)])
def test_tensors_are_the_fake_quantized_weights(family, tied, tmp_path):
    model = apply_qat(_model(family, tied), grid="q4_0")
    save_gguf(model, tmp_path / "m.gguf", float_matrices="f32")
    _, got = _read(tmp_path / "m.gguf")
    permute = family == "llama"
    inner = model.model
    want = {"token_embd.weight": _weight(inner.embed_tokens), "output_norm.weight": inner.norm.weight}
    if not tied:
        want["output.weight"] = _weight(model.lm_head)
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        want[f"blk.{i}.attn_norm.weight"] = layer.input_layernorm.weight
        want[f"blk.{i}.ffn_norm.weight"] = layer.post_attention_layernorm.weight
        for attr, name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
            want[f"blk.{i}.{name}.weight"] = _weight(getattr(attn, attr))
            if getattr(attn, attr).bias is not None:
                want[f"blk.{i}.{name}.bias"] = getattr(attn, attr).bias
        for attr, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            want[f"blk.{i}.{name}.weight"] = _weight(getattr(mlp, attr))
    assert set(got) == set(want)
    for name, value in want.items():
        value = value.detach().numpy() if isinstance(value, torch.Tensor) else value
        array = got[name][1]
        if permute and (".attn_q." in name or ".attn_k." in name):
            array = _halves_from_pairs(array, HEADS if ".attn_q." in name else KV_HEADS)
        np.testing.assert_array_equal(array.view(np.uint32), value.astype(np.float32).view(np.uint32), err_msg=name)
        if name.endswith(".weight") and value.ndim == 2:
            assert got[name][0] == ("F32" if name == "token_embd.weight" and not tied else "Q4_0"), name
    assert family == "llama" or "blk.0.attn_q.bias" in got  # qwen2's q/k/v biases


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _llama_logits(t, ids, arch, eps, theta):
    """llama.cpp's llama/qwen2 graph in numpy: rotary on adjacent pairs (llama) or halves (qwen2)."""
    head_dim = HIDDEN // HEADS
    n = len(ids)
    pos = np.arange(n)[:, None]
    freq = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    cos, sin = np.cos(pos * freq)[:, None], np.sin(pos * freq)[:, None]  # (n, 1, head_dim / 2)

    def rope(x):
        if arch == "llama":
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
            return out
        a, b = x[..., : head_dim // 2], x[..., head_dim // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def dense(x, name):
        y = x @ t[name + ".weight"].T
        return y + t[name + ".bias"] if name + ".bias" in t else y

    x = t["token_embd.weight"][ids]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(LAYERS):
        h = _rms(x, t[f"blk.{i}.attn_norm.weight"], eps)
        q = rope(dense(h, f"blk.{i}.attn_q").reshape(n, HEADS, head_dim))
        k = rope(dense(h, f"blk.{i}.attn_k").reshape(n, KV_HEADS, head_dim))
        v = dense(h, f"blk.{i}.attn_v").reshape(n, KV_HEADS, head_dim)
        out = np.empty((n, HEADS, head_dim))
        for head in range(HEADS):
            kv = head // (HEADS // KV_HEADS)
            scores = q[:, head] @ k[:, kv].T / np.sqrt(head_dim) + mask
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, head] = (weights / weights.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + dense(out.reshape(n, -1), f"blk.{i}.attn_output")
        h = _rms(x, t[f"blk.{i}.ffn_norm.weight"], eps)
        gate = dense(h, f"blk.{i}.ffn_gate")
        x = x + dense(gate / (1 + np.exp(-gate)) * dense(h, f"blk.{i}.ffn_up"), f"blk.{i}.ffn_down")
    head = t.get("output.weight", t["token_embd.weight"])
    return _rms(x, t["output_norm.weight"], eps) @ head.T


@pytest.mark.parametrize("family, tied", [("llama", True), ("qwen2", False)])
def test_file_computes_the_qat_forward(family, tied, tmp_path):
    """The rotary row order and head layout are right: llama.cpp's graph on the file gives HF's logits."""
    model = apply_qat(_model(family, tied), grid="q4_0")
    save_gguf(model, tmp_path / "m.gguf", float_matrices="f32")  # an untied embedding stays float
    reader, tensors = _read(tmp_path / "m.gguf")
    fields = {key: reader.fields[key].contents() for key in reader.fields if key.startswith(family + ".")}
    ids = np.array([1, 7, 79, 3, 3, 40, 12, 0, 55])
    with torch.no_grad():
        want = model(torch.from_numpy(ids)[None]).logits[0].numpy()
    t = {name: value.astype(np.float64) for name, (_, value) in tensors.items()}
    got = _llama_logits(t, ids, family, fields[f"{family}.attention.layer_norm_rms_epsilon"],
                        fields[f"{family}.rope.freq_base"])
    # float32 torch vs float64 numpy through 2 layers of width 64-96: rounding ~1e-6 relative.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, np.abs(want).max()))


def test_metadata_llama_cpp_needs_for_llama(tmp_path):
    model = convert(apply_qat(_model("llama", True), bits=8, grid="q8_0"))
    save_gguf(model, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    expected = {"general.architecture": "llama", "llama.context_length": 32, "llama.embedding_length": HIDDEN,
                "llama.block_count": LAYERS, "llama.feed_forward_length": FFN, "llama.attention.head_count": HEADS,
                "llama.attention.head_count_kv": KV_HEADS, "llama.rope.dimension_count": HIDDEN // HEADS,
                "llama.vocab_size": VOCAB, "tokenizer.ggml.model": "gpt2"}
    assert {key: reader.fields[key].contents() for key in expected} == expected
    assert reader.fields["llama.attention.layer_norm_rms_epsilon"].contents() == pytest.approx(1e-5, rel=1e-6)
    assert reader.fields["llama.rope.freq_base"].contents() == 10000.0
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == VOCAB
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} == {"Q8_0"}


def test_scaled_rotary_embedding_is_refused(tmp_path):
    model = _model("llama", True)
    model.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match=r"as llama.cpp's 'llama': its rotary embedding is scaled"):
        save_gguf(model, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_hf_byte_level_bpe_tokenizer_metadata(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"a": 0, "b": 1, "Ġ": 2, "ab": 3, "Ġa": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [("a", "b"), ("Ġ", "a")]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    save_gguf(_model("qwen2", False), tmp_path / "m.gguf", tokenizer=tokenizer)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    tokens = field("tokenizer.ggml.tokens")
    assert tokens[:6] == ["a", "b", "Ġ", "ab", "Ġa", "<eos>"] and tokens[6:] == [f"[PAD{i}]" for i in range(6, VOCAB)]
    assert field("tokenizer.ggml.token_type") == [1] * 5 + [3] + [5] * (VOCAB - 6)  # normal, control, unused
    assert field("tokenizer.ggml.merges") == ["a b", "Ġ a"]
    assert field("tokenizer.ggml.eos_token_id") == 5 and "tokenizer.ggml.bos_token_id" not in reader.fields


def test_non_byte_level_tokenizer_is_refused(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
    with pytest.raises(ValueError, match=r"WordLevel model without GPT-2's byte-level pre-tokenizer.*pass vocab="):
        save_gguf(_model("qwen2", False), tmp_path / "m.gguf", tokenizer=tokenizer)
    assert not (tmp_path / "m.gguf").exists()


def test_load_gguf_weights_puts_the_file_back_into_the_model(tmp_path):
    """The file's weights, llama.cpp's q/k row order undone, give the QAT model's logits."""
    from mixle.task.quantize import load_gguf_weights

    model = apply_qat(_model("llama", False), grid="q4_0")
    save_gguf(model, tmp_path / "m.gguf", float_matrices="f32")
    float_model = _model("llama", False)
    back = load_gguf_weights(float_model, tmp_path / "m.gguf")
    assert not any(hasattr(m, "spec") for m in back.modules()) and back is not float_model
    attn, qat_attn = back.model.layers[1].self_attn, model.model.layers[1].self_attn
    for name in ("q_proj", "k_proj", "o_proj"):
        assert torch.equal(getattr(attn, name).weight, getattr(qat_attn, name).quantized_weight().detach()), name
    ids = torch.tensor([[1, 7, 3, 60, 2, 9]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"model has quantized layers \('model.layers.0.self_attn.q_proj'"):
        load_gguf_weights(model, tmp_path / "m.gguf")
    with pytest.raises(ValueError, match=r"holds llama.cpp's 'llama', but the model is written as 'qwen2'"):
        load_gguf_weights(_model("qwen2", False), tmp_path / "m.gguf")
