"""The stored-array record and its one validation: a toy two-level affine grid round-trips through
pack, validate, save and load bit for bit, and every loader (core, torch, Flax) refuses bad contents
naming the tensor."""

import hashlib
import json
import re

import numpy as np
import pytest

from mixle.core.fileformat import MANIFEST_KEY, canonical_manifest, read_safetensors, write_safetensors
from mixle.core.grids import GRIDS, Grid
from mixle.core.manifest import load_arrays, save_arrays
from mixle.core.spec import QuantSpec
from mixle.core.stored import QuantizedArray, check_stored

# A toy of llama.cpp's Q4_K: super-blocks of 16 values in 4 sub-blocks of 4, codes 0..15,
# 6-bit sub-block scales and mins under a float16 super-block scale and min:
# w = d * sc * q - dmin * m.
TOY = Grid(name="toy_k", codes={4: (0, 15)}, divisor={4: 63.0}, scale_rule="min_max", offset="min",
           scale_dtype="float16", zero_scale=None, block=16, sub_block=4, sub_scale_bits=6, backends=(),
           summary="test-only two-level affine grid")
ROWS, COLS = 4, 32  # 8 super-blocks


@pytest.fixture
def toy_grid(monkeypatch):
    monkeypatch.setitem(GRIDS, TOY.name, TOY)
    return QuantSpec(bits=4, grid=TOY.name)


def _divide(a, b):
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b > 0)


def toy_quantize(w):
    """``(codes, d, dmin, sc, m)`` of w on the toy grid (numpy only; not mixle's numerics)."""
    sub = w.astype(np.float32).reshape(1, -1, 4, 4)  # (1, super-blocks, sub-blocks, values)
    low, high = np.minimum(sub.min(-1), 0), sub.max(-1)
    scales, mins = (high - low) / np.float32(15), -low
    d = (scales.max(-1, keepdims=True) / np.float32(63)).astype(np.float16).astype(np.float32)
    dmin = (mins.max(-1, keepdims=True) / np.float32(63)).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_divide(scales, d)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_divide(mins, dmin)), 0, 63).astype(np.uint8)
    step, base = (d * sc)[..., None], (dmin * m)[..., None]
    codes = np.clip(np.rint(_divide(sub + base, step)), 0, 15).astype(np.int8)
    return codes.reshape(w.shape), d, dmin, sc, m


def toy_reference(codes, d, dmin, sc, m):
    q = codes.reshape(1, -1, 4, 4).astype(np.float32)
    return ((d * sc)[..., None] * q - (dmin * m)[..., None]).reshape(codes.shape)


def toy_record(spec, seed=0):
    w = np.random.default_rng(seed).standard_normal((ROWS, COLS)).astype(np.float32)
    codes, d, dmin, sc, m = toy_quantize(w)
    return QuantizedArray(codes, d, spec, 0, 1, offset=dmin, sub_scales=sc, sub_offsets=m), (codes, d, dmin, sc, m)


def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def test_toy_two_level_grid_round_trips_bit_exactly(toy_grid, tmp_path):
    q, (codes, d, dmin, sc, m) = toy_record(toy_grid)
    assert codes.min() >= 0 and codes.max() == 15 and sc.max() == 63  # the ranges are used
    np.testing.assert_array_equal(bits(q.dequantize()), bits(toy_reference(codes, d, dmin, sc, m)))
    stored = q.stored()
    flat = codes.reshape(-1).astype(np.uint8)
    np.testing.assert_array_equal(stored["codes"], flat[0::2] | (flat[1::2] << 4))  # unsigned nibbles, C order
    assert {k: v.dtype.name for k, v in stored.items()} == {"codes": "uint8", "scale": "float32", "offset": "float32",
                                                            "sub_scales": "uint8", "sub_offsets": "uint8"}
    q.check("toy")
    bias = np.linspace(-1, 1, ROWS, dtype=np.float32)
    manifest = save_arrays(tmp_path / "toy.safetensors", {"toy": q, "bias": bias})
    assert manifest["layers"][0]["spec"]["grid"] == "toy_k" and manifest["layers"][0]["sub_offsets"] == "toy.sub_offsets"
    back = load_arrays(tmp_path / "toy.safetensors")
    loaded = back["toy"]
    np.testing.assert_array_equal(loaded.codes, codes)
    for got, want in ((loaded.scale, d), (loaded.offset, dmin)):
        np.testing.assert_array_equal(bits(got), bits(want))
    for got, want in ((loaded.sub_scales, sc), (loaded.sub_offsets, m)):
        assert got.dtype == np.uint8
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(bits(loaded.dequantize()), bits(toy_reference(codes, d, dmin, sc, m)))
    np.testing.assert_array_equal(back["bias"], bias)


