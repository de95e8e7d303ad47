"""llama.cpp's mixes (Q4_K_M, ...) against llama.cpp's own quantizer: the type it gives every tensor
(``mixle.gguf.mixes.tensor_types``) and its quantized bytes (``quantize_array`` + ``pack_array``,
and ``save_gguf(..., gguf_mix=...)``), for gpt2, llama and qwen2 models whose rows are and are not
multiples of 256.

Oracle: ``llama_cpp.llama_model_quantize`` (``pure`` off, no importance matrix) on the F32 GGUF
``save_gguf(model, float_matrices="f32")`` writes. CI cannot build llama-cpp-python, so
``benchmarks/make_llama_quantize_fixtures.py`` ran it once on the seeded models below (and on
files of given shapes, for the types of real models' shapes) and stored per tensor the type it
chose and the sha256 of its bytes (``tests/fixtures/llama_quantize_reference.npz``); the live
tests run when ``llama_cpp`` is importable.
"""

import ctypes
import hashlib
import importlib.util
import json
import pathlib
from collections import Counter

import numpy as np
import pytest
import torch

from mixle.gguf.mixes import GGUF_MIXES, fallback_type, grid_of_type, mix_named, tensor_types, use_more_bits
from mixle.core.numerics import quantize_array
from mixle.gguf.blocks import pack_array

gguf = pytest.importorskip("gguf")

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = "tests/fixtures/llama_quantize_reference.npz"
MIXES = list(GGUF_MIXES)
HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


# --------------------------------------------------------------------------- seeded models


