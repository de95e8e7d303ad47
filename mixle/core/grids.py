"""Formats as data: one record per grid (or llama.cpp block type), read by the numerics, the
backends and the exports, and the only table of formats there is.

A grid says which integer codes exist for each bit width (and the values a lookup grid's codes
index), how a block's scale is derived from its values and refined by a search, how a value is
rounded to a code, its offsets and second scale level (integer or float sub-scales), how its
scales are stored (``scale_dtype``, a ``mixle.core.scale_codecs`` codec), its block numerics
(``numerics`` / ``block_type``: quantize, dequantize, pack, unpack), ggml's importance-weighted
search (``weighted``) or that ggml ignores an importance (``ignores_importance``), its ggml type
(name, id, block layout ``ggml_fields``), the GGUF file type a file mostly of it is (and its
precedence), how the fused CPU kernels run it (``kernel``) and which backends train on it. Adding
a format is one ``Grid`` (``register_grid``; plus its oracle test); every other table
(``mixle.gguf.blocks.GGML_BLOCKS``, ``mixle.gguf.mixes.GRID_OF_TYPE``,
``mixle.torch_backend.fused_ggml.KINDS``, ``WEIGHTED`` ...) is read off the records, and nothing
branches on grid names.

Scale rules (``Grid.scale_rule``), per block of values ``w``:

* ``"absmax"``: ``scale = max|w| / divisor``.
* ``"signed_max"``: ``scale = m / divisor`` where ``m`` is the value of largest magnitude with
  its sign (the first one on ties); a negative divisor maps ``m`` to the most negative code.
* ``"min_max"``: ``scale = (max - min) / divisor``, with the min stored (below).
* ``"power_of_two"``: ``scale = 2 ** floor(log2(max|w| / divisor))``, stored as its exponent
  (``scale_dtype="e8m0"``: MXFP4's shared exponent).

Rounding rules (``Grid.rounding``):

* ``"half_even"``: ``code = clip(round_half_even(w / scale), code_min, code_max)``.
* ``"half_away"``: ``code = clip(round_half_away_from_zero(w * (1 / scale)), ...)``.
* ``"offset_trunc"``: ``code = clip(trunc(w * (1 / scale) + offset + 0.5), 0, 2 * offset - 1)
  - offset`` with ``offset = -code_min``: ggml's Q4_0 rounding, computed in the block's dtype.
* ``"half_up"``: ``code = min(trunc((w - min) * (1 / scale) + 0.5), code_max)`` (ggml's Q4_1 / Q5_1).
* ``"nearest_int"``: ggml's ``nearest_int`` (round half to even through float32's mantissa), as
  the K-quants round.
* ``"table_nearest"``: the index of the nearest value of the grid's ``table`` (MXFP4, NF4).

Block numerics (``Grid.numerics``): llama.cpp's other block types (and NF4) are computed by
``mixle.core.ggml_quants`` (bit for bit as ggml's reference C code), which ``numerics`` names
(a ``BLOCK_TYPES`` key); the scale rule, rounding and search fields then describe what that code
does, and the stored array (``mixle.core.stored``) holds its fields. ``table``: the values a
lookup grid's codes index (``w = table[code] * scale``).

A zero block gets ``Grid.zero_scale`` (1: codes 0 and no division by zero); ``None`` keeps the
computed (signed) zero, as ggml's grids do, whose reciprocal is then 0 too. ``scale_dtype="float16"``
means the scale is *computed* in the weight's dtype (the codes use that value) and *stored* in
float16, and the dequantized weight is ``code * float16(scale)``.

What a grid may also store (the record expresses llama.cpp's K-quants; their numerics come with
their grids):

* ``scale_rule="min_max"`` with ``offset="min"``: ``scale = (max - min) / divisor`` and the
  block's min stored as a float offset, ``w = scale * code + min`` (ggml's Q4_1 / Q5_1);
  ``offset="zero_point"`` stores an integer zero point instead, ``w = scale * (code - zero)``.
* ``scale_search``: the block scale is refined by a least-squares search over candidate scales
  (``"make_qx_quants"``, symmetric; ``"make_qkx2_quants"``, with a min), as ggml's K-quants.
* Two scale levels (``sub_block``, ``sub_scale_bits``, ``sub_scale_signed``): each ``block`` is
  a super-block of ``block / sub_block`` sub-blocks whose scales (and mins) are small integers
  under the float super-block scale (and min) stored in ``scale_dtype``:
  ``w = d * sc * code - dmin * m`` (Q4_K: unsigned 6-bit ``sc``/``m``; Q6_K: signed 8-bit ``sc``).
* ``ggml_type``: the GGUF block type the grid's codes and scales are written as; ``packing`` says
  how its codes sit in the bytes of that block (``mixle.core.packing.pack_block_codes``).

Activations (``QuantSpec.act_bits``): ``Grid.activation_grid`` names the grid the activations
feeding a matmul on this grid are fake-quantized on, in blocks of that grid's ``block`` along the
input axis of each token: what llama.cpp's CPU path makes of the input of the product. It
quantizes the input of every Q4_0/Q8_0/Q5_0/MXFP4 product to Q8_0 blocks of 32 (ggml's
``quantize_row_q8_0``), so those grids name ``"q8_0"``; the input of a Q4_1/Q5_1 product to Q8_1
blocks, whose values are Q8_0's (Q8_1 also keeps each block's scaled sum, which only the dot
product reads), so they name ``"q8_0"`` too; and the input of a K-quant product to Q8_K blocks of
256 (``quantize_row_q8_K``: inverse scale ``-127 / signed max``, codes ``nearest_int``, scale
``1 / inverse`` in float32), ``"q8_k"``, a grid of activations only (``ACTIVATION_GRIDS``: no
weight trains on it or is stored on it). ``None`` means one scale per token on the weights' own
grid, except on NF4, which has no llama.cpp product: ``QuantSpec`` refuses ``act_bits`` there.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from mixle.core import ggml_weighted as _searches
from mixle.core.ggml_quants import BLOCK_TYPES, KVALUES_MXFP4, NF4_TABLE, BlockType
from mixle.core.ggml_weighted import run_weighted
from mixle.core.scale_codecs import SCALE_CODECS, scale_codec

SCALE_RULES = ("absmax", "signed_max", "min_max", "power_of_two")
ROUNDINGS = ("half_even", "half_away", "offset_trunc", "half_up", "nearest_int", "table_nearest")
PACKINGS = ("pairs", "ggml_q4_0", "bytes", "block_type")
OFFSETS = (None, "min", "zero_point")
SCALE_SEARCHES = (None, "make_qx_quants", "make_qkx2_quants")
IMPORTANCE = (None, "weighted", "ignored")


class KernelKind(NamedTuple):
    """How the fused CPU kernels of llama.cpp's grids (``mixle.torch_backend.fused_ggml``) run a grid.

    Attributes:
        id: the grid's number in ``fused_ggml_quant.cpp``'s enum.
        sub: values per multiplier ``a`` (and offset ``b``): ``value = code * a (+ b)``.
        offset: whether there is an offset ``b``.
        indexes_table: the kernel's codes index the grid's ``table`` (``value = table[code] * a``);
            else they are the values themselves (MXFP4's doubled E2M1 values).
    """

    id: int
    sub: int
    offset: bool = False
    indexes_table: bool = False


@dataclass(frozen=True, kw_only=True)
class Grid:
    """One integer grid.

    Attributes:
        name: the ``QuantSpec.grid`` value.
        codes: ``{bits: (code_min, code_max)}``; its keys are the bit widths the grid has.
        divisor: ``{bits: divisor}`` of the scale rule (with two levels: of the super-block scale).
        scale_rule: one of ``SCALE_RULES``.
        rounding: one of ``ROUNDINGS``.
        scale_dtype: ``None`` (the weight's own dtype) or ``"float16"``; with two levels the dtype
            of the super-block scale (and min).
        zero_scale: the scale of an all-zero block (None: the computed zero is kept).
        block: a fixed group size the grid imposes (``None``: any granularity); with two levels
            the super-block.
        activation_grid: the grid (in blocks of its ``block`` along each token's inputs) that
            ``act_bits`` fake-quantizes activations on; ``None``: per token on this grid.
        packing: how codes sit in the bytes of the grid's file blocks (one of ``PACKINGS``; see
            ``mixle.core.packing``; ``"block_type"``: as the block numerics' own ``pack`` lays out
            the whole block). mixle's own files always store 4-bit codes as ``"pairs"``.
        offset: one of ``OFFSETS``: no offset, a float ``"min"`` or an integer ``"zero_point"``
            per block.
        scale_search: one of ``SCALE_SEARCHES``: a least-squares search refining each scale.
        sub_block: values per sub-block of a two-level grid (``None``: one scale level).
        sub_scale_bits: bits of the integer sub-block scales (and mins).
        sub_scale_signed: sub-block scales are signed (stored int8) rather than unsigned (uint8).
        sub_scale_dtype: instead of integer sub-scales (``sub_scale_bits``), float ones stored in
            this scale codec (``mixle.core.scale_codecs``: e.g. an FP8 scale per sub-block).
        ggml_type: the GGUF block type the grid is written as (``"Q4_0"``), or None.
        numerics: the ``mixle.core.ggml_quants.BLOCK_TYPES`` entry that quantizes on this grid
            (None: ``mixle.core.numerics``' own block rules).
        table: the values the codes index on a lookup grid (``w = table[code] * scale``), or None.
        qwix_native: Qwix's own grid: its calibration methods and 8-bit float weight formats
            (``QuantSpec.calibration``, ``weight_format``) describe it.
        backends: the backends that train on this grid (the numerics in ``mixle.core.numerics``
            implement every registered grid; a backend is listed once its layers, kernels and
            storage do).
        summary: one line for errors and docs.

    >>> GRIDS["symmetric"].code_range(4)
    (-7, 7)
    """

    name: str
    codes: dict
    divisor: dict
    scale_rule: str = "absmax"
    rounding: str = "half_even"
    scale_dtype: str | None = None
    zero_scale: float | None = 1.0
    block: int | None = None
    activation_grid: str | None = None
    packing: str = "pairs"
    offset: str | None = None
    scale_search: str | None = None
    sub_block: int | None = None
    sub_scale_bits: int | None = None
    sub_scale_signed: bool = False
    sub_scale_dtype: str | None = None
    ggml_type: str | None = None
    numerics: str | None = None
    table: tuple | None = None
    block_type: BlockType | None = None
    weighted: object = None
    ignores_importance: bool = False
    ggml_type_id: int | None = None
    ggml_fields: tuple | None = None
    file_type: str | None = None
    file_type_rank: int | None = None
    kernel: KernelKind | None = None
    qwix_native: bool = False
    backends: tuple = ("torch", "flax")
    summary: str = ""

    def __post_init__(self):
        if self.block_type is not None and self.numerics is None:
            object.__setattr__(self, "numerics", self.block_type.name)
        elif self.block_type is None and self.numerics in BLOCK_TYPES:
            object.__setattr__(self, "block_type", BLOCK_TYPES[self.numerics])
        if set(self.codes) != set(self.divisor):
            raise ValueError(f"grid {self.name!r}: codes and divisor must list the same bit widths")
        for field, allowed in (("scale_rule", SCALE_RULES), ("rounding", ROUNDINGS), ("packing", PACKINGS),
                               ("offset", OFFSETS), ("scale_search", SCALE_SEARCHES),
                               ("scale_dtype", (None,) + tuple(SCALE_CODECS))):
            if getattr(self, field) not in allowed:
                raise ValueError(f"grid {self.name!r}: {field}={getattr(self, field)!r} is unknown: use one of "
                                 f"{allowed}")
        for bits, (low, high) in self.codes.items():
            top = 2 ** (bits - 1) - 1 if low < 0 else 2 ** bits - 1
            if not (isinstance(bits, int) and 1 <= bits <= 8 and -(2 ** (bits - 1)) <= low < high <= top):
                raise ValueError(f"grid {self.name!r}: codes[{bits!r}]=({low}, {high}) is not a range of "
                                 f"{bits}-bit integers")
        problem = (self._rule_problem() or self._level_problem() or self._file_problem()
                   or self._numerics_problem())
        if problem:
            raise ValueError(f"grid {self.name!r}: {problem}")

    def _rule_problem(self):
        if self.scale_rule == "min_max" and self.offset is None:
            return "scale_rule='min_max' spans min..max, so the block's min must be stored: set offset='min'"
        if self.scale_search == "make_qkx2_quants" and self.offset != "min":
            return "scale_search='make_qkx2_quants' searches a scale and a min: set offset='min'"
        if self.scale_search == "make_qx_quants" and self.offset is not None:
            return "scale_search='make_qx_quants' is ggml's symmetric search: it stores no offset"
        if self.zero_scale is not None and not self.zero_scale > 0:
            return f"zero_scale={self.zero_scale!r} must be positive (or None to keep a zero block's zero scale)"
        return None

    def _level_problem(self):
        if self.sub_scale_bits is not None and self.sub_scale_dtype is not None:
            return "sub-scales are integers (sub_scale_bits) or floats (sub_scale_dtype), not both"
        fields = (self.sub_block, self.sub_scale_bits if self.sub_scale_dtype is None else self.sub_scale_dtype)
        if fields == (None, None):
            return "sub_scale_signed=True needs a second scale level (sub_block)" if self.sub_scale_signed else None
        if None in fields:
            return "a second scale level needs both sub_block and sub_scale_bits (or sub_scale_dtype)"
        if self.sub_scale_dtype is not None and self.sub_scale_dtype not in SCALE_CODECS:
            return f"sub_scale_dtype={self.sub_scale_dtype!r} is unknown: use one of {sorted(SCALE_CODECS)}"
        if self.block is None or self.sub_block < 1 or self.block % self.sub_block or self.sub_block == self.block:
            return (f"sub_block={self.sub_block!r} must divide the super-block block={self.block!r} into "
                    f"at least two sub-blocks")
        if self.sub_scale_bits is not None and not 2 <= self.sub_scale_bits <= 8:
            return f"sub_scale_bits={self.sub_scale_bits!r} must be 2..8 (the sub-scales are small integers)"
        if self.scale_dtype is None:
            return "a two-level grid stores its super-block scale as a float: set scale_dtype='float16'"
        if self.offset == "zero_point":
            return "a two-level grid stores sub-block mins (offset='min'), not a zero point"
        return None

    def _file_problem(self):
        if self.packing == "ggml_q4_0" and (set(self.codes) != {4} or self.block is None or self.block % 32):
            return "packing='ggml_q4_0' holds 4-bit codes in blocks of 32: set codes={4: ...} and block=32"
        if self.packing == "bytes" and set(self.codes) != {8}:
            return "packing='bytes' holds one 8-bit code per byte: set codes={8: ...}"
        if self.ggml_type is not None and (self.block is None or self.scale_dtype is None):
            return f"ggml_type={self.ggml_type!r} stores fixed blocks with float16 scales: set block and scale_dtype"
        if self.ggml_fields is not None and self.ggml_type is None:
            return "ggml_fields lay out a ggml block: set ggml_type"
        if self.weighted is not None and self.ignores_importance:
            return "a grid either has a weighted search (weighted) or ignores an importance (ignores_importance)"
        if self.weighted is not None and self.weighted.parts is None and self.block_type is None:
            return "weighted searches without parts of their own need the grid's block numerics: set numerics"
        if self.packing == "block_type" and self.numerics is None:
            return "packing='block_type' lays codes out as the block numerics do: set numerics"
        return None

    def _numerics_problem(self):
        if self.table is not None and (set(self.codes) != {4} or len(self.table) != 16
                                       or self.codes[4] != (0, 15)):
            return f"a table of {len(self.table)} values is indexed by 4-bit codes 0..15: set codes={{4: (0, 15)}}"
        if self.numerics is None:
            return None
        block_type = self.block_type
        if block_type is None:
            return f"numerics={self.numerics!r} is unknown: use one of {sorted(BLOCK_TYPES)}"
        if (block_type.block, block_type.ggml_type) != (self.block, self.ggml_type):
            return (f"numerics={self.numerics!r} makes {block_type.ggml_type} blocks of {block_type.block}: set "
                    f"block={block_type.block}, ggml_type={block_type.ggml_type!r}")
        if self.ggml_fields is not None and self.ggml_block_bytes != block_type.bytes_per_block:
            return (f"ggml_fields take {self.ggml_block_bytes} bytes, but numerics={self.numerics!r} packs "
                    f"{block_type.bytes_per_block} per block")
        return None

    def activation_record(self):
        """The Grid activations are fake-quantized on (this one when ``activation_grid`` is None).

        >>> GRIDS["q4_0"].activation_record().name, GRIDS["q4_k"].activation_record().name
        ('q8_0', 'q8_k')
        """
        if self.activation_grid is None:
            return self
        return GRIDS.get(self.activation_grid) or ACTIVATION_GRIDS[self.activation_grid]

    def code_range(self, bits):
        """``(code_min, code_max)`` at ``bits``.

        >>> GRIDS["q8_0"].code_range(8)
        (-127, 127)
        """
        return self.codes[bits]

    def largest_level(self, bits):
        """The largest magnitude a code stands for before the scale multiplies it: the largest
        ``|code|``, or of ``|table|`` on a lookup grid (the dequantized extreme is it times the scale).

        >>> GRIDS["qwix"].largest_level(4), GRIDS["mxfp4"].largest_level(4)
        (8, 12.0)
        """
        if self.table is not None:
            return max(abs(v) for v in self.table)
        low, high = self.codes[bits]
        return max(abs(low), abs(high))

    @property
    def importance(self):
        """How ``llama-quantize --imatrix`` uses an importance on this grid: ``"weighted"`` (a
        weighted search, ``weighted``), ``"ignored"`` (discarded), or None (no such quantizer).

        >>> GRIDS["q4_k"].importance, GRIDS["q8_0"].importance, GRIDS["nf4"].importance
        ('weighted', 'ignored', None)
        """
        if self.weighted is not None:
            return "weighted"
        return "ignored" if self.ignores_importance else None

    @property
    def codec(self):
        """The ``mixle.core.scale_codecs.ScaleCodec`` its scales are stored in (None: the weight's dtype)."""
        return scale_codec(self.scale_dtype)

    @property
    def ggml_block_bytes(self):
        """Bytes of one of its ggml blocks (``ggml_fields``), or None.

        >>> GRIDS["q4_0"].ggml_block_bytes, GRIDS["q6_k"].ggml_block_bytes
        (18, 210)
        """
        return None if self.ggml_fields is None else sum(size for _, size in self.ggml_fields)

    @property
    def two_level(self):
        """Whether blocks hold sub-blocks with integer scales under a float super-block scale."""
        return self.sub_block is not None

    def sub_scale_range(self):
        """``(low, high)`` of the integer sub-block scales (and mins) of a two-level grid, else None
        (None too for float sub-scales, ``sub_scale_dtype``).

        >>> Grid(name="k", codes={4: (0, 15)}, divisor={4: 15.0}, scale_rule="min_max", offset="min",
        ...      scale_dtype="float16", block=256, sub_block=32, sub_scale_bits=6).sub_scale_range()
        (0, 63)
        """
        if not self.two_level or self.sub_scale_dtype is not None:
            return None
        bits = self.sub_scale_bits
        return (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if self.sub_scale_signed else (0, 2 ** bits - 1)

    def is_plain(self):
        """True for the grids every kernel and backend implements: absmax scale, half-even
        rounding, scale kept in the weight's dtype, one scale level and no offset.

        >>> GRIDS["qwix"].is_plain(), GRIDS["q4_0"].is_plain()
        (True, False)
        """
        plain = ("absmax", "half_even", None, 1.0, None, None, None, None, None)
        return (self.scale_rule, self.rounding, self.scale_dtype, self.zero_scale, self.offset, self.scale_search,
                self.sub_block, self.numerics, self.table) == plain


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


# llama.cpp's other block types and NF4: their numerics are mixle.core.ggml_quants' (numpy, torch
# and jax; both backends train on them through their block numerics, except MXFP4, whose exponent
# needs a log2 jax has no exact form of here, and NF4, which Flax refuses too).
_BLOCK_GRIDS = (
    _block_grid("q4_1", {4: (0, 15)}, {4: 15.0}, scale_rule="min_max", rounding="half_up", offset="min",
                activation_grid="q8_0",
                weighted=_searches.Q4_1_WEIGHTED, ggml_type_id=3, ggml_fields=(("d", 2), ("m", 2), ("qs", 16)),
                file_type="MOSTLY_Q4_1", file_type_rank=1, kernel=KernelKind(2, 32, offset=True),
                summary="llama.cpp's Q4_1: blocks of 32, w = d * code + m with d = (max - min) / 15 and the "
                        "min m stored as float16"),
    _block_grid("q5_0", {5: (-16, 15)}, {5: -16.0}, scale_rule="signed_max", rounding="offset_trunc",
                activation_grid="q8_0",
                weighted=_searches.Q5_0_WEIGHTED, ggml_type_id=6, ggml_fields=(("d", 2), ("qh", 4), ("qs", 16)),
                file_type="MOSTLY_Q5_0", file_type_rank=3, kernel=KernelKind(3, 32),
                summary="llama.cpp's Q5_0: blocks of 32, scale = signed max / -16 stored as float16"),
    _block_grid("q5_1", {5: (0, 31)}, {5: 31.0}, scale_rule="min_max", rounding="half_up", offset="min",
                activation_grid="q8_0",
                weighted=_searches.Q5_1_WEIGHTED, ggml_type_id=7,
                ggml_fields=(("d", 2), ("m", 2), ("qh", 4), ("qs", 16)), file_type="MOSTLY_Q5_1", file_type_rank=4,
                kernel=KernelKind(4, 32, offset=True),
                summary="llama.cpp's Q5_1: blocks of 32, w = d * code + m with d = (max - min) / 31 and the "
                        "min m stored as float16"),
    _block_grid("q4_k", {4: (0, 15)}, {4: 63.0}, scale_rule="min_max", rounding="nearest_int", offset="min",
                scale_search="make_qkx2_quants", sub_block=32, sub_scale_bits=6, activation_grid="q8_k",
                weighted=_searches.Q4_K_WEIGHTED, ggml_type_id=12, ggml_fields=_K4, file_type="MOSTLY_Q4_K_M",
                file_type_rank=2, kernel=KernelKind(5, 32, offset=True),
                summary="llama.cpp's Q4_K: super-blocks of 256 = 8 x 32 with 6-bit scales and mins (a "
                        "least-squares search) under float16 d and dmin, w = d * sc * code - dmin * m"),
    _block_grid("q5_k", {5: (0, 31)}, {5: 63.0}, scale_rule="min_max", rounding="nearest_int", offset="min",
                scale_search="make_qkx2_quants", sub_block=32, sub_scale_bits=6, activation_grid="q8_k",
                weighted=_searches.Q5_K_WEIGHTED, ggml_type_id=13, ggml_fields=_K4[:3] + (("qh", 32), ("qs", 128)),
                file_type="MOSTLY_Q5_K_M", file_type_rank=5, kernel=KernelKind(6, 32, offset=True),
                summary="llama.cpp's Q5_K: as Q4_K with codes 0..31"),
    _block_grid("q6_k", {6: (-32, 31)}, {6: -128.0}, scale_rule="signed_max", rounding="nearest_int",
                scale_search="make_qx_quants", sub_block=16, sub_scale_bits=8, sub_scale_signed=True,
                activation_grid="q8_k",
                weighted=_searches.Q6_K_WEIGHTED, ggml_type_id=14,
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
    _block_grid("nf4", {4: (0, 15)}, {4: 1.0}, scale_rule="absmax", rounding="table_nearest", scale_dtype=None,
                packing="pairs", table=tuple(NF4_TABLE), backends=("torch",),
                kernel=KernelKind(9, 64, indexes_table=True),
                summary="QLoRA's NormalFloat-4 (bitsandbytes): blocks of 64, w = NF4_TABLE[code] * absmax "
                        "(float32); no GGUF type"),
)

GRIDS = {
    grid.name: grid
    for grid in (
        Grid(name="symmetric", codes={4: (-7, 7), 8: (-127, 127)}, divisor={4: 7.0, 8: 127.0},
             summary="codes -qmax..qmax, scale = absmax / qmax (mixle's default)"),
        Grid(name="qwix", codes={4: (-8, 7), 8: (-128, 127)}, divisor={4: 7.5, 8: 127.5}, qwix_native=True,
             summary="codes -(qmax+1)..qmax, scale = absmax / (qmax + 0.5) (Qwix's grid; also "
                     "compressed-tensors' symmetric int scheme)"),
        Grid(name="q4_0", codes={4: (-8, 7)}, divisor={4: -8.0}, scale_rule="signed_max",
             rounding="offset_trunc", scale_dtype="float16", zero_scale=None, block=32, packing="ggml_q4_0",
             ggml_type="Q4_0", activation_grid="q8_0", weighted=_searches.Q4_0_WEIGHTED,
             ggml_type_id=2, ggml_fields=(("d", 2), ("qs", 16)), file_type="MOSTLY_Q4_0", file_type_rank=0,
             kernel=KernelKind(0, 32),
             summary="llama.cpp's Q4_0: blocks of 32, scale = signed max / -8 stored as float16"),
        Grid(name="q8_0", codes={8: (-127, 127)}, divisor={8: 127.0}, rounding="half_away",
             scale_dtype="float16", zero_scale=None, block=32, packing="bytes", ggml_type="Q8_0",
             activation_grid="q8_0", ignores_importance=True, ggml_type_id=8,
             ggml_fields=(("d", 2), ("qs", 32)), file_type="MOSTLY_Q8_0", file_type_rank=7, kernel=KernelKind(1, 32),
             summary="llama.cpp's Q8_0: blocks of 32, scale = absmax / 127 stored as float16"),
    ) + tuple(_BLOCK_GRIDS)
}


# Grids that only activations are quantized on (``Grid.activation_grid``), never weights.
ACTIVATION_GRIDS = {
    "q8_k": Grid(name="q8_k", codes={8: (-127, 127)}, divisor={8: -127.0}, scale_rule="signed_max",
                 rounding="nearest_int", zero_scale=None, block=256, backends=(),
                 summary="llama.cpp's Q8_K, the input of its K-quant products: blocks of 256, codes "
                         "nearest_int(x * (-127 / signed max)), scale 1 / (-127 / signed max) in float32"),
}


def grid_named(name):
    """The Grid called ``name``; ValueError listing the known grids otherwise.

    >>> grid_named("q8_0").block
    32
    """
    grid = GRIDS.get(name) if isinstance(name, str) else None
    if grid is None:
        known = ", ".join(f"{g.name!r} ({g.summary})" for g in GRIDS.values())
        raise ValueError(f"grid={name!r} is unknown: use one of {known}")
    return grid



def register_grid(grid):
    """Add a format record to ``GRIDS``: every layer (numerics, backends, stored arrays, files)
    then reads it; nothing else needs to change. Returns the grid.

    Raises:
        ValueError: another grid already has its name (or it is not a Grid).

    >>> register_grid(GRIDS["q8_0"]).name
    'q8_0'
    """
    if not isinstance(grid, Grid):
        raise ValueError(f"register_grid takes a mixle.core.grids.Grid, got {type(grid).__name__}")
    known = GRIDS.get(grid.name) or ACTIVATION_GRIDS.get(grid.name)
    if known is not None and known is not grid:
        raise ValueError(f"grid {grid.name!r} is already registered: give the new format another name")
    GRIDS[grid.name] = grid
    return grid


class DerivedTable(Mapping):
    """A read-only table computed from the grid records each time it is read, so that a grid
    registered later (``register_grid``) is in it too.

    >>> dict(DerivedTable(lambda: {g.ggml_type: g.name for g in GRIDS.values() if g.ggml_type}))["Q8_0"]
    'q8_0'
    """

    def __init__(self, build: Callable):
        self._build = build

    def __getitem__(self, key):
        return self._build()[key]

    def __iter__(self):
        return iter(self._build())

    def __len__(self):
        return len(self._build())

    def __repr__(self):
        return repr(self._build())


# grid name -> its weighted search, and the grids whose ggml quantizer discards an importance.
WEIGHTED = DerivedTable(lambda: {g.name: g.weighted for g in GRIDS.values() if g.weighted is not None})
IGNORED = DerivedTable(lambda: {g.name: g for g in GRIDS.values() if g.ignores_importance})


def importance_grid(grid_name, name="x"):
    """How ``llama-quantize --imatrix`` uses an importance on a grid: ``"weighted"`` (a weighted
    search, ``Grid.weighted``) or ``"ignored"`` (ggml discards it); ValueError for grids ggml has
    no importance-weighted quantizer for.

    >>> importance_grid("q4_k"), importance_grid("q8_0")
    ('weighted', 'ignored')
    """
    grid = GRIDS.get(grid_name) if isinstance(grid_name, str) else None
    if grid is not None and grid.importance is not None:
        return grid.importance
    raise ValueError(f"{name}: grid={grid_name!r} has no importance-weighted search (llama.cpp's imatrix quantizers are for "
                     f"{sorted(WEIGHTED)}; it ignores the importance on {list(IGNORED)}): drop importance= or pick "
                     f"one of those grids")


def quantize_weighted(grid_name, x, importance):
    """ggml's importance-weighted quantizer of ``grid_name`` on rows x (..., n)
    (``mixle.core.ggml_weighted.run_weighted`` of the grid's ``weighted``).

    >>> x = np.linspace(-1, 1, 64, dtype=np.float32)[None]
    >>> quantize_weighted("q4_0", x, np.ones(64, np.float32)).codes[0, 0, [0, -1]].tolist()
    [0, 8]
    """
    grid = GRIDS.get(grid_name)
    if grid is None or grid.weighted is None:
        raise ValueError(f"grid {grid_name!r} has no importance-weighted quantizer in ggml: those are {sorted(WEIGHTED)}")
    return run_weighted(grid.weighted, x, importance)
