"""Dynamic per-token activation fake-quant for the torch backend (``QuantSpec.act_bits``).

Every token (each vector along the last axis of a Linear's input) gets its own range, computed
from the token itself at run time:

* symmetric (``act_symmetric=True``, the default): the weights' grid at ``act_bits``:
  ``scale = absmax / divisor``, codes ``round(x / scale)`` clipped to ``[code_min, code_max]``
  (``-127..127`` for int8 on the symmetric grid, ``-128..127`` with divisor 127.5 on ``"qwix"``,
  which is what the Flax backend does through Qwix);
* asymmetric (``act_symmetric=False``, torchao's 8da4w activations): codes
  ``qmin..qmax = -2^(b-1)..2^(b-1)-1``, ``lo = min(min x, 0)``, ``hi = max(max x, 0)``,
  ``scale = max((hi - lo) / (qmax - qmin), eps32)``, ``zero = clip(qmin - round(lo / scale), qmin,
  qmax)``, ``q = clip(round(x / scale) + zero, qmin, qmax)``, value ``(q - zero) * scale``.

A token of zeros keeps scale 1 (symmetric) or eps (asymmetric) and comes back as zeros. The
backward is the straight-through estimator (identity): the range follows the data, so nothing
is clipped except by rounding. The same function runs in the QAT layer and in the converted
``QuantizedLinear``, so ``convert`` computes exactly what training saw.

No fused CPU kernel: the per-token pass is three elementwise ops and two row reductions over
the activations, which torch runs vectorised; ``benchmarks/overhead.py`` measures its cost.
"""

import torch

from mixle.core.spec import ACTIVATION_FIELDS

__all__ = ["fake_quant_activations", "check_activation_spec", "ACTIVATION_FIELDS"]


def check_activation_spec(spec):
    """Refuse activation settings the torch backend cannot honour (with the reason).

    >>> from mixle.core.spec import QuantSpec
    >>> check_activation_spec(QuantSpec(bits=4, act_bits=8))
    >>> check_activation_spec(QuantSpec(bits=4, grid="q4_0", act_bits=8))
    Traceback (most recent call last):
    ValueError: act_bits=8 with grid='q4_0': llama.cpp quantizes activations in blocks of 32 (Q8_0) inside its own matmul, which the torch backend does not reproduce (it quantizes per token); use grid='symmetric' or 'qwix' for activation fake-quant, or leave act_bits=None
    """
    if spec.act_bits is None:
        return
    grid = spec.grid_record
    if grid.block is not None:
        raise ValueError(
            f"act_bits={spec.act_bits} with grid={spec.grid!r}: llama.cpp quantizes activations in blocks of 32 "
            f"(Q8_0) inside its own matmul, which the torch backend does not reproduce (it quantizes per token); "
            f"use grid='symmetric' or 'qwix' for activation fake-quant, or leave act_bits=None"
        )
    if spec.act_bits not in grid.codes:
        raise ValueError(f"act_bits={spec.act_bits} has no codes on grid={spec.grid!r} ({grid.summary})")


def _symmetric(x, bits, grid):
    lo, hi = grid.code_range(bits)
    absmax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / grid.divisor[bits], torch.ones_like(absmax))
    return torch.clamp(torch.round(x / scale), lo, hi) * scale


def _asymmetric(x, bits):
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    lo = torch.clamp(x.amin(dim=-1, keepdim=True), max=0)
    hi = torch.clamp(x.amax(dim=-1, keepdim=True), min=0)
    scale = torch.clamp((hi - lo) / (qmax - qmin), min=torch.finfo(torch.float32).eps)
    zero = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax)
    codes = torch.clamp(torch.round(x / scale) + zero, qmin, qmax)
    return (codes - zero) * scale


def quantize_dequantize_activations(x, spec):
    """The per-token quantize-dequantize of ``x`` under ``spec`` (no gradient rule).

    >>> from mixle.core.spec import QuantSpec
    >>> quantize_dequantize_activations(torch.tensor([[1.0, -0.5, 0.25]]), QuantSpec(bits=4, act_bits=8)).tolist()
    [[1.0, -0.5039370059967041, 0.25196850299835205]]
    """
    if spec.act_symmetric:
        return _symmetric(x, spec.act_bits, spec.grid_record)
    return _asymmetric(x, spec.act_bits)


class _STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec):
        return quantize_dequantize_activations(x, spec)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_quant_activations(x, spec):
    """``x`` fake-quantized per token at ``spec.act_bits`` with a straight-through gradient.

    Returns ``x`` itself when ``spec.act_bits`` is None.

    >>> from mixle.core.spec import QuantSpec
    >>> x = torch.tensor([[0.3, -1.2, 2.0]], requires_grad=True)
    >>> y = fake_quant_activations(x, QuantSpec(bits=4, act_bits=8, act_symmetric=False))
    >>> y.sum().backward(); x.grad.tolist()
    [[1.0, 1.0, 1.0]]
    """
    if spec.act_bits is None:
        return x
    return _STE.apply(x, spec)
