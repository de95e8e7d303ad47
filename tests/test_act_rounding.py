"""``act_rounding``: each llama.cpp CPU build's rounding of a product's input to Q8_0 blocks.

The oracle is a numpy transcription of ggml-cpu's ``quantize_row_q8_0`` per build (the reference C
loop, the AVX/AVX2 loop of ``arch/x86/quants.c``, the NEON loop of ``arch/arm/quants.c``), one block at
a time, then ``code * float16(d)``; the reference build is also gguf-py's Q8_0, and with llama-cpp-python the
machine's own llama.cpp build (its ggml-cpu ``quantize_row_q8_0``, through ctypes) is this CPU's record. The
inputs put many values on (or an ulp from) a rounding tie, where the builds differ.
"""

import numpy as np
import pytest
import torch

import mixle
from mixle.core.array_ops import array_ops
from mixle.core.numerics import round_q8_0_input
from mixle.core.product_inputs import ACT_ROUNDINGS, ProductInputRounding
from mixle.core.spec import QuantSpec
from mixle.torch_backend.layers.activations import quantize_dequantize_activations

pytest.importorskip("gguf")
from tests.test_kquant_activations import _tokens, np_q8_0  # noqa: E402

BUILDS = tuple(ACT_ROUNDINGS)


def c_q8_0(x, build):
    """ggml-cpu's quantize_row_q8_0 as ``build`` compiles it, dequantized: one block of 32 at a time."""
    blocks = np.asarray(x, np.float32).reshape(-1, 32)
    out = np.empty_like(blocks)
    for i, block in enumerate(blocks):
        amax = np.abs(block).max()
        d = amax / np.float32(127)
        with np.errstate(over="ignore", invalid="ignore"):
            if build == "x86":  # id = 127 / max, _mm256_round_ps to nearest (ties to even)
                scaled = block * (np.float32(127) / amax if amax != 0 else np.float32(0))
            else:  # id = 1 / d: roundf (ties away) in the reference loop, vcvtnq (ties to even) on NEON
                scaled = block * (np.float32(1) / d if d != 0 else np.float32(0))
        wide = scaled.astype(np.float64)
        codes = np.rint(wide) if build != "reference" else np.sign(wide) * np.floor(np.abs(wide) + 0.5)
        codes = np.where(np.isfinite(codes), codes, -128)  # d below float16's range: multiplied by 0 anyway
        out[i] = codes * np.float32(np.float16(d))
    return out.reshape(np.shape(x))


def tie_tokens(count=64, seed=0):
    """Tokens of 256 inputs whose values are (k + 1/2) * max / 127 in float32: each build's ``x * id``
    lands on the half or an ulp beside it, on a side that depends on how ``id`` was computed."""
    rng = np.random.default_rng(seed)
    top = (rng.uniform(0.5, 2.0, (count, 8, 1)) * 10.0 ** rng.integers(-3, 3, (count, 8, 1))).astype(np.float32)
    halves = rng.integers(-126, 126, (count, 8, 32)).astype(np.float32) + np.float32(0.5)
    x = (halves * (top / np.float32(127))).astype(np.float32)
    x[..., 0] = top[..., 0] * np.where(rng.random((count, 8)) < 0.5, 1, -1)
    return np.concatenate([x.reshape(count, 256), _tokens()[:5]]).astype(np.float32)


@pytest.mark.parametrize("build", BUILDS)
def test_each_builds_q8_0_rounding_is_its_c_loop_bit_for_bit_in_numpy_and_torch(build):
    x = tie_tokens()
    want = c_q8_0(x, build)
    assert np.array_equal(round_q8_0_input(array_ops(x), x, ACT_ROUNDINGS[build]), want)
    spec = QuantSpec(bits=4, grid="q4_0", act_bits=8, act_rounding=build)
    assert np.array_equal(quantize_dequantize_activations(torch.from_numpy(x), spec).numpy(), want)
    assert np.array_equal(quantize_dequantize_activations(torch.from_numpy(x[None]), spec).numpy()[0], want)


def test_the_reference_build_is_gguf_pys_q8_0_and_the_builds_differ_on_ties():
    x = tie_tokens()
    assert np.array_equal(c_q8_0(x[:64], "reference"), np_q8_0(x[:64]))
    values = {build: c_q8_0(x, build) for build in BUILDS}
    differ = {(a, b): int((values[a] != values[b]).sum()) for a, b in [("reference", "x86"), ("reference", "arm"),
                                                                      ("x86", "arm")]}
    assert min(differ.values()) > 100, differ  # so the test above tells the three apart


