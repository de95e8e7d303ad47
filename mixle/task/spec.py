"""QuantSpec: the one description of how weights are quantized, shared by every backend."""

import math
import numbers
import dataclasses
from dataclasses import dataclass

GRIDS = ("symmetric", "qwix")
GRANULARITIES = ("tensor", "channel", "group")
SUPPORTED_BITS = (4, 8)


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """What to quantize and how; validated on construction, immutable, hashable.

    Args:
        bits: integer width of the codes, 4 or 8.
        grid: ``"symmetric"`` (codes -qmax..qmax, scale = absmax / qmax; mixle's default) or
            ``"qwix"`` (codes -2^(b-1)..2^(b-1)-1, scale = absmax / (qmax + 0.5); Qwix's grid).
        granularity: ``"tensor"`` (one scale), ``"channel"`` (one scale per output row; the
            default) or ``"group"`` (one scale per ``group_size`` consecutive inputs of a row).
            Left as ``None`` it is ``"group"`` when ``group_size`` is given, else ``"channel"``.
        group_size: inputs per scale for ``granularity="group"``; must divide the input size.
        clip_percentile: if set, the scale comes from this percentile of ``|w|`` (computed per
            tensor, row or group) instead of the maximum; values beyond it saturate.
        clip_gradient: the straight-through estimator passes no gradient to weights clipped
            by ``clip_percentile`` (requires it).

    >>> QuantSpec(bits=4, group_size=32)
    QuantSpec(bits=4, grid='symmetric', granularity='group', group_size=32, clip_percentile=None, clip_gradient=False)
    """

    bits: int = 4
    grid: str = "symmetric"
    granularity: str | None = None
    group_size: int | None = None
    clip_percentile: float | None = None
    clip_gradient: bool = False

    def __post_init__(self):
        if not _is_int(self.bits):
            raise TypeError(f"bits must be an int (4 or 8), got {self.bits!r} of type {type(self.bits).__name__}")
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits={self.bits!r} is not supported: use bits=4 or bits=8")
        object.__setattr__(self, "bits", int(self.bits))
        if self.grid not in GRIDS:
            raise ValueError(f"grid={self.grid!r} is unknown: use one of {GRIDS}")
        granularity = self.granularity
        if granularity is None:
            granularity = "group" if self.group_size is not None else "channel"
            object.__setattr__(self, "granularity", granularity)
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity={granularity!r} is unknown: use one of {GRANULARITIES}")
        if granularity == "group":
            if self.group_size is None:
                raise ValueError("granularity='group' needs group_size: pass e.g. group_size=32")
            if not _is_int(self.group_size):
                raise TypeError(f"group_size must be a positive int, got {self.group_size!r}")
            if self.group_size <= 0:
                raise ValueError(f"group_size={self.group_size!r} must be a positive int, e.g. 32")
            object.__setattr__(self, "group_size", int(self.group_size))
        elif self.group_size is not None:
            raise ValueError(
                f"group_size={self.group_size!r} only applies to granularity='group', "
                f"not granularity={granularity!r}: drop group_size or use granularity='group'"
            )
        p = self.clip_percentile
        if p is not None:
            if not _is_real(p):
                raise TypeError(f"clip_percentile must be a number in (0, 100] or None, got {p!r}")
            if not (math.isfinite(p) and 0 < p <= 100):
                raise ValueError(
                    f"clip_percentile={p!r} is out of range: use a value in (0, 100], e.g. 99.9, "
                    f"or None for no clipping"
                )
            object.__setattr__(self, "clip_percentile", float(p))
        if not isinstance(self.clip_gradient, bool):
            raise TypeError(f"clip_gradient must be True or False, got {self.clip_gradient!r}")
        if self.clip_gradient and p is None:
            raise ValueError(
                "clip_gradient=True masks the gradient of weights clipped by clip_percentile, "
                "but clip_percentile is None: set clip_percentile (e.g. 99.9) or clip_gradient=False"
            )

    @property
    def qmax(self):
        """Largest positive code: 7 for int4, 127 for int8."""
        return 2 ** (self.bits - 1) - 1

    @property
    def code_min(self):
        """Smallest code: -qmax on the symmetric grid, -(qmax + 1) on the qwix grid."""
        return -self.qmax if self.grid == "symmetric" else -self.qmax - 1

    @property
    def code_max(self):
        """Largest code (qmax on both grids)."""
        return self.qmax

    @property
    def scale_divisor(self):
        """absmax / scale_divisor is the scale: qmax (symmetric) or qmax + 0.5 (qwix)."""
        return float(self.qmax) if self.grid == "symmetric" else self.qmax + 0.5

    def replace(self, **changes):
        """A copy with some fields changed, validated again.

        >>> QuantSpec(bits=4).replace(bits=8).bits
        8
        """
        return dataclasses.replace(self, **changes)

    def short(self):
        """A compact label such as ``int4/channel/symmetric``.

        >>> QuantSpec(bits=4, group_size=32, clip_percentile=99.5).short()
        'int4/group32/symmetric/p99.5'
        """
        gran = f"group{self.group_size}" if self.granularity == "group" else self.granularity
        label = f"int{self.bits}/{gran}/{self.grid}"
        if self.clip_percentile is not None:
            label += f"/p{self.clip_percentile:g}"
        return label
