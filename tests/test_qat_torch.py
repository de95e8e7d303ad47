"""PyTorch QAT: STE fake-quant, QATWrapper, apply_qat guarantees (ties, checkpoints, toggle, atomicity)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixle.models.qat import (
    QATWrapper,
    QuantSpec,
    apply_qat,
    fake_quantize,
    fake_quantize_int4,
    get_qat_report,
    set_fake_quant_enabled,
)
from tests.test_numerics import GRANULARITIES, reference_codes_scales

# Every test runs on the fused CPU kernels and on the plain torch ops.
pytestmark = pytest.mark.usefixtures("fake_quant_path")


class TinyLM(nn.Module):
    """Embedding -> two Linears -> head tied to the embedding."""

    def __init__(self, vocab=40, d=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids):
        return self.head(self.norm(self.body(self.tok(ids))))


def make_lm(seed=0):
    torch.manual_seed(seed)
    return TinyLM()


def ids(seed=1):
    return torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------- fake_quantize


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("granularity,group_size", GRANULARITIES)
@pytest.mark.parametrize("percentile", [None, 99.0])
def test_fake_quantize_forward_equals_reference_exactly(bits, granularity, group_size, percentile):
    w = np.random.default_rng(bits).standard_normal((8, 32)).astype(np.float32)
    spec = QuantSpec(bits=bits, granularity=granularity, group_size=group_size, clip_percentile=percentile)
    expected = reference_codes_scales(w, bits, granularity, group_size, percentile)[2]
    out = fake_quantize(torch.from_numpy(w), spec=spec)
    np.testing.assert_array_equal(out.numpy(), expected)
    np.testing.assert_array_equal(fake_quantize(w, spec=spec), expected)


def test_fake_quantize_int4_is_bits_4_and_refuses_other_bits():
    x = torch.randn(4, 8)
    assert torch.equal(fake_quantize_int4(x), fake_quantize(x, bits=4))
    with pytest.raises(ValueError, match="bits=8"):
        fake_quantize_int4(x, bits=8)
    with pytest.raises(TypeError, match="not both"):
        fake_quantize(x, spec=QuantSpec(), bits=4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fake_quantize_keeps_low_precision_dtype(dtype):
    torch.manual_seed(0)
    x = torch.randn(6, 16).to(dtype).requires_grad_()
    out = fake_quantize(x, bits=4)
    assert out.dtype == dtype
    # Reference: the grid numerics run in float32 (a float32 copy of x's codes, scales and values),
    # and the values are rounded once to x's dtype.
    w = x.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True) / 7.0
    expected = (torch.round(w / scale).clamp(-7, 7) * scale).to(dtype)
    assert torch.equal(out.detach(), expected)
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_ste_backward_is_identity():
    x = torch.randn(5, 12, requires_grad=True)
    g = torch.randn(5, 12)
    fake_quantize(x, bits=4, clip_percentile=80.0).backward(g)
    assert torch.equal(x.grad, g)


def test_ste_backward_masks_clipped_weights_with_clip_gradient():
    w = np.random.default_rng(3).standard_normal((4, 20)).astype(np.float32)
    x = torch.from_numpy(w).requires_grad_()
    g = torch.randn(4, 20)
    fake_quantize(x, bits=4, clip_percentile=80.0, clip_gradient=True).backward(g)
    s = np.sort(np.abs(w), axis=1)
    pos = 0.8 * 19
    lo = int(pos)
    c = s[:, lo : lo + 1] + (s[:, lo + 1 : lo + 2] - s[:, lo : lo + 1]) * np.float32(pos - lo)
    keep = np.abs(w) <= c
    assert 0 < (~keep).sum() < w.size
    np.testing.assert_array_equal(x.grad.numpy(), g.numpy() * keep)


# ---------------------------------------------------------------------------------- QATWrapper


def test_qatwrapper_shares_parameters_and_quantizes_in_train_and_eval():
    linear = nn.Linear(16, 8)
    wrapper = QATWrapper(linear, bits=4)
    assert isinstance(wrapper, nn.Linear)
    assert wrapper.weight is linear.weight and wrapper.bias is linear.bias
    x = torch.randn(3, 16)
    w = linear.weight.detach().numpy()
    expected_w = reference_codes_scales(w, 4, "channel")[2]
    expected = x @ torch.from_numpy(expected_w).T + linear.bias.detach()
    for mode in (True, False):
        wrapper.train(mode)
        torch.testing.assert_close(wrapper(x), expected, rtol=0, atol=0)


def test_qatwrapper_refuses_nesting_and_non_linear():
    wrapper = QATWrapper(nn.Linear(4, 4))
    with pytest.raises(TypeError, match="never nest"):
        QATWrapper(wrapper)
    with pytest.raises(TypeError, match="nn.Linear"):
        QATWrapper(nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match="group_size=3 does not divide the input size 4"):
        QATWrapper(nn.Linear(4, 4), group_size=3)


# ----------------------------------------------------------------------------------- apply_qat


def test_tied_head_stays_tied_and_gradients_accumulate_in_one_parameter():
    model = make_lm()
    apply_qat(model, bits=4)
    assert isinstance(model.head, QATWrapper)
    assert model.head.weight is model.tok.weight
    params = list(model.parameters())
    assert sum(p is model.tok.weight for p in params) == 1
    model(ids()).sum().backward()
    grad_both = model.tok.weight.grad.clone()
    # The same loss with the embedding use blocked shows the head alone gives a different grad:
    model.zero_grad()
    h = model.norm(model.body(model.tok(ids()).detach()))
    model.head(h).sum().backward()
    assert not torch.equal(grad_both, model.tok.weight.grad)
    assert model.tok.weight.grad.abs().sum() > 0


def test_state_dict_identical_and_loads_strictly_both_ways():
    model = make_lm()
    before = copy.deepcopy(model.state_dict())
    apply_qat(model, bits=4, group_size=8)
    after = model.state_dict()
    assert list(after) == list(before)
    for key in before:
        assert torch.equal(after[key], before[key])
    plain = make_lm(seed=5)
    plain.load_state_dict(after, strict=True)
    model.load_state_dict(make_lm(seed=6).state_dict(), strict=True)
    assert torch.equal(model.tok.weight, make_lm(seed=6).tok.weight)


def test_optimizer_built_before_apply_qat_trains_the_same_tensors():
    model = make_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weight = model.body[0].weight
    start = weight.detach().clone()
    apply_qat(model, bits=4)
    assert model.body[0].weight is weight
    model(ids()).logsumexp(-1).mean().backward()
    opt.step()
    assert not torch.equal(model.body[0].weight, start)


def test_apply_qat_never_changes_a_weight():
    model = make_lm()
    before = [p.detach().clone() for p in model.parameters()]
    apply_qat(model, bits=4, clip_percentile=99.0)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_disabled_is_bit_identical_and_reenabled_equals_fresh_wrap():
    float_model = make_lm()
    qat = apply_qat(copy.deepcopy(float_model), bits=4, group_size=8)
    set_fake_quant_enabled(qat, False)
    out_q, out_f = qat(ids()), float_model(ids())
    assert torch.equal(out_q, out_f)
    out_q.square().mean().backward()
    out_f.square().mean().backward()
    gq, gf = _grads(qat), _grads(float_model)
    assert gq.keys() == gf.keys() and all(torch.equal(gq[k], gf[k]) for k in gq)

    set_fake_quant_enabled(qat, True)
    fresh = apply_qat(copy.deepcopy(float_model), bits=4, group_size=8)
    assert torch.equal(qat(ids()), fresh(ids()))
    assert not torch.equal(qat(ids()), float_model(ids()))


def test_root_linear_is_replaced_and_returned():
    linear = nn.Linear(8, 4)
    wrapped = apply_qat(linear, bits=8)
    assert isinstance(wrapped, QATWrapper) and wrapped.weight is linear.weight
    assert get_qat_report(wrapped).wrapped == [""]


def test_idempotent_same_spec_and_reconfigure_needed_for_another():
    model = apply_qat(make_lm(), bits=4)
    wrappers = [m for m in model.modules() if isinstance(m, QATWrapper)]
    apply_qat(model, bits=4)
    assert [m for m in model.modules() if isinstance(m, QATWrapper)] == wrappers
    assert {d.action for d in get_qat_report(model).decisions} == {"unchanged"}
    with pytest.raises(ValueError, match="reconfigure=True"):
        apply_qat(model, bits=8)
    assert model.body[0].spec.bits == 4
    apply_qat(model, bits=8, reconfigure=True)
    assert {m.spec.bits for m in model.modules() if hasattr(m, "spec")} == {8}
    assert [m for m in model.modules() if isinstance(m, QATWrapper)] == wrappers  # never nested
    assert all(not list(m.children()) for m in wrappers)


def test_patterns_first_match_wins_and_exclude_and_report():
    model = make_lm()
    apply_qat(model, patterns=[(r"body\.0", QuantSpec(bits=8)), (r"body\..*", None), ".*"], exclude=("head",), bits=4)
    report = get_qat_report(model)
    assert model.body[0].spec.bits == 8
    assert not isinstance(model.body[2], QATWrapper)
    assert not isinstance(model.head, QATWrapper) and type(model.tok) is nn.Embedding
    assert report["body.2"].action == "skipped" and "maps it to float" in report["body.2"].reason
    assert report["head"].reason == "excluded by 'head'"
    text = str(report)
    assert "body.0" in text and "int8/channel/symmetric" in text and "1 quantized, 2 left in float" in text


def test_tied_embedding_follows_its_head():
    model = apply_qat(make_lm(), bits=4)
    report = get_qat_report(model)
    assert report["tok"].action == "wrapped" and "head" in report["tok"].reason
    x = ids()
    # The lookup uses the quantized table: row i of the output equals the quantized row.
    w = model.tok.weight.detach().numpy()
    np.testing.assert_array_equal(model.tok(x).detach().numpy(), reference_codes_scales(w, 4, "channel")[2][x.numpy()])
    with pytest.raises(ValueError, match="exclude both or neither"):
        apply_qat(make_lm(), bits=4, exclude=("tok",))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", [QuantSpec(grid="q8_0"), QuantSpec(grid="q4_k"), QuantSpec(bits=4, group_size=32),
                                  QuantSpec(bits=8, group_size=32, clip_percentile=90.0, clip_gradient=True),
                                  QuantSpec(bits=8, granularity="tensor")])
def test_an_embedding_lookup_equals_the_rows_of_the_fake_quantized_table(spec, dtype):
    """The lookup fake-quantizes only the rows it reads (a per-tensor scale: the whole table): the
    same rows and the same straight-through (or clip-masked) gradient, bit for bit."""
    from mixle.torch_backend.layers.qat import QATEmbedding

    torch.manual_seed(0)
    table = nn.Embedding(40, 256, padding_idx=3, scale_grad_by_freq=True).to(dtype)
    reference = table.weight.detach().clone().requires_grad_()
    layer = QATEmbedding(table, spec)
    idx = torch.tensor([[1, 3, 5, 5], [39, 0, 3, 7]])
    out = layer(idx)
    grad = torch.randn(out.shape).to(dtype)
    out.backward(grad)
    want = F.embedding(idx, fake_quantize(reference, spec=spec), padding_idx=3, scale_grad_by_freq=True)
    want.backward(grad)
    assert torch.equal(out, want) and torch.equal(table.weight.grad, reference.grad)


def test_multihead_attention_out_proj_is_quantized_with_its_attention_or_not_at_all():
    model = nn.Sequential(nn.Linear(8, 8))
    model.attn = nn.MultiheadAttention(8, 2)
    apply_qat(model)
    report = get_qat_report(model)
    assert report["attn"].action == report["attn.out_proj"].action == "wrapped"
    assert "read by nn.MultiheadAttention 'attn'" in report["attn.out_proj"].reason
    model = nn.Sequential(nn.Linear(8, 8))
    model.attn = nn.MultiheadAttention(8, 2)
    apply_qat(model, exclude=("attn",))
    report = get_qat_report(model)
    assert report["attn.out_proj"].action == "skipped"
    assert "reads this weight directly" in report["attn.out_proj"].reason


def _snapshot(model):
    return (
        [(name, type(m)) for name, m in model.named_modules()],
        [id(p) for p in model.parameters()],
        {k: v.clone() for k, v in model.state_dict().items()},
    )


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (dict(patterns=("bodyy.*",)), ValueError, ["'bodyy.*'", "matches no nn.Linear"]),
        (dict(exclude=("haed",)), ValueError, ["'haed'", "matches no module"]),
        (dict(patterns=("body[",)), ValueError, ["not a valid regex"]),
        (dict(patterns="body.*"), TypeError, ["sequence of regexes"]),
        (dict(bits=3), ValueError, ["bits=3"]),
        (dict(group_size=7), ValueError, ["group_size=7 does not divide"]),
        (dict(clip_percentile=0), ValueError, ["clip_percentile=0"]),
        (dict(spec="int4"), TypeError, ["QuantSpec"]),
        (dict(reconfigure="yes"), TypeError, ["reconfigure"]),
    ],
)
def test_failed_apply_qat_leaves_model_untouched(kwargs, error, words):
    model = make_lm()
    before = _snapshot(model)
    with pytest.raises(error) as info:
        apply_qat(model, **kwargs)
    for word in words:
        assert word in str(info.value)
    after = _snapshot(model)
    assert after[0] == before[0] and after[1] == before[1]
    assert all(torch.equal(after[2][k], before[2][k]) for k in before[2])


def test_failed_reconfigure_leaves_wrapped_model_untouched():
    model = apply_qat(make_lm(), bits=8, group_size=16)
    with pytest.raises(ValueError, match="group_size=32 does not divide the input size 16"):
        # body.0 has 16 inputs: 32 fails there after body.2 (32 inputs) would have succeeded
        apply_qat(model, bits=4, group_size=32, reconfigure=True)
    assert {m.spec for m in model.modules() if hasattr(m, "spec")} == {QuantSpec(bits=8, group_size=16)}


def test_set_fake_quant_enabled_errors():
    with pytest.raises(ValueError, match="apply_qat"):
        set_fake_quant_enabled(make_lm(), False)
    with pytest.raises(TypeError, match="True or False"):
        set_fake_quant_enabled(apply_qat(make_lm()), 0)
    with pytest.raises(TypeError, match="torch.nn.Module, flax.nnx.Module"):
        apply_qat(object())


def test_report_for_small_model_is_printable():
    model = apply_qat(make_lm(), bits=4, group_size=8, exclude=(r"body\.2",))
    text = str(get_qat_report(model))
    assert text.splitlines()[0].split() == ["path", "kind", "action", "spec", "reason"]
    assert "body.2" in text and "excluded by" in text


def test_user_hooks_keep_working_on_the_wrapper():
    model = make_lm()
    seen = []
    model.body[0].register_forward_hook(lambda module, inputs, output: seen.append(type(module).__name__))
    apply_qat(model, bits=4)
    model(ids())
    assert seen == ["QATWrapper"]


def test_a_meta_device_model_runs_the_qat_forward_and_backward_as_shapes():
    with torch.device("meta"):
        float_model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4))
        qat = apply_qat(nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4)), bits=4)
    ids_ = torch.zeros(2, 3, dtype=torch.long, device="meta")
    expected = float_model(ids_)
    out = qat(ids_)
    assert out.device.type == "meta" and out.shape == expected.shape and out.dtype == expected.dtype
    out.sum().backward()
    assert qat[1].weight.grad.shape == (4, 8)
    with torch.no_grad():
        assert qat(ids_).shape == expected.shape


@pytest.mark.parametrize("shape", [(0, 4), (4, 0)])
def test_an_empty_linear_is_refused_at_apply_qat_with_its_name(shape):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(*shape))
    with pytest.raises(ValueError, match=r"layer '1': its weight is empty .*exclude=\['1'\]"):
        apply_qat(model, bits=4)
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.Linear  # nothing half-applied
    assert type(apply_qat(model, bits=4, exclude=("1",))[0]).__name__ == "QATWrapper"
