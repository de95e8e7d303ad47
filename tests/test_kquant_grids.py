"""The grids of llama.cpp's other block types (q4_1 ... q6_k, mxfp4) and nf4: records, the stored
array, quantize_array bit for bit against libggml (the committed fixture) and gguf-py, validation,
and the two rough edges of issue 24 (a grid's only width is implied; no finite weight dequantizes
to infinity on any grid)."""

import pathlib

import numpy as np
import pytest
import torch

from mixle.core.checks import ScaleOverflowError
from mixle.core.grids import BLOCK_TYPES
from mixle.core.grids import GRIDS, Grid
from mixle.core.manifest import load_arrays, save_arrays
from mixle.core.numerics import quantize_array, quantize_dequantize_array
from mixle.core.spec import QuantSpec
from mixle.core.stored import QuantizedArray, block_quantized_array, check_stored
from mixle.gguf.blocks import pack_array

ROOT = pathlib.Path(__file__).resolve().parent.parent
NEW_GRIDS = ["q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "mxfp4", "nf4"]
GGML_GRIDS = [name for name in NEW_GRIDS if GRIDS[name].ggml_type]
BITS = {"q4_1": 4, "q5_0": 5, "q5_1": 5, "q4_k": 4, "q5_k": 5, "q6_k": 6, "mxfp4": 4, "nf4": 4}
FLOAT32_MAX = float(np.finfo(np.float32).max)


def bits(x):
    x = x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return x.astype(np.float32).view(np.uint32)


def weights(seed=0, rows=6, cols=512):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * rng.exponential(1.0, (rows, 1))
    w[0, :64] = 0.0  # a zero block (and a zero sub-block)
    w[1, 32:64] = -0.75  # a constant block
    return w.astype(np.float32)


@pytest.fixture(scope="module")
def reference():
    data = np.load(ROOT / "tests/fixtures/ggml_reference.npz")
    return {key: data[key] for key in data.files}


# ----------------------------------------------------------------------------------- records


@pytest.mark.parametrize("name", NEW_GRIDS)
def test_each_block_type_is_a_grid_record(name):
    grid, block_type = GRIDS[name], BLOCK_TYPES[name]
    assert (grid.numerics, grid.block, grid.ggml_type) == (name, block_type.block, block_type.ggml_type)
    spec = QuantSpec(grid=name)  # the grid's only width is implied
    assert (spec.bits, spec.granularity, spec.group_size) == (BITS[name], "group", grid.block)
    assert not grid.is_plain()
    spec.check_backend("torch", ("bits", "grid", "granularity", "group_size"), "fake-quantizes weights")
    if name in ("mxfp4", "nf4"):  # Flax refuses them: no exact jax log2 (MXFP4's exponent); NF4 not yet
        assert grid.backends == ("torch",)
        with pytest.raises(ValueError, match=rf"grid='{name}'.*not supported by the flax backend yet"):
            spec.check_backend("flax", ("bits", "grid", "granularity", "group_size"), "fake-quantizes")
    else:
        spec.check_backend("flax", ("bits", "grid", "granularity", "group_size"), "fake-quantizes")


@pytest.mark.parametrize("fields, words", [
    (dict(bits=4, grid="q6_k"), r"grid='q6_k' has no bits=4 codes.*use bits=6"),
    (dict(grid="nf4", act_bits=8), r"act_bits=8 with grid='nf4'.*no llama.cpp product.*leave act_bits=None"),
    (dict(grid="nf4", clip_percentile=99.0), r"grid='nf4' fixes its scale rule.*drop clip_percentile"),
    (dict(grid="q4_k", group_size=32), r"blocks of 256.*leave both unset"),
    (dict(grid="q5_0", scale="learned"), r"scale='learned' with grid='q5_0'"),
])
def test_specs_the_block_grids_cannot_honour_are_refused(fields, words):
    with pytest.raises(ValueError, match=words):
        QuantSpec(**fields)


def test_activation_grid_is_the_one_llama_cpp_uses():
    # ggml-cpu's vec_dot_type: Q8_0 for Q5_0 and MXFP4 (as for Q4_0 / Q8_0), Q8_1 (Q8_0's values) for
    # Q4_1 / Q5_1, Q8_K for the K-quants.
    for grid, activations in (("q5_0", "q8_0"), ("mxfp4", "q8_0"), ("q4_1", "q8_0"), ("q5_1", "q8_0"),
                              ("q4_k", "q8_k"), ("q5_k", "q8_k"), ("q6_k", "q8_k")):
        assert QuantSpec(grid=grid, act_bits=8).grid_record.activation_record().name == activations


@pytest.mark.parametrize("fields, words", [
    (dict(numerics="q4_k", block=32, ggml_type="Q4_K"), r"makes Q4_K blocks of 256: set block=256"),
    (dict(numerics="q9_z", block=32), r"numerics='q9_z' is unknown"),
    (dict(table=(0.0, 1.0)), r"a table of 2 values is indexed by 4-bit codes"),
    (dict(packing="block_type"), r"set numerics"),
])
def test_the_grid_record_refuses_inconsistent_numerics(fields, words):
    with pytest.raises(ValueError, match=words):
        Grid(name="bad", codes={4: (0, 15)}, divisor={4: 15.0}, scale_dtype="float16", **fields)


# ------------------------------------------------------------- quantize_array against ggml


@pytest.mark.parametrize("name", GGML_GRIDS)
def test_quantize_array_equals_libggml_bit_for_bit(name, reference):
    """Every fixture row (ggml's own bytes and values): quantize_array's record dequantizes to
    ggml's values and packs to ggml's bytes; the rows it refuses are those whose float16 scales
    overflow in ggml too (ggml writes an infinite scale there)."""
    ggml_type = GRIDS[name].ggml_type
    inputs, want_bytes, want_values = reference["inputs"], reference[f"{ggml_type}_bytes"], \
        reference[f"{ggml_type}_values"]
    refused = []
    for i, row in enumerate(inputs):
        try:
            q = quantize_array(row[None], grid=name)
        except ScaleOverflowError:
            refused.append(str(reference["row_names"][i]))
            with np.errstate(all="ignore"):
                scales = BLOCK_TYPES[name].unpack(want_bytes[i])
            assert not all(np.isfinite(np.asarray(getattr(scales, f), np.float32)).all()
                           for f in scales._fields if f in ("d", "m", "dmin")), reference["row_names"][i]
            continue
        np.testing.assert_array_equal(bits(q.dequantize())[0], bits(want_values[i]), err_msg=str(reference["row_names"][i]))
        np.testing.assert_array_equal(pack_array(q)[0], want_bytes[i])
    assert set(refused) <= {"huge_1e30", "block_scales"}  # 1e30 and 1e6-scaled blocks overflow float16


@pytest.mark.parametrize("name", NEW_GRIDS)
def test_torch_and_numpy_records_are_the_same_bits(name):
    w = weights(1)
    q_np, q_t = quantize_array(w, grid=name), quantize_array(torch.from_numpy(w), grid=name)
    assert isinstance(q_t.codes, torch.Tensor) and q_t.codes.dtype == torch.int8
    for part in ("codes", "scale", "offset", "sub_scales", "sub_offsets"):
        a, b = getattr(q_np, part), getattr(q_t, part)
        assert (a is None) == (b is None), part
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), b.numpy(), err_msg=part)
    np.testing.assert_array_equal(bits(q_np.dequantize()), bits(q_t.dequantize()))
    bt = BLOCK_TYPES[name]
    np.testing.assert_array_equal(bits(q_np.dequantize()), bits(bt.dequantize(bt.quantize(w))))


