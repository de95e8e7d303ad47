"""Learned weight scales (``QuantSpec.scale="learned"``) for the torch QAT layers.

Each QAT layer with a learned-scale spec holds one trainable Parameter,
``weight_log2_scale`` (state_dict key ``<layer path>.weight_log2_scale``), of shape ``(1, S, 1)``:
the base-2 log of each block's scale, blocks as in ``mixle.core.numerics.block_shape`` (one per
output row for ``channel``, one per ``group_size`` inputs for ``group``, one for ``tensor``). It
starts from the weight's statistics, ``log2(absmax / divisor)`` (the grid's fixed rule; a block of
zeros starts at scale 1), so step 0 computes what fixed-scale QAT computes. The forward is

    s = 2 ** weight_log2_scale;  codes = clip(round(w / s), code_min, code_max);  w_q = codes * s

and the backward is LSQ's (Esser et al. 2020, "Learned Step Size Quantization"):
``d w_q / d w = 1`` inside the grid, 0 where clipped; ``d w_q / d s = round(w/s) - w/s`` inside,
the clipping code outside; chained through the log2 domain of TQT (Jain et al. 2020, "Trained
Quantization Thresholds"): ``d/d log2 s = ln 2 * s * d/ds``. Training the log of the scale makes
an Adam step a *relative* change of the scale, whatever its magnitude, which is what LSQ's
gradient scale ``g = 1/sqrt(N qmax)`` approximates for SGD; with Adam ``g`` would cancel out, so it
is not applied. Optimise these parameters without weight decay (decay would pull log2 s, not s,
toward 0): ``param_groups`` splits them out.

The scales are float32 Parameters whatever the weight's dtype (a bfloat16 log2 scale near -6
would lose a 1e-3 step), kept so by ``Module.to``; a bfloat16/float16 weight's codes are computed
in float32 and multiplied by the float32 ``s``, as ``convert`` stores it, each value rounded once to
the weight's dtype.

A weight tied to another layer (the LM head and its embedding) has one scale Parameter shared by
both layers. ``convert`` stores ``codes`` and ``s`` computed by ``quantized_array`` here, the same
float ops as the forward, so the converted model equals the fake-quant model bit for bit, and
``save_quantized`` writes exactly the trained scales.
"""

import math
import weakref

import torch
from torch import nn

from mixle.core.numerics import QuantizedArray, block_shape
from mixle.torch_backend.fake_quant import numerics_input

__all__ = ["SCALE_PARAMETER", "attach", "learned_weight", "quantized_array", "param_groups", "is_learned",
           "precise_scales", "restore_precision"]

SCALE_PARAMETER = "weight_log2_scale"
# id(weight Parameter) -> (weak reference to it, its scale Parameter), so tied layers share one scale
# (tensors compare elementwise, so they cannot key a WeakKeyDictionary).
_SHARED = {}


def is_learned(spec):
    """True when ``spec`` asks for learned scales."""
    return getattr(spec, "scale", "absmax") == "learned"


def _blocks_shape(weight, spec):
    return block_shape(tuple(weight.shape), spec, 0, 1)


def initial_log2_scale(weight, spec):
    """``log2(absmax / divisor)`` per block of ``weight`` (0 for an all-zero block), shape ``(1, S, 1)``.

    >>> from mixle.core.spec import QuantSpec
    >>> initial_log2_scale(torch.tensor([[7.0, -1.0], [0.0, 0.0]]), QuantSpec(bits=4, scale="learned")).ravel().tolist()
    [0.0, 0.0]
    """
    blocks = numerics_input(weight.detach()).reshape(_blocks_shape(weight, spec))
    scale = blocks.abs().amax(dim=-1, keepdim=True) / spec.scale_divisor
    return torch.log2(torch.where(scale > 0, scale, torch.ones_like(scale)))


def precise_scales(layer):
    """``layer``'s learned log2 scale Parameter and its data, to restore after a cast (or None).

    >>> precise_scales(nn.Linear(2, 2)) is None
    True
    """
    scale = layer._parameters.get(SCALE_PARAMETER)
    return None if scale is None else (scale, scale.data)


def restore_precision(layer, kept):
    """Undo a cast of the log2 scale to a 16-bit float (``Module.to(torch.bfloat16)``), keeping
    its device; ``kept`` is what ``precise_scales`` returned before the cast.

    >>> from mixle.models.qat import apply_qat
    >>> layer = apply_qat(nn.Linear(4, 2), bits=4, scale="learned").to(torch.bfloat16)  # calls it
    >>> layer.weight.dtype, layer.weight_log2_scale.dtype
    (torch.bfloat16, torch.float32)
    """
    if kept is None:
        return
    scale, before = kept
    scale = layer._parameters.get(SCALE_PARAMETER, scale)
    if scale.dtype in (torch.bfloat16, torch.float16):
        scale.data = before.to(device=scale.device, dtype=torch.float32)
        if scale.grad is not None:
            scale.grad = scale.grad.to(torch.float32)