@pytest.mark.parametrize("offset, formula", [
    ("min", lambda q, s, o: q * s + o),
    ("zero_point", lambda q, s, z: s * (q - z)),
])
def test_one_level_offsets_dequantize_as_their_formula(monkeypatch, offset, formula):
    grid = Grid(name=f"toy_{offset}", codes={4: (0, 15)}, divisor={4: 15.0}, scale_rule="min_max", offset=offset,
                backends=())
    monkeypatch.setitem(GRIDS, grid.name, grid)
    spec = QuantSpec(bits=4, grid=grid.name, group_size=4)
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, (2, 8)).astype(np.int8)
    scale = rng.uniform(0.1, 1, (1, 4, 1)).astype(np.float32)
    per_block = rng.uniform(-1, 1, (1, 4, 1)).astype(np.float32) if offset == "min" else \
        rng.integers(0, 16, (1, 4, 1)).astype(np.int8)
    q = QuantizedArray(codes, scale, spec, 0, 1, offset=per_block).check("w")
    want = formula(codes.reshape(1, 4, 4).astype(np.float32), scale, per_block.astype(np.float32)).reshape(2, 8)
    np.testing.assert_array_equal(bits(q.dequantize()), bits(want))


@pytest.mark.parametrize("fields, words", [
    (dict(scale_rule="min_max"), "set offset='min'"),
    (dict(offset="min", block=16, sub_block=5, sub_scale_bits=6, scale_dtype="float16"), "must divide the super-block"),
    (dict(offset="min", block=16, sub_block=4, sub_scale_bits=6), "set scale_dtype='float16'"),
    (dict(offset="zero_point", block=16, sub_block=4, sub_scale_bits=6, scale_dtype="float16"), "not a zero point"),
    (dict(block=16, sub_block=4), "both sub_block and sub_scale_bits"),
    (dict(scale_search="make_qkx2_quants"), "set offset='min'"),
    (dict(packing="bytes"), "one 8-bit code per byte"),
    (dict(offset="sideways"), "offset='sideways' is unknown"),
])
def test_the_grid_record_refuses_what_it_cannot_mean(fields, words):
    with pytest.raises(ValueError, match=words):
        Grid(name="bad", codes={4: (0, 15)}, divisor={4: 15.0}, **fields)


def test_the_grid_record_expresses_the_k_quants():
    q4_k = Grid(name="k4", codes={4: (0, 15)}, divisor={4: 63.0}, offset="min", scale_search="make_qkx2_quants",
                scale_dtype="float16", zero_scale=None, block=256, sub_block=32, sub_scale_bits=6, ggml_type="Q4_K")
    q6_k = Grid(name="k6", codes={6: (-32, 31)}, divisor={6: -128.0}, scale_rule="signed_max",
                scale_search="make_qx_quants", scale_dtype="float16", zero_scale=None, block=256, sub_block=16,
                sub_scale_bits=8, sub_scale_signed=True, ggml_type="Q6_K")
    assert (q4_k.sub_scale_range(), q6_k.sub_scale_range()) == ((0, 63), (-128, 127))
    assert not q4_k.is_plain() and all(GRIDS[name].is_plain() for name in ("symmetric", "qwix"))


# ----------------------------------------------------------------------------------------------
# Refusals: the core loader (load_arrays), torch's and Flax's load_quantized.


def resign(path, edit):
    """Rewrite a mixle file after ``edit(tensors)``, every hash recomputed (a buggy writer's file)."""
    tensors, metadata = read_safetensors(path)
    manifest = json.loads(metadata[MANIFEST_KEY])
    edit(tensors)
    for name, array in tensors.items():
        manifest["tensors"][name].update(dtype={"float32": "F32", "float16": "F16", "uint8": "U8", "int8": "I8"}[
            array.dtype.name], shape=list(array.shape), sha256=hashlib.sha256(array.tobytes()).hexdigest())
    manifest["manifest_sha256"] = hashlib.sha256(canonical_manifest(manifest)).hexdigest()
    write_safetensors(path, tensors, {MANIFEST_KEY: json.dumps(manifest)})


def setter(name, index, value, dtype=None):
    def edit(tensors):
        array = tensors[name].astype(dtype or tensors[name].dtype)
        array[index] = value
        tensors[name] = array
    return edit


