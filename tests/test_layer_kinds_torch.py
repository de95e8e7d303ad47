"""Layer kinds beyond nn.Linear in plain torch: nn.Conv1d / nn.Conv2d (opt-in) and the report's
accounting of weights no kind takes."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from mixle.api import (apply_qat, convert, get_qat_report, load_quantized, model_nbytes, save_quantized,
                       set_fake_quant_enabled)
from tests.test_numerics import reference_codes_scales


# Converted layers run the exact dequantize-then-matmul path here (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("exact_converted_layers")


def conv_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, groups=2, padding=1, padding_mode="reflect"), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 4))


def test_conv_is_opt_in_and_reported_not_selected():
    model = apply_qat(conv_net(), bits=4)
    report = get_qat_report(model)
    assert report.wrapped == ["4"] and "opt-in" in report["0"].reason
    assert report.weight_share == (4 * 288, 8 * 27 + 8 * 36 + 4 * 288)
    assert "1 quantized, 2 left in float; weights quantized: 69.6% of 1,656 elements" in str(report)


@pytest.mark.parametrize("select", [dict(opt_in=("conv",)), dict(patterns=(r"[02]", "4"))])
def test_conv2d_per_output_channel_toggle_convert_and_save_load(select, tmp_path):
    float_model = conv_net()
    model = copy.deepcopy(float_model)
    weight = model[0].weight
    model = apply_qat(model, bits=4, group_size=9, **select)
    assert get_qat_report(model).wrapped == ["0", "2", "4"]
    assert model[0].weight is weight  # shared Parameter, not a copy
    assert list(model.state_dict()) == list(float_model.state_dict())
    # groups of 9 along the flattened (in / groups * kh * kw) inputs of each output channel
    w = model[2].weight.detach().numpy()
    expected = reference_codes_scales(w.reshape(8, -1), 4, "group", 9)[2].reshape(w.shape)
    np.testing.assert_array_equal(model[2].quantized_weight().detach().numpy(), expected)

    x = torch.randn(2, 3, 6, 6)
    fake = model(x)
    set_fake_quant_enabled(model, False)
    assert torch.equal(model(x), float_model(x))
    set_fake_quant_enabled(model, True)
    converted = convert(model)
    assert torch.equal(converted(x), fake)
    assert model_nbytes(converted).int4_code_bytes == (8 * 27 + 8 * 36 + 4 * 288) // 2
    save_quantized(converted, tmp_path / "conv.safetensors")
    assert torch.equal(load_quantized(tmp_path / "conv.safetensors", conv_net(seed=4))(x), fake)


def test_conv1d_int8_channel_and_gradient():
    torch.manual_seed(0)
    model = apply_qat(nn.Sequential(nn.Conv1d(4, 6, 3, stride=2)), bits=8, opt_in=("conv",))
    x = torch.randn(2, 4, 11)
    w = model[0].weight.detach().numpy()
    expected = reference_codes_scales(w.reshape(6, -1), 8, "channel")[2].reshape(w.shape)
    torch.testing.assert_close(model(x), nn.functional.conv1d(x, torch.from_numpy(expected), model[0].bias, 2),
                               rtol=0, atol=0)
    assert torch.equal(convert(model)(x), model(x))
    # Straight-through: the weight's gradient is the gradient w.r.t. a leaf holding the
    # fake-quantized weight; the same conv1d op on the same values, so equal bit for bit.
    upstream = torch.randn(2, 6, 5)
    (model(x) * upstream).sum().backward()
    leaf = torch.from_numpy(expected).requires_grad_()
    (nn.functional.conv1d(x, leaf, model[0].bias.detach(), 2) * upstream).sum().backward()
    assert torch.equal(model[0].weight.grad, leaf.grad) and model[0].weight.grad.abs().sum() > 0


def test_weights_no_kind_takes_are_reported_with_their_reason():
    model = nn.Sequential(nn.Linear(8, 8))
    model.attn = nn.MultiheadAttention(8, 2, kdim=4, vdim=4)  # separate q/k/v weights: not supported
    model.norm = nn.LayerNorm(8)  # 1-D parameters: not weights the report accounts for
    model.table = nn.Parameter(torch.zeros(3, 8))
    report = get_qat_report(apply_qat(model))
    assert report["attn"].reason.startswith("unsupported type: nn.MultiheadAttention with kdim/vdim")
    assert report["attn.q_proj_weight"].reason == "unsupported type: nn.MultiheadAttention reads q_proj_weight directly"
    assert "reads this weight directly" in report["attn.out_proj"].reason
    assert report["table"].reason == "unsupported type: mixle has no QAT layer for Sequential"
    assert not any(d.path.startswith("norm") for d in report.decisions)
    assert report.weight_share == (64, 64 + (64 + 32 + 32) + 64 + 24)


class Attention(nn.Module):
    def __init__(self, batch_first):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=batch_first)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.attn(x, x, x, need_weights=False)[0])


def attention(batch_first, seed=0):
    torch.manual_seed(seed)
    return Attention(batch_first).eval()


@pytest.mark.parametrize("batch_first", [True, False])  # True: eval under no_grad takes MHA's fast path
def test_multihead_attention_in_and_out_proj_fake_quantized_toggle_convert_save_load(batch_first, tmp_path):
    float_model = attention(batch_first)
    model = apply_qat(copy.deepcopy(float_model), bits=4, group_size=8)
    assert get_qat_report(model).weight_share == (48 * 16 + 16 * 16 + 4 * 16,) * 2
    x = torch.randn(2, 5, 16)
    w_in = reference_codes_scales(model.attn.in_proj_weight.detach().numpy(), 4, "group", 8)[2]
    w_out = reference_codes_scales(model.attn.out_proj.weight.detach().numpy(), 4, "group", 8)[2]
    reference = copy.deepcopy(float_model)
    with torch.no_grad():
        reference.attn.in_proj_weight.copy_(torch.from_numpy(w_in))
        reference.attn.out_proj.weight.copy_(torch.from_numpy(w_out))
        reference.fc.weight.copy_(torch.from_numpy(reference_codes_scales(model.fc.weight.detach().numpy(), 4, "group", 8)[2]))
        fake = model(x)
        # the float MHA on the numpy-quantized weights, along the same (fast or slow) path
        assert torch.equal(fake, reference(x))
        set_fake_quant_enabled(model, False)
        assert torch.equal(model(x), float_model(x))
        set_fake_quant_enabled(model, True)
        converted = convert(model)
        assert torch.equal(converted(x), fake)
        save_quantized(converted, tmp_path / "mha.safetensors")
        assert torch.equal(load_quantized(tmp_path / "mha.safetensors", attention(batch_first, seed=3))(x), fake)
    # Slow path with grad: the STE gradients reaching both weights are the gradients w.r.t. the
    # reference's Parameters, which hold the fake-quantized weights; the stock MHA forward runs on
    # the same values in both, so the same ops in the same order: equal bit for bit.
    model.train()
    reference.train()
    upstream = torch.randn(2, 5, 16)
    (model.attn(x, x, x, need_weights=False)[0] * upstream).sum().backward()
    (reference.attn(x, x, x, need_weights=False)[0] * upstream).sum().backward()
    for name in ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"):
        got, want = model.attn.get_parameter(name).grad, reference.attn.get_parameter(name).grad
        assert torch.equal(got, want) and got.abs().sum() > 0, name
    with pytest.raises(ValueError, match="exclude both or neither"):
        apply_qat(attention(batch_first), exclude=(r"attn\.out_proj",))


@pytest.mark.parametrize("build, fields, refused", [
    (lambda: nn.Sequential(nn.Conv1d(4, 8, 3)), dict(act_bits=8, opt_in=("conv",)), "a conv QAT layer.*act_bits=8"),
    (lambda: nn.Sequential(nn.Conv2d(4, 8, 3)), dict(scale="learned", opt_in=("conv",)), "conv.*scale='learned'"),
    (lambda: nn.MultiheadAttention(16, 2), dict(act_bits=8), "a multihead_attention QAT layer.*act_bits=8"),
])
def test_options_a_layer_kind_does_not_honour_are_refused_not_ignored(build, fields, refused):
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=refused):
        apply_qat(model, bits=4, **fields)
    assert [type(m) for m in model.modules()] == [type(m) for m in build().modules()]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
