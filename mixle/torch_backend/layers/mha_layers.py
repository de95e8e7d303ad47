"""``nn.MultiheadAttention``: its packed ``in_proj_weight`` and its ``out_proj`` weight, both
fake-quantized per output channel.

MHA reads its weights directly (``F.multi_head_attention_forward`` or, in inference, the fused
fast path), so wrapping ``out_proj`` alone would never run. The QAT and the quantized layer both
run ``nn.MultiheadAttention.forward`` itself on a stand-in holding the (fake-)quantized weights:
the stock code chooses between the fast and the slow path exactly as for a float MHA, and the
converted layer computes the same ops on the same dequantized weights, bit for bit. Under
torch.compile, which cannot trace the stand-in's construction, both run the stock slow path
(``F.multi_head_attention_forward``, what a float MHA runs in training) directly.
"""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from mixle.core.numerics import block_shape
from mixle.torch_backend.fake_quant import fake_quantized_weight
from mixle.torch_backend.layers.qat import QATLayerMixin, adopt, check_supported
from mixle.torch_backend.layers.quantized import QuantizedWeight

OPTIONS = ("embed_dim", "num_heads", "dropout", "batch_first", "add_zero_attn")


def unsupported_reason(mha):
    """Why mixle cannot quantize this MHA, or None."""
    if not mha._qkv_same_embed_dim:
        return "unsupported type: nn.MultiheadAttention with kdim/vdim != embed_dim (separate q/k/v weights)"
    if mha.bias_k is not None:
        return "unsupported type: nn.MultiheadAttention with add_bias_kv=True"
    return None


def _run(attrs, training, in_weight, in_bias, out_weight, out_bias, args, kwargs):
    """``nn.MultiheadAttention.forward`` on a stand-in holding these weights (no hooks run twice:
    the caller's own ``__call__`` ran them)."""
    if torch.compiler.is_compiling():
        return _slow_path(attrs, training, (in_weight, in_bias, out_weight, out_bias), *args, **kwargs)
    shadow = nn.MultiheadAttention.__new__(nn.MultiheadAttention)
    embed_dim = attrs["embed_dim"]
    shadow.__dict__.update(
        attrs, training=training, kdim=embed_dim, vdim=embed_dim, _qkv_same_embed_dim=True,
        head_dim=embed_dim // attrs["num_heads"], bias_k=None, bias_v=None, _buffers={},
        _parameters={"in_proj_weight": in_weight, "q_proj_weight": None, "k_proj_weight": None,
                     "v_proj_weight": None, "in_proj_bias": in_bias},
        _modules={"out_proj": SimpleNamespace(weight=out_weight, bias=out_bias)})
    return nn.MultiheadAttention.forward(shadow, *args, **kwargs)


def _slow_path(attrs, training, weights, query, key, value, key_padding_mask=None, need_weights=True,
               attn_mask=None, average_attn_weights=True, is_causal=False):
    """The slow path of ``nn.MultiheadAttention.forward`` (its batch-first transposes and
    ``F.multi_head_attention_forward``, same arguments) on ``weights``, for traced code."""
    batched = attrs["batch_first"] and query.dim() == 3
    if batched:  # as the stock forward, keeping which of query, key and value are one tensor
        if key is value and query is key:
            query = key = value = query.transpose(1, 0)
        elif key is value:
            query, key = query.transpose(1, 0), key.transpose(1, 0)
            value = key
        else:
            query, key, value = (t.transpose(1, 0) for t in (query, key, value))
    in_weight, in_bias, out_weight, out_bias = weights
    output, attention = F.multi_head_attention_forward(
        query, key, value, attrs["embed_dim"], attrs["num_heads"], in_weight, in_bias, None, None,
        attrs["add_zero_attn"], attrs["dropout"], out_weight, out_bias, training=training,
        key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
        average_attn_weights=average_attn_weights, is_causal=is_causal)
    return (output.transpose(1, 0) if batched else output), attention


