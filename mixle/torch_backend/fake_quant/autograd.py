"""The fake-quant engine's autograd nodes: the straight-through fake-quant and the QAT linear.

``_FakeQuantSTE`` fake-quantizes a tensor (through the per-weight cache when given one);
``_QATLinear`` is ``F.linear`` on a fake-quantized weight as one node that keeps no float copy of
the weight for backward, rebuilding it there inside a recycled buffer (``buffers``).
"""

import torch
import torch.nn.functional as F

from mixle.core.array_ops import TorchOps
from mixle.core.checks import check_array
from mixle.torch_backend.fake_quant.buffers import spare_buffers, take_buffer
from mixle.torch_backend.fake_quant.cache import cache_of
from mixle.torch_backend.fake_quant.dispatch import clip_mask_grad, ggml_fused, quantize, rebuild, writes_operand
from mixle.torch_backend.kernels import fused_cpu as _fused_cpu

__all__ = ["fake_quantize", "fake_quantized_weight", "linear"]

_OPS = TorchOps()


class _FakeQuantSTE(torch.autograd.Function):
    """Forward: quantize-dequantize. Backward: identity, or masked where percentile-clipped."""

    @staticmethod
    def forward(ctx, x, spec, cache=None, shared=False, importance=None):
        if cache is None:
            deq, entry = quantize(x, spec, importance=importance)
        else:
            deq, entry = cache.lookup(x, spec, shared, importance=importance)
        ctx.spec = spec
        if spec.clip_gradient:
            # The mask is recomputed in backward from x (saved, no copy) and the tiny thresholds.
            ctx.save_for_backward(x)
            ctx.threshold = entry.threshold
        return deq

    @staticmethod
    def backward(ctx, grad):
        if ctx.spec.clip_gradient:
            (x,) = ctx.saved_tensors
            grad = clip_mask_grad(grad, x, ctx.spec, ctx.threshold)
        return grad, None, None, None, None


def fake_quantize(x, spec):
    """Fake-quantize a torch tensor with the straight-through estimator.

    >>> from mixle.core.spec import QuantSpec
    >>> fake_quantize(torch.tensor([0.7, 0.1]), QuantSpec(bits=4)).tolist()
    [0.699999988079071, 0.10000000149011612]
    """
    check_array(x, finite=False)  # type and size; finiteness is read from the block maxima
    return _FakeQuantSTE.apply(x, spec)


def fake_quantized_weight(param, spec, *, shared=False, output_axis=0, importance=None):
    """``(fake-quantized param with STE gradient, entry)``, cached per version of ``param``.

    ``importance`` (a float32 tensor, one value per input column; llama.cpp's grids with a
    weighted search, see ``mixle.gguf.ggml_weighted``): the weight is quantized by ggml's
    importance-weighted search, bit for bit ``quantize_array(param, spec, importance=...)``.

    ``output_axis=1`` (a weight stored ``(in, out)``, e.g. transformers' Conv1D) quantizes and
    returns the ``(out, in)`` transpose. Under ``torch.compile`` the cache is bypassed (the
    compiled graph recomputes and fuses it), and for inference tensors, which have no version
    counter, and for weights on an accelerator (see ``WeightCache.lookup``).
    """
    if param.is_meta:  # no values to quantize: shapes only, as the float layer gives
        return param, None
    check_array(param, "weight", finite=False)
    x = param.t() if output_axis == 1 else param
    if not _OPS.readable(param) or param.is_inference():  # not readable also while compiling
        return _FakeQuantSTE.apply(x, spec, None, False, importance), None
    cache = cache_of(param)
    return _FakeQuantSTE.apply(x, spec, cache, shared, importance), cache.entry


