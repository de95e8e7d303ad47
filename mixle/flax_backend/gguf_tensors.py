"""What a Flax causal LM's files hold, gathered framework-free: float weights and stored arrays by
the names of the equivalent transformers model.

The files (``save_gguf``, ``save_pretrained_compressed``) are written from a transformers model's
layout; a Flax model of the same family (mixle's NNX Llama / Qwen2 / Mistral, whose modules carry
transformers' names: ``layers.0.self_attn.q_proj`` for ``model.layers.0.self_attn.q_proj``) gives
the same inputs here, as numpy arrays:

* ``torch_config(model)``: the transformers ``config.json`` fields of the model;
* ``float_tensors(model)``: ``{state_dict name: float32 array}`` in torch's layout (a Linear kernel
  ``(in, out)`` transposed to ``(out, in)``; a converted kernel dequantized);
* ``stored_arrays(model)``: ``{torch module path: QuantizedArray}`` of every kernel a QAT-wrapped
  (or converted) model quantizes: the ``(out, in)`` rows' codes and scales of the fake-quantized
  forward (``kernel_rows`` on the float32 master weight), the blocks llama.cpp multiplies with;
  a head tied to the embedding is its ``embed_tokens`` entry.

``torch_path`` / ``flax_path`` map module paths both ways.
"""

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from flax import nnx

from mixle.flax_backend.activations import qwix_options
from mixle.flax_backend.convert import QuantizedKernel, QuantizedValue

__all__ = ["torch_path", "flax_path", "torch_config", "float_tensors", "stored_arrays"]

# Flax Param name -> (torch name, transposed)
_TORCH_NAMES = {"kernel": ("weight", True), "embedding": ("weight", False), "bias": ("bias", False),
                "weight": ("weight", False)}
_HEAD = "lm_head"


def torch_path(path):
    """The transformers module path of a Flax module path.

    >>> torch_path("layers.0.mlp.up_proj"), torch_path("lm_head")
    ('model.layers.0.mlp.up_proj', 'lm_head')
    """
    return path if path == _HEAD or path.startswith(_HEAD + ".") else f"model.{path}" if path else "model"


def flax_path(path):
    """The Flax module path of a transformers module path (``torch_path``'s inverse).

    >>> flax_path("model.embed_tokens"), flax_path("lm_head")
    ('embed_tokens', 'lm_head')
    """
    return path.removeprefix("model.") if path.startswith("model.") else path


def torch_config(model):
    """The transformers ``config.json`` fields of a Flax causal LM (its ``config`` dataclass).

    Raises:
        ValueError: the model has no such config (not one of mixle's Flax causal LMs).
    """
    config = getattr(model, "config", None)
    if config is None or not dataclasses.is_dataclass(config) or not hasattr(config, "model_type"):
        raise ValueError(f"a {type(model).__name__} has no causal-LM config: the files are written for mixle's Flax "
                         f"causal LMs (mixle.lm.flax_causal_lm.load_causal_lm), whose config names the architecture")
    fields = dataclasses.asdict(config)
    if fields.get("rope_scaling") is None:
        fields.pop("rope_scaling", None)
    return fields


def _params(model):
    """``[(module path, param name, variable)]`` of the model's Params and converted kernels."""
    found = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, (nnx.Param, QuantizedKernel)):
            found.append((".".join(str(p) for p in path[:-1]), str(path[-1]), node))
    return found


def float_tensors(model):
    """``{torch state_dict name: float32 numpy array}`` of a Flax causal LM (float, QAT or converted).

    >>> float_tensors  # doctest: +ELLIPSIS
    <function float_tensors at ...>
    """
    tensors = {}
    for path, name, variable in _params(model):
        value = variable.get_raw_value()
        value = value.dequantize() if isinstance(value, QuantizedValue) else value
        torch_name, transposed = _TORCH_NAMES.get(name, (name, False))
        array = np.asarray(value, np.float32)
        tensors[f"{torch_path(path)}.{torch_name}"] = array.T.copy() if transposed and array.ndim == 2 else array
    return tensors


def stored_arrays(model):
    """``{torch module path: QuantizedArray (numpy)}`` of the kernels a QAT-wrapped or converted
    Flax model quantizes (see the module docstring); ``{}`` for a float model.

    Raises:
        ValueError: a QAT kernel trains with a Qwix-only option, whose codes are not mixle's.
    """
    from mixle.flax_backend.qat import quantized_kernels

    arrays = {}
    for path, name, variable in _params(model):
        value = variable.get_raw_value()
        if isinstance(value, QuantizedValue):
            arrays[torch_path(path)] = value.on_host().quantized_array()
    kernels = quantized_kernels(model)
    for kernel in kernels:
        spec = kernel.spec
        if qwix_options(spec):
            raise ValueError(f"kernel {kernel.owner}.{kernel.name} trains as {spec.short()}, whose forward is Qwix's "
                             f"own quantizer ({qwix_options(spec)}): its codes are not mixle's, so no file can "
                             f"hold them")
    # numpy's numerics: the jax ones give the same codes (exactly), and numpy's run without compiling; one
    # kernel a thread (numpy lets go of the GIL in its array operations: ggml's searches take minutes in one)
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        stored = pool.map(lambda kernel: kernel.stored(np.asarray(kernel.param.get_raw_value()))[0], kernels)
        arrays.update((torch_path(kernel.owner), value) for kernel, value in zip(kernels, stored))
    return arrays
