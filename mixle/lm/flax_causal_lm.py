"""A Flax NNX causal LM of the Llama / Qwen2 / Mistral architectures, loaded from a transformers
checkpoint: the JAX half of the LM jobs' model families.

Why mixle's own: the maintained JAX implementation on the package index (Google's Tunix) installs
TensorFlow Datasets, Grain, Kaggle and Hugging Face download clients and pins an older safetensors
than mixle's; the few modules a decoder needs are written here instead, against transformers'
definitions (``LlamaForCausalLM``), and tested against transformers' torch model on the same weights.

The model is plain NNX (``nnx.Linear`` for every matrix, in flax's ``(in, out)`` kernel layout), so
``mixle.apply_qat`` fake-quantizes it through Qwix like any NNX model. Computation runs in the
parameters' dtype (float32) unless ``dtype`` asks for bfloat16 compute.

What is read: ``config.json`` (``model_type`` ``llama``, ``mistral`` or ``qwen2``; hidden sizes,
heads and key/value heads, RMSNorm epsilon, RoPE theta and Llama 3's RoPE scaling, tied
embeddings, attention biases) and the safetensors weights (one file or an index of shards), read
with safetensors' numpy loader: no torch needed.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["CausalLMConfig", "CausalLM", "load_causal_lm", "causal_lm_of", "ARCHITECTURES"]

# transformers' model_type -> whether q/k/v projections carry biases.
ARCHITECTURES = {"llama": False, "mistral": False, "qwen2": True}


@dataclass(frozen=True, kw_only=True)
class CausalLMConfig:
    """The architecture's numbers, as transformers' ``config.json`` holds them."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int

    def __post_init__(self):
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"model_type={self.model_type!r}: the Flax causal LM reads {sorted(ARCHITECTURES)}; "
                             f"use the torch backend for other architectures")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} must divide "
                             f"num_attention_heads={self.num_attention_heads}")
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ValueError(f"rope_scaling={self.rope_scaling!r}: the Flax causal LM computes RoPE unscaled or with "
                             f"Llama 3's scaling; use the torch backend for {kind!r}")

    @classmethod
    def from_dict(cls, config):
        """The config of a transformers ``config.json`` dict.

        >>> CausalLMConfig.from_dict({"model_type": "llama", "vocab_size": 8, "hidden_size": 4,
        ...     "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}).head_dim
        2
        """
        heads = config["num_attention_heads"]
        model_type = config.get("model_type")
        # transformers 5 writes rope_parameters (theta and scaling together); older files rope_theta
        # and rope_scaling.
        rope = config.get("rope_parameters") or {**(config.get("rope_scaling") or {}),
                                                  "rope_theta": config.get("rope_theta", 10000.0)}
        scaling = None if rope.get("rope_type", rope.get("type", "default")) == "default" else rope
        window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
        if window is not None and window < config.get("max_position_embeddings", 2048):
            raise ValueError(f"sliding_window={window}: the Flax causal LM attends to the whole context; use the "
                             f"torch backend for sliding-window attention")
        return cls(model_type=model_type, vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
                   intermediate_size=config["intermediate_size"], num_hidden_layers=config["num_hidden_layers"],
                   num_attention_heads=heads, num_key_value_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=rope.get("rope_theta", 10000.0),
                   rope_scaling=scaling, tie_word_embeddings=config.get("tie_word_embeddings", False),
                   attention_bias=config.get("attention_bias", ARCHITECTURES.get(model_type, False)),
                   max_position_embeddings=config.get("max_position_embeddings", 2048))


def rope_frequencies(config):
    """The inverse frequencies of RoPE (``head_dim / 2`` of them), with Llama 3's scaling if set.

    >>> rope_frequencies(CausalLMConfig.from_dict({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
    ...     "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2})).tolist()
    [1.0, 0.009999999776482582]
    """
    dim = config.head_dim
    inverse = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inverse.astype(np.float32)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inverse
    scaled = np.where(wavelength > original / low, inverse / factor, inverse)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return np.where(medium, blended, scaled).astype(np.float32)


