"""save_gguf for mixtures of experts: Qwen3-MoE as llama.cpp's ``qwen3moe``, Mixtral as ``llama``
with experts. Oracles: gguf-py (names, shapes, types, metadata, and its own Q4_0/Q8_0 quantizer for
the expert blocks) and, where llama-cpp-python is installed, llama.cpp's logits."""

import importlib.util

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import mixle  # noqa: E402
from mixle.core.layer_weights import quantize_linear_weight  # noqa: E402
from tests.gguf_parity_cases import IDS, hf_logits, moe_arrays, moe_logits, moe_model, moe_reference  # noqa: E402
from tests.test_gguf_mixes import (MIXES, MOE_CASES, llama_quantize, mixle_bytes,  # noqa: E402, F401
                                   mixle_types, read_tensors, reference, sha, write_float_file)

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
FAMILIES = ("qwen3moe", "mixtral")
EXPERTS, USED, ROWS, HIDDEN = 4, 2, 64, 64


def _read(path):
    reader = gguf.GGUFReader(str(path))
    return reader, {t.name: t for t in reader.tensors}


def _field(reader, key):
    return reader.fields[key].contents()


def _ne(tensor):
    return [int(n) for n in tensor.shape]


def _llama_cpp_logits(path):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=16, logits_all=True, n_threads=1, type_k=0, type_v=0,
                          verbose=False)
    llm.eval(IDS)
    return np.array(llm.scores[: len(IDS)], dtype=np.float32)


@pytest.mark.parametrize("family", FAMILIES)
def test_names_shapes_types_and_hyper_parameters(family, tmp_path):
    model = moe_model(family)
    written = mixle.save_gguf(model, tmp_path / "m.gguf", quantized=moe_arrays(model, "q4_0"))
    reader, tensors = _read(tmp_path / "m.gguf")
    arch = "qwen3moe" if family == "qwen3moe" else "llama"
    assert _field(reader, "general.architecture") == arch
    assert (_field(reader, f"{arch}.expert_count"), _field(reader, f"{arch}.expert_used_count"),
            _field(reader, f"{arch}.expert_feed_forward_length")) == (EXPERTS, USED, ROWS)
    assert _field(reader, f"{arch}.feed_forward_length") == model.config.intermediate_size
    for i in range(2):
        block = {name.split(".", 2)[2]: t for name, t in tensors.items() if name.startswith(f"blk.{i}.")}
        norms = {"attn_q_norm.weight", "attn_k_norm.weight"} if arch == "qwen3moe" else set()
        assert set(block) == {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                              "attn_output.weight", "ffn_norm.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight",
                              "ffn_up_exps.weight", "ffn_down_exps.weight"} | norms
        # gguf's ne is numpy's shape reversed: experts last.
        got = {k: (block[k].tensor_type.name, _ne(block[k])) for k in ("ffn_gate_exps.weight", "ffn_up_exps.weight",
                                                                        "ffn_down_exps.weight", "ffn_gate_inp.weight")}
        assert got == {"ffn_gate_exps.weight": ("Q4_0", [HIDDEN, ROWS, EXPERTS]),
                       "ffn_up_exps.weight": ("Q4_0", [HIDDEN, ROWS, EXPERTS]),
                       "ffn_down_exps.weight": ("Q4_0", [ROWS, HIDDEN, EXPERTS]),
                       "ffn_gate_inp.weight": ("F32", [HIDDEN, EXPERTS])}
        np.testing.assert_array_equal(np.asarray(block["ffn_gate_inp.weight"].data),
                                      model.model.layers[i].mlp.gate.weight.detach().numpy())
    assert written["blk.0.ffn_gate_exps.weight"] == "Q4_0" and written["output.weight"] == "Q8_0"


