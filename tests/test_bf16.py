"""bfloat16 done right: float32 grid numerics for bf16 weights, autocast on the memory-light path.

A bf16 weight gets exactly the codes, scales and values a float32 copy of it gets, the values
rounded once to bf16, on every grid and path (the fused kernels, the torch ops, numpy's and jax's
numerics); convert holds the float32 scales, so it equals the QAT forward. Under autocast the QAT
linear keeps its one autograd node (x saved, nothing else) and computes exactly what ``F.linear``
computes on the fake-quantized weight under autocast.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixle.api import apply_qat, convert
from mixle.core.grids import GRIDS
from mixle.core.numerics import quantize_dequantize_array
from mixle.core.spec import QuantSpec
from mixle.torch_backend.kernels import fused_cpu
from mixle.torch_backend.kernels import packed_linear
from mixle.torch_backend.fake_quant import fake_quantize, fake_quantized_weight, invalidate_caches

SPECS = {
    "int4 g32": QuantSpec(bits=4, group_size=32),
    "qwix int8 channel": QuantSpec(bits=8, grid="qwix"),
    "int8 g32 p99": QuantSpec(bits=8, group_size=32, clip_percentile=99.0, clip_gradient=True),
    "q4_0": QuantSpec(bits=4, grid="q4_0"),
    "q8_0": QuantSpec(bits=8, grid="q8_0"),
}


# Every plain grid (the fused kernel's) x granularity, and percentile clipping with its STE mask.
PLAIN = {f"{grid} int{bits} {label}": QuantSpec(bits=bits, grid=grid, granularity=granularity, group_size=size)
         for grid in ("symmetric", "qwix") for bits in (4, 8)
         for granularity, size, label in (("tensor", None, "tensor"), ("channel", None, "channel"), ("group", 32, "g32"))}
PLAIN["int4 g32 p99 clip_gradient"] = QuantSpec(bits=4, group_size=32, clip_percentile=99.0, clip_gradient=True)


def codes_of(weight, spec):
    invalidate_caches()
    fake_quantized_weight(weight, spec)
    deq, entry = fake_quantized_weight(weight, spec)  # a reused version keeps its codes
    return deq, entry


def numpy_reference(w, spec):
    """The promise: numpy's float32 numerics on the float32 copy of bf16 ``w``, rounded once to bf16."""
    return torch.from_numpy(quantize_dequantize_array(w.detach().float().numpy(), spec)).bfloat16()


def same_bits(a, b):
    return a.dtype == b.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("name", [*SPECS, *PLAIN])
def test_a_bf16_weight_gets_the_codes_scales_and_values_of_its_float32_copy(name, fake_quant_path):
    spec = {**SPECS, **PLAIN}[name]
    torch.manual_seed(0)
    bf16 = nn.Parameter((torch.randn(96, 256) * 0.02).bfloat16())
    deq, entry = codes_of(bf16, spec)
    deq32, entry32 = codes_of(nn.Parameter(bf16.detach().float()), spec)
    assert torch.equal(entry.codes, entry32.codes)
    assert entry.scale.dtype == torch.float32 and torch.equal(entry.scale, entry32.scale)
    # The values: the float32 copy's, rounded once to bf16 (fresh and rebuilt from the kept codes).
    assert same_bits(deq, deq32.bfloat16()) and same_bits(deq, numpy_reference(bf16, spec))
    assert same_bits(fake_quantized_weight(bf16, spec)[0], deq)


# Every grid, the plain ones at every granularity, on tiny weights (rows of 256: the K-quants' block).
EVERY_GRID = {**{f"{grid} int{bits} {granularity}": QuantSpec(bits=bits, grid=grid, granularity=granularity,
                                                             group_size=32 if granularity == "group" else None)
                 for grid in ("symmetric", "qwix") for bits in (4, 8) for granularity in ("tensor", "channel", "group")},
              **{grid: QuantSpec(grid=grid, bits=max(GRIDS[grid].codes)) for grid in GRIDS
                 if grid not in ("symmetric", "qwix") and "torch" in GRIDS[grid].backends}}


@pytest.mark.parametrize("name", EVERY_GRID)
def test_fake_quantize_of_a_bf16_tensor_is_its_float32_copys_values_rounded_once(name, fake_quant_path):
    """The issue's probe: ``fake_quantize(w_bf16)`` against numpy's float32 numerics on ``w_bf16.float()``."""
    spec = EVERY_GRID[name]
    torch.manual_seed(1)
    w = (torch.randn(8, 256) * 0.05).bfloat16()
    w[0, 5] = 0.9  # an outlier: wide steps, many codes that a bf16-rounded scale moves
    x = w.clone().requires_grad_()
    got = fake_quantize(x, spec)
    assert same_bits(got.detach(), numpy_reference(w, spec))
    assert same_bits(got.detach(), fake_quantize(w.float(), spec).bfloat16())
    got.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("name", ["int4 g32", "qwix int8 channel", "q8_0"])
