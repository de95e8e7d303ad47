"""convert(QAT model) and PTQ (quantize_model): exact forwards, one grid, ties, independence, errors."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixle.torch_backend.kernels import packed_linear
from mixle.torch_backend.layers.qat import QATWrapper
from mixle.models.qat import apply_qat, get_qat_report
from mixle.task.quantize import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantSpec,
    convert,
    quantize_mlp,
    quantize_model,
    unpack_int4,
)


def make_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


class TinyCausalLM(nn.Module):
    """One pre-norm attention + MLP block; the output head is tied to the token embedding."""

    def __init__(self, vocab=96, dim=32, context=16, tied=True):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, ids):
        t = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(t))
        h = self.ln1(x)
        x = x + self.o(F.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h), is_causal=True))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.head(self.ln_f(x))


def make_lm(seed=0, **kwargs):
    torch.manual_seed(seed)
    return TinyCausalLM(**kwargs)


def lm_batch(seed=1, batch=4, length=12, vocab=96):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def mlp_batch(seed=1):
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(seed))


def train_qat(model, batch, steps=3):
    """A few SGD steps so the QAT weights move off their initialisation through the STE."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        out = model(batch)
        loss = out.float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def numpy_reference_weight(w, bits=4, group_size=None, grid="symmetric"):
    """Plain numpy: (out, in) float32 weight -> dequantized weight, per row or per row group."""
    qmax = 2 ** (bits - 1) - 1
    lowest = -qmax if grid == "symmetric" else -qmax - 1
    divisor = np.float32(qmax if grid == "symmetric" else qmax + 0.5)
    blocks = w.reshape(w.shape[0], -1, group_size or w.shape[1])
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / divisor
    scale = np.where(scale == 0, np.float32(1), scale)
    codes = np.clip(np.rint(blocks / scale), lowest, qmax)
    return (codes * scale).reshape(w.shape).astype(np.float32)


SPECS = [
    QuantSpec(bits=4),
    QuantSpec(bits=8),
    QuantSpec(bits=4, group_size=8, grid="qwix"),
    QuantSpec(bits=4, clip_percentile=99.0),
    QuantSpec(bits=8, granularity="tensor"),
]


# ----------------------------------------------------------------------------------------------
# convert(QAT) == fake-quant forward


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.short())
@pytest.mark.parametrize("kind", ["mlp", "lm"])
def test_convert_forward_equals_fake_quant_forward_bit_for_bit(kind, spec):
    model, batch = (make_mlp(), mlp_batch()) if kind == "mlp" else (make_lm(), lm_batch())
    qat = train_qat(apply_qat(model, spec=spec), batch)
    qat.eval()
    converted = convert(qat)
    with torch.no_grad(), packed_linear.switched_off():  # the exact path: same float ops, same order
        expected, got = qat(batch), converted(batch)
    assert (got - expected).abs().max().item() == 0.0
    assert torch.equal(got, expected)
    for path, module in qat.named_modules():
        if isinstance(module, QATWrapper):
            new = converted.get_submodule(path)
            assert isinstance(new, QuantizedLinear) and new.spec == spec
            assert torch.equal(new.dequantized_weight(), module.quantized_weight().detach())


def test_convert_leaves_the_qat_model_untouched_and_independent():
    qat = train_qat(apply_qat(make_lm(), bits=4), lm_batch())
    before = {k: v.detach().clone() for k, v in qat.state_dict().items()}
    params = [id(p) for p in qat.parameters()]
    converted = convert(qat)
    assert [id(p) for p in qat.parameters()] == params
    assert all(torch.equal(before[k], v) for k, v in qat.state_dict().items())
    assert isinstance(qat.fc1, QATWrapper) and get_qat_report(qat).wrapped
    assert not any(p is q for p in qat.parameters() for q in converted.parameters())
    with torch.no_grad():
        converted.ln_f.weight.add_(1.0)  # changing the copy leaves the original alone
    assert torch.equal(qat.ln_f.weight, before["ln_f.weight"])
    with pytest.raises(ValueError, match="no QAT report"):
        get_qat_report(converted)


def test_convert_ignores_the_fake_quant_toggle():
    from mixle.models.qat import set_fake_quant_enabled

    qat = apply_qat(make_mlp(), bits=4)
    with torch.no_grad():
        expected = qat(mlp_batch())
    set_fake_quant_enabled(qat, False)
    with torch.no_grad(), packed_linear.switched_off():  # the exact path: same float ops, same order
        assert torch.equal(convert(qat)(mlp_batch()), expected)