@pytest.mark.parametrize("grid, ggml", [("q4_0", "Q4_0"), ("q8_0", "Q8_0")])
def test_expert_blocks_are_gguf_pys_bit_for_bit(grid, ggml, tmp_path):
    """gate/up are whole rows of gate_up_proj: their blocks are gguf-py's quantization of each half."""
    model = moe_model("qwen3moe")
    arrays = moe_arrays(model, grid)
    mixle.save_gguf(model, tmp_path / "m.gguf", quantized=arrays)
    _, tensors = _read(tmp_path / "m.gguf")
    kind = getattr(gguf.GGMLQuantizationType, ggml)
    for i, layer in enumerate(model.model.layers):
        gate_up = layer.mlp.experts.gate_up_proj.detach().numpy()
        halves = {"ffn_gate_exps": gate_up[:, :ROWS], "ffn_up_exps": gate_up[:, ROWS:],
                  "ffn_down_exps": layer.mlp.experts.down_proj.detach().numpy()}
        for name, values in halves.items():
            stored = tensors[f"blk.{i}.{name}.weight"]
            assert stored.tensor_type == kind
            np.testing.assert_array_equal(np.asarray(stored.data).reshape(-1),
                                          gguf.quants.quantize(np.ascontiguousarray(values), kind).reshape(-1))
        back = gguf.quants.dequantize(np.asarray(tensors[f"blk.{i}.ffn_up_exps.weight"].data), kind)
        want = arrays[f"model.layers.{i}.mlp.experts.gate_up_proj"].dequantize()[:, ROWS:]
        np.testing.assert_array_equal(back.reshape(want.shape), want)


@pytest.mark.parametrize("float_matrices, ggml, dtype", [("f32", "F32", np.float32), ("f16", "F16", np.float16)])
def test_float_experts_follow_float_matrices(float_matrices, ggml, dtype, tmp_path):
    model = moe_model("mixtral")
    mixle.save_gguf(model, tmp_path / "m.gguf", float_matrices=float_matrices)
    _, tensors = _read(tmp_path / "m.gguf")
    experts = model.model.layers[1].mlp.experts
    assert tensors["blk.1.ffn_gate_exps.weight"].tensor_type.name == ggml
    np.testing.assert_array_equal(np.asarray(tensors["blk.1.ffn_gate_exps.weight"].data),
                                  experts.gate_up_proj.detach().numpy()[:, :ROWS].astype(dtype))
    np.testing.assert_array_equal(np.asarray(tensors["blk.1.ffn_down_exps.weight"].data),
                                  experts.down_proj.detach().numpy().astype(dtype))
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type.name == "F32"  # the router stays F32 always


def test_load_gguf_weights_puts_the_experts_back(tmp_path):
    model = moe_model("qwen3moe")
    arrays = moe_arrays(model, "q4_0")
    mixle.save_gguf(model, tmp_path / "m.gguf", quantized=arrays)
    back = mixle.load_gguf_weights(model, tmp_path / "m.gguf")
    for i, layer in enumerate(back.model.layers):
        for attr in ("gate_up_proj", "down_proj"):
            want = torch.as_tensor(arrays[f"model.layers.{i}.mlp.experts.{attr}"].dequantize())
            assert torch.equal(getattr(layer.mlp.experts, attr), want), (i, attr)
        assert torch.equal(layer.mlp.gate.weight, model.model.layers[i].mlp.gate.weight)


def _config_model(family, **changes):
    model = moe_model(family)
    config = type(model.config)(**{**model.config.to_dict(), **changes})
    return type(model)(config).eval()


