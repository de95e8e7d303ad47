"""The fake-quant engine's paths: which numerics quantize a weight, and rebuilding it from a kept entry.

One weight (``quantize``) runs, in this order: ggml's importance-weighted search (with an
importance), ``fused_ggml``'s kernels (llama.cpp's grids and nf4 on float32/bfloat16 CPU weights),
the grid's own block numerics (``BLOCK_NUMERICS``), ``fused_cpu``'s kernels (the plain grids on
contiguous float32/float64/bfloat16 CPU weights), else the torch ops of ``mixle.core.numerics``;
every path gives the same bits. ``rebuild`` gives the fake-quantized weight again from what an
``_Entry`` kept (codes and scales, or scales alone). The cache (``cache``), the buffer pool
(``buffers``) and the autograd nodes (``autograd``) decide when these run.
"""

import torch

from mixle.torch_backend import fused_ggml as _fused_ggml
from mixle.torch_backend.kernels import fused_cpu as _fused_cpu
from mixle.core.array_ops import TorchOps, array_ops
from mixle.core.checks import ScaleOverflowError, check_block_max, not_finite_error, require_finite
from mixle.core.stored import block_quantized_array, check_dequantized_range
from mixle.core.numerics import (
    NARROW_FLOATS,
    QuantizedArray,
    block_shape,
    block_stats,
    check_scale_range,
    dequantize_array,
    fake_quant_forward,
    round_codes,
    stored_scale,
)

__all__ = ["BLOCK_NUMERICS", "numerics_input", "quantize", "rebuild", "ggml_fused", "writes_operand", "clip_mask_grad"]

_OPS = TorchOps()
# Weights whose grid numerics run in float32 (see numerics_input).
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def numerics_input(x):
    """``x`` as the grid numerics see it: bfloat16/float16 in float32, other dtypes as they are.

    >>> numerics_input(torch.ones(2, dtype=torch.bfloat16)).dtype
    torch.float32
    """
    return x.float() if x.dtype in _LOW_PRECISION else x


def _narrow(x):
    """The 16-bit dtype name x's values are rounded to from the float32 numerics, or None."""
    name = _OPS.dtype_name(x)
    return name if name in NARROW_FLOATS else None


def _check_no_bad_blocks(nonfinite, overflow, x, scale, spec):
    """The fused kernel's counts of blocks holding NaN or infinity and of blocks that would
    dequantize to infinity (``check_scale_range``'s rule, on the scales it computed) must be 0."""
    if torch.compiler.is_compiling():
        torch._assert_async(nonfinite == 0, str(not_finite_error(x, "weight")))
        torch._assert_async(overflow == 0, f"weight: on {spec.short()} a block scale times the grid's largest level "
                                           f"overflows {x.dtype}, so a finite weight would dequantize to infinity: "
                                           f"rescale the weights (e.g. halve them and double what they feed)")
    elif int(nonfinite):
        raise not_finite_error(x, "weight")
    elif int(overflow):
        check_dequantized_range(scale, spec, "weight", _narrow(x))  # raises, with the worst scale
        raise ScaleOverflowError(f"weight: on {spec.short()} {int(overflow)} block(s) would dequantize to infinity "
                                 f"in {x.dtype}: rescale the weights (e.g. halve them and double what they feed)")


class _Entry:
    """One version of one weight, quantized: scales, clip thresholds (for clip_gradient) and,
    once the version is reused, the int8 codes and the weight's fingerprint.

    ``scale`` is the scale as stored (what codes are multiplied by); ``code_scale`` the one the
    codes were rounded with, when it differs (grids whose scale is stored in float16, such as
    llama.cpp's: codes use the unrounded scale), else None."""

    __slots__ = ("key", "spec", "scale", "threshold", "codes", "code_scale", "offset", "fingerprint", "importance")

    def __init__(self, key, spec, scale, threshold, codes, code_scale=None, offset=None, importance=None):
        self.key, self.spec, self.scale, self.threshold, self.codes = key, spec, scale, threshold, codes
        self.code_scale = code_scale
        self.offset = offset  # ``_fused_ggml``'s entries: per sub-block, value = code * scale + offset
        self.fingerprint = None
        self.importance = importance  # the importance its codes were searched with (a float32 tensor), or None


def _blocks(x, spec):
    return array_ops(x), x.reshape(block_shape(x.shape, spec))


# Functions plugged in for a grid: grid name -> fn(x in float32 or float64, spec) -> the round trip
# of x, same shape and dtype; they run instead of the grid's own numerics and kernels. A grid whose
# record has block numerics (``Grid.numerics``: offsets, second-level scales, llama.cpp's K-quants)
# and nothing plugged in runs ``_block_round_trip``. Their entries keep no scales: a rebuild runs fn again.
BLOCK_NUMERICS = {}


def _block_round_trip(x, spec):
    return fake_quant_forward(x, spec, name="weight")[0]


def _own_numerics(spec):
    """The block-numerics function that fake-quantizes on ``spec``'s grid, or None (the plain numerics)."""
    plugged = BLOCK_NUMERICS.get(spec.grid)
    if plugged is not None:
        return plugged
    return _block_round_trip if spec.grid_record.numerics is not None else None


