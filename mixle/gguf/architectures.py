"""The transformers causal LMs mixle writes as llama.cpp files: one ``DecoderArch`` record each.

A record says what llama.cpp's converter (``convert_hf_to_gguf.py`` of the llama.cpp vendored by
llama-cpp-python 0.3.36) and its graph for the architecture do that the tensor names do not:
the llama.cpp architecture, whether q/k rows are reordered for its adjacent-pair rotary layout,
the offset added to norm weights (Gemma's ``(1 + w)`` RMSNorm: the converter adds 1), which
head the graph loads, the activation it computes, the metadata the converter writes beyond the
common keys (``METADATA``) and the configurations its graph computes differently (``CHECKS``,
refused with the reason). Tensor names are not here: ``mixle.gguf.layouts`` maps every module
path through gguf-py's own map (``gguf.get_tensor_name_map``), as the converter does.

This module imports neither torch nor gguf-py: ``mixle finetune`` reads ``SUPPORTED`` from it
before anything heavy is loaded.
"""

from dataclasses import dataclass

__all__ = ["DecoderArch", "DECODERS", "SUPPORTED", "METADATA", "CHECKS", "HEADS", "decoder_of", "rope_theta",
           "head_dim_of", "config_refusals", "config_metadata", "rope_dimension_count"]

HEADS = ("either", "tied", "untied")


def head_dim_of(config):
    """The attention head size of a transformers config (``head_dim``, else hidden / heads).

    >>> class Config: hidden_size, num_attention_heads, head_dim = 64, 4, None
    >>> head_dim_of(Config())
    16
    """
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope_params(config):
    """``[(which, rope parameters dict)]``: one for most families, one per attention type for Gemma 3."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    typed = [(which, params[which]) for which in ("full_attention", "sliding_attention")
             if isinstance(params.get(which), dict)]
    return typed or [("", params)]


def rope_theta(config):
    """The rotary base of the full-attention layers, or None when the rotary embedding is scaled.

    >>> class Config: rope_parameters = {"rope_type": "default", "rope_theta": 5e5}
    >>> rope_theta(Config())
    500000.0
    """
    scaling = getattr(config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        return None
    found = _rope_params(config)
    if any(params.get("rope_type", "default") != "default" for _, params in found):
        return None
    return float(found[0][1].get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _partial_rotary(config):
    params = _rope_params(config)[0][1]
    return float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))


_ACTIVATION_NAMES = {"silu": "SiLU", "gelu_pytorch_tanh": "tanh-approximated GELU"}


def _activation(config):
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")


def _swa_layers(config, period):
    """llama.cpp's sliding-window layers for a pattern of ``period`` (the last of each period is global)."""
    return ["sliding_attention" if i % period < period - 1 else "full_attention"
            for i in range(config.num_hidden_layers)]


# ---------------------------------------------------------------------------------- refusals
# name -> check(config, record) -> None, or (what llama.cpp would compute differently, the fix).

_FIX = "export a model with the default configuration of this family"


def _full_attention(config, record):
    window = getattr(config, "sliding_window", None)
    if window is not None:
        return (f"sliding_window={window} (llama.cpp's {record.arch!r} graph attends to every earlier position)",
                "set config.sliding_window=None if the model never sees longer contexts, or export another model")
    return None


def _full_rotary(config, record):
    factor = _partial_rotary(config)
    if factor != 1.0:
        return (f"partial_rotary_factor={factor} (llama.cpp's {record.arch!r} graph rotates whole heads)", _FIX)
    return None


def _swa_pattern(config, record):
    want = _swa_layers(config, record.swa_period)
    found = list(getattr(config, "layer_types", None) or want)
    if found != want:
        return (f"layer_types={found} (llama.cpp's {record.arch!r} graph makes every {record.swa_period}th layer "
                f"global and the others sliding-window: {want})", _FIX)
    return None


# llama.cpp gives the largest Gemma 2 / 3 (46 / 62 layers, "27B") the query scale 1/sqrt(hidden / heads),
# every other size 1/sqrt(head_dim) (its loader, after gemma_pytorch's config).
_LARGE_GEMMA_LAYERS = {"gemma2": 46, "gemma3": 62}


