"""GGUF export: a model as the file llama.cpp runs, with the ggml blocks QAT trained on.

``save_gguf`` writes, through gguf-py's ``GGUFWriter`` (architectures in
``mixle.gguf.layouts``):

* mixle's ``build_causal_lm`` (pre-norm blocks, fused qkv with bias, learned positions,
  LayerNorm, GELU, head tied to the token embedding) as llama.cpp's ``gpt2``, whose graph computes
  tanh-approximated GELU: a model built with ``activation="gelu_tanh"`` (an erf-GELU model is
  refused unless ``allow_activation_mismatch=True``);
* transformers' dense decoders of ``mixle.gguf.architectures.DECODERS`` (Llama, Mistral, Qwen2, Qwen3,
  Gemma 2 / 3, Phi-3, OLMo2, SmolLM3) as llama.cpp's converter writes them, tied or untied;
* the mixtures of experts ``Qwen3MoeForCausalLM`` as ``qwen3moe`` and ``MixtralForCausalLM`` as
  ``llama`` with experts: the router as F32 ``ffn_gate_inp``, the fused expert weights as the 3-D
  ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps`` (numpy ``(E, rows, cols)``, gguf
  ``ne = [cols, rows, E]``), float or as the blocks of a QAT/converted experts layer.

The model may be float, QAT-wrapped (``apply_qat``) or converted (``convert``):

* A layer fake-quantized (or converted) on a llama.cpp grid (``"q4_0"``, ``"q8_0"``; the
  ``QuantizedArray`` of any grid with a ``ggml_type``: ``"q4_k"``, ``"q6_k"``, ...) is written as
  the ggml blocks of exactly its codes and scales: no re-quantization, so the weights llama.cpp
  multiplies with are the fake-quantized weights QAT trained with, bit for bit. ``quantized=``
  gives such an array for any layer (by its model path) directly.
* Layers on another grid (e.g. mixle's symmetric int4) have no GGUF block type and are refused,
  naming the layer, before any file is created.
* Float matrices (layers left out of QAT, and the token embedding when the tied head is not
  quantized) follow ``float_matrices``: ``"q8_0"`` (the default: gguf's own quantizer, llama.cpp's
  QAT convention for embedding and output), ``"f16"`` or ``"f32"``; or, with ``gguf_mix="Q4_K_M"``
  (any of ``mixle.gguf.mixes.GGUF_MIXES``), the block type llama.cpp's quantizer gives that
  tensor in that mix, quantized bit for bit as it does: the file then equals what
  ``llama-quantize`` makes of the float model (and QAT layers must be on the mix's type).
* Position embeddings, norm weights and all biases are F32.
* The tokenizer: every ``tokenizer.*`` key llama.cpp's converter writes (pre-tokenizer name,
  special-token ids and flags, chat template), copied verbatim from ``source_gguf`` or derived
  from a transformers tokenizer (``mixle.gguf.tokenizer``), so llama.cpp tokenizes a
  user's text as the model's own tokenizer does.
* A tied head is stored once, as ``token_embd`` (no ``output.weight``: llama.cpp then uses the
  token embedding as its output matrix); an untied head is written as ``output.weight``.

Layout: every matrix is written in torch's ``(out, in)`` row order, which gguf stores as
``ne = [in, out]``; gpt2's fused qkv rows stay ``[q; k; v]`` (what llama.cpp's gpt2 graph
splits); only Llama's q/k rows are permuted (see ``mixle.gguf.layouts``).

Numerics llama.cpp computes differently (``benchmarks/gguf_parity.py`` measures it): its KV cache
is float16 by default, its CPU GELU goes through a float16 table, and its CPU path quantizes
activations to Q8_0 before Q4_0/Q8_0 products (train and evaluate with ``act_bits=8`` on the
q4_0/q8_0 grids to fake-quantize them the same way).
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mixle.core.fileformat import replace_atomically
from mixle.core.grids import GRIDS
from mixle.core.numerics import quantize_array
from mixle.core.spec import QuantSpec
from mixle.core.stored import QuantizedArray
from mixle.gguf.flax_twin import is_flax, torch_twin
from mixle.gguf.blocks import BLOCK, GGML_BLOCKS, GGML_TYPE_OF_GRID, pack_array
from mixle.gguf.imatrix_file import importance_by_tensor, require_entry
from mixle.gguf.mixes import grid_of_type, mix_named
from mixle.gguf.plan import full_shape, plan_of
from mixle.gguf.reader import load_gguf_weights  # noqa: F401  (its old path: the reader was this module's)
from mixle.gguf.tokenizer import gguf_tokenizer
from mixle.torch_backend.gather import check_writable, gather_weights

__all__ = ["save_gguf", "load_gguf_weights", "gguf_mix_types", "gguf_mix_specs", "FLOAT_MATRICES"]
FLOAT_MATRICES = ("q8_0", "f16", "f32")


@dataclass
class _Tensor:
    """One tensor to write: ``data`` (numpy) and the ggml type name (``"F32"``, ``"Q4_0"``, ...)."""

    name: str
    data: np.ndarray
    ggml_type: str


def _plan_matrix(part, data, float_matrices, gguf, mix_type, importance=None):
    """The tensor for a weight from its gathered ``data`` (float32 numpy, or the QuantizedArray of a
    QAT, converted or ``quantized=`` layer), or ValueError naming the layer.

    ``mix_type``: the type ``gguf_mix`` gives the tensor (``_FLOAT_MATRICES``: no mix).
    ``importance``: ``{gguf name: importance}`` a float matrix the mix quantizes is weighted by, or None.
    """
    path, gguf_name = part.path, part.name
    want = full_shape(part) if isinstance(data, QuantizedArray) else None  # the layer's whole weight
    if want is None:
        if part.tensor is not None:  # a float matrix llama.cpp keeps F32 (a router)
            return _Tensor(gguf_name, data, "F32")
        if mix_type is _FLOAT_MATRICES:
            return _float_matrix(data, path, gguf_name, float_matrices, gguf)
        if importance is not None:
            require_entry(gguf_name, mix_type, importance)
        return _mix_matrix(data, path, gguf_name, mix_type, None if importance is None else importance.get(gguf_name))
    quantized, spec = data, data.spec
    if spec.grid_record.ggml_type not in GGML_BLOCKS:
        raise ValueError(
            f"layer {path!r} is quantized on {spec.short()}, which GGUF has no block type for: train it on "
            f"{' or '.join(f'grid={name!r}' for name in GGML_TYPE_OF_GRID)} (llama.cpp's "
            f"{' / '.join(GGML_TYPE_OF_GRID.values())}), or leave it out of apply_qat so it is "
            f"written as float_matrices={float_matrices!r}"
        )
    if tuple(quantized.shape) != want:
        raise ValueError(f"quantized[{path!r}] has shape {list(quantized.shape)}, but the layer's weight is "
                         f"{list(want)}: quantize the layer's own weight")
    if mix_type is not _FLOAT_MATRICES and spec.grid_record.ggml_type != mix_type:
        raise ValueError(
            f"layer {path!r} is quantized on {spec.short()} ({spec.grid_record.ggml_type}), but llama.cpp's "
            f"quantizer gives {gguf_name!r} {mix_type} in this gguf_mix: train it on grid={grid_of_type(mix_type)!r} "
            f"(gguf_mix_specs gives every layer's spec), or leave gguf_mix unset")
    try:
        blocks = pack_array(quantized, f"layer {path!r}")
    except ValueError as err:
        message = str(err)
        raise ValueError(message if message.startswith("layer ") else f"layer {path!r}: {message}") from None
    if part.experts:  # the whole weight's blocks (rows, bytes), as the part's (..., rows, bytes) slice
        blocks = blocks.reshape(*want[:-1], -1)
        blocks = blocks if part.row_slice is None else np.ascontiguousarray(blocks[..., part.row_slice, :])
    return _Tensor(gguf_name, blocks, spec.grid_record.ggml_type)


def _mix_matrix(array, path, gguf_name, ggml_type, importance=None):
    """A float32 weight as llama.cpp's quantizer writes it on ``ggml_type`` (None: kept as F32), with
    ``importance`` (``(in,)``, or ``(experts, in)`` for a 3-D expert weight) as ``llama-quantize --imatrix``."""
    if ggml_type in (None, "F32"):
        return _Tensor(gguf_name, array, "F32")
    if ggml_type == "F16":
        return _Tensor(gguf_name, array.astype(np.float16), "F16")
    grid = grid_of_type(ggml_type)
    extra = {} if importance is None else {"importance": importance, "batch_ndim": array.ndim - 2}
    quantized = quantize_array(array, grid=grid, name=f"layer {path!r}", **extra)
    return _Tensor(gguf_name, pack_array(quantized, f"layer {path!r}"), ggml_type)


def _float_matrix(array, path, gguf_name, float_matrices, gguf):
    if float_matrices == "f32":
        return _Tensor(gguf_name, array, "F32")
    if float_matrices == "f16":
        return _Tensor(gguf_name, array.astype(np.float16), "F16")
    if array.shape[-1] % BLOCK:
        raise ValueError(
            f"layer {path!r} has rows of {array.shape[-1]} values, which Q8_0 blocks of {BLOCK} do not divide: "
            f"pass float_matrices='f16' or 'f32'"
        )
    return _Tensor(gguf_name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), "Q8_0")


# gguf_mix unset: float matrices follow float_matrices.
_FLOAT_MATRICES = object()


def _check_quantized_paths(layout, quantized):
    """Refuse ``quantized=`` entries for paths that are no weight matrix of the layout."""
    matrices = [part.path for part in layout.parts if part.module is not None]
    unknown = sorted(set(quantized) - set(matrices))
    if unknown:
        raise ValueError(f"quantized names {unknown}, which are not weight matrices save_gguf writes: use the "
                         f"layers' model paths, e.g. {matrices[:3]}")


def _tensors(layout, weights, types, float_matrices, gguf, importance=None):
    """Every tensor of the layout as bytes to write, from the gathered ``weights`` (``gather_weights``:
    numpy arrays and QuantizedArrays); all refusals happen here, before any file.

    ``types``: ``{gguf name: ggml type}`` of ``gguf_mix`` (None: no mix).
    ``importance``: ``{gguf name: importance}`` (``importance_by_tensor``), or None."""
    tensors = []
    for part in layout.parts:
        data = weights[part.name]
        if part.module is not None:
            mix_type = _FLOAT_MATRICES if types is None else types[part.name]
            tensor = _plan_matrix(part, data, float_matrices, gguf, mix_type, importance)
        else:
            tensor = _Tensor(part.name, data + np.float32(part.offset) if part.offset else data, "F32")
        if part.rows is not None:  # whole rows move: quantized blocks run along a row
            tensor.data = np.take(tensor.data, part.rows, axis=0 if tensor.data.ndim == 1 else -2)
        tensors.append(tensor)
    return tensors


def _importance(plan, importance):
    """``{gguf name: importance}`` of any form ``quantize_model`` takes, validated; None for None."""
    return None if importance is None else importance_by_tensor(plan, importance)


def gguf_mix_types(model, gguf_mix, *, importance=None):
    """``{gguf tensor name: ggml type or None}``: what llama.cpp's quantizer gives each tensor of
    ``save_gguf(model, ...)``'s file under ``gguf_mix`` (None: kept float, e.g. norms and biases).

    ``importance`` (any form ``quantize_model`` takes; checked against the model): the types
    ``llama-quantize --imatrix`` gives (Q4_0: the first eighth of the ffn_down layers Q4_1).

    >>> from mixle.models.transformer import build_causal_lm
    >>> types = gguf_mix_types(build_causal_lm(vocab=40, d_model=256, n_layer=1, n_head=2, block=8), "Q4_K_M")
    >>> types["blk.0.attn_qkv.weight"], types["blk.0.ffn_down.weight"], types["token_embd.weight"], types["blk.0.ffn_up.bias"]
    ('Q6_K', 'Q6_K', 'Q6_K', None)
    """
    plan = plan_of(model, "gguf_mix_types")
    mix = mix_named(gguf_mix)
    return plan.mix_types(mix, _importance(plan, importance) is not None)


def gguf_mix_specs(model, gguf_mix, *, importance=None):
    """``{layer path: QuantSpec or None}``: the grid to train each weight matrix on so that
    ``save_gguf(..., gguf_mix=...)`` writes the file llama.cpp's quantizer would (None: the mix
    keeps it float, F16/F32). A head tied to the token embedding gets the embedding's spec.
    ``importance``: as for ``gguf_mix_types`` (the types of ``llama-quantize --imatrix``).

    >>> from mixle.models.transformer import build_causal_lm
    >>> specs = gguf_mix_specs(build_causal_lm(vocab=40, d_model=64, n_layer=4, n_head=2, block=8), "Q4_K_M")
    >>> specs["blocks.0.qkv"].grid, specs["blocks.2.qkv"].grid, specs["tok"].grid, specs["head"].grid
    ('q5_0', 'q8_0', 'q8_0', 'q8_0')
    """
    plan = plan_of(model, "gguf_mix_specs")
    layout = plan.layout
    mix = mix_named(gguf_mix)
    types = plan.mix_types(mix, _importance(plan, importance) is not None)
    specs, names = {}, {}
    for part in layout.parts:
        if part.module is not None:
            grid = grid_of_type(types[part.name]) if types[part.name] else None
            spec = None if grid is None else QuantSpec(grid=grid)
            path = part.path.rpartition(".")[0] if part.experts else part.path  # one spec per experts layer
            if path in specs and specs[path] != spec:
                raise ValueError(
                    f"gguf_mix={gguf_mix!r} gives {names[path]!r} {types[names[path]]} but {part.name!r} "
                    f"{types[part.name]}, and both are weights of {path!r}, which QAT quantizes with one spec: "
                    f"pick a mix that gives its experts one type (e.g. 'Q4_0', 'Q8_0', 'MXFP4_MOE'), or write the "
                    f"float model with save_gguf(..., gguf_mix={gguf_mix!r})")
            specs[path] = spec
            names.setdefault(path, part.name)
    if layout.tied and layout.head_path is not None:
        specs[layout.head_path] = specs[layout.parts[0].path]
    return specs


# ----------------------------------------------------------------------------------------------

def _file_type(tensors, gguf, mix):
    """general.file_type: the mix's, else that of the grid of highest precedence (``Grid.file_type_rank``)
    among the tensors' types, else F16 / F32."""
    if mix is not None:
        return gguf.LlamaFileType(mix.ftype)
    types = {t.ggml_type for t in tensors}
    ranked = sorted((g.file_type_rank, g.file_type) for g in GRIDS.values() if g.file_type and g.ggml_type in types)
    if ranked:
        return getattr(gguf.LlamaFileType, ranked[0][1])
    return gguf.LlamaFileType.MOSTLY_F16 if "F16" in types else gguf.LlamaFileType.ALL_F32


