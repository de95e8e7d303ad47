"""A format is one record: a new block format defined here, in the test only, goes through
fake-quant (numpy and torch), the STE, convert, save_quantized and load_quantized with no other
change to the package, and its numbers equal a few lines of numpy written independently below.

The format is NVFP4-like: blocks of 16 values, each block's scale ``absmax / 6`` rounded to the
nearest FP8 E4M3 value (stored as its byte), each value the nearest E2M1 value (0, 0.5, 1, 1.5, 2,
3, 4, 6 and their negatives) times the scale.
"""

from typing import NamedTuple

import numpy as np
import pytest
import torch

import mixle
from mixle.core.grids import GRIDS, BlockType, Grid, register_grid
from mixle.core.numerics import quantize_array, quantize_dequantize_array
from mixle.core.scale_codecs import SCALE_CODECS, ScaleCodec, register_scale_codec
from mixle.core.stored import stored_layout

NAME = "nvfp4_like"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _e4m3_value(byte):
    """FP8 E4M3 (the ``fn`` variant: bias 7, no infinities, 0x7F / 0xFF NaN) of one byte."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0:
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


E4M3 = np.array([_e4m3_value(b) if b & 0x7F != 0x7F else np.nan for b in range(256)], np.float32)
POSITIVE = np.arange(0x7F)  # the bytes of 0, the subnormals and the normals up to 448, ascending


class Fields(NamedTuple):
    codes: object  # uint8 (..., n_blocks, 16): indices into E2M1
    s: object  # uint8 (..., n_blocks): the scale's E4M3 byte


def _library_of(x):
    return (lambda a: torch.from_numpy(np.ascontiguousarray(a))) if isinstance(x, torch.Tensor) else (lambda a: a)


def _numpy(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def quantize(x):
    back = _library_of(x)
    xb = _numpy(x).astype(np.float32).reshape(x.shape[:-1] + (x.shape[-1] // 16, 16))
    wanted = np.abs(xb).max(-1) / np.float32(6)
    s = POSITIVE[np.abs(E4M3[POSITIVE] - wanted[..., None]).argmin(-1)].astype(np.uint8)
    scale = E4M3[s][..., None]
    codes = np.abs(np.float32(E2M1) * scale[..., None] - xb[..., None]).argmin(-1).astype(np.uint8)
    return Fields(back(codes), back(s))


def dequantize(fields):
    codes, s = _numpy(fields.codes), _numpy(fields.s)
    values = np.float32(E2M1)[codes] * E4M3[s][..., None]
    return _library_of(fields.codes)(values.reshape(codes.shape[:-2] + (-1,)))


def pack(fields):
    codes, s = _numpy(fields.codes), _numpy(fields.s)
    pairs = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    blocks = np.concatenate([s[..., None], pairs], axis=-1)
    return blocks.reshape(blocks.shape[:-2] + (-1,))


def unpack(data):
    blocks = np.asarray(data, np.uint8).reshape(data.shape[:-1] + (-1, 9))
    pairs = blocks[..., 1:]
    codes = np.stack([pairs & 0xF, pairs >> 4], axis=-1).reshape(pairs.shape[:-1] + (16,))
    return Fields(codes.astype(np.uint8), blocks[..., 0].copy())


def _e4m3_decode(o, field):
    return o.const(E4M3.tolist(), "float32")[o.to_named(field, "int64")]


def _e4m3_encode(values):
    values = np.asarray(values, np.float32)
    return np.searchsorted(E4M3[POSITIVE], values).astype(np.uint8)


def _e4m3_inexact(array):
    return ~np.isin(array.astype(np.float32), E4M3[POSITIVE]) | (array.astype(np.float32) != array)


CODEC = ScaleCodec(name="e4m3_test", decode=_e4m3_decode, encode=_e4m3_encode, inexact=_e4m3_inexact,
                   largest=448.0)
BLOCKS = BlockType(NAME, 16, None, 9, quantize, dequantize, pack, unpack, Fields,
                   (("codes", "codes"), ("scale", "s")))


@pytest.fixture
def nvfp4_like():
    """The format registered for one test, then removed (other tests enumerate GRIDS)."""
    register_scale_codec(CODEC)
    grid = register_grid(Grid(
        name=NAME, codes={4: (0, 15)}, divisor={4: 6.0}, scale_rule="absmax", rounding="table_nearest",
        scale_dtype=CODEC.name, zero_scale=None, block=16, packing="block_type", table=E2M1, block_type=BLOCKS,
        backends=("torch",), summary="NVFP4-like: blocks of 16 E2M1 values under an E4M3 scale"))
    try:
        yield grid
    finally:
        del GRIDS[NAME], SCALE_CODECS[CODEC.name]


def reference(w):
    """The format's round trip, block by block, in plain numpy loops."""
    positive = sorted({float(v) for v in E4M3 if v >= 0})
    out = np.empty_like(w, dtype=np.float32)
    for row in range(w.shape[0]):
        for start in range(0, w.shape[1], 16):
            block = w[row, start:start + 16].astype(np.float32)
            target = float(np.float32(np.abs(block).max()) / np.float32(6))
            scale = np.float32(min(positive, key=lambda v: (abs(v - target), v)))
            for i, v in enumerate(block):
                levels = [np.float32(e) * scale for e in E2M1]
                out[row, start + i] = min(levels, key=lambda lv: abs(lv - v))
    return out


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 4))