@pytest.mark.parametrize("edit, words", [
    (setter("toy.sub_scales", (0, 1, 2), 64), r"tensor 'toy.sub_scales'.*6-bit sub-scales lie in \[0, 63\], got "
                                               r"sub_scales\[0, 1, 2\] = 64"),
    (setter("toy.sub_offsets", (0, 3, 0), 255), r"tensor 'toy.sub_offsets'.*6-bit sub-offsets lie in \[0, 63\]"),
    (setter("toy.scale", (0, 2, 0), np.inf), r"tensor 'toy.scale'.*scales must be finite and non-negative.*"
                                             r"scale\[0, 2, 0\] = inf"),
    (setter("toy.scale", (0, 0, 0), np.nan), r"tensor 'toy.scale'.*scales must be finite"),
    (setter("toy.scale", (0, 5, 0), 70000.0), r"tensor 'toy.scale'.*scales must be finite and non-negative float16 "
                                              r"values.*above float16's largest 65504"),
    (setter("toy.scale", (0, 5, 0), 0.1), r"tensor 'toy.scale'.*float16 values.*scale\[0, 5, 0\] = 0.1"),
    (setter("toy.offset", (0, 1, 0), np.nan), r"tensor 'toy.offset'.*offsets must be finite; .*offset\[0, 1, 0\] = nan"),
    (setter("toy.offset", (0, 1, 0), 0.1), r"tensor 'toy.offset'.*offsets must be finite float16 values"),
    (lambda t: t.update({"toy.offset": t["toy.offset"][..., 0]}),
     r"tensor 'toy.offset'.*offsets of a \[4, 32\] weight are floats of shape \[1, 8, 1\], got float32 of shape \[1, 8\]"),
    (lambda t: t.update({"toy.offset": t["toy.offset"].astype(np.int8)}),
     r"tensor 'toy.offset'.*offsets .* are floats of shape \[1, 8, 1\], got int8"),
    (lambda t: t.update({"toy.sub_scales": t["toy.sub_scales"][:, :, :3].copy()}),
     r"tensor 'toy.sub_scales'.*sub-scales .* are uint8 of shape \[1, 8, 4\], got uint8 of shape \[1, 8, 3\]"),
], ids=["sub-scale", "sub-offset", "inf-scale", "nan-scale", "float16-overflow", "not-float16", "nan-offset",
        "offset-not-float16", "offset-shape", "offset-dtype", "sub-scale-shape"])
def test_the_core_loader_refuses_bad_contents_naming_the_tensor(toy_grid, tmp_path, edit, words):
    path = tmp_path / "toy.safetensors"
    save_arrays(path, {"toy": toy_record(toy_grid)[0]})
    resign(path, edit)
    with pytest.raises(ValueError, match=words):
        load_arrays(path)


def test_the_record_check_refuses_codes_and_parts_off_the_grid(toy_grid):
    q, (codes, d, dmin, sc, m) = toy_record(toy_grid)
    high = codes.copy()
    high[1, 3] = 16
    with pytest.raises(ValueError, match=r"toy: codes span \[0, 16\], outside the int4/group16/toy_k grid \[0, 15\]"):
        QuantizedArray(high, d, toy_grid, 0, 1, offset=dmin, sub_scales=sc, sub_offsets=m).check("toy")
    with pytest.raises(ValueError, match=r"toy: grid 'toy_k' stores offsets too, none was given"):
        QuantizedArray(codes, d, toy_grid, 0, 1, sub_scales=sc, sub_offsets=m).check("toy")
    with pytest.raises(ValueError, match=r"w: grid 'symmetric' stores no sub-scales"):
        check_stored(np.zeros((1, 2), np.int8), np.ones((1, 1, 1), np.float32), QuantSpec(bits=8), (1, 2),
                     sub_scales=np.zeros((1, 1, 1), np.uint8), name="w")


def test_the_core_loader_refuses_a_non_zero_pad_nibble(tmp_path):
    path = tmp_path / "w.safetensors"
    q = QuantizedArray(np.array([[1, -2, 3]], np.int8), np.ones((1, 1, 1), np.float32), QuantSpec(bits=4), 0, 1)
    save_arrays(path, {"w": q})
    resign(path, setter("w.codes", -1, 0x13))
    with pytest.raises(ValueError, match=r"layer 'w', tensor 'w.codes': the pad nibble after the last of 3 int4 codes"):
        load_arrays(path)


torch_edits = [
    (setter("0.codes", -1, 0x17), r"layer '0', tensor '0.codes': the pad nibble after the last of 9 int4 codes"),
    (setter("0.codes", 0, 0x08), r"layer '0', tensor '0.codes': codes span \[-8, .*outside the int4/channel/symmetric"),
    (setter("0.scale", (0, 1, 0), np.inf), r"layer '0', tensor '0.scale'.*scales must be finite and positive"),
    (setter("0.scale", (0, 1, 0), 0.0), r"layer '0', tensor '0.scale'.*scales must be finite and positive.*= 0.0"),
    (lambda t: t.update({"0.scale": t["0.scale"].reshape(1, 3)}),
     r"layer '0', tensor '0.scale'.*scales of a \[3, 3\] weight are floats of shape \[1, 3, 1\]"),
]