def _query_scale(config, record):
    size = config.hidden_size // config.num_attention_heads
    want = size if config.num_hidden_layers == _LARGE_GEMMA_LAYERS[record.arch] else head_dim_of(config)
    found = getattr(config, "query_pre_attn_scalar", want)
    if found != want:
        return (f"query_pre_attn_scalar={found} (llama.cpp's {record.arch!r} graph scales queries by 1/sqrt({want}) "
                f"for a model of {config.num_hidden_layers} layers)", _FIX)
    return None


def _softcaps(config, record):
    missing = [name for name in ("attn_logit_softcapping", "final_logit_softcapping")
               if getattr(config, name, None) is None]
    if missing:
        return (f"{missing[0]}=None (llama.cpp's {record.arch!r} graph always soft-caps, 50 and 30 unless the file "
                f"says otherwise)", _FIX)
    return None


def _no_attention_softcap(config, record):
    found = getattr(config, "attn_logit_softcapping", None)
    if found is not None:
        return f"attn_logit_softcapping={found} (llama.cpp's {record.arch!r} graph does not soft-cap attention)", _FIX
    return None


def _nope_layers(config, record):
    interval = getattr(config, "no_rope_layer_interval", 4)
    want = [int((i + 1) % 4 != 0) for i in range(config.num_hidden_layers)]
    found = list(getattr(config, "no_rope_layers", None) or want)
    if interval != 4 or found != want:
        return (f"no_rope_layers={found} (llama.cpp's {record.arch!r} graph skips the rotation on every 4th layer "
                f"only: {want})", _FIX)
    return None


def _top_k_sum(config, record):
    if not getattr(config, record.topk_flag, False):
        return (f"{record.topk_flag}=False: llama.cpp's {record.arch} graph always divides the top-k routing weights "
                f"by their sum, so the file would mix the experts with other weights",
                f"export a model with {record.topk_flag}=True (as Qwen3-30B-A3B's config)")
    return None


CHECKS = {"full_attention": _full_attention, "full_rotary": _full_rotary, "swa_pattern": _swa_pattern,
          "query_scale": _query_scale, "softcaps": _softcaps, "no_attention_softcap": _no_attention_softcap,
          "nope_layers": _nope_layers, "top_k_sum": _top_k_sum}


# ---------------------------------------------------------------------------------- metadata
# name -> rule(config) -> [(GGUFWriter method, value)]: what the converter writes for the family
# beyond the keys every decoder gets (``mixle.gguf.layouts``).

def _key_length(config):
    return [("add_key_length", head_dim_of(config)), ("add_value_length", head_dim_of(config))]


def _local_rope_base(config):
    found = dict(_rope_params(config))
    local = (found.get("sliding_attention") or {}).get("rope_theta", getattr(config, "rope_local_base_freq", None))
    return [] if local is None else [("add_rope_freq_base_swa", float(local))]


def _sliding_window_if_used(config):
    used = "sliding_attention" in (getattr(config, "layer_types", None) or ["sliding_attention"])
    return [("add_sliding_window", config.sliding_window)] if used and config.sliding_window else []


METADATA = {
    "key_length": _key_length,
    "attention_softcap": lambda config: [("add_attn_logit_softcapping", float(config.attn_logit_softcapping))],
    "final_softcap": lambda config: ([("add_final_logit_softcapping", float(config.final_logit_softcapping))]
                                     if getattr(config, "final_logit_softcapping", None) else []),
    "sliding_window": lambda config: [("add_sliding_window", config.sliding_window)],
    "sliding_window_if_used": _sliding_window_if_used,
    "sliding_window_or_zero": lambda config: [("add_sliding_window", getattr(config, "sliding_window", None) or 0)],
    "local_rope_base": _local_rope_base,
    "rope_original_context": lambda config: [("add_rope_scaling_orig_ctx_len",
                                              int(config.original_max_position_embeddings))],
}


