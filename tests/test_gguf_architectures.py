"""Every dense decoder architecture against llama.cpp's own converter and quantizer.

For each case (a tiny seeded transformers model of the architecture, rows of 256 so that the
K-quants apply), mixle QAT-wraps the model on a llama.cpp mix (``apply_qat(gguf_mix=...)``) and writes
it with ``save_gguf(..., gguf_mix=...)``. The oracle: the same float weights saved as a transformers
checkpoint, converted by llama.cpp's ``convert_hf_to_gguf.py`` to F32 and quantized by
``llama-quantize`` to the same mix (the llama.cpp vendored by llama-cpp-python 0.3.36's sdist). Same
tensor names, types and shapes, bit-identical bytes, and the same inference metadata (the
``<arch>.*`` keys, with llama.cpp's defaults filled in where one file leaves a key to them).

CI has neither tool, so ``benchmarks/make_arch_fixtures.py`` ran them once and stored llama.cpp's side
(``tests/fixtures/arch_reference.json``); the live test reruns the comparison when the converter
(``MIXLE_LLAMA_CPP_SOURCE`` or the sdist unpacked under ``/tmp/llsdist``) and ``llama-quantize``
(``MIXLE_LLAMA_CPP_BUILD`` or ``/tmp/llbuild``) are here. The tokenizer is not compared (the
converter is given a minimal vocabulary; ``tests/test_gguf_tokenizer.py`` covers tokenizers).
"""

import copy
import glob
import hashlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

import mixle
from tests.test_gguf_mixes import seeded
from tests.test_imatrix import build_dir

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = "tests/fixtures/arch_reference.json"
MIXES = ("Q4_K_M", "Q4_0")
BASE = dict(vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

# case -> (transformers family, config fields beyond BASE): every record of
# mixle.gguf.architectures.DECODERS that is not a mixture of experts (those: tests/test_gguf_moe.py).
CASES = {
    "llama": ("Llama", dict(tie_word_embeddings=False)),
    "llama_tied_bias": ("Llama", dict(tie_word_embeddings=True, attention_bias=True)),
    "mistral": ("Mistral", dict(sliding_window=None)),
    "qwen2": ("Qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3", dict(head_dim=64, tie_word_embeddings=False)),
    "gemma2": ("Gemma2", dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=16, **TOKENS)),
    "gemma3": ("Gemma3", dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=16, num_hidden_layers=6,
                              **TOKENS)),
    "gemma3_untied": ("Gemma3", dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=16, tie_word_embeddings=False,
                                     final_logit_softcapping=30.0, **TOKENS)),
    "phi3": ("Phi3", dict(**TOKENS)),
    "olmo2": ("Olmo2", dict(tie_word_embeddings=False, **TOKENS)),
    "smollm3": ("SmolLM3", dict(**TOKENS)),
}


def model_of(case, seed=0):
    """The seeded float model of ``case`` (numpy's generator: stable across torch versions)."""
    family, fields = CASES[case]
    config_class = transformers.Gemma3TextConfig if family == "Gemma3" else getattr(transformers, f"{family}Config")
    model = getattr(transformers, f"{family}ForCausalLM")(config_class(**{**BASE, **fields}))
    return seeded(model, seed)


def sha(data):
    return hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()


def _value(field):
    value = field.contents()
    return [float(v) if isinstance(v, float) else v for v in value] if isinstance(value, list) else value


