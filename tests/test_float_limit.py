"""The float limit: no finite weight dequantizes to infinity, on any grid, layout or array library.

A weight near float32's largest value is refused alike by numpy, torch (the fused kernel and the
torch ops; a QAT layer names itself) and jax (eagerly; the Flax QAT forward names its module), with
a ScaleOverflowError naming the array; where every library accepts a weight, they give the same
finite values. A bfloat16/float16 weight is refused where its float32 values would round to
infinity in its own dtype.
"""

import numpy as np
import pytest
import torch
from torch import nn

from mixle.api import apply_qat, fake_quantize
from mixle.core.array_ops import TorchOps
from mixle.core.checks import ScaleOverflowError
from mixle.core.grids import GRIDS
from mixle.core.numerics import quantize_dequantize_array
from mixle.core.spec import QuantSpec
from mixle.torch_backend.kernels import fused_cpu

FLOAT32_MAX = float(np.finfo(np.float32).max)

SPECS = {**{f"{grid} int{bits} {granularity}": QuantSpec(bits=bits, grid=grid, granularity=granularity,
                                                        group_size=32 if granularity == "group" else None)
            for grid in ("symmetric", "qwix") for bits in (4, 8) for granularity in ("tensor", "channel", "group")},
         **{grid: QuantSpec(grid=grid, bits=max(GRIDS[grid].codes)) for grid in GRIDS
            if grid not in ("symmetric", "qwix") and "torch" in GRIDS[grid].backends}}
LIBRARIES = ["numpy", "torch fused", "torch ops", "jax"]


def fake_quantized(library, w, spec):
    """``("refused", message)`` or ``("values", float32 numpy array)`` of ``fake_quantize(w)`` in ``library``."""
    try:
        if library == "numpy":
            out = fake_quantize(w, spec=spec)
        elif library == "jax":
            jnp = pytest.importorskip("jax.numpy")
            out = np.asarray(fake_quantize(jnp.asarray(w), spec=spec).astype(jnp.float32))
        elif library == "torch fused":
            if not fused_cpu.available():
                pytest.skip("the fused CPU kernels could not be built here (no C++ compiler)")
            out = fake_quantize(torch.from_numpy(w), spec=spec).detach().numpy()
        else:
            with fused_cpu.switched_off():
                out = fake_quantize(torch.from_numpy(w), spec=spec).detach().numpy()
    except ScaleOverflowError as err:
        return "refused", str(err)
    return "values", np.asarray(out, np.float32)


def weights(rows=2, cols=256, seed=0):
    return (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.1).astype(np.float32)


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("top", [FLOAT32_MAX, -FLOAT32_MAX, -3.4e38, -0.999 * FLOAT32_MAX, 1e30])
def test_every_library_refuses_alike_or_gives_the_same_finite_values(name, top):
    spec = SPECS[name]
    w = weights()
    w[0, 3] = top
    w[1, 7] = -top
    results = {library: fake_quantized(library, w, spec) for library in LIBRARIES}
    assert len({kind for kind, _ in results.values()}) == 1, {k: v[1] if v[0] == "refused" else "values"
                                                              for k, v in results.items()}
    kind = results["numpy"][0]
    if kind == "refused":
        for library, (_, message) in results.items():
            # numpy and jax call the array x, the torch backend (the QAT layers' weight) weight.
            assert message.startswith("weight: " if library.startswith("torch") else "x: "), (library, message)
            assert "infinity" in message or "does not fit" in message
    else:
        values = [v for _, v in results.values()]
        assert all(np.isfinite(v).all() for v in values)
        assert all(np.array_equal(v.view(np.int32), values[0].view(np.int32)) for v in values)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("granularity", ["tensor", "channel", "group"])
def test_the_qwix_grid_at_float32s_limit_is_refused_everywhere(bits, granularity):
    """The issue's probe: code -8 of ``grid='qwix'`` times the scale of -3.4e38 overflows."""
    spec = QuantSpec(bits=bits, grid="qwix", granularity=granularity, group_size=32 if granularity == "group" else None)
    w = np.zeros((1, 64), np.float32)
    w[0, 0] = -3.4e38
    for library in LIBRARIES:
        kind, message = fake_quantized(library, w, spec)
        assert kind == "refused" and "overflows float32" in message, (library, message)
    assert fake_quantized("torch fused", w * np.float32(0.5), spec)[0] == "values"  # half as large fits