@dataclass(frozen=True, kw_only=True)
class DecoderArch:
    """How one transformers causal-LM class is written as a llama.cpp file.

    Attributes:
        hf_class: the transformers class name (``"Gemma3ForCausalLM"``).
        arch: llama.cpp's architecture name (a value of ``gguf.MODEL_ARCH_NAMES``).
        permute_qk: reorder q/k rows (and biases) for llama.cpp's adjacent-pair rotary layout (its
            ``NORM`` rope); False where llama.cpp rotates halves as transformers does (``NEOX``).
        norm_offset: added to every norm weight (the converter's ``+ 1`` for Gemma's ``(1 + w)`` norm).
        head: the output head llama.cpp's graph loads: ``"either"``, ``"tied"`` (the token embedding
            only) or ``"untied"`` (an ``output.weight`` it requires).
        activation: the MLP activation llama.cpp's graph computes, as transformers names it.
        attention_bias: llama.cpp's graph reads an o_proj bias (``config.attention_bias=True``).
        swa_period: llama.cpp's sliding-window layer pattern (every ``swa_period``-th layer global), or 0.
        metadata: the names in ``METADATA`` of the keys the converter writes beyond the common ones.
        checks: the names in ``CHECKS`` of the refusals for configurations llama.cpp computes otherwise.
        experts: every layer's MLP is a sparse block of fused experts, written as ``ffn_*_exps``.
        moe_block: the class name of that sparse MLP block.
        topk_flag: the config flag that must be True because llama.cpp divides the top-k routing
            weights by their sum (Qwen3-MoE's ``norm_topk_prob``), or None.

    >>> DecoderArch(hf_class="LlamaForCausalLM", arch="llama", head="both")
    Traceback (most recent call last):
    ...
    ValueError: DecoderArch LlamaForCausalLM: head='both' is not one of ('either', 'tied', 'untied')
    """

    hf_class: str
    arch: str
    permute_qk: bool = False
    norm_offset: float = 0.0
    head: str = "either"
    activation: str = "silu"
    attention_bias: bool = False
    swa_period: int = 0
    metadata: tuple = ()
    checks: tuple = ()
    experts: bool = False
    moe_block: str | None = None
    topk_flag: str | None = None

    def __post_init__(self):
        def bad(what):
            raise ValueError(f"DecoderArch {self.hf_class}: {what}")

        if not (isinstance(self.hf_class, str) and self.hf_class.endswith("ForCausalLM")):
            bad(f"hf_class must name a transformers causal LM class (…ForCausalLM), got {self.hf_class!r}")
        if not (isinstance(self.arch, str) and self.arch and self.arch == self.arch.lower()):
            bad(f"arch must be llama.cpp's lower-case architecture name, got {self.arch!r}")
        if self.head not in HEADS:
            bad(f"head={self.head!r} is not one of {HEADS}")
        if self.activation not in _ACTIVATION_NAMES:
            bad(f"activation={self.activation!r} is not one of {sorted(_ACTIVATION_NAMES)}")
        if self.norm_offset not in (0.0, 1.0):
            bad(f"norm_offset={self.norm_offset!r}: llama.cpp's converters add 0 or 1")
        for field, table in (("metadata", METADATA), ("checks", CHECKS)):
            unknown = [name for name in getattr(self, field) if name not in table]
            if not isinstance(getattr(self, field), tuple) or unknown:
                bad(f"{field} must be a tuple of names in {sorted(table)}, got {getattr(self, field)!r}")
        if ("swa_pattern" in self.checks) != (self.swa_period > 0):
            bad("swa_period and the 'swa_pattern' check go together")
        if self.experts != (self.moe_block is not None) or (self.topk_flag is not None) != ("top_k_sum" in self.checks):
            bad("experts needs moe_block, and topk_flag the 'top_k_sum' check (and neither without)")


_DENSE = ("full_attention", "full_rotary")
_GEMMA = dict(norm_offset=1.0, activation="gelu_pytorch_tanh", checks=("swa_pattern", "query_scale"))

