"""ggml's block layouts, written from mixle's codes and float16 scales (numpy only).

Nothing is re-quantized here: the codes and scales a QAT or converted layer holds are laid out
byte for byte as llama.cpp stores them. Which block type a grid is written as is the grid
record's ``ggml_type``, how its codes sit in a block its ``packing``, and the codes' range its
``code_range`` (``mixle.core.grids``); this module only knows the block layouts. Per block of 32
consecutive weights of a row:

* Q4_0 (18 bytes): the float16 scale ``d``, then 16 bytes where byte ``j`` holds
  ``q[j] | q[j + 16] << 4`` with ``q = code + 8`` (codes -8..7 stored as 0..15).
* Q8_0 (34 bytes): the float16 scale ``d``, then the 32 codes as int8.

A row of ``cols`` weights takes ``cols / 32`` blocks; rows follow each other.
"""

from dataclasses import dataclass

import numpy as np

from mixle.core.grids import GRIDS, Grid, grid_named
from mixle.core.packing import pack_block_codes
from mixle.core.spec import QuantSpec
from mixle.core.stored import check_stored

BLOCK = 32

__all__ = ["BLOCK", "GGML_BLOCKS", "GGML_TYPE_OF_GRID", "GGMLBlock", "ggml_grid", "pack_blocks"]


@dataclass(frozen=True)
class GGMLBlock:
    """One ggml block type: its values per block and the bytes of its fields, in file order.

    Attributes:
        name: the ggml type name (``gguf.GGMLQuantizationType`` member).
        block: values per block.
        fields: ``(field, bytes)`` in the order a block stores them: ``"d"`` the float16 scale,
            ``"qs"`` the codes as the grid's ``packing`` lays them out.
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


GGML_BLOCKS = {block.name: block for block in (
    GGMLBlock("Q4_0", BLOCK, (("d", 2), ("qs", BLOCK // 2))),
    GGMLBlock("Q8_0", BLOCK, (("d", 2), ("qs", BLOCK))),
)}

# grid name -> ggml type name, read off the grid records.
GGML_TYPE_OF_GRID = {grid.name: grid.ggml_type for grid in GRIDS.values() if grid.ggml_type in GGML_BLOCKS}


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
    fields = {"d": scale.reshape(-1, 1).astype(np.float16).view(np.uint8),
              "qs": pack_block_codes(codes, record, bits)}
    return np.concatenate([fields[name] for name, _ in layout.fields], axis=1).reshape(codes.shape[0], -1)
