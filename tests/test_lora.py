"""LoRA + QAT: exact no-op start, composition with apply_qat in either order, merge, convert, bad input."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from mixle.experimental.program.lora import (
    LoRALinear,
    LoRASpec,
    QATLoRALinear,
    apply_lora,
    get_lora_report,
    lora_parameters,
    merge_lora,
)
from mixle.models.qat import QATWrapper, QuantSpec, apply_qat, get_qat_report, set_fake_quant_enabled
from tests.test_numerics import reference_codes_scales
from tests.test_optional_imports import BLOCK, run_python
from tests.test_qat_torch import ids, make_lm

BODY = ("body.0", "body.2")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread; a busy 2-core machine makes a thread pool spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def snapshot(model):
    """Everything a failed call must leave unchanged: layer types, tensors, Parameter ids, flags."""
    return (
        [(p, type(m).__name__) for p, m in model.named_modules()],
        {k: v.clone() for k, v in model.state_dict().items()},
        [(n, id(p), p.requires_grad) for n, p in model.named_parameters()],
    )


def assert_same(model, snap):
    types, state, params = snapshot(model)
    assert types == snap[0] and params == snap[2]
    assert state.keys() == snap[1].keys() and all(torch.equal(state[k], snap[1][k]) for k in state)


def randomize_adapters(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def np_linear(x, w, b=None):
    y = x.astype(np.float64) @ w.astype(np.float64).T
    return y if b is None else y + b


def q4(w):
    """Independent int4 per-channel symmetric round trip (the test suite's numpy reference)."""
    return reference_codes_scales(w, 4, "channel", None, None)[2]


# -------------------------------------------------------------------------------- apply_lora


def test_adapters_start_as_exact_noop_and_only_they_train():
    model = make_lm()
    before = model(ids()).detach()
    base_keys = list(model.state_dict())
    lora = apply_lora(model, rank=4, alpha=8)
    assert lora is model and [type(model.body[i]) for i in (0, 2)] == [LoRALinear, LoRALinear]
    assert torch.equal(model(ids()), before)
    keys = list(model.state_dict())
    assert [k for k in keys if "lora" not in k] == base_keys
    assert sorted(k for k in keys if "lora" in k) == [f"{p}.{n}" for p in BODY for n in ("lora_A", "lora_B")]
    assert model.body[0].lora_A.shape == (4, 16) and model.body[0].lora_B.shape == (32, 4)
    missing, unexpected = model.load_state_dict(make_lm(seed=2).state_dict(), strict=False)  # a base checkpoint
    assert unexpected == [] and sorted(missing) == sorted(k for k in keys if "lora" in k)
    model.load_state_dict(make_lm().state_dict(), strict=False)
    bound = 1 / np.sqrt(16)
    assert model.body[0].lora_A.abs().max() <= bound and not model.body[0].lora_B.any()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [f"{p}.{n}" for p in BODY for n in ("lora_A", "lora_B")]
    model(ids()).square().mean().backward()
    assert model.body[0].weight.grad is None and model.body[0].lora_B.grad.abs().sum() > 0


def test_train_base_leaves_flags_and_forward_matches_numpy_reference():
    model = make_lm()
    model.norm.weight.requires_grad_(False)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    apply_lora(model, rank=3, alpha=5, train_base=True)
    assert {n: p.requires_grad for n, p in model.named_parameters() if "lora" not in n} == flags
    randomize_adapters(model)
    layer = model.body[0]
    x = torch.randn(7, 16)
    w, b, a, bb = (t.detach().numpy() for t in (layer.weight, layer.bias, layer.lora_A, layer.lora_B))
    expected = np_linear(x.numpy(), w, b) + (5 / 3) * np_linear(np_linear(x.numpy(), a), bb)
    np.testing.assert_allclose(layer(x).detach().numpy(), expected, rtol=1e-5, atol=1e-5)


def test_dropout_applies_to_adapter_input_in_training_only():
    layer = apply_lora(nn.Sequential(nn.Linear(8, 6)), rank=2, alpha=2, dropout=0.5)[0]
    randomize_adapters(layer)
    x = torch.randn(5, 8)
    base = nn.functional.linear(x, layer.weight, layer.bias)
    torch.manual_seed(3)
    mask_x = nn.functional.dropout(x, 0.5, training=True)
    torch.manual_seed(3)
    out = layer(x)
    expected = base + (mask_x @ layer.lora_A.T @ layer.lora_B.T) * 1.0
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    layer.eval()
    torch.testing.assert_close(layer(x), base + x @ layer.lora_A.T @ layer.lora_B.T, rtol=0, atol=1e-6)


def test_tied_head_is_skipped_and_report_explains():
    model = make_lm()
    apply_lora(model, rank=2, alpha=4)
    report = get_lora_report(model)
    assert report.wrapped == list(BODY) and report.skipped == ["head"]
    assert "shared with 'tok'" in report["head"].reason
    assert type(model.head) is nn.Linear and model.head.weight is model.tok.weight
    assert "2 adapted, 1 without adapter" in str(report)
    with pytest.raises(ValueError, match="no nn.Linear layer it can adapt.*shared with 'tok'"):
        apply_lora(make_lm(), rank=2, alpha=4, patterns=("head",))


def test_multihead_attention_out_proj_is_skipped():
    model = nn.Sequential(nn.MultiheadAttention(8, 2), nn.Linear(8, 8))
    apply_lora(model, rank=2, alpha=2)
    assert get_lora_report(model).skipped == ["0.out_proj"] and isinstance(model[1], LoRALinear)


def test_idempotent_and_different_spec_refused():
    model = make_lm()
    apply_lora(model, rank=2, alpha=4, patterns=(("body.0", LoRASpec(rank=1, alpha=1)), "body.2"))
    assert (model.body[0].lora_spec.rank, model.body[2].lora_spec.rank) == (1, 2)
    params = [id(p) for p in model.parameters()]
    apply_lora(model, rank=2, alpha=4, patterns=(("body.0", LoRASpec(rank=1, alpha=1)), "body.2"))
    assert [id(p) for p in model.parameters()] == params
    assert {d.action for d in get_lora_report(model).decisions if d.spec} == {"unchanged"}
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"'body.0' already has an adapter \(lora r1 a1\), not lora r3 a4: merge_lora"):
        apply_lora(model, rank=3, alpha=4)
    with pytest.raises(ValueError, match="'body.0' has a LoRA adapter but is not selected now"):
        apply_lora(model, rank=2, alpha=4, patterns=("body.2",))
    assert_same(model, snap)


