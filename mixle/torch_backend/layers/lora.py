"""PyTorch LoRA layers: a low-rank adapter over a float (LoRALinear) or fake-quantized (QATLoRALinear) base."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from mixle.torch_backend.fake_quant import fake_quantize
from mixle.torch_backend.layers.qat import QATWrapper, adopt, plain_linear

_LINEAR_FIELDS = ("in_features", "out_features", "weight", "bias")


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus a low-rank adapter: ``base(x) + alpha/rank * B(A(dropout(x)))``.

    Shares the wrapped layer's ``weight``/``bias`` Parameters (base ``state_dict`` keys and
    tied references are unchanged); ``lora_A`` (rank x in) starts uniform in +-1/sqrt(in) like
    ``nn.Linear``, ``lora_B`` (out x rank) starts at zero, so the layer first computes exactly
    what the base layer computes. Made by ``apply_lora``.

    Args:
        linear: the ``nn.Linear`` to adapt (not already adapted, not a QATWrapper).
        lora: the LoRASpec.
        adapters: existing ``(lora_A, lora_B)`` Parameters to reuse instead of new ones.

    >>> from mixle.experimental.program.lora import LoRASpec
    >>> layer = LoRALinear(nn.Linear(6, 4), LoRASpec(rank=2, alpha=4))
    >>> layer.lora_A.shape, layer.lora_B.shape, layer.lora_spec.scaling
    (torch.Size([2, 6]), torch.Size([4, 2]), 2.0)
    """

    def __init__(self, linear, lora, *, adapters=None):
        if not isinstance(linear, nn.Linear) or isinstance(linear, (LoRALinear, QATWrapper)):
            raise TypeError(f"LoRALinear adapts a plain nn.Linear, got {type(linear).__name__}: use apply_lora")
        nn.Module.__init__(self)
        adopt(self, linear, _LINEAR_FIELDS)
        self._set_adapters(lora, adapters)

    def _set_adapters(self, lora, adapters):
        self.lora_spec = lora
        if adapters is None:
            w = self.weight
            bound = 1.0 / math.sqrt(self.in_features)
            a = torch.empty(lora.rank, self.in_features, dtype=w.dtype, device=w.device).uniform_(-bound, bound)
            b = torch.zeros(self.out_features, lora.rank, dtype=w.dtype, device=w.device)
            adapters = (nn.Parameter(a), nn.Parameter(b))
        self.lora_A, self.lora_B = adapters

    def adapter_weights(self):
        """``(A, B)`` as the forward uses them (fake-quantized in ``QATLoRALinear`` when asked)."""
        return self.lora_A, self.lora_B

    def forward(self, x):
        # super() is nn.Linear here and QATWrapper in QATLoRALinear: the base path is theirs.
        base = super().forward(x)
        a, b = self.adapter_weights()
        if self.lora_spec.dropout and self.training:
            x = F.dropout(x, self.lora_spec.dropout, training=True)
        h = F.linear(x, a)
        # One GEMM adds alpha/rank * h @ B^T onto the base output: no full-size scale or add pass,
        # and with B = 0 it adds exact zeros, so a fresh adapter leaves the output bit-identical.
        out = torch.addmm(base.reshape(-1, self.out_features), h.reshape(-1, h.shape[-1]), b.t(),
                          alpha=self.lora_spec.scaling)
        return out.view(base.shape)

    def merged_weight(self):
        """``W + (B @ A) * alpha/rank`` in W's dtype (summed in at least float32), no gradient."""
        with torch.no_grad():
            return self._merge(*self.adapter_weights())

    def _merge(self, a, b):
        # The one formula for the merged weight: merge_lora and the quantize_merged forward.
        dtype = torch.promote_types(self.weight.dtype, torch.float32)
        delta = (b.to(dtype) @ a.to(dtype)) * self.lora_spec.scaling
        return (self.weight.to(dtype) + delta).to(self.weight.dtype)

    def base_layer(self):
        """The adapter-free layer sharing this one's Parameters: ``nn.Linear`` (or ``QATWrapper``)."""
        return plain_linear(self)

    def extra_repr(self):
        return f"{super().extra_repr()}, {self.lora_spec.short()}"


class QATLoRALinear(LoRALinear, QATWrapper):
    """A ``QATWrapper`` (fake-quantized base weight) with a float LoRA adapter.

    ``apply_qat`` then ``apply_lora`` and the reverse order both give this layer.
    ``set_fake_quant_enabled`` toggles the base (and the adapters, with ``adapter_spec``);
    off, it computes exactly what ``LoRALinear`` computes. With ``quantize_merged`` the
    forward fake-quantizes ``W + alpha/rank * B @ A`` as one weight instead.

    >>> from mixle.experimental.program.lora import LoRASpec, QuantSpec
    >>> layer = QATLoRALinear(nn.Linear(6, 4), LoRASpec(rank=2, alpha=2), QuantSpec(bits=4))
    >>> layer.spec.bits, layer.lora_spec.rank, isinstance(layer, QATWrapper)
    (4, 2, True)
    """

    def __init__(self, linear, lora, spec, *, enabled=True, adapters=None):
        if isinstance(linear, (LoRALinear, QATWrapper)):
            raise TypeError(f"QATLoRALinear takes a plain nn.Linear, got {type(linear).__name__}: use apply_lora")
        if spec.scale == "learned" or spec.act_bits is not None:
            # The adapter reads the raw input and merge_lora changes W under its scales, so the
            # merged, converted layer would not compute what training saw.
            raise ValueError(f"LoRA layers cannot take {spec.short()} yet: learned scales and activation "
                             f"fake-quant are not carried through merge_lora; drop scale='learned'/act_bits")
        QATWrapper.__init__(self, linear, spec, enabled=enabled)
        self._set_adapters(lora, adapters)

    def forward(self, x):
        if self.enabled and self.lora_spec.quantize_merged:
            merged = self._merge(self.lora_A, self.lora_B)
            return F.linear(x, fake_quantize(merged, self.spec), self.bias)
        return super().forward(x)

    def adapter_weights(self):
        spec = self.lora_spec.adapter_spec
        if spec is None or not self.enabled:
            return self.lora_A, self.lora_B
        return fake_quantize(self.lora_A, spec), fake_quantize(self.lora_B, spec)

    def base_layer(self):
        return QATWrapper(plain_linear(self), self.spec, enabled=self.enabled)