class _QATLinear(torch.autograd.Function):
    """The training QAT linear as one autograd node: ``F.linear(x, fake_quant(weight), bias)``
    with the straight-through weight gradient, saving only x.

    ``F.linear`` on a fake-quantized weight would save that weight for backward, a second copy
    of every weight alive from forward to backward; here backward rebuilds it, just for the
    input gradient, inside the buffer that then receives the weight gradient. Under autocast
    the products run in ``dtype`` (autocast's): the forward's ``F.linear`` casts as autocast
    does, and the backward casts x and the rebuilt weight the same way; where a fused kernel
    writes that cast itself (``_operand_dtype``), the weight is fake-quantized and rebuilt
    straight into it.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, spec, cache, dtype, importance=None):
        if importance is None:
            fused = _fused_cpu.applies_to(weight, spec) or ggml_fused(weight, spec)
        else:
            fused = ggml_fused(weight, spec, importance)
        deq_dtype = _operand_dtype(weight, spec, dtype, importance)
        out = take_buffer(weight, deq_dtype, fused)[0]
        deq, entry = cache.lookup(weight, spec, False, out, importance)
        x_dtype, x = x.dtype, x.to(dtype)  # autocast's cast of x, saved below as autocast saves it
        y = F.linear(x, deq, bias)  # under autocast: the bf16 cast of the fake-quantized weight
        if fused:
            spare_buffers.give(deq, holds=entry)  # dead now: nothing saved it
        del deq
        ctx.weight, ctx.version, ctx.entry, ctx.fused = weight, weight._version, entry, fused
        ctx.dtype, ctx.x_dtype, ctx.bias_dtype = dtype, x_dtype, None if bias is None else bias.dtype
        ctx.deq_dtype = deq_dtype
        if ctx.needs_input_grad[1]:
            ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, grad):
        weight, entry, dtype = ctx.weight, ctx.entry, ctx.dtype
        if weight._version != ctx.version:
            raise RuntimeError(
                "a QAT layer's weight was modified in place between its forward and backward "
                "(one of the variables needed for gradient computation has been modified by an "
                "inplace operation): run backward before changing the weight"
            )
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        flat = grad.reshape(-1, grad.shape[-1])
        if need_w:
            (x,) = ctx.saved_tensors
            x = x.reshape(-1, x.shape[-1])
        if torch.is_grad_enabled():  # backward(create_graph=True): differentiable torch ops
            grad_x = grad.matmul(_FakeQuantSTE.apply(weight, entry.spec, None, False, entry.importance).to(dtype)) \
                if need_x else None
            grad_w = flat.t().mm(x).to(weight.dtype) if need_w else None
        else:
            grad_x, grad_w = _backward_products(ctx, grad, flat, x if need_w else None, need_x)
        if grad_w is not None and entry.spec.clip_gradient:  # grad_w is ours: masked in place
            grad_w = clip_mask_grad(grad_w, weight.detach(), entry.spec, entry.threshold, out=grad_w)
        grad_x = None if grad_x is None else grad_x.to(ctx.x_dtype)
        grad_b = flat.sum(0).to(ctx.bias_dtype) if need_b else None
        return grad_x, grad_w, grad_b, None, None, None, None


def _backward_products(ctx, grad, flat, x, need_x):
    """``(input gradient, weight gradient)`` of ``_QATLinear``, either None where not needed.

    The weight gradient's buffer first holds the fake-quantized weight: one weight-sized
    allocation (and its first-touch page faults) less per layer and step, and no rebuild at all
    for a recycled buffer that still holds it. Where the weight is fake-quantized into autocast's
    bfloat16 (``_operand_dtype``) that buffer is the matmul's operand only, recycled after it.
    """
    weight, entry, dtype, deq_dtype = ctx.weight, ctx.entry, ctx.dtype, ctx.deq_dtype
    buffer = grad_x = grad_w = None
    if need_x:
        buffer, holds = take_buffer(weight, deq_dtype, ctx.fused, holding=entry)
        if not holds:
            buffer = rebuild(entry, weight.detach(), out=buffer)
        grad_x = grad.matmul(buffer.to(dtype))
        if buffer.dtype != weight.dtype:  # the matmul operand alone (autocast): dead now, recycled
            if ctx.fused:
                spare_buffers.give(buffer)
            buffer = None
    if x is not None:
        if buffer is None:
            grad_w = flat.t().mm(x).to(weight.dtype)
        elif dtype == weight.dtype:
            grad_w = torch.mm(flat.t(), x, out=buffer)
        else:  # autocast: the product in its dtype, as F.linear's backward computes it
            grad_w = buffer.copy_(flat.t().mm(x))
    return grad_x, grad_w


def _operand_dtype(weight, spec, dtype, importance):
    """The dtype ``_QATLinear`` fake-quantizes ``weight`` into: autocast's bfloat16 for a float32 weight
    on a kernel that writes it (``writes_operand``: no float32 copy and cast), else the weight's own."""
    if dtype == torch.bfloat16 and weight.dtype == torch.float32 and writes_operand(weight, spec, importance):
        return dtype
    return weight.dtype


def _matmul_dtype(x, weight, bias):
    """The dtype ``F.linear(x, weight, bias)`` multiplies in, for the mixes ``_QATLinear`` takes:
    one dtype without autocast; autocast's from float32 or its own dtype under it. Else None."""
    device = x.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        allowed = (torch.float32, dtype)
    else:
        dtype, allowed = x.dtype, (x.dtype,)
    if x.dtype in allowed and weight.dtype in allowed and (bias is None or bias.dtype in allowed):
        return dtype
    return None


def linear(x, weight, bias, spec, importance=None):
    """``F.linear`` with a fake-quantized ``weight``, keeping no float copy of it for backward.
    ``importance``: as for ``fake_quantized_weight``.

    The quantized weight comes from the per-version cache; training runs as one autograd node
    (``_QATLinear``), under autocast too (the products see autocast's cast of the fake-quantized
    weight, as ``F.linear`` would). Under torch.compile, no-grad or mixed dtypes the stock
    ``F.linear`` runs on the same fake-quantized weight (on meta tensors, which have no values,
    it gives the float layer's shapes).

    >>> from mixle.core.spec import QuantSpec
    >>> w = torch.nn.Parameter(torch.tensor([[0.7, -0.35]]))
    >>> linear(torch.ones(1, 2), w, None, QuantSpec(bits=4)).tolist()
    [[0.29999998211860657]]
    """
    if (torch.compiler.is_compiling() or weight.is_inference() or not torch.is_grad_enabled() or weight.is_meta
            or x.is_meta or (dtype := _matmul_dtype(x, weight, bias)) is None):
        return F.linear(x, fake_quantized_weight(weight, spec, importance=importance)[0], bias)
    check_array(weight, "weight", finite=False)
    return _QATLinear.apply(x, weight, bias, spec, cache_of(weight), dtype, importance)