def test_hooks_survive_and_root_linear_is_replaced():
    seen = []
    linear = nn.Linear(4, 3)
    linear.register_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    lora = apply_lora(linear, rank=1, alpha=1)
    lora(torch.randn(2, 4))
    assert isinstance(lora, LoRALinear) and seen == ["LoRALinear"] and lora.weight is linear.weight


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(rank=0, alpha=1), ValueError, r"rank=0 must be a positive int"),
        (dict(rank=-2, alpha=1), ValueError, r"rank=-2 must be a positive int"),
        (dict(rank=2.0, alpha=1), TypeError, r"rank must be a positive int"),
        (dict(rank=True, alpha=1), TypeError, r"rank must be a positive int"),
        (dict(rank=17, alpha=1), ValueError, r"rank=17 is larger than min\(in_features, out_features\)=16 of layer 'body.0'"),
        (dict(rank=2, alpha=0), ValueError, r"alpha=0 must be a finite number > 0"),
        (dict(rank=2, alpha=-1.0), ValueError, r"alpha=-1.0 must be a finite number > 0"),
        (dict(rank=2, alpha=float("nan")), ValueError, r"alpha=nan must be a finite number > 0"),
        (dict(rank=2, alpha=1, dropout=1.0), ValueError, r"dropout=1.0 must be in \[0, 1\)"),
        (dict(rank=2, alpha=1, train_base="no"), TypeError, r"train_base must be True or False"),
        (dict(rank=2, alpha=1, quantize_merged=1), TypeError, r"quantize_merged must be True or False"),
        (dict(rank=2, alpha=1, dropout=0.1, quantize_merged=True), ValueError, r"no place for dropout=0.1"),
        (dict(rank=2, alpha=1, adapter_spec="int8"), TypeError, r"adapter_spec must be a mixle QuantSpec"),
        (dict(rank=2, alpha=1, adapter_spec=QuantSpec(group_size=3)), ValueError, r"adapter_spec does not fit 'body.0'.lora_A"),
        (dict(rank=2, alpha=1, patterns=("bdy.0",)), ValueError, r"patterns entry 'bdy.0' matches no nn.Linear"),
        (dict(rank=2, alpha=1, patterns=(("body.0", QuantSpec()),)), TypeError, r"\(regex, LoRASpec or None\)"),
    ],
)
def test_bad_input_raises_clearly_and_leaves_model_untouched(kwargs, error, match):
    model = make_lm()
    snap = snapshot(model)
    with pytest.raises(error, match=match):
        apply_lora(model, **kwargs)
    assert_same(model, snap)


