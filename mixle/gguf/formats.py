"""llama.cpp's block types as format records (``mixle.core.grids.Grid``), registered in ``GRIDS``.

Each record holds everything every layer needs of a ggml type: codes, scale and rounding rules, its
block numerics (``mixle.gguf.ggml_quants``) or mixle's own block rules (Q4_0, Q8_0), the
importance-weighted search of ``llama-quantize --imatrix`` (``mixle.gguf.ggml_weighted``) or that
ggml ignores an importance, the ggml type id and block layout, the GGUF file type a file mostly of
it is, and the fused CPU kernels' kind. ``Q8_K`` is the grid llama.cpp quantizes a K-quant
product's activations on (``ACTIVATION_GRIDS``). ``import mixle`` imports this module, so every
lookup of a grid by name sees them; it imports numpy only.
"""

from mixle.core.grids import Grid, KernelKind, register_grid
from mixle.gguf.ggml_quants import BLOCK_TYPES, KVALUES_MXFP4
from mixle.gguf.ggml_weighted import (
    Q4_0_WEIGHTED,
    Q4_1_WEIGHTED,
    Q4_K_WEIGHTED,
    Q5_0_WEIGHTED,
    Q5_1_WEIGHTED,
    Q5_K_WEIGHTED,
    Q6_K_WEIGHTED,
)

__all__ = ["LLAMA_CPP_GRIDS", "Q8_K"]


def _block_grid(name, codes, divisor, **fields):
    """A grid whose numerics are ``BLOCK_TYPES[name]`` (blocks, ggml type and packing from there)."""
    block_type = BLOCK_TYPES[name]
    common = dict(scale_dtype="float16", zero_scale=None, packing="block_type")
    return Grid(name=name, codes=codes, divisor=divisor, block=block_type.block, ggml_type=block_type.ggml_type,
                block_type=block_type, **{**common, **fields})