def test_a_bf16_jax_array_is_its_float32_copys_values_rounded_once(name):
    jnp = pytest.importorskip("jax.numpy")
    from mixle.api import fake_quantize as any_fake_quantize
    from mixle.flax_backend.fake_quant import fake_quantize_weight

    spec = SPECS[name]
    torch.manual_seed(2)
    w = (torch.randn(8, 256) * 0.05).bfloat16()
    want = numpy_reference(w, spec).float().numpy()
    w_jax = jnp.asarray(w.float().numpy()).astype(jnp.bfloat16)
    got = any_fake_quantize(w_jax, spec=spec)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
    if GRIDS[spec.grid].is_plain():  # a Flax kernel (in, out), quantized in its own layout
        kernel = fake_quantize_weight(w_jax.T, (0,), spec)
        np.testing.assert_array_equal(np.asarray(kernel.astype(jnp.float32)).T, want)


def _bf16_steps(spec):
    """A bf16 model's training forward and backward, then two eval forwards (the second rebuilds
    from kept codes): ``(outputs, gradients)``. Three equal layers, so the first layer's backward
    finds no recycled buffer holding its weight and rebuilds it from its scales."""
    torch.manual_seed(0)
    model = apply_qat(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.Linear(64, 64)).bfloat16(),
                      spec=spec)
    x = torch.randn(4, 64).bfloat16().requires_grad_()  # the first layer's backward needs its weight
    y = model(x)
    y.float().square().sum().backward()
    with torch.no_grad():
        outputs = [y.detach(), model(x), model(x)]
    return outputs, [x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", PLAIN)
def test_bf16_weights_run_the_kernel_bit_identically_to_the_torch_path(name, monkeypatch):
    if not fused_cpu.available():
        pytest.skip("the fused CPU kernels could not be built here (no C++ compiler)")
    spec = PLAIN[name]
    ran = []
    kernel = fused_cpu._fake_quant_kernel
    monkeypatch.setattr(fused_cpu, "_fake_quant_kernel", lambda x, *args: ran.append(x.dtype) or kernel(x, *args))
    outputs, grads = _bf16_steps(spec)
    assert ran and set(ran) == {torch.bfloat16}  # the kernel, not the torch ops, quantized the bf16 weights
    with fused_cpu.switched_off():
        ref_outputs, ref_grads = _bf16_steps(spec)
    for got, want in zip(outputs + grads, ref_outputs + ref_grads):
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_a_bf16_model_converts_to_exactly_its_qat_forward(exact_converted_layers):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(40, 64), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 40)).bfloat16()
    model[3].weight = model[0].weight
    for spec in SPECS.values():
        qat = apply_qat(model, spec=spec, reconfigure=True)
        ids = torch.randint(0, 40, (3, 7))
        with torch.no_grad():
            expected = qat(ids)
            converted = convert(qat)
            assert converted[1].scale.dtype == torch.float32
            assert torch.equal(converted(ids), expected), spec.short()