def test_the_record_round_trips_numpy_and_torch_as_the_reference(nvfp4_like):
    w = np.random.default_rng(0).standard_normal((3, 48)).astype(np.float32) * 0.7
    want = reference(w)
    np.testing.assert_array_equal(quantize_dequantize_array(w, grid=NAME), want)
    np.testing.assert_array_equal(quantize_dequantize_array(torch.from_numpy(w), grid=NAME).numpy(), want)
    q = quantize_array(w, grid=NAME)
    assert q.spec.bits == 4 and q.spec.group_size == 16 and q.scale.shape == (1, 9, 1)
    assert set(np.unique(q.scale)) <= set(E4M3[POSITIVE].tolist())
    np.testing.assert_array_equal(q.dequantize(), want)
    with pytest.raises(ValueError, match="e4m3_test"):  # a scale that is no E4M3 value is refused
        mixle.QuantizedArray(q.codes, q.scale * np.float32(1.01), q.spec).check("w")


def test_the_record_trains_converts_saves_and_loads_on_torch(nvfp4_like, tmp_path):
    plain, model = _model(), mixle.apply_qat(_model(), grid=NAME)
    x = torch.randn(5, 32)
    deq = [torch.from_numpy(reference(m.weight.detach().numpy())) for m in (plain[0], plain[2])]
    want = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, deq[0], plain[0].bias)), deq[1],
                                      plain[2].bias)
    got = model(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.square().sum().backward()
    ref = [d.clone().requires_grad_(True) for d in deq]  # STE: the fake-quantized weight's gradient
    torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, ref[0], plain[0].bias)), ref[1],
                               plain[2].bias).square().sum().backward()
    torch.testing.assert_close(model[0].weight.grad, ref[0].grad, rtol=0, atol=0)
    assert NAME in str(mixle.get_qat_report(model))

    converted = mixle.convert(model)
    with torch.no_grad():
        torch.testing.assert_close(converted(x), want, rtol=0, atol=0)
    path = tmp_path / "m.safetensors"
    mixle.save_quantized(converted, path)
    back = mixle.load_quantized(path, _model())
    with torch.no_grad():
        torch.testing.assert_close(back(x), want, rtol=0, atol=0)


def test_a_record_holds_float_sub_scales(nvfp4_like):
    """Two scale levels with float sub-scales: a float16 scale per 64 values times an E4M3 scale per 16."""
    grid = register_grid(Grid(
        name="fp8_sub", codes={4: (0, 15)}, divisor={4: 6.0}, rounding="table_nearest", table=E2M1,
        scale_dtype="float16", zero_scale=None, block=64, sub_block=16, sub_scale_dtype=CODEC.name,
        backends=("torch",)))
    try:
        spec = mixle.QuantSpec(grid=grid.name)
        rng = np.random.default_rng(1)
        codes = rng.integers(0, 16, (2, 64)).astype(np.int8)
        scale = np.float16(rng.random((1, 2, 1)) + 0.5).astype(np.float32)
        sub = E4M3[rng.integers(0x30, 0x50, (1, 2, 4))]
        q = mixle.QuantizedArray(codes, scale, spec, 0, 1, sub_scales=sub).check("w")
        want = np.float32(E2M1)[codes].reshape(2, 4, 16) * (scale.reshape(2, 1, 1) * sub.reshape(2, 4, 1))
        np.testing.assert_array_equal(q.dequantize(), want.reshape(2, 64))
        assert stored_layout(spec, (2, 64))["sub_scales"] == ("float", (1, 2, 4))
        back = mixle.QuantizedArray.from_stored(q.stored(), spec, (2, 64))
        np.testing.assert_array_equal(back.dequantize(), q.dequantize())
        bad = sub.copy()
        bad[0, 1, 2] *= np.float32(1.01)
        with pytest.raises(ValueError, match=r"sub-scales must be finite e4m3_test values.*sub_scales\[0, 1, 2\]"):
            mixle.QuantizedArray(codes, scale, spec, 0, 1, sub_scales=bad).check("w")
    finally:
        del GRIDS["fp8_sub"]


def test_the_records_ggml_facts_are_gguf_pys():
    """gguf-py decides: each record's ggml type id, block size and bytes, and its file type."""
    gguf = pytest.importorskip("gguf")
    from mixle.gguf.blocks import GGML_BLOCKS

    written = [g for g in GRIDS.values() if g.ggml_type is not None]
    assert {g.name for g in written} == {"q4_0", "q8_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "mxfp4"}
    for grid in written:
        ggml_type = gguf.GGMLQuantizationType[grid.ggml_type]
        assert int(ggml_type) == grid.ggml_type_id, grid.name
        assert gguf.GGML_QUANT_SIZES[ggml_type] == (grid.block, grid.ggml_block_bytes), grid.name
        assert GGML_BLOCKS[grid.ggml_type].nbytes == grid.ggml_block_bytes
        assert hasattr(gguf.LlamaFileType, grid.file_type), grid.name
    ranks = sorted(g.file_type_rank for g in written)
    assert ranks == list(range(len(written)))  # one precedence each