def test_rank_too_large_for_a_later_layer_changes_nothing():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"rank=8 is larger than .*=4 of layer '1'.*use rank <= 4, or exclude"):
        apply_lora(model, rank=8, alpha=8)
    assert_same(model, snap)


def test_non_torch_model_is_refused():
    with pytest.raises(TypeError, match="apply_lora supports torch.nn.Module"):
        apply_lora(object(), rank=2, alpha=2)


# ------------------------------------------------------------------------- composition with QAT


def lora_then_qat(seed=5, **lora_kwargs):
    torch.manual_seed(seed)
    return apply_qat(apply_lora(make_lm(), rank=2, alpha=4, **lora_kwargs), bits=4)


def qat_then_lora(seed=5, **lora_kwargs):
    torch.manual_seed(seed)
    return apply_lora(apply_qat(make_lm(), bits=4), rank=2, alpha=4, **lora_kwargs)


def test_either_order_gives_the_same_model():
    one, two = lora_then_qat(), qat_then_lora()
    assert repr(one) == repr(two) and type(one.body[0]) is QATLoRALinear
    s1, s2 = one.state_dict(), two.state_dict()
    assert list(s1) == list(s2) and all(torch.equal(s1[k], s2[k]) for k in s1)
    assert [p.requires_grad for p in one.parameters()] == [p.requires_grad for p in two.parameters()]
    randomize_adapters(one), randomize_adapters(two)
    assert torch.equal(one(ids()), two(ids()))
    assert get_qat_report(one).wrapped == get_qat_report(two).wrapped == [*BODY, "head", "tok"]


def test_base_is_fake_quantized_adapter_float_and_toggle_is_exact():
    model = qat_then_lora()
    randomize_adapters(model)
    layer = model.body[0]
    x = torch.randn(6, 16)
    w, b, a, bb = (t.detach().numpy() for t in (layer.weight, layer.bias, layer.lora_A, layer.lora_B))
    adapter = 2.0 * np_linear(np_linear(x.numpy(), a), bb)
    np.testing.assert_allclose(layer(x).detach().numpy(), np_linear(x.numpy(), q4(w), b) + adapter, rtol=1e-5, atol=1e-5)

    float_twin = apply_lora(make_lm(), rank=2, alpha=4)
    float_twin.load_state_dict(model.state_dict())
    fq_out = model(ids())
    set_fake_quant_enabled(model, False)
    assert torch.equal(model(ids()), float_twin(ids()))
    set_fake_quant_enabled(model, True)
    assert torch.equal(model(ids()), fq_out)


