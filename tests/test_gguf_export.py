"""save_gguf: read the file back with gguf-py, dequantize with gguf's own code, compare with mixle."""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from mixle.api import apply_qat, convert  # noqa: E402
from mixle.core.numerics import quantize_dequantize_array  # noqa: E402
from mixle.lm.data import CharTokenizer  # noqa: E402
from mixle.models.transformer import build_causal_lm  # noqa: E402
from mixle.task.quantize import save_gguf  # noqa: E402

VOCAB, D, LAYERS, HEADS, CONTEXT = 48, 64, 2, 4, 16
PARTS = {"norm1": "attn_norm", "qkv": "attn_qkv", "proj": "attn_output", "norm2": "ffn_norm", "fc": "ffn_up",
         "out": "ffn_down"}


def _lm(seed=0):
    torch.manual_seed(seed)
    lm = build_causal_lm(vocab=VOCAB, d_model=D, n_layer=LAYERS, n_head=HEADS, block=CONTEXT, activation="gelu_tanh")
    with torch.no_grad():  # non-zero biases and norms, so a swapped tensor would show
        for name, param in lm.named_parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return lm


def _read(path):
    """``{name: (ggml type name, float32 array in torch's (out, in) layout)}`` via gguf's dequantize."""
    reader = gguf.GGUFReader(path)
    out = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        out[tensor.name] = (tensor.tensor_type.name, np.asarray(values, dtype=np.float32).reshape(
            tuple(int(d) for d in reversed(tensor.shape))))
    return reader, out


def _field(reader, key):
    return reader.fields[key].contents()


def _expected(lm, weight_of):
    """The tensors the file must hold, computed from the model: ``{gguf name: float32 array}``."""
    want = {"token_embd.weight": weight_of(lm.tok), "position_embd.weight": lm.pos.weight,
            "output_norm.weight": lm.norm.weight, "output_norm.bias": lm.norm.bias}
    for i, block in enumerate(lm.blocks):
        for part, name in PARTS.items():
            module = getattr(block, part)
            want[f"blk.{i}.{name}.weight"] = module.weight if part.startswith("norm") else weight_of(module)
            want[f"blk.{i}.{name}.bias"] = module.bias
    return {k: v.detach().numpy() if isinstance(v, torch.Tensor) else v for k, v in want.items()}


def _fake_quantized(module):
    """What the QAT forward multiplies with: the fake-quantized weight (float layers: gguf's default Q8_0)."""
    if hasattr(module, "spec"):
        if hasattr(module, "quantized_weight"):
            return module.quantized_weight()
        from mixle.torch_backend.fake_quant import fake_quantized_weight

        return fake_quantized_weight(module.weight, module.spec)[0]
    # A float matrix: float_matrices='q8_0', checked against mixle's own q8_0 numerics.
    return quantize_dequantize_array(module.weight.detach(), bits=8, grid="q8_0")


def _assert_bitwise(got, want):
    for name in want:
        assert got[name][1].shape == want[name].shape, name
        np.testing.assert_array_equal(got[name][1].view(np.uint32), want[name].astype(np.float32).view(np.uint32),
                                      err_msg=name)


@pytest.mark.parametrize("grid", ["q4_0", "q8_0"])
def test_qat_model_tensors_are_its_fake_quantized_weights(grid, tmp_path):
    lm = apply_qat(_lm(), bits=4 if grid == "q4_0" else 8, grid=grid, exclude=(r"blocks\.1\.fc",))
    types = save_gguf(lm, tmp_path / "lm.gguf")
    reader, got = _read(tmp_path / "lm.gguf")
    assert set(got) == set(types) and "output.weight" not in got  # the tied head is stored once
    want = _expected(lm, _fake_quantized)
    assert set(got) == set(want)
    _assert_bitwise(got, want)
    ggml = grid.upper()
    assert got["token_embd.weight"][0] == got["blk.0.attn_qkv.weight"][0] == ggml
    assert got["blk.1.ffn_up.weight"][0] == "Q8_0"  # excluded from QAT: the float default
    assert got["blk.0.attn_qkv.bias"][0] == got["position_embd.weight"][0] == "F32"


