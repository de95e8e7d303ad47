"""Which model tensors become which llama.cpp tensors: one layout function per architecture.

A layout recognises a model, checks what llama.cpp's graph for its architecture computes, and
lists the tensors to write (``Part``) with the hyper-parameters (``GGUFWriter.add_*`` calls).
Tensor names come from gguf-py's ``TENSOR_NAMES``. ``LAYOUTS`` is the table ``save_gguf``
tries in order; adding an architecture is one function there.

Row permutation: llama.cpp's ``llama`` graph applies rotary embeddings to adjacent pairs of
each head's dimensions, Hugging Face's Llama to the two halves, so (as llama.cpp's own
converter does) the rows of ``q_proj`` and ``k_proj`` (and their biases) are reordered within
each head: new row ``2i + j`` of a head is old row ``j * head_dim / 2 + i``. Whole rows move, so
quantized blocks (which run along a row) move intact. ``qwen2`` rotates halves like Hugging
Face: no permutation.
"""

from dataclasses import dataclass, field

import numpy as np
from torch import nn

__all__ = ["Part", "Layout", "LAYOUTS", "layout_of", "rotary_pair_rows"]


@dataclass
class Part:
    """One tensor to write.

    Attributes:
        name: the gguf tensor name, e.g. ``"blk.0.attn_q.weight"``.
        path: the model path it comes from (for error messages).
        module: a layer whose 2-D ``weight`` (float, QAT or converted) is written; or None.
        tensor: a float tensor written as F32 (norms, biases, positions); or None.
        rows: a row order applied before writing (``rotary_pair_rows``), or None.
    """

    name: str
    path: str
    module: object = None
    tensor: object = None
    rows: object = None


@dataclass
class Layout:
    """A model as one llama.cpp architecture: its name, ``[(add_* method, value)]`` and parts.

    ``notes`` lists what llama.cpp's graph would compute differently from the model (e.g. another
    activation), each as ``(what, fix)``; ``save_gguf`` refuses them unless told to accept them.
    ``head_path`` is the model path of the output head (written as ``token_embd`` when tied).
    """

    arch: str
    hparams: list
    parts: list
    vocab_size: int
    tied: bool
    notes: list = field(default_factory=list)
    head_path: str | None = None