@pytest.mark.parametrize("name", GGML_GRIDS)
def test_record_dequantizes_as_gguf_py_reads_its_blocks(name):
    gguf = pytest.importorskip("gguf")
    w = weights(2)
    q = quantize_array(w, grid=name)
    data = pack_array(q)
    theirs = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[GRIDS[name].ggml_type])
    np.testing.assert_array_equal(bits(q.dequantize()), bits(theirs))


def test_record_fields_are_the_block_types():
    """The record holds the block type's fields as the stored-array parts the module docs name."""
    w = weights(3)
    q = quantize_array(w, grid="q4_k")
    f = BLOCK_TYPES["q4_k"].quantize(w)
    assert q.scale.shape == q.offset.shape == (1, 12, 1) and q.sub_scales.shape == q.sub_offsets.shape == (1, 12, 8)
    np.testing.assert_array_equal(q.scale.ravel(), f.d.astype(np.float32).ravel())
    np.testing.assert_array_equal(q.offset.ravel(), f.dmin.astype(np.float32).ravel())
    np.testing.assert_array_equal(q.sub_offsets.reshape(-1, 8), f.mins.reshape(-1, 8))
    q6 = quantize_array(w, grid="q6_k")
    assert q6.sub_scales.dtype == np.int8 and q6.codes.min() >= -32 and q6.offset is None
    np.testing.assert_array_equal(q6.codes.reshape(-1, 256), BLOCK_TYPES["q6_k"].quantize(w).codes.reshape(-1, 256).astype(int) - 32)
    mx = quantize_array(w, grid="mxfp4")
    assert set(np.unique(np.log2(mx.scale))) <= set(range(-128, 128))  # powers of two (E8M0, halved)
    for name in NEW_GRIDS:
        q = quantize_array(w, grid=name)
        fields = q.block_fields()
        again = BLOCK_TYPES[name].quantize(w)
        for field in again._fields:
            np.testing.assert_array_equal(np.asarray(getattr(fields, field)).reshape(-1),
                                          np.asarray(getattr(again, field)).reshape(-1), err_msg=f"{name}.{field}")