def seeded(model, seed):
    """``model`` with every parameter drawn from numpy's seeded generator (stable across torch and
    transformers versions), with a zero row, a constant run and an outlier in some matrices."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for index, (name, param) in enumerate(model.named_parameters()):
            shape = tuple(param.shape)
            if param.dim() == 1:
                values = (1.0 if name.endswith("weight") else 0.0) + 0.1 * rng.standard_normal(shape)
            else:
                values = rng.standard_normal(shape) * 0.05 * rng.exponential(1.0, (*shape[:-1], 1))
                if index % 4 == 0:
                    values[0] = 0.0
                elif index % 4 == 1:
                    values[0, : min(64, shape[1])] = 0.37
                elif index % 4 == 2:
                    values[1 % shape[0], 5 % shape[1]] = 3.0
            param.copy_(torch.from_numpy(values.astype(np.float32)))
    return model.eval()


def _hf(family, seed, **fields):
    transformers = pytest.importorskip("transformers")
    base = dict(vocab_size=64, max_position_embeddings=16, rms_norm_eps=1e-5)
    config = getattr(transformers, f"{family}Config")(**base, **fields)
    return seeded(getattr(transformers, f"{family}ForCausalLM")(config), seed)


def _gpt2(seed, d_model, n_layer):
    import mixle

    return seeded(mixle.build_causal_lm(vocab=48, d_model=d_model, n_layer=n_layer, n_head=2, block=16,
                                        activation="gelu_tanh"), seed)


# name -> (build(seed), architecture): rows of 256 (K-quants) and of 32, 64, 96, 40 (fallbacks; 40: F16).
MODEL_CASES = {
    "llama_h256": (lambda seed: _hf("Llama", seed, hidden_size=256, intermediate_size=32, num_hidden_layers=8,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                    tie_word_embeddings=False), "llama"),
    "qwen2_h64": (lambda seed: _hf("Qwen2", seed, hidden_size=64, intermediate_size=256, num_hidden_layers=3,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True), "qwen2"),
    "gpt2_h64": (lambda seed: _gpt2(seed, 64, 4), "gpt2"),
    "gpt2_h40": (lambda seed: _gpt2(seed, 40, 2), "gpt2"),
}


# Mixtures of experts: name -> (build(seed), architecture, experts). Qwen3-MoE's expert rows of 64
# (fallbacks) and down rows of 256; an 8-expert Mixtral (llama.cpp's Mixtral-8x rules) of hidden 256.
MOE_CASES = {
    "qwen3moe_h64": (lambda seed: _hf("Qwen3Moe", seed, hidden_size=64, intermediate_size=96, moe_intermediate_size=256,
                                      num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                      tie_word_embeddings=True), "qwen3moe", 4),
    "mixtral8_h256": (lambda seed: _hf("Mixtral", seed, hidden_size=256, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                       num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False),
                      "llama", 8),
}


def _decoder_shapes(n_layer, hidden, ffn, rows=8, tied=True):
    """A decoder's tensor shapes with ``rows`` output rows each: the types depend only on the rows'
    lengths (the last axis), so real models' types come from files this small."""
    shapes = {"token_embd.weight": (rows, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (rows, hidden)
    for i in range(n_layer):
        for part, cols in (("attn_q", hidden), ("attn_k", hidden), ("attn_v", hidden), ("attn_output", hidden),
                           ("ffn_gate", hidden), ("ffn_up", hidden), ("ffn_down", ffn)):
            shapes[f"blk.{i}.{part}.weight"] = (rows, cols)
        shapes[f"blk.{i}.attn_norm.weight"] = shapes[f"blk.{i}.ffn_norm.weight"] = (hidden,)
    return shapes


# name -> (architecture, n_layer, n_head, n_head_kv, shapes): types only.
SHAPE_CASES = {
    "smollm2_135m": ("llama", 30, 9, 3, _decoder_shapes(30, 576, 1536)),
    "llama_30_h4096": ("llama", 30, 32, 8, _decoder_shapes(30, 4096, 11008, tied=False)),
    "llama_80_gqa": ("llama", 80, 64, 8, _decoder_shapes(80, 256, 512, tied=False)),
    "llama_80_mha": ("llama", 80, 8, 8, _decoder_shapes(80, 256, 512)),
    "qwen2_80": ("qwen2", 80, 8, 8, _decoder_shapes(80, 256, 512)),
}


# ------------------------------------------------------------------------------- helpers


def sha(data):
    return hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()


def read_tensors(path):
    """``{name: (ggml type name, numpy-order shape, data)}`` of a GGUF file (data as gguf-py reads it)."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), np.asarray(t.data))
            for t in reader.tensors}


def file_type_of(path):
    return int(gguf.GGUFReader(str(path)).fields["general.file_type"].contents())


def mixle_bytes(values, ggml_type, cache=None):
    """mixle's bytes of a float32 tensor (numpy order) written as ``ggml_type``, as llama.cpp stores it."""
    key = None if cache is None else (id(values), ggml_type)
    if key in (cache or {}):
        return cache[key]
    if ggml_type == "F32":
        data = values.astype(np.float32)
    elif ggml_type == "F16":
        data = values.astype(np.float16)
    else:
        data = pack_array(quantize_array(values.reshape(-1, values.shape[-1]), grid=grid_of_type(ggml_type)))
    if cache is not None:
        cache[key] = data
    return data


def llama_quantize(src, dst, mix):
    """llama.cpp's quantizer on ``src`` (one thread, ``pure`` off, no importance matrix)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{mix}")
    params.nthread = 1
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {src} ({mix})")


def write_float_file(model, path):
    import mixle

    mixle.save_gguf(model, path, float_matrices="f32")
    return read_tensors(path)


def write_shape_file(case, path):
    """A GGUF of the case's shapes (seeded values) with the hyper-parameters llama.cpp's quantizer reads."""
    arch, n_layer, n_head, n_head_kv, shapes = SHAPE_CASES[case]
    writer = gguf.GGUFWriter(str(path), arch=arch)
    hidden = shapes["token_embd.weight"][-1]
    for method, value in (("add_context_length", 64), ("add_embedding_length", hidden), ("add_block_count", n_layer),
                          ("add_feed_forward_length", shapes["blk.0.ffn_down.weight"][-1]),
                          ("add_head_count", n_head), ("add_head_count_kv", n_head_kv),
                          ("add_layer_norm_rms_eps", 1e-5), ("add_rope_dimension_count", hidden // n_head),
                          ("add_vocab_size", 8)):
        getattr(writer, method)(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<|{i}|>" for i in range(8)])
    writer.add_token_types([1] * 8)
    writer.add_token_merges(["<|0|> <|1|>"])
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def mixle_types(case, tensors, mix):
    """tensor_types for a model (or MoE) case's F32 file (``tensors`` as ``read_tensors`` gives them)."""
    shapes = {name: shape for name, (_, shape, _) in tensors.items()}
    n_layer = 1 + max(int(name.split(".")[1]) for name in shapes if name.startswith("blk."))
    arch, n_expert = MOE_CASES[case][1:] if case in MOE_CASES else (MODEL_CASES[case][1], 0)
    return tensor_types(mix, shapes, arch, n_layer, n_head=2, n_head_kv=1, n_expert=n_expert)


@pytest.fixture(scope="module")
def reference():
    path = ROOT / FIXTURE
    if not path.exists():
        pytest.fail(f"{FIXTURE} is missing: run `python benchmarks/make_llama_quantize_fixtures.py` with llama-cpp-python")
    return json.loads(str(np.load(path)["meta"]))


@pytest.fixture(scope="module")
def float_files(tmp_path_factory):
    """``{case: read_tensors of its F32 file}`` of the seeded models (seed 0, as the fixture's)."""
    out = tmp_path_factory.mktemp("float")
    return {case: write_float_file(build(0), out / f"{case}.gguf") for case, (build, _) in MODEL_CASES.items()}


# ------------------------------------------------------------------------------ unit rules


def test_use_more_bits_and_fallbacks_are_llama_cpps():
    assert [i for i in range(30) if use_more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert [fallback_type(t, 96) for t in ("Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q8_0")] == \
        ["Q5_0", "Q5_1", "Q8_0", "Q4_0", "Q8_0"]
    assert [fallback_type(t, 40) for t in ("Q4_K", "Q6_K", "Q4_0")] == ["F16", "F16", "F16"]


def test_mixes_are_llama_cpps_ftypes():
    if HAS_LLAMA_CPP:
        import llama_cpp

        assert {m.name: m.ftype for m in GGUF_MIXES.values()} == \
            {name: getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}") for name in GGUF_MIXES}
    assert {m.name: int(gguf.LlamaFileType[f"MOSTLY_{m.name}"]) for m in GGUF_MIXES.values()} == \
        {m.name: m.ftype for m in GGUF_MIXES.values()}
    assert mix_named("q4_k_m") is GGUF_MIXES["Q4_K_M"]
    with pytest.raises(ValueError, match=r"gguf_mix='Q3_K_M' is unknown: use one of 'Q4_0'"):
        mix_named("Q3_K_M")


def test_rules_for_tensors_that_are_not_matrices_and_for_ties():
    shapes = {"token_embd.weight": (64, 256), "position_embd.weight": (16, 256), "blk.0.attn_norm.weight": (256,),
              "blk.0.attn_qkv.weight": (768, 256), "blk.0.attn_qkv.bias": (768,), "blk.0.ffn_up.weight": (1, 256),
              "blk.0.ffn_down.weight": (256, 1024)}
    types = tensor_types("Q4_K_M", shapes, "gpt2", 1)
    # tied (no output.weight): token_embd gets the output's Q6_K; position embeddings, norms, biases and a
    # one-row matrix (one dimension for ggml) stay as stored; attn_qkv is counted with attn_v.
    assert types == {"token_embd.weight": "Q6_K", "position_embd.weight": None, "blk.0.attn_norm.weight": None,
                     "blk.0.attn_qkv.weight": "Q6_K", "blk.0.attn_qkv.bias": None, "blk.0.ffn_up.weight": None,
                     "blk.0.ffn_down.weight": "Q6_K"}
    untied = tensor_types("Q4_0", {**shapes, "output.weight": (64, 256)}, "gpt2", 1)
    assert (untied["token_embd.weight"], untied["output.weight"]) == ("Q4_0", "Q6_K")
    with pytest.raises(ValueError, match="Falcon"):
        tensor_types("Q4_K_M", shapes, "falcon", 1)
    with pytest.raises(ValueError, match="pass n_head and n_head_kv"):
        tensor_types("Q4_K_M", shapes, "llama", 80)


def test_thirty_layer_llama_q4_k_m_table():
    """The mix table of a 30-layer Llama: 4096-wide (every row a multiple of 256) and SmolLM2-135M's
    widths (576: Q4_K falls back to Q5_0, Q6_K to Q8_0)."""
    arch, n_layer, n_head, n_kv, shapes = SHAPE_CASES["llama_30_h4096"]
    types = tensor_types("Q4_K_M", shapes, arch, n_layer, n_head=n_head, n_head_kv=n_kv)
    more = [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    for i in range(30):
        assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down.weight"] == ("Q6_K" if i in more else "Q4_K")
        assert {types[f"blk.{i}.{p}.weight"] for p in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} == \
            {"Q4_K"}
    assert (types["token_embd.weight"], types["output.weight"]) == ("Q4_K", "Q6_K")
    arch, n_layer, n_head, n_kv, shapes = SHAPE_CASES["smollm2_135m"]
    smol = Counter(t for t in tensor_types("Q4_K_M", shapes, arch, n_layer, n_head=n_head, n_head_kv=n_kv).values()
                   if t)
    assert smol == {"Q5_0": 166, "Q4_K": 16, "Q6_K": 14, "Q8_0": 15}


# ----------------------------------------------------------------- the committed fixture


def test_fixture_was_made_from_these_models(reference, float_files):
    assert reference["llama_cpp_python"] and reference["ggml_commit"]
    for case, tensors in float_files.items():
        want = reference["cases"][case]["float"]
        got = {name: sha(data) for name, (_, _, data) in tensors.items()}
        assert got == want, f"{case}: the seeded float weights changed (numpy, torch or transformers): regenerate"


@pytest.mark.parametrize("case", list(MODEL_CASES) + list(SHAPE_CASES))
def test_tensor_types_equal_llama_cpps(case, reference, float_files):
    for mix in MIXES:
        chosen = reference["cases"][case]["mixes"][mix]
        if case in SHAPE_CASES:
            arch, n_layer, n_head, n_kv, shapes = SHAPE_CASES[case]
            mine = tensor_types(mix, shapes, arch, n_layer, n_head=n_head, n_head_kv=n_kv)
        else:
            mine = mixle_types(case, float_files[case], mix)
        assert {name: mine[name] or "F32" for name in chosen} == {name: t for name, (t, *_) in chosen.items()}, mix


def _bit_identical(case, tensors, chosen, cache):
    """``Counter((type, equal))`` over the tensors of one llama.cpp output file."""
    counts = Counter()
    for name, (ggml_type, digest) in chosen.items():
        values = tensors[name][2]
        counts[ggml_type, sha(mixle_bytes(values, ggml_type, cache)) == digest] += 1
    return counts


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_quantize_array_bytes_equal_llama_quantize(case, reference, float_files):
    """Every tensor of every mix: quantize_array of the F32 file's weight (its GGUF row order) on
    the type llama.cpp chose, packed, is llama.cpp's bytes."""
    cache, total = {}, Counter()
    for mix in MIXES:
        counts = _bit_identical(case, float_files[case], reference["cases"][case]["mixes"][mix], cache)
        assert not [key for key in counts if not key[1]], f"{case} {mix}: {counts}"
        total += counts
    assert sum(total.values()) == len(MIXES) * len(float_files[case])


@pytest.mark.parametrize("case, mix", [("llama_h256", "Q4_K_M"), ("llama_h256", "Q4_K_S"), ("qwen2_h64", "Q5_K_M"),
                                       ("gpt2_h64", "Q6_K"), ("gpt2_h40", "Q4_0"), ("qwen2_h64", "Q8_0")])
def test_save_gguf_with_a_mix_writes_llama_quantizes_file(case, mix, reference, tmp_path):
    import mixle

    model = MODEL_CASES[case][0](0)
    written = mixle.save_gguf(model, tmp_path / "m.gguf", gguf_mix=mix)
    tensors = read_tensors(tmp_path / "m.gguf")
    chosen = reference["cases"][case]["mixes"][mix]
    assert written == {name: t for name, (t, _) in chosen.items()}
    assert {name: (t, sha(data)) for name, (t, _, data) in tensors.items()} == {n: tuple(v) for n, v in chosen.items()}
    assert file_type_of(tmp_path / "m.gguf") == GGUF_MIXES[mix].ftype
    back = mixle.load_gguf_weights(model, tmp_path / "m.gguf")  # gguf-py reads every new block type
    assert all(torch.isfinite(p).all() for p in back.parameters())


def test_the_fixture_covers_every_block_type(reference):
    seen = Counter(t for case in reference["cases"].values() for mix in case["mixes"].values() for t, *_ in mix.values())
    assert {"Q4_0", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "F32"} <= set(seen)


# ---------------------------------------------------------------------- live llama.cpp


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (the llama extra)")
@pytest.mark.parametrize("case", ["llama_h256", "qwen2_h64", "gpt2_h40"])
def test_live_llama_quantize_matches_mixle(case, tmp_path):
    """Fresh weights (another seed): llama.cpp's types and bytes, tensor by tensor."""
    tensors = write_float_file(MODEL_CASES[case][0](7), tmp_path / "f32.gguf")
    cache = {}
    for mix in MIXES:
        llama_quantize(tmp_path / "f32.gguf", tmp_path / f"{mix}.gguf", mix)
        theirs = read_tensors(tmp_path / f"{mix}.gguf")
        mine = mixle_types(case, tensors, mix)
        assert {n: mine[n] or "F32" for n in theirs} == {n: t for n, (t, *_) in theirs.items()}, mix
        for name, (ggml_type, _, data) in theirs.items():
            assert sha(mixle_bytes(tensors[name][2], ggml_type, cache)) == sha(data), (mix, name, ggml_type)


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (the llama extra)")
def test_live_llama_quantize_still_gives_the_fixture(reference, float_files, tmp_path):
    case = "llama_h256"
    tensors = float_files[case]
    import mixle

    mixle.save_gguf(MODEL_CASES[case][0](0), tmp_path / "f32.gguf", float_matrices="f32")
    for mix in ("Q4_K_M", "Q5_K_S"):
        llama_quantize(tmp_path / "f32.gguf", tmp_path / "q.gguf", mix)
        got = {n: [t, sha(d)] for n, (t, _, d) in read_tensors(tmp_path / "q.gguf").items()}
        assert got == reference["cases"][case]["mixes"][mix]
    assert set(tensors) == set(got)
