"""A small decoder-only causal language model whose output head is tied to its token embedding."""

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CausalLM", "Block", "build_causal_lm", "ACTIVATIONS"]


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


_F16_TABLE = []


def _gelu_f16_table():
    """ggml's table: ``float16(gelu_tanh(h))`` for every float16 ``h``, in float32 and in ggml's
    operation order (``0.5f*x*(1.0f + tanhf(SQRT_2_OVER_PI*x*(1.0f + GELU_COEF_A*x*x)))``)."""
    if not _F16_TABLE:
        import numpy as np

        h = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)
        with np.errstate(all="ignore"):
            inner = np.float32(math.sqrt(2 / math.pi)) * h * (np.float32(1) + np.float32(0.044715) * h * h)
            tanh = np.tanh(inner.astype(np.float64)).astype(np.float32)  # tanhf, correctly rounded
            table = (np.float32(0.5) * h * (np.float32(1) + tanh)).astype(np.float16).astype(np.float32)
        _F16_TABLE.append(torch.from_numpy(table))
    return _F16_TABLE[0]


class _GeluTanhF16(torch.autograd.Function):
    """llama.cpp's CPU GELU: a table of tanh GELU at every float16 value, looked up at
    ``float16(x)`` for ``-10 < x < 10``; 0 at or below -10, ``x`` at or above 10. The backward is
    tanh GELU's own derivative at ``x`` (the float16 roundings pass the gradient straight through)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        index = x.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
        table = _gelu_f16_table().to(x.device)[index].to(x.dtype)
        return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, table))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            return torch.autograd.grad(_gelu_tanh(leaf), leaf, grad)[0]


# The MLP activations a block can use: erf GELU (torch's default); the tanh approximation, which
# is what llama.cpp's ``gpt2`` graph computes (so a model meant for save_gguf trains on it); and
# the same through the float16 table llama.cpp's CPU backend looks it up in, value for value.
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
    "gelu_tanh_f16": _GeluTanhF16.apply,
}


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention then a GELU MLP, each residual.

    Every weight matrix is a plain ``nn.Linear`` (``qkv``, ``proj``, ``fc``, ``out``), so
    ``apply_qat`` can wrap all of them; ``nn.MultiheadAttention`` would read its output weight
    directly and could not be fake-quantized. ``activation`` names the MLP's entry in
    ``ACTIVATIONS``.
    """

    def __init__(self, d_model, n_head, activation="gelu"):
        super().__init__()
        self.n_head = n_head
        self.activation = activation
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        heads = lambda t: t.view(batch, length, self.n_head, width // self.n_head).transpose(1, 2)
        att = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(ACTIVATIONS[self.activation](self.fc(self.norm2(x))))


class CausalLM(nn.Module):
    """Token + position embeddings, pre-norm blocks, a final norm and a head tied to ``tok``.

    Attributes:
        tok: ``nn.Embedding(vocab, d_model)``; its weight is also ``head.weight``.
        pos: ``nn.Embedding(block, d_model)``, learned positions.
        blocks: ``nn.ModuleList`` of ``Block``.
        norm: final ``nn.LayerNorm``.
        head: ``nn.Linear(d_model, vocab, bias=False)`` with ``head.weight is tok.weight``.
        block: the longest context the model accepts.
    """

    def __init__(self, vocab, d_model, n_layer, n_head, block, activation="gelu"):
        super().__init__()
        self.vocab, self.block = vocab, block
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(block, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, activation) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight
        self._init_weights(n_layer)

    def _init_weights(self, n_layer):
        for name, param in self.named_parameters():
            if param.dim() == 2:
                # Residual outputs start smaller so the sum over layers keeps unit scale.
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(param, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(param)

    def forward(self, idx, all_positions=False):
        """Logits for the next token after each sequence of ``idx`` (batch, length).

        Args:
            idx: int64 token ids, shape ``(batch, length)`` with ``1 <= length <= block``.
            all_positions: return logits after every position, shape ``(batch, length, vocab)``,
                instead of only after the last one, shape ``(batch, vocab)``.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, length), got {tuple(idx.shape)}")
        length = idx.shape[1]
        if not 1 <= length <= self.block:
            raise ValueError(f"sequence length {length} must be between 1 and the model's block={self.block}")
        x = self.tok(idx) + self.pos(torch.arange(length, device=idx.device))
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        if not all_positions:
            x = x[:, -1]
        return self.head(x)

    def sequence_log_prob(self, tokens):
        """Log-probability of each row's tokens after its first one: ``sum_t log p(x_t | x_<t)``.

        Args:
            tokens: int64 ids, shape ``(batch, length)``, ``2 <= length <= block + 1``.

        Returns:
            float tensor of shape ``(batch,)``; divide by ``length - 1`` for a per-token value.
        """
        if tokens.dim() != 2 or tokens.shape[1] < 2:
            raise ValueError(f"tokens must have shape (batch, length >= 2), got {tuple(tokens.shape)}")
        logits = self(tokens[:, :-1], all_positions=True)
        nll = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
        return -nll.view(tokens.shape[0], -1).sum(dim=1)


def build_causal_lm(vocab, d_model=128, n_layer=3, n_head=4, block=64, activation="gelu"):
    """Build a ``CausalLM`` (head tied to the token embedding), initialised from torch's RNG.

    Args:
        vocab: number of token ids.
        d_model: width of the residual stream; must be divisible by ``n_head``.
        n_layer: number of transformer blocks.
        n_head: attention heads per block.
        block: longest context (number of learned positions).
        activation: the MLP activation, ``"gelu"`` (erf, the default), ``"gelu_tanh"`` (the tanh
            approximation llama.cpp's ``gpt2`` graph computes: use it for a model meant for
            ``save_gguf``) or ``"gelu_tanh_f16"`` (the same through llama.cpp's CPU float16
            table, ``float16(gelu_tanh(float16(x)))``: with ``act_bits=8`` on the q4_0/q8_0
            grids, mixle's forward then matches llama.cpp's CPU logits to float rounding).

    >>> lm = build_causal_lm(vocab=50, d_model=32, n_layer=1, n_head=2, block=8)
    >>> lm.head.weight is lm.tok.weight, lm(torch.zeros(3, 5, dtype=torch.long)).shape
    (True, torch.Size([3, 50]))
    """
    for name, value in (("vocab", vocab), ("d_model", d_model), ("n_layer", n_layer),
                        ("n_head", n_head), ("block", block)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if d_model % n_head:
        raise ValueError(f"d_model={d_model} must be divisible by n_head={n_head}: e.g. n_head=4 with d_model=128")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is unknown: use one of {sorted(ACTIVATIONS)} "
                         f"('gelu_tanh' is what llama.cpp's gpt2 graph computes, 'gelu_tanh_f16' as its CPU table)")
    return CausalLM(vocab, d_model, n_layer, n_head, block, activation)