def test_adapter_spec_fake_quantizes_adapters_while_enabled():
    model = qat_then_lora(adapter_spec=QuantSpec(bits=8, granularity="tensor"))
    randomize_adapters(model)
    layer = model.body[0]
    x = torch.randn(4, 16)
    a, bb = layer.lora_A.detach().numpy(), layer.lora_B.detach().numpy()
    qa, qb = (reference_codes_scales(t, 8, "tensor", None, None)[2] for t in (a, bb))
    expected = np_linear(x.numpy(), q4(layer.weight.detach().numpy()), layer.bias.detach().numpy())
    np.testing.assert_allclose(layer(x).detach().numpy(), expected + 2.0 * np_linear(np_linear(x.numpy(), qa), qb),
                               rtol=1e-5, atol=1e-5)
    layer(x).sum().backward()  # straight-through: the float adapters get gradients
    assert layer.lora_A.grad.abs().sum() > 0 and layer.weight.grad is None
    set_fake_quant_enabled(model, False)
    assert all(torch.equal(t, r) for t, r in zip(layer.adapter_weights(), (layer.lora_A, layer.lora_B)))


def test_quantize_merged_trains_the_weights_convert_will_store():
    plain_qat = apply_qat(make_lm(), bits=4)
    model = qat_then_lora(quantize_merged=True)
    model.load_state_dict(plain_qat.state_dict(), strict=False)
    assert torch.equal(model(ids()), plain_qat(ids()))  # B = 0: q(W + 0) is q(W), bit for bit
    randomize_adapters(model)
    layer, x = model.body[0], torch.randn(5, 16)
    w, b, a, bb = (t.detach().numpy() for t in (layer.weight, layer.bias, layer.lora_A, layer.lora_B))
    expected = np_linear(x.numpy(), q4(w + (bb @ a) * np.float32(2.0)), b)
    np.testing.assert_allclose(layer(x).detach().numpy(), expected, rtol=1e-5, atol=1e-5)
    layer(x).square().sum().backward()
    assert layer.lora_A.grad.abs().sum() > 0 and layer.lora_B.grad.abs().sum() > 0 and layer.weight.grad is None

    from mixle.task.quantize import convert
    from mixle.torch_backend.kernels import packed_linear

    out = model(ids()).detach()
    set_fake_quant_enabled(model, False)
    float_twin = apply_lora(make_lm(), rank=2, alpha=4)
    float_twin.load_state_dict(model.state_dict())
    assert torch.equal(model(ids()), float_twin(ids()))
    set_fake_quant_enabled(model, True)
    with packed_linear.switched_off():  # the exact path: same float ops, same order
        assert torch.equal(convert(merge_lora(model))(ids()), out)  # no requantization loss at all


def test_optimizer_built_after_lora_keeps_training_after_qat():
    torch.manual_seed(0)
    model = apply_lora(make_lm(), rank=2, alpha=4)
    opt = torch.optim.SGD(lora_parameters(model), lr=0.5)
    adapters = lora_parameters(model)
    model = apply_qat(model, bits=4)
    assert [id(p) for p in lora_parameters(model)] == [id(p) for p in adapters]
    before = model.body[2].lora_B.detach().clone()
    model(ids()).square().mean().backward()
    opt.step()
    assert not torch.equal(model.body[2].lora_B, before)


def test_apply_qat_reconfigure_keeps_the_adapters():
    model = lora_then_qat()
    adapters = [id(p) for p in lora_parameters(model)]
    apply_qat(model, bits=8, group_size=8, reconfigure=True)
    assert model.body[0].spec == QuantSpec(bits=8, group_size=8) and type(model.body[0]) is QATLoRALinear
    assert [id(p) for p in lora_parameters(model)] == adapters
    with pytest.raises(ValueError, match="group_size=5 does not divide"):
        apply_qat(model, bits=8, group_size=5, reconfigure=True)


