"""LoRA adapter configuration (data): rank, alpha, dropout and how adapters meet fake quantization."""

import math
import numbers
from dataclasses import dataclass

from mixle.core.spec import QuantSpec

__all__ = ["LoRASpec"]


@dataclass(frozen=True, kw_only=True)
class LoRASpec:
    """One adapter configuration; validated on construction, immutable, hashable.

    Args:
        rank: inner width r of the adapter (``A`` is r x in, ``B`` is out x r); a positive int.
        alpha: the adapter output is scaled by ``alpha / rank``; a positive number.
        dropout: probability of dropping adapter inputs in training mode, in [0, 1).
        adapter_spec: a QuantSpec to fake-quantize ``A`` and ``B`` with (straight-through
            gradient) wherever the base weight is fake-quantized, toggled with it by
            ``set_fake_quant_enabled``; None (default) keeps the adapter path in float.
        quantize_merged: on a fake-quantized base, fake-quantize the merged weight
            ``W + alpha/rank * B @ A`` as one weight instead of adding a float adapter to the
            quantized ``W``. Training then sees exactly the int weights ``merge_lora`` +
            ``convert`` will store (a float adapter's small correction is largely rounded away
            when the merged weight is requantized), at the cost of a weight-sized gradient per
            layer, as in full QAT. Needs ``dropout=0`` and no ``adapter_spec``.

    >>> LoRASpec(rank=8, alpha=16).scaling
    2.0
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    adapter_spec: QuantSpec | None = None
    quantize_merged: bool = False

    def __post_init__(self):
        rank, alpha, dropout = self.rank, self.alpha, self.dropout
        if not isinstance(rank, numbers.Integral) or isinstance(rank, bool):
            raise TypeError(f"rank must be a positive int such as rank=8, got {rank!r} of type {type(rank).__name__}")
        if rank <= 0:
            raise ValueError(f"rank={rank!r} must be a positive int: use e.g. rank=8")
        object.__setattr__(self, "rank", int(rank))
        if not isinstance(alpha, numbers.Real) or isinstance(alpha, bool):
            raise TypeError(f"alpha must be a positive number such as alpha=16, got {alpha!r}")
        if not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"alpha={alpha!r} must be a finite number > 0: use e.g. alpha=2 * rank")
        if not isinstance(dropout, numbers.Real) or isinstance(dropout, bool):
            raise TypeError(f"dropout must be a number in [0, 1), got {dropout!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout={dropout!r} must be in [0, 1): use e.g. dropout=0.05, or 0 for none")
        if self.adapter_spec is not None and not isinstance(self.adapter_spec, QuantSpec):
            raise TypeError(
                f"adapter_spec must be a mixle QuantSpec or None, got {type(self.adapter_spec).__name__}: "
                f"e.g. adapter_spec=QuantSpec(bits=8)"
            )
        if not isinstance(self.quantize_merged, bool):
            raise TypeError(f"quantize_merged must be True or False, got {self.quantize_merged!r}")
        if self.quantize_merged and (dropout or self.adapter_spec is not None):
            raise ValueError(
                f"quantize_merged=True fake-quantizes W + alpha/rank * B @ A as one weight, which has no "
                f"place for dropout={dropout!r} or adapter_spec={self.adapter_spec!r}: set dropout=0 "
                f"and adapter_spec=None, or quantize_merged=False"
            )

    @property
    def scaling(self):
        """``alpha / rank``, the factor on the adapter output."""
        return self.alpha / self.rank

    def short(self):
        """Compact text for reports, e.g. ``'lora r8 a16'``.

        >>> LoRASpec(rank=4, alpha=8, adapter_spec=QuantSpec(bits=8)).short()
        'lora r4 a8 +int8/channel/symmetric adapters'
        """
        text = f"lora r{self.rank} a{self.alpha:g}"
        if self.dropout:
            text += f" drop{self.dropout:g}"
        if self.adapter_spec is not None:
            text += f" +{self.adapter_spec.short()} adapters"
        if self.quantize_merged:
            text += " merged-fq"
        return text
