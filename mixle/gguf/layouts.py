"""Which model tensors become which llama.cpp tensors: one layout function per kind of model.

A layout recognises a model, checks what llama.cpp's graph for its architecture computes, and
lists the tensors to write (``Part``) with the hyper-parameters (``GGUFWriter.add_*`` calls).
``LAYOUTS`` is the table ``save_gguf`` tries in order: mixle's ``build_causal_lm`` (``gpt2``) and
the transformers decoders of ``mixle.gguf.architectures`` (one ``DecoderArch`` record each).

A transformers decoder is walked module by module: every module path goes through gguf-py's own
tensor-name map for the record's architecture (``gguf.get_tensor_name_map``, as llama.cpp's
converter names tensors), so ``post_attention_layernorm`` is ``ffn_norm`` in a Llama and
``post_attention_norm`` in a Gemma or OLMo2, ``qkv_proj`` is ``attn_qkv``; a module holding
weights the map has no name for, or a tensor the architecture's graph does not read, is refused.
Norm weights get the record's offset (Gemma's ``1 + w``).

Row permutation: llama.cpp's ``llama`` graph applies rotary embeddings to adjacent pairs of
each head's dimensions, Hugging Face's Llama to the two halves, so (as llama.cpp's own
converter does) the rows of ``q_proj`` and ``k_proj`` (and their biases) are reordered within
each head: new row ``2i + j`` of a head is old row ``j * head_dim / 2 + i``. Whole rows move, so
quantized blocks (which run along a row) move intact. Records with ``permute_qk`` (Llama,
Mistral, Mixtral, SmolLM3) are permuted; the others rotate halves as transformers does.

Mixtures of experts (records with ``experts``): each layer's router (``mlp.gate``,
float: F32, as llama.cpp never quantizes it) is ``ffn_gate_inp``; the fused expert weights
``gate_up_proj`` ``(E, 2I, H)`` (gate rows first) and ``down_proj`` ``(E, H, I)`` are
``ffn_gate_exps`` / ``ffn_up_exps`` (rows ``[:I]`` and ``[I:]`` of every expert) and
``ffn_down_exps``, with ``expert_count``, ``expert_used_count`` and ``expert_feed_forward_length``.
llama.cpp's graph (``build_moe_ffn``) takes a softmax over all experts, keeps the top k and divides
them by their sum: configurations it would compute differently (Qwen3-MoE's
``norm_topk_prob=False``, dense or shared-expert layers, a sliding window) are refused.
"""

from dataclasses import dataclass, field

import numpy as np
from torch import nn

from mixle.gguf.architectures import (DECODERS, DecoderArch, config_metadata, config_refusals, decoder_of,
                                      head_dim_of, rope_dimension_count, rope_theta)

__all__ = ["Part", "Layout", "HFArch", "HF_ARCHS", "LAYOUTS", "layout_of", "rotary_pair_rows", "expert_shape"]


@dataclass
class Part:
    """One tensor to write.

    Attributes:
        name: the gguf tensor name, e.g. ``"blk.0.attn_q.weight"``.
        path: the model path it comes from (for error messages).
        module: a layer whose 2-D ``weight`` (float, QAT or converted) is written; or None.
        tensor: a float tensor written as F32 (norms, biases, positions); or None. With a
            ``module`` (a router): what the module writes while it is float.
        rows: a row order applied before writing (``rotary_pair_rows``), or None.
        attr: the attribute of ``module`` holding the weight: ``"weight"`` (a 2-D ``(out, in)``
            matrix), or a fused expert weight ``(experts, rows, cols)`` such as ``"gate_up_proj"``.
        row_slice: the rows of every expert this tensor takes (``slice(0, n)``: the gate half of
            ``gate_up_proj``), or None for all of them. Whole rows: quantized blocks stay intact.
        offset: added to a ``tensor`` as it is written (Gemma's norms: the file holds ``1 + w``).

    A fused expert weight is written as a 3-D tensor (gguf ``ne = [cols, rows, experts]``); its
    ``path`` is the parameter's model path (``"model.layers.0.mlp.experts.gate_up_proj"``), the
    key ``save_gguf(..., quantized=...)`` takes for it.
    """

    name: str
    path: str
    module: object = None
    tensor: object = None
    rows: object = None
    attr: str = "weight"
    row_slice: slice | None = None
    offset: float = 0.0

    @property
    def experts(self):
        """Whether the part is a fused 3-D expert weight."""
        return self.attr != "weight"


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


