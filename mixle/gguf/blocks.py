"""ggml's block layouts, written from mixle's stored arrays (numpy only).

Nothing is re-quantized here: the codes and scales a QAT or converted layer (or a
``QuantizedArray``) holds are laid out byte for byte as llama.cpp stores them. Which block type a
grid is written as is the grid record's ``ggml_type``, how its codes sit in a block its
``packing``, and the codes' range its ``code_range`` (``mixle.core.grids``); this module only
knows the block layouts (``GGML_BLOCKS``, the fields of each block in file order):

* Q4_0 (18 bytes per 32 weights of a row): the float16 scale ``d``, then 16 bytes where byte
  ``j`` holds ``q[j] | q[j + 16] << 4`` with ``q = code + 8`` (codes -8..7 stored as 0..15).
* Q8_0 (34 bytes): the float16 scale ``d``, then the 32 codes as int8.
* Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4: the fields of ``mixle.gguf.ggml_quants``'
  block types, packed by their ``pack`` (``pack_array``).

A row of ``cols`` weights takes ``cols / block`` blocks; rows follow each other. ``block_scale_problem``
reads the float16 fields (``d``, ``m``, ``dmin``) back from a file's bytes to refuse NaN/inf ones.
"""

from dataclasses import dataclass

import math

import numpy as np

from mixle.core.grids import GRIDS, DerivedTable, Grid, grid_named
from mixle.core.packing import pack_scale_blocks
from mixle.core.spec import QuantSpec
from mixle.core.stored import block_type_of, check_stored

BLOCK = 32
# The block fields that hold float16 values (scales and mins).
FLOAT16_FIELDS = ("d", "m", "dmin")

__all__ = ["BLOCK", "FLOAT16_FIELDS", "GGML_BLOCKS", "GGML_TYPE_OF_GRID", "GGMLBlock", "ggml_grid", "pack_blocks",
           "pack_array", "block_scale_problem"]


@dataclass(frozen=True)
class GGMLBlock:
    """One ggml block type: its values per block and the bytes of its fields, in file order (a view
    of a grid record's ``block``, ``ggml_type`` and ``ggml_fields``).

    Attributes:
        name: the ggml type name (``gguf.GGMLQuantizationType`` member).
        block: values per block.
        fields: ``(field, bytes)`` in the order a block stores them: ``"d"`` the float16 scale,
            ``"m"`` / ``"dmin"`` the float16 min, ``"e"`` MXFP4's exponent byte, ``"scales"`` the
            sub-block scales (and mins), ``"qs"`` / ``"ql"`` / ``"qh"`` the codes' bits.
    """

    name: str
    block: int
    fields: tuple

    @property
    def nbytes(self):
        """Bytes of one block.

        >>> GGML_BLOCKS["Q4_0"].nbytes
        18
        """
        return sum(size for _, size in self.fields)


# ggml type name -> its layout, and grid name -> ggml type, read off the grid records (``Grid.ggml_fields``).
GGML_BLOCKS = DerivedTable(lambda: {g.ggml_type: GGMLBlock(g.ggml_type, g.block, g.ggml_fields)
                                    for g in GRIDS.values() if g.ggml_fields is not None})
GGML_TYPE_OF_GRID = DerivedTable(lambda: {g.name: g.ggml_type for g in GRIDS.values() if g.ggml_fields is not None})


def ggml_grid(grid):
    """The Grid record of ``grid`` (a name or a Grid) if GGUF has its block type; ValueError otherwise.

    >>> ggml_grid("q8_0").ggml_type
    'Q8_0'
    """
    record = grid if isinstance(grid, Grid) else grid_named(grid)
    if record.ggml_type not in GGML_BLOCKS:
        usable = sorted(GGML_TYPE_OF_GRID)
        raise ValueError(f"grid={record.name!r} has no ggml block type: use one of {usable}")
    return record


