"""llama.cpp's Q4_0 / Q8_0 grids: mixle's numerics against gguf-py's reference quantizers, bit for bit."""

import numpy as np
import pytest
import torch

from mixle.core.numerics import quantize_array, quantize_dequantize_array
from mixle.core.spec import QuantSpec

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402


# Converted layers run the exact dequantize-then-matmul path here (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("exact_converted_layers")

GRIDS = {"q4_0": (4, GGMLQuantizationType.Q4_0), "q8_0": (8, GGMLQuantizationType.Q8_0)}


def gguf_round_trip(w, grid):
    """The oracle: gguf-py's quantize then dequantize (ggml's reference numerics)."""
    qtype = GRIDS[grid][1]
    return gguf_quants.dequantize(gguf_quants.quantize(w, qtype), qtype)


def bits_of(x):
    """The float32 bit patterns (so -0.0 and 0.0 differ)."""
    x = x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return x.astype(np.float32).view(np.uint32)


def special_blocks():
    """(rows of 32) zero blocks, signed zeros, rounding ties, argmax ties, one huge value, tiny values."""
    rows = [np.zeros(32), -np.zeros(32), np.where(np.arange(32) % 2, 0.0, -0.0)]
    ramp = np.arange(32, dtype=np.float64) - 16
    rows.append(np.concatenate([[-8.0], ramp[1:] + 0.5]))  # q4_0: d = 1, every other value a tie
    rows.append(np.concatenate([[127.0], (ramp[1:] + 0.5) * 3]))  # q8_0: d = 1, half-integer ties
    rows.append(np.concatenate([[3.0, -3.0], np.linspace(-1, 1, 30)]))  # equal |max|, + first
    rows.append(np.concatenate([[-3.0, 3.0], np.linspace(-1, 1, 30)]))  # equal |max|, - first
    rows.append(np.concatenate([[1e4], np.full(31, 1e-3)]))
    rows.append(np.full(32, 1e-30))  # the scale underflows float16 to (signed) zero
    rows.append(np.concatenate([[0.0] * 31, [-5.0]]))
    rows.append(np.concatenate([[0.0] * 31, [5.0]]))
    rows.append(np.linspace(-0.25, 0.125, 32))
    return np.stack(rows).astype(np.float32)


def weights(seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((24, 96)) * rng.exponential(1.0, (24, 1))
    return np.concatenate([w.astype(np.float32), special_blocks().reshape(-1, 96)], axis=0)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_round_trip_equals_gguf_bit_for_bit(grid, library):
    bits = GRIDS[grid][0]
    for seed in range(3):
        w = weights(seed)
        x = torch.from_numpy(w) if library == "torch" else w
        got = quantize_dequantize_array(x, bits=bits, grid=grid)
        np.testing.assert_array_equal(bits_of(got), bits_of(gguf_round_trip(w, grid)))


@pytest.mark.parametrize("grid", GRIDS)
def test_special_blocks_equal_gguf_bit_for_bit(grid):
    w = special_blocks()
    want = bits_of(gguf_round_trip(w, grid))
    for x in (w, torch.from_numpy(w)):
        np.testing.assert_array_equal(bits_of(quantize_dequantize_array(x, bits=GRIDS[grid][0], grid=grid)), want)
    assert (want == 0).any()
    if grid == "q4_0":  # negative scales make -0.0 weights (Q8_0's scales are never negative)
        assert (want == 0x80000000).any()


@pytest.mark.parametrize("grid", GRIDS)
def test_codes_and_stored_scales_equal_gguf_blocks(grid):
    """The codes and float16 scales themselves, read from gguf-py's packed blocks."""
    bits, qtype = GRIDS[grid]
    w = weights(7)
    q = quantize_array(w, bits=bits, grid=grid)
    blocks = gguf_quants.quantize(w, qtype).reshape(-1, 18 if grid == "q4_0" else 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32).ravel()
    np.testing.assert_array_equal(bits_of(q.scale.ravel()), bits_of(d))
    if grid == "q4_0":
        qs = blocks[:, 2:]
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int16) - 8
    else:
        codes = blocks[:, 2:].view(np.int8)
    np.testing.assert_array_equal(q.codes.reshape(-1, 32), codes)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # numpy's float16 cast, then refused
