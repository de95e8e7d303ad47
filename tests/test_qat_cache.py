"""The torch QAT fast path: one quantization per weight version, exact reuse, invalidation, memory."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixle.torch_backend.fake_quant.dispatch as fq
from mixle.models.qat import (QATWrapper, QuantSpec, apply_qat, fake_quantize, invalidate_fake_quant_caches,
                              set_fake_quant_enabled)
from mixle.core.array_ops import TorchOps
from mixle.core.numerics import fake_quant_forward, quantize_dequantize_array
from tests.test_numerics import reference_codes_scales
from tests.test_qat_torch import ids, make_lm

# Every test runs on the fused CPU kernels and on the plain torch ops.
pytestmark = pytest.mark.usefixtures("fake_quant_path")


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 16, generator=g) for _ in range(n)]


def reference_forward(model, x, bits=4, granularity="channel", group_size=None):
    """The model's forward with each Linear weight replaced by the plain-numpy fake-quant weight."""
    for layer in model:
        if isinstance(layer, nn.Linear):
            w = reference_codes_scales(layer.weight.detach().numpy(), bits, granularity, group_size)[2]
            x = F.linear(x, torch.from_numpy(w), layer.bias)
        else:
            x = layer(x)
    return x


@pytest.fixture
def calls(monkeypatch, fake_quant_path):
    """Counts of block reductions (scales) and rounding passes (codes), by weight size, on
    either path: the fused kernel computes both in one call, or only codes on given scales."""
    counts = {"stats": [], "codes": []}
    stats, codes, fused = fq.block_stats, fq.round_codes, fq._fused_cpu.fake_quant

    def counted_stats(ops, blocks, *args, **kwargs):
        counts["stats"].append(blocks.numel())
        return stats(ops, blocks, *args, **kwargs)

    def counted_codes(ops, blocks, *args, **kwargs):
        counts["codes"].append(blocks.numel())
        return codes(ops, blocks, *args, **kwargs)

    def counted_fused(x, spec, *, scale=None, **kwargs):
        if scale is None:
            counts["stats"].append(x.numel())
        counts["codes"].append(x.numel())
        return fused(x, spec, scale=scale, **kwargs)

    monkeypatch.setattr(fq, "block_stats", counted_stats)
    monkeypatch.setattr(fq, "round_codes", counted_codes)
    monkeypatch.setattr(fq._fused_cpu, "fake_quant", counted_fused)
    return counts


def reset(counts):
    counts["stats"].clear()
    counts["codes"].clear()


# ------------------------------------------------------------------------------------ reuse