def test_converted_model_writes_the_same_file_contents(tmp_path):
    qat_model = apply_qat(_lm(), grid="q4_0")
    converted = convert(qat_model)
    save_gguf(qat_model, tmp_path / "qat.gguf")
    save_gguf(converted, tmp_path / "converted.gguf")
    qat_reader, qat_tensors = _read(tmp_path / "qat.gguf")
    conv_reader, conv_tensors = _read(tmp_path / "converted.gguf")
    for a, b in zip(qat_reader.tensors, conv_reader.tensors):
        assert a.name == b.name and a.tensor_type == b.tensor_type and np.array_equal(a.data, b.data)
    _assert_bitwise(conv_tensors, _expected(converted, lambda m: m.dequantized_weight()))


def test_float_model_and_float_matrix_options(tmp_path):
    lm = _lm()
    save_gguf(lm, tmp_path / "f32.gguf", float_matrices="f32")
    _, got = _read(tmp_path / "f32.gguf")
    _assert_bitwise(got, _expected(lm, lambda m: m.weight))
    save_gguf(lm, tmp_path / "f16.gguf", float_matrices="f16")
    _, got = _read(tmp_path / "f16.gguf")
    assert got["blk.0.ffn_down.weight"][0] == "F16"
    want = lm.blocks[0].out.weight.detach().numpy().astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got["blk.0.ffn_down.weight"][1], want)


def _gpt2_logits(tensors, ids, heads, eps):
    """llama.cpp's gpt2 graph in numpy from the file's tensors (tanh GELU, as ggml_gelu)."""
    t = {name: value for name, (_, value) in tensors.items()}

    def norm(x, name):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + eps) * t[name + ".weight"] + t[name + ".bias"]

    def dense(x, name):
        return x @ t[name + ".weight"].T + t[name + ".bias"]

    x = t["token_embd.weight"][ids] + t["position_embd.weight"][: len(ids)]
    n, width = x.shape
    hd = width // heads
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(LAYERS):
        q, k, v = np.split(dense(norm(x, f"blk.{i}.attn_norm"), f"blk.{i}.attn_qkv"), 3, axis=-1)
        out = np.empty_like(q)
        for h in range(heads):
            cols = slice(h * hd, (h + 1) * hd)
            scores = q[:, cols] @ k[:, cols].T / np.sqrt(hd) + mask
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, cols] = (weights / weights.sum(-1, keepdims=True)) @ v[:, cols]
        x = x + dense(out, f"blk.{i}.attn_output")
        up = dense(norm(x, f"blk.{i}.ffn_norm"), f"blk.{i}.ffn_up")
        gelu = 0.5 * up * (1 + np.tanh(math.sqrt(2 / math.pi) * (up + 0.044715 * up**3)))
        x = x + dense(gelu, f"blk.{i}.ffn_down")
    return norm(x, "output_norm") @ t["token_embd.weight"].T  # no output.weight: the tied head


def test_file_computes_the_qat_forward(tmp_path):
    """The layout (qkv order, head split, tied head) is right: the file's gpt2 graph gives mixle's logits."""
    lm = apply_qat(_lm(), grid="q4_0")
    save_gguf(lm, tmp_path / "lm.gguf")
    reader, tensors = _read(tmp_path / "lm.gguf")
    ids = np.array([3, 17, 0, 47, 5, 5, 12, 30, 1, 9])
    with torch.no_grad():
        want = lm(torch.from_numpy(ids)[None], all_positions=True)[0].numpy()
    got = _gpt2_logits({k: (a, v.astype(np.float64)) for k, (a, v) in tensors.items()}, ids, HEADS,
                       float(_field(reader, "gpt2.attention.layer_norm_epsilon")))
    # float32 torch vs float64 numpy through 2 blocks of width 64-256: rounding ~1e-6 relative.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, np.abs(want).max()))


