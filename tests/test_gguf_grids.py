"""llama.cpp's Q4_0 / Q8_0 grids: mixle's numerics against gguf-py's reference quantizers, bit for bit."""

import numpy as np
import pytest
import torch

from mixle.core.numerics import quantize_array, quantize_dequantize_array
from mixle.core.spec import QuantSpec

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

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
    (dict(grid="q8_0"), r"grid='q8_0' has no bits=4 codes.*use bits=8"),
    (dict(grid="q4_0", group_size=64), r"blocks of 32.*group_size=64: leave both unset"),
    (dict(grid="q4_0", granularity="channel"), r"blocks of 32.*granularity='channel'.*leave both unset"),
    (dict(bits=8, grid="q8_0", granularity="tensor"), r"blocks of 32.*granularity='tensor'"),
    (dict(grid="q4_0", clip_percentile=99.0), r"clip_percentile=99.0.*fixes its scale rule.*drop clip_percentile"),
])
def test_conflicting_spec_is_refused(fields, words):
    with pytest.raises(ValueError, match=words):
        QuantSpec(**fields)


def test_group_size_must_divide_the_input():
    with pytest.raises(ValueError, match=r"group_size=32 does not divide the input size 48"):
        quantize_array(np.ones((2, 48), np.float32), grid="q4_0")