@pytest.mark.parametrize("grid, huge", [("q4_0", 6e5), ("q8_0", 9e6)])
@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_scale_overflowing_float16_is_refused(grid, huge, library):
    w = np.ones((2, 32), np.float32)
    w[1, 3] = huge
    x = torch.from_numpy(w) if library == "torch" else w
    with pytest.raises(ValueError, match=r"does not fit float16.*rescale them or use another grid"):
        quantize_dequantize_array(x, bits=GRIDS[grid][0], grid=grid)


def test_spec_fixes_blocks_of_32():
    spec = QuantSpec(grid="q4_0")
    assert (spec.bits, spec.granularity, spec.group_size, spec.code_min, spec.code_max) == (4, "group", 32, -8, 7)
    spec = QuantSpec(bits=8, grid="q8_0", granularity="group", group_size=32)
    assert (spec.granularity, spec.group_size, spec.code_min, spec.code_max) == ("group", 32, -127, 127)


@pytest.mark.parametrize("fields, words", [
    (dict(bits=8, grid="q4_0"), r"grid='q4_0' has no bits=8 codes.*use bits=4"),
    (dict(bits=4, grid="q8_0"), r"grid='q8_0' has no bits=4 codes.*use bits=8 \(or leave bits unset\)"),
    (dict(grid="q4_0", group_size=64), r"blocks of 32.*group_size=64: leave both unset"),
    (dict(grid="q4_0", granularity="channel"), r"blocks of 32.*granularity='channel'.*leave both unset"),
    (dict(bits=8, grid="q8_0", granularity="tensor"), r"blocks of 32.*granularity='tensor'"),
    (dict(grid="q4_0", clip_percentile=99.0), r"clip_percentile=99.0.*fixes its scale rule.*drop clip_percentile"),
])
def test_conflicting_spec_is_refused(fields, words):
    with pytest.raises(ValueError, match=words):
        QuantSpec(**fields)


def test_a_grid_with_one_width_implies_it():
    # The rough edge of issue 24: grid="q8_0" alone used to fail with "has no bits=4 codes".
    assert QuantSpec(grid="q8_0").bits == 8 and QuantSpec(grid="q4_0").bits == 4
    assert QuantSpec(grid="q8_0") == QuantSpec(bits=8, grid="q8_0")
    assert QuantSpec().bits == 4 and QuantSpec(grid="qwix").bits == 4  # two widths: 4 unless told
    w = weights(3)
    np.testing.assert_array_equal(bits_of(quantize_dequantize_array(w, grid="q8_0")), bits_of(gguf_round_trip(w, "q8_0")))
    import mixle

    np.testing.assert_array_equal(bits_of(mixle.fake_quantize(torch.from_numpy(w), grid="q8_0")),
                                  bits_of(gguf_round_trip(w, "q8_0")))


def test_group_size_must_divide_the_input():
    with pytest.raises(ValueError, match=r"group_size=32 does not divide the input size 48"):
        quantize_array(np.ones((2, 48), np.float32), grid="q4_0")


# ----------------------------------------------------------------------------------------------
# The torch backend: QAT forward, STE backward, convert, storage, files and byte counts.


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))


def _spec_fields(grid):
    return dict(bits=GRIDS[grid][0], grid=grid)


