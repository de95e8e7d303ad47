"""compressed-tensors checkpoints: transformers loads what mixle writes, mixle loads what they write.

Oracles: transformers' own ``from_pretrained`` (with compressed-tensors' decompression) for the
logits, and compressed-tensors' own quantizer / unpacker for the stored codes.
"""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,  # noqa: E402
                                             apply_quantization_config)
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from safetensors import safe_open  # noqa: E402

from mixle.api import apply_qat, convert, quantize_model, save_quantized  # noqa: E402
from mixle.core.spec import QuantSpec  # noqa: E402
from mixle.exports.compressed_tensors import (load_pretrained_compressed, save_pretrained_compressed,  # noqa: E402
                                              spec_of_args, weight_args)
from mixle.torch_backend.layers.quantized import QuantizedEmbedding, QuantizedLinear  # noqa: E402


# Converted layers run the exact dequantize-then-matmul path here (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("exact_converted_layers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}  # Qwen2: q/k/v have biases
SPECS = {"int4-channel": dict(bits=4), "int4-group16": dict(bits=4, group_size=16),
         "int8-channel": dict(bits=8), "int8-group16": dict(bits=8, group_size=16)}
CASES = [(arch, tied, spec) for arch in CONFIGS for tied in (True, False) for spec in SPECS]


def tiny_lm(arch="llama", tied=False, seed=0):
    torch.manual_seed(seed)
    config = CONFIGS[arch](vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                           tie_word_embeddings=tied)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def token_ids():
    return torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))


def trained_qat(arch, tied, spec_fields, **qat):
    """A QAT model after one optimizer step (so its weights are not the float init)."""
    model = apply_qat(tiny_lm(arch, tied), **spec_fields, **qat)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = token_ids()
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    return model.eval()


def logits(model, ids=None):
    with torch.no_grad():
        return model(token_ids() if ids is None else ids).logits


