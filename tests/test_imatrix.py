"""Importance-matrix quantization against llama.cpp: ``quantize_array(..., importance=)`` and the
mixes' types with an imatrix, tensor by tensor, bit for bit as ``llama-quantize --imatrix``.

Oracles: ggml's own ``ggml_quantize_chunk`` with ``quant_weights`` (the library bundled with
llama-cpp-python, when installed), and ``llama-quantize --imatrix`` run once by
``benchmarks/make_imatrix_fixtures.py`` on the seeded models below with an imatrix written by
mixle and with ``llama-imatrix``'s own file (``tests/fixtures/imatrix_reference.npz``: per tensor
the type and the sha256 of its bytes). The live test reruns the tools when a build is found
(``MIXLE_LLAMA_CPP_BUILD`` or ``/tmp/llbuild``, with ``bin/llama-quantize``).
"""

import functools
import json
import os
import pathlib
import subprocess

import numpy as np
import pytest
import torch

from mixle.core.imatrix import Imatrix, check_entries
from mixle.gguf.mixes import grid_of_type, tensor_types
from mixle.core.numerics import quantize_array
from mixle.gguf.blocks import pack_array
from tests.test_gguf_mixes import MODEL_CASES, MOE_CASES, read_tensors, sha

gguf = pytest.importorskip("gguf")

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = "tests/fixtures/imatrix_reference.npz"
FTYPES = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")
IMATRIX_CASES = ("llama_h256", "qwen2_h64")
# the mixture of experts (3 layers, 4 experts, top-2; rows of 64 and 256): llama-imatrix's own file only
MOE_IMATRIX_CASE, MOE_FTYPES = "qwen3moe_h64", ("Q4_0", "Q4_K_M")
VOCAB = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + \
        [str(d) for d in range(10)] + [" ", "."]
WEIGHTED = ("q4_0", "q5_0", "q4_1", "q5_1", "q4_k", "q5_k", "q6_k")


def build_dir(tool="llama-quantize"):
    """The llama.cpp build directory whose ``bin`` has ``tool`` (a build may hold only some tools)."""
    for path in (os.environ.get("MIXLE_LLAMA_CPP_BUILD"), "/tmp/llbuild"):
        if path and os.path.exists(os.path.join(path, "bin", tool)):
            return path
    return None


# ------------------------------------------------------------------ the fixture's recipe


@functools.lru_cache(maxsize=None)
def seeded_model(case):
    """The seeded float model of ``case`` (built once per session: callers only read it)."""
    return (MODEL_CASES[case] if case in MODEL_CASES else MOE_CASES[case])[0](0)


def write_model(case, path):
    """The seeded model of ``case`` as an F32 GGUF (one character per token); its tensors."""
    import mixle

    mixle.save_gguf(seeded_model(case), path, float_matrices="f32", vocab=VOCAB)
    return read_tensors(path)


def calibration_text(words=600, seed=3):
    rng = np.random.default_rng(seed)
    letters = np.array(VOCAB[:-2])
    return " ".join("".join(rng.choice(letters, rng.integers(1, 8))) for _ in range(words)) + ".\n"


def imatrix_names(tensors):
    """The tensors an imatrix has entries for: every block matrix and the output head."""
    return sorted(name for name, (_, shape, _) in tensors.items()
                  if len(shape) == 2 and (name.startswith("blk.") or name == "output.weight") and "norm" not in name)


def known_imatrix(case, tensors, path):
    """An imatrix of seeded sums (squares over ~6 decades, some columns zero) written by mixle."""
    from mixle.gguf.imatrix_file import write_imatrix

    sums, counts = {}, {}
    for index, name in enumerate(imatrix_names(tensors)):
        rng = np.random.default_rng(1000 + index)
        cols = tensors[name][1][-1]
        values = rng.standard_normal(cols) ** 2 * 10.0 ** rng.uniform(-3, 3, cols) * 320
        values[rng.random(cols) < 0.05] = 0.0
        sums[name], counts[name] = values.astype(np.float32)[None], np.array([320])
    write_imatrix(path, Imatrix(sums, counts, ("seeded",), 10, 32))


def llama_imatrix(build, model, text, out):
    subprocess.run([os.path.join(build, "bin", "llama-imatrix"), "-m", model, "-f", text, "-o", out, "-c", "32",
                    "--chunks", "8", "-t", "1", "--no-ppl", "--process-output"], check=True, capture_output=True)


def llama_quantize_imatrix(build, src, dst, ftype, imatrix):
    subprocess.run([os.path.join(build, "bin", "llama-quantize"), "--imatrix", imatrix, src, dst, ftype, "1"],
                   check=True, capture_output=True)


# ------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="module")
def reference():
    path = ROOT / FIXTURE
    if not path.exists():
        pytest.fail(f"{FIXTURE} is missing: run `python benchmarks/make_imatrix_fixtures.py`")
    data = np.load(path)
    return json.loads(str(data["meta"])), {k: data[k] for k in data.files if k != "meta"}


