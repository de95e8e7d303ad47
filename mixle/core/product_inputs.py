"""How llama.cpp's CPU builds round a product's input to Q8_0 blocks (``QuantSpec.act_rounding``).

Before it multiplies activations by a Q4_0, Q8_0, Q4_1, Q5_0, Q5_1 or MXFP4 weight, llama.cpp's CPU
backend rounds each token's inputs to Q8_0 blocks of 32: the scale ``d = max|x| / 127`` is stored as
float16 and the codes are ``x`` times an inverse scale, rounded. Its builds compute the codes
differently (ggml-cpu's ``quantize_row_q8_0``, and ``ggml_quantize_mat_q8_0_4x8`` where Q4_0 weights
are repacked), one record each in ``ACT_ROUNDINGS`` (``mixle.core.numerics.round_q8_0_input`` rounds
so):

* ``"reference"``: ggml's scalar ``quantize_row_q8_0_ref`` (builds with neither AVX nor NEON; gguf-py's
  Q8_0 quantizer): ``round_half_away(x * (1 / d))``;
* ``"x86"``: builds with AVX, AVX2 or AVX-512: ``round_half_even(x * (127 / max))``;
* ``"arm"``: builds with NEON: ``round_half_even(x * (1 / d))``.

A code differs between them only where the scaled value is at (or one ulp from) a half. The value is
``code * float16(d)`` in every build. Q8_K (the K-quants' inputs) is rounded the same way by all three.
"""

from dataclasses import dataclass

__all__ = ["ProductInputRounding", "ACT_ROUNDINGS", "act_rounding_named"]

# How the code's multiplier is computed: 1 / (max / 127), or 127 / max.
INVERSES = ("reciprocal", "quotient")
TIES = ("away", "even")


@dataclass(frozen=True, kw_only=True)
class ProductInputRounding:
    """One llama.cpp CPU build's rounding of a product's input to Q8_0 blocks.

    Args:
        name: what ``QuantSpec.act_rounding`` calls it.
        inverse: ``"reciprocal"`` (codes from ``x * (1 / d)``, ``d = max / 127``) or ``"quotient"``
            (``x * (127 / max)``).
        ties: ``"away"`` (round half away from zero, C's ``roundf``) or ``"even"`` (the vector units'
            round to nearest).
        summary: which builds round so, for error messages and docs.

    >>> ProductInputRounding(name="x86", inverse="quotient", ties="even", summary="AVX").ties
    'even'
    """

    name: str
    inverse: str
    ties: str
    summary: str

    def __post_init__(self):
        for field, allowed in (("inverse", INVERSES), ("ties", TIES)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field}={getattr(self, field)!r} is unknown: use one of {allowed}")


ACT_ROUNDINGS = {r.name: r for r in (
    ProductInputRounding(name="reference", inverse="reciprocal", ties="away",
                         summary="ggml's reference C code: builds with neither AVX nor NEON, and gguf-py"),
    ProductInputRounding(name="x86", inverse="quotient", ties="even",
                         summary="llama.cpp built with AVX, AVX2 or AVX-512, on x86-64 CPUs"),
    ProductInputRounding(name="arm", inverse="reciprocal", ties="even",
                         summary="llama.cpp built with NEON, on ARM CPUs such as Apple silicon"),
)}


def act_rounding_named(name):
    """The ``ACT_ROUNDINGS`` record called ``name``; ValueError listing them otherwise.

    >>> act_rounding_named("x86").inverse
    'quotient'
    """
    record = ACT_ROUNDINGS.get(name) if isinstance(name, str) else None
    if record is None:
        known = "; ".join(f"{r.name!r} ({r.summary})" for r in ACT_ROUNDINGS.values())
        raise ValueError(f"act_rounding={name!r} is unknown: use the llama.cpp build you run, one of {known}")
    return record