def test_metadata_llama_cpp_needs_for_gpt2(tmp_path):
    text = "hello, gguf world\n"
    tokenizer = CharTokenizer(text)
    lm = apply_qat(build_causal_lm(vocab=tokenizer.vocab_size, d_model=32, n_layer=1, n_head=2, block=8,
                                   activation="gelu_tanh"), grid="q4_0")
    save_gguf(lm, tmp_path / "lm.gguf", tokenizer=tokenizer)
    reader = gguf.GGUFReader(tmp_path / "lm.gguf")
    expected = {"general.architecture": "gpt2", "gpt2.context_length": 8, "gpt2.embedding_length": 32,
                "gpt2.block_count": 1, "gpt2.feed_forward_length": 128, "gpt2.attention.head_count": 2,
                "tokenizer.ggml.model": "gpt2", "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q4_0)}
    assert {key: _field(reader, key) for key in expected} == expected
    assert _field(reader, "gpt2.attention.layer_norm_epsilon") == pytest.approx(1e-5, rel=1e-6)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    # GPT-2's byte-level strings: a space is "Ġ", a newline "Ċ"; ids follow the tokenizer's.
    assert tokens == [{" ": "Ġ", "\n": "Ċ"}.get(ch, ch) for ch in tokenizer.chars]
    assert _field(reader, "tokenizer.ggml.token_type") == [1] * tokenizer.vocab_size
    assert len(_field(reader, "tokenizer.ggml.merges")) >= 1  # llama.cpp refuses gpt2 without merges


def test_erf_gelu_is_refused_unless_accepted_and_the_written_epsilon_is_the_models(tmp_path):
    erf = build_causal_lm(vocab=VOCAB, d_model=D, n_layer=LAYERS, n_head=HEADS, block=CONTEXT)
    with pytest.raises(ValueError, match=r"blocks \[0, 1\] use activation='gelu'.*activation='gelu_tanh'.*"
                                         r"allow_activation_mismatch=True"):
        save_gguf(erf, tmp_path / "erf.gguf")
    assert not (tmp_path / "erf.gguf").exists()
    save_gguf(erf, tmp_path / "erf.gguf", allow_activation_mismatch=True)
    lm = _lm()
    for module in lm.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = 3e-6
    save_gguf(lm, tmp_path / "lm.gguf")
    eps = _field(gguf.GGUFReader(tmp_path / "lm.gguf"), "gpt2.attention.layer_norm_epsilon")
    assert eps == np.float32(3e-6)  # stored as float32, the precision ggml's norm computes in
    lm.blocks[1].norm2.eps = 1e-5
    with pytest.raises(ValueError, match=r"layer 'blocks.1.norm2' has eps=1e-05, another norm eps=3e-06"):
        save_gguf(lm, tmp_path / "lm.gguf")


def test_vocabulary_merges_come_from_the_tokens():
    from mixle.gguf.vocab import vocabulary

    words = vocabulary(4, vocab=["a", "b", "ab", "b a"])
    assert words.tokens == ["a", "b", "ab", "bĠa"] and words.merges == ["a b"]
    assert vocabulary(3).tokens == ["<|0|>", "<|1|>", "<|2|>"]
    assert vocabulary(3).merges == ["<|0|> <|1|>"]  # the placeholder merge llama.cpp needs to load


@pytest.mark.parametrize("prepare, words", [
    (lambda lm: apply_qat(lm, bits=4, exclude=("head",)), r"layer 'blocks.0.qkv' is quantized on "
                                                          r"int4/channel/symmetric, which GGUF has no block type"),
    (lambda lm: torch.nn.Sequential(lm.blocks[0]), r"build_causal_lm \(llama.cpp's 'gpt2' architecture\)"),
    (lambda lm: _big_weight(apply_qat(lm, grid="q4_0")), r"layer 'blocks.1.fc': a block scale does not fit float16"),
])
def test_unwritable_models_are_refused_before_the_file_exists(prepare, words, tmp_path):
    path = tmp_path / "lm.gguf"
    path.write_bytes(b"previous contents")
    with pytest.raises(ValueError, match=words):
        save_gguf(prepare(_lm()), path)
    assert path.read_bytes() == b"previous contents"
    assert [p.name for p in tmp_path.iterdir()] == ["lm.gguf"]  # no partial file left


def _big_weight(lm):
    with torch.no_grad():
        lm.blocks[1].fc.weight[3, 5] = 1e6
    return lm


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(vocab=["a"] * 3), ValueError, r"vocab has 3 tokens but the model's embedding has 48 rows"),
    (dict(vocab=[f"t{i}" for i in range(47)] + ["t0"]), ValueError, r"repeated tokens"),
    (dict(float_matrices="q4_0"), ValueError, r"float_matrices='q4_0' is unknown"),
    (dict(tokenizer=object()), TypeError, r"not a mixle CharTokenizer"),
    (dict(vocab=["a"] * 48, tokenizer=CharTokenizer("ab")), ValueError, r"not both"),
])
def test_bad_arguments_are_refused(kwargs, error, words, tmp_path):
    with pytest.raises(error, match=words):
        save_gguf(_lm(), tmp_path / "lm.gguf", **kwargs)
    assert not (tmp_path / "lm.gguf").exists()


