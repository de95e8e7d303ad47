"""llama.cpp's quantization mixes as data: the block type ``llama-quantize`` gives each tensor.

A mix (llama.cpp's ftype, e.g. ``Q4_K_M``) is one ``GGUFMix`` record: its default block type and
the rules that give some layers more bits. ``tensor_types`` applies them to a model's GGUF tensors
exactly as llama.cpp's quantizer does (``llama_tensor_get_type`` in ``src/llama-quant.cpp`` of the
llama.cpp vendored by llama-cpp-python 0.3.36, no importance matrix, no overrides, ``pure`` off):

* Only tensors of two or more dimensions (as ggml counts them: trailing axes of one do not
  count) whose name ends in ``weight`` are quantized; norms, position embeddings and the other
  names of ``NOT_QUANTIZED`` keep their stored type (``None`` here).
* ``output.weight``, and ``token_embd.weight`` when the file has no ``output.weight`` (a tied
  head), get Q8_0 when the mix's default block does not divide their rows, else Q6_K (Q8_0
  under the Q8_0 mix). An untied ``token_embd`` gets the default.
* attn_v (and attn_qkv, attn_kv_b, which llama.cpp counts with it) and ffn_down of the layers a
  ``LayerRule`` selects get its type; counted in llama.cpp's order (by layer, then name):
  ``"more_bits"`` is llama.cpp's ``use_more_bits`` (the first and last eighth of the layers and
  every third between), ``"first_eighth"`` the first eighth, ``"first_four"`` the first four.
  An 80-layer GQA Llama (or Qwen2, ...: llama.cpp's "70B") gets Q5_K where attn_v would be Q4_K.
* Fallbacks, when a row's length is not a multiple of the chosen type's block: Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0 (``FALLBACKS``); a 32-block type stays; and F16 when even 32 does
  not divide the row.

* Mixtures of experts (``n_expert``): a 3-D expert tensor (numpy ``(experts, rows, cols)``) is
  quantized as its rows, and ffn_down's layer is read from its name; with exactly 8 experts
  (llama.cpp's Mixtral-8x rules) attn_v and attn_k get Q8_0 and, under Q4_K_S / Q4_K_M,
  attn_output Q5_K (``GGUFMix.eight_expert_attn_output``). ``MXFP4_MOE`` gives every expert
  tensor of more than one expert MXFP4 and every other quantized tensor (output too) Q8_0
  (``GGUFMix.expert_type``).

* With an importance matrix (``llama-quantize --imatrix``; ``tensor_types(..., imatrix=True)``)
  llama.cpp changes one rule of these mixes: under Q4_0, ffn_down of the first eighth of the
  layers is Q4_1 (``GGUFMix.imatrix_ffn_down``); Q4_K_S/M, Q5_K_S/M, Q6_K and Q8_0 keep their types.

The rows are a tensor's last axis (numpy order; ggml's ``ne[0]``). Not modeled (refused): the
Falcon architecture, whose rules differ.
"""

import re
from dataclasses import dataclass

from mixle.core.grids import GRIDS, DerivedTable

__all__ = ["GGUFMix", "LayerRule", "GGUF_MIXES", "FALLBACKS", "LAYER_RULES", "NOT_QUANTIZED", "mix_named",
           "tensor_types", "tensor_category", "grid_of_type", "use_more_bits", "fallback_type"]

# ggml type -> values per block, of the types mixle has grids for (F16 and F32: one value).
BLOCK_OF_TYPE = DerivedTable(lambda: {**{g.ggml_type: g.block for g in GRIDS.values() if g.ggml_type}, "F16": 1, "F32": 1})
GRID_OF_TYPE = DerivedTable(lambda: {g.ggml_type: g.name for g in GRIDS.values() if g.ggml_type})

# tensor_type_fallback: the 32-block type a 256-block type falls back to.
FALLBACKS = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}

# Substrings (and whole names) of weights llama.cpp never quantizes (tensor_allows_quantization).
NOT_QUANTIZED = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight", "attn_rel_b.weight",
    ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger",
    "a.rvq.codebook", "mm.a.code_embd",
) + tuple(f"time_mix_{part}.weight" for part in (
    "first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2", "g1", "g2", "decay_w1", "decay_w2", "lerp_fused"))
NOT_QUANTIZED_NAMES = ("position_embd.weight", "token_types.weight")

# tensor_get_category: exact names first, then the first substring found, in this order.
CATEGORY_NAMES = {"output.weight": "output", "token_embd.weight": "token_embd",
                  "per_layer_token_embd.weight": "token_embd"}