def fixture_imatrix(arrays, case, which):
    prefix = f"{case}/{which}/"
    names = sorted({k[len(prefix):].rsplit("/", 1)[0] for k in arrays if k.startswith(prefix)})  # one order every run
    return Imatrix({n: arrays[f"{prefix}{n}/sums"] for n in names}, {n: arrays[f"{prefix}{n}/counts"] for n in names})


@pytest.fixture(scope="module")
def float_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("imatrix")
    return {case: write_model(case, str(tmp / f"{case}.gguf")) for case in IMATRIX_CASES}


def mixle_bytes(values, ggml_type, importance, library=np):
    if ggml_type in ("F32", "F16"):
        return values.astype(np.float32 if ggml_type == "F32" else np.float16)
    rows = values.reshape(-1, values.shape[-1])
    rows = torch.from_numpy(rows.copy()) if library is torch else rows
    return pack_array(quantize_array(rows, grid=grid_of_type(ggml_type), importance=importance))


def n_layer(tensors):
    return 1 + max(int(name.split(".")[1]) for name in tensors if name.startswith("blk."))


# -------------------------------------------------------------------------------- tests


def test_weighted_quantizers_equal_libggml():
    """Every weighted block type, numpy and torch, against ``ggml_quantize_chunk`` with quant_weights."""
    from tests.test_ggml_quants import ggml_library, stress_rows

    lib = ggml_library()
    if lib is None:
        pytest.skip("llama-cpp-python (its bundled ggml library) is not installed")
    _, x = stress_rows(48)
    x = x[:, :512]
    x = np.ascontiguousarray(x[abs(x).max(axis=1) < 1e5])  # larger blocks' scales overflow float16 (refused)
    qw = (np.random.default_rng(5).random(512) ** 4 * 50).astype(np.float32)
    qw[::13] = 0.0
    for grid in WEIGHTED:
        type_id = int(getattr(gguf.GGMLQuantizationType, grid.upper()))
        ref = np.zeros((x.shape[0], lib.ggml_row_size(type_id, 512)), np.uint8)
        lib.ggml_quantize_chunk(type_id, x.ctypes.data, ref.ctypes.data, 0, x.shape[0], 512, qw.ctypes.data)
        plain = pack_array(quantize_array(x, grid=grid))
        assert (plain != ref).any(axis=1).sum() > x.shape[0] // 2, grid  # the importance changes most rows
        for library in (np, torch):
            got = mixle_bytes(x, grid.upper(), torch.from_numpy(qw) if library is torch else qw, library)
            bad = np.flatnonzero((got != ref).any(axis=1))
            assert bad.size == 0, f"{grid} ({library.__name__}): rows {bad[:5]} differ from ggml"


@pytest.mark.parametrize("case", IMATRIX_CASES)
def test_types_and_bytes_equal_llama_quantize_imatrix(case, reference, float_files):
    meta, arrays = reference
    tensors = float_files[case]
    record = meta["cases"][case]
    assert {n: sha(d) for n, (_, _, d) in tensors.items()} == record["float"], "the seeded model changed"
    shapes = {name: shape for name, (_, shape, _) in tensors.items()}
    counted, done = 0, {}
    for which, entry in record["imatrix"].items():
        if case == "llama_h256" and which == "llama_imatrix":
            continue  # its Q4_0 file is checked whole in test_imatrix_model.py; the types here by "known"
        importance = fixture_imatrix(arrays, case, which).importance()
        for ftype, want in entry["ftypes"].items():
            types = tensor_types(ftype, shapes, MODEL_CASES[case][1], n_layer(tensors), n_head=2, n_head_kv=1,
                                 imatrix=True)
            assert {n: t or tensors[n][0] for n, t in types.items()} == {n: t for n, (t, _) in want.items()}, ftype
            for name, (ggml_type, digest) in want.items():
                key = (which, name, ggml_type)  # the mixes share most tensors' types: each is checked once
                if key not in done:
                    library = torch if len(done) % 8 == 0 else np  # every eighth tensor on torch
                    done[key] = (sha(mixle_bytes(tensors[name][2], ggml_type, importance.get(name), library)),
                                 library.__name__)
                assert done[key][0] == digest, f"{case} {which} {ftype} {name} ({ggml_type}, {done[key][1]})"
                counted += 1
    assert counted >= 100


def test_q4_0_imatrix_changes_first_eighth_ffn_down(reference):
    meta, _ = reference
    want = meta["cases"]["llama_h256"]["imatrix"]["known"]["ftypes"]["Q4_0"]
    downs = {name: t for name, (t, _) in want.items() if "ffn_down" in name}
    assert downs["blk.0.ffn_down.weight"] == "Q4_1" and downs["blk.1.ffn_down.weight"] == "Q4_0"
    assert {t for n, (t, _) in want.items() if ".attn_q." in n} == {"Q4_0"}