def test_face_imports_gguf_only_when_called():
    code = "import sys, mixle.task.quantize as q; q.save_gguf; print('gguf' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


# ----------------------------------------------------------------------------------------------
# Any llama.cpp grid, given per layer as a QuantizedArray (the entry point the torch wiring uses),
# and the refusals.

from mixle.core.numerics import quantize_array  # noqa: E402

# layer -> grid: ffn_down rows hold 256 values (the K-quants), the others 64 (the 32-blocks).
NEW_BLOCKS = {"blocks.0.out": "q4_k", "blocks.1.out": "q6_k", "blocks.0.fc": "q4_1", "blocks.0.qkv": "q5_0",
              "blocks.1.qkv": "q5_1", "blocks.1.fc": "mxfp4", "blocks.0.proj": "q8_0", "blocks.1.proj": "q4_0"}


def _module(lm, path):
    return lm.get_submodule(path)


def test_quantized_arrays_on_every_ggml_grid_are_written_as_their_blocks(tmp_path):
    lm = _lm()
    arrays = {path: quantize_array(_module(lm, path).weight.detach(), grid=grid) for path, grid in NEW_BLOCKS.items()}
    types = save_gguf(lm, tmp_path / "lm.gguf", quantized=arrays, float_matrices="f32")
    reader, got = _read(tmp_path / "lm.gguf")
    index = {"qkv": "attn_qkv", "proj": "attn_output", "fc": "ffn_up", "out": "ffn_down"}
    for path, grid in NEW_BLOCKS.items():
        _, block, part = path.split(".")
        name = f"blk.{block}.{index[part]}.weight"
        assert types[name] == got[name][0] == grid.upper()
        want = arrays[path].dequantize().numpy()  # gguf-py's dequantize of the file's blocks == the record's
        np.testing.assert_array_equal(got[name][1].view(np.uint32), want.view(np.uint32), err_msg=name)
    assert _field(reader, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q4_0)
    back = load_gguf_weights(lm, tmp_path / "lm.gguf")
    for path in NEW_BLOCKS:
        torch.testing.assert_close(_module(back, path).weight, arrays[path].dequantize(), rtol=0, atol=0)