def stored_tensors(directory):
    tensors = {}
    for path in glob.glob(os.path.join(directory, "*.safetensors")):
        with safe_open(path, "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


def quantization_config(directory):
    with open(os.path.join(directory, "config.json")) as handle:
        return json.load(handle)["quantization_config"]


@pytest.fixture(scope="module", params=CASES, ids=lambda case: f"{case[0]}-{'tied' if case[1] else 'untied'}-{case[2]}")
def saved(request, tmp_path_factory):
    """(case, QAT model, its fake-quant logits, convert(QAT model), checkpoint directory)."""
    arch, tied, spec = request.param
    qat = trained_qat(arch, tied, SPECS[spec])
    directory = str(tmp_path_factory.mktemp("ct") / "checkpoint")
    save_pretrained_compressed(qat, directory)
    return request.param, qat, logits(qat), convert(qat), directory


def test_from_pretrained_logits_equal_the_qat_fake_quant_forward(saved):
    # Exact: compressed-tensors dequantizes codes.to(float32) * weight_scale, the same product the
    # fake-quant forward computes from the same codes and scale, and every other op is the same
    # transformers code in the same order, so no rounding differs.
    _, _, qat_logits, _, directory = saved
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    assert torch.equal(logits(loaded), qat_logits)


def test_config_and_codes_follow_compressed_tensors(saved):
    (_, tied, spec), _, _, converted, directory = saved
    config = quantization_config(directory)
    assert (config["quant_method"], config["format"]) == ("compressed-tensors", "pack-quantized")
    (group,) = config["config_groups"].values()
    fields = SPECS[spec]
    want = {"num_bits": fields["bits"], "type": "int", "symmetric": True,
            "strategy": "group" if "group_size" in fields else "channel", "group_size": fields.get("group_size")}
    assert {key: group["weights"][key] for key in want} == want
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    assert config["ignore"] == (["lm_head"] if tied else [])
    args = QuantizationArgs.model_validate(group["weights"])
    tensors = stored_tensors(directory)
    packed_layers = {key.rsplit(".", 1)[0] for key in tensors if key.endswith(".weight_packed")}
    heads = {"lm_head"} if tied else set()
    quantized = {path for path, m in converted.named_modules() if isinstance(m, QuantizedLinear)}
    assert packed_layers == quantized - heads
    for path in packed_layers:
        layer = converted.get_submodule(path)
        scale = tensors[f"{path}.weight_scale"]
        codes = unpack_from_int32(tensors[f"{path}.weight_packed"], args.num_bits, torch.Size(tensors[f"{path}.weight_shape"]))
        oracle = ct_quantize(layer.dequantized_weight(), scale, None, args, dtype=torch.int8)
        assert torch.equal(codes, oracle), path  # compressed-tensors' quantizer, from the stored scale
        assert torch.equal(codes, layer.quantized_array().codes), path  # mixle's own codes, not re-chosen
        assert torch.equal(scale.reshape(-1), layer.scale.reshape(-1)), path  # the scale trained on


def test_tied_table_is_stored_once_and_stays_tied(saved):
    (_, tied, _), _, _, converted, directory = saved
    tensors = stored_tensors(directory)
    if not tied:
        assert "lm_head.weight_packed" in tensors and "lm_head.weight" not in tensors
        return
    assert not any(key.startswith("lm_head.") for key in tensors)
    embedding = converted.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding) and embedding.codes is converted.lm_head.codes
    assert torch.equal(tensors["model.embed_tokens.weight"], embedding.dequantized_weight())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_mixle_loads_its_checkpoint_into_quantized_linear_layers(saved):
    (_, tied, _), _, _, converted, directory = saved
    loaded = load_pretrained_compressed(directory).eval()
    for path, layer in converted.named_modules():
        if not isinstance(layer, QuantizedLinear) or (tied and path == "lm_head"):
            continue
        back = loaded.get_submodule(path)
        assert isinstance(back, QuantizedLinear) and back.spec == layer.spec, path
        assert torch.equal(back.codes, layer.codes) and torch.equal(back.scale, layer.scale), path
        assert (back.bias is None) == (layer.bias is None) and (back.bias is None or torch.equal(back.bias, layer.bias))
    if tied:  # stored as the dequantized table, so it comes back float and tied
        assert type(loaded.lm_head) is nn.Linear and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert loaded.hf_quantizer is None and not hasattr(loaded.config, "quantization_config")
    # Both models run QuantizedLinear's forward on identical storage: the same ops, so exact.
    assert torch.equal(logits(loaded), logits(converted))


def test_bfloat16_int8_codes_survive_the_compressor(tmp_path):
    # In bfloat16, round(bf16(code * scale) / scale) can land on a neighbouring int8 code near
    # +-127; the export must still store exactly mixle's codes. The format keeps scales in the
    # model's dtype, so the file's weights are code * bf16(scale) rounded to bfloat16: within one
    # bfloat16 step of QAT's values (float32 scales, rounded once).
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    qat = apply_qat(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval(), bits=8)
    save_pretrained_compressed(qat, tmp_path / "bf16")
    tensors = stored_tensors(tmp_path / "bf16")
    layer = convert(qat).model.layers[0].mlp.down_proj
    codes = unpack_from_int32(tensors["model.layers.0.mlp.down_proj.weight_packed"], 8, torch.Size([128, 256]))
    assert torch.equal(codes, layer.quantized_array().codes)
    scale = tensors["model.layers.0.mlp.down_proj.weight_scale"]
    assert scale.dtype == torch.bfloat16 and torch.equal(scale.reshape(-1), layer.scale.reshape(-1).bfloat16())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").eval()
    assert loaded.dtype == torch.bfloat16
    file_weight = (codes.float() * scale.float().reshape(-1, 1)).bfloat16()
    qat_weight = layer.dequantized_weight()
    assert qat_weight.dtype == torch.bfloat16
    step = torch.finfo(torch.bfloat16).eps * qat_weight.float().abs()  # one bfloat16 step, or less
    assert ((file_weight.float() - qat_weight.float()).abs() <= step).all()
    reference = convert(qat)  # the converted model with the file's bfloat16-rounded scales
    for module in reference.modules():
        if hasattr(module, "quantized_array"):
            module.scale = module.scale.bfloat16().float()
    assert torch.equal(reference.model.layers[0].mlp.down_proj.dequantized_weight(), file_weight)
    assert torch.equal(logits(loaded), logits(reference))  # exact: same bf16 ops on the file's weights
    back = load_pretrained_compressed(tmp_path / "bf16")
    assert torch.equal(back.model.layers[0].mlp.down_proj.codes, layer.codes)