def gpt2_layout(model, gguf):
    """mixle's ``CausalLM`` (``build_causal_lm``) as llama.cpp's ``gpt2``, or None for other models."""
    names, kinds = gguf.TENSOR_NAMES, gguf.MODEL_TENSOR
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
# transformers decoders: one ``DecoderArch`` record each (``mixle.gguf.architectures``); tensor names
# through gguf-py's own map, as llama.cpp's converter names them.

HFArch = DecoderArch  # the record's old name
HF_ARCHS = DECODERS

# The order of a layer's tensors in the file (llama.cpp does not care; kept as it always was):
# by the stage of the layer they belong to, then as the model holds them.
_STAGES = {"ATTN_NORM": 0, "ATTN_POST_NORM": 2, "FFN_NORM": 3, "FFN_PRE_NORM": 3, "FFN_POST_NORM": 5}
# Matrices whose bias llama.cpp's graphs read (q/k/v: every architecture here; o_proj: ``attention_bias``).
_BIASED = ("ATTN_Q", "ATTN_K", "ATTN_V", "ATTN_QKV")


def _stage(kind):
    return _STAGES.get(kind.name, 1 if kind.name.startswith("ATTN_") else 4)


def _expert_parts(model, record, mlp, prefix, name, kinds):
    """The router and expert tensors of one sparse MLP block, after refusing blocks llama.cpp cannot run."""
    found = type(mlp).__name__
    if found != record.moe_block:
        raise _refuse(model, record.arch, f"{prefix}.mlp is a {found}, not a {record.moe_block} (llama.cpp's graph "
                      f"needs every layer to be a mixture of experts: no dense layers, mlp_only_layers=[], "
                      f"decoder_sparse_step=1)", "export a model whose every layer routes to experts")
    extra = sorted(child for child, _ in mlp.named_children() if child not in ("gate", "experts"))
    if extra:
        raise _refuse(model, record.arch, f"{prefix}.mlp has {extra} besides its router and experts (shared "
                      f"experts, which llama.cpp's {record.arch!r} graph does not compute)", "export another model")
    gate, experts = mlp.gate, mlp.experts
    router = f"{prefix}.mlp.gate"
    # llama.cpp never quantizes the router: F32 while float; a router opted in to QAT (or given
    # through quantized=) is written as its blocks.
    parts = [Part(name(kinds.FFN_GATE_INP) + ".weight", router, module=gate,
                  tensor=gate.weight if getattr(gate, "spec", None) is None else None)]
    gate_up = f"{prefix}.mlp.experts.gate_up_proj"
    rows = int(getattr(experts, "intermediate_dim", 0)) or expert_shape(experts, "gate_up_proj")[1] // 2
    parts += [Part(name(kinds.FFN_GATE_EXP) + ".weight", gate_up, module=experts, attr="gate_up_proj",
                   row_slice=slice(0, rows)),
              Part(name(kinds.FFN_UP_EXP) + ".weight", gate_up, module=experts, attr="gate_up_proj",
                   row_slice=slice(rows, 2 * rows)),
              Part(name(kinds.FFN_DOWN_EXP) + ".weight", f"{prefix}.mlp.experts.down_proj", module=experts,
                   attr="down_proj")]
    return parts, (expert_shape(gate, "weight")[0], int(gate.top_k), rows)


def expert_shape(module, attr):
    """The shape of a fused module's weight (float, QAT or converted): ``(experts, rows, cols)``.

    >>> import torch
    >>> class Experts(torch.nn.Module):
    ...     down_proj = torch.nn.Parameter(torch.zeros(4, 8, 16))
    >>> expert_shape(Experts(), "down_proj")
    (4, 8, 16)
    """
    found = getattr(module, attr)  # a Parameter, or a converted layer's stored weight
    return tuple(int(d) for d in (getattr(found, "array_shape", None) or found.shape))