def inference_metadata(reader):
    """``{key: value}`` of a file's ``<arch>.*`` keys and file type, with llama.cpp's defaults for the
    keys it fills in itself (head_count_kv, key/value length, rope dimensions and base)."""
    arch = reader.fields["general.architecture"].contents()
    meta = {key[len(arch) + 1:]: _value(field) for key, field in reader.fields.items() if key.startswith(arch + ".")}
    heads, width = meta["attention.head_count"], meta["embedding_length"]
    for key, value in (("attention.head_count_kv", heads), ("attention.key_length", width // heads),
                       ("attention.value_length", width // heads), ("rope.freq_base", 10000.0)):
        meta.setdefault(key, value)
    meta.setdefault("rope.dimension_count", meta["attention.key_length"])
    meta["general.architecture"] = arch
    meta["general.file_type"] = int(reader.fields["general.file_type"].contents())
    return meta


def summary(path):
    """``{"tensors": {name: [type, shape, sha256]}, "metadata": inference_metadata}`` of a GGUF file."""
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: [t.tensor_type.name, [int(d) for d in reversed(t.shape)], sha(np.asarray(t.data))]
               for t in reader.tensors}
    return {"tensors": tensors, "metadata": inference_metadata(reader)}


def mixle_file(case, mix, path):
    """mixle's file of the case: the seeded model QAT-wrapped on ``mix``, written by save_gguf."""
    qat = mixle.apply_qat(copy.deepcopy(model_of(case)), gguf_mix=mix)
    mixle.save_gguf(qat, path, gguf_mix=mix)
    return summary(path)


# The structurally new cases, also with an importance matrix (llama-quantize --imatrix's weighted search
# and types): a seeded one, so that the fixture does not depend on torch's float sums.
IMATRIX_CASES = ("gemma3", "olmo2", "phi3", "qwen3")


def known_importance(case):
    """A seeded ``Imatrix`` over the case's matrices (gguf names; squares over six decades, some zero)."""
    from mixle.core.imatrix import Imatrix
    from mixle.gguf.plan import plan_of

    plan = plan_of(model_of(case))
    names = sorted(name for found in plan.imatrix_names.values() for name in found)
    sums, counts = {}, {}
    for index, name in enumerate(names):
        rng = np.random.default_rng(2000 + index)
        cols = plan.matrix_shapes[name][-1]
        values = rng.standard_normal(cols) ** 2 * 10.0 ** rng.uniform(-3, 3, cols) * 320
        values[rng.random(cols) < 0.05] = 0.0
        sums[name], counts[name] = values.astype(np.float32)[None], np.array([320])
    return Imatrix(sums, counts, ("seeded",), 10, 32)


def mixle_imatrix_file(case, mix, path):
    """mixle's file of the case QAT-wrapped on ``mix`` with the seeded importance matrix."""
    qat = mixle.apply_qat(copy.deepcopy(model_of(case)), gguf_mix=mix, importance=known_importance(case))
    mixle.save_gguf(qat, path, gguf_mix=mix)
    return summary(path)


def compare(mine, reference):
    """The differences between two summaries (empty when the files agree on everything that matters)."""
    problems = []
    mine_meta, ref_meta = dict(mine["metadata"]), dict(reference["metadata"])
    if "vocab_size" not in ref_meta:  # llama.cpp reads the vocabulary's size from the tokenizer
        mine_meta.pop("vocab_size", None)
    if mine_meta != ref_meta:
        keys = sorted(set(mine_meta) | set(ref_meta))
        problems += [f"metadata {k}: mixle {mine_meta.get(k)!r}, llama.cpp {ref_meta.get(k)!r}" for k in keys
                     if mine_meta.get(k) != ref_meta.get(k)]
    names = sorted(set(mine["tensors"]) | set(reference["tensors"]))
    problems += [f"tensor {n}: mixle {mine['tensors'].get(n)}, llama.cpp {reference['tensors'].get(n)}" for n in names
                 if mine["tensors"].get(n) != reference["tensors"].get(n)]
    return problems


# ------------------------------------------------------------------------------ llama.cpp's side


def llama_cpp_source():
    """The llama.cpp source tree holding convert_hf_to_gguf.py (None if absent)."""
    found = [os.environ.get("MIXLE_LLAMA_CPP_SOURCE")] + sorted(glob.glob("/tmp/llsdist/*/vendor/llama.cpp"))
    return next((p for p in found if p and os.path.isfile(os.path.join(p, "convert_hf_to_gguf.py"))), None)


# The converter, with every family's set_vocab replaced by a minimal vocabulary (the tokenizer is
# not what is compared, and a tiny tokenizer's pre-tokenizer is not one the converter knows).
_CONVERT = r"""
import sys
source, model_dir, out = sys.argv[1:4]
sys.path[:0] = [source + "/gguf-py", source]
import convert_hf_to_gguf

def set_vocab(self):
    n = self.hparams["vocab_size"]
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("default")
    self.gguf_writer.add_token_list([f"<{i}>" for i in range(n)])
    self.gguf_writer.add_token_types([1] * n)

find = convert_hf_to_gguf.get_model_class

def model_class(*args, **kwargs):
    found = find(*args, **kwargs)
    found.set_vocab = set_vocab
    return found

convert_hf_to_gguf.get_model_class = model_class
sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outfile", out, "--outtype", "f32"]
convert_hf_to_gguf.main()
"""


def checkpoint(case, directory):
    """The case's float weights as a transformers checkpoint, with a tokenizer.json of its vocabulary
    (Gemma 3's converter counts its rows there)."""
    model = model_of(case)
    model.save_pretrained(directory)
    n = model.config.vocab_size
    with open(os.path.join(directory, "tokenizer.json"), "w") as handle:
        json.dump({"model": {"type": "BPE", "vocab": {f"<{i}>": i for i in range(n)}, "merges": []},
                   "added_tokens": []}, handle)


def llama_cpp_files(case, directory, source, build, mixes=MIXES):
    """``{mix: path}`` of llama.cpp's files of the case: convert_hf_to_gguf.py to F32, then llama-quantize;
    for ``IMATRIX_CASES`` also ``{"<mix>+imatrix": path}``, llama-quantize --imatrix of the seeded matrix."""
    from mixle.gguf.imatrix_file import write_imatrix

    hf, f32 = os.path.join(directory, "hf"), os.path.join(directory, "f32.gguf")
    checkpoint(case, hf)
    subprocess.run([sys.executable, "-c", _CONVERT, source, hf, f32], check=True, capture_output=True, cwd=source)
    files, imatrix = {}, os.path.join(directory, "known.imatrix.gguf")
    if case in IMATRIX_CASES:
        write_imatrix(imatrix, known_importance(case))
    for mix in mixes:
        for label, extra in ((mix, []), (f"{mix}+imatrix", ["--imatrix", imatrix])):
            if extra and case not in IMATRIX_CASES:
                continue
            files[label] = os.path.join(directory, f"{label}.gguf")
            subprocess.run([os.path.join(build, "bin", "llama-quantize"), *extra, f32, files[label], mix], check=True,
                           capture_output=True)
    return files


# ------------------------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def reference():
    path = ROOT / FIXTURE
    if not path.exists():
        pytest.fail(f"{FIXTURE} is missing: run `python benchmarks/make_arch_fixtures.py`")
    return json.loads(path.read_text())


def test_the_fixture_covers_every_dense_record(reference):
    from mixle.gguf.architectures import DECODERS

    dense = {name for name, record in DECODERS.items() if not record.experts}
    assert {type(model_of(case)).__name__ for case in CASES} == dense
    assert set(reference["cases"]) == set(CASES)


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_save_gguf_writes_llama_cpps_file(case, mix, reference, tmp_path):
    """mixle's QAT file = convert_hf_to_gguf.py + llama-quantize of the same float weights."""
    assert compare(mixle_file(case, mix, tmp_path / "mine.gguf"), reference["cases"][case][mix]) == []


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("case", IMATRIX_CASES)
def test_save_gguf_with_an_importance_matrix_writes_llama_quantize_imatrix_file(case, mix, reference, tmp_path):
    """apply_qat(gguf_mix=, importance=) + save_gguf = llama-quantize --imatrix of the converter's file."""
    mine = mixle_imatrix_file(case, mix, tmp_path / "mine.gguf")
    assert compare(mine, reference["cases"][case][f"{mix}+imatrix"]) == []


def _mixle_file(case, label, path):
    mix, _, imatrix = label.partition("+")
    return mixle_imatrix_file(case, mix, path) if imatrix else mixle_file(case, mix, path)


@pytest.mark.skipif(llama_cpp_source() is None or build_dir() is None,
                    reason="no llama.cpp source (convert_hf_to_gguf.py) or build (llama-quantize)")
@pytest.mark.parametrize("case", sorted(CASES))
def test_live_llama_cpp_writes_the_same_file(case, tmp_path):
    files = llama_cpp_files(case, str(tmp_path), llama_cpp_source(), build_dir())
    for label, path in files.items():
        assert compare(_mixle_file(case, label, tmp_path / f"mine.{label}.gguf"), summary(path)) == [], label


# ------------------------------------------------------------------- records, refusals, training


def test_every_record_names_a_llama_cpp_architecture_and_its_tensors():
    from mixle.gguf.architectures import DECODERS

    names = set(gguf.MODEL_ARCH_NAMES.values())
    assert {record.arch for record in DECODERS.values()} <= names
    for record in DECODERS.values():
        arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[record.arch]
        assert gguf.MODEL_TENSOR.TOKEN_EMBD in gguf.MODEL_TENSORS[arch]


def test_a_record_is_validated_when_made():
    from mixle.gguf.architectures import DecoderArch

    with pytest.raises(ValueError, match="metadata must be a tuple of names"):
        DecoderArch(hf_class="XForCausalLM", arch="x", metadata=("no_such_key",))
    with pytest.raises(ValueError, match="norm_offset=2"):
        DecoderArch(hf_class="XForCausalLM", arch="x", norm_offset=2)
    with pytest.raises(ValueError, match="swa_period and the 'swa_pattern' check"):
        DecoderArch(hf_class="XForCausalLM", arch="x", swa_period=2)
    with pytest.raises(ValueError, match="hf_class must name"):
        DecoderArch(hf_class="Llama", arch="llama")


# case, config change, what the refusal says: knobs llama.cpp's graph for the architecture does not implement
REFUSALS = [
    ("mistral", dict(sliding_window=16), r"sliding_window=16 \(llama.cpp's 'llama' graph attends to every"),
    ("qwen3", dict(attention_bias=True), r"attention_bias=True \(llama.cpp's qwen3 graph has no o_proj bias"),
    ("gemma2", dict(query_pre_attn_scalar=32), r"query_pre_attn_scalar=32 .* 1/sqrt\(64\)"),
    ("gemma2", dict(attn_logit_softcapping=None), r"attn_logit_softcapping=None"),
    ("gemma2", dict(tie_word_embeddings=False), r"not tied to the token embedding"),
    ("gemma3", dict(layer_types=["full_attention"] * 6), r"layer_types=.*every 6th layer global"),
    ("gemma3", dict(attn_logit_softcapping=20.0), r"does not soft-cap attention"),
    ("gemma3", dict(hidden_activation="gelu"), r"hidden_act='gelu' \(llama.cpp computes tanh-approximated GELU"),
    ("olmo2", dict(tie_word_embeddings=True), r"tied to the token embedding, but llama.cpp's graph reads a separate"),
    ("smollm3", dict(no_rope_layers=[1, 0]), r"no_rope_layers=\[1, 0\]"),
    ("phi3", dict(sliding_window=32), r"sliding_window=32"),
    ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), r"rotary embedding is scaled"),
    ("qwen2", dict(max_window_layers=1), None),  # a knob of a sliding window it does not use: written
]