def test_convert_of_a_wrapped_root_linear_is_a_quantized_linear():
    qat = apply_qat(nn.Linear(8, 3), bits=8)
    layer = convert(qat)
    assert isinstance(layer, QuantizedLinear) and layer.codes.dtype == torch.int8
    assert tuple(layer.codes.shape) == (3, 8)


# ----------------------------------------------------------------------------------------------
# PTQ == numpy reference


@pytest.mark.parametrize("bits,group_size,grid", [(4, None, "symmetric"), (8, None, "symmetric"), (4, 16, "qwix")])
def test_ptq_mlp_forward_equals_a_numpy_dequantize_reference(bits, group_size, grid):
    model = make_mlp()
    ptq = quantize_model(model, bits=bits, group_size=group_size, grid=grid)
    ws = [numpy_reference_weight(layer.weight.detach().numpy(), bits, group_size, grid) for layer in (model[0], model[2])]
    for layer, w in zip((ptq[0], ptq[2]), ws):
        np.testing.assert_array_equal(layer.dequantized_weight().numpy(), w)  # bit-exact weights
    x = mlp_batch().numpy()
    b1, b2 = model[0].bias.detach().numpy(), model[2].bias.detach().numpy()
    reference = np.maximum(x @ ws[0].T + b1, 0) @ ws[1].T + b2
    with torch.no_grad():
        got = ptq(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)  # matmul summation order only
    float_out = model(torch.from_numpy(x)).detach().numpy()
    assert np.abs(float_out - reference).max() > 1e-4  # the reference is not the float model


def test_ptq_lm_weights_equal_the_numpy_reference_and_the_tie_holds():
    model = make_lm()
    ptq = quantize_model(model, bits=4, group_size=8)
    for name in ("q", "k", "v", "o", "fc1", "fc2", "head"):
        w = getattr(model, name).weight.detach().numpy()
        got = getattr(ptq, name).dequantized_weight().numpy()
        np.testing.assert_array_equal(got, numpy_reference_weight(w, 4, 8))
    assert isinstance(ptq.tok, QuantizedEmbedding) and isinstance(ptq.pos, nn.Embedding)
    ids = lm_batch()
    table = numpy_reference_weight(model.tok.weight.detach().numpy(), 4, 8)
    with torch.no_grad():
        np.testing.assert_array_equal(ptq.tok(ids).numpy(), table[ids.numpy()])


def test_ptq_leaves_the_float_model_untouched():
    model = make_lm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = [type(m) for m in model.modules()]
    ptq = quantize_model(model, bits=4)
    assert [type(m) for m in model.modules()] == modules
    assert model.head.weight is model.tok.weight
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not hasattr(model, "_mixle_qat_report")
    assert isinstance(ptq.head, QuantizedLinear)


def test_ptq_selection_follows_patterns_and_exclude():
    ptq = quantize_model(make_lm(), bits=4, patterns=(("fc.*", QuantSpec(bits=8)), ".*"), exclude=("head",))
    assert isinstance(ptq.head, nn.Linear) and isinstance(ptq.tok, nn.Embedding)
    assert ptq.head.weight is ptq.tok.weight  # left float, still tied
    assert ptq.fc1.spec.bits == 8 and ptq.q.spec.bits == 4


# ----------------------------------------------------------------------------------------------
# One grid for PTQ and QAT


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.short())
def test_ptq_codes_equal_convert_of_qat_bit_for_bit(spec):
    model = make_lm()
    ptq = quantize_model(model, spec)
    qat = apply_qat(copy.deepcopy(model), spec=spec)
    converted = convert(qat)
    for name in ("q", "fc1", "head"):
        a, b = getattr(ptq, name), getattr(converted, name)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
        assert torch.equal(a.dequantized_weight(), getattr(qat, name).quantized_weight().detach())


def test_ptq_and_qat_move_together_when_the_shared_grid_changes(monkeypatch):
    """Change the grid definition in its one place; PTQ and the QAT fake-quant must both follow."""
    model = make_mlp()
    normal = quantize_model(model, bits=4)[0].dequantized_weight()
    monkeypatch.setattr(QuantSpec, "scale_divisor", property(lambda self: self.qmax - 2.0))
    monkeypatch.setattr(QuantSpec, "code_min", property(lambda self: -self.qmax + 2))
    monkeypatch.setattr(QuantSpec, "code_max", property(lambda self: self.qmax - 2))
    ptq_weight = quantize_model(model, bits=4)[0].dequantized_weight()
    qat_weight = apply_qat(copy.deepcopy(model), bits=4)[0].quantized_weight().detach()
    assert not torch.equal(ptq_weight, normal)  # the change reached PTQ ...
    assert torch.equal(ptq_weight, qat_weight)  # ... and QAT, identically
    codes = unpack_int4(quantize_model(model, bits=4)[0].codes, (64, 32))
    assert int(codes.abs().max()) == 5


