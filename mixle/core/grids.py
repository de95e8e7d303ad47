"""Integer grids as data: one record per grid, read by the numerics, the backends and the exports.

A grid says which integer codes exist for each bit width, how a block's scale is derived from
its values, how a value is rounded to a code, in which dtype the scale is stored, how int4 codes
are packed and which backends train on it. Adding a grid is one ``Grid`` entry in ``GRIDS``
(plus its oracle test); nothing else branches on grid names.

Scale rules (``Grid.scale_rule``), per block of values ``w``:

* ``"absmax"``: ``scale = max|w| / divisor``.
* ``"signed_max"``: ``scale = m / divisor`` where ``m`` is the value of largest magnitude with
  its sign (the first one on ties); a negative divisor maps ``m`` to the most negative code.

Rounding rules (``Grid.rounding``):

* ``"half_even"``: ``code = clip(round_half_even(w / scale), code_min, code_max)``.
* ``"half_away"``: ``code = clip(round_half_away_from_zero(w * (1 / scale)), ...)``.
* ``"offset_trunc"``: ``code = clip(trunc(w * (1 / scale) + offset + 0.5), 0, 2 * offset - 1)
  - offset`` with ``offset = -code_min``: ggml's Q4_0 rounding, computed in the block's dtype.

A zero block gets ``Grid.zero_scale`` (1: codes 0 and no division by zero); ``None`` keeps the
computed (signed) zero, as ggml's grids do, whose reciprocal is then 0 too. ``scale_dtype="float16"`` means the scale is *computed* in the
weight's dtype (the codes use that value) and *stored* in float16, and the dequantized weight is
``code * float16(scale)``.

Activations (``QuantSpec.act_bits``): ``Grid.activation_grid`` names the grid the activations
feeding a matmul on this grid are fake-quantized on, in blocks of that grid's ``block`` along the
input axis of each token. llama.cpp's CPU path quantizes the input of every Q4_0/Q8_0 product to
Q8_0 blocks of 32 (ggml's ``quantize_row_q8_0``), so ``q4_0`` and ``q8_0`` name ``"q8_0"``;
``None`` means one scale per token on the weights' own grid.
"""

from dataclasses import dataclass

SCALE_RULES = ("absmax", "signed_max")
ROUNDINGS = ("half_even", "half_away", "offset_trunc")
PACKINGS = ("pairs", "ggml_q4_0")


@dataclass(frozen=True, kw_only=True)
class Grid:
    """One integer grid.

    Attributes:
        name: the ``QuantSpec.grid`` value.
        codes: ``{bits: (code_min, code_max)}``; its keys are the bit widths the grid has.
        divisor: ``{bits: divisor}`` of the scale rule.
        scale_rule: one of ``SCALE_RULES``.
        rounding: one of ``ROUNDINGS``.
        scale_dtype: ``None`` (the weight's own dtype) or ``"float16"``.
        zero_scale: the scale of an all-zero block (None: the computed zero is kept).
        block: a fixed group size the grid imposes (``None``: any granularity).
        activation_grid: the grid (in blocks of its ``block`` along each token's inputs) that
            ``act_bits`` fake-quantizes activations on; ``None``: per token on this grid.
        packing: how two int4 codes share a byte in storage (see ``mixle.core.packing``).
        backends: the backends that train on this grid (the numerics in ``mixle.core.numerics``
            implement every grid; a backend is listed once its layers, kernels and storage do).
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
    backends: tuple = ("torch", "flax")
    summary: str = ""

    def __post_init__(self):
        if set(self.codes) != set(self.divisor):
            raise ValueError(f"grid {self.name!r}: codes and divisor must list the same bit widths")
        if self.scale_rule not in SCALE_RULES or self.rounding not in ROUNDINGS or self.packing not in PACKINGS:
            raise ValueError(f"grid {self.name!r}: unknown rule in {self!r}")

    def activation_record(self):
        """The Grid activations are fake-quantized on (this one when ``activation_grid`` is None).

        >>> GRIDS["q4_0"].activation_record().name, GRIDS["qwix"].activation_record().name
        ('q8_0', 'qwix')
        """
        return self if self.activation_grid is None else GRIDS[self.activation_grid]

    def code_range(self, bits):
        """``(code_min, code_max)`` at ``bits``."""
        return self.codes[bits]

    def is_plain(self):
        """True for the grids every kernel and backend implements: absmax scale, half-even
        rounding, scale kept in the weight's dtype.

        >>> GRIDS["qwix"].is_plain(), GRIDS["q4_0"].is_plain()
        (True, False)
        """
        return (self.scale_rule, self.rounding, self.scale_dtype, self.zero_scale) == ("absmax", "half_even", None, 1.0)


GRIDS = {
    grid.name: grid
    for grid in (
        Grid(name="symmetric", codes={4: (-7, 7), 8: (-127, 127)}, divisor={4: 7.0, 8: 127.0},
             summary="codes -qmax..qmax, scale = absmax / qmax (mixle's default)"),
        Grid(name="qwix", codes={4: (-8, 7), 8: (-128, 127)}, divisor={4: 7.5, 8: 127.5},
             summary="codes -(qmax+1)..qmax, scale = absmax / (qmax + 0.5) (Qwix's grid; also "
                     "compressed-tensors' symmetric int scheme)"),
        Grid(name="q4_0", codes={4: (-8, 7)}, divisor={4: -8.0}, scale_rule="signed_max",
             rounding="offset_trunc", scale_dtype="float16", zero_scale=None, block=32, packing="ggml_q4_0",
             activation_grid="q8_0", backends=("torch",),
             summary="llama.cpp's Q4_0: blocks of 32, scale = signed max / -8 stored as float16"),
        Grid(name="q8_0", codes={8: (-127, 127)}, divisor={8: 127.0}, rounding="half_away",
             scale_dtype="float16", zero_scale=None, block=32, activation_grid="q8_0", backends=("torch",),
             summary="llama.cpp's Q8_0: blocks of 32, scale = absmax / 127 stored as float16"),
    )
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

