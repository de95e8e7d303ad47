"""Dynamic activation fake-quant for the torch backend (``QuantSpec.act_bits``).

Every token (each vector along the last axis of a Linear's input) gets its own range, computed
from the token itself at run time. On llama.cpp's grids (a grid whose ``activation_grid`` is
set) the activations take exactly the form llama.cpp's CPU path gives the input of the product,
along each token's inputs:

* Q8_0 blocks of 32 (``q4_0``, ``q8_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``mxfp4``): ``d = max|x| / 127``
  in the activations' dtype, code ``round_half_away(x * (1/d))`` (ggml's reference
  ``quantize_row_q8_0``, which gguf-py's Q8_0 quantizer reproduces; ``QuantSpec.act_rounding``
  picks the x86 or ARM builds' rounding instead) or 0 where d is 0, scale stored as
  ``float16(d)``, value ``code * float16(d)``; a scale above float16's range is an error;
* Q8_K blocks of 256 (the K-quants; ``quantize_row_q8_K``): ``m`` the block's first value of
  largest magnitude, ``inverse = -127 / m``, code ``min(127, nearest_int(x * inverse))`` (round
  half to even), value ``code * (1 / inverse)`` in float32; a block of zeros (or one whose
  ``inverse`` overflows) comes back as zeros.

On the other grids:

* symmetric (``act_symmetric=True``, the default): the weights' grid at ``act_bits``:
  ``scale = absmax / divisor``, codes ``round(x / scale)`` clipped to ``[code_min, code_max]``
  (``-127..127`` for int8 on the symmetric grid, ``-128..127`` with divisor 127.5 on ``"qwix"``,
  which is what the Flax backend does through Qwix);
* asymmetric (``act_symmetric=False``, torchao's 8da4w activations): codes
  ``qmin..qmax = -2^(b-1)..2^(b-1)-1``, ``lo = min(min x, 0)``, ``hi = max(max x, 0)``,
  ``scale = max((hi - lo) / (qmax - qmin), eps32)``, ``zero = clip(qmin - round(lo / scale), qmin,
  qmax)``, ``q = clip(round(x / scale) + zero, qmin, qmax)``, value ``(q - zero) * scale``.

A token of zeros keeps scale 1 (symmetric) or eps (asymmetric) and comes back as zeros.
bfloat16/float16 activations (a bf16 model, autocast) are quantized in float32, as the weights
are, and the result is cast back to their dtype; nothing waits for a device (a float16-overflowing
Q8_0 scale on an accelerator is an asynchronous device assert). The
backward is the straight-through estimator (identity): the range follows the data, so nothing
is clipped except by rounding. The same function runs in the QAT layer and in the converted
``QuantizedLinear``, so ``convert`` computes exactly what training saw.

No fused CPU kernel: the per-token pass is three elementwise ops and two row reductions over
the activations, which torch runs vectorised; ``benchmarks/overhead.py`` measures its cost.
"""

import torch

from mixle.core.checks import ScaleOverflowError
from mixle.core.array_ops import array_ops
from mixle.core.numerics import PRODUCT_INPUT_ROUNDINGS, fake_quant_forward
from mixle.core.spec import ACTIVATION_FIELDS, QuantSpec

__all__ = ["fake_quant_activations", "check_activation_spec", "ACTIVATION_FIELDS"]


def check_activation_spec(spec):
    """Refuse activation settings the torch backend cannot honour (with the reason).

    >>> from mixle.core.spec import QuantSpec
    >>> check_activation_spec(QuantSpec(bits=4, act_bits=8))
    >>> check_activation_spec(QuantSpec(bits=4, grid="q4_0", act_bits=4))
    Traceback (most recent call last):
    ValueError: act_bits=4 with grid='q4_0': its activations are quantized on grid 'q8_0' (llama.cpp's Q8_0: blocks of 32, scale = absmax / 127 stored as float16), which has no 4-bit codes: use act_bits=8
    """
    if spec.act_bits is None:
        return
    grid = spec.grid_record
    act = grid.activation_record()
    if spec.act_bits not in act.codes:
        if act is grid:
            raise ValueError(f"act_bits={spec.act_bits} has no codes on grid={spec.grid!r} ({grid.summary})")
        raise ValueError(
            f"act_bits={spec.act_bits} with grid={spec.grid!r}: its activations are quantized on grid {act.name!r} "
            f"({act.summary}), which has no {spec.act_bits}-bit codes: use act_bits={' or '.join(map(str, act.codes))}"
        )
    if not spec.act_symmetric and act.block is not None:
        raise ValueError(
            f"act_symmetric=False with grid={spec.grid!r}: its activations take llama.cpp's symmetric {act.name} "
            f"blocks ({act.summary}); drop act_symmetric"
        )


