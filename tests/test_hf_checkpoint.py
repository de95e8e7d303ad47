"""``save_pretrained_float``: a QAT model's float master weights as a plain transformers checkpoint."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import mixle  # noqa: E402
from mixle.exports.hf_checkpoint import save_pretrained_float  # noqa: E402


def tiny_llama(tied=True, seed=0, vocab=48):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(config)


def stored(directory):
    """The checkpoint's tensors as safetensors reads them (numpy), independently of transformers."""
    from safetensors.numpy import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


@pytest.mark.parametrize("tied", [True, False])
def test_the_checkpoint_holds_the_master_weights_bit_for_bit(tied, tmp_path):
    model = tiny_llama(tied)
    qat = mixle.apply_qat(model, grid="q4_0", bits=4, opt_in=("embedding",) if not tied else ())
    with torch.no_grad():  # a trained state: weights off their initial values
        for param in qat.parameters():
            param.add_(0.01 * torch.randn_like(param))
    info = save_pretrained_float(qat, tmp_path / "hf")
    tensors = stored(tmp_path / "hf")
    state = {k: v.numpy() for k, v in qat.state_dict().items()}
    for name, array in tensors.items():
        assert array.dtype == np.float32 and np.array_equal(array, state[name]), name
    assert set(tensors) == set(state) - ({"lm_head.weight"} if tied else set())  # a tied head is stored once
    assert info["dtypes"] == ["float32"] and info["left_out"] == []
    assert info["bytes"] == sum(a.nbytes for a in tensors.values())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(back) is transformers.LlamaForCausalLM and back.config.tie_word_embeddings == tied
    ids = torch.arange(12).reshape(1, 12)
    mixle.set_fake_quant_enabled(qat, False)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, qat(ids).logits)


def test_learned_scales_are_left_out_and_listed(tmp_path):
    qat = mixle.apply_qat(tiny_llama(), bits=4, group_size=32, scale="learned")
    info = save_pretrained_float(qat, tmp_path / "hf", tokenizer=None)
    assert info["left_out"] and all(key.endswith("weight_log2_scale") for key in info["left_out"])
    assert not any("log2_scale" in name for name in stored(tmp_path / "hf"))


def test_the_tokenizer_is_written_beside(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    save_pretrained_float(tiny_llama(), tmp_path / "hf", tokenizer=tokenizer)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").convert_tokens_to_ids("a") == 1


def test_models_without_float_weights_are_refused_and_nothing_is_written(tmp_path):
    qat = mixle.apply_qat(tiny_llama(), grid="q4_0", bits=4)
    with pytest.raises(ValueError, match=r"layer 'model.embed_tokens' is converted to integer codes: .* before convert"):
        save_pretrained_float(mixle.convert(qat), tmp_path / "a")
    lora = mixle.apply_lora(mixle.apply_qat(tiny_llama(), grid="q4_0", bits=4), rank=2, alpha=4)
    with pytest.raises(ValueError, match=r"holds LoRA adapters: merge them first"):
        save_pretrained_float(lora, tmp_path / "b")
    with pytest.raises(TypeError, match="takes a transformers PreTrainedModel"):
        save_pretrained_float(torch.nn.Linear(4, 4), tmp_path / "c")
    assert os.listdir(tmp_path) == []
    save_pretrained_float(mixle.merge_lora(lora), tmp_path / "d")  # merged: written
    assert "model.safetensors" in os.listdir(tmp_path / "d")


def test_a_failed_write_leaves_no_directory_and_a_full_one_is_kept(tmp_path, monkeypatch):
    model = tiny_llama()

    class Broken:
        def save_pretrained(self, directory):
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        save_pretrained_float(model, tmp_path / "hf", tokenizer=Broken())
    assert os.listdir(tmp_path) == []  # neither hf nor a partial sibling
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "mine.txt").write_text("kept")
    with pytest.raises(FileExistsError, match="exists and is not empty: pick a new path, or pass overwrite=True"):
        save_pretrained_float(model, tmp_path / "hf")
    with pytest.raises(OSError, match="No space left"):
        save_pretrained_float(model, tmp_path / "hf", tokenizer=Broken(), overwrite=True)
    assert os.listdir(tmp_path / "hf") == ["mine.txt"] and sorted(os.listdir(tmp_path)) == ["hf"]
    save_pretrained_float(model, tmp_path / "hf", overwrite=True)
    assert "mine.txt" not in os.listdir(tmp_path / "hf") and "model.safetensors" in os.listdir(tmp_path / "hf")


def test_a_model_read_from_a_gguf_file_is_written_as_the_float_model_it_was_dequantized_to(tmp_path):
    """transformers' GGUF loader marks the model quantized (save_pretrained refuses it), though its weights are
    float: they are written as a plain checkpoint, and the marks are put back."""
    import json
    import types

    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from mixle.lm.data import default_text
    from tests.test_finetune import byte_level_tokenizer

    tokenizer = byte_level_tokenizer(default_text()[:4000])
    mixle.save_gguf(tiny_llama(vocab=len(tokenizer)), tmp_path / "m.gguf", tokenizer=tokenizer, float_matrices="f32")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf")
    quantizer = model.hf_quantizer
    save_pretrained_float(model, tmp_path / "hf")
    assert model.hf_quantizer is quantizer and model.config.quantization_config is not None
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    for name, array in stored(tmp_path / "hf").items():
        assert np.array_equal(array, model.state_dict()[name].numpy()), name
    model.hf_quantizer = types.SimpleNamespace(quantization_config=types.SimpleNamespace(quant_method="bitsandbytes"))
    with pytest.raises(ValueError, match=r"loaded quantized by transformers \(bitsandbytes\): its weights are not"):
        save_pretrained_float(model, tmp_path / "other")
    assert not (tmp_path / "other").exists()