@pytest.mark.parametrize("family, changes, message", [
    ("qwen3moe", {"norm_topk_prob": False}, r"norm_topk_prob=False: llama.cpp's qwen3moe graph always divides"),
    ("qwen3moe", {"mlp_only_layers": [1]}, r"model.layers.1.mlp is a Qwen3MoeMLP, not a Qwen3MoeSparseMoeBlock"),
    ("qwen3moe", {"use_sliding_window": True, "sliding_window": 8}, r"sliding_window=8"),
    ("qwen3moe", {"attention_bias": True}, r"attention_bias=True"),
    ("mixtral", {"sliding_window": 8}, r"sliding_window=8"),
    ("mixtral", {"hidden_act": "gelu"}, r"hidden_act='gelu'"),
])
def test_configs_llama_cpp_computes_differently_are_refused(family, changes, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        mixle.save_gguf(_config_model(family, **changes), tmp_path / "m.gguf", float_matrices="f32")
    assert not (tmp_path / "m.gguf").exists()


def test_bad_expert_arrays_are_refused_before_writing(tmp_path):
    model = moe_model("mixtral")
    key = "model.layers.0.mlp.experts.gate_up_proj"
    weight = model.model.layers[0].mlp.experts.gate_up_proj.detach()
    cases = [({key: quantize_linear_weight(weight[:, :ROWS], grid="q4_0", batch_axis_count=1)},
              r"quantized\['model.layers.0.mlp.experts.gate_up_proj'\] has shape \[4, 64, 64\], but the layer's "
              r"weight is \[4, 128, 64\]"),
             ({key: quantize_linear_weight(weight, bits=4, batch_axis_count=1)},
              r"layer 'model.layers.0.mlp.experts.gate_up_proj' is quantized on int4.* which GGUF has no block type"),
             ({"model.layers.0.mlp.experts": quantize_linear_weight(weight, grid="q4_0", batch_axis_count=1)},
              r"quantized names \['model.layers.0.mlp.experts'\], which are not weight matrices")]
    for quantized, message in cases:
        with pytest.raises(ValueError, match=message):
            mixle.save_gguf(model, tmp_path / "m.gguf", quantized=quantized)
    assert not (tmp_path / "m.gguf").exists()


# ---------------------------------------------------------------------------------- llama.cpp


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (the llama extra)")
@pytest.mark.parametrize("family, grid", [("qwen3moe", None), ("qwen3moe", "q4_0"), ("mixtral", "q4_0"),
                                          ("mixtral", "q8_0")])
def test_llama_cpp_computes_the_models_forward(family, grid, tmp_path):
    """llama.cpp's logits of the file against the model with the arrays' dequantized weights and
    (``act_bits=8``, as the dense tests) the input of every quantized product as Q8_0 blocks."""
    model, arrays, want = moe_logits(family, grid)
    mixle.save_gguf(model, tmp_path / "m.gguf", quantized=arrays, float_matrices="f32" if grid is None else None)
    got = _llama_cpp_logits(tmp_path / "m.gguf")
    # Measured 1.2e-6 (q4_0, q8_0) / 1.7e-6 (f32) at |logit| ~4 on AMD EPYC: float32 sums in another
    # order. As in the dense tests, other SIMD paths may round an exact Q8_0 tie differently: 1e-4.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def _digests(path):
    return {t.name: (t.tensor_type.name, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("grid", ["q4_0", "q8_0"])
def test_qat_and_converted_experts_write_their_own_blocks(grid, tmp_path):
    """apply_qat's experts layer (codes of each expert's matrix quantized as a Linear) and its
    convert: the file holds exactly those blocks, which dequantize to the QAT forward's weights."""
    model = moe_model("mixtral")
    qat = mixle.apply_qat(moe_model("mixtral"), grid=grid, bits=4 if grid == "q4_0" else 8)
    mixle.save_gguf(qat, tmp_path / "qat.gguf")
    mixle.save_gguf(mixle.convert(qat), tmp_path / "converted.gguf")
    mixle.save_gguf(model, tmp_path / "given.gguf", quantized=moe_arrays(model, grid, head=grid))
    qat_file = _digests(tmp_path / "qat.gguf")
    assert qat_file == _digests(tmp_path / "converted.gguf") == _digests(tmp_path / "given.gguf")
    back = mixle.load_gguf_weights(model, tmp_path / "qat.gguf")
    for i, layer in enumerate(qat.model.layers):
        trained = layer.mlp.experts.quantized_weights()  # what the QAT forward multiplies with
        for attr in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(back.model.layers[i].mlp.experts, attr), trained[attr].detach()), (i, attr)


def test_a_quantized_router_is_written_as_its_blocks(tmp_path):
    """Routers stay F32 unless opted in to QAT (or given): then their own Q8_0 blocks, in llama.cpp too."""
    model = moe_model("mixtral")
    qat = mixle.apply_qat(moe_model("mixtral"), grid="q8_0", bits=8, opt_in=("router",))
    mixle.save_gguf(qat, tmp_path / "qat.gguf")
    arrays = {**moe_arrays(model, "q8_0", head="q8_0"),
              **{f"model.layers.{i}.mlp.gate": quantize_linear_weight(layer.mlp.gate.weight.detach(), grid="q8_0")
                 for i, layer in enumerate(model.model.layers)}}
    mixle.save_gguf(model, tmp_path / "given.gguf", quantized=arrays)
    assert _digests(tmp_path / "qat.gguf") == _digests(tmp_path / "given.gguf")
    assert _digests(tmp_path / "qat.gguf")["blk.1.ffn_gate_inp.weight"][0] == "Q8_0"
    if HAS_LLAMA_CPP:
        want = hf_logits(moe_reference(model, arrays))
        np.testing.assert_allclose(_llama_cpp_logits(tmp_path / "qat.gguf"), want, rtol=0, atol=1e-4)


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (the llama extra)")
def test_llama_cpp_runs_the_qat_file(tmp_path):
    """The QAT file in llama.cpp against the trained weights with Q8_0 activations (the QAT experts
    layer fake-quantizes weights only, so the activations are quantized by the reference)."""
    model = moe_model("qwen3moe")
    mixle.save_gguf(mixle.apply_qat(moe_model("qwen3moe"), grid="q4_0"), tmp_path / "m.gguf")
    want = hf_logits(moe_reference(model, moe_arrays(model, "q4_0", head="q4_0")))
    np.testing.assert_allclose(_llama_cpp_logits(tmp_path / "m.gguf"), want, rtol=0, atol=1e-4)


# ------------------------------------------------------------ llama.cpp's mixes on MoE models



@pytest.fixture(scope="module")
def moe_float_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_float")
    return {case: write_float_file(build(0), out / f"{case}.gguf") for case, (build, *_) in MOE_CASES.items()}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_tensor_types_and_bytes_equal_llama_quantizes(case, reference, moe_float_files):
    """Every mix: the type llama_model_quantize gave each tensor (the committed fixture) and its bytes."""
    tensors = moe_float_files[case]
    assert {n: sha(d) for n, (_, _, d) in tensors.items()} == reference["cases"][case]["float"]
    cache = {}
    for mix in MIXES:
        chosen = reference["cases"][case]["mixes"][mix]
        mine = mixle_types(case, tensors, mix)
        assert {name: mine[name] or "F32" for name in chosen} == {name: t for name, (t, _) in chosen.items()}, mix
        wrong = [name for name, (t, digest) in chosen.items() if sha(mixle_bytes(tensors[name][2], t, cache)) != digest]
        assert wrong == [], (mix, wrong)


def test_eight_expert_rules_and_mxfp4_moe(reference):
    """Mixtral-8x's bumps (attn_v and attn_k Q8_0, attn_output Q5_K under Q4_K_M) and MXFP4_MOE's
    experts, as llama.cpp chose them."""
    q4km = {n: t for n, (t, _) in reference["cases"]["mixtral8_h256"]["mixes"]["Q4_K_M"].items()}
    assert (q4km["blk.0.attn_v.weight"], q4km["blk.0.attn_k.weight"], q4km["blk.0.attn_output.weight"],
            q4km["blk.0.attn_q.weight"]) == ("Q8_0", "Q8_0", "Q5_K", "Q4_K")
    mxfp4 = {n: t for n, (t, _) in reference["cases"]["qwen3moe_h64"]["mixes"]["MXFP4_MOE"].items()}
    assert {mxfp4[f"blk.1.{p}.weight"] for p in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")} == {"MXFP4"}
    assert (mxfp4["blk.1.attn_q.weight"], mxfp4["token_embd.weight"], mxfp4["blk.1.ffn_gate_inp.weight"]) == \
        ("Q8_0", "Q8_0", "F32")


@pytest.mark.parametrize("case, mix", [("mixtral8_h256", "Q4_K_M"), ("qwen3moe_h64", "MXFP4_MOE")])
def test_save_gguf_with_a_mix_writes_llama_quantizes_moe_file(case, mix, reference, tmp_path):
    model = MOE_CASES[case][0](0)
    mixle.save_gguf(model, tmp_path / "m.gguf", gguf_mix=mix)
    got = {name: [t, sha(data)] for name, (t, _, data) in read_tensors(tmp_path / "m.gguf").items()}
    assert got == reference["cases"][case]["mixes"][mix]


@pytest.mark.parametrize("mix", ["Q4_0"])
def test_qat_on_a_mix_writes_llama_quantizes_moe_file(mix, reference, tmp_path):
    """apply_qat(gguf_mix=...) trains every expert on the type llama.cpp gives it; the saved file is
    llama_model_quantize's, bit for bit (what the mix keeps float is F16, as in llama.cpp's files)."""
    case = "qwen3moe_h64"
    qat = mixle.apply_qat(MOE_CASES[case][0](0), gguf_mix=mix)
    assert type(qat.model.layers[0].mlp.experts).__name__ == "QATQwen3MoeExperts"
    mixle.save_gguf(qat, tmp_path / "m.gguf", float_matrices="f16")
    got = {name: [t, sha(data)] for name, (t, _, data) in read_tensors(tmp_path / "m.gguf").items()}
    assert got == reference["cases"][case]["mixes"][mix]


def test_a_mix_giving_one_experts_layer_two_types_is_refused():
    model = MOE_CASES["qwen3moe_h64"][0](0)  # gate/up rows of 64 (Q4_K -> Q5_0), down rows of 256 (Q4_K)
    with pytest.raises(ValueError, match=r"gives 'blk.0.ffn_gate_exps.weight' Q5_0 but 'blk.0.ffn_down_exps.weight' "
                                         r"(Q4_K|Q6_K), and both are weights of 'model.layers.0.mlp.experts'"):
        mixle.gguf_mix_specs(model, "Q4_K_S")
    specs = mixle.gguf_mix_specs(model, "Q4_0")
    assert specs["model.layers.0.mlp.experts"].grid == "q4_0" and specs["model.layers.0.mlp.gate"] is None  # F32


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (the llama extra)")
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_live_llama_quantize_matches_mixle_on_moe(case, tmp_path):
    """Fresh weights (another seed): llama.cpp's types and bytes, tensor by tensor."""
    tensors = write_float_file(MOE_CASES[case][0](7), tmp_path / "f32.gguf")
    for mix in ("Q4_K_M", "Q6_K", "MXFP4_MOE"):
        llama_quantize(tmp_path / "f32.gguf", tmp_path / f"{mix}.gguf", mix)
        theirs = read_tensors(tmp_path / f"{mix}.gguf")
        mine = mixle_types(case, tensors, mix)
        assert {n: mine[n] or "F32" for n in theirs} == {n: t for n, (t, *_) in theirs.items()}, mix
        for name, (ggml_type, _, data) in theirs.items():
            assert sha(mixle_bytes(tensors[name][2], ggml_type)) == sha(data), (mix, name, ggml_type)


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (the llama extra)")
@pytest.mark.parametrize("family, grid", [("mixtral", "q4_0"), ("qwen3moe", "q4_0"), ("qwen3moe", "q8_0")])
def test_llama_cpp_matches_the_qat_forward_with_act_bits_8(family, grid, tmp_path):
    """The dense tests' check on a MoE model: QAT with act_bits=8 (each product's input, the experts'
    included, as Q8_0 blocks) computes what llama.cpp's CPU path does with the file it saves. The
    token embedding is trained on q8_0 too (a lookup: the file holds its blocks, which it reads)."""
    from mixle.core.spec import QuantSpec

    spec = QuantSpec(grid=grid, bits=4 if grid == "q4_0" else 8, act_bits=8)
    qat = mixle.apply_qat(moe_model(family), spec=spec, opt_in=("embedding",),
                          patterns=[(r"model\.embed_tokens", QuantSpec(grid="q8_0", bits=8)), ".*"])
    assert qat.model.layers[0].mlp.experts.spec.act_bits == 8
    mixle.save_gguf(qat, tmp_path / "m.gguf")
    # Measured 9.5e-7 (mixtral q4_0) at |logit| ~4 on AMD EPYC; as the dense tests: 1e-4.
    np.testing.assert_allclose(_llama_cpp_logits(tmp_path / "m.gguf"), hf_logits(qat), rtol=0, atol=1e-4)