def test_read_imatrix_equals_gguf_py(reference, tmp_path):
    """mixle's reader against gguf-py's raw tensors, on a file mixle wrote and llama-quantize took."""
    from mixle.gguf.imatrix_file import read_imatrix, write_imatrix

    _, arrays = reference
    imatrix = fixture_imatrix(arrays, "llama_h256", "llama_imatrix")
    path = tmp_path / "m.imatrix.gguf"
    write_imatrix(path, Imatrix(imatrix.sums, imatrix.counts, ("t",), 8, 32))
    raw = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    back = read_imatrix(path)
    for name, sums in imatrix.sums.items():
        assert np.array_equal(raw[name + ".in_sum2"].reshape(sums.shape), sums)
        assert np.array_equal(back.sums[name], sums) and back.counts[name].tolist() == imatrix.counts[name].tolist()
    assert (back.datasets, back.chunk_count, back.chunk_size) == (("t",), 8, 32)


def test_legacy_file_is_read(tmp_path):
    path = tmp_path / "old.dat"
    name = b"blk.0.ffn_up.weight"
    body = np.array([1], "<i4").tobytes() + np.array([len(name)], "<i4").tobytes() + name
    body += np.array([4, 3], "<i4").tobytes() + np.array([8.0, 4.0, 0.0], "<f4").tobytes()
    from mixle.gguf.imatrix_file import read_imatrix

    path.write_bytes(body)
    imatrix = read_imatrix(path)
    assert imatrix.legacy and imatrix.counts[name.decode()].tolist() == [4]
    assert imatrix.importance()[name.decode()].tolist() == [2.0, 1.0, 0.0]


@pytest.mark.parametrize("sums, counts, message", [
    ({"blk.9.ffn_up.weight": np.ones((1, 4))}, [8], "not a matrix of this model"),
    ({"blk.0.ffn_up.weight": np.ones((1, 5))}, [8], "computed for another model"),
    ({"blk.0.ffn_up.weight": np.array([[1.0, np.nan, 0, 0]])}, [8], "finite and non-negative"),
    ({"blk.0.ffn_up.weight": np.array([[1.0, -1.0, 0, 0]])}, [8], "finite and non-negative"),
    ({"blk.0.ffn_up.weight": np.ones((1, 4))}, [2], "fewer than min_tokens=4"),
])
def test_bad_imatrix_is_refused_naming_the_tensor(sums, counts, message):
    imatrix = Imatrix({k: v.astype(np.float32) for k, v in sums.items()}, {k: np.array(counts) for k in sums})
    with pytest.raises(ValueError, match=message) as err:
        check_entries(imatrix, {"blk.0.ffn_up.weight": (8, 4)}, min_tokens=4)
    assert next(iter(sums)) in str(err.value)


def test_importance_is_checked_and_refused_where_ggml_has_no_search():
    x = np.ones((2, 64), np.float32)
    for bad, message in ((np.ones(63), "64 input columns"), (-np.ones(64), "non-negative"),
                         (np.full(64, np.inf), "finite")):
        with pytest.raises(ValueError, match=message):
            quantize_array(x, grid="q4_0", importance=bad, name="layer 'fc'")
    with pytest.raises(ValueError, match="x: grid='nf4' has no importance-weighted search"):
        quantize_array(x, grid="nf4", importance=np.ones(64))
    plain = quantize_array(x, grid="q8_0")
    assert np.array_equal(quantize_array(x, grid="q8_0", importance=np.ones(64)).codes, plain.codes)  # ggml ignores it


@pytest.mark.skipif(build_dir() is None, reason="no llama.cpp build with llama-quantize (MIXLE_LLAMA_CPP_BUILD)")
def test_live_llama_quantize_imatrix_on_mixle_file(tmp_path):
    """Rerun the tools: llama-quantize --imatrix on mixle's imatrix file equals mixle, tensor by tensor."""
    case, build = "qwen2_h64", build_dir()
    tensors = write_model(case, str(tmp_path / "f32.gguf"))
    known_imatrix(case, tensors, str(tmp_path / "m.imatrix.gguf"))
    from mixle.gguf.imatrix_file import read_imatrix

    importance = read_imatrix(tmp_path / "m.imatrix.gguf").importance()
    llama_quantize_imatrix(build, str(tmp_path / "f32.gguf"), str(tmp_path / "q.gguf"), "Q4_K_M",
                           str(tmp_path / "m.imatrix.gguf"))
    for name, (ggml_type, _, data) in read_tensors(tmp_path / "q.gguf").items():
        assert sha(mixle_bytes(tensors[name][2], ggml_type, importance.get(name))) == sha(data), name


def test_stacked_experts_take_one_importance_each():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((3, 4, 256)).astype(np.float32)
    imp = rng.random((3, 256)).astype(np.float32)
    q = quantize_array(w, grid="q4_k", batch_ndim=1, importance=imp)
    for e in range(3):
        one = quantize_array(w[e], grid="q4_k", importance=imp[e])
        assert np.array_equal(q.dequantize()[e], one.dequantize())
    shared = quantize_array(w, grid="q4_k", batch_ndim=1, importance=imp[0])
    assert np.array_equal(shared.dequantize()[0], q.dequantize()[0])
    assert not np.array_equal(shared.dequantize()[1], q.dequantize()[1])