@pytest.mark.parametrize("grid", GRIDS)
def test_qat_forward_and_backward_equal_gguf_round_trip(grid, fake_quant_path):
    from mixle.api import apply_qat

    model = apply_qat(_mlp(), **_spec_fields(grid))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(6, 64)
    for step in range(2):  # fresh weights after the optimizer step: quantized afresh
        refs = [torch.from_numpy(gguf_round_trip(layer.weight.detach().numpy(), grid)) for layer in (model[0], model[2])]
        for _ in range(3):  # first use, reuse (codes kept) and rebuild from the kept codes
            for layer, ref in zip((model[0], model[2]), refs):
                np.testing.assert_array_equal(bits_of(layer.quantized_weight().detach()), bits_of(ref))
        xi = x.clone().requires_grad_()
        hidden = model[1](torch.nn.functional.linear(xi, refs[0], model[0].bias))
        want = torch.nn.functional.linear(hidden, refs[1], model[2].bias)
        got = model(xi)
        assert torch.equal(got, want)
        grad = torch.randn_like(got)
        got.backward(grad)
        # STE: the input gradient goes through the quantized weight, the weight gradient as for a float layer.
        assert torch.equal(model[2].weight.grad, grad.t().mm(hidden.detach()))
        (input_grad,) = torch.autograd.grad(want, xi, grad)
        torch.testing.assert_close(xi.grad, input_grad, rtol=0, atol=0)
        optimizer.step()
        optimizer.zero_grad()


def test_fused_kernels_refuse_non_plain_grids():
    from mixle.torch_backend.kernels import fused_cpu

    x = torch.randn(4, 64)
    assert not fused_cpu.applies_to(x, QuantSpec(grid="q4_0"))
    assert not fused_cpu.applies_to(x, QuantSpec(bits=8, grid="q8_0"))
    assert fused_cpu.applies_to(x, QuantSpec(bits=4)) == fused_cpu.available()


@pytest.mark.parametrize("grid", GRIDS)
def test_convert_save_load_and_nbytes(grid, tmp_path, fake_quant_path):
    from mixle.api import apply_qat, convert, get_qat_report, load_quantized, model_nbytes, save_quantized

    qat_model = apply_qat(_mlp(), **_spec_fields(grid))
    assert "2 quantized" in str(get_qat_report(qat_model))
    x = torch.randn(5, 64)
    converted = convert(qat_model)
    assert torch.equal(converted(x), qat_model(x))
    for layer in (converted[0], converted[2]):
        w = layer.dequantized_weight()
        assert layer.scale.dtype == torch.float32  # holding float16 values: the forward is the QAT one
        ref = gguf_round_trip(qat_model[0 if layer is converted[0] else 2].weight.detach().numpy(), grid)
        np.testing.assert_array_equal(bits_of(w), bits_of(ref))
    scales = (64 * 32 + 32 * 16) // 32
    nbytes = model_nbytes(converted)
    assert nbytes.scale_bytes == 2 * scales  # float16 scales
    code_bytes = (64 * 32 + 32 * 16) * GRIDS[grid][0] // 8
    assert (nbytes.int4_code_bytes if grid == "q4_0" else nbytes.int8_code_bytes) == code_bytes
    path = tmp_path / "model.safetensors"
    manifest = save_quantized(converted, path)
    assert manifest["tensors"]["0.scale"]["dtype"] == "F16"
    assert manifest["nbytes"]["scale_bytes"] == 2 * scales
    loaded = load_quantized(path, _mlp(1))
    assert loaded[0].scale.dtype == torch.float32 and loaded[0].spec == converted[0].spec
    assert torch.equal(loaded(x), converted(x))


def _storage_args(grid, codes, scale):
    from mixle.core.packing import pack_int4

    codes = torch.tensor(codes, dtype=torch.int8).reshape(1, 32)
    stored = pack_int4(codes) if grid == "q4_0" else codes
    return stored, torch.tensor(scale, dtype=torch.float32).reshape(1, 1, 1), QuantSpec(**_spec_fields(grid)), (1, 32)


def _ggml_block(grid, codes, scale):
    """The same block as llama.cpp stores it (float16 d, then the codes: q4_0 as nibbles q + 8,
    element j low and j + 16 high in byte j), read back by gguf-py's dequantizer (the oracle)."""
    codes = np.asarray(codes)
    if grid == "q4_0":
        nibbles = (codes + 8).astype(np.uint8)
        quants = (nibbles[:16] | (nibbles[16:] << 4)).astype(np.uint8)
    else:
        quants = codes.astype(np.int8).view(np.uint8)
    raw = np.concatenate([np.frombuffer(np.float16(scale).tobytes(), np.uint8), quants]).reshape(1, -1)
    return gguf_quants.dequantize(raw, GRIDS[grid][1])


