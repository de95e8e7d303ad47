"""GGUF export: a model as the file llama.cpp runs, with the Q4_0/Q8_0 blocks QAT trained on.

``save_gguf`` writes, through gguf-py's ``GGUFWriter`` (architectures in
``mixle.exports.gguf_layouts``):

* mixle's ``build_causal_lm`` (pre-norm blocks, fused qkv with bias, learned positions,
  LayerNorm, GELU, head tied to the token embedding) as llama.cpp's ``gpt2``, whose graph computes
  tanh-approximated GELU: a model built with ``activation="gelu_tanh"`` (an erf-GELU model is
  refused unless ``allow_activation_mismatch=True``);
* transformers' ``LlamaForCausalLM`` as ``llama`` (q/k rows reordered for llama.cpp's rotary
  layout) and ``Qwen2ForCausalLM`` as ``qwen2``, tied or untied.

The model may be float, QAT-wrapped (``apply_qat``) or converted (``convert``):

* A layer fake-quantized (or converted) on ``grid="q4_0"`` / ``"q8_0"`` is written as the
  Q4_0 / Q8_0 blocks of exactly its codes and float16 scales: no re-quantization, so the weights
  llama.cpp multiplies with are the fake-quantized weights QAT trained with, bit for bit.
* Layers on another grid (e.g. mixle's symmetric int4) have no GGUF block type and are refused,
  naming the layer, before any file is created.
* Float matrices (layers left out of QAT, and the token embedding when the tied head is not
  quantized) follow ``float_matrices``: ``"q8_0"`` (the default: gguf's own quantizer, llama.cpp's
  QAT convention for embedding and output), ``"f16"`` or ``"f32"``.
* Position embeddings, norm weights and all biases are F32.
* A tied head is stored once, as ``token_embd`` (no ``output.weight``: llama.cpp then uses the
  token embedding as its output matrix); an untied head is written as ``output.weight``.

Layout: every matrix is written in torch's ``(out, in)`` row order, which gguf stores as
``ne = [in, out]``; gpt2's fused qkv rows stay ``[q; k; v]`` (what llama.cpp's gpt2 graph
splits); only Llama's q/k rows are permuted (see ``gguf_layouts``).

Numerics llama.cpp computes differently (``benchmarks/gguf_parity.py`` measures it): its KV cache
is float16 by default, its CPU GELU goes through a float16 table, and its CPU path quantizes
activations to Q8_0 before Q4_0/Q8_0 products (train and evaluate with ``act_bits=8`` on the
q4_0/q8_0 grids to fake-quantize them the same way).
"""

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from mixle._optional import require
from mixle.core.fileformat import replace_atomically
from mixle.exports.ggml_blocks import BLOCK, GGML_BLOCKS, GGML_TYPE_OF_GRID, pack_blocks
from mixle.exports.gguf_layouts import layout_of
from mixle.exports.gguf_vocab import vocabulary
from mixle.torch_backend.convert import check_convertible
from mixle.torch_backend.layer_kinds import kind_of_qat
from mixle.torch_backend.quantized import QuantizedWeight

__all__ = ["save_gguf", "load_gguf_weights", "FLOAT_MATRICES"]

FLOAT_MATRICES = ("q8_0", "f16", "f32")


@dataclass
class _Tensor:
    """One tensor to write: ``data`` (numpy) and the ggml type name (``"F32"``, ``"Q4_0"``, ...)."""

    name: str
    data: np.ndarray
    ggml_type: str


def _plan_matrix(module, path, gguf_name, float_matrices, gguf):
    """The tensor for a 2-D weight of ``module`` (float, QAT or converted), or ValueError naming ``path``."""
    spec = getattr(module, "spec", None)
    if isinstance(module, QuantizedWeight):
        quantized = module.quantized_array()
    elif spec is not None and kind_of_qat(module) is not None:
        try:  # the codes convert would store: the fake-quant forward's, bit for bit
            quantized = kind_of_qat(module).quantize(module.weight.detach(), spec)
        except ValueError as err:
            raise ValueError(f"layer {path!r}: {err}") from None
    else:
        return _float_matrix(module.weight.detach(), path, gguf_name, float_matrices, gguf)
    if spec.grid_record.ggml_type not in GGML_BLOCKS:
        raise ValueError(
            f"layer {path!r} is quantized on {spec.short()}, which GGUF has no block type for: train it on "
            f"{' or '.join(f'grid={name!r}' for name in GGML_TYPE_OF_GRID)} (llama.cpp's "
            f"{' / '.join(GGML_TYPE_OF_GRID.values())}), or leave it out of apply_qat so it is "
            f"written as float_matrices={float_matrices!r}"
        )
    codes = quantized.codes.detach().cpu().numpy()
    scale = quantized.scale.detach().cpu().to(torch.float32).numpy().ravel()
    try:
        blocks = pack_blocks(spec.grid_record, codes, scale)
    except ValueError as err:
        raise ValueError(f"layer {path!r}: {err}") from None
    return _Tensor(gguf_name, blocks, spec.grid_record.ggml_type)