def attach(layer):
    """Give QAT ``layer`` its ``weight_log2_scale`` Parameter (shared with any layer tied to its weight)."""
    weight = layer.weight
    want = _blocks_shape(weight, layer.spec)
    for key in [k for k, (ref, _, _) in _SHARED.items() if ref() is None]:
        del _SHARED[key]
    ref, version, scale = _SHARED.get(id(weight), (None, None, None))
    # Shared only with a layer wrapped around the same, unchanged weight (a tie in one apply_qat).
    if ref is None or ref() is not weight or version != weight._version or tuple(scale.shape) != (want[0], want[1], 1):
        scale = nn.Parameter(initial_log2_scale(weight, layer.spec))
        _SHARED[id(weight)] = (weakref.ref(weight), weight._version, scale)
    layer.register_parameter(SCALE_PARAMETER, scale)


def _scale_of(layer):
    scale = getattr(layer, SCALE_PARAMETER, None)
    if scale is None:
        raise ValueError(f"{type(layer).__name__} has spec scale='learned' but no {SCALE_PARAMETER} Parameter: "
                         f"wrap the float layer with apply_qat(..., scale='learned') instead of changing .spec")
    return scale


def _codes(blocks, scale, spec):
    scaled = blocks / scale
    return scaled, torch.clamp(torch.round(scaled), spec.code_min, spec.code_max)


class _LearnedFakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, log2_scale, spec):
        scale = torch.exp2(log2_scale)
        _, codes = _codes(numerics_input(weight).reshape(_blocks_shape(weight, spec)), scale, spec)
        ctx.save_for_backward(weight, log2_scale)
        ctx.spec = spec
        return (codes * scale).reshape(weight.shape).to(weight.dtype)

    @staticmethod
    def backward(ctx, grad):
        weight, log2_scale = ctx.saved_tensors
        spec = ctx.spec
        scale = torch.exp2(log2_scale)
        scaled, codes = _codes(numerics_input(weight).reshape(_blocks_shape(weight, spec)), scale, spec)
        inside = (scaled >= spec.code_min) & (scaled <= spec.code_max)
        g = grad.reshape(scaled.shape)
        grad_weight = torch.where(inside, g, torch.zeros_like(g)).reshape(weight.shape).to(weight.dtype)
        step = torch.where(inside, codes - scaled, codes)  # LSQ: d(codes * s)/ds
        grad_scale = (g * step).sum(dim=-1, keepdim=True)
        return grad_weight, (grad_scale * scale * math.log(2.0)).to(log2_scale.dtype), None


def learned_weight(layer):
    """The fake-quantized weight of ``layer`` with its learned scales (LSQ gradients to both).

    >>> from mixle.models.qat import apply_qat
    >>> layer = apply_qat(nn.Linear(4, 2), bits=4, scale="learned")
    >>> learned_weight(layer).shape, tuple(layer.weight_log2_scale.shape)
    (torch.Size([2, 4]), (1, 2, 1))
    """
    return _LearnedFakeQuant.apply(layer.weight, _scale_of(layer), layer.spec)


def quantized_array(layer):
    """Codes and scales of ``layer``'s weight with its trained scales (what ``convert`` stores)."""
    weight, spec = layer.weight.detach(), layer.spec
    scale = torch.exp2(_scale_of(layer).detach())
    _, codes = _codes(numerics_input(weight).reshape(_blocks_shape(weight, spec)), scale, spec)
    return QuantizedArray(codes.to(torch.int8).reshape(weight.shape), scale, spec, 0, 1)


def param_groups(model, params, lr, scale_lr=None, weight_decay=0.01):
    """Optimizer groups: the learned scales (lr ``scale_lr``, no weight decay) and the rest.

    Args:
        model: the model whose ``weight_log2_scale`` Parameters are split out.
        params: the parameters to train (e.g. those a GradLeaf passes its optimizer factory).
        lr: learning rate of the other parameters.
        scale_lr: learning rate of the scales (default ``lr``).
        weight_decay: weight decay of the other parameters.

    >>> from mixle.models.qat import apply_qat
    >>> net = apply_qat(nn.Linear(4, 2), bits=4, scale="learned")
    >>> [len(g["params"]) for g in param_groups(net, list(net.parameters()), 1e-3, 1e-2)]
    [2, 1]
    """
    scales = {id(p) for name, p in model.named_parameters() if name.rsplit(".", 1)[-1] == SCALE_PARAMETER}
    rest = [p for p in params if id(p) not in scales]
    mine = [p for p in params if id(p) in scales]
    groups = [{"params": rest, "lr": lr, "weight_decay": weight_decay}]
    if mine:
        groups.append({"params": mine, "lr": lr if scale_lr is None else scale_lr, "weight_decay": 0.0})
    return groups
