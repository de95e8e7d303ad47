"""mixle's ggml block quantizers (``mixle.gguf.ggml_quants``, ``mixle.core.nf4``) against ggml, bit for bit.

Oracles: gguf-py's numpy quantizers (Q4_1, Q5_0, Q5_1, MXFP4: bytes and values) and its
dequantizers (the K-quants' block layout); ggml's own C code through ctypes when llama-cpp-python
is installed (``ggml_quantize_chunk`` and the type's ``to_float``); and, without it, the bytes and
values ggml gave once for fixed rows (``tests/fixtures/ggml_reference.npz``, written by
``benchmarks/make_ggml_fixtures.py``, which reuses this module's rows and ctypes helpers).
"""

import ctypes
import ctypes.util
import importlib.util
import json
import pathlib

import numpy as np
import pytest

from mixle.core.grids import BLOCK_TYPES
from mixle.core.nf4 import NF4_TABLE, NF4_THRESHOLDS

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = "tests/fixtures/ggml_reference.npz"
ROW = 512  # two K-quant super-blocks, sixteen blocks of 32, eight NF4 blocks
# ggml.h's enum ggml_type numbers of the types mixle emulates.
GGML_TYPE_IDS = {"Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "MXFP4": 39}
GGML_NAMES = sorted(name for name, bt in BLOCK_TYPES.items() if bt.ggml_type)
GGUF_PY_QUANTIZES = ["mxfp4", "q4_1", "q5_0", "q5_1"]  # gguf-py only dequantizes the K-quants
# gguf-py takes a block's min with np.min and its signed max with argmax(|x|): in a block of zeros
# of both signs it may pick another zero than C's first-strictly-smaller loop (ggml's), so its d
# or m can carry the other sign bit there. mixle follows ggml (the fixture and live tests).
GGUF_PY_SIGNED_ZEROS = ["signed_zero_blocks"]


def fixture_rows():
    """``(names, rows)``: seeded float32 rows (R, 512) of the usual and the edge cases."""
    rng = np.random.default_rng(20240624)
    normal = rng.standard_normal
    rows = {
        "normal": normal(ROW),
        "normal_small": normal(ROW) * 0.02,
        "uniform": rng.uniform(-1, 1, ROW),
        "laplace": rng.laplace(size=ROW),
        "zeros": np.zeros(ROW),
        "constant": np.full(ROW, 0.37),
        "negative_constant": np.full(ROW, -1.5),
        "tiny_1e-30": normal(ROW) * 1e-30,
        "huge_1e30": normal(ROW) * 1e30,
        "float16_subnormal_scales": normal(ROW) * 1e-6,
        "float32_subnormal": normal(ROW) * 1e-40,
        "positive": np.abs(normal(ROW)) + 0.5,
        "negative": -np.abs(normal(ROW)),
        "outliers": normal(ROW) * np.where(np.arange(ROW) % 37 == 0, 100.0, 1.0),
        "one_outlier": np.where(np.arange(ROW) == 100, 500.0, normal(ROW)),
        "heavy_tail": rng.standard_t(2, ROW) * 3,
        "grid_ties": np.round(normal(ROW) * 4) / 4,
        "half_ties": (rng.integers(-16, 16, ROW) + 0.5) / 8,
        "block_scales": normal(ROW) * np.repeat(10.0 ** rng.integers(-6, 7, ROW // 32), 32),
        "zero_blocks": np.where(np.repeat(np.arange(ROW // 32) % 3 == 1, 32), 0.0, normal(ROW)),
        "signed_zero_blocks": normal(ROW) * np.repeat(np.arange(ROW // 32) % 3 != 1, 32),  # -0.0 and 0.0
        "powers_of_two": rng.choice([-1.0, 1.0], ROW) * 2.0 ** rng.integers(-10, 10, ROW),
    }
    negative_max = normal(ROW).reshape(-1, 32)  # each block's largest magnitude is negative
    at = np.abs(negative_max).argmax(axis=1)
    negative_max[np.arange(len(at)), at] = -3.0 * np.abs(negative_max).max(axis=1)
    rows["negative_max"] = negative_max.reshape(ROW)
    for seed in range(4):
        rows[f"normal_scaled_{seed}"] = normal(ROW) * 10.0 ** rng.uniform(-3, 3)
    return list(rows), np.stack(list(rows.values())).astype(np.float32)


# ----------------------------------------------------------------- ggml's C code through ctypes


class _TypeTraits(ctypes.Structure):
    """ggml.h's ``struct ggml_type_traits``."""

    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)),
        ("from_float_ref", ctypes.c_void_p),
    ]


def ggml_library():
    """The ggml shared library bundled with llama-cpp-python (ctypes), or None without it."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    libdir = pathlib.Path(spec.origin).parent / "lib"
    for name in ("libggml-base.so", "libggml.so", "libggml-base.dylib", "libggml.dylib"):
        if (libdir / name).exists():
            lib = ctypes.CDLL(str(libdir / name))
            if hasattr(lib, "ggml_quantize_chunk"):
                break
    else:
        return None
    i64 = ctypes.c_int64
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, i64, i64, i64, ctypes.c_void_p]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, i64]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    for name in ("ggml_version", "ggml_commit"):
        getattr(lib, name).restype = ctypes.c_char_p
    return lib


def ggml_quantize(lib, ggml_type, x):
    """ggml's bytes (R, row bytes) of float32 rows x (R, n): ``ggml_quantize_chunk``, no imatrix."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    type_id = GGML_TYPE_IDS[ggml_type]
    row_size = lib.ggml_row_size(type_id, x.shape[1])
    out = np.zeros((x.shape[0], row_size), np.uint8)
    written = lib.ggml_quantize_chunk(type_id, x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None)
    assert written == out.size
    return out


def ggml_dequantize(lib, ggml_type, data, n):
    """ggml's float32 values (R, n) of block bytes (R, row bytes): the type's ``to_float``."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    out = np.zeros((data.shape[0], n), np.float32)
    to_float = lib.ggml_get_type_traits(GGML_TYPE_IDS[ggml_type]).contents.to_float
    to_float(data.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size)
    return out


# ------------------------------------------------------------------------------------ helpers


def bits(a):
    """Bit patterns, so that -0.0 != 0.0 and NaNs compare by payload."""
    a = a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same_bits(mine, theirs, names, what):
    mine, theirs = bits(mine), bits(theirs)
    assert mine.shape == theirs.shape, what
    bad = [names[i] for i in range(len(names)) if not np.array_equal(mine[i], theirs[i])]
    assert not bad, f"{what}: rows differ: {bad}"


def round_trip(name, x):
    """``(bytes, values)`` of mixle's quantizer for block type ``name``."""
    bt = BLOCK_TYPES[name]
    fields = bt.quantize(x)
    with np.errstate(all="ignore"):
        return bt.pack(fields), bt.dequantize(fields)


@pytest.fixture(scope="module")
def rows():
    return fixture_rows()


# ---------------------------------------------------------------------------------- gguf-py


@pytest.mark.parametrize("name", GGUF_PY_QUANTIZES)
def test_bytes_and_values_equal_gguf_py(name, rows):
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    names, x = rows
    qtype = GGMLQuantizationType[BLOCK_TYPES[name].ggml_type]
    with np.errstate(all="ignore"):
        ref = gguf_quants.quantize(x, qtype)
        ref_values = gguf_quants.dequantize(ref, qtype)
    data, values = round_trip(name, x)
    keep = [i for i, row in enumerate(names) if row not in GGUF_PY_SIGNED_ZEROS]
    kept = [names[i] for i in keep]
    assert_same_bits(data[keep], ref[keep], kept, f"{name} bytes vs gguf-py")
    assert_same_bits(values[keep], ref_values[keep], kept, f"{name} values vs gguf-py")
    # Blocks of signed zeros: at most the sign bit of a float16 d or m differs, and values are zeros.
    signed = [names.index(row) for row in GGUF_PY_SIGNED_ZEROS]
    assert np.all((data[signed] ^ ref[signed]) & 0x7F == 0)
    assert np.array_equal(values[signed], ref_values[signed])


@pytest.mark.parametrize("name", GGML_NAMES)
def test_layout_reads_back_with_gguf_py(name, rows):
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    names, x = rows
    bt = BLOCK_TYPES[name]
    qtype = GGMLQuantizationType[bt.ggml_type]
    assert GGML_QUANT_SIZES[qtype] == (bt.block, bt.bytes_per_block)
    assert int(qtype) == GGML_TYPE_IDS[bt.ggml_type]
    data, values = round_trip(name, x)
    with np.errstate(all="ignore"):
        theirs = gguf_quants.dequantize(data, qtype)
    assert_same_bits(values, theirs, names, f"{name}: gguf-py's dequantize of mixle's bytes")


# ------------------------------------------------------------------- ggml: fixture and live


@pytest.fixture(scope="module")
def reference():
    path = ROOT / FIXTURE
    if not path.exists():
        pytest.fail(f"{FIXTURE} is missing: run `python benchmarks/make_ggml_fixtures.py` with llama-cpp-python")
    data = np.load(path)
    return {key: data[key] for key in data.files}


@pytest.mark.parametrize("name", GGML_NAMES)
def test_bytes_and_values_equal_ggml_fixture(name, reference):
    names, x = list(reference["row_names"]), reference["inputs"]
    ggml_type = BLOCK_TYPES[name].ggml_type
    data, values = round_trip(name, x)
    assert_same_bits(data, reference[f"{ggml_type}_bytes"], names, f"{name} bytes vs ggml (fixture)")
    assert_same_bits(values, reference[f"{ggml_type}_values"], names, f"{name} values vs ggml (fixture)")
    with np.errstate(all="ignore"):  # unpack then dequantize reads ggml's own bytes
        read = BLOCK_TYPES[name].dequantize(BLOCK_TYPES[name].unpack(reference[f"{ggml_type}_bytes"]))
    assert_same_bits(read, reference[f"{ggml_type}_values"], names, f"{name} values of ggml's bytes")


def test_fixture_inputs_are_the_rows(reference, rows):
    meta = json.loads(str(reference["meta"]))
    assert meta["ggml_commit"] and meta["llama_cpp_python"]
    assert list(reference["row_names"]) == rows[0]
    assert np.array_equal(bits(reference["inputs"]), bits(rows[1]))


@pytest.fixture(scope="module")
def libggml():
    lib = ggml_library()
    if lib is None:
        pytest.skip("llama-cpp-python (its bundled ggml library) is not installed")
    return lib


def stress_rows(count=96, seed=7):
    """Random rows over 24 decades of scale and six shapes of distribution, some blocks zero."""
    rng = np.random.default_rng(seed)
    shapes = [
        lambda: rng.standard_normal(ROW),
        lambda: rng.laplace(size=ROW),
        lambda: rng.uniform(-1, 1, ROW),
        lambda: np.round(rng.standard_normal(ROW) * 3) / 3,
        lambda: rng.standard_t(1.5, ROW),
        lambda: rng.uniform(0, 1, ROW) + rng.uniform(-1, 1),
    ]
    x = np.stack([shapes[i % len(shapes)]() * 10.0 ** rng.uniform(-12, 12) for i in range(count)])
    x.reshape(count, -1, 32)[rng.random((count, ROW // 32)) < 0.05] = 0
    return [f"stress_{i}" for i in range(count)], x.astype(np.float32)


@pytest.mark.parametrize("name", GGML_NAMES)
def test_bytes_and_values_equal_libggml(name, libggml, rows):
    names, x = rows
    more_names, more = stress_rows()
    names, x = names + more_names, np.concatenate([x, more])
    ggml_type = BLOCK_TYPES[name].ggml_type
    ref = ggml_quantize(libggml, ggml_type, x)
    data, values = round_trip(name, x)
    assert_same_bits(data, ref, names, f"{name} bytes vs libggml")
    assert_same_bits(values, ggml_dequantize(libggml, ggml_type, ref, x.shape[1]), names, f"{name} values vs libggml")


def test_mxfp4_exponent_follows_log2f_at_powers_of_two():
    """floorf(log2f(amax)) rounds up just below a power of two; mixle rounds the same way."""
    path = ctypes.util.find_library("m")
    if path is None:
        pytest.skip("no C math library to call log2f from")
    libm = ctypes.CDLL(path)
    libm.log2f.argtypes, libm.log2f.restype = [ctypes.c_float], ctypes.c_float
    powers = np.array([2.0**k for k in range(-149, 128)], np.float32).view(np.int32)
    amax = (powers[:, None] + np.arange(-160, 4)).ravel().view(np.float32)
    amax = amax[np.isfinite(amax) & (amax > 0)]
    want = [(int(np.floor(np.float32(libm.log2f(float(v))))) - 2 + 127) & 0xFF for v in amax]
    x = np.zeros((len(amax), 32), np.float32)
    x[:, 3] = amax * np.where(np.arange(len(amax)) % 2, -1, 1).astype(np.float32)
    e = BLOCK_TYPES["mxfp4"].quantize(x).e[:, 0]
    assert np.array_equal(e, np.array(want, np.uint8))


# -------------------------------------------------------------------------- torch and layout


@pytest.mark.parametrize("name", sorted(BLOCK_TYPES))
def test_torch_equals_numpy(name, rows):
    torch = pytest.importorskip("torch")
    names, x = rows
    bt = BLOCK_TYPES[name]
    mine, theirs = bt.quantize(x), bt.quantize(torch.from_numpy(x))
    assert all(isinstance(field, torch.Tensor) for field in theirs)
    for field, a, b in zip(mine._fields, mine, theirs):
        assert_same_bits(a, b, names, f"{name}.{field} torch vs numpy")
    with np.errstate(all="ignore"):
        assert_same_bits(bt.dequantize(mine), bt.dequantize(theirs), names, f"{name} values torch vs numpy")


@pytest.mark.parametrize("name", sorted(BLOCK_TYPES))
def test_unpack_inverts_pack(name, rows):
    names, x = rows
    bt = BLOCK_TYPES[name]
    fields = bt.quantize(x)
    data = bt.pack(fields)
    assert data.dtype == np.uint8 and data.shape == (len(x), ROW // bt.block * bt.bytes_per_block)
    for field, a, b in zip(fields._fields, fields, bt.unpack(data)):
        assert_same_bits(a, b, names, f"{name}.{field} after pack and unpack")


@pytest.mark.parametrize("name", sorted(BLOCK_TYPES))
def test_shapes(name):
    bt = BLOCK_TYPES[name]
    x = np.ones((2, 3, 2 * bt.block), np.float32)
    assert bt.dequantize(bt.quantize(x)).shape == x.shape
    assert bt.pack(bt.quantize(x)).shape == (2, 3, 2 * bt.bytes_per_block)
    with pytest.raises(ValueError, match="multiple of the block"):
        bt.quantize(np.ones(bt.block + 1, np.float32))


# ------------------------------------------------------------------------------------- NF4


def test_nf4_codes_are_the_nearest_table_value(rows):
    _, x = rows
    fields = BLOCK_TYPES["nf4"].quantize(x[:4])
    table = np.array(NF4_TABLE, np.float32)
    normalized = x[:4].reshape(4, -1, 64) * (np.float32(1) / fields.absmax[..., None])
    nearest = np.abs(normalized[..., None] - table).argmin(axis=-1)
    assert np.array_equal(fields.codes, nearest)
    mid = (table[1:].astype(np.float64) + table[:-1]) / 2
    assert np.allclose(NF4_THRESHOLDS, mid, atol=1e-7)


def test_nf4_ties_and_zero_blocks():
    t = np.float32(NF4_THRESHOLDS[9])
    x = np.zeros((2, 64), np.float32)
    x[0, :3] = [1.0, t, np.nextafter(t, np.float32(1))]  # absmax 1: x itself is normalized
    fields = BLOCK_TYPES["nf4"].quantize(x)
    assert fields.codes[0, 0, :3].tolist() == [15, 9, 10]  # `x > threshold` takes the upper code
    assert set(fields.codes[1, 0].tolist()) == {7} and fields.absmax[1, 0] == 0
    assert not np.signbit(BLOCK_TYPES["nf4"].dequantize(fields)[1]).any()
