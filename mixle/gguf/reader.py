"""Reading a GGUF file's weights back into a float copy of the model (``load_gguf_weights``).

Every tensor is read with gguf-py's ``GGUFReader`` (after ``mixle.gguf.file``'s checks of the
file's layout) and dequantized with gguf's own code, then put back where ``save_gguf``'s layout
(``mixle.gguf.layouts``) took it from, with its row order undone.
"""

import copy

import numpy as np
import torch
from torch import nn

from mixle._optional import require
from mixle.gguf.blocks import block_scale_problem
from mixle.gguf.file import open_gguf
from mixle.gguf.plan import float_weight, plan_of

__all__ = ["load_gguf_weights"]


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
        ValueError: the file is truncated or corrupt (a tensor cut short or not fitting the file's
            layout, e.g. a changed type or two tensors at one offset: ``mixle.gguf.file``;
            a NaN/inf float16 block scale, NaN/inf values), its architecture, tensor names or shapes do not match
            ``model``'s layout, or ``model`` has quantized layers (pass its float original); the
            message names the tensor and the file.

    >>> import os, tempfile, torch
    >>> from mixle.models.transformer import build_causal_lm
    >>> from mixle.api import quantize_model
    >>> from mixle.gguf.writer import save_gguf
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
    layout = plan_of(out, "load_gguf_weights").layout
    stored = _read_tensors(path, layout, gguf)
    with torch.no_grad():
        for part in layout.parts:
            target = float_weight(part) if part.module is not None else part.tensor
            target.copy_(torch.from_numpy(_part_values(stored[part.name], part, target, path, gguf)))
    return out


def _read_tensors(path, layout, gguf):
    """``{gguf tensor name: ReaderTensor}`` of the file, after checking it holds ``layout``'s tensors."""
    reader = open_gguf(path, purpose="load_gguf_weights")
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    if arch != layout.arch:
        raise ValueError(f"{str(path)!r} holds llama.cpp's {arch!r}, but the model is written as {layout.arch!r}")
    stored = {tensor.name: tensor for tensor in reader.tensors}
    wanted = {part.name for part in layout.parts}
    if set(stored) != wanted:
        raise ValueError(f"{str(path)!r} does not hold this model's tensors: missing {sorted(wanted - set(stored))}, "
                         f"unexpected {sorted(set(stored) - wanted)}")
    return stored


def _part_values(tensor, part, target, path, gguf):
    """One file tensor dequantized by gguf-py, in the model's shape and row order, after checking it."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    where = f"tensor {part.name!r} of {str(path)!r}"
    if shape != tuple(target.shape):
        raise ValueError(f"{where} has shape {list(shape)}, but {part.path!r} has {list(target.shape)}: the file was "
                         f"written for another configuration of this architecture; pass the model it was saved from")
    problem = block_scale_problem(tensor.data, tensor.tensor_type.name)
    if problem:
        raise ValueError(f"{where} holds a NaN or infinite float16 block scale ({problem}): the file is corrupt; "
                         f"write it again")
    values = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
    if not np.isfinite(values).all():
        index = [int(i) for i in np.argwhere(~np.isfinite(values))[0]]
        raise ValueError(f"{where} holds NaN or infinity ({tensor.tensor_type.name} value {values[tuple(index)]} at "
                         f"{index}): the file is corrupt; write it again")
    if part.offset:  # the file holds the norm weight plus the offset (Gemma's 1 + w)
        values = values - np.float32(part.offset)
    if part.rows is not None:  # file row r holds model row rows[r]
        unpermuted = np.empty_like(values)
        unpermuted[part.rows] = values
        values = unpermuted
    return values