DECODERS = {record.hf_class: record for record in (
    DecoderArch(hf_class="LlamaForCausalLM", arch="llama", permute_qk=True, attention_bias=True, checks=_DENSE),
    DecoderArch(hf_class="Qwen2ForCausalLM", arch="qwen2", attention_bias=True, checks=_DENSE),
    DecoderArch(hf_class="MistralForCausalLM", arch="llama", permute_qk=True, checks=_DENSE),
    DecoderArch(hf_class="Qwen3ForCausalLM", arch="qwen3", checks=_DENSE),
    DecoderArch(hf_class="Gemma2ForCausalLM", arch="gemma2", head="tied", swa_period=2,
                metadata=("key_length", "attention_softcap", "final_softcap", "sliding_window"),
                **{**_GEMMA, "checks": _GEMMA["checks"] + ("softcaps",)}),
    DecoderArch(hf_class="Gemma3ForCausalLM", arch="gemma3", swa_period=6,
                metadata=("key_length", "final_softcap", "sliding_window_if_used", "local_rope_base"),
                **{**_GEMMA, "checks": _GEMMA["checks"] + ("no_attention_softcap",)}),
    DecoderArch(hf_class="Phi3ForCausalLM", arch="phi3", metadata=("rope_original_context", "sliding_window_or_zero"),
                checks=("full_attention",)),
    DecoderArch(hf_class="Olmo2ForCausalLM", arch="olmo2", head="untied", checks=_DENSE),
    DecoderArch(hf_class="SmolLM3ForCausalLM", arch="smollm3", permute_qk=True, checks=_DENSE + ("nope_layers",)),
    DecoderArch(hf_class="Qwen3MoeForCausalLM", arch="qwen3moe", experts=True, moe_block="Qwen3MoeSparseMoeBlock",
                topk_flag="norm_topk_prob", checks=("full_attention", "top_k_sum")),
    DecoderArch(hf_class="MixtralForCausalLM", arch="llama", permute_qk=True, attention_bias=True, experts=True,
                moe_block="MixtralSparseMoeBlock", checks=("full_attention",)),
)}

# What ``mixle finetune`` loads (dense decoders): class name -> llama.cpp architecture.
SUPPORTED = {name: record.arch for name, record in DECODERS.items() if not record.experts}


def decoder_of(model):
    """The record of a transformers model's class, or None for any other model.

    >>> decoder_of(object()) is None
    True
    """
    cls = type(model)
    if not cls.__module__.startswith("transformers."):
        return None
    return DECODERS.get(cls.__name__)


def config_refusals(config, record):
    """``[(why, fix)]`` for what llama.cpp's graph for ``record.arch`` computes differently from ``config``.

    >>> class Config:
    ...     hidden_act, sliding_window, rope_parameters = "silu", 4096, {"rope_theta": 1e4}
    >>> config_refusals(Config(), DECODERS["MistralForCausalLM"])[0][0]
    "sliding_window=4096 (llama.cpp's 'llama' graph attends to every earlier position)"
    """
    out = []
    if rope_theta(config) is None:
        out.append(("its rotary embedding is scaled (rope_parameters "
                    f"{getattr(config, 'rope_parameters', None)})", _FIX))
    if _activation(config) != record.activation:
        out.append((f"hidden_act={_activation(config)!r} (llama.cpp computes {_ACTIVATION_NAMES[record.activation]})",
                    _FIX))
    if getattr(config, "mlp_bias", False):
        out.append(("mlp_bias=True (llama.cpp's graph has no MLP biases)", _FIX))
    if not record.attention_bias and getattr(config, "attention_bias", False):
        out.append((f"attention_bias=True (llama.cpp's {record.arch} graph has no o_proj bias)", _FIX))
    out += [found for found in (CHECKS[name](config, record) for name in record.checks) if found]
    return out


def config_metadata(config, record):
    """``[(GGUFWriter method, value)]`` the converter writes for ``record``'s family beyond the common keys.

    >>> class Config: sliding_window, original_max_position_embeddings = None, 4096
    >>> config_metadata(Config(), DECODERS["Phi3ForCausalLM"])
    [('add_rope_scaling_orig_ctx_len', 4096), ('add_sliding_window', 0)]
    """
    return [pair for name in record.metadata for pair in METADATA[name](config)]


def rope_dimension_count(config):
    """The rotated dimensions per head (``partial_rotary_factor`` of Phi-3 and others)."""
    return int(head_dim_of(config) * _partial_rotary(config))