def save_gguf(model, path, *, vocab=None, tokenizer=None, float_matrices=None, gguf_mix=None, quantized=None,
              name=None, allow_activation_mismatch=False, importance=None, source_gguf=None, tokenizer_pre=None):
    """Write a causal LM as a GGUF file llama.cpp loads (``gpt2``, ``llama``, ``qwen3``, ``gemma3``, ...).

    Layers QAT-trained (or converted) on a llama.cpp grid are written as the ggml blocks of their
    own codes and scales, so llama.cpp multiplies with exactly the weights QAT trained with; see
    the module docstring for the other tensors and the layout. Everything is checked before the
    file is created, written to a temporary file and renamed into place: a failed call leaves none.

    Args:
        model: mixle's ``build_causal_lm``, a transformers causal LM of ``architectures.DECODERS`` or a
            Flax one (``mixle.lm.flax_causal_lm``): float, after ``apply_qat`` or ``convert``.
        path: the ``.gguf`` file to write (replaced if it exists).
        vocab, tokenizer, source_gguf, tokenizer_pre: the tokenizer, as ``gguf_tokenizer`` takes them: each
            id's token; a Hugging Face byte-level BPE or SentencePiece tokenizer (as llama.cpp's converter writes it;
            ``tokenizer_pre``: a byte-level BPE's pre-tokenizer name), a mixle Char/ByteTokenizer; or the GGUF the model was read from (copied verbatim).
        float_matrices: how float weight matrices are stored: ``"q8_0"`` (default), ``"f16"``, ``"f32"``.
        gguf_mix: instead, a llama.cpp ftype (``"Q4_K_M"``, ...: ``mixle.gguf.mixes.GGUF_MIXES``):
            float matrices become what llama.cpp's quantizer makes of them, QAT layers must be on
            the type it picks (``gguf_mix_specs``), and ``general.file_type`` is the mix's.
        quantized: ``{layer path: QuantizedArray}`` written instead of that layer's weight (its
            grid's ggml blocks, packed from its fields, e.g. ``quantize_array(w, grid="q4_k")``); a
            fused expert weight by its parameter's path (``"model.layers.0.mlp.experts.gate_up_proj"``):
            all of it, ``quantize_linear_weight(w, grid="q4_0", batch_axis_count=1)``.
        name: ``general.name`` (default: the file's stem).
        allow_activation_mismatch: write a model whose activation llama.cpp's graph does not
            compute (a ``build_causal_lm`` with erf GELU); refused by default.
        importance: with ``gguf_mix``, an importance matrix (as ``quantize_model`` takes it): the
            file ``llama-quantize --imatrix`` makes (types, weighted search of float matrices).
            Refused without a mix, for another model, or lacking a ``blk.*`` matrix the mix weights.

    Returns:
        ``{gguf tensor name: ggml type name}`` of what was written.

    Raises:
        ValueError: an unsupported architecture, a layer on a grid GGUF has no type for (or not the
            mix's), a float16-overflowing scale, an activation llama.cpp does not compute, or a
            tokenizer that does not fit (``gguf_tokenizer``); the message names the layer or argument and the fix.

    >>> import os, tempfile, torch
    >>> from mixle.models.transformer import build_causal_lm
    >>> from mixle.models.qat import apply_qat
    >>> lm = build_causal_lm(vocab=40, d_model=32, n_layer=1, n_head=2, block=8, activation="gelu_tanh")
    >>> types = save_gguf(apply_qat(lm, grid="q4_0"), os.path.join(tempfile.mkdtemp(), "lm.gguf"))
    >>> types["token_embd.weight"], types["blk.0.attn_qkv.weight"], types["blk.0.attn_qkv.bias"]
    ('Q4_0', 'Q4_0', 'F32')
    """
    model, quantized = _torch_model(model, quantized)
    gguf = (plan := plan_of(model, "save_gguf")).gguf
    mix, float_matrices, quantized = _check_save_arguments(plan, float_matrices, gguf_mix, quantized,
                                                           allow_activation_mismatch, importance)
    layout = _checked_layout(plan, allow_activation_mismatch)
    words = _file_tokenizer(model, layout, vocab, tokenizer, source_gguf, tokenizer_pre)
    types = None if mix is None else plan.mix_types(mix, importance is not None)
    _check_quantized_paths(layout, quantized)
    importance = _importance(plan, importance)
    tensors = _tensors(layout, gather_weights(layout.parts, quantized), types, float_matrices, gguf, importance)
    path = _checked_path(path)
    replace_atomically(path, lambda tmp: _write(tmp, layout, tensors, words, name or path.stem, mix, gguf))
    return {t.name: t.ggml_type for t in tensors}