CATEGORY_PARTS = (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"), ("attn_v.weight", "attn_v"),
                  ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
                  ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down"))
ATTN_V_LIKE = ("attn_v", "attn_qkv", "attn_kv_b")

# Architectures whose loader calls a model of this many layers "70B" (llama: only with GQA).
SEVENTY_B_LAYERS = {"llama": 80, "qwen2": 80, "deci": 80, "olmo": 80, "jais2": 68}
REFUSED_ARCHITECTURES = ("falcon",)


def use_more_bits(i_layer, n_layers):
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers, and every third one between.

    >>> [i for i in range(8) if use_more_bits(i, 8)]
    [0, 3, 6, 7]
    """
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


LAYER_RULES = {
    "more_bits": use_more_bits,
    "first_eighth": lambda i, n: i < n // 8,
    "first_four": lambda i, n: i < 4,
}


@dataclass(frozen=True)
class LayerRule:
    """Layers of one kind that get another type: those ``LAYER_RULES[when]`` selects get ``type``.

    >>> LayerRule("more_bits", "Q6_K").picks(7, 8)
    True
    """

    when: str
    type: str

    def __post_init__(self):
        if self.when not in LAYER_RULES or self.type not in BLOCK_OF_TYPE:
            raise ValueError(f"LayerRule({self.when!r}, {self.type!r}): use a rule of {sorted(LAYER_RULES)} and a type "
                             f"of {sorted(BLOCK_OF_TYPE)}")

    def picks(self, index, count):
        """Whether layer ``index`` of ``count`` gets ``type``."""
        return LAYER_RULES[self.when](index, count)


@dataclass(frozen=True)
class GGUFMix:
    """One llama.cpp ftype.

    Attributes:
        name: the ftype's name (``"Q4_K_M"``), as ``llama-quantize`` takes it.
        ftype: llama.h's ``LLAMA_FTYPE_MOSTLY_<name>`` (``general.file_type``).
        default: the block type of every quantized tensor no rule picks.
        attn_v: the rule for attn_v (and attn_qkv), or None.
        ffn_down: the rule for ffn_down, or None.
        summary: one line for errors and docs.
        imatrix_ffn_down: the rule for ffn_down when the file is quantized with an importance
            matrix (``llama-quantize --imatrix``; llama.cpp's guard for Q4_0 / Q5_0), or None.
        expert_type: the type of every tensor of more than one expert (``MXFP4_MOE``), every other
            quantized tensor getting ``default``; None: experts follow the rules as 2-D tensors do.
        eight_expert_attn_output: attn_output's type in a model of exactly 8 experts, or None.
    """

    name: str
    ftype: int
    default: str
    attn_v: LayerRule | None = None
    ffn_down: LayerRule | None = None
    summary: str = ""
    imatrix_ffn_down: LayerRule | None = None
    expert_type: str | None = None
    eight_expert_attn_output: str | None = None


_MORE_Q6 = LayerRule("more_bits", "Q6_K")
GGUF_MIXES = {mix.name: mix for mix in (
    GGUFMix("Q4_0", 2, "Q4_0", summary="Q4_0 everywhere, output (and a tied token_embd) Q6_K",
            imatrix_ffn_down=LayerRule("first_eighth", "Q4_1")),
    GGUFMix("Q8_0", 7, "Q8_0", summary="Q8_0 everywhere"),
    GGUFMix("Q4_K_S", 14, "Q4_K", LayerRule("first_four", "Q5_K"), LayerRule("first_eighth", "Q5_K"),
            summary="Q4_K; attn_v of the first 4 layers and ffn_down of the first eighth Q5_K; output Q6_K",
            eight_expert_attn_output="Q5_K"),
    GGUFMix("Q4_K_M", 15, "Q4_K", _MORE_Q6, _MORE_Q6,
            summary="Q4_K; attn_v and ffn_down of the use_more_bits layers Q6_K; output Q6_K",
            eight_expert_attn_output="Q5_K"),
    GGUFMix("Q5_K_S", 16, "Q5_K", summary="Q5_K everywhere, output Q6_K"),
    GGUFMix("Q5_K_M", 17, "Q5_K", _MORE_Q6, _MORE_Q6,
            summary="Q5_K; attn_v and ffn_down of the use_more_bits layers Q6_K; output Q6_K"),
    GGUFMix("Q6_K", 18, "Q6_K", summary="Q6_K everywhere"),
    GGUFMix("MXFP4_MOE", 38, "Q8_0", summary="MXFP4 for the experts of MoE models, Q8_0 for every other matrix",
            expert_type="MXFP4"),
)}


def mix_named(mix):
    """The GGUFMix called ``mix`` (a name, case-insensitive, or a GGUFMix); ValueError listing them.

    >>> mix_named("q4_k_m").default
    'Q4_K'
    """
    if isinstance(mix, GGUFMix):
        return mix
    found = GGUF_MIXES.get(mix.upper()) if isinstance(mix, str) else None
    if found is None:
        known = ", ".join(f"{m.name!r} ({m.summary})" for m in GGUF_MIXES.values())
        raise ValueError(f"gguf_mix={mix!r} is unknown: use one of {known}")
    return found


def grid_of_type(ggml_type):
    """The mixle grid of a ggml block type (``"Q4_K"`` -> ``"q4_k"``), None for F16 / F32.

    >>> grid_of_type("Q6_K"), grid_of_type("F16")
    ('q6_k', None)
    """
    if ggml_type in ("F16", "F32"):
        return None
    if ggml_type not in GRID_OF_TYPE:
        raise ValueError(f"ggml type {ggml_type!r} has no mixle grid: those are {sorted(GRID_OF_TYPE)}")
    return GRID_OF_TYPE[ggml_type]


def tensor_category(name):
    """llama.cpp's category of a tensor name (``"attn_v"``, ``"ffn_down"``, ..., ``"other"``).

    >>> tensor_category("blk.3.attn_qkv.weight"), tensor_category("blk.0.ffn_down.weight")
    ('attn_qkv', 'ffn_down')
    """
    if name in CATEGORY_NAMES:
        return CATEGORY_NAMES[name]
    return next((category for part, category in CATEGORY_PARTS if part in name), "other")


def _ggml_n_dims(shape):
    """ggml_n_dims of a numpy-order shape: its axes, leading axes of one not counted (at least 1)."""
    axes = list(shape)
    while len(axes) > 1 and axes[0] == 1:
        axes.pop(0)
    return len(axes)


def _quantized(name, shape):
    """Whether llama.cpp quantizes the tensor at all (``tensor_allows_quantization``)."""
    if _ggml_n_dims(shape) < 2 or not name.endswith("weight") or name in NOT_QUANTIZED_NAMES:
        return False
    return not any(part in name for part in NOT_QUANTIZED)


def fallback_type(ggml_type, row):
    """The type llama.cpp writes when ``ggml_type``'s block does not divide rows of ``row`` values.

    >>> fallback_type("Q4_K", 320), fallback_type("Q6_K", 96), fallback_type("Q8_0", 40), fallback_type("Q4_K", 512)
    ('Q5_0', 'Q8_0', 'F16', 'Q4_K')
    """
    if row % BLOCK_OF_TYPE[ggml_type] == 0:
        return ggml_type
    if BLOCK_OF_TYPE[ggml_type] > 32:
        if ggml_type not in FALLBACKS:
            raise ValueError(f"llama.cpp defines no fallback for {ggml_type} with rows of {row} values")
        ggml_type = FALLBACKS[ggml_type]
    return ggml_type if row % BLOCK_OF_TYPE[ggml_type] == 0 else "F16"


def _layer_of(name, n_layer):
    found = re.match(r"blk\.(-?\d+)\.", name)
    if found is None or not 0 <= int(found.group(1)) < n_layer:
        raise ValueError(f"tensor {name!r}: an expert tensor needs its layer in its name (blk.N., N < {n_layer})")
    return int(found.group(1))


def _load_order(name):
    """llama.cpp's tensor order (``weight_name_comparer``): by layer (none first), then name."""
    found = re.match(r"blk\.(-?\d+)\.", name)
    return (int(found.group(1)) if found else -1, name)


@dataclass
class _Counters:
    """The quantizer's state over one file: the counts and running indices its rules read."""

    tied: bool
    n_attn_v: int
    n_layer: int
    n_expert: int
    seventy_b: bool
    imatrix: bool = False
    i_attn_v: int = 0
    i_ffn_down: int = 0


def _mix_type(mix, name, category, shape, state):
    """``llama_tensor_get_type_impl`` for the mixes of GGUF_MIXES (before the fallback)."""
    row, eight = shape[-1], state.n_expert == 8
    if category == "output" or (state.tied and category == "token_embd"):
        if row % BLOCK_OF_TYPE[mix.default]:
            return "Q8_0"
        return mix.default if mix.default == "Q8_0" else "Q6_K"
    if mix.expert_type is not None:  # ggml's ne[2] > 1: a tensor of several experts
        return mix.expert_type if len(shape) >= 3 and shape[-3] > 1 else mix.default
    if category in ATTN_V_LIKE:
        chosen = mix.attn_v.type if mix.attn_v and mix.attn_v.picks(state.i_attn_v, state.n_attn_v) else mix.default
        if state.seventy_b and chosen == "Q4_K":
            chosen = "Q5_K"
        state.i_attn_v += 1
        return "Q8_0" if eight else chosen
    if category == "attn_k" and eight:
        return "Q8_0"
    if category == "attn_output" and eight and mix.eight_expert_attn_output:
        return mix.eight_expert_attn_output
    if category == "ffn_down":
        index = state.i_ffn_down if state.n_expert <= 1 else _layer_of(name, state.n_layer)
        state.i_ffn_down += 1
        rule = mix.imatrix_ffn_down if state.imatrix and mix.imatrix_ffn_down else mix.ffn_down
        return rule.type if rule and rule.picks(index, state.n_layer) else mix.default
    return mix.default


def _seventy_b(architecture, n_layer, n_head, n_head_kv):
    if SEVENTY_B_LAYERS.get(architecture) != n_layer:
        return False
    if architecture != "llama":
        return True
    if n_head is None or n_head_kv is None:
        raise ValueError(f"a {n_layer}-layer llama is llama.cpp's 70B when its attention is grouped (more bits in "
                         f"attn_v): pass n_head and n_head_kv")
    return n_head != n_head_kv


def tensor_types(mix, tensors, architecture, n_layer, *, n_head=None, n_head_kv=None, n_expert=0, imatrix=False):
    """The ggml type llama.cpp's quantizer gives each tensor of a GGUF file under ``mix``.

    Args:
        mix: a ``GGUF_MIXES`` name (``"Q4_K_M"``) or GGUFMix.
        tensors: ``{gguf tensor name: shape}`` of every tensor in the file (numpy order: the last
            axis is the row), or ``(name, shape)`` pairs.
        architecture: the file's ``general.architecture`` (``"llama"``, ``"qwen2"``, ``"gpt2"``, ...).
        n_layer: the block count.
        n_head, n_head_kv: attention heads (only read for an 80-layer llama).
        n_expert: experts per MoE layer (0 or 1: a dense model; 8: llama.cpp's Mixtral-8x rules).
        imatrix: whether the file is quantized with an importance matrix (``llama-quantize
            --imatrix``): under Q4_0, ffn_down of the first eighth of the layers is then Q4_1
            (``GGUFMix.imatrix_ffn_down``); the other mixes' types do not change.

    Returns:
        ``{name: ggml type name}`` in the order given, None for tensors llama.cpp keeps as stored.

    Raises:
        ValueError: an unknown mix, a refused architecture, or a shape llama.cpp has no type for.

    >>> shapes = {"token_embd.weight": (64, 256), "blk.0.attn_v.weight": (64, 256),
    ...           "blk.0.ffn_down.weight": (256, 320), "blk.0.attn_norm.weight": (256,)}
    >>> tensor_types("Q4_K_M", shapes, "llama", 1)
    {'token_embd.weight': 'Q6_K', 'blk.0.attn_v.weight': 'Q6_K', 'blk.0.ffn_down.weight': 'Q8_0', 'blk.0.attn_norm.weight': None}
    """
    mix = mix_named(mix)
    shapes = {str(name): tuple(int(d) for d in shape) for name, shape in dict(tensors).items()}
    if architecture in REFUSED_ARCHITECTURES:
        raise ValueError(f"tensor_types models llama.cpp's rules for non-Falcon models; got architecture="
                         f"{architecture!r}, whose rules differ")
    if not (isinstance(n_layer, int) and n_layer > 0):
        raise ValueError(f"n_layer={n_layer!r} must be the file's positive block count")
    categories = {name: tensor_category(name) for name in shapes}
    state = _Counters(tied="output.weight" not in shapes, n_attn_v=sum(c in ATTN_V_LIKE for c in categories.values()),
                      n_layer=n_layer, n_expert=n_expert, imatrix=bool(imatrix),
                      seventy_b=_seventy_b(architecture, n_layer, n_head, n_head_kv))
    chosen = {}
    for name in sorted(shapes, key=_load_order):
        shape = shapes[name]
        if not _quantized(name, shape):
            chosen[name] = None
            continue
        chosen[name] = fallback_type(_mix_type(mix, name, categories[name], shape, state), shape[-1])
    return {name: chosen[name] for name in shapes}
