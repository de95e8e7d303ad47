"""``nn.Conv1d`` / ``nn.Conv2d``: fake-quantized per output channel, groups along ``in * kernel``.

The weight ``(out, in / groups, *kernel)`` is quantized as the ``(out, in * kernel)`` matrix
(``mixle.core.numerics.quantize_conv_weight``); the codes are stored in that 2-D layout, like a
Linear's, with the kernel shape kept beside them.
"""

import math

import torch.nn.functional as F
from torch import nn

from mixle.core.layer_weights import quantize_conv_weight
from mixle.core.numerics import QuantizedArray, block_shape
from mixle.torch_backend.fake_quant import fake_quantized_weight
from mixle.torch_backend.layers.qat import QATLayerMixin, adopt, check_supported
from mixle.torch_backend.layers.quantized import QuantizedWeight

_CONV_ATTRIBUTES = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "transposed",
                    "output_padding", "groups", "padding_mode", "_reversed_padding_repeated_twice", "weight", "bias")


class QATConvMixin(QATLayerMixin, nn.Module):
    """A convolution whose weight is fake-quantized per output channel while enabled.

    Shares the wrapped layer's Parameters; the forward is the convolution's own
    ``_conv_forward`` with the fake-quantized weight (disabled: with the weight itself).
    """

    def __init__(self, conv, spec, *, enabled=True):
        check_supported(spec)
        block_shape(tuple(conv.weight.shape), spec)  # group_size must divide in * kernel
        nn.Module.__init__(self)
        adopt(self, conv, _CONV_ATTRIBUTES)
        self.spec = spec
        self.enabled = enabled

    @property
    def conv_shape(self):
        """The weight's full shape ``(out, in / groups, *kernel)``."""
        return tuple(self.weight.shape)

    @property
    def reversed_padding(self):
        return tuple(self._reversed_padding_repeated_twice)

    def quantized_weight(self):
        """The fake-quantized weight (STE gradient), shaped like the weight."""
        return fake_quantized_weight(self.weight, self.spec)[0]

    def forward(self, x):
        return self._conv_forward(x, self.quantized_weight() if self.enabled else self.weight, self.bias)


class QATConv1d(QATConvMixin, nn.Conv1d):
    """``nn.Conv1d`` with a fake-quantized weight (see ``QATConvMixin``)."""


class QATConv2d(QATConvMixin, nn.Conv2d):
    """``nn.Conv2d`` with a fake-quantized weight.

    >>> from mixle.core.spec import QuantSpec
    >>> QATConv2d(nn.Conv2d(3, 4, 3), QuantSpec(bits=8)).weight.shape
    torch.Size([4, 3, 3, 3])
    """


_QAT_OF = {nn.Conv1d: QATConv1d, nn.Conv2d: QATConv2d}


def wrap_conv(conv, spec, enabled):
    """The QAT layer for ``nn.Conv1d``/``nn.Conv2d`` ``conv`` (sharing its Parameters)."""
    cls = next(qat for base, qat in _QAT_OF.items() if isinstance(conv, base))
    return cls(conv, spec, enabled=enabled)


def quantize_conv_matrix(w, spec):
    """``quantize_conv_weight`` with the codes laid out ``(out, in * kernel)`` for storage."""
    q = quantize_conv_weight(w, spec)
    return QuantizedArray(q.codes.reshape(q.codes.shape[0], -1), q.scale, q.spec, 0, 1)


def _per_dim(value, dims):
    return (int(value),) * dims if isinstance(value, int) else tuple(int(v) for v in value)


class QuantizedConv(QuantizedWeight):
    """An inference ``nn.Conv1d``/``nn.Conv2d`` storing integer codes and scales.

    Codes are stored ``(out, in * kernel)`` (as ``QuantizedLinear``'s); the forward reshapes the
    dequantized weight to ``conv_shape`` and runs the same convolution as the QAT layer.

    Args:
        codes, scale, spec: as for ``QuantizedLinear``.
        weight_shape: ``(out, in / groups * prod(kernel))``.
        conv_shape: the convolution weight's shape ``(out, in / groups, *kernel)``.
        stride, padding, dilation, groups, padding_mode, reversed_padding: as for ``nn.Conv2d``.
        bias: float bias of shape ``(out,)`` or None.
        dtype: the replaced weight's float dtype (default: the scales', see ``QuantizedWeight``).

    >>> import torch
    >>> from mixle.core.spec import QuantSpec
    >>> from mixle.torch_backend.layers.quantized import to_storage
    >>> codes, scale, _ = to_storage(quantize_conv_matrix(torch.randn(4, 3, 2, 2), QuantSpec(bits=8)))
    >>> layer = QuantizedConv(codes, scale, QuantSpec(bits=8), (4, 12), conv_shape=(4, 3, 2, 2))
    >>> tuple(layer(torch.ones(1, 3, 5, 5)).shape)
    (1, 4, 4, 4)
    """

    KIND = "conv"

    def __init__(self, codes, scale, spec, weight_shape, bias=None, *, conv_shape, stride=1, padding=0,
                 dilation=1, groups=1, padding_mode="zeros", reversed_padding=None, dtype=None):
        super().__init__()
        self._set_storage(codes, scale, spec, weight_shape, dtype)
        conv_shape = tuple(int(d) for d in conv_shape)
        if len(conv_shape) not in (3, 4) or (conv_shape[0], math.prod(conv_shape[1:])) != self.weight_shape:
            raise ValueError(f"QuantizedConv: conv_shape {conv_shape} does not hold a {list(self.weight_shape)} "
                             f"weight as (out, in / groups, *kernel) of a 1-D or 2-D convolution")
        if bias is not None and (not bias.is_floating_point() or tuple(bias.shape) != (conv_shape[0],)):
            raise ValueError(f"QuantizedConv: bias must be a float tensor of shape ({conv_shape[0]},), got {bias!r:.80}")
        self.conv_shape = conv_shape
        dims = len(conv_shape) - 2
        self.stride, self.dilation = _per_dim(stride, dims), _per_dim(dilation, dims)
        self.padding = padding if isinstance(padding, str) else _per_dim(padding, dims)
        self.groups, self.padding_mode = int(groups), padding_mode
        self.reversed_padding = None if reversed_padding is None else tuple(reversed_padding)
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x):
        conv = F.conv1d if len(self.conv_shape) == 3 else F.conv2d
        weight = self.dequantized_weight().view(self.conv_shape)
        if self.padding_mode != "zeros":  # as nn.Conv's _conv_forward
            zero = (0,) * (len(self.conv_shape) - 2)
            return conv(F.pad(x, self.reversed_padding, mode=self.padding_mode), weight, self.bias, self.stride,
                        zero, self.dilation, self.groups)
        return conv(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self):
        return (f"conv_shape={list(self.conv_shape)}, stride={self.stride}, padding={self.padding}, "
                f"groups={self.groups}, bias={self.bias is not None}, {self._storage_repr()}")