class QATMultiheadAttention(QATLayerMixin, nn.MultiheadAttention):
    """An ``nn.MultiheadAttention`` whose ``in_proj_weight`` and ``out_proj.weight`` are
    fake-quantized (one spec) while enabled; disabled, it is the stock forward, bit for bit.

    Shares every Parameter and the ``out_proj`` module of the wrapped layer.

    >>> from mixle.core.spec import QuantSpec
    >>> layer = QATMultiheadAttention(nn.MultiheadAttention(8, 2), QuantSpec(bits=8))
    >>> layer.in_proj_weight.shape, layer.spec.bits
    (torch.Size([24, 8]), 8)
    """

    def __init__(self, mha, spec, *, enabled=True):
        reason = unsupported_reason(mha)
        if reason:
            raise ValueError(reason)
        check_supported(spec)
        block_shape(tuple(mha.in_proj_weight.shape), spec)  # group_size must divide embed_dim
        nn.Module.__init__(self)
        adopt(self, mha, ("embed_dim", "kdim", "vdim", "_qkv_same_embed_dim", "num_heads", "dropout",
                          "batch_first", "head_dim", "bias_k", "bias_v", "add_zero_attn", "out_proj"))
        for name, param in mha._parameters.items():
            self.register_parameter(name, param)
        self.spec = spec
        self.enabled = enabled

    def quantized_weights(self):
        """The fake-quantized ``(in_proj_weight, out_proj.weight)`` (STE gradients)."""
        return (fake_quantized_weight(self.in_proj_weight, self.spec)[0],
                fake_quantized_weight(self.out_proj.weight, self.spec)[0])

    def forward(self, *args, **kwargs):
        if not self.enabled:
            return super().forward(*args, **kwargs)
        in_weight, out_weight = self.quantized_weights()
        attrs = {name: getattr(self, name) for name in OPTIONS}
        return _run(attrs, self.training, in_weight, self.in_proj_bias, out_weight, self.out_proj.bias, args, kwargs)

    def extra_repr(self):
        return self.qat_state(", in_proj and out_proj")


def wrap_mha(mha, spec, enabled):
    return QATMultiheadAttention(mha, spec, enabled=enabled)


class QuantizedMultiheadAttention(QuantizedWeight):
    """An inference ``nn.MultiheadAttention`` storing ``in_proj_weight`` as integer codes and
    scales, with its ``out_proj`` a ``QuantizedLinear``; the forward is the stock MHA forward on
    the dequantized weights (the QAT layer's, bit for bit).

    Args:
        codes, scale, spec: ``in_proj_weight``'s, as for ``QuantizedLinear``.
        weight_shape: ``(3 * embed_dim, embed_dim)``.
        bias: ``in_proj_bias`` or None.
        out_proj: the output projection (a ``QuantizedLinear``).
        embed_dim, num_heads, dropout, batch_first, add_zero_attn: as for ``nn.MultiheadAttention``.
        dtype: the replaced weight's float dtype (default: the scales', see ``QuantizedWeight``).
    """

    KIND = "multihead_attention"

    def __init__(self, codes, scale, spec, weight_shape, bias=None, *, out_proj, embed_dim, num_heads,
                 dropout=0.0, batch_first=False, add_zero_attn=False, dtype=None):
        super().__init__()
        self._set_storage(codes, scale, spec, weight_shape, dtype)
        embed_dim, num_heads = int(embed_dim), int(num_heads)
        if self.weight_shape != (3 * embed_dim, embed_dim) or embed_dim % num_heads:
            raise ValueError(f"QuantizedMultiheadAttention: in_proj_weight {list(self.weight_shape)} does not fit "
                             f"embed_dim={embed_dim}, num_heads={num_heads}")
        if bias is not None and tuple(bias.shape) != (3 * embed_dim,):
            raise ValueError(f"QuantizedMultiheadAttention: in_proj_bias must have shape ({3 * embed_dim},)")
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, float(dropout)
        self.batch_first, self.add_zero_attn = bool(batch_first), bool(add_zero_attn)
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.out_proj = out_proj

    def forward(self, *args, **kwargs):
        attrs = {name: getattr(self, name) for name in OPTIONS}
        return _run(attrs, self.training, self.dequantized_weight(), self.bias,
                    self.out_proj.dequantized_weight(), self.out_proj.bias, args, kwargs)

    def extra_repr(self):
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, in_proj {self._storage_repr()}"