@pytest.mark.parametrize("grid, codes, scale", [
    ("q4_0", [-8] * 16 + [7] * 16, -0.125),  # the signed scale of a block whose extreme is positive
    ("q4_0", [0] * 32, -0.0),  # an all-zero block keeps its signed zero scale
    ("q8_0", [-127] * 16 + [127] * 16, 0.25),
    ("q8_0", [0] * 32, 0.0),
    ("q4_0", [(5 * j) % 16 - 8 for j in range(32)], 0.375),  # distinct neighbours: the element order shows
    ("q8_0", [(37 * j) % 255 - 127 for j in range(32)], 0.5),
])
def test_storage_accepts_what_the_grids_write(grid, codes, scale, tmp_path):
    from mixle.api import load_quantized, save_quantized
    from mixle.torch_backend.layers.quantized import QuantizedLinear, check_quantized_storage

    args = _storage_args(grid, codes, scale)
    check_quantized_storage(*args)  # accepted, and it means what llama.cpp means by it:
    want = bits_of(_ggml_block(grid, codes, scale))  # signed zeros and signed scales included
    layer = QuantizedLinear(*args)
    np.testing.assert_array_equal(bits_of(layer.dequantized_weight()), want)
    save_quantized(torch.nn.Sequential(layer), tmp_path / "block.safetensors")  # the scale as float16
    loaded = load_quantized(tmp_path / "block.safetensors", torch.nn.Sequential(torch.nn.Linear(32, 1, bias=False)))[0]
    np.testing.assert_array_equal(bits_of(loaded.scale), bits_of(np.float32(scale)).reshape(1, 1, 1))
    np.testing.assert_array_equal(bits_of(loaded.dequantized_weight()), want)


@pytest.mark.parametrize("grid, codes, scale, words", [
    ("q8_0", [-128] + [0] * 31, 0.25, r"codes span \[-128, 0\], outside the int8/group32/q8_0 grid \[-127, 127\]"),
    ("q8_0", [1] * 32, -0.25, r"scales must be finite and non-negative"),
    ("q4_0", [1] * 32, 0.1, r"scales must be finite float16 values"),
    ("q4_0", [1] * 32, float("inf"), r"scales must be finite"),
])
def test_storage_refuses_what_the_grids_cannot_write(grid, codes, scale, words):
    from mixle.torch_backend.layers.quantized import check_quantized_storage

    with pytest.raises(ValueError, match=words):
        check_quantized_storage(*_storage_args(grid, codes, scale), name="fc")


def test_flax_trains_llama_cpps_grids_but_refuses_mxfp4_and_nf4():
    from mixle.core.spec import WEIGHT_FIELDS

    QuantSpec(grid="q4_0").check_backend("flax", WEIGHT_FIELDS, "fake-quantizes weights")
    with pytest.raises(ValueError, match=r"grid='mxfp4'.*not supported by the flax backend"):
        QuantSpec(grid="mxfp4").check_backend("flax", WEIGHT_FIELDS, "fake-quantizes weights")


# ----------------------------------------------------------------------------------------------
# act_bits=8 on llama.cpp's grids: the activations of a Q4_0/Q8_0 product as ggml's CPU path
# quantizes them, Q8_0 blocks of 32 along each token's inputs.


def _gguf_activations(x):
    """The oracle: each token's inputs through gguf-py's Q8_0 quantize and dequantize."""
    x = np.asarray(x, np.float32)
    return gguf_round_trip(x.reshape(-1, x.shape[-1]), "q8_0").reshape(x.shape)