# ggml's block layouts, the fields in file order with their bytes: ``"d"`` the float16 scale,
# ``"m"`` / ``"dmin"`` the float16 min, ``"e"`` MXFP4's exponent byte, ``"scales"`` the sub-block
# scales (and mins), ``"qs"`` / ``"ql"`` / ``"qh"`` the codes' bits.
_K4 = (("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128))


# llama.cpp's other block types: their numerics are mixle.gguf.ggml_quants' (numpy, torch and jax;
# both backends train on them through their block numerics, except MXFP4, whose exponent needs a
# log2 jax has no exact form of here).
_BLOCK_GRIDS = (
    _block_grid("q4_1", {4: (0, 15)}, {4: 15.0}, scale_rule="min_max", rounding="half_up", offset="min",
                activation_grid="q8_0",
                weighted=Q4_1_WEIGHTED, ggml_type_id=3, ggml_fields=(("d", 2), ("m", 2), ("qs", 16)),
                file_type="MOSTLY_Q4_1", file_type_rank=1, kernel=KernelKind(2, 32, offset=True),
                summary="llama.cpp's Q4_1: blocks of 32, w = d * code + m with d = (max - min) / 15 and the "
                        "min m stored as float16"),
    _block_grid("q5_0", {5: (-16, 15)}, {5: -16.0}, scale_rule="signed_max", rounding="offset_trunc",
                activation_grid="q8_0",
                weighted=Q5_0_WEIGHTED, ggml_type_id=6, ggml_fields=(("d", 2), ("qh", 4), ("qs", 16)),
                file_type="MOSTLY_Q5_0", file_type_rank=3, kernel=KernelKind(3, 32),
                summary="llama.cpp's Q5_0: blocks of 32, scale = signed max / -16 stored as float16"),
    _block_grid("q5_1", {5: (0, 31)}, {5: 31.0}, scale_rule="min_max", rounding="half_up", offset="min",
                activation_grid="q8_0",
                weighted=Q5_1_WEIGHTED, ggml_type_id=7,
                ggml_fields=(("d", 2), ("m", 2), ("qh", 4), ("qs", 16)), file_type="MOSTLY_Q5_1", file_type_rank=4,
                kernel=KernelKind(4, 32, offset=True),
                summary="llama.cpp's Q5_1: blocks of 32, w = d * code + m with d = (max - min) / 31 and the "
                        "min m stored as float16"),
    _block_grid("q4_k", {4: (0, 15)}, {4: 63.0}, scale_rule="min_max", rounding="nearest_int", offset="min",
                scale_search="make_qkx2_quants", sub_block=32, sub_scale_bits=6, activation_grid="q8_k",
                weighted=Q4_K_WEIGHTED, ggml_type_id=12, ggml_fields=_K4, file_type="MOSTLY_Q4_K_M",
                file_type_rank=2, kernel=KernelKind(5, 32, offset=True),
                summary="llama.cpp's Q4_K: super-blocks of 256 = 8 x 32 with 6-bit scales and mins (a "
                        "least-squares search) under float16 d and dmin, w = d * sc * code - dmin * m"),
    _block_grid("q5_k", {5: (0, 31)}, {5: 63.0}, scale_rule="min_max", rounding="nearest_int", offset="min",
                scale_search="make_qkx2_quants", sub_block=32, sub_scale_bits=6, activation_grid="q8_k",
                weighted=Q5_K_WEIGHTED, ggml_type_id=13, ggml_fields=_K4[:3] + (("qh", 32), ("qs", 128)),
                file_type="MOSTLY_Q5_K_M", file_type_rank=5, kernel=KernelKind(6, 32, offset=True),
                summary="llama.cpp's Q5_K: as Q4_K with codes 0..31"),
    _block_grid("q6_k", {6: (-32, 31)}, {6: -128.0}, scale_rule="signed_max", rounding="nearest_int",
                scale_search="make_qx_quants", sub_block=16, sub_scale_bits=8, sub_scale_signed=True,
                activation_grid="q8_k",
                weighted=Q6_K_WEIGHTED, ggml_type_id=14,
                ggml_fields=(("ql", 128), ("qh", 64), ("scales", 16), ("d", 2)), file_type="MOSTLY_Q6_K",
                file_type_rank=6, kernel=KernelKind(7, 16),
                summary="llama.cpp's Q6_K: super-blocks of 256 = 16 x 16 with int8 scales under a float16 d, "
                        "codes -32..31, w = d * sc * code"),
    _block_grid("mxfp4", {4: (0, 15)}, {4: 8.0}, scale_rule="power_of_two", rounding="table_nearest",
                scale_dtype="e8m0", zero_scale=2.0 ** -128, table=tuple(float(v) for v in KVALUES_MXFP4),
                activation_grid="q8_0", backends=("torch",),
                ignores_importance=True, ggml_type_id=39, ggml_fields=(("e", 1), ("qs", 16)),
                file_type="MOSTLY_MXFP4_MOE", file_type_rank=8,
                kernel=KernelKind(8, 32),  # code = the E2M1 value doubled, a = 2**(e - 128)
                summary="llama.cpp's MXFP4: blocks of 32, E2M1 values (doubled) under a shared E8M0 "
                        "exponent (halved)"),
)

# Q4_0 and Q8_0: mixle's own block rules (``mixle.core.numerics``) compute them bit for bit.
_PLAIN_GRIDS = (
    Grid(name="q4_0", codes={4: (-8, 7)}, divisor={4: -8.0}, scale_rule="signed_max",
         rounding="offset_trunc", scale_dtype="float16", zero_scale=None, block=32, packing="ggml_q4_0",
         ggml_type="Q4_0", activation_grid="q8_0", weighted=Q4_0_WEIGHTED,
         ggml_type_id=2, ggml_fields=(("d", 2), ("qs", 16)), file_type="MOSTLY_Q4_0", file_type_rank=0,
         kernel=KernelKind(0, 32),
         summary="llama.cpp's Q4_0: blocks of 32, scale = signed max / -8 stored as float16"),
    Grid(name="q8_0", codes={8: (-127, 127)}, divisor={8: 127.0}, rounding="half_away",
         scale_dtype="float16", zero_scale=None, block=32, packing="bytes", ggml_type="Q8_0",
         activation_grid="q8_0", ignores_importance=True, ggml_type_id=8,
         ggml_fields=(("d", 2), ("qs", 32)), file_type="MOSTLY_Q8_0", file_type_rank=7, kernel=KernelKind(1, 32),
         summary="llama.cpp's Q8_0: blocks of 32, scale = absmax / 127 stored as float16"),
)

Q8_K = Grid(name="q8_k", codes={8: (-127, 127)}, divisor={8: -127.0}, scale_rule="signed_max",
            rounding="nearest_int", zero_scale=None, block=256, backends=(),
            summary="llama.cpp's Q8_K, the input of its K-quant products: blocks of 256, codes "
                    "nearest_int(x * (-127 / signed max)), scale 1 / (-127 / signed max) in float32")


# every llama.cpp grid, in the order ``GRIDS`` lists them (after mixle's own).
LLAMA_CPP_GRIDS = tuple(register_grid(grid) for grid in _PLAIN_GRIDS + _BLOCK_GRIDS)
register_grid(Q8_K, activations_only=True)