def test_convert_refuses_unmerged_adapters():
    from mixle.task.quantize import convert

    model = qat_then_lora()
    with pytest.raises(ValueError, match="merge_lora"):
        convert(model)


# ------------------------------------------------------------------------------------ merge


def test_rank_one_merge_is_bit_exact_and_restores_plain_layers():
    model = apply_lora(make_lm(), rank=1, alpha=3)
    randomize_adapters(model)
    weights = [model.body[i].weight for i in (0, 2)]
    expected = [
        m.weight.detach().numpy() + (m.lora_B.detach().numpy() @ m.lora_A.detach().numpy()) * np.float32(3.0)
        for m in (model.body[0], model.body[2])
    ]
    assert merge_lora(model) is model
    assert [type(model.body[i]) for i in (0, 2)] == [nn.Linear, nn.Linear]
    assert [model.body[i].weight for i in (0, 2)] == weights  # the same Parameter objects
    for i, exp in zip((0, 2), expected):
        np.testing.assert_array_equal(model.body[i].weight.detach().numpy(), exp)
    assert list(model.state_dict()) == list(make_lm().state_dict())
    with pytest.raises(ValueError, match="get_lora_report|no LoRA report"):
        get_lora_report(model)


def test_merge_equals_float64_reference_and_keeps_the_function():
    model = apply_lora(make_lm(), rank=4, alpha=8)
    randomize_adapters(model)
    out = model(ids()).detach()
    layer = model.body[0]
    w64, a64, b64 = (t.detach().double().numpy() for t in (layer.weight, layer.lora_A, layer.lora_B))
    exact = w64 + 2.0 * (b64 @ a64)
    merge_lora(model)
    merged = model.body[0].weight.detach().double().numpy()
    np.testing.assert_allclose(merged, exact, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(exact).max())
    torch.testing.assert_close(model(ids()), out, rtol=1e-5, atol=1e-5)


def test_merge_of_qat_lora_gives_qat_wrapper_with_same_spec_and_state():
    model = lora_then_qat()
    randomize_adapters(model)
    set_fake_quant_enabled(model, False)
    float_out = model(ids()).detach()
    merge_lora(model)
    assert type(model.body[0]) is QATWrapper and model.body[0].spec == QuantSpec(bits=4)
    assert model.body[0].enabled is False
    torch.testing.assert_close(model(ids()), float_out, rtol=1e-5, atol=1e-5)
    set_fake_quant_enabled(model, True)
    x = torch.randn(3, 16)
    w, b = model.body[0].weight.detach().numpy(), model.body[0].bias.detach().numpy()
    np.testing.assert_allclose(model.body[0](x).detach().numpy(), np_linear(x.numpy(), q4(w), b), rtol=1e-5, atol=1e-5)


def test_merge_without_adapters_raises_and_leaves_model_untouched():
    model = apply_qat(make_lm(), bits=4)
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"merge_lora found no LoRA adapters .*apply_lora\(model, rank=..., alpha=...\)"):
        merge_lora(model)
    assert_same(model, snap)


def test_merge_interrupted_at_the_second_layer_leaves_everything_as_it_was(monkeypatch):
    model = apply_lora(make_lm(), rank=2, alpha=4)
    randomize_adapters(model)
    snap, report, out = snapshot(model), get_lora_report(model), model(ids()).detach()
    merged_weight, calls = LoRALinear.merged_weight, []

    def fails_second(self):
        calls.append(self)
        if len(calls) == 2:
            raise RuntimeError("interrupted while merging the second layer")
        return merged_weight(self)

    monkeypatch.setattr(LoRALinear, "merged_weight", fails_second)
    with pytest.raises(RuntimeError, match="second layer"):
        merge_lora(model)
    assert len(calls) == 2  # the first layer had been folded when the second failed
    assert_same(model, snap)
    assert [type(model.body[i]) for i in (0, 2)] == [LoRALinear, LoRALinear]
    assert get_lora_report(model) is report
    torch.testing.assert_close(model(ids()), out, rtol=0, atol=0)  # same ops, same order: exact


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_merge_refuses_a_non_finite_adapter_and_leaves_the_model(bad):
    model = apply_lora(make_lm(), rank=2, alpha=4)
    randomize_adapters(model)
    with torch.no_grad():
        model.body[2].lora_B[1, 0] = bad
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"'body\.2'.*NaN or infinity"):
        merge_lora(model)
    types, state, params = snapshot(model)
    assert types == snap[0] and params == snap[2]
    assert all(torch.allclose(state[k], snap[1][k], rtol=0, atol=0, equal_nan=True) for k in state)
    assert all(bool(torch.isfinite(model.body[i].weight).all()) for i in (0, 2))


