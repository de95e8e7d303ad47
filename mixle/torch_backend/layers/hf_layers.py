"""transformers' ``Conv1D`` (GPT-2's projections: a Linear whose weight is stored ``(in, out)``).

mixle never imports transformers itself: a model holding a ``Conv1D`` has already imported
``transformers.pytorch_utils``, so the float type is looked up there when a module is checked,
and the QAT class (a subclass of the real ``Conv1D``, so transformers and PEFT keep treating it
as one) is built on first use.
"""

import sys

import torch
from torch import nn

from mixle.core.numerics import block_shape
from mixle.torch_backend.fake_quant import fake_quantized_weight
from mixle.torch_backend.layers.qat import QATLayerMixin, adopt, check_supported
from mixle.torch_backend.layers.quantized import QuantizedWeight

HF_MODULE, HF_NAME = "transformers.pytorch_utils", "Conv1D"


def _hf_conv1d():
    """transformers' Conv1D class if transformers is loaded, else None."""
    module = sys.modules.get(HF_MODULE)
    return getattr(module, HF_NAME, None)


class _Conv1DType(type):
    """``isinstance(m, Conv1DType)`` is ``isinstance(m, transformers Conv1D)``, without importing it."""

    def __instancecheck__(cls, instance):
        real = _hf_conv1d()
        return real is not None and isinstance(instance, real)

    def __getattr__(cls, name):  # e.g. Conv1DType.forward: the real class's
        real = _hf_conv1d()
        if real is None:
            raise AttributeError(name)
        return getattr(real, name)


class Conv1DType(metaclass=_Conv1DType):
    """Stands for ``transformers.pytorch_utils.Conv1D`` in a layer kind's ``float_types``.

    >>> isinstance(nn.Linear(2, 2), Conv1DType)
    False
    """


class QATConv1DMixin(QATLayerMixin, nn.Module):
    """A Conv1D whose weight is fake-quantized per output channel (per column) while enabled.

    Shares the wrapped layer's ``weight`` and ``bias`` Parameters. Enabled, the forward is
    ``Conv1D.forward`` with the fake-quantized weight: ``addmm(bias, x, fq(weight))``; disabled, it is
    ``Conv1D.forward`` itself (bit for bit).
    """

    def __init__(self, conv, spec, *, enabled=True):
        check_supported(spec)
        block_shape(tuple(conv.weight.shape[::-1]), spec)  # group_size must divide the input size
        nn.Module.__init__(self)
        adopt(self, conv, ("nf", "nx", "weight", "bias"))
        self.spec = spec
        self.enabled = enabled

    def quantized_weight(self):
        """The fake-quantized weight, laid out ``(out, in)`` (a transposed view of the Parameter's)."""
        return fake_quantized_weight(self.weight, self.spec, output_axis=1)[0]

    def forward(self, x):
        if not self.enabled:
            return _hf_conv1d().forward(self, x)
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.quantized_weight().t()).view(size_out)

    def __repr__(self):
        return f"QATConv1D(nf={self.nf}, nx={self.nx}, {self.qat_state()})"


_QAT_CLASS = []


def qat_conv1d_class():
    """``QATConv1D``: the mixin over the loaded transformers ``Conv1D`` (built once)."""
    if not _QAT_CLASS:
        real = _hf_conv1d()
        if real is None:
            raise ImportError("QATConv1D needs transformers.pytorch_utils.Conv1D, which is not loaded")
        cls = type("QATConv1D", (QATConv1DMixin, real), {"__module__": __name__, "__qualname__": "QATConv1D"})
        _QAT_CLASS.append(cls)
    return _QAT_CLASS[0]


def wrap_conv1d(conv, spec, enabled):
    """The QAT layer for transformers ``Conv1D`` ``conv`` (sharing its Parameters)."""
    return qat_conv1d_class()(conv, spec, enabled=enabled)


def __getattr__(name):  # unpickling a QATConv1D finds its class here
    if name == "QATConv1D":
        return qat_conv1d_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class QuantizedConv1D(QuantizedWeight):
    """An inference transformers ``Conv1D`` storing integer codes and scales.

    The codes are laid out ``(out, in)`` like ``QuantizedLinear``'s (one scale row per output
    channel); the forward is ``addmm(bias, x, dequantized.t())``, exactly the QAT forward.

    Args:
        codes, scale, spec: as for ``QuantizedLinear``.
        weight_shape: ``(out, in)`` (the transpose of ``Conv1D.weight``'s shape).
        bias: float bias of shape ``(out,)``.
        dtype: the replaced weight's float dtype (default: the scales', see ``QuantizedWeight``).

    >>> from mixle.core.layer_weights import quantize_linear_weight
    >>> from mixle.core.spec import QuantSpec
    >>> from mixle.torch_backend.layers.quantized import to_storage
    >>> codes, scale, _ = to_storage(quantize_linear_weight(torch.randn(3, 4), bits=8))
    >>> tuple(QuantizedConv1D(codes, scale, QuantSpec(bits=8), (3, 4), torch.zeros(3))(torch.ones(2, 5, 4)).shape)
    (2, 5, 3)
    """

    KIND = "conv1d"

    def __init__(self, codes, scale, spec, weight_shape, bias, dtype=None):
        super().__init__()
        self._set_storage(codes, scale, spec, weight_shape, dtype)
        self.nf, self.nx = self.weight_shape
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or tuple(bias.shape) != (self.nf,):
            raise ValueError(f"QuantizedConv1D: bias must be a float tensor of shape ({self.nf},), got {bias!r:.80}")
        self.register_buffer("bias", bias.detach())

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.dequantized_weight().t()).view(size_out)

    def extra_repr(self):
        return f"nf={self.nf}, nx={self.nx}, {self._storage_repr()}"
