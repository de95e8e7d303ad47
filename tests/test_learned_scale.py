"""Learned scales (QuantSpec.scale="learned"): init, LSQ gradient, convert/save exactness, resume, refusals."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from mixle.api import convert, load_quantized, save_quantized
from mixle.core.spec import QuantSpec
from mixle.models.qat import apply_qat, set_fake_quant_enabled
from mixle.models.transformer import build_causal_lm
from mixle.torch_backend.layers.learned_scale import learned_weight, param_groups


# Converted layers run the exact dequantize-then-matmul path here (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("exact_converted_layers")


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def test_scales_start_from_the_weights_absmax():
    model = apply_qat(_mlp(), bits=4, group_size=8, scale="learned")
    w = model[0].weight.detach().numpy().reshape(1, -1, 8)
    want = np.abs(w).max(-1, keepdims=True) / 7.0
    got = torch.exp2(model[0].weight_log2_scale.detach()).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-7)  # exp2(log2(s)) rounds twice in float32: ~1 ulp
    fixed = apply_qat(_mlp(), bits=4, group_size=8)
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), fixed(x), rtol=1e-5, atol=1e-6)  # same codes unless on a tie


def test_lsq_gradient_matches_numpy():
    torch.manual_seed(0)
    layer = apply_qat(nn.Linear(6, 3).double(), bits=4, scale="learned")
    with torch.no_grad():
        layer.weight_log2_scale -= 0.7  # smaller scales: some weights clip
    upstream = torch.randn(3, 6, dtype=torch.float64)
    (learned_weight(layer) * upstream).sum().backward()
    w = layer.weight.detach().numpy()
    s = 2.0 ** layer.weight_log2_scale.detach().numpy().reshape(3, 1)
    v = w / s
    q = np.clip(np.round(v), -7, 7)
    inside = (v >= -7) & (v <= 7)
    g = upstream.numpy()
    assert inside.sum() < inside.size  # both branches are exercised
    np.testing.assert_array_equal(layer.weight.grad.numpy(), np.where(inside, g, 0))
    grad_s = (g * np.where(inside, q - v, q)).sum(-1) * s[:, 0] * math.log(2)
    np.testing.assert_allclose(layer.weight_log2_scale.grad.numpy().ravel(), grad_s, rtol=1e-12, atol=1e-15)


def _train(model, steps=5, lr=1e-2):
    opt = torch.optim.Adam(param_groups(model, list(model.parameters()), lr, scale_lr=5e-2, weight_decay=0.0))
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        loss = (model(x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@pytest.mark.parametrize("fields", [dict(bits=4, group_size=8), dict(bits=8, grid="qwix"),
                                    dict(bits=4, group_size=8, act_bits=8, act_symmetric=False)])
def test_trained_scales_convert_and_save_exactly(fields, tmp_path):
    spec = QuantSpec(scale="learned", **fields)
    model = _mlp()
    start = apply_qat(_mlp(), spec=spec)[0].weight_log2_scale.detach().clone()
    model = _train(apply_qat(model, spec=spec))
    assert not torch.equal(model[0].weight_log2_scale.detach(), start)  # the scales trained
    x = torch.randn(5, 16)
    with torch.no_grad():
        fake = model(x)
        quantized = convert(model)
        assert torch.equal(quantized(x), fake)  # convert == fake-quant, bit for bit
        assert torch.equal(quantized[0].scale, torch.exp2(model[0].weight_log2_scale))
        save_quantized(quantized, tmp_path / "m.safetensors")
        loaded = load_quantized(tmp_path / "m.safetensors", _mlp(1))
        assert torch.equal(loaded[0].scale, quantized[0].scale) and torch.equal(loaded(x), fake)


def test_state_dict_resume(tmp_path):
    model = _train(apply_qat(_mlp(), bits=4, scale="learned"))
    keys = [k for k in model.state_dict() if k.endswith("weight_log2_scale")]
    assert keys == ["0.weight_log2_scale", "2.weight_log2_scale"]
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    resumed = apply_qat(_mlp(7), bits=4, scale="learned")
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt"), strict=True)
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(resumed(x), model(x))
        set_fake_quant_enabled(resumed, False)
        assert torch.equal(resumed(x), nn.functional.linear(
            nn.functional.gelu(nn.functional.linear(x, resumed[0].weight, resumed[0].bias)),
            resumed[2].weight, resumed[2].bias))  # exact float toggle


def test_tied_head_and_embedding_share_one_scale():
    torch.manual_seed(0)
    float_lm = build_causal_lm(20, 16, 1, 2, 8)
    lm = apply_qat(copy.deepcopy(float_lm), bits=4, scale="learned", patterns=(r"head",))  # tok follows the tie
    assert lm.head.weight_log2_scale is lm.tok.weight_log2_scale
    assert sum(p is lm.head.weight_log2_scale for p in lm.parameters()) == 1
    with torch.no_grad():
        lm.head.weight_log2_scale -= 0.5  # smaller scales: some weights clip, both LSQ branches run
    tokens = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(1))
    (-lm.sequence_log_prob(tokens).sum()).backward()

    # Reference: the float LM with the head and the table untied, each a leaf holding the
    # fake-quantized weight (numpy), so G_head and G_tok are the gradients the two uses receive.
    w = float_lm.head.weight.detach().numpy()
    s = torch.exp2(lm.head.weight_log2_scale.detach()).numpy().reshape(20, 1)
    v = w / s
    codes = np.clip(np.round(v), -7, 7)
    ref = copy.deepcopy(float_lm)
    ref.head.weight = nn.Parameter(torch.from_numpy(codes * s))
    ref.tok.weight = nn.Parameter(torch.from_numpy(codes * s))
    (-ref.sequence_log_prob(tokens).sum()).backward()
    g_head, g_tok = ref.head.weight.grad.numpy(), ref.tok.weight.grad.numpy()
    inside = (v >= -7) & (v <= 7)
    assert 0 < inside.sum() < inside.size
    # The shared weight gets both straight-through gradients, masked where clipped: the same ops on
    # the same values, and a float sum of two terms, which does not depend on their order.
    np.testing.assert_array_equal(lm.head.weight.grad.numpy(), np.where(inside, g_head + g_tok, 0))
    # The shared scale gets both LSQ gradients; float64 here. Per layer, 16 products summed in
    # float32, times s and ln 2, then the two layers added: within (16 + 4) eps of the magnitudes.
    step = np.where(inside, codes - v, codes).astype(np.float64)
    want = ((g_head + g_tok) * step).sum(-1) * s[:, 0] * math.log(2)
    magnitude = ((np.abs(g_head) + np.abs(g_tok)) * np.abs(step)).sum(-1) * s[:, 0] * math.log(2)
    got = lm.head.weight_log2_scale.grad.numpy().ravel()
    assert (np.abs(got - want) <= 20 * np.finfo(np.float32).eps * magnitude).all()
    assert np.abs(want).max() > 0
    with torch.no_grad():
        q = convert(lm)
        assert q.head.codes is q.tok.codes
        assert torch.equal(q(tokens[:, :-1], all_positions=True), lm(tokens[:, :-1], all_positions=True))


def test_compiled_matches_eager():
    model = apply_qat(_mlp(), bits=4, group_size=8, scale="learned")
    x = torch.randn(4, 16)
    eager = model(x)
    eager.sum().backward()
    grad = model[0].weight_log2_scale.grad.clone()
    model.zero_grad()
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    out.sum().backward()
    # aot_eager runs the same aten ops; the matmul backward may reassociate float32 sums.
    torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model[0].weight_log2_scale.grad, grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fields,msg", [
    (dict(bits=4, grid="q4_0"), "fixes how each block's scale"),
    (dict(bits=8, grid="q8_0"), "fixes how each block's scale"),
    (dict(bits=4, clip_percentile=99.0), "clip_percentile"),
    (dict(bits=4, scale="lsq"), "unknown"),
])
def test_refusals(fields, msg):
    fields.setdefault("scale", "learned")
    with pytest.raises(ValueError, match=msg):
        QuantSpec(**fields)


def test_flax_backend_refuses_learned_scales():
    pytest.importorskip("flax")
    from mixle.flax_backend.qat import SPEC_FIELDS

    with pytest.raises(ValueError, match="scale='learned' is not supported by the flax backend"):
        QuantSpec(bits=4, scale="learned").check_backend("flax", SPEC_FIELDS, "quantizes through Qwix")


def test_bare_arrays_and_lora_refuse_learned_scales_and_activations():
    from mixle.models.qat import fake_quantize

    with pytest.raises(ValueError, match="scale='learned'"):
        fake_quantize(torch.ones(2, 4), bits=4, scale="learned")
    with pytest.raises(ValueError, match="act_bits=8"):
        fake_quantize(torch.ones(2, 4), bits=4, act_bits=8)
    from mixle.experimental.program.lora import LoRASpec
    from mixle.torch_backend.layers.lora import QATLoRALinear

    for fields in (dict(scale="learned"), dict(act_bits=8)):
        with pytest.raises(ValueError, match="LoRA layers cannot take"):
            QATLoRALinear(nn.Linear(8, 4), LoRASpec(rank=2, alpha=4), QuantSpec(bits=4, **fields))