def test_fake_quantize_of_bf16_runs_the_float32_numerics():
    torch.manual_seed(3)
    x = torch.randn(64, 32).bfloat16().requires_grad_()
    out = fake_quantize(x, QuantSpec(bits=4))
    w = x.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True) / 7.0
    expected = (torch.round(w / scale).clamp(-7, 7) * scale).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out.detach(), expected)
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("name", ["int4 g32", "int8 g32 p99", "q4_0"])
def test_autocast_keeps_the_memory_light_linear_and_equals_f_linear_under_autocast(name, fake_quant_path):
    spec = SPECS[name]
    torch.manual_seed(0)
    layer, reference = nn.Linear(64, 48), nn.Linear(64, 48)
    reference.load_state_dict(layer.state_dict())
    qat = apply_qat(nn.Sequential(layer), spec=spec)
    x = torch.randn(2, 5, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = qat(x)
    assert [tuple(t.shape) for t in saved] == [(2, 5, 64)]  # x only: no bf16 copy of the weight
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref = F.linear(x_ref, fake_quantize(reference.weight, spec), reference.bias)
    grad = torch.randn_like(y_ref)
    y.backward(grad)
    y_ref.backward(grad)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    assert torch.equal(x.grad, x_ref.grad)
    assert layer.weight.grad.dtype == torch.float32 and torch.equal(layer.weight.grad, reference.weight.grad)
    assert torch.equal(layer.bias.grad, reference.bias.grad)


AUTOCAST_STEPS = {**{grid: QuantSpec(grid=grid) for grid in ("q4_0", "q5_0", "q8_0", "q4_k", "q6_k")},
                  "int4 g32": QuantSpec(bits=4, group_size=32), "qwix int8 channel": QuantSpec(bits=8, grid="qwix"),
                  "int4 g32 p99 clip_gradient": PLAIN["int4 g32 p99 clip_gradient"]}


@pytest.mark.parametrize("name", AUTOCAST_STEPS)
def test_autocast_training_steps_equal_f_linear_of_the_fake_quantized_weights(name, fake_quant_path):
    """Three SGD steps of a 4-layer QAT MLP under bfloat16 autocast (the fused kernels write the bfloat16
    operand directly; recycled buffers, cached codes and rebuilds all run): every output, gradient and
    updated weight equals the same steps through F.linear of fake_quantize(weight)."""
    spec = AUTOCAST_STEPS[name]
    torch.manual_seed(0)
    widths = [256, 512, 256, 512, 256]
    model = nn.Sequential(*[nn.Linear(i, o) for i, o in zip(widths, widths[1:])])
    reference = nn.Sequential(*[nn.Linear(i, o) for i, o in zip(widths, widths[1:])])
    reference.load_state_dict(model.state_dict())
    qat = apply_qat(model, spec=spec)
    steps = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (qat, reference)]
    for step in range(3):
        x = torch.randn(8, 256)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = qat(x)
            h = x
            for layer in reference:
                h = F.linear(h, fake_quantize(layer.weight, spec), layer.bias)
        assert y.dtype == torch.bfloat16 and torch.equal(y, h), step
        grad = torch.randn_like(y)
        y.backward(grad)
        h.backward(grad)
        for mine, theirs in zip(qat, reference):
            assert torch.equal(mine.weight.grad, theirs.weight.grad) and torch.equal(mine.bias.grad, theirs.bias.grad)
        for optimizer in steps:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert all(torch.equal(mine.weight, theirs.weight) for mine, theirs in zip(qat, reference))


def test_a_bf16_model_trains_on_the_memory_light_linear():
    torch.manual_seed(0)
    qat = apply_qat(nn.Sequential(nn.Linear(64, 32)).bfloat16(), bits=4, group_size=32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = qat(torch.randn(4, 64).bfloat16())
    y.float().square().sum().backward()
    assert [tuple(t.shape) for t in saved] == [(4, 64)]
    assert qat[0].weight.grad.dtype == torch.bfloat16


def test_learned_log2_scales_stay_float32_and_keep_small_steps():
    torch.manual_seed(0)
    qat = apply_qat(nn.Sequential(nn.Linear(64, 32)).bfloat16(), bits=4, scale="learned")
    scale = qat[0].weight_log2_scale
    assert scale.dtype == torch.float32
    qat.to(torch.bfloat16)
    assert qat[0].weight_log2_scale is scale and scale.dtype == torch.float32
    before = scale.detach().clone()
    with torch.no_grad():
        scale.add_(1e-3)
    assert torch.all(scale != before)  # in bf16 a 1e-3 step near -6 is lost
    y = qat(torch.randn(4, 64).bfloat16())
    y.float().sum().backward()
    assert scale.grad.dtype == torch.float32 and qat[0].weight.grad.dtype == torch.bfloat16
    with torch.no_grad(), packed_linear.switched_off():
        x = torch.randn(3, 64).bfloat16()
        assert torch.equal(convert(qat)(x), qat(x))


def test_float32_autocast_model_with_act_bits_quantizes_bf16_activations_in_float32():
    torch.manual_seed(0)
    qat = apply_qat(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)), bits=4, group_size=32, act_bits=8)
    x = torch.randn(4, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = qat(x)
        hidden = qat[0](x)
    assert y.dtype == torch.bfloat16 and hidden.dtype == torch.bfloat16
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), packed_linear.switched_off():
        assert torch.equal(convert(qat)(x), y.detach())


def test_the_prepared_gpu_check_runs_on_cpu_in_quick_mode(capsys):
    pytest.importorskip("transformers")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    rows = {name: (value, ratio) for name, value, ratio in gpu_check.main(["--device", "cpu", "--quick"])}
    assert all(rows[f"exact {mode}: {grid}"][0] == 100.0 for mode in ("eager", "compiled")
               for grid in gpu_check.QUICK_GRIDS)
    trained = [ratio for name, (_, ratio) in rows.items() if name.startswith("train eager: mixle")]
    assert len(trained) == len(gpu_check.QUICK_GRIDS) and all(ratio > 0 for ratio in trained)
    assert "matmul 4 tok: q4_0 compiled" in rows and "row (values" in capsys.readouterr().out