@pytest.mark.parametrize("name", NEW_GRIDS)
def test_batch_and_output_axes_keep_blocks_along_rows(name):
    w = weights(4, rows=4, cols=512).reshape(2, 2, 512)
    q = quantize_array(w, grid=name, batch_ndim=1)
    assert q.scale.shape[0] == 2
    np.testing.assert_array_equal(bits(q.dequantize()), bits(quantize_array(w.reshape(4, 512), grid=name).dequantize()
                                                              .reshape(2, 2, 512)))


def test_rows_the_block_does_not_divide_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"does not divide the input size 96.*grid='q4_k' stores blocks of 256 along "
                                         r"each row.*\['mxfp4', 'q4_0', 'q4_1', 'q5_0', 'q5_1', 'q8_0'\].*tensor_types"):
        quantize_array(np.ones((2, 96), np.float32), grid="q4_k")


def test_quantize_dequantize_array_equals_ggml_on_the_k_quants(reference):
    x = reference["inputs"][:4]
    got = quantize_dequantize_array(x, grid="q4_k")
    np.testing.assert_array_equal(bits(got), bits(reference["Q4_K_values"][:4]))


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("name", NEW_GRIDS)
def test_records_validate_and_round_trip_through_mixle_files(name, tmp_path):
    q = quantize_array(weights(5), grid=name).check(name)
    save_arrays(tmp_path / "a.safetensors", {"w": q})
    back = load_arrays(tmp_path / "a.safetensors")["w"]
    for part in ("codes", "scale", "offset", "sub_scales", "sub_offsets"):
        a, b = getattr(q, part), getattr(back, part)
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=part)
    np.testing.assert_array_equal(bits(back.dequantize()), bits(q.dequantize()))


def _edited(q, **parts):
    values = {p: getattr(q, p) for p in ("offset", "sub_scales", "sub_offsets")}
    values.update({k: v for k, v in parts.items() if k not in ("codes", "scale")})
    return QuantizedArray(parts.get("codes", q.codes), parts.get("scale", q.scale), q.spec, q.batch_ndim, q.out_ndim,
                          **values)


