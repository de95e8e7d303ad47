"""save_gguf files in llama.cpp itself (llama-cpp-python, the ``llama`` extra); skipped without it."""

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp")

from mixle.models.qat import apply_qat  # noqa: E402
from mixle.models.transformer import build_causal_lm  # noqa: E402
from mixle.task.quantize import save_gguf  # noqa: E402
from tests.gguf_parity_cases import hf_logits, hf_model  # noqa: E402

IDS = [5, 17, 3, 3, 40, 12, 0, 29, 8, 33, 2, 1]


def _lm(activation="gelu_tanh"):
    torch.manual_seed(0)
    return build_causal_lm(vocab=48, d_model=64, n_layer=2, n_head=2, block=16, activation=activation)


def _llama_logits(path):
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=16, logits_all=True, n_threads=1, type_k=0, type_v=0,
                          verbose=False)
    llm.eval(IDS)
    return np.array(llm.scores[: len(IDS)], dtype=np.float32)


def test_float_file_reproduces_the_float_forward(tmp_path):
    lm = _lm()
    save_gguf(lm, tmp_path / "lm.gguf", float_matrices="f32")
    with torch.no_grad():
        want = lm(torch.tensor([IDS]), all_positions=True)[0].numpy()
    # ggml's tanh GELU goes through a float16 table; the bound leaves room for other CPUs' SIMD paths.
    np.testing.assert_allclose(_llama_logits(tmp_path / "lm.gguf"), want, rtol=0, atol=0.01)


@pytest.mark.parametrize("grid", ["q4_0", "q8_0"])
def test_qat_file_reproduces_the_fake_quant_forward(grid, tmp_path):
    # act_bits=8: activations as the Q8_0 blocks ggml's CPU path makes of each product's input.
    lm = apply_qat(_lm(), bits=4 if grid == "q4_0" else 8, grid=grid, act_bits=8)
    save_gguf(lm, tmp_path / "lm.gguf")
    with torch.no_grad():
        want = lm(torch.tensor([IDS]), all_positions=True)[0].numpy()
    # Measured 3.7e-3 (q4_0) / 4.1e-3 (q8_0) at |logit| ~1 on AMD EPYC (AVX-512): ggml's float16
    # GELU table moves some Q8_0 activation codes (see the next test).
    np.testing.assert_allclose(_llama_logits(tmp_path / "lm.gguf"), want, rtol=0, atol=0.02)


@pytest.mark.parametrize("grid", ["q4_0", "q8_0"])
def test_cpu_numerics_are_reproduced_with_the_float16_gelu_table(grid, tmp_path):
    """act_bits=8 and activation='gelu_tanh_f16': mixle computes what llama.cpp's CPU path computes."""
    lm = apply_qat(_lm("gelu_tanh_f16"), bits=4 if grid == "q4_0" else 8, grid=grid, act_bits=8)
    save_gguf(lm, tmp_path / "lm.gguf")
    with torch.no_grad():
        want = lm(torch.tensor([IDS]), all_positions=True)[0].numpy()
    # Measured 1.8e-7 (q4_0) / 1.2e-7 (q8_0) at |logit| ~1 on AMD EPYC (AVX-512): float32 sums in
    # another order. Other SIMD paths round exact Q8_0 ties differently, so the bound is wider.
    np.testing.assert_allclose(_llama_logits(tmp_path / "lm.gguf"), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_file_reproduces_the_hf_forward(family, tmp_path):
    """llama.cpp's rotary layout: Llama's q/k rows reordered, Qwen2's not."""
    pytest.importorskip("transformers")
    model = hf_model(family)
    save_gguf(model, tmp_path / "m.gguf", float_matrices="f32")
    # All-F32 weights and KV cache: float rounding and ggml's SiLU/rope kernels only.
    np.testing.assert_allclose(_llama_logits(tmp_path / "m.gguf"), hf_logits(model), rtol=0, atol=1e-3)