@pytest.mark.parametrize("edit, words", torch_edits, ids=["pad", "code", "inf", "zero", "shape"])
def test_torch_load_quantized_refuses_bad_contents(tmp_path, edit, words):
    torch = pytest.importorskip("torch")
    from mixle.torch_backend.transforms.convert import quantize_model
    from mixle.torch_backend.export import load_quantized, save_quantized

    path = tmp_path / "m.safetensors"
    save_quantized(quantize_model(torch.nn.Sequential(torch.nn.Linear(3, 3)), bits=4), path)
    resign(path, edit)
    with pytest.raises(ValueError, match=words):
        load_quantized(path, torch.nn.Sequential(torch.nn.Linear(3, 3)))


def test_torch_refuses_float16_overflowing_scales_on_the_llama_cpp_grids(tmp_path):
    torch = pytest.importorskip("torch")
    from mixle.torch_backend.transforms.convert import quantize_model
    from mixle.torch_backend.export import load_quantized, save_quantized
    from mixle.torch_backend.layers.quantized import QuantizedLinear

    path = tmp_path / "m.safetensors"
    save_quantized(quantize_model(torch.nn.Sequential(torch.nn.Linear(32, 2)), grid="q8_0", bits=8), path)
    resign(path, setter("0.scale", (0, 1, 0), 1e5, np.float32))
    words = r"layer '0', tensor '0.scale'.*float16 values \(the grid stores them in float16\).*65504"
    with pytest.raises(ValueError, match=words):
        load_quantized(path, torch.nn.Sequential(torch.nn.Linear(32, 2)))
    with pytest.raises(ValueError, match=r"QuantizedLinear: .*scales must be finite and non-negative float16 values"):
        QuantizedLinear(torch.zeros(2, 32, dtype=torch.int8), torch.full((1, 2, 1), 1e5), QuantSpec(grid="q8_0", bits=8),
                        (2, 32))


@pytest.fixture(scope="module")
def flax_file(tmp_path_factory):
    pytest.importorskip("jax")
    nnx = pytest.importorskip("flax.nnx")
    import jax.numpy as jnp

    from mixle.api import quantize_model, save_quantized

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(3, 3, rngs=rngs)

        def __call__(self, x):
            return self.fc(x)

    path = tmp_path_factory.mktemp("flax") / "fc.safetensors"
    save_quantized(quantize_model(Net(nnx.Rngs(0)), bits=4, example_inputs=(jnp.ones((1, 3)),)), path)
    return path, Net, nnx


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("edit, words", [(e(), w) for e, w in (
    (lambda: setter("fc.codes", -1, 0x17), r"layer 'fc', tensor 'fc.codes': the pad nibble"),
    (lambda: setter("fc.codes", 0, 0x08), r"layer 'fc', tensor 'fc.codes': codes span \[-8"),
    (lambda: setter("fc.scale", (0, 1, 0), np.nan), r"layer 'fc', tensor 'fc.scale'.*scales must be finite and positive"),
    (lambda: setter("fc.scale", (0, 2, 0), -0.5), r"layer 'fc', tensor 'fc.scale'.*scales must be finite and positive"),
)], ids=["pad", "code", "nan", "negative"])
def test_flax_load_quantized_refuses_bad_contents(flax_file, tmp_path, edit, words):
    from mixle.api import load_quantized

    source, net, nnx = flax_file
    path = tmp_path / "fc.safetensors"
    path.write_bytes(source.read_bytes())
    resign(path, edit)
    with pytest.raises(ValueError, match=words):
        load_quantized(path, net(nnx.Rngs(1)))


def test_the_exporters_refuse_storage_corrupted_in_memory(tmp_path):
    torch = pytest.importorskip("torch")
    from mixle.gguf.blocks import pack_blocks
    from mixle.torch_backend.transforms.convert import quantize_model
    from mixle.torch_backend.export import save_quantized

    model = quantize_model(torch.nn.Sequential(torch.nn.Linear(4, 2)), bits=4)
    model[0].scale.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"layer '0': int4/channel/symmetric scales must be finite and positive"):
        save_quantized(model, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()
    with pytest.raises(ValueError, match=r"q8_0 blocks: codes span \[-128, 0\], outside the int8/group32/q8_0 grid"):
        pack_blocks("q8_0", np.r_[-128, np.zeros(31, np.int8)].reshape(1, 32), np.float32([0.5]))
    with pytest.raises(ValueError, match=r"q4_0 blocks: .*scales must be finite float16 values.*scale\[0, 0, 0\] = 0.1"):
        pack_blocks("q4_0", np.zeros((1, 32), np.int8), np.float32([0.1]))