# ------------------------------------------------------------- train, merge, convert (real int4)


def held_out_loss(model, windows):
    with torch.no_grad():
        logits = model(windows[:, :-1], all_positions=True)
        return nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()


def train_steps(model, params, train_ids, steps, lr, block, gen):
    opt = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        starts = torch.randint(0, len(train_ids) - block - 1, (8,), generator=gen).numpy()
        batch = torch.as_tensor(np.stack([train_ids[s : s + block + 1] for s in starts]))
        logits = model(batch[:, :-1], all_positions=True)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_lora_qat_beats_ptq_after_merge_and_convert_to_int4():
    from mixle.lm.data import load_splits
    from mixle.models.transformer import build_causal_lm
    from mixle.task.quantize import convert, quantize_model

    train_ids, held_ids, tok = load_splits()
    block, gen = 32, torch.Generator().manual_seed(0)
    held = torch.as_tensor(np.stack([held_ids[i : i + block + 1] for i in range(0, 64 * block, block)]))
    torch.manual_seed(0)
    fp32 = build_causal_lm(tok.vocab_size, d_model=32, n_layer=1, n_head=2, block=block)
    train_steps(fp32, fp32.parameters(), train_ids, 80, 2e-2, block, gen)
    ptq_loss = held_out_loss(quantize_model(fp32, bits=4), held)

    model = apply_lora(apply_qat(copy.deepcopy(fp32), bits=4), rank=4, alpha=8)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == sum(p.numel() for p in lora_parameters(model)) == 4 * (32 + 96 + 32 + 32 + 32 + 128 + 128 + 32)
    assert held_out_loss(model, held) == pytest.approx(ptq_loss, abs=1e-6)  # exact no-op on the int4 base
    train_steps(model, lora_parameters(model), train_ids, 60, 1e-2, block, gen)
    trained = held_out_loss(model, held)

    merged = merge_lora(model)
    merged_loss = held_out_loss(merged, held)  # fake-quant of the merged weights: requantized
    int4 = convert(merged)
    kinds = {type(m).__name__ for m in int4.modules()}
    assert {"QuantizedLinear", "QuantizedEmbedding"} <= kinds and not kinds & {"Linear", "LoRALinear", "QATWrapper"}
    int4_loss = held_out_loss(int4, held)
    print(f"held-out loss: fp32 {held_out_loss(fp32, held):.4f}, PTQ int4 {ptq_loss:.4f}, LoRA+QAT {trained:.4f}, "
          f"merged fake-quant {merged_loss:.4f}, merged+converted int4 {int4_loss:.4f}")
    assert int4_loss == pytest.approx(merged_loss, abs=1e-5)
    assert int4_loss < ptq_loss - 0.01


def test_lora_module_imports_without_torch_and_names_the_extra():
    out = run_python(
        BLOCK
        + """
import mixle.experimental.program.lora as lora
print(lora.LoRASpec(rank=2, alpha=4).short())
try:
    lora.LoRALinear()
except ImportError as err:
    print("pip install mixle[torch]" in str(err))
"""
    )
    assert out.splitlines() == ["lora r2 a4", "True"]