@pytest.mark.parametrize("case, change, message", REFUSALS)
def test_knobs_llama_cpp_does_not_implement_are_refused_before_writing(case, change, message, tmp_path):
    family, fields = CASES[case]
    config_class = transformers.Gemma3TextConfig if family == "Gemma3" else getattr(transformers, f"{family}Config")
    model = getattr(transformers, f"{family}ForCausalLM")(config_class(**{**BASE, **fields, **change}))
    path = tmp_path / "m.gguf"
    if message is None:
        mixle.save_gguf(model, path, float_matrices="f32")
        return
    with pytest.raises(ValueError, match=message):
        mixle.save_gguf(model, path, float_matrices="f32")
    assert not path.exists()


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_gemma_scaled_embedding_keeps_its_scale_through_qat_and_convert(case, tmp_path, exact_converted_layers):
    """Gemma multiplies token embeddings by sqrt(hidden): the QAT layer (tied to the head) and the
    converted one keep that, so the fake-quant toggle is exact and convert equals QAT."""
    model = model_of(case)
    ids = torch.arange(48).reshape(2, 24) % 64
    qat = mixle.apply_qat(copy.deepcopy(model), gguf_mix="Q4_0")
    assert type(qat.model.embed_tokens).__name__ == "QATScaledEmbedding"
    with torch.no_grad():
        float_logits = model(ids).logits
        mixle.set_fake_quant_enabled(qat, False)
        assert torch.equal(qat(ids).logits, float_logits)
        mixle.set_fake_quant_enabled(qat, True)
        trained = qat(ids).logits
        converted = mixle.convert(qat)
        assert torch.equal(converted(ids).logits, trained)
        mixle.save_quantized(converted, tmp_path / "q.safetensors")
        back = mixle.load_quantized(tmp_path / "q.safetensors", copy.deepcopy(model))
        assert back.model.embed_tokens.embedding_scale == float(model.model.embed_tokens.embed_scale)
        assert torch.equal(back(ids).logits, trained)