def _float_matrix(weight, path, gguf_name, float_matrices, gguf):
    array = weight.cpu().to(torch.float32).numpy()
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


def _vector(tensor, gguf_name):
    return _Tensor(gguf_name, tensor.detach().cpu().to(torch.float32).numpy(), "F32")


def _plan(layout, float_matrices, gguf):
    """Every tensor of ``layout`` as bytes to write (all refusals happen here, before any file)."""
    tensors = []
    for part in layout.parts:
        if part.module is not None:
            tensor = _plan_matrix(part.module, part.path, part.name, float_matrices, gguf)
        else:
            tensor = _vector(part.tensor, part.name)
        if part.rows is not None:  # whole rows move: quantized blocks run along a row
            tensor.data = tensor.data[part.rows]
        tensors.append(tensor)
    return tensors


# ----------------------------------------------------------------------------------------------


def _file_type(tensors, gguf):
    types = {t.ggml_type for t in tensors}
    for ggml_type, file_type in (("Q4_0", "MOSTLY_Q4_0"), ("Q8_0", "MOSTLY_Q8_0"), ("F16", "MOSTLY_F16")):
        if ggml_type in types:
            return getattr(gguf.LlamaFileType, file_type)
    return gguf.LlamaFileType.ALL_F32


def save_gguf(model, path, *, vocab=None, tokenizer=None, float_matrices="q8_0", name=None,
              allow_activation_mismatch=False):
    """Write a causal LM as a GGUF file llama.cpp loads (``gpt2``, ``llama`` or ``qwen2``).

    Layers QAT-trained (or converted) on ``grid="q4_0"`` / ``"q8_0"`` are written as the Q4_0 /
    Q8_0 blocks of their own codes and float16 scales, so llama.cpp multiplies with exactly the
    weights QAT trained with. See the module docstring for the other tensors and the layout.
    Everything is checked before the file is created; it is written to a temporary file in the
    same directory and renamed into place, so a failed call leaves no file behind.

    Args:
        model: mixle's ``build_causal_lm``, or transformers' ``LlamaForCausalLM`` /
            ``Qwen2ForCausalLM``: float, after ``apply_qat`` or after ``convert``.
        path: the ``.gguf`` file to write (replaced if it exists).
        vocab: the token of each id (str or bytes), e.g. a CharTokenizer's characters.
        tokenizer: instead of ``vocab``: a mixle ``CharTokenizer`` / ``ByteTokenizer``, or a
            Hugging Face fast tokenizer with a byte-level BPE model (GPT-2, Llama 3, Qwen2);
            see ``mixle.exports.gguf_vocab``.
        float_matrices: how float weight matrices are stored: ``"q8_0"``, ``"f16"`` or ``"f32"``.
        name: ``general.name`` (default: the file's stem).
        allow_activation_mismatch: write a model whose activation llama.cpp's graph does not
            compute (a ``build_causal_lm`` with erf GELU, where the file computes tanh GELU);
            refused by default, because llama.cpp's outputs would then differ from the model's.

    Returns:
        ``{gguf tensor name: ggml type name}`` of what was written.

    Raises:
        ValueError: an unsupported architecture, a layer on a grid GGUF has no type for, a
            float16-overflowing scale, an activation llama.cpp does not compute, or a vocabulary
            that does not fit; the message names the layer or argument and the fix.

    >>> import os, tempfile, torch
    >>> from mixle.models.transformer import build_causal_lm
    >>> from mixle.models.qat import apply_qat
    >>> lm = build_causal_lm(vocab=40, d_model=32, n_layer=1, n_head=2, block=8, activation="gelu_tanh")
    >>> lm = apply_qat(lm, grid="q4_0")
    >>> types = save_gguf(lm, os.path.join(tempfile.mkdtemp(), "lm.gguf"))
    >>> types["token_embd.weight"], types["blk.0.attn_qkv.weight"], types["blk.0.attn_qkv.bias"]
    ('Q4_0', 'Q4_0', 'F32')
    """
    gguf = require("gguf", extra="gguf", purpose="save_gguf")
    _check_save_arguments(model, float_matrices, allow_activation_mismatch)
    layout = layout_of(model, gguf)
    if layout.notes and not allow_activation_mismatch:
        what, fix = layout.notes[0]
        raise ValueError(f"save_gguf: {what}; {fix}")
    with torch.no_grad():
        tensors = _plan(layout, float_matrices, gguf)
    words = vocabulary(layout.vocab_size, vocab, tokenizer)
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"path={str(path)!r}: the directory {str(path.parent)!r} does not exist")
    title = name or path.stem
    replace_atomically(path, lambda tmp: _write(tmp, layout, tensors, words, title, gguf))
    return {t.name: t.ggml_type for t in tensors}