@pytest.mark.parametrize("grid", GRIDS)
def test_activation_blocks_equal_gguf_q8_0_bit_for_bit(grid):
    from mixle.torch_backend.layers.activations import quantize_dequantize_activations

    rng = np.random.default_rng(7)
    special = np.stack([np.asarray(r, np.float32) for r in special_blocks()]).reshape(-1, 64)
    tokens = np.concatenate([special, (rng.standard_normal((5 * 7, 64)) * rng.choice([1e-3, 1, 30], (35, 1)))])
    x = tokens.astype(np.float32)[: 5 * (len(tokens) // 5)].reshape(5, -1, 64)
    spec = QuantSpec(**_spec_fields(grid), act_bits=8)
    got = quantize_dequantize_activations(torch.from_numpy(x), spec)
    np.testing.assert_array_equal(bits_of(got), bits_of(_gguf_activations(x)))
    assert spec.grid_record.activation_grid == "q8_0"  # data on the grid, not a branch on its name


@pytest.mark.parametrize("grid", GRIDS)
def test_act8_qat_forward_backward_convert_and_toggle(grid, tmp_path):
    from mixle.api import apply_qat, convert, load_quantized, save_quantized, set_fake_quant_enabled

    model = apply_qat(_mlp(), **_spec_fields(grid), act_bits=8)
    x = (torch.randn(3, 4, 64) * 2).requires_grad_()
    w0, w1 = (torch.from_numpy(gguf_round_trip(layer.weight.detach().numpy(), grid)) for layer in (model[0], model[2]))
    a0 = torch.from_numpy(_gguf_activations(x.detach().numpy())).requires_grad_()
    hidden = model[1](torch.nn.functional.linear(a0, w0, model[0].bias))
    a1 = torch.from_numpy(_gguf_activations(hidden.detach().numpy()))
    a1 = a1 + (hidden - hidden.detach())  # STE: the gradient passes the activation rounding unchanged
    want = torch.nn.functional.linear(a1, w1, model[2].bias)
    got = model(x)
    assert torch.equal(got, want)
    grad = torch.randn_like(got)
    got.backward(grad)
    (input_grad,) = torch.autograd.grad(want, a0, grad)
    assert torch.equal(x.grad, input_grad)
    with torch.no_grad():
        fake = model(x)
        converted = convert(model)
        assert torch.equal(converted(x), fake)  # convert == fake-quant, bit for bit
        save_quantized(converted, tmp_path / "m.safetensors")
        loaded = load_quantized(tmp_path / "m.safetensors", _mlp(1))
        assert loaded[0].spec.act_bits == 8 and torch.equal(loaded(x), fake)
        set_fake_quant_enabled(model, False)
        assert torch.equal(model(x), _mlp()(x))  # the toggle is exact: plain float maths


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_scale_overflow_names_the_layer_in_the_qat_forward_and_convert():
    from mixle.api import apply_qat, convert

    model = apply_qat(_mlp(), grid="q4_0")
    with torch.no_grad():
        model[2].weight[3, 5] = 1e6
    words = r"layer '2': (weight: )?a block scale does not fit float16 \(largest 125000\)"
    with pytest.raises(ValueError, match=words):
        model(torch.randn(2, 64))
    with pytest.raises(ValueError, match=words):
        convert(model)
    # Activations: a Q8_0 block scale above float16's range (|x| > 127 * 65504), in training and converted.
    model = apply_qat(_mlp(), bits=8, grid="q8_0", act_bits=8)
    x = torch.ones(2, 64)
    x[1, 40] = 1e7
    words = r"layer '0': the activations reach 1e\+07: their q8_0 block scale .* does not fit float16"
    with pytest.raises(ValueError, match=words):
        model(x)
    with torch.no_grad(), pytest.raises(ValueError, match=words):
        convert(model)(x)


@pytest.mark.parametrize("fields, words", [
    (dict(bits=4, grid="q4_0", act_bits=4), r"act_bits=4 with grid='q4_0': its activations are quantized on "
                                            r"grid 'q8_0'.*use act_bits=8"),
    (dict(bits=8, grid="q8_0", act_bits=8, act_symmetric=False), r"act_symmetric=False with grid='q8_0'.*symmetric"),
])
def test_activation_forms_the_grids_do_not_have_are_refused(fields, words):
    from mixle.api import apply_qat

    net = _mlp()
    with pytest.raises(ValueError, match=words):
        apply_qat(net, **fields)
    assert type(net[0]) is torch.nn.Linear  # the model is unchanged
