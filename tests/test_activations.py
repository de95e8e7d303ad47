"""Per-token activation fake-quant on the torch backend (act_bits, act_symmetric)."""

import numpy as np
import pytest
import torch
from torch import nn

from mixle.core.spec import QuantSpec
from mixle.models.qat import apply_qat, set_fake_quant_enabled
from mixle.api import convert, load_quantized, save_quantized
from mixle.torch_backend.layers.activations import fake_quant_activations, quantize_dequantize_activations


# Converted layers run the exact dequantize-then-matmul path here (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("exact_converted_layers")


def np_symmetric(x, bits, lo, hi, divisor):
    absmax = np.abs(x).max(-1, keepdims=True)
    scale = np.where(absmax > 0, absmax / np.float32(divisor), np.float32(1))
    return np.clip(np.round(x / scale), lo, hi) * scale


def np_asymmetric(x, bits):
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    lo = np.minimum(x.min(-1, keepdims=True), 0)
    hi = np.maximum(x.max(-1, keepdims=True), 0)
    scale = np.maximum((hi - lo) / np.float32(qmax - qmin), np.finfo(np.float32).eps)
    zero = np.clip(np.float32(qmin) - np.round(lo / scale), qmin, qmax)
    q = np.clip(np.round(x / scale) + zero, qmin, qmax)
    return (q - zero) * scale


def _tokens(seed=0, shape=(3, 5, 64)):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * rng.uniform(0.1, 4, shape[:-1] + (1,))).astype(np.float32)
    x[0, 0] = 0.0  # an all-zero token
    x[0, 1] = np.abs(x[0, 1])  # all positive: the asymmetric range starts at 0
    return x


@pytest.mark.parametrize("grid,lo,hi,divisor", [("symmetric", -127, 127, 127.0), ("qwix", -128, 127, 127.5)])
def test_symmetric_matches_numpy(grid, lo, hi, divisor):
    x = _tokens()
    got = quantize_dequantize_activations(torch.from_numpy(x), QuantSpec(bits=4, grid=grid, act_bits=8))
    # The same float32 ops in the same order: exact.
    np.testing.assert_array_equal(got.numpy(), np_symmetric(x, 8, lo, hi, divisor))


@pytest.mark.parametrize("bits", [8, 4])
def test_asymmetric_matches_numpy(bits):
    x = _tokens(1)
    got = quantize_dequantize_activations(torch.from_numpy(x), QuantSpec(bits=4, act_bits=bits, act_symmetric=False))
    np.testing.assert_array_equal(got.numpy(), np_asymmetric(x, bits))
    assert (got[0, 0] == 0).all()


def test_asymmetric_matches_torchao_8da4w_activations():
    pytest.importorskip("torchao")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.quantization.qat import IntxFakeQuantizeConfig
        from torchao.quantization.qat.fake_quantizer import IntxFakeQuantizer

    config = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False,
                                    eps=torch.finfo(torch.float32).eps)
    x = torch.from_numpy(_tokens(2))
    theirs = IntxFakeQuantizer(config)(x)
    ours = quantize_dequantize_activations(x, QuantSpec(bits=4, act_bits=8, act_symmetric=False))
    # Same grid and rule; torchao may round x * (1 / scale) instead of x / scale, which can move a
    # value sitting on a rounding boundary by one step, so allow one step on a few elements.
    step = (x.amax(-1, keepdim=True).clamp(min=0) - x.amin(-1, keepdim=True).clamp(max=0)) / 255
    off = (ours - theirs).abs()
    assert (off <= step * 1.001 + 1e-7).all()
    assert (off > 1e-6).float().mean() < 0.01


def test_straight_through_gradient_and_disabled_is_identity():
    x = torch.randn(4, 8, requires_grad=True)
    spec = QuantSpec(bits=4, act_bits=8)
    (fake_quant_activations(x, spec) * torch.arange(8.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(8.0).expand(4, 8))
    assert fake_quant_activations(x, QuantSpec(bits=4)) is x


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


@pytest.mark.parametrize("symmetric", [True, False])
def test_qat_forward_convert_and_toggle(symmetric, tmp_path):
    spec = QuantSpec(bits=4, group_size=8, act_bits=8, act_symmetric=symmetric)
    model = apply_qat(_mlp(), spec=spec)
    x = torch.randn(5, 16)
    # Reference: weights fake-quantized by mixle, activations by numpy, float32 ops as the layer runs them.
    w0, w1 = (layer.quantized_weight().detach() for layer in (model[0], model[2]))
    a0 = torch.from_numpy((np_symmetric(x.numpy(), 8, -127, 127, 127.0) if symmetric else np_asymmetric(x.numpy(), 8)))
    h = nn.functional.gelu(nn.functional.linear(a0, w0, model[0].bias))
    a1 = torch.from_numpy(np_symmetric(h.detach().numpy(), 8, -127, 127, 127.0) if symmetric
                          else np_asymmetric(h.detach().numpy(), 8))
    want = nn.functional.linear(a1, w1, model[2].bias)
    with torch.no_grad():
        fake = model(x)
        assert torch.equal(fake, want)
        assert torch.equal(convert(model)(x), fake)  # convert == fake-quant, bit for bit
        save_quantized(convert(model), tmp_path / "m.safetensors")
        loaded = load_quantized(tmp_path / "m.safetensors", _mlp(1))
        assert loaded[0].spec == spec and torch.equal(loaded(x), fake)
        set_fake_quant_enabled(model, False)
        assert torch.equal(model(x), _mlp()(x))  # the toggle is exact: plain float maths


def test_torch_compile_matches_eager():
    spec = QuantSpec(bits=4, act_bits=8, act_symmetric=False)
    model = apply_qat(_mlp(), spec=spec)
    x = torch.randn(6, 16, requires_grad=True)
    eager = model(x)
    eager.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    # aot_eager runs the same aten ops: equal up to float32 reassociation in the matmul backward.
    torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, grad, rtol=1e-5, atol=1e-6)


def test_refusals():
    with pytest.raises(ValueError, match="act_symmetric=False .* act_bits is None"):
        QuantSpec(bits=4, act_symmetric=False)
    with pytest.raises(TypeError, match="act_symmetric"):
        QuantSpec(bits=4, act_bits=8, act_symmetric="no")
    from mixle.torch_backend.layers.activations import check_activation_spec

    check_activation_spec(QuantSpec(bits=4, grid="q4_0", act_bits=8))  # llama.cpp's Q8_0 blocks (test_gguf_grids)
    net = nn.Sequential(nn.Linear(64, 4))
    with pytest.raises(ValueError, match="act_bits=4 with grid='q4_0'.*use act_bits=8"):
        apply_qat(net, bits=4, grid="q4_0", act_bits=4)
    assert type(net[0]) is nn.Linear


def test_flax_backend_refuses_asymmetric_activations():
    pytest.importorskip("flax")
    from mixle.flax_backend.qat import SPEC_FIELDS

    with pytest.raises(ValueError, match="act_symmetric=False is not supported by the flax backend"):
        QuantSpec(bits=4, act_bits=8, act_symmetric=False).check_backend("flax", SPEC_FIELDS, "quantizes through Qwix")