def rotary_pair_rows(heads, head_dim):
    """The row order that turns per-head halves into adjacent pairs (llama.cpp's Llama layout).

    >>> rotary_pair_rows(1, 4).tolist()
    [0, 2, 1, 3]
    """
    index = np.arange(heads * head_dim).reshape(heads, 2, head_dim // 2)
    return index.swapaxes(1, 2).reshape(-1)


def _refuse(model, arch, why, fix):
    return ValueError(f"save_gguf cannot write this {type(model).__name__} as llama.cpp's {arch!r}: {why}; {fix}")


def tied_head(tok, head, tok_path, head_path):
    """Whether ``head`` shares ``tok``'s storage; ValueError if they share it with different specs."""
    if hasattr(tok, "codes") or hasattr(head, "codes"):
        tied = getattr(tok, "codes", None) is getattr(head, "codes", 1)
    else:
        tied = head.weight is tok.weight
    head_spec, tok_spec = getattr(head, "spec", None), getattr(tok, "spec", None)
    if tied and head_spec != tok_spec:
        label = lambda spec: "float" if spec is None else spec.short()  # noqa: E731
        raise ValueError(
            f"layer {head_path!r} is tied to {tok_path!r} but quantized as {label(head_spec)} while {tok_path!r} "
            f"is {label(tok_spec)}: a tied matrix is stored once, so prepare both with one spec (apply_qat "
            f"selects the embedding with its tied head)"
        )
    return tied


def _norm_eps(norm, path, kind, eps):
    if kind == "layer":
        ok = isinstance(norm, nn.LayerNorm) and norm.elementwise_affine and norm.bias is not None
        value = getattr(norm, "eps", None)
    else:  # an RMSNorm with a weight (Hugging Face's keep the epsilon as variance_epsilon)
        value = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        ok = isinstance(getattr(norm, "weight", None), nn.Parameter) and getattr(norm, "bias", None) is None
    if not ok or value is None:
        raise ValueError(f"layer {path!r} is {type(norm).__name__}: llama.cpp needs a {kind} norm with a weight"
                         + (" and bias" if kind == "layer" else ""))
    if eps is not None and value != eps:
        raise ValueError(f"layer {path!r} has eps={value}, another norm eps={eps}: GGUF stores one epsilon")
    return value


# ----------------------------------------------------------------------------------------------
# gpt2: mixle's build_causal_lm.

# llama.cpp's gpt2 graph computes ggml_gelu, the tanh approximation: build_causal_lm's "gelu_tanh"
# ("gelu_tanh_f16": the same through the float16 table its CPU backend uses).
GPT2_ACTIVATION = "gelu_tanh"
GPT2_ACTIVATIONS = ("gelu_tanh", "gelu_tanh_f16")


def gpt2_layout(model, names, kinds):
    """mixle's ``CausalLM`` (``build_causal_lm``) as llama.cpp's ``gpt2``, or None for other models."""
    cls = type(model)
    if cls.__name__ != "CausalLM" or not cls.__module__.startswith("mixle."):
        return None
    tok, head = model.tok, model.head
    tied = tied_head(tok, head, "tok", "head")
    if getattr(head, "bias", None) is not None:
        raise _refuse(model, "gpt2", "its output head has a bias", "build it with build_causal_lm")
    eps = _norm_eps(model.norm, "norm", "layer", None)
    parts = [Part(names[kinds.TOKEN_EMBD] + ".weight", "tok", module=tok),
             Part(names[kinds.POS_EMBD] + ".weight", "pos", tensor=model.pos.weight)]
    per_block = (("norm1", kinds.ATTN_NORM), ("qkv", kinds.ATTN_QKV), ("proj", kinds.ATTN_OUT),
                 ("norm2", kinds.FFN_NORM), ("fc", kinds.FFN_UP), ("out", kinds.FFN_DOWN))
    heads = {block.n_head for block in model.blocks}
    notes = []
    erf = [i for i, block in enumerate(model.blocks) if getattr(block, "activation", "gelu") not in GPT2_ACTIVATIONS]
    if erf:
        found = model.blocks[erf[0]].activation
        notes.append((f"blocks {erf} use activation={found!r}, but llama.cpp's gpt2 graph computes tanh-approximated "
                      f"GELU ({GPT2_ACTIVATION!r}), so the file would compute another function than the model",
                      f"train with build_causal_lm(..., activation={GPT2_ACTIVATION!r}), or pass "
                      f"allow_activation_mismatch=True to write it anyway"))
    for index, block in enumerate(model.blocks):
        for attr, kind in per_block:
            module, path, base = getattr(block, attr), f"blocks.{index}.{attr}", names[kind].format(bid=index)
            if attr.startswith("norm"):
                _norm_eps(module, path, "layer", eps)
                parts.append(Part(base + ".weight", path, tensor=module.weight))
            else:
                parts.append(Part(base + ".weight", path, module=module))
            parts.append(Part(base + ".bias", path, tensor=module.bias))
    if len(heads) != 1:
        raise _refuse(model, "gpt2", f"its blocks have different head counts {sorted(heads)}", "use one n_head")
    parts += [Part(names[kinds.OUTPUT_NORM] + ".weight", "norm", tensor=model.norm.weight),
              Part(names[kinds.OUTPUT_NORM] + ".bias", "norm", tensor=model.norm.bias)]
    if not tied:
        parts.append(Part(names[kinds.OUTPUT] + ".weight", "head", module=head))
    d_model = tok.embedding_dim if hasattr(tok, "embedding_dim") else tok.weight_shape[1]
    ffn = model.blocks[0].fc.out_features if len(model.blocks) else 4 * d_model
    hparams = [("add_context_length", model.block), ("add_embedding_length", d_model),
               ("add_block_count", len(model.blocks)), ("add_feed_forward_length", ffn),
               ("add_head_count", heads.pop() if heads else 1), ("add_layer_norm_eps", eps)]
    vocab = tok.num_embeddings if hasattr(tok, "num_embeddings") else tok.weight_shape[0]
    return Layout("gpt2", hparams, parts, vocab, tied, notes, head_path="head")


# ----------------------------------------------------------------------------------------------
# llama and qwen2: Hugging Face's LlamaForCausalLM and Qwen2ForCausalLM.

_HF_ARCHS = {"LlamaForCausalLM": ("llama", True), "Qwen2ForCausalLM": ("qwen2", False)}  # arch, permute q/k


def _rope_theta(config):
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    scaling = getattr(config, "rope_scaling", None)
    if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default")):
        return None
    return params.get("rope_theta", getattr(config, "rope_theta", 10000.0))


def hf_decoder_layout(model, names, kinds):
    """Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` as llama.cpp's ``llama`` / ``qwen2``."""
    found = _HF_ARCHS.get(type(model).__name__)
    if found is None or not type(model).__module__.startswith("transformers."):
        return None
    arch, permute = found
    config = model.config
    fix = "export a model with the default configuration of this family"
    theta = _rope_theta(config)
    if theta is None:
        raise _refuse(model, arch, "its rotary embedding is scaled (rope_parameters "
                      f"{getattr(config, 'rope_parameters', None)})", fix)
    if getattr(config, "hidden_act", "silu") != "silu":
        raise _refuse(model, arch, f"hidden_act={config.hidden_act!r} (llama.cpp computes SiLU)", fix)
    if getattr(config, "mlp_bias", False):
        raise _refuse(model, arch, "mlp_bias=True (llama.cpp's graph has no MLP biases)", fix)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inner = model.model
    tok, head = inner.embed_tokens, model.lm_head
    tied = tied_head(tok, head, "model.embed_tokens", "lm_head")
    eps = _norm_eps(inner.norm, "model.norm", "rms", None)
    parts = [Part(names[kinds.TOKEN_EMBD] + ".weight", "model.embed_tokens", module=tok)]
    q_rows = rotary_pair_rows(heads, head_dim) if permute else None
    k_rows = rotary_pair_rows(kv_heads, head_dim) if permute else None
    for index, layer in enumerate(inner.layers):
        prefix = f"model.layers.{index}"
        attn, mlp = layer.self_attn, layer.mlp
        name = lambda kind: names[kind].format(bid=index)  # noqa: E731
        _norm_eps(layer.input_layernorm, f"{prefix}.input_layernorm", "rms", eps)
        parts.append(Part(name(kinds.ATTN_NORM) + ".weight", f"{prefix}.input_layernorm",
                          tensor=layer.input_layernorm.weight))
        for attr, kind, rows in (("q_proj", kinds.ATTN_Q, q_rows), ("k_proj", kinds.ATTN_K, k_rows),
                                 ("v_proj", kinds.ATTN_V, None), ("o_proj", kinds.ATTN_OUT, None)):
            module, path = getattr(attn, attr), f"{prefix}.self_attn.{attr}"
            parts.append(Part(name(kind) + ".weight", path, module=module, rows=rows))
            if module.bias is not None:
                parts.append(Part(name(kind) + ".bias", path, tensor=module.bias, rows=rows))
        _norm_eps(layer.post_attention_layernorm, f"{prefix}.post_attention_layernorm", "rms", eps)
        parts.append(Part(name(kinds.FFN_NORM) + ".weight", f"{prefix}.post_attention_layernorm",
                          tensor=layer.post_attention_layernorm.weight))
        for attr, kind in (("gate_proj", kinds.FFN_GATE), ("up_proj", kinds.FFN_UP), ("down_proj", kinds.FFN_DOWN)):
            parts.append(Part(name(kind) + ".weight", f"{prefix}.mlp.{attr}", module=getattr(mlp, attr)))
    parts.append(Part(names[kinds.OUTPUT_NORM] + ".weight", "model.norm", tensor=inner.norm.weight))
    if not tied:
        parts.append(Part(names[kinds.OUTPUT] + ".weight", "lm_head", module=head))
    hparams = [("add_context_length", config.max_position_embeddings), ("add_embedding_length", hidden),
               ("add_block_count", len(inner.layers)), ("add_feed_forward_length", config.intermediate_size),
               ("add_head_count", heads), ("add_head_count_kv", kv_heads), ("add_layer_norm_rms_eps", eps),
               ("add_rope_freq_base", float(theta)), ("add_rope_dimension_count", head_dim),
               ("add_vocab_size", config.vocab_size)]
    if head_dim * heads != hidden:
        hparams += [("add_key_length", head_dim), ("add_value_length", head_dim)]
    return Layout(arch, hparams, parts, config.vocab_size, tied, head_path="lm_head")


LAYOUTS = (gpt2_layout, hf_decoder_layout)


def layout_of(model, gguf):
    """The first layout in ``LAYOUTS`` that takes ``model``; ValueError naming the supported ones."""
    for layout in LAYOUTS:
        found = layout(model, gguf.TENSOR_NAMES, gguf.MODEL_TENSOR)
        if found is not None:
            return found
    raise ValueError(
        f"save_gguf has no llama.cpp architecture for a {type(model).__name__}: it writes mixle's "
        f"build_causal_lm (llama.cpp's 'gpt2' architecture) and transformers' LlamaForCausalLM ('llama') and "
        f"Qwen2ForCausalLM ('qwen2'); build the model with one of them"
    )
