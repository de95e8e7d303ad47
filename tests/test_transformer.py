"""build_causal_lm: shapes, causality, the tied head, sequence log-probabilities and QAT wrapping."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from mixle.models.qat import QATWrapper, apply_qat, get_qat_report, set_fake_quant_enabled
from mixle.models.transformer import CausalLM, build_causal_lm
from mixle.task.quantize import quantize_dequantize_array


def small(seed=0, **kw):
    torch.manual_seed(seed)
    return build_causal_lm(vocab=kw.pop("vocab", 40), d_model=32, n_layer=2, n_head=4, block=16, **kw)


def test_structure_plain_linears_and_a_tied_head():
    lm = small()
    assert isinstance(lm, CausalLM)
    assert lm.head.weight is lm.tok.weight
    assert lm.head.bias is None
    linears = sorted(name for name, m in lm.named_modules() if type(m) is nn.Linear)
    assert linears == sorted([f"blocks.{i}.{n}" for i in range(2) for n in ("qkv", "proj", "fc", "out")] + ["head"])
    assert not any(isinstance(m, nn.MultiheadAttention) for m in lm.modules())
    # The tied table is one Parameter: counted once.
    unique = {id(p) for p in lm.parameters()}
    assert len(unique) == len(list(lm.parameters()))


def test_forward_shapes_and_last_position_option():
    lm = small().eval()
    idx = torch.randint(0, 40, (3, 10))
    seen = []
    lm.norm.register_forward_hook(lambda module, args, out: seen.append(out))
    with torch.no_grad():
        every = lm(idx, all_positions=True)
        last = lm(idx)
    assert every.shape == (3, 10, 40) and last.shape == (3, 40)
    # Only the head's input differs in shape (3 rows vs 30), so the two may take other matmul
    # kernels and summation orders (AVX2 vs AVX-512): equal up to float32 rounding of a
    # d_model-long dot product, |diff| <= d_model * eps * sum_k |h_k w_k| per logit.
    hidden = seen[0][:, -1]
    magnitude = hidden.abs() @ lm.head.weight.abs().t()
    bound = lm.head.in_features * torch.finfo(torch.float32).eps * magnitude
    assert torch.all((last - every[:, -1]).abs() <= bound)


def test_attention_is_causal():
    lm = small().eval()
    idx = torch.randint(0, 40, (2, 12))
    changed = idx.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 40
    with torch.no_grad():
        a, b = lm(idx, all_positions=True), lm(changed, all_positions=True)
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_sequence_log_prob_matches_a_numpy_log_softmax():
    lm = small().eval()
    tokens = torch.randint(0, 40, (4, 9))
    with torch.no_grad():
        got = lm.sequence_log_prob(tokens).numpy()
        logits = lm(tokens[:, :-1], all_positions=True).double().numpy()
    shifted = logits - logits.max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    target = tokens[:, 1:].numpy()
    expected = np.take_along_axis(log_softmax, target[..., None], -1)[..., 0].sum(1)
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_apply_qat_wraps_every_linear_and_the_tied_embedding_follows_the_head():
    lm = small()
    keys = list(lm.state_dict())
    lm = apply_qat(lm, bits=4)
    assert list(lm.state_dict()) == keys
    report = get_qat_report(lm)
    assert set(report.wrapped) >= {"head", "blocks.0.qkv", "blocks.1.out", "tok"}
    assert isinstance(lm.head, QATWrapper) and lm.head.weight is lm.tok.weight
    ids = torch.tensor([[3, 7, 39]])
    w = lm.tok.weight.detach().numpy()
    # Per-row symmetric int4 in plain numpy: scale = max|row| / 7, codes rounded and clipped to -7..7.
    scale = np.abs(w).max(1, keepdims=True) / np.float32(7)
    reference = (np.clip(np.round(w / scale), -7, 7) * scale).astype(np.float32)
    np.testing.assert_allclose(lm.tok(ids)[0].detach().numpy(), reference[[3, 7, 39]], rtol=0, atol=1e-7)
    np.testing.assert_array_equal(quantize_dequantize_array(w, bits=4), lm.head.quantized_weight().detach().numpy())
    set_fake_quant_enabled(lm, False)
    assert torch.equal(lm.tok(ids)[0], lm.tok.weight[[3, 7, 39]])


def test_bad_sizes_and_inputs_are_refused():
    with pytest.raises(ValueError, match="d_model=30 must be divisible by n_head=4"):
        build_causal_lm(vocab=10, d_model=30, n_head=4)
    with pytest.raises(ValueError, match="vocab must be a positive int"):
        build_causal_lm(vocab=0)
    lm = small()
    with pytest.raises(ValueError, match="sequence length 17 must be between 1 and the model's block=16"):
        lm(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"shape \(batch, length\)"):
        lm(torch.zeros(5, dtype=torch.long))


def test_gelu_tanh_option_computes_the_tanh_approximation():
    erf, tanh = small(seed=3), small(seed=3, activation="gelu_tanh")
    assert [b.activation for b in tanh.blocks] == ["gelu_tanh"] * 2 and erf.blocks[0].activation == "gelu"
    seen = []
    tanh.blocks[0].out.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    tanh.blocks[0].fc.register_forward_hook(lambda module, args, out: seen.append(out))
    idx = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        tanh(idx), erf(idx)
    up, act = seen[0].double().numpy(), seen[1].double().numpy()  # fc runs before out
    want = 0.5 * up * (1 + np.tanh(np.sqrt(2 / np.pi) * (up + 0.044715 * up**3)))
    np.testing.assert_allclose(act, want, rtol=1e-6, atol=1e-7)  # float32 torch vs float64 numpy
    with pytest.raises(ValueError, match=r"activation='relu' is unknown: use one of \['gelu', 'gelu_tanh', "):
        small(activation="relu")


def test_gelu_tanh_f16_is_llama_cpps_float16_table():
    """ggml's CPU GELU: float16(gelu(float16(x))) from a table computed in float32 (numpy here, in
    ggml's own operation order), 0 at or below -10, x at or above 10; backward: tanh GELU's derivative."""
    from mixle.lm.transformer import ACTIVATIONS

    halves = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)
    x = np.concatenate([halves[np.isfinite(halves) & (np.abs(halves) < 12)], [-10.0, 10.0, 0.1234567, -3.3333333]])
    x = x.astype(np.float32)
    h = x.astype(np.float16).astype(np.float32)
    c, a = np.float32(math.sqrt(2 / math.pi)), np.float32(0.044715)
    tanh = np.tanh((c * h * (np.float32(1) + a * h * h)).astype(np.float64)).astype(np.float32)  # C's tanhf
    table = (np.float32(0.5) * h * (np.float32(1) + tanh)).astype(np.float16)
    want = np.where(x <= -10, 0, np.where(x >= 10, x, table.astype(np.float32))).astype(np.float32)
    xt = torch.from_numpy(x).requires_grad_()
    got = ACTIVATIONS["gelu_tanh_f16"](xt)
    assert np.array_equal(got.detach().numpy(), want)
    got.sum().backward()
    leaf = torch.from_numpy(x).requires_grad_()
    torch.nn.functional.gelu(leaf, approximate="tanh").sum().backward()
    assert torch.equal(xt.grad, leaf.grad)