@pytest.mark.parametrize("path", ["fused", "torch ops"])
def test_a_qat_layer_refuses_with_a_scale_overflow_error_naming_itself(path):
    if path == "fused" and not fused_cpu.available():
        pytest.skip("the fused CPU kernels could not be built here (no C++ compiler)")
    model = nn.Sequential(nn.Linear(64, 4), nn.Linear(4, 2))
    with torch.no_grad():
        model[1].weight[0, 0] = -3.4e38
    qat = apply_qat(model, bits=4, grid="qwix", group_size=2)
    with pytest.raises(ScaleOverflowError, match=r"layer '1': weight: on int4/group2/qwix .* dequantize to infinity"):
        if path == "fused":
            qat(torch.ones(1, 64))
        else:
            with fused_cpu.switched_off():
                qat(torch.ones(1, 64))


def test_a_flax_qat_kernel_refuses_eagerly_naming_its_module():
    jnp = pytest.importorskip("jax.numpy")
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Sequential(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
    x = jnp.ones((1, 4))
    apply_qat(model, bits=4, grid="qwix", example_inputs=(x,))
    model.layers[0].kernel[...] = model.layers[0].kernel[...].at[0, 0].set(-3.4e38)
    with pytest.raises(ScaleOverflowError, match=r"module 'layers.0', weight 'kernel': on int4/channel/qwix"):
        model(x)


def test_on_a_device_the_refusal_is_an_asynchronous_assert(monkeypatch):
    """Where the host cannot read the scales (an accelerator, torch.compile) the same rule runs as a
    device assert: a RuntimeError with the advice, raised by the op on CPU."""
    monkeypatch.setattr(TorchOps, "readable", lambda self, x: False)
    w = torch.zeros(2, 32)
    w[0, 0] = -3.4e38
    with pytest.raises(RuntimeError, match=r"weight: on int4/channel/qwix a block scale times the grid's largest "
                                           r"level 8 overflows float32"):
        fake_quantize(w, bits=4, grid="qwix")


# A block of two bfloat16 weights whose 75th percentile of |w| is the qwix scale's threshold: code -8
# times that scale is finite in float32 (3.399e38) but rounds to infinity in bfloat16.
BF16_EDGE = torch.tensor([[-3.1769e38, -3.1901e38]]).bfloat16()
BF16_SPEC = QuantSpec(bits=4, grid="qwix", clip_percentile=75.0)


@pytest.mark.parametrize("library", ["torch fused", "torch ops", "numpy", "jax"])
def test_a_bf16_weight_whose_values_round_to_infinity_in_bf16_is_refused(library):
    copy = BF16_EDGE.float().numpy()
    assert np.isfinite(quantize_dequantize_array(copy, BF16_SPEC)).all()  # its float32 copy fits float32
    match = r"on int4/channel/qwix/p75 the block scale .* overflows bfloat16"
    if library == "numpy":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        with pytest.raises(ScaleOverflowError, match=match):
            quantize_dequantize_array(copy.astype(ml_dtypes.bfloat16), BF16_SPEC)
    elif library == "jax":
        jnp = pytest.importorskip("jax.numpy")
        with pytest.raises(ScaleOverflowError, match=match):
            fake_quantize(jnp.asarray(copy).astype(jnp.bfloat16), spec=BF16_SPEC)
    else:
        if library == "torch fused" and not fused_cpu.available():
            pytest.skip("the fused CPU kernels could not be built here (no C++ compiler)")
        with pytest.raises(ScaleOverflowError, match=match):
            if library == "torch fused":
                fake_quantize(BF16_EDGE, spec=BF16_SPEC)
            else:
                with fused_cpu.switched_off():
                    fake_quantize(BF16_EDGE, spec=BF16_SPEC)


@pytest.mark.parametrize("grid", ["qwix", "q8_0"])
@pytest.mark.parametrize("library", ["torch", "numpy"])
def test_a_float16_weight_whose_values_pass_float16s_largest_is_refused(grid, library):
    """float16's largest weight, 65504: qwix's code -8 times 65504 / 7.5 and q8_0's 127 times its float16
    scale (516) both pass 65504 and would round to infinity in float16."""
    w = np.zeros((1, 32), np.float16)
    w[0, 0] = -65504.0
    spec = QuantSpec(bits=8 if grid == "q8_0" else 4, grid=grid)
    with pytest.raises(ScaleOverflowError, match="float16"):
        if library == "torch":
            fake_quantize(torch.from_numpy(w), spec=spec)
        else:
            fake_quantize(w, spec=spec)
    half = fake_quantize(torch.from_numpy(w / np.float16(2)), spec=spec)  # half as large fits
    assert torch.isfinite(half).all()