def test_mixed_specs_write_one_group_each_with_named_targets(tmp_path):
    attention, mlp = QuantSpec(bits=4, group_size=16, grid="qwix"), QuantSpec(bits=8)
    qat = trained_qat("qwen2", False, {}, patterns=[(r".*self_attn\..*", attention), (r".*mlp\..*", mlp)],
                      exclude=("lm_head",))
    save_pretrained_compressed(qat, tmp_path / "mixed")
    config = quantization_config(tmp_path / "mixed")
    groups = sorted(config["config_groups"].values(), key=lambda g: g["weights"]["num_bits"])
    assert [g["weights"]["num_bits"] for g in groups] == [4, 8]
    assert all(t.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) for t in groups[0]["targets"])
    assert len(groups[0]["targets"]) == 8 and len(groups[1]["targets"]) == 6 and config["ignore"] == ["lm_head"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mixed").eval()
    assert torch.equal(logits(loaded), logits(qat))  # exact, as in the per-case test above
    back = load_pretrained_compressed(tmp_path / "mixed")
    assert back.model.layers[1].self_attn.k_proj.spec == attention  # qwix: its codes reach -8
    assert back.model.layers[0].mlp.up_proj.spec == mlp and type(back.lm_head) is nn.Linear


def test_a_converted_or_ptq_model_saves_too_and_the_users_model_is_untouched(tmp_path):
    qat = trained_qat("llama", True, dict(bits=4, group_size=16))
    before = {k: v.clone() for k, v in qat.state_dict().items()}
    converted = convert(qat)
    save_pretrained_compressed(converted, tmp_path / "a")
    save_pretrained_compressed(qat, tmp_path / "b")
    # The converted model writes the QAT model's checkpoint: the same tensors, bit for bit.
    from_converted, from_qat = stored_tensors(tmp_path / "a"), stored_tensors(tmp_path / "b")
    assert from_converted.keys() == from_qat.keys()
    for key, tensor in from_qat.items():
        other = from_converted[key]
        assert other.dtype == tensor.dtype and other.shape == tensor.shape, key
        assert other.view(torch.uint8).numpy().tobytes() == tensor.view(torch.uint8).numpy().tobytes(), key
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a").eval()
    assert torch.equal(logits(loaded), logits(qat))  # decompressed: the fake-quant weights, same ops
    assert all(torch.equal(before[k], v) for k, v in qat.state_dict().items())
    assert isinstance(converted.lm_head, QuantizedLinear) and isinstance(converted.model.embed_tokens, QuantizedEmbedding)
    ptq = quantize_model(tiny_lm("qwen2"), bits=8)
    save_pretrained_compressed(ptq, tmp_path / "ptq", tokenizer=word_tokenizer())
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "ptq")("a b").input_ids == [1, 2]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ptq").eval()
    assert torch.equal(logits(loaded), logits(ptq))


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>")


def test_a_tied_head_alone_is_refused_before_writing(tmp_path):
    qat = apply_qat(tiny_lm("llama", tied=True), bits=4, patterns=("lm_head",))
    with pytest.raises(ValueError, match="tied to the embedding"):
        save_pretrained_compressed(qat, tmp_path / "head")
    assert os.listdir(tmp_path) == []


def make_ct_checkpoint(directory, args):
    """A checkpoint made by compressed-tensors itself: its scale rule, its compressor, no mixle."""
    model = tiny_lm("llama", seed=3)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                rows = module.weight.reshape(module.weight.shape[0], -1, args.group_size or module.weight.shape[1])
                scale, _ = calculate_qparams(rows.amin(-1), rows.amax(-1), args)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)