def test_a_mix_with_qat_layers_on_its_types(tmp_path):
    from mixle.gguf.writer import gguf_mix_specs, gguf_mix_types

    lm = _lm()
    specs = gguf_mix_specs(lm, "Q4_K_M")
    types = gguf_mix_types(lm, "Q4_K_M")
    assert specs["head"] == specs["tok"] and specs["tok"].grid == "q8_0"  # tied, rows of 64: Q8_0
    # ffn_down: use_more_bits picks layer 1 of 2 (Q6_K); ffn_up's rows of 64 fall back from Q4_K to Q5_0.
    assert (specs["blocks.0.out"].grid, specs["blocks.1.out"].grid, specs["blocks.0.fc"].grid) == ("q4_k", "q6_k", "q5_0")
    arrays = {path: quantize_array(_module(lm, path).weight.detach(), spec) for path, spec in specs.items()
              if path != "head"}
    written = save_gguf(lm, tmp_path / "mix.gguf", gguf_mix="Q4_K_M", quantized=arrays)
    assert written == {name: t or "F32" for name, t in types.items()}
    save_gguf(lm, tmp_path / "float.gguf", gguf_mix="Q4_K_M")  # the float model: the same file
    for a, b in zip(gguf.GGUFReader(tmp_path / "mix.gguf").tensors, gguf.GGUFReader(tmp_path / "float.gguf").tensors):
        assert a.name == b.name and a.tensor_type == b.tensor_type and np.array_equal(a.data, b.data)


@pytest.mark.parametrize("kwargs, words", [
    (lambda lm: dict(quantized={"blocks.0.fc": quantize_array(lm.blocks[0].fc.weight.detach(), bits=4)}),
     r"layer 'blocks.0.fc' is quantized on int4/channel/symmetric, which GGUF has no block type"),
    (lambda lm: dict(quantized={"blocks.0.out": quantize_array(lm.blocks[0].out.weight.detach(), grid="nf4")}),
     r"layer 'blocks.0.out' is quantized on int4/group64/nf4, which GGUF has no block type"),
    (lambda lm: dict(quantized={"blocks.9.fc": quantize_array(lm.blocks[0].fc.weight.detach(), grid="q4_1")}),
     r"quantized names \['blocks.9.fc'\], which are not weight matrices save_gguf writes"),
    (lambda lm: dict(quantized={"blocks.0.fc": quantize_array(lm.blocks[0].proj.weight.detach(), grid="q4_1")}),
     r"quantized\['blocks.0.fc'\] has shape \[64, 64\], but the layer's weight is \[256, 64\]"),
    (lambda lm: dict(gguf_mix="Q4_K_M",
                     quantized={"blocks.1.out": quantize_array(lm.blocks[1].out.weight.detach(), grid="q4_k")}),
     r"layer 'blocks.1.out' is quantized on int4/group256/q4_k \(Q4_K\), but llama.cpp's quantizer gives "
     r"'blk.1.ffn_down.weight' Q6_K in this gguf_mix: train it on grid='q6_k'"),
    (lambda lm: dict(gguf_mix="Q4_K_M", float_matrices="f32"), r"float_matrices='f32' and gguf_mix='Q4_K_M'"),
    (lambda lm: dict(gguf_mix="Q2_K"), r"gguf_mix='Q2_K' is unknown"),
])
def test_what_gguf_cannot_hold_is_refused_naming_the_layer(kwargs, words, tmp_path):
    lm = _lm()
    with pytest.raises(ValueError, match=words):
        save_gguf(lm, tmp_path / "lm.gguf", **kwargs(lm))
    assert not (tmp_path / "lm.gguf").exists()
    with pytest.raises(TypeError, match=r"quantized must be \{layer path: QuantizedArray\}"):
        save_gguf(lm, tmp_path / "lm.gguf", quantized={"blocks.0.fc": lm.blocks[0].fc.weight})


def test_a_qat_layer_off_the_mixs_type_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"layer 'tok' is quantized on int4/group32/q4_0 \(Q4_0\), but llama.cpp's "
                                         r"quantizer gives 'token_embd.weight' Q8_0 in this gguf_mix"):
        save_gguf(apply_qat(_lm(), grid="q4_0"), tmp_path / "lm.gguf", gguf_mix="Q4_K_M")


# ----------------------------------------------------------------------------------------------
# load_gguf_weights refuses files it cannot trust, naming the tensor and the file.