def _is_matrix(module):
    """A layer whose 2-D weight is written as a matrix (float, QAT or converted), not a norm's vector."""
    return hasattr(module, "weight_shape") or getattr(getattr(module, "weight", None), "dim", lambda: 0)() >= 2


class _DecoderWalk:
    """One transformers decoder's parts, found by mapping every module path through gguf-py's map."""

    def __init__(self, model, record, gguf):
        self.model, self.record, self.gguf = model, record, gguf
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[record.arch]
        self.allowed = set(gguf.MODEL_TENSORS[arch])
        self.tensor_map = gguf.get_tensor_name_map(arch, len(model.model.layers))
        self.eps = _norm_eps(model.model.norm, "model.norm", "rms", None)

    def rows(self, kind):
        if not self.record.permute_qk or kind.name not in ("ATTN_Q", "ATTN_K"):
            return None
        return rotary_pair_rows(self.heads if kind.name == "ATTN_Q" else self.kv_heads, self.head_dim)

    def refuse(self, why, fix="export a model of this family as transformers builds it"):
        return _refuse(self.model, self.record.arch, why, fix)

    def module_parts(self, path, module, kind, name):
        """The parts of one mapped module: a matrix (and its bias) or a norm's weight."""
        if kind not in self.allowed:
            raise self.refuse(f"{path!r} is llama.cpp's {kind.name}, which its {self.record.arch!r} graph does not read")
        if not _is_matrix(module):
            _norm_eps(module, path, "rms", self.eps)
            return [Part(name + ".weight", path, tensor=module.weight, offset=self.record.norm_offset)]
        parts = [Part(name + ".weight", path, module=module, rows=self.rows(kind))]
        bias = getattr(module, "bias", None)
        if bias is not None:
            if kind.name not in _BIASED and not (kind.name == "ATTN_OUT" and self.record.attention_bias):
                raise self.refuse(f"{path!r} has a bias, which llama.cpp's {self.record.arch!r} graph does not add")
            parts.append(Part(name + ".bias", path, tensor=bias, rows=self.rows(kind)))
        return parts

    def parts(self):
        """``(token embedding part, {layer: [(stage, order, part)]}, [output parts], MoE sizes)``."""
        layers, tail, moe, taken = {}, [], set(), []
        kinds = self.gguf.MODEL_TENSOR
        for order, (path, module) in enumerate(self.model.named_modules()):
            if not path or path == "lm_head" or any(path.startswith(prefix) for prefix in taken):
                continue  # the head: hf_decoder_layout's (token_embd when tied)
            found = self.tensor_map.get_type_and_name(path)
            if self.record.experts and path.endswith(".mlp") and path.startswith("model.layers."):
                index = int(path.split(".")[2])
                name = lambda kind, index=index: self.gguf.TENSOR_NAMES[kind].format(bid=index)  # noqa: E731
                expert_parts, sizes = _expert_parts(self.model, self.record, module, path[:-len(".mlp")], name, kinds)
                layers.setdefault(index, []).extend((4, order, part) for part in expert_parts)
                moe.add(sizes)
                taken.append(path + ".")
            elif found is not None and (hasattr(module, "weight") or hasattr(module, "codes")):
                kind, name = found
                taken.append(path + ".")
                if kind.name in ("TOKEN_EMBD", "OUTPUT", "OUTPUT_NORM"):
                    continue  # written by hf_decoder_layout itself
                index = int(name.split(".")[1])
                layers.setdefault(index, []).extend(
                    (_stage(kind), order, part) for part in self.module_parts(path, module, kind, name))
            elif any(True for _ in module.parameters(recurse=False)):
                own = sorted(n for n, _ in module.named_parameters(recurse=False))
                raise self.refuse(f"{path!r} ({type(module).__name__}) holds {own}, which llama.cpp's "
                                  f"{self.record.arch!r} tensor names have no place for")
        return layers, moe


