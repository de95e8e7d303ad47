"""LoRA adapters for PyTorch and Flax NNX models, composable with QAT: apply, report, merge into the base.

Low-rank adapters (``W x + alpha/rank * B A x``) are trained while the base weights stay frozen;
when the base is fake-quantized by ``apply_qat`` the adapters learn to correct its int grid.
``merge_lora`` folds them into the base weights so ``convert`` can store real int weights.
Nothing here imports torch at import time.
"""

import math
import numbers
from dataclasses import dataclass

from mixle import backends
from mixle._optional import is_available, require
from mixle.core.selection import LayerSelector
from mixle.core.spec import QuantSpec

__all__ = [
    "LoRASpec",
    "LoRALinear",
    "QATLoRALinear",
    "apply_lora",
    "merge_lora",
    "get_lora_report",
    "lora_parameters",
]


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


def apply_lora(model, *, rank, alpha, dropout=0.0, patterns=(".*",), exclude=(), train_base=False,
               adapter_spec=None, quantize_merged=False):
    """Add a trainable low-rank adapter to each selected ``nn.Linear``, in place.

    Each selected layer becomes a ``LoRALinear`` (or a ``QATLoRALinear`` if ``apply_qat``
    already wrapped it) computing ``base(x) + alpha/rank * B(A(dropout(x)))``. It shares the
    base ``weight``/``bias`` Parameters, so base ``state_dict`` keys do not change; the adapter
    adds ``<path>.lora_A`` (rank x in, uniform init) and ``<path>.lora_B`` (out x rank, zeros),
    so the model's outputs are bit-identical to before until the adapter trains. ``apply_qat``
    before or after gives the same layers: the base weight is fake-quantized, the adapter is not
    (unless ``adapter_spec``). Layers whose weight is shared with another module (a head tied to
    an embedding) are skipped, because merging would change the other user of the weight too.
    When the goal is a merged int model, pass ``quantize_merged=True``: requantizing
    ``W + alpha/rank * B @ A`` rounds much of a float adapter's correction away
    (``benchmarks/lora_qat.py`` measures both).

    Flax NNX models (``mixle.flax_backend.lora``): each selected ``nnx.Linear`` becomes a
    ``LoRALinear`` in place (same path and Variables, adapter child ``lora`` with
    ``nnx.LoRAParam`` ``lora_a`` (in x r) and ``lora_b`` (r x out)); ``dropout``,
    ``adapter_spec`` and ``quantize_merged`` are torch only. NNX has no ``requires_grad``: train
    the adapters alone with ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)`` (``train_base``
    changes nothing there).

    Args:
        model: a ``torch.nn.Module``.
        rank: adapter rank r, 1 <= r <= min(in_features, out_features) of every selected layer.
        alpha: the adapter output is scaled by ``alpha / rank``.
        dropout: dropout probability on the adapter input (training mode only).
        patterns: regexes over dotted module paths, matched in full, first match wins (as in
            ``apply_qat``); an entry may be ``(regex, LoRASpec)`` for its own rank/alpha, or
            ``(regex, None)`` to leave those layers without adapter.
        exclude: regexes of module paths never adapted; each must match a module.
        train_base: False (default) sets ``requires_grad=False`` on every parameter of the
            model except the adapters; True leaves every ``requires_grad`` flag as it is.
        adapter_spec: QuantSpec to fake-quantize the adapters too (see ``LoRASpec``).
        quantize_merged: fake-quantize ``W + alpha/rank * B @ A`` as one weight, so training
            sees exactly what merge + convert store (see ``LoRASpec``).

    Returns:
        The model (the replacement if the root itself is an ``nn.Linear``); what was adapted or
        skipped, and why, is ``get_lora_report(model)``.

    Raises:
        ValueError: invalid rank/alpha/dropout, a rank above a selected layer's
            min(in, out), a pattern that matches nothing, no layer left to adapt, or a layer
            that already has an adapter with another spec. The model is then untouched.

    >>> import torch
    >>> net = apply_lora(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), rank=2, alpha=4)
    >>> get_lora_report(net).wrapped, [n for n, p in net.named_parameters() if p.requires_grad]
    (['0', '2'], ['0.lora_A', '0.lora_B', '2.lora_A', '2.lora_B'])
    """
    lora = LoRASpec(rank=rank, alpha=alpha, dropout=dropout, adapter_spec=adapter_spec,
                    quantize_merged=quantize_merged)
    if not isinstance(train_base, bool):
        raise TypeError(f"train_base must be True or False, got {train_base!r}")
    backend = backends.for_model(model, "apply_lora")
    selector = LayerSelector(patterns=patterns, exclude=exclude, default_spec=lora, spec_type=LoRASpec)
    return backend.apply_lora(model, selector, train_base)


def merge_lora(model):
    """Fold every adapter into its base weight and remove the adapters, in place.

    Each adapted layer's weight becomes ``W + (B @ A) * alpha/rank`` (computed in at least
    float32, with the fake-quantized ``A``/``B`` where ``adapter_spec`` is active) and the layer
    goes back to a ``QATWrapper`` (same spec and on/off state) or a plain ``nn.Linear``, sharing
    the same Parameter objects. ``convert(model)`` then stores the merged weights as real ints.
    ``requires_grad`` flags are left as they are.

    Returns:
        The model (the replacement if the root itself was adapted).

    Raises:
        ValueError: the model has no adapters (it is then untouched).

    >>> import torch
    >>> net = apply_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), rank=1, alpha=1)
    >>> type(merge_lora(net)[0]).__name__
    'Linear'
    """
    return backends.for_model(model, "merge_lora").merge_lora(model)


def get_lora_report(model):
    """The report of the last ``apply_lora`` on this model (a ``QATReport`` of adapted layers).

    >>> import torch
    >>> print(get_lora_report(apply_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), rank=2, alpha=2)))  # doctest: +NORMALIZE_WHITESPACE
    path  kind    action   spec         reason
    0     Linear  wrapped  lora r2 a2  matched '.*'
    1 adapted, 0 without adapter
    """
    return backends.for_model(model, "get_lora_report").lora_report(model)


def lora_parameters(model):
    """The adapter Parameters (``lora_A``, ``lora_B`` of every adapted layer), e.g. for an optimizer.

    >>> import torch
    >>> len(lora_parameters(apply_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), rank=1, alpha=1)))
    2
    """
    return backends.for_model(model, "lora_parameters").lora_parameters(model)


class _Unavailable:
    """Stand-in for the LoRA layer classes when torch is missing: constructing one explains."""

    def __init__(self, *args, **kwargs):
        require("torch", extra="torch", purpose="LoRA layers")


def __getattr__(name):
    if name in ("LoRALinear", "QATLoRALinear"):
        if not is_available("torch"):
            return _Unavailable
        from mixle.torch_backend import lora as torch_lora

        return getattr(torch_lora, name)
    raise AttributeError(f"module 'mixle.experimental.program.lora' has no attribute {name!r}")