# ----------------------------------------------------------------------------------------------
# Ties


def test_tied_embedding_and_head_share_one_codes_buffer_after_convert():
    converted = convert(apply_qat(make_lm(), bits=4))
    assert isinstance(converted.tok, QuantizedEmbedding) and isinstance(converted.head, QuantizedLinear)
    assert converted.head.codes is converted.tok.codes
    assert converted.head.scale is converted.tok.scale
    assert not any(name.endswith("weight") and p.shape == (96, 32) for name, p in converted.named_parameters())
    ids = lm_batch()
    with torch.no_grad():
        assert torch.equal(converted.tok(ids), converted.head.dequantized_weight()[ids])


def test_untied_lm_keeps_a_float_embedding():
    converted = convert(apply_qat(make_lm(tied=False), bits=4))
    assert type(converted.tok) is nn.Embedding and isinstance(converted.head, QuantizedLinear)


# ----------------------------------------------------------------------------------------------
# quantize_mlp and refusals


def test_quantize_mlp_accepts_an_mlp_and_refuses_other_models():
    mlp = quantize_mlp(make_mlp(), bits=8)
    assert [type(m).__name__ for m in mlp] == ["QuantizedLinear", "ReLU", "QuantizedLinear"]
    with pytest.raises(ValueError, match="quantize_mlp takes an MLP.*'tok' is a Embedding.*use quantize_model"):
        quantize_mlp(make_lm())
    with pytest.raises(ValueError, match="no nn.Linear"):
        quantize_mlp(nn.Sequential(nn.ReLU()))


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="convert found no QAT layers.*apply_qat.*quantize_model"):
        convert(make_mlp())
    with pytest.raises(TypeError, match="convert supports torch.nn.Module"):
        convert(np.zeros(3))
    with pytest.raises(ValueError, match="QAT-wrapped model: use convert"):
        quantize_model(apply_qat(make_mlp(), bits=4))
    with pytest.raises(ValueError, match="already has quantized layers"):
        quantize_model(quantize_model(make_mlp()))
    with pytest.raises(ValueError, match="selected no nn.Linear"):
        quantize_model(make_mlp(), patterns=(("0", None), ("2", None)))
    with pytest.raises(TypeError, match="not both"):
        quantize_model(make_mlp(), QuantSpec(bits=4), bits=8)


class ScaledQATLinear(QATWrapper):
    """A QATWrapper subclass whose forward uses an extra parameter (like an unmerged adapter)."""

    def __init__(self, linear, spec):
        super().__init__(linear, spec)
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return super().forward(x) * self.gain


def test_convert_refuses_qat_layers_with_more_than_a_quantized_weight():
    model = nn.Sequential(ScaledQATLinear(nn.Linear(4, 4), QuantSpec(bits=4)))
    with pytest.raises(ValueError, match=r"'0' is a ScaledQATLinear .*\['gain'\].*fold the rest in"):
        convert(model)


def test_quantized_linear_validates_its_storage():
    spec = QuantSpec(bits=4)
    good = torch.zeros(6, dtype=torch.uint8)
    scale = torch.ones(1, 3, 1)
    QuantizedLinear(good, scale, spec, (3, 4))
    with pytest.raises(ValueError, match=r"codes span \[-8, 0\], outside the int4/channel/symmetric grid \[-7, 7\]"):
        QuantizedLinear(torch.tensor([8, 0, 0, 0, 0, 0], dtype=torch.uint8), scale, spec, (3, 4))
    with pytest.raises(ValueError, match=r"needs torch.uint8 codes of shape \[6\]"):
        QuantizedLinear(torch.zeros(3, 4, dtype=torch.int8), scale, spec, (3, 4))
    with pytest.raises(ValueError, match=r"floats of shape \[1, 3, 1\]"):
        QuantizedLinear(good, torch.ones(3), spec, (3, 4))
    with pytest.raises(ValueError, match="finite and positive"):
        QuantizedLinear(good, torch.full((1, 3, 1), float("nan")), spec, (3, 4))
    with pytest.raises(ValueError, match="bias must be a float tensor of shape"):
        QuantizedLinear(good, scale, spec, (3, 4), bias=torch.zeros(4))
    with pytest.raises(ValueError, match="pad nibble"):
        QuantizedLinear(torch.tensor([0, 0x10], dtype=torch.uint8), torch.ones(1, 1, 1), spec, (1, 3))
    with pytest.raises(ValueError, match="weight_format='float8_e4m3fn' is not supported by the torch backend"):
        QuantizedLinear(good, scale, QuantSpec(bits=8, grid="qwix", weight_format="float8_e4m3fn"), (3, 4))