def test_mixle_loads_a_checkpoint_made_by_compressed_tensors(tmp_path):
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16)
    make_ct_checkpoint(tmp_path / "ct", args)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ct").eval()
    ids = token_ids()
    want = logits(reference, ids)  # the first forward decompresses its weights
    ours = load_pretrained_compressed(tmp_path / "ct").eval()
    layer = ours.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantizedLinear) and layer.spec == QuantSpec(bits=4, group_size=16, grid="qwix")
    for path, module in ours.named_modules():
        if isinstance(module, QuantizedLinear):
            assert torch.equal(module.dequantized_weight(), reference.get_submodule(path).weight), path
    # Same dequantized weights (asserted exactly above); the float32 products may sum in another
    # order if QuantizedLinear's kernel differs from F.linear: at most ~K * 2^-24 relative per
    # product for K <= 64 inputs, far below 1e-5 at these logit magnitudes (|logit| < 1).
    assert logits(ours, ids).abs().max() < 1
    torch.testing.assert_close(logits(ours, ids), want, rtol=0, atol=1e-5)
    # Written back by mixle, the checkpoint holds exactly the tensors compressed-tensors wrote.
    save_pretrained_compressed(ours, tmp_path / "again")
    theirs, again = stored_tensors(tmp_path / "ct"), stored_tensors(tmp_path / "again")
    assert theirs.keys() == again.keys() and all(torch.equal(theirs[k], again[k]) for k in theirs)
    assert quantization_config(tmp_path / "again")["config_groups"]["group_0"]["weights"] == \
        quantization_config(tmp_path / "ct")["config_groups"]["group_0"]["weights"]


def write_config(directory, quantization):
    tiny_lm().config.save_pretrained(directory)
    path = os.path.join(directory, "config.json")
    with open(path) as handle:
        config = json.load(handle)
    if quantization is not None:
        config["quantization_config"] = quantization
    with open(path, "w") as handle:
        json.dump(config, handle)


def ct_config(**weights_and_more):
    weights = dict(num_bits=4, type="int", symmetric=True, strategy="channel")
    extra = {k: weights_and_more.pop(k) for k in ("input_activations", "kv_cache_scheme", "format") if k in weights_and_more}
    weights.update(weights_and_more)
    group = {"targets": ["Linear"], "weights": weights, "input_activations": extra.pop("input_activations", None)}
    return {"quant_method": "compressed-tensors", "format": extra.pop("format", "pack-quantized"),
            "config_groups": {"group_0": group}, "ignore": ["lm_head"], **extra}


@pytest.mark.parametrize("quantization, reason", [
    (ct_config(symmetric=False), "asymmetric"),
    (ct_config(type="float", num_bits=8), "type='float'"),
    (ct_config(input_activations=dict(num_bits=8, type="int", strategy="token", dynamic=True)), "activation quantization"),
    (ct_config(kv_cache_scheme=dict(num_bits=8, type="float", strategy="tensor")), "KV cache"),
    (ct_config(format="naive-quantized", num_bits=8), "format 'naive-quantized'"),
    (ct_config(strategy="block", block_structure=[16, 16]), "strategy='block'"),
    (None, "no compressed-tensors quantization_config"),
])
def test_load_refuses_schemes_mixle_cannot_represent(tmp_path, quantization, reason):
    write_config(tmp_path, quantization)  # no weights: the refusal comes before any is read
    with pytest.raises(ValueError, match=reason):
        load_pretrained_compressed(tmp_path)