def test_quantized_once_per_optimizer_step_across_micro_batches(calls):
    model = apply_qat(mlp(), bits=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        reset(calls)
        for x in batches(3, seed=step):
            out = model(x)
            assert torch.equal(out, reference_forward(model, x))  # never a stale weight
            out.square().mean().backward()
        if step:  # from the second step on, one reduction and one rounding pass per weight
            assert sorted(calls["stats"]) == [256, 512] and sorted(calls["codes"]) == [256, 512]
        else:  # the first reuse of a version quantizes afresh (a `.data` edit may have changed it)
            assert sorted(calls["stats"]) == [256, 256, 512, 512]
        opt.step()
        opt.zero_grad()


def test_eval_forwards_reuse_the_weight_and_match_the_reference(calls):
    model = apply_qat(mlp(), bits=4, group_size=8).eval()
    x = batches(1)[0]
    with torch.no_grad():
        outs = [model(x) for _ in range(4)]
    # two reductions per weight for all four forwards (the first reuse quantizes afresh, in case
    # a `.data` edit changed the weight), then the int8 codes are reused
    assert sorted(calls["stats"]) == [256, 256, 512, 512]
    assert len(calls["codes"]) <= 4  # rounded at most twice per weight
    for out in outs:
        assert torch.equal(out, reference_forward(model, x, granularity="group", group_size=8))


def test_tied_head_and_embedding_quantize_the_shared_weight_once(calls, fake_quant_path):
    model = apply_qat(make_lm(), bits=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tied = model.tok.weight.numel()
    looked_up = ids().numel() * model.tok.embedding_dim  # the lookup fake-quantizes only its rows
    assert tied not in (m.weight.numel() for m in model.body if isinstance(m, nn.Linear))
    for _ in range(2):
        reset(calls)
        model(ids()).logsumexp(-1).mean().backward()
        # The head's scales, once; its codes again in its backward on the torch ops (the fused
        # path's backward finds the head's weight still in its recycled buffer).
        assert calls["stats"].count(tied) == 1
        assert calls["codes"].count(tied) == (1 if fake_quant_path == "fused" else 2)
        assert calls["stats"].count(looked_up) == 1
        assert len(calls["stats"]) == 4  # tok's rows, head, body.0, body.2
        opt.step()
        opt.zero_grad()
    w = reference_codes_scales(model.tok.weight.detach().numpy(), 4, "channel")[2]
    np.testing.assert_array_equal(model.tok(ids()).detach().numpy(), w[ids().numpy()])


# ------------------------------------------------------------------------------ invalidation


def test_cache_is_invalidated_by_optimizer_step_load_state_dict_and_in_place_edits():
    model = apply_qat(mlp(), bits=4).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = batches(1)[0]

    def check():
        with torch.no_grad():
            for _ in range(3):  # the second and third forwards are served from the cache
                assert torch.equal(model(x), reference_forward(model, x))

    check()
    model(x).sum().backward()
    before = model[0].weight.detach().clone()
    opt.step()
    assert not torch.equal(model[0].weight, before)
    check()
    model.load_state_dict(mlp(seed=7).state_dict())
    assert torch.equal(model[0].weight, mlp(seed=7)[0].weight)
    check()
    with torch.no_grad():
        model[2].weight.mul_(0.5)
    check()
    model[2].weight.data.mul_(2.0)  # bypasses the version counter: documented escape hatch
    invalidate_fake_quant_caches()
    check()
    for _ in range(2):  # bypasses it without the escape hatch (PEFT's merge): the fingerprint sees it
        model[0].weight.data.add_(0.25)
        model[2].weight.data[1:3].mul_(-1.5)  # a few rows only
        check()


def test_load_state_dict_invalidates_even_when_the_version_counter_is_preserved():
    # FSDP2 refills gathered weights under _unsafe_preserve_version_counter; load_state_dict
    # into a QAT layer must still drop the cached weight.
    model = apply_qat(mlp(), bits=4).eval()
    x = batches(1)[0]
    with torch.no_grad():
        model(x), model(x)
        with torch.autograd._unsafe_preserve_version_counter(model[0].weight):
            model[0].weight.copy_(mlp(seed=3)[0].weight)
    model.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model(x), reference_forward(model, x))


def test_reenabling_after_weight_changes_uses_the_new_weights():
    float_model = mlp()
    model = apply_qat(mlp(), bits=4)
    x = batches(1)[0]
    model(x), model(x)  # cache filled
    with torch.no_grad():
        for p, q in zip(model.parameters(), float_model.parameters()):
            p.add_(0.25)
            q.add_(0.25)
    set_fake_quant_enabled(model, False)
    out, ref = model(x), float_model(x)
    assert torch.equal(out, ref)
    out.sum().backward()
    ref.sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), float_model.parameters()))
    set_fake_quant_enabled(model, True)
    assert torch.equal(model(x), reference_forward(model, x))


def test_inference_mode_forwards_and_inference_tensor_weights():
    model = apply_qat(mlp(), bits=4)
    x = batches(1)[0]
    with torch.inference_mode():
        first, second = model(x), model(x)  # the second is served by codes made in inference mode
    assert torch.equal(first, reference_forward(model, x)) and torch.equal(second, first)
    out = model(x)  # and those codes serve a training forward too
    assert torch.equal(out, first)
    out.sum().backward()
    with torch.inference_mode():
        frozen = apply_qat(mlp(seed=2), bits=4)  # its Parameters are inference tensors
        assert torch.equal(frozen(x), reference_forward(frozen, x))


# ------------------------------------------------------------------------------- gradients