def test_act_rounding_is_validated_and_reaches_every_layer_of_a_mix():
    with pytest.raises(ValueError, match=r"act_rounding='avx' is unknown: use the llama.cpp build you run.*'x86'"):
        QuantSpec(grid="q4_0", act_bits=8, act_rounding="avx")
    with pytest.raises(ValueError, match=r"act_rounding='x86' .* but act_bits is None: set act_bits=8"):
        QuantSpec(grid="q4_0", act_rounding="x86")
    with pytest.raises(ValueError, match=r"act_rounding='arm' with grid='symmetric': only llama.cpp's grids"):
        QuantSpec(bits=4, act_bits=8, act_rounding="arm")
    with pytest.raises(ValueError, match="ties='up' is unknown"):
        ProductInputRounding(name="odd", inverse="quotient", ties="up", summary="")
    from tests.test_gguf_mixes import MODEL_CASES

    model = mixle.apply_qat(MODEL_CASES["llama_h256"][0](0), gguf_mix="Q4_K_M", act_bits=8, act_rounding="x86")
    specs = [m.spec for m in model.modules() if getattr(m, "spec", None) is not None]
    assert {s.grid for s in specs} >= {"q4_k", "q6_k", "q5_0"}
    assert all(s.act_bits == 8 and s.act_rounding == "x86" for s in specs)


def test_the_finetune_flag_needs_act_bits_and_reaches_the_spec():
    from mixle.lm.finetune_config import FinetuneConfig

    with pytest.raises(ValueError, match="--act-rounding x86 chooses how --act-bits 8 rounds.*add --act-bits 8"):
        FinetuneConfig(model="m", out="o", act_rounding="x86")
    config = FinetuneConfig(model="m", out="o", target="q4_0", act_bits=8, act_rounding="arm")
    assert (config.spec().act_bits, config.spec().act_rounding) == (8, "arm")
    assert FinetuneConfig(model="m", out="o", target="Q4_0", act_bits=8).act_fields() == {"act_bits": 8}


def _ggml_quantize_row_q8_0():
    """This machine's llama.cpp build's own ``quantize_row_q8_0`` (ggml-cpu's Q8_0 ``from_float``, what its
    products run on their input), through ctypes; skips without llama-cpp-python."""
    import ctypes
    import os
    from pathlib import Path

    llama_cpp = pytest.importorskip("llama_cpp")
    folder = Path(os.environ.get("LLAMA_CPP_LIB_PATH") or Path(llama_cpp.__file__).parent / "lib")
    names = [next(iter(sorted(folder.glob(f"libggml-{part}.*"))), None) for part in ("base", "cpu")]
    if None in names:
        pytest.skip(f"no libggml-base / libggml-cpu in {folder}")
    cpu = [ctypes.CDLL(str(name), mode=ctypes.RTLD_GLOBAL) for name in names][-1]  # base first: cpu needs it
    row = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    cpu.ggml_cpu_init()
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(row)  # the struct's first field: from_float
    from_float = cpu.ggml_get_type_traits_cpu(8)[0]  # GGML_TYPE_Q8_0

    def quantize(x):
        x = np.ascontiguousarray(x, np.float32)
        blocks = np.zeros(x.size // 32, np.dtype([("d", "<f2"), ("qs", "i1", 32)]))
        from_float(x.ctypes.data, blocks.ctypes.data, x.size)
        return (blocks["qs"].astype(np.float32) * blocks["d"].astype(np.float32)[:, None]).reshape(x.shape)

    return quantize


def test_live_llama_cpp_rounds_product_inputs_as_this_cpus_build_record():
    import platform

    quantize = _ggml_quantize_row_q8_0()
    build = {"x86_64": "x86", "AMD64": "x86", "aarch64": "arm", "arm64": "arm"}.get(platform.machine())
    if build is None:
        pytest.skip(f"no record says how llama.cpp rounds on {platform.machine()}")
    x = tie_tokens()
    got = quantize(x)
    spec = QuantSpec(bits=4, grid="q4_0", act_bits=8, act_rounding=build)
    np.testing.assert_array_equal(quantize_dequantize_activations(torch.from_numpy(x), spec).numpy(), got)
    assert (c_q8_0(x, "reference") != got).sum() > 100  # the reference rounding is not what this build runs