def _checked_path(path):
    """``path`` as a Path, after refusing one whose directory does not exist."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"path={str(path)!r}: the directory {str(path.parent)!r} does not exist")
    return path


def _torch_model(model, quantized):
    """``(model, quantized)`` to write: a Flax causal LM (float, QAT-wrapped or converted) as its
    transformers twin holding its weights, and the blocks of its quantized kernels added to
    ``quantized`` (``mixle.gguf.flax_twin``): the file equals the torch model's, byte for byte."""
    if not is_flax(model):
        return model, quantized
    twin, given = torch_twin(model, "save_gguf")
    return twin, {**given, **(quantized or {})}


def _file_tokenizer(model, layout, vocab, tokenizer, source_gguf, tokenizer_pre):
    """The file's ``tokenizer.*`` keys (``gguf_tokenizer``) for the model's embedding rows and architecture."""
    return gguf_tokenizer(layout.vocab_size, vocab=vocab, tokenizer=tokenizer, source_gguf=source_gguf,
                          tokenizer_pre=tokenizer_pre, arch=layout.arch, config=getattr(model, "config", None))


def _checked_layout(plan, allow_activation_mismatch):
    """The model's layout, after refusing what llama.cpp would compute differently (unless allowed)."""
    layout = plan.layout
    if layout.notes and not allow_activation_mismatch:
        what, fix = layout.notes[0]
        raise ValueError(f"save_gguf: {what}; {fix}")
    return layout