def pack_blocks(grid, codes, scale):
    """The ggml blocks of a ``(rows, cols)`` matrix of codes on ``grid`` with one scale per block.

    The codes and scales are validated first (``mixle.core.stored.check_stored``: codes on the
    grid, scales finite, of the grid's sign rule and exact float16 values).

    Args:
        grid: a grid name (``"q4_0"``, ``"q8_0"``) or Grid record with a ggml type.
        codes: integer array ``(rows, cols)``, ``cols`` a multiple of 32, in the grid's range.
        scale: ``rows * cols / 32`` float16 values (any float dtype holding them exactly).

    Returns:
        uint8 array ``(rows, cols / 32 * bytes_per_block)``: what gguf's ``GGUFWriter.add_tensor``
        takes with ``raw_dtype`` set to the ggml type.

    >>> pack_blocks("q8_0", np.arange(-16, 16).reshape(1, 32), np.float32([0.5])).shape
    (1, 34)
    """
    record = ggml_grid(grid)
    layout = GGML_BLOCKS[record.ggml_type]
    if record.packing not in ("ggml_q4_0", "bytes"):
        raise ValueError(f"grid {record.name!r} stores more than codes and one scale per block: use pack_array")
    (bits,) = record.codes
    codes = np.asarray(codes)
    if codes.ndim != 2 or codes.shape[1] % layout.block:
        raise ValueError(f"codes must be (rows, cols) with cols a multiple of {layout.block}, got shape {codes.shape}")
    scale = np.asarray(scale, dtype=np.float32).reshape(1, -1, 1)
    spec = QuantSpec(bits=bits, grid=record.name)
    narrow = codes.astype(np.int8)
    if not np.array_equal(narrow, codes):
        low, high = record.code_range(bits)
        raise ValueError(f"{record.name} codes lie in [{low}, {high}], got [{codes.min()}, {codes.max()}]")
    check_stored(narrow, scale, spec, codes.shape, packed=False, name=f"{record.name} blocks")
    return pack_scale_blocks(codes, scale, record, bits)


def pack_array(q, name="array"):
    """The ggml blocks of a ``QuantizedArray`` on a grid with a GGUF block type, from its own fields.

    The record is validated first (``QuantizedArray.check``); nothing is re-quantized.

    Args:
        q: the QuantizedArray (numpy or torch), its last axis the rows (a multiple of the block).
        name: what errors call it (e.g. ``"layer 'fc'"``).

    Returns:
        uint8 array ``(rows, cols / block * bytes_per_block)`` (rows: every axis but the last).

    Raises:
        ValueError: the grid has no GGUF block type, or the record is invalid; names ``name``.

    >>> from mixle.core.numerics import quantize_array
    >>> pack_array(quantize_array(np.ones((2, 256), np.float32), grid="q4_k")).shape
    (2, 144)
    """
    grid = q.spec.grid_record
    if grid.ggml_type not in GGML_BLOCKS:
        raise ValueError(f"{name} is quantized on {q.spec.short()}, which GGUF has no block type for: use one of "
                         f"the grids {sorted(GGML_TYPE_OF_GRID)}")
    q.check(name)
    rows = math.prod(q.shape[:-1])
    if grid.numerics is not None:
        return block_type_of(grid).pack(q.block_fields()).reshape(rows, -1)
    if grid.packing not in ("ggml_q4_0", "bytes"):
        raise ValueError(f"grid {grid.name!r} stores more than codes and one scale per block, but has no block numerics")
    codes = q.codes.detach().cpu().numpy() if hasattr(q.codes, "detach") else np.asarray(q.codes)
    scale = q.scale.detach().cpu().float().numpy() if hasattr(q.scale, "detach") else np.asarray(q.scale)
    return pack_scale_blocks(codes.reshape(rows, -1), scale.ravel(), grid, q.spec.bits)


def block_scale_problem(data, ggml_type):
    """Where a file's ggml blocks hold a NaN or infinite float16 scale or min, or None.

    Args:
        data: the tensor's bytes, uint8 ``(..., bytes per row)`` (as gguf's reader gives them).
        ggml_type: its type name; types without a layout here are not checked (None).

    Returns:
        ``"row r, block b: d = nan"`` for the first bad field, or None.

    >>> block = np.zeros((1, 18), np.uint8)
    >>> block_scale_problem(block, "Q4_0") is None
    True
    >>> block[0, :2] = np.array([np.nan], "<f2").view(np.uint8)
    >>> block_scale_problem(block, "Q4_0")
    'row 0, block 0: d = nan'
    """
    layout = GGML_BLOCKS.get(ggml_type)
    if layout is None:
        return None
    raw = np.asarray(data, np.uint8)
    blocks = raw.reshape(-1, raw.shape[-1] // layout.nbytes, layout.nbytes)
    start = 0
    for field, size in layout.fields:
        if field in FLOAT16_FIELDS:
            values = np.ascontiguousarray(blocks[..., start:start + 2]).view("<f2")[..., 0]
            bad = ~np.isfinite(values)
            if bad.any():
                row, block = (int(i) for i in np.argwhere(bad)[0])
                return f"row {row}, block {block}: {field} = {float(values[row, block])}"
        start += size
    return None
