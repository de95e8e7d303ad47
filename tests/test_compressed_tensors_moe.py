"""compressed-tensors and mixtures of experts: QAT / converted fused experts are written as packed
per-expert Linear weights, which transformers' own loader (the oracle) merges back into the fused
Parameters with mixle's logits; what it cannot load is refused before anything is written."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import mixle  # noqa: E402
from mixle.exports import compressed_experts  # noqa: E402
from tests.gguf_parity_cases import IDS, moe_model  # noqa: E402


def _logits(model):
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits


def _load(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


# family -> (its checkpoint's MLP name, per-expert Linear names), as transformers saves its own.
LAYOUTS = {"qwen3moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
           "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_qat_experts_load_back_with_the_fake_quant_logits(family, tmp_path):
    block, names = LAYOUTS[family]
    qat = mixle.apply_qat(moe_model(family), bits=4, group_size=16, grid="qwix")
    written = mixle.save_pretrained_compressed(qat, tmp_path / "ct")
    assert written["config_groups"]["group_0"]["targets"] == ["Linear"]
    from safetensors import safe_open

    (shard,) = (tmp_path / "ct").glob("*.safetensors")
    with safe_open(str(shard), "pt") as stored:  # transformers' per-expert checkpoint layout, packed
        keys = set(stored.keys())
        assert {f"model.layers.1.{block}.experts.3.{n}.weight_{p}" for n in names for p in ("packed", "scale")} <= keys
        assert not [k for k in keys if "gate_up_proj" in k]
    loaded = _load(tmp_path / "ct")
    assert type(loaded.model.layers[0].mlp.experts).__name__ in ("Qwen3MoeExperts", "MixtralExperts")  # fused again
    experts = qat.model.layers[1].mlp.experts.quantized_weights()  # what the QAT forward multiplies with
    assert torch.equal(loaded.model.layers[1].mlp.experts.gate_up_proj, experts["gate_up_proj"].detach())
    assert torch.equal(loaded.model.layers[1].mlp.experts.down_proj, experts["down_proj"].detach())
    assert torch.equal(_logits(loaded), _logits(qat))


def test_converted_experts_write_the_same_checkpoint(tmp_path):
    qat = mixle.apply_qat(moe_model("qwen3moe"), bits=8, grid="qwix")
    mixle.save_pretrained_compressed(mixle.convert(qat), tmp_path / "ct")
    assert torch.equal(_logits(_load(tmp_path / "ct")), _logits(qat))


@pytest.mark.parametrize("make, message", [
    (lambda m: mixle.quantize_model(m, bits=4, group_size=16, grid="qwix", patterns=(r".*self_attn\..*",)),
     r"with float experts \('model.layers.0.mlp.experts', a Qwen3MoeExperts\).*Nothing was written"),
    (lambda m: mixle.apply_qat(m, bits=4, grid="q4_0"), r"grid='q4_0'"),
    (lambda m: mixle.apply_qat(m, patterns=[(r".*experts", mixle.QuantSpec(bits=4, group_size=16, grid="qwix")),
                                            (r".*self_attn\..*", mixle.QuantSpec(bits=8, grid="qwix"))]),
     r"would need 2 compressed-tensors config groups .* nothing was written"),
])
def test_what_the_loader_cannot_read_is_refused_before_writing(make, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        mixle.save_pretrained_compressed(make(moe_model("qwen3moe")), tmp_path / "ct")
    assert not (tmp_path / "ct").exists()


def test_the_float_experts_refusal_is_transformers_own_limit(tmp_path, monkeypatch):
    """Without the refusal the directory is written, but transformers cannot load it back: its
    compressed-tensors loader expects packed per-expert weights and drops the float experts."""
    model = mixle.quantize_model(moe_model("qwen3moe"), bits=4, group_size=16, grid="qwix",
                                 patterns=(r".*self_attn\..*",))
    from mixle.exports import compressed_tensors as ct_export

    monkeypatch.setattr(ct_export, "check_experts", lambda model: False)
    mixle.save_pretrained_compressed(model, tmp_path / "ct")
    from safetensors import safe_open

    (shard,) = (tmp_path / "ct").glob("*.safetensors")
    with safe_open(str(shard), "pt") as stored:  # the float experts are in the checkpoint, per expert
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in set(stored.keys())
    # transformers logs "Concatenate on tensors destined for ...experts.gate_up_proj. Ckpt contains: 0"
    with pytest.raises(RuntimeError, match=r"issues during automatic conversion of the weights"):
        _load(tmp_path / "ct")
    assert compressed_experts.EXPERT_LINEAR_NAMES["Qwen3MoeExperts"][0] == "gate_proj"