def _check_save_arguments(plan, float_matrices, gguf_mix, quantized, allow_activation_mismatch, importance):
    """``(mix or None, float_matrices, quantized dict)`` after checking save_gguf's arguments."""
    check_writable(plan.model)  # a torch model, without layers a file cannot store (LoRA: fold them in first)
    if float_matrices is not None and float_matrices not in FLOAT_MATRICES:
        raise ValueError(f"float_matrices={float_matrices!r} is unknown: use one of {FLOAT_MATRICES}")
    if float_matrices is not None and gguf_mix is not None:
        raise ValueError(f"float_matrices={float_matrices!r} and gguf_mix={gguf_mix!r} both say how float matrices "
                         f"are stored (gguf_mix: as llama.cpp's quantizer does): pass one")
    if not isinstance(allow_activation_mismatch, bool):
        raise TypeError(f"allow_activation_mismatch must be True or False, got {allow_activation_mismatch!r}")
    quantized = {} if quantized is None else quantized
    if not isinstance(quantized, dict) or not all(isinstance(q, QuantizedArray) for q in quantized.values()):
        raise TypeError("quantized must be {layer path: QuantizedArray}, e.g. {'blocks.0.fc': quantize_array(w, "
                        "grid='q4_k')}")
    if importance is not None and gguf_mix is None:
        raise ValueError("importance= is used where llama-quantize --imatrix uses it, in quantizing float matrices "
                         "to a mix's types: pass gguf_mix= too, or quantize first with quantize_model(..., importance=)")
    mix = None if gguf_mix is None else mix_named(gguf_mix)
    return mix, float_matrices or "q8_0", quantized


def _write(path, layout, tensors, words, name, mix, gguf):
    """Write the GGUF file at ``path`` (the temporary file ``replace_atomically`` moves into place)."""
    writer = gguf.GGUFWriter(path, arch=layout.arch)
    try:
        writer.add_name(name)
        for method, value in layout.hparams:
            getattr(writer, method)(value)
        writer.add_file_type(_file_type(tensors, gguf, mix))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        words.add_to(writer)
        for tensor in tensors:
            raw_dtype = None if tensor.ggml_type in ("F32", "F16") else getattr(gguf.GGMLQuantizationType, tensor.ggml_type)
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