@pytest.mark.parametrize("name, edit, words", [
    ("q4_k", lambda q: dict(sub_scales=q.sub_scales + np.uint8(64)), r"6-bit sub-scales lie in \[0, 63\]"),
    ("q4_k", lambda q: dict(scale=q.scale + np.float32(1e-5)), r"scales must be finite and non-negative float16"),
    ("q4_1", lambda q: dict(offset=q.offset * np.float32(np.nan)), r"offsets must be finite"),
    ("q6_k", lambda q: dict(codes=q.codes * np.int8(2)), r"outside the int6/group256/q6_k grid \[-32, 31\]"),
    ("mxfp4", lambda q: dict(scale=q.scale * np.float32(3)), r"e8m0 values"),
    ("q4_k", lambda q: dict(sub_offsets=None), r"stores sub-offsets too, none was given"),
])
def test_check_stored_refuses_corrupt_records(name, edit, words):
    q = quantize_array(weights(6), grid=name)
    with pytest.raises(ValueError, match=words):
        _edited(q, **edit(q)).check("w")


def test_huge_weights_are_refused_where_float16_overflows():
    w = weights(7)
    w[2, 3] = 1e9
    for name in ("q4_1", "q5_0", "q4_k", "q6_k"):
        with pytest.raises(ScaleOverflowError, match=rf"x: a block .* does not fit float16.*grid='{name}'"):
            quantize_array(w, grid=name)
    with pytest.raises(ScaleOverflowError, match="w: a block scale"):
        block_quantized_array(w, QuantSpec(grid="q4_k"), name="w")


# ------------------------------------------------------- no finite weight dequantizes to inf


@pytest.mark.parametrize("name", sorted(GRIDS))
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_no_finite_weight_dequantizes_to_infinity_on_any_grid(name, sign):
    """Near float32's maximum every grid either refuses (naming the array) or stays finite."""
    spec = QuantSpec(grid=name, bits=max(GRIDS[name].codes))
    w = weights(8, rows=2, cols=256)
    w[0, 7] = sign * FLOAT32_MAX * 0.999
    w[1, 9] = sign * FLOAT32_MAX
    try:
        with np.errstate(over="ignore"):  # q4_0 / q8_0 cast the scale to float16 before refusing it
            q = quantize_array(w, spec)
    except ScaleOverflowError as err:
        # q4_0 / q8_0 refuse in numerics.stored_scale (its message does not name the array yet).
        assert str(err).startswith("x: ") or (name in ("q4_0", "q8_0") and "does not fit float16" in str(err))
        return
    with np.errstate(over="raise"):
        assert np.isfinite(q.dequantize()).all()
    q.check(name)


@pytest.mark.parametrize("bits_", [4, 8])
def test_qwix_refuses_a_weight_whose_most_negative_code_overflows(bits_):
    w = np.array([[-FLOAT32_MAX * 0.999, 1.0]], np.float32)  # code -(qmax + 1) = -1.003 x 0.999 x max
    with pytest.raises(ScaleOverflowError, match=r"x: on int\d/channel/qwix the block scale .* overflows float32.*"
                                                 r"dequantize to infinity: rescale the weights"):
        quantize_array(w, bits=bits_, grid="qwix")
    q = quantize_array(w * np.float32(0.5), bits=bits_, grid="qwix")  # half as large fits
    assert np.isfinite(q.dequantize()).all()


def test_check_stored_refuses_a_scale_whose_largest_code_overflows():
    spec = QuantSpec(grid="qwix")
    scale = np.full((1, 1, 1), FLOAT32_MAX / 7.5, np.float32)
    with pytest.raises(ValueError, match=r"layer: int4/channel/qwix scales must be finite and positive and small "
                                         r"enough that the largest level \(8\) times them is finite"):
        check_stored(np.array([[-8, 7]], np.int8), scale, spec, (1, 2), packed=False, name="layer")


def test_the_fake_quant_forward_refuses_the_overflow_too():
    with pytest.raises(ScaleOverflowError):
        quantize_dequantize_array(np.array([[-FLOAT32_MAX * 0.99, 1.0]], np.float32), grid="qwix")