def _check_save_arguments(model, float_matrices, allow_activation_mismatch):
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_gguf takes a torch.nn.Module, got {type(model).__name__}")
    if float_matrices not in FLOAT_MATRICES:
        raise ValueError(f"float_matrices={float_matrices!r} is unknown: use one of {FLOAT_MATRICES}")
    if not isinstance(allow_activation_mismatch, bool):
        raise TypeError(f"allow_activation_mismatch must be True or False, got {allow_activation_mismatch!r}")
    check_convertible(model)  # e.g. LoRA layers: fold them in first


def _write(path, layout, tensors, words, name, gguf):
    """Write the GGUF file at ``path`` (the temporary file ``replace_atomically`` moves into place)."""
    writer = gguf.GGUFWriter(path, arch=layout.arch)
    try:
        writer.add_name(name)
        for method, value in layout.hparams:
            getattr(writer, method)(value)
        writer.add_file_type(_file_type(tensors, gguf))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(words.tokens)
        writer.add_token_types(words.types)
        writer.add_token_merges(words.merges)
        for method, token_id in (("add_bos_token_id", words.bos), ("add_eos_token_id", words.eos)):
            if token_id is not None:
                getattr(writer, method)(token_id)
        for tensor in tensors:
            raw_dtype = None if tensor.ggml_type in ("F32", "F16") else getattr(gguf.GGMLQuantizationType, tensor.ggml_type)
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def load_gguf_weights(model, path):
    """A float copy of ``model`` holding the weights of a GGUF file, as llama.cpp multiplies with them.

    Every tensor is read with gguf-py's ``GGUFReader`` and dequantized with gguf's own code
    (``gguf.quants.dequantize``), then put back where ``save_gguf``'s layout took it from, with
    its row order undone (Llama's q/k rows). Evaluating the copy with mixle's forward is
    evaluating the file's weights.

    Args:
        model: a float model of the file's architecture and shapes (e.g. the model before
            ``apply_qat``); it is not changed.
        path: a ``.gguf`` file written by ``save_gguf`` (or with the same layout).

    Returns:
        The float copy.

    Raises:
        ValueError: the file's architecture, tensor names or shapes do not match ``model``'s
            layout, or ``model`` has quantized layers (pass its float original).

    >>> import os, tempfile, torch
    >>> from mixle.models.transformer import build_causal_lm
    >>> from mixle.api import quantize_model
    >>> lm = build_causal_lm(vocab=40, d_model=32, n_layer=1, n_head=2, block=8, activation="gelu_tanh")
    >>> path = os.path.join(tempfile.mkdtemp(), "lm.gguf")
    >>> _ = save_gguf(quantize_model(lm, grid="q4_0"), path)
    >>> back = load_gguf_weights(lm, path)
    >>> torch.equal(back.blocks[0].fc.weight, quantize_model(lm, grid="q4_0").blocks[0].fc.dequantized_weight())
    True
    """
    gguf = require("gguf", extra="gguf", purpose="load_gguf_weights")
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_gguf_weights takes a torch.nn.Module, got {type(model).__name__}")
    quantized = [name for name, m in model.named_modules() if getattr(m, "spec", None) is not None]
    if quantized:
        raise ValueError(f"model has quantized layers ({quantized[0]!r}, ...): pass the float model they were made "
                         f"from, whose copy load_gguf_weights fills with the file's weights")
    out = copy.deepcopy(model)
    layout = layout_of(out, gguf)
    stored = _read_tensors(path, layout, gguf)
    with torch.no_grad():
        for part in layout.parts:
            target = part.module.weight if part.module is not None else part.tensor
            target.copy_(torch.from_numpy(_part_values(stored[part.name], part, target, path, gguf)))
    return out


def _read_tensors(path, layout, gguf):
    """``{gguf tensor name: ReaderTensor}`` of the file, after checking it holds ``layout``'s tensors."""
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    if arch != layout.arch:
        raise ValueError(f"{str(path)!r} holds llama.cpp's {arch!r}, but the model is written as {layout.arch!r}")
    stored = {tensor.name: tensor for tensor in reader.tensors}
    wanted = {part.name for part in layout.parts}
    if set(stored) != wanted:
        raise ValueError(f"{str(path)!r} does not hold this model's tensors: missing {sorted(wanted - set(stored))}, "
                         f"unexpected {sorted(set(stored) - wanted)}")
    return stored


def _part_values(tensor, part, target, path, gguf):
    """One file tensor dequantized by gguf-py, in the model's shape and row order."""
    values = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if values.size != target.numel() or shape[-1] != target.shape[-1]:
        raise ValueError(f"tensor {part.name!r} of {str(path)!r} has shape {list(shape)}, but {part.path!r} "
                         f"has {list(target.shape)}")
    values = values.reshape(target.shape)
    if part.rows is not None:  # file row r holds model row rows[r]
        unpermuted = np.empty_like(values)
        unpermuted[part.rows] = values
        values = unpermuted
    return values
