"""The two-command path, for an architecture mixle's GGUF writer does not write (StableLM).

A tiny seeded StableLM is QAT-trained through mixle on a llama.cpp grid (``apply_qat(grid=...)``,
every matrix, the token embedding included) for a few steps and written by the finetune job's
own code (``save_pretrained_float``). llama.cpp's ``convert_hf_to_gguf.py --outtype f32`` and
``llama-quantize --pure`` (the llama.cpp vendored by llama-cpp-python 0.3.36's sdist) make a file
whose every quantized tensor holds exactly the blocks of mixle's QAT codes and scales of that
weight (``convert`` of the QAT model, packed by ``mixle.gguf.blocks.pack_array``). That is the
guarantee: llama-quantize's quantizer is the lattice QAT trains on, so the trained float weights
are all llama.cpp's tools need, for any architecture they convert.

Training runs in float64, its loss included (transformers' own loss upcasts the logits to float32 only,
whose summation order differs between AVX2 and AVX-512 CPUs and once changed the trained weights), and
the model is then cast to float32, the master weights written and quantized: float64's summation-order
differences between CPUs vanish in that rounding (weights perturbed by 2e-16 relative train to the same
float32 weights), so the float32 weights, and the fixture's hashes, are the same on every machine.

CI has neither tool: ``benchmarks/make_hf_llama_cpp_fixtures.py`` ran them once and stored
llama.cpp's blocks' hashes (``tests/fixtures/hf_llama_cpp_reference.json``); the live test reruns
the tools when they are here (``MIXLE_LLAMA_CPP_SOURCE`` / ``MIXLE_LLAMA_CPP_BUILD``, or the sdist
under ``/tmp/llsdist`` and a build in ``/tmp/llbuild``).
"""

import functools
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
from tests.test_gguf_architectures import _CONVERT, llama_cpp_source
from tests.test_gguf_mixes import seeded
from tests.test_imatrix import build_dir

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = "tests/fixtures/hf_llama_cpp_reference.json"
ARCHITECTURE = "StableLmForCausalLM"
CONFIG = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
SEED, STEPS, LR = 0, 3, 0.5
# llama-quantize file type -> the grid QAT trains every matrix on (with --pure, every matrix gets that type).
GRIDS = {"Q4_0": "q4_0", "Q8_0": "q8_0"}


def float_model():
    """The seeded float StableLM (numpy's generator: the same weights with every torch version)."""
    return seeded(transformers.StableLmForCausalLM(transformers.StableLmConfig(**CONFIG)), SEED)


@functools.lru_cache(maxsize=None)
def trained(file_type, steps=STEPS):
    """The StableLM QAT-wrapped on ``file_type``'s grid (embedding and head included), after ``steps``
    SGD steps of next-token cross-entropy on seeded ids (in float64), cast to float32 (built once per
    session: callers only read it)."""
    grid = GRIDS[file_type]
    model = mixle.apply_qat(float_model().double(), grid=grid, bits=int(grid[1]), opt_in=("embedding",))
    ids = torch.tensor(np.random.default_rng(SEED + 1).integers(0, CONFIG["vocab_size"], (4, 16)))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        logits = model(ids).logits[:, :-1]
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.float()


def sha(data):
    return hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()


def weights_digest(model):
    """One sha256 of the float32 weights a checkpoint of ``model`` holds (state_dict order)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        if "log2_scale" not in name:
            digest.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def mixle_blocks(model):
    """``{gguf tensor name: [type, shape, sha256 of the blocks]}`` of every QAT layer: its codes and
    scales as ``convert`` gives them, packed into ggml blocks, named as gguf-py maps the path."""
    from mixle.gguf.blocks import pack_array

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.STABLELM, model.config.num_hidden_layers)
    found = {}
    for path, module in mixle.convert(model).named_modules():
        if hasattr(module, "quantized_array"):
            array = module.quantized_array()
            name = names.get_name(path + ".weight", try_suffixes=(".weight",))
            found[name] = [array.spec.grid_record.ggml_type, [int(d) for d in array.shape], sha(pack_array(array))]
    return found


def quantized_tensors(path):
    """The same summary of the quantized tensors of a GGUF file (F32 norms and biases left out)."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: [t.tensor_type.name, [int(d) for d in reversed(t.shape)], sha(np.asarray(t.data))]
            for t in reader.tensors if t.tensor_type.name not in ("F32", "F16")}