class RMSNorm(nnx.Module):
    def __init__(self, size, eps, dtype):
        self.weight = nnx.Param(jnp.ones(size, jnp.float32))
        self.eps, self.dtype = eps, dtype

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...] * normed.astype(self.dtype)).astype(self.dtype)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class Attention(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, hd = config.hidden_size, config.head_dim
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.q_proj = nnx.Linear(d, config.num_attention_heads * hd, use_bias=config.attention_bias, **kw)
        self.k_proj = nnx.Linear(d, config.num_key_value_heads * hd, use_bias=config.attention_bias, **kw)
        self.v_proj = nnx.Linear(d, config.num_key_value_heads * hd, use_bias=config.attention_bias, **kw)
        self.o_proj = nnx.Linear(config.num_attention_heads * hd, d, use_bias=False, **kw)
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd

    def __call__(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.kv_heads, self.head_dim)
        q, k = _rotate(q, cos, sin).astype(x.dtype), _rotate(k, cos, sin).astype(x.dtype)
        repeat = self.heads // self.kv_heads
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * self.head_dim**-0.5
        causal = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(x.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, self.heads * self.head_dim)
        return self.o_proj(out)


class MLP(nnx.Module):
    def __init__(self, config, dtype, rngs):
        kw = dict(dtype=dtype, param_dtype=jnp.float32, use_bias=False, rngs=rngs)
        self.gate_proj = nnx.Linear(config.hidden_size, config.intermediate_size, **kw)
        self.up_proj = nnx.Linear(config.hidden_size, config.intermediate_size, **kw)
        self.down_proj = nnx.Linear(config.intermediate_size, config.hidden_size, **kw)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, config, dtype, rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype, rngs)

    def __call__(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nnx.Module):
    """A decoder-only LM of ``config``'s architecture; ``model(ids)`` gives float32 logits.

    Module and parameter names follow transformers' (``model.layers.N.self_attn.q_proj``), so
    mixle's patterns, reports and files name the same layers in both frameworks.

    Args:
        config: a ``CausalLMConfig``.
        dtype: the compute dtype (parameters stay float32).
        rngs: ``nnx.Rngs`` for the initial parameters.

    >>> cfg = CausalLMConfig.from_dict({"model_type": "llama", "vocab_size": 11, "hidden_size": 8,
    ...     "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2})
    >>> CausalLM(cfg, rngs=nnx.Rngs(0))(jnp.zeros((1, 3), jnp.int32)).shape
    (1, 3, 11)
    """

    def __init__(self, config, *, dtype=jnp.float32, rngs):
        self.config, self.dtype = config, dtype
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=jnp.float32,
                                      rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = None if config.tie_word_embeddings else nnx.Linear(
            config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.inverse_frequencies = nnx.Variable(jnp.asarray(rope_frequencies(config)))

    def __call__(self, ids):
        positions = jnp.arange(ids.shape[1], dtype=jnp.float32)
        angles = positions[:, None] * self.inverse_frequencies[...][None, :]
        angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.norm(x)
        logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        return logits.astype(jnp.float32)


def _read_safetensors(directory):
    from safetensors.numpy import load_file

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    tensors = {}
    for name in files:
        path = directory / name
        if not path.exists():
            raise FileNotFoundError(f"{path}: the checkpoint names this weights file, which is missing")
        tensors.update(load_file(str(path)))
    return tensors


def _assign(param, value, name, transpose=False):
    value = np.asarray(value, np.float32)
    need = tuple(param[...].shape)[::-1] if transpose else tuple(param[...].shape)
    if need != value.shape:
        raise ValueError(f"tensor {name!r} has shape {list(value.shape)}, the config needs "
                         f"{list(need)}: the weights do not belong to this config.json")
    value = value.T if transpose else value
    if not np.isfinite(value).all():
        raise ValueError(f"tensor {name!r} holds NaN or infinite values: the checkpoint is damaged")
    param[...] = jnp.asarray(value)


def load_causal_lm(directory, *, dtype=jnp.float32):
    """The ``CausalLM`` of a transformers checkpoint directory (``config.json`` + safetensors).

    Args:
        directory: the directory ``save_pretrained`` wrote.
        dtype: the compute dtype (parameters are float32, as the checkpoint's values).

    Raises:
        ValueError: an architecture or RoPE scaling this model does not compute, a weight of the
            wrong shape, non-finite or missing, or a weight the model has no place for.

    >>> load_causal_lm  # doctest: +ELLIPSIS
    <function load_causal_lm at ...>
    """
    directory = Path(directory)
    return causal_lm_of(json.loads((directory / "config.json").read_text()), _read_safetensors(directory),
                        str(directory), dtype=dtype)


def causal_lm_of(config, tensors, source, *, dtype=jnp.float32):
    """The ``CausalLM`` of a transformers config dict and its weights by transformers' names.

    What ``load_causal_lm`` reads from a directory; also the way in for a model transformers
    loaded from elsewhere (a GGUF file, through its GGUF loader): ``causal_lm_of(model.config.to_dict(),
    {name: tensor.numpy() for name, tensor in model.state_dict().items()}, path)``.

    Args:
        config: the ``config.json`` dict.
        tensors: ``{name: array}`` (``model.`` prefixes are dropped; a tied ``lm_head.weight`` is ignored).
        source: where they came from, for the errors.
        dtype: the compute dtype.

    Raises:
        ValueError: as ``load_causal_lm``.

    >>> causal_lm_of  # doctest: +ELLIPSIS
    <function causal_lm_of at ...>
    """
    config = CausalLMConfig.from_dict(config)
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    model = CausalLM(config, dtype=dtype, rngs=nnx.Rngs(0))
    used = set()

    def take(name):
        if name not in tensors:
            raise ValueError(f"{source}: tensor {name!r} is missing from the checkpoint")
        used.add(name)
        return tensors[name]

    _assign(model.embed_tokens.embedding, take("embed_tokens.weight"), "embed_tokens.weight")
    for i, layer in enumerate(model.layers):
        prefix = f"layers.{i}."
        for path in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            module = layer
            for part in path.split("."):
                module = getattr(module, part)
            _assign(module.kernel, take(f"{prefix}{path}.weight"), f"{prefix}{path}.weight", transpose=True)
            if module.bias is not None:
                _assign(module.bias, take(f"{prefix}{path}.bias"), f"{prefix}{path}.bias")
        _assign(layer.input_layernorm.weight, take(f"{prefix}input_layernorm.weight"), f"{prefix}input_layernorm.weight")
        _assign(layer.post_attention_layernorm.weight, take(f"{prefix}post_attention_layernorm.weight"),
                f"{prefix}post_attention_layernorm.weight")
    _assign(model.norm.weight, take("norm.weight"), "norm.weight")
    if model.lm_head is not None:
        head = tensors.get("lm_head.weight")
        if head is None:
            raise ValueError(f"{source}: tensor 'lm_head.weight' is missing and tie_word_embeddings is false")
        _assign(model.lm_head.kernel, head, "lm_head.weight", transpose=True)
        used.add("lm_head.weight")
    unused = sorted(set(tensors) - used - {"lm_head.weight"} - {n for n in tensors if n.endswith("rotary_emb.inv_freq")})
    if unused:
        raise ValueError(f"{source}: tensors {unused[:5]} have no place in a {config.model_type} model")
    return model