def ggml_fused(x, spec, importance=None):
    """Whether ``fused_ggml``'s kernel fake-quantizes x on spec (llama.cpp's grids), with
    ``importance`` when given (its weighted search).

    >>> from mixle.core.spec import QuantSpec
    >>> ggml_fused(torch.ones(2, 32), QuantSpec(bits=4))  # a plain grid: fused_cpu's kernels, not ggml's
    False
    """
    if importance is not None and (spec.grid not in _fused_ggml.WEIGHTED or importance.device.type != "cpu"):
        return False
    return spec.grid not in BLOCK_NUMERICS and not spec.clip_gradient and _fused_ggml.applies_to(x, spec)


def _quantize_weighted(x, spec, key, importance, out):
    """``quantize`` with an importance: ggml's weighted search (``quantize_array(x, spec,
    importance=)``, bit for bit, then cast to x's dtype), by ``_fused_ggml``'s kernel where it
    applies (its entry keeps the codes: a rebuild would repeat the search), else by the torch
    numerics (its entry keeps nothing; a rebuild runs them again)."""
    if ggml_fused(x, spec, importance):
        deq, codes, a, b, nonfinite, overflow = _fused_ggml.fake_quant(x, spec, want_codes=True, out=out,
                                                                       importance=importance)
        if nonfinite:
            raise not_finite_error(x, "weight")
        if not overflow:
            shape = block_shape(x.shape, spec)
            shape = (shape[0], shape[1], a.numel() // (shape[0] * shape[1]))
            return deq, _Entry(key, spec, a.reshape(shape), None, codes, offset=None if b is None else b.reshape(shape),
                               importance=importance)
    check_block_max(x.detach().abs().amax(), x, "weight")  # the search would turn a NaN into codes
    q = block_quantized_array(numerics_input(x.detach()), spec, importance=importance, check=_OPS.readable(x),
                              name="weight")
    deq = q.dequantize().reshape(x.shape).to(x.dtype)
    return deq if out is None else out.copy_(deq), _Entry(key, spec, None, None, None, importance=importance)


def _quantize_ggml(x, spec, key, keep_codes, out):
    """``quantize`` by ``_fused_ggml``'s kernel, or None where a float16 scale overflows (the torch
    numerics then run, and raise their own error)."""
    keep = keep_codes or spec.grid_record.scale_search is not None  # a rebuild would repeat the search
    deq, codes, a, b, nonfinite, overflow = _fused_ggml.fake_quant(x, spec, want_codes=keep, out=out)
    if nonfinite:
        raise not_finite_error(x, "weight")
    if overflow:
        return None
    if not keep:
        return deq, _Entry(key, spec, None, None, None)
    batch, count, width = block_shape(x.shape, spec)
    shape = (batch, count, a.numel() // (batch * count))  # per sub-block (one per block of 32 but on K-quants)
    return deq, _Entry(key, spec, a.reshape(shape), None, codes, offset=None if b is None else b.reshape(shape))


def quantize(x, spec, key=None, keep_codes=False, out=None, importance=None):
    """``(fake-quantized x, entry)`` from scratch; the finiteness check reads the block maxima.
    The fused kernel writes into ``out`` when given (a dead buffer shaped like x). ``importance``:
    the weighted search's (``_quantize_weighted``), or None. An ``out`` in another dtype than x (bfloat16
    for a float32 x) is written by the fused kernels directly (``writes_operand``), else copied into.

    >>> from mixle.core.spec import QuantSpec
    >>> deq, entry = quantize(torch.tensor([[7.0, -3.0]]), QuantSpec(bits=4))
    >>> deq.tolist(), entry.codes is None  # codes are kept only when asked (keep_codes)
    ([[7.0, -3.0]], True)
    """
    if out is not None and out.dtype != x.dtype and not writes_operand(x, spec, importance):
        deq, entry = quantize(x, spec, key, keep_codes, None, importance)
        return out.copy_(deq), entry
    if importance is not None:
        return _quantize_weighted(x, spec, key, importance, out)
    if ggml_fused(x, spec):
        done = _quantize_ggml(x, spec, key, keep_codes, out)
        if done is not None:
            return done
    own = _own_numerics(spec)
    if own is not None:
        # The block searches would turn a NaN into codes: refuse it (a device assert off the host).
        check_block_max(x.detach().abs().amax(), x, "weight")
        deq = own(numerics_input(x), spec).to(x.dtype)
        if x.dtype == torch.float16:  # float16 scales times codes can pass float16's largest value
            require_finite(deq, ScaleOverflowError(f"weight: on grid={spec.grid!r} a block's largest level overflows "
                                                   f"float16, so a finite weight would dequantize to infinity: rescale "
                                                   f"the weights, or quantize a float32 copy"))
        return deq, _Entry(key, spec, None, None, None)
    if _fused_cpu.applies_to(x, spec):
        deq, codes, scale, threshold, nonfinite, overflow = _fused_cpu.fake_quant(
            x, spec, want_codes=keep_codes, want_threshold=spec.clip_gradient, out=out)
        _check_no_bad_blocks(nonfinite, overflow, x, scale, spec)
        return deq, _Entry(key, spec, scale, threshold, codes, None)
    ops, blocks = _blocks(numerics_input(x), spec)
    scale, threshold, block_max = block_stats(ops, blocks, spec, with_max=True)
    check_block_max(block_max, x, "weight")  # a device assert on accelerators and under torch.compile
    codes = round_codes(ops, blocks, scale, spec)
    stored = stored_scale(ops, scale, spec, "weight")
    check_scale_range(ops, stored, spec, "weight", _narrow(x))
    codes_kept = ops.to_int8(codes).reshape(x.shape) if keep_codes else None
    entry = _Entry(key, spec, stored, threshold if spec.clip_gradient else None, codes_kept,
                   None if stored is scale else scale)
    return codes.mul_(stored).reshape(x.shape).to(x.dtype), entry


def rebuild(entry, x, keep_codes=False, out=None):
    """The fake-quantized weight of an entry: from its int8 codes, else from x and its scales;
    written into ``out`` (shaped like x; in x's dtype, or bfloat16 for a float32 x) when given.

    >>> from mixle.core.spec import QuantSpec
    >>> x = torch.tensor([[0.7, -0.35]])
    >>> deq, entry = quantize(x, QuantSpec(bits=4), keep_codes=True)
    >>> torch.equal(rebuild(entry, x), deq)
    True
    """
    fused = _fused_cpu.applies_to(x, entry.spec)
    if entry.scale is None:  # a grid of BLOCK_NUMERICS, or fused on llama.cpp's grids without codes kept
        deq = quantize(x, entry.spec, out=out, importance=entry.importance)[0]
    elif entry.codes is not None and _is_ggml(entry):
        offset = None if entry.offset is None else entry.offset.reshape(-1)
        return _fused_ggml.dequantize(entry.codes, entry.scale.reshape(-1).float(), offset,
                                      x.dtype if out is None else out.dtype, out=out, grid=entry.spec.grid)
    elif entry.codes is not None:
        if fused:
            return _fused_cpu.dequantize(entry.codes, entry.scale, entry.spec, out=out, dtype=x.dtype,
                                         weight_dtype=x.dtype)
        deq = dequantize_array(QuantizedArray(entry.codes, entry.scale, entry.spec)).to(x.dtype)
    elif fused:  # rounded with the scale the codes were computed with (float32 for a bf16 weight)
        code_scale = entry.scale if entry.code_scale is None else entry.code_scale
        deq, entry.codes, *_ = _fused_cpu.fake_quant(x, entry.spec, scale=code_scale,
                                                     want_codes=keep_codes, out=out)
        return deq
    else:
        ops, blocks = _blocks(numerics_input(x), entry.spec)
        code_scale = entry.scale if entry.code_scale is None else entry.code_scale
        codes = round_codes(ops, blocks, code_scale, entry.spec)
        if keep_codes:
            entry.codes = ops.to_int8(codes).reshape(x.shape)
        deq = codes.mul_(entry.scale).reshape(x.shape).to(x.dtype)
    return deq if out is None or deq is out else out.copy_(deq)


def _is_ggml(entry):
    """An entry of ``_fused_ggml``'s kernel: codes times a scale per sub-block (plus an offset on
    grids with a min), rounded with no other scale (the torch path's q4_0 / q8_0 entries keep one)."""
    return entry.spec.grid_record.kernel is not None and entry.code_scale is None


def clip_mask_grad(grad, x, spec, threshold, out=None):
    """The clip_gradient STE's gradient: ``grad`` where ``|w| <= threshold`` per block, else 0;
    the fused kernel writes it into ``out`` when given (which may be ``grad`` itself).

    >>> from mixle.core.spec import QuantSpec
    >>> clip_mask_grad(torch.ones(1, 2), torch.tensor([[1.0, 3.0]]), QuantSpec(bits=4), torch.tensor([[[2.0]]])).tolist()
    [[1.0, 0.0]]
    """
    # Under backward(create_graph=True) the product must stay differentiable: torch ops then.
    if (not torch.is_grad_enabled() and _fused_cpu.applies_to(x, spec) and grad.dtype == x.dtype
            and grad.device == x.device):
        return _fused_cpu.clip_mask_grad(grad, x, threshold, spec, out=out)
    _, blocks = _blocks(x, spec)
    return grad * (abs(blocks) <= threshold).reshape(x.shape)




def writes_operand(x, spec, importance=None):
    """Whether a fused kernel fake-quantizes x (float32) straight into bfloat16: llama.cpp's grids'
    (``fused_ggml``) or the plain grids' (``kernels.fused_cpu``), which write the values the cast would give.

    >>> from mixle.core.spec import QuantSpec
    >>> writes_operand(torch.ones(2, 32), QuantSpec(bits=4)) == _fused_cpu.applies_to(torch.ones(2, 32), QuantSpec(bits=4))
    True
    """
    return ggml_fused(x, spec, importance) or (importance is None and _fused_cpu.applies_to(x, spec))