def checkpoint(model, directory):
    """The finetune job's checkpoint of ``model`` (``save_pretrained_float``) and a tokenizer.json of its
    vocabulary (the converter's stand-in vocabulary counts the tokens; the tokenizer is not compared)."""
    from mixle.exports.hf_checkpoint import save_pretrained_float

    save_pretrained_float(model, directory)
    with open(os.path.join(directory, "tokenizer.json"), "w") as handle:
        json.dump({"model": {"type": "BPE", "vocab": {f"<{i}>": i for i in range(model.config.vocab_size)},
                             "merges": []}, "added_tokens": []}, handle)


def llama_cpp_file(model, file_type, directory, source, build):
    """``convert_hf_to_gguf.py --outtype f32`` of the checkpoint, then ``llama-quantize --pure``; the path."""
    hf, f32 = os.path.join(directory, "hf"), os.path.join(directory, "f32.gguf")
    out = os.path.join(directory, f"{file_type}.gguf")
    checkpoint(model, hf)
    subprocess.run([sys.executable, "-c", _CONVERT, source, hf, f32], check=True, capture_output=True, cwd=source)
    subprocess.run([os.path.join(build, "bin", "llama-quantize"), "--pure", f32, out, file_type], check=True,
                   capture_output=True)
    return out


@pytest.fixture(scope="module")
def reference():
    path = ROOT / FIXTURE
    if not path.exists():
        pytest.fail(f"{FIXTURE} is missing: run `python benchmarks/make_hf_llama_cpp_fixtures.py`")
    return json.loads(path.read_text())


def test_stablelm_is_an_architecture_mixle_does_not_write(tmp_path):
    from mixle.gguf.architectures import DECODERS

    assert ARCHITECTURE not in DECODERS
    with pytest.raises(ValueError):
        mixle.save_gguf(float_model(), tmp_path / "m.gguf", float_matrices="f32")
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("file_type", sorted(GRIDS))
def test_llama_quantize_of_the_converted_checkpoint_is_the_trained_blocks(file_type, reference):
    model = trained(file_type)
    case = reference["cases"][file_type]
    assert weights_digest(model) == case["weights_sha256"], "training did not end on the fixture's float32 weights"
    mine = mixle_blocks(model)
    assert len(mine) == 2 + 7 * CONFIG["num_hidden_layers"]  # token_embd, output and every block matrix
    assert mine == case["tensors"]
    # The blocks are the trained ones: training moved them off the float model's quantization.
    before = mixle_blocks(mixle.apply_qat(float_model(), grid=GRIDS[file_type], bits=int(GRIDS[file_type][1]),
                                          opt_in=("embedding",)))
    assert all(before[name] != mine[name] for name in mine)


def test_the_fixture_records_its_recipe(reference):
    assert reference["architecture"] == ARCHITECTURE and reference["config"] == CONFIG
    assert (reference["seed"], reference["steps"], reference["lr"]) == (SEED, STEPS, LR)
    assert set(reference["cases"]) == set(GRIDS)


@pytest.mark.skipif(llama_cpp_source() is None or build_dir() is None,
                    reason="no llama.cpp source (convert_hf_to_gguf.py) or build (llama-quantize)")
@pytest.mark.parametrize("file_type", sorted(GRIDS))
def test_live_llama_cpp_tools_make_the_trained_blocks(file_type, tmp_path):
    model = trained(file_type)
    path = llama_cpp_file(model, file_type, str(tmp_path), llama_cpp_source(), build_dir())
    assert quantized_tensors(path) == mixle_blocks(model)


@pytest.mark.skipif(llama_cpp_source() is None or build_dir() is None,
                    reason="no llama.cpp source (convert_hf_to_gguf.py) or build (llama-quantize)")
@pytest.mark.parametrize("ggml_type", ["Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_live_every_file_type_the_finetune_recipe_names_keeps_the_qat_blocks(ggml_type, tmp_path):
    """The other grids of ``mixle.lm.finetune_hf.PURE_FILE_TYPES`` (rows of 256 for the K-quants): llama-quantize
    --pure with the file type the recipe names puts every matrix on the QAT grid's blocks, mixle's bit for bit."""
    from mixle.gguf.mixes import grid_of_type
    from mixle.lm.finetune_hf import PURE_FILE_TYPES

    config = {**CONFIG, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 1}
    grid = grid_of_type(ggml_type)
    model = seeded(transformers.StableLmForCausalLM(transformers.StableLmConfig(**config)), SEED)
    qat = mixle.apply_qat(model, grid=grid, bits=int(grid[1]), opt_in=("embedding",))
    path = llama_cpp_file(qat, PURE_FILE_TYPES[ggml_type], str(tmp_path), llama_cpp_source(), build_dir())
    found = quantized_tensors(path)
    assert {kind for kind, _, _ in found.values()} == {ggml_type} and found == mixle_blocks(qat)