def test_gradients_with_the_cache_are_exact_and_straight_through():
    model = apply_qat(mlp(), bits=4, group_size=8)
    x = batches(1)[0]
    model(x).square().mean().backward()  # computes the quantized weights
    first = [p.grad.clone() for p in model.parameters()]
    model(x).square().mean().backward()  # served from the cache (codes kept on reuse)
    for p, g in zip(model.parameters(), first):
        assert torch.equal(p.grad, 2 * g)
    # Straight-through: the weight gradient is the gradient with respect to the quantized weight.
    ref = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    with torch.no_grad():
        for r, m in zip(ref, model):
            if isinstance(m, nn.Linear):
                w = reference_codes_scales(m.weight.detach().numpy(), 4, "group", 8)[2]
                r.weight.copy_(torch.from_numpy(w))
                r.bias.copy_(m.bias)
    ref(x).square().mean().backward()
    for r, g in zip(ref.parameters(), first):
        torch.testing.assert_close(g, r.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", [(16,), (2, 3, 16)])
def test_inputs_of_any_rank_get_the_gradients_of_the_flattened_batch(shape):
    model = apply_qat(nn.Linear(16, 8), bits=4)
    x = torch.randn(*shape, requires_grad=True)
    model(x).sin().sum().backward()
    x2 = x.detach().reshape(-1, 16).requires_grad_()
    w = torch.from_numpy(reference_codes_scales(model.weight.detach().numpy(), 4, "channel")[2]).requires_grad_()
    F.linear(x2, w, model.bias.detach()).sin().sum().backward()
    torch.testing.assert_close(x.grad.reshape(-1, 16), x2.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model.weight.grad, w.grad, rtol=1e-6, atol=1e-7)


def test_frozen_weight_still_passes_the_input_gradient():
    layer = apply_qat(nn.Linear(16, 8), bits=4)
    layer.weight.requires_grad_(False)
    x = torch.randn(4, 16, requires_grad=True)
    layer(x).sum().backward()
    w = reference_codes_scales(layer.weight.numpy(), 4, "channel")[2]
    np.testing.assert_allclose(x.grad.numpy(), np.ones((4, 8), np.float32) @ w, rtol=1e-6)
    assert layer.weight.grad is None


def test_clip_gradient_mask_matches_the_shared_numerics():
    layer = apply_qat(nn.Linear(32, 8), bits=4, clip_percentile=90.0, clip_gradient=True)
    x = torch.randn(5, 32)
    for _ in range(2):  # computed, then from the cache
        layer.weight.grad = None
        layer(x).sum().backward()
        w = layer.weight.detach()
        _, mask = fake_quant_forward(w, layer.spec, with_mask=True)
        assert 0 < (~mask).sum() < mask.numel()
        torch.testing.assert_close(layer.weight.grad, (torch.ones(5, 8).T @ x) * mask, rtol=1e-6, atol=1e-6)


def test_double_backward_matches_a_straight_through_reference():
    layer = apply_qat(nn.Linear(16, 8), bits=4)
    x = torch.randn(4, 16, requires_grad=True)
    (gx,) = torch.autograd.grad(layer(x).tanh().sum(), x, create_graph=True)
    gx.square().sum().backward()
    w = layer.weight.detach().clone().requires_grad_()
    deq = torch.from_numpy(reference_codes_scales(w.detach().numpy(), 4, "channel")[2])
    x2 = x.detach().clone().requires_grad_()
    (gx2,) = torch.autograd.grad(F.linear(x2, w + (deq - w).detach(), layer.bias.detach()).tanh().sum(), x2,
                                 create_graph=True)
    gx2.square().sum().backward()
    torch.testing.assert_close(gx, gx2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad, w.grad, rtol=1e-5, atol=1e-6)


def test_double_backward_through_the_clip_gradient_mask():
    # A gradient penalty on the weight gradient: its path back to the input runs through the
    # clip_gradient mask, which must stay differentiable under create_graph=True.
    spec = QuantSpec(bits=4, clip_percentile=90.0, clip_gradient=True)
    layer = apply_qat(nn.Linear(16, 8), spec=spec)
    x = torch.randn(4, 16, requires_grad=True)
    (gw,) = torch.autograd.grad(layer(x).tanh().sum(), layer.weight, create_graph=True)
    gw.square().sum().backward()
    w = layer.weight.detach().clone().requires_grad_()
    _, mask = fake_quant_forward(w.detach().numpy(), spec, with_mask=True)
    mask = torch.from_numpy(mask).float()
    deq = torch.from_numpy(quantize_dequantize_array(w.detach().numpy(), spec))
    x2 = x.detach().clone().requires_grad_()
    w_ste = (deq - w * mask).detach() + w * mask  # value deq, gradient passed where |w| <= c
    (gw2,) = torch.autograd.grad(F.linear(x2, w_ste, layer.bias.detach()).tanh().sum(), w, create_graph=True)
    gw2.square().sum().backward()
    torch.testing.assert_close(gw, gw2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)


def test_backward_after_an_in_place_weight_change_is_refused():
    layer = apply_qat(nn.Linear(16, 8), bits=4)
    x = torch.randn(4, 16, requires_grad=True)
    out = layer(x)
    with torch.no_grad():
        layer.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_activation_checkpointing_and_autocast_keep_working():
    from torch.utils.checkpoint import checkpoint

    model, x = apply_qat(mlp(), bits=4), batches(1)[0]
    model(x).square().sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    checkpoint(model, x, use_reentrant=False).square().sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# ---------------------------------------------------------------------------------- memory


def test_no_float_copy_of_a_weight_is_saved_for_backward():
    model = apply_qat(mlp(), bits=4)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_sizes = {m.weight.numel() for m in model if isinstance(m, nn.Linear)}
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(batches(1)[0])
    copies = [t for t in saved if t.untyped_storage().data_ptr() not in params and t.numel() in weight_sizes]
    assert copies == [] and saved  # only activations (and the Parameters themselves) are saved
    out.sum().backward()


def _peak_bytes(build, spec):
    """Peak live torch CPU bytes (profiler memory events) from building the model through 2 steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = build() if spec is None else apply_qat(build(), spec=spec)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(64, 256), torch.randn(64, 256)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            opt.step()
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("spec", [QuantSpec(bits=4), QuantSpec(bits=4, group_size=32, clip_percentile=99.0)])
def test_peak_training_memory_stays_within_ten_percent_of_fp32(spec):
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.GELU(), nn.Linear(256, 256))

    fp32, qat = _peak_bytes(build, None), _peak_bytes(build, spec)
    assert qat <= 1.10 * fp32, (qat, fp32)


# ------------------------------------------------------------------------- checks and numerics


@pytest.mark.parametrize("spec", [QuantSpec(bits=4), QuantSpec(bits=8, group_size=8, clip_percentile=50.0)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_raise_the_clear_error_without_a_separate_scan(spec, bad):
    model = apply_qat(mlp(), spec=spec)
    x = batches(1)[0]
    model(x)  # cached
    with torch.no_grad():
        model[2].weight[3, 5] = bad
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="NaN or infinity"):
            model(x)
    with pytest.raises(ValueError, match="NaN or infinity"):
        fake_quantize(model[2].weight.detach(), spec=spec)


def _ranked_rows(count, rows=6, seed=0):
    rng = np.random.default_rng(seed)
    a = np.abs(rng.standard_normal((rows, count))).astype(np.float32)
    a[1] = a[1, 0]  # one value repeated over the whole row
    a[2, : count // 2] = 0.0
    if count > 2:
        a[3, :2] = a[3].max()  # the maximum twice
        a[4, -3:] = np.sort(a[4])[-2]  # the runner-up three times
    return a


@pytest.mark.parametrize("count", [1, 2, 3, 8, 32, 48, 512, 1000])
def test_order_statistics_are_exact_at_every_rank_position(count):
    a = _ranked_rows(count)
    ops = TorchOps()
    ranks = {count - 1, max(count - 2, 0), max(count - 3, 0), max(count - 9, 0), count // 2, 0, min(1, count - 1)}
    for lo in sorted(ranks):
        ks = [lo, min(lo + 1, count - 1)]
        expected = np.partition(a, ks, axis=-1)
        got = ops.order_stats(torch.from_numpy(a.copy()).reshape(2, 3, count), ks)  # may overwrite its input
        for k, value in zip(ks, got):
            np.testing.assert_array_equal(value.reshape(-1).numpy(), expected[:, k])


@pytest.mark.parametrize("granularity,group_size", [("tensor", None), ("channel", None), ("group", 32)])
@pytest.mark.parametrize("percentile", [99.9, 99.0, 75.0])
def test_percentile_clipping_matches_numpy_at_layer_sizes(granularity, group_size, percentile):
    w = np.random.default_rng(5).standard_normal((64, 2048)).astype(np.float32)
    w[3, 100] = 9.0
    spec = QuantSpec(bits=4, granularity=granularity, group_size=group_size, clip_percentile=percentile)
    expected = reference_codes_scales(w, 4, granularity, group_size, percentile)[2]
    np.testing.assert_array_equal(fake_quantize(torch.from_numpy(w), spec=spec).numpy(), expected)
    np.testing.assert_array_equal(quantize_dequantize_array(w, spec), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_percentile_selection_equals_kthvalue(dtype):
    a = torch.from_numpy(_ranked_rows(64, rows=8, seed=3)).to(dtype)
    for ks in ([62, 63], [40, 41], [3, 4]):
        got = TorchOps().order_stats(a.clone(), ks)
        for k, value in zip(ks, got):
            assert torch.equal(value, a.kthvalue(k + 1, dim=-1, keepdim=True).values)


def test_layer_quantized_weight_is_cached_and_exact():
    layer = QATWrapper(nn.Linear(64, 16), bits=8, group_size=16)
    first, second = layer.quantized_weight(), layer.quantized_weight()
    expected = reference_codes_scales(layer.weight.detach().numpy(), 8, "group", 16)[2]
    np.testing.assert_array_equal(first.detach().numpy(), expected)
    assert torch.equal(first, second) and first.requires_grad


@pytest.mark.parametrize("granularity,group_size", [("tensor", None), ("channel", None), ("group", 4)])
def test_signed_zeros_and_zero_rows_give_the_same_bits_on_numpy_and_torch(granularity, group_size):
    w = np.array([[-0.0, 0.0, -0.0, 0.0], [0.5, -0.0, -0.25, 0.0], [-0.0] * 4], np.float32)
    spec = QuantSpec(bits=4, granularity=granularity, group_size=group_size)
    from mixle.task.quantize import quantize_array

    for field in ("scale", "codes"):
        a = np.asarray(getattr(quantize_array(w, spec), field))
        b = getattr(quantize_array(torch.from_numpy(w), spec), field).numpy()
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    a = quantize_dequantize_array(w, spec)
    b = fake_quantize(torch.from_numpy(w), spec=spec).numpy()
    np.testing.assert_array_equal(a.view(np.int32), b.view(np.int32))