def test_save_refusals_leave_nothing_behind(tmp_path):
    class BrokenTokenizer:
        def save_pretrained(self, directory):
            raise OSError("disk full")

    qat = trained_qat("llama", False, dict(bits=4))
    before = {k: v.clone() for k, v in qat.state_dict().items()}
    with pytest.raises(OSError, match="disk full"):
        save_pretrained_compressed(qat, tmp_path / "out", tokenizer=BrokenTokenizer())
    assert os.listdir(tmp_path) == []  # no checkpoint, no staging directory
    assert all(torch.equal(before[k], v) for k, v in qat.state_dict().items())
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_pretrained_compressed(qat, tmp_path / "full")
    assert os.listdir(tmp_path / "full") == ["keep.txt"]
    save_pretrained_compressed(qat, tmp_path / "full", overwrite=True)
    assert "keep.txt" not in os.listdir(tmp_path / "full") and sorted(os.listdir(tmp_path)) == ["full"]
    with pytest.raises(TypeError, match="save_quantized"):
        save_pretrained_compressed(quantize_model(nn.Sequential(nn.Linear(8, 4))), tmp_path / "mlp")
    with pytest.raises(ValueError, match="no quantized or QAT layers"):
        save_pretrained_compressed(tiny_lm(), tmp_path / "float")
    assert sorted(os.listdir(tmp_path)) == ["full"]


@pytest.mark.parametrize("grid, reason", [("q4_0", "signed maximum"), ("q8_0", "float16")])
def test_llama_cpp_grids_are_refused_with_the_reason(grid, reason):
    with pytest.raises(ValueError, match=f"grid='{grid}'.*{reason}"):
        weight_args(QuantSpec(bits=4 if grid == "q4_0" else 8, grid=grid))


def test_spec_args_round_trip():
    for spec in (QuantSpec(bits=4), QuantSpec(bits=8, group_size=32, grid="qwix"), QuantSpec(bits=4, granularity="tensor")):
        assert spec_of_args(weight_args(spec), spec.grid) == spec
    assert spec_of_args(weight_args(QuantSpec(bits=4, clip_percentile=99.0)), "symmetric") == QuantSpec(bits=4)


@pytest.mark.parametrize("tied", [True, False])
def test_transformers_save_pretrained_of_a_converted_model_fails_loudly(tmp_path, tied):
    converted = quantize_model(tiny_lm("llama", tied), bits=4)
    with pytest.raises(RuntimeError, match="save_pretrained_compressed"):
        converted.save_pretrained(tmp_path)
    with pytest.raises(OSError):  # no weights were written, so nothing loads as random weights
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert save_quantized(converted, tmp_path / "own.safetensors")["format"]  # plain state_dict users still work
    assert any(key.endswith(".codes") for key in converted.state_dict())


def test_face_exports_lazily_without_importing_transformers():
    code = ("import sys, mixle.task.quantize as q; f = q.save_pretrained_compressed, q.load_pretrained_compressed; "
            "print(sorted(m for m in ('transformers', 'compressed_tensors') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_learned_scales_are_stored_exactly_as_trained(tmp_path, tied):
    # scale="learned": the file's weight_scale is 2**weight_log2_scale after training (not the absmax
    # rule re-applied to the weight), and transformers' forward equals the QAT forward exactly.
    model = apply_qat(tiny_lm("llama", tied), bits=4, group_size=16, scale="learned")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(3):
        ids = token_ids()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    directory = str(tmp_path / "checkpoint")
    save_pretrained_compressed(model, directory)
    tensors = stored_tensors(directory)
    learned = {path: torch.exp2(m.weight_log2_scale.detach()) for path, m in model.named_modules()
               if hasattr(m, "weight_log2_scale")}
    packed = {key.rsplit(".", 1)[0] for key in tensors if key.endswith(".weight_packed")}
    tied_table = {"lm_head", "model.embed_tokens"} if tied else set()  # stored once, dequantized (see above)
    assert packed == set(learned) - tied_table
    moved = 0
    for path in packed:
        weight = model.get_submodule(path).weight.detach()
        absmax_rule = weight.reshape(weight.shape[0], -1, 16).abs().amax(-1) / 7
        moved += not torch.equal(learned[path].reshape(absmax_rule.shape), absmax_rule)
        assert torch.equal(tensors[f"{path}.weight_scale"].reshape(-1), learned[path].reshape(-1)), path
    assert moved == len(packed)  # training moved every layer's scales off the absmax rule
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    assert torch.equal(logits(loaded), logits(model))