@pytest.mark.parametrize("case", ["gemma3", "phi3", "olmo2"])
def test_load_gguf_weights_reads_the_file_back_as_llama_cpp_multiplies(case, tmp_path):
    """The norm offset (Gemma's 1 + w) and the row order are undone on reading."""
    model = model_of(case)
    mixle.save_gguf(model, tmp_path / "f32.gguf", float_matrices="f32")
    back = mixle.load_gguf_weights(model, tmp_path / "f32.gguf")
    offset = 1.0 if case.startswith("gemma") else 0.0
    for (name, mine), (_, theirs) in zip(model.state_dict().items(), back.state_dict().items()):
        if name.endswith("norm.weight"):  # what the model multiplies with: 1 + w for Gemma (w + 1 - 1 may round)
            mine, theirs = mine + offset, theirs + offset
        assert torch.equal(mine, theirs), name


@pytest.mark.skipif(llama_cpp_source() is None or build_dir() is None,
                    reason="no llama.cpp source (convert_hf_to_gguf.py) or build (llama-quantize)")
@pytest.mark.parametrize("case", ["gemma3", "phi3", "qwen3"])
def test_live_importance_matrix_quantizes_as_llama_quantize_imatrix(case, tmp_path):
    """calibrate_importance -> save_imatrix -> llama-quantize --imatrix (of the converter's F32 file)
    equals quantize_model(..., importance=) -> save_gguf, every tensor."""
    from tests.test_imatrix import llama_quantize_imatrix

    model = model_of(case)
    ids = torch.tensor(np.random.default_rng(3).integers(0, 64, (8, 32)))
    found = mixle.calibrate_importance(model, [ids], dataset="seeded ids")
    mixle.save_imatrix(model, found, tmp_path / "m.imatrix.gguf")
    hf, f32 = tmp_path / "hf", tmp_path / "f32.gguf"
    checkpoint(case, hf)
    subprocess.run([sys.executable, "-c", _CONVERT, llama_cpp_source(), str(hf), str(f32)], check=True,
                   capture_output=True, cwd=llama_cpp_source())
    for mix in ("Q4_0", "Q4_K_M"):
        llama_quantize_imatrix(build_dir(), str(f32), str(tmp_path / "ref.gguf"), mix, str(tmp_path / "m.imatrix.gguf"))
        mixle.save_gguf(mixle.quantize_model(model, gguf_mix=mix, importance=found), tmp_path / "mine.gguf")
        ref, mine = summary(tmp_path / "ref.gguf"), summary(tmp_path / "mine.gguf")
        assert compare(mine, ref) == [], mix