def _symmetric(x, bits, grid):
    lo, hi = grid.code_range(bits)
    absmax = x.abs().amax(dim=-1, keepdim=True)
    # A divisor on the device: CUDA divides by a host scalar as a product with its reciprocal.
    divisor = torch.full((), grid.divisor[bits], dtype=absmax.dtype, device=absmax.device)
    scale = torch.where(absmax > 0, absmax / divisor, torch.ones_like(absmax))
    return torch.clamp(torch.round(x / scale), lo, hi) * scale


def _asymmetric(x, bits):
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    lo = torch.clamp(x.amin(dim=-1, keepdim=True), max=0)
    hi = torch.clamp(x.amax(dim=-1, keepdim=True), min=0)
    scale = torch.clamp((hi - lo) / (qmax - qmin), min=torch.finfo(torch.float32).eps)
    zero = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax)
    codes = torch.clamp(torch.round(x / scale) + zero, qmin, qmax)
    return (codes - zero) * scale


_BLOCK_SPECS = {}  # (grid, bits) -> QuantSpec; a plain dict, which torch.compile reads as a constant


def _block_spec(grid, bits):
    spec = _BLOCK_SPECS.get((grid, bits))
    if spec is None:
        spec = _BLOCK_SPECS[grid, bits] = QuantSpec(bits=bits, grid=grid)
    return spec


def _check_width(x, grid):
    width = x.shape[-1]
    if width % grid.block:
        raise ValueError(f"activations with {width} inputs per token do not split into {grid.name} blocks of "
                         f"{grid.block}: the layer's input size must be a multiple of {grid.block}")
    return width


def _grid_blocks(rows, spec, grid):
    return fake_quant_forward(rows, _block_spec(grid.name, spec.act_bits), out_ndim=1)[0]


def _blocks(x, spec, grid):
    """Blocks of ``grid.block`` along each token's inputs on the activation grid ``grid``."""
    width = _check_width(x, grid)
    try:
        rows = x.reshape(-1, width)
        rule = PRODUCT_INPUT_ROUNDINGS.get((grid.scale_rule, grid.rounding))
        out = _grid_blocks(rows, spec, grid) if rule is None else rule(array_ops(rows), rows, spec, grid, "activations")
    except ScaleOverflowError:
        largest = float(x.detach().abs().amax())
        if not torch.isfinite(x).all():
            raise ValueError("the activations contain NaN or infinity: training diverged (lower the learning "
                             "rate) or the input is corrupt") from None
        bits = spec.act_bits
        raise ValueError(
            f"the activations reach {largest:.6g}: their {grid.name} block scale (max / {grid.divisor[bits]:g}) "
            f"does not fit float16, so llama.cpp would compute infinity; keep activations below "
            f"{grid.divisor[bits] * 65504:.6g} (e.g. normalise the input) or leave act_bits=None"
        ) from None
    return out.reshape(x.shape)


def quantize_dequantize_activations(x, spec):
    """The quantize-dequantize of ``x`` under ``spec`` (no gradient rule): per token, or in
    llama.cpp's Q8_0 / Q8_K blocks on its grids.

    >>> from mixle.core.spec import QuantSpec
    >>> quantize_dequantize_activations(torch.tensor([[1.0, -0.5, 0.25]]), QuantSpec(bits=4, act_bits=8)).tolist()
    [[1.0, -0.5039370059967041, 0.25196850299835205]]
    >>> x = torch.linspace(-1, 1, 64)[None]
    >>> y = quantize_dequantize_activations(x, QuantSpec(bits=4, grid="q4_0", act_bits=8))
    >>> round(float(y[0, 0]), 6), round(float(y[0, 1]), 6)  # codes -127, -123 times float16(1 / 127)
    (-0.999939, -0.968445)
    """
    act = spec.grid_record.activation_record()
    work = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    if act.block is not None:
        out = _blocks(work, spec, act)
    elif spec.act_symmetric:
        out = _symmetric(work, spec.act_bits, spec.grid_record)
    else:
        out = _asymmetric(work, spec.act_bits)
    return out.to(x.dtype)


class _STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec):
        return quantize_dequantize_activations(x, spec)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_quant_activations(x, spec):
    """``x`` fake-quantized at ``spec.act_bits`` (per token, or llama.cpp's Q8_0 / Q8_K blocks on
    its grids) with a straight-through gradient.

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