def _check_head(model, record, tied, allowed, gguf):
    if tied and record.head == "untied":
        raise _refuse(model, record.arch, "its output head is tied to the token embedding, but llama.cpp's graph "
                      "reads a separate output.weight", "untie the head (config.tie_word_embeddings=False) before "
                      "training, or export another model")
    if not tied and (record.head == "tied" or gguf.MODEL_TENSOR.OUTPUT not in allowed):
        raise _refuse(model, record.arch, "its output head is not tied to the token embedding, but llama.cpp's "
                      "graph multiplies with the token embedding", "export a model with tie_word_embeddings=True")


def hf_decoder_layout(model, gguf):
    """A transformers causal LM of ``DECODERS`` as its llama.cpp architecture, or None for other models."""
    record = decoder_of(model)
    if record is None:
        return None
    config = model.config
    problems = config_refusals(config, record)
    if problems:
        raise _refuse(model, record.arch, *problems[0])
    theta = rope_theta(config)
    walk = _DecoderWalk(model, record, gguf)
    inner = model.model
    tok, head = inner.embed_tokens, model.lm_head
    tied = tied_head(tok, head, "model.embed_tokens", "lm_head")
    _check_head(model, record, tied, walk.allowed, gguf)
    names, kinds = gguf.TENSOR_NAMES, gguf.MODEL_TENSOR
    layers, moe = walk.parts()
    parts = [Part(names[kinds.TOKEN_EMBD] + ".weight", "model.embed_tokens", module=tok)]
    for index in sorted(layers):
        parts += [part for _, _, part in sorted(layers[index], key=lambda entry: entry[:2])]
    parts.append(Part(names[kinds.OUTPUT_NORM] + ".weight", "model.norm", tensor=inner.norm.weight,
                      offset=record.norm_offset))
    if not tied:
        parts.append(Part(names[kinds.OUTPUT] + ".weight", "lm_head", module=head))
    hidden, heads, head_dim = config.hidden_size, config.num_attention_heads, walk.head_dim
    hparams = [("add_context_length", config.max_position_embeddings), ("add_embedding_length", hidden),
               ("add_block_count", len(inner.layers)), ("add_feed_forward_length", config.intermediate_size),
               ("add_head_count", heads), ("add_head_count_kv", config.num_key_value_heads),
               ("add_layer_norm_rms_eps", walk.eps), ("add_rope_freq_base", theta),
               ("add_rope_dimension_count", rope_dimension_count(config)), ("add_vocab_size", config.vocab_size)]
    extra = config_metadata(config, record)
    if head_dim * heads != hidden and not any(method == "add_key_length" for method, _ in extra):
        hparams += [("add_key_length", head_dim), ("add_value_length", head_dim)]
    hparams += extra
    if record.experts:
        hparams += _expert_hparams(model, record, moe)
    return Layout(record.arch, hparams, parts, config.vocab_size, tied, head_path="lm_head")


def _expert_hparams(model, record, sizes):
    """expert_count, expert_used_count and expert_feed_forward_length: one value for every layer."""
    if len(sizes) != 1:
        raise _refuse(model, record.arch, f"its layers have different (experts, top-k, expert rows) {sorted(sizes)}",
                      "use one expert configuration")
    (experts, used, rows), = sizes
    if not 0 < used <= experts:
        raise _refuse(model, record.arch, f"it routes each token to {used} of {experts} experts", "use 1..experts")
    # llama.cpp's llama reads the experts' rows from feed_forward_length: Mixtral's intermediate_size,
    # which MixtralExperts is built from; qwen3moe reads expert_feed_forward_length.
    return [("add_expert_count", experts), ("add_expert_used_count", used), ("add_expert_feed_forward_length", rows)]


LAYOUTS = (gpt2_layout, hf_decoder_layout)


def layout_of(model, gguf):
    """The first layout in ``LAYOUTS`` that takes ``model``; ValueError naming the supported ones."""
    for layout in LAYOUTS:
        found = layout(model, gguf)
        if found is not None:
            return found
    raise ValueError(
        f"save_gguf has no llama.cpp architecture for a {type(model).__name__}: it writes mixle's "
        f"build_causal_lm (llama.cpp's 'gpt2' architecture) and transformers' "
        f"{', '.join(f'{cls} ({record.arch!r})' for cls, record in HF_ARCHS.items())}; build the model with one of them"
    )