from mixle.task.quantize import load_gguf_weights  # noqa: E402


@pytest.fixture
def q4_file(tmp_path):
    lm = _lm()
    save_gguf(apply_qat(_lm(), grid="q4_0"), tmp_path / "lm.gguf")
    return lm, tmp_path / "lm.gguf"


def test_a_truncated_file_is_refused_naming_the_tensor(q4_file, tmp_path):
    lm, path = q4_file
    data = path.read_bytes()
    last = gguf.GGUFReader(path).tensors[-1]
    (tmp_path / "cut.gguf").write_bytes(data[: last.data_offset + 10])
    with pytest.raises(ValueError, match=rf"cut.gguf' cannot be read as a GGUF file: tensor {last.name!r} needs bytes "
                                         rf"{last.data_offset}\.\.\d+, but the file ends at {last.data_offset + 10}: "
                                         rf"it is truncated"):
        load_gguf_weights(lm, tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:200])
    with pytest.raises(ValueError, match=r"head.gguf' cannot be read as a GGUF file: its header is cut short"):
        load_gguf_weights(lm, tmp_path / "head.gguf")


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_nan_or_inf_block_scale_is_refused(q4_file, tmp_path, value):
    lm, path = q4_file
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_up.weight")
    data = bytearray(path.read_bytes())
    offset = tensor.data_offset + 3 * 18  # the d of the fourth Q4_0 block: rows of 64 hold two
    data[offset:offset + 2] = np.array([value], "<f2").tobytes()
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"tensor 'blk.1.ffn_up.weight' of '.*bad.gguf' holds a NaN or infinite "
                                         rf"float16 block scale \(row 1, block 1: d = {value}\): the file is corrupt"):
        load_gguf_weights(lm, tmp_path / "bad.gguf")


def test_nan_values_and_misfit_shapes_are_refused(tmp_path):
    lm = _lm()
    save_gguf(lm, tmp_path / "f32.gguf", float_matrices="f32")
    tensor = next(t for t in gguf.GGUFReader(tmp_path / "f32.gguf").tensors if t.name == "blk.0.ffn_down.weight")
    data = bytearray((tmp_path / "f32.gguf").read_bytes())
    data[tensor.data_offset + 8:tensor.data_offset + 12] = np.array([np.nan], "<f4").tobytes()
    (tmp_path / "nan.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_down.weight' of '.*nan.gguf' holds NaN or infinity "
                                         r"\(F32 value nan at \[0, 2\]\)"):
        load_gguf_weights(lm, tmp_path / "nan.gguf")
    torch.manual_seed(0)
    other = build_causal_lm(vocab=VOCAB, d_model=32, n_layer=LAYERS, n_head=HEADS, block=CONTEXT,
                            activation="gelu_tanh")
    with pytest.raises(ValueError, match=r"tensor 'token_embd.weight' of '.*f32.gguf' has shape \[48, 64\], but "
                                         r"'tok' has \[48, 32\]: the file was written for another configuration"):
        load_gguf_weights(other, tmp_path / "f32.gguf")


def test_a_file_that_is_not_gguf_is_refused_naming_it(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(200))
    with pytest.raises(ValueError, match=r"x.gguf' cannot be read as a GGUF file: its first bytes are b'PK\\x03\\x04', "
                                         r"not GGUF's magic"):
        load_gguf_weights(_lm(), tmp_path / "x.gguf")


def test_a_float_weight_too_large_for_the_mixs_float16_scales_is_refused_naming_it(tmp_path):
    lm = _lm()
    with torch.no_grad():
        lm.blocks[0].out.weight[2, 7] = 1e9
    with pytest.raises(ValueError, match=r"layer 'blocks.0.out': a block scale does not fit float16, which "
                                         r"grid='q4_k' stores it in"):
        save_gguf(lm, tmp_path / "lm.gguf", gguf_mix="Q4_K_M")
    assert not (tmp_path / "lm.gguf").exists()