@pytest.mark.parametrize("case", sorted(CASES))
def test_llama_cpp_computes_the_transformers_forward(case, tmp_path):
    """The F32 file in llama.cpp itself (llama-cpp-python, F32 KV cache) gives the transformers model's
    logits: rotary layout, norm offsets, soft-capping, sliding windows and scaled embeddings included."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from mixle.gguf.architectures import DECODERS
    from tests.gguf_parity_cases import IDS

    model = model_of(case).eval()
    mixle.save_gguf(model, tmp_path / "m.gguf", float_matrices="f32")
    llm = llama_cpp.Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=16, logits_all=True, n_threads=1, type_k=0,
                          type_v=0, verbose=False)
    llm.eval(IDS)
    with torch.no_grad():
        want = model(torch.tensor([IDS])).logits[0].numpy()
    # All-F32 weights and KV cache: float rounding and ggml's kernels only (the HF files' tolerance); Gemma's
    # tanh GELU goes through ggml's float16 table (the gpt2 files' tolerance; measured 0.0085 at |logit| ~12).
    gelu = DECODERS[type(model).__name__].activation == "gelu_pytorch_tanh"
    np.testing.assert_allclose(np.array(llm.scores[: len(IDS)], dtype=np.float32), want, rtol=0,
                               atol=0.01 if gelu else 1e-3)
