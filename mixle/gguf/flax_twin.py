"""A Flax causal LM's files are its transformers twin's: the same weights, the same stored blocks.

``save_gguf`` and ``save_pretrained_compressed`` lay their files out from a transformers model. For
a Flax model of the same family (mixle's NNX Llama / Qwen2 / Mistral, float, QAT-wrapped or
converted), ``torch_twin`` builds the transformers model of its config holding its float weights,
and takes from the Flax side (``mixle.flax_backend.gguf_tensors``, numpy only) the codes and scales
of every kernel it quantizes; the writers then store those arrays in place of the twin's weights,
so a file written from Flax is, byte for byte, the file written from the equivalent torch model
with the same weights and the same spec (the numerics are one, and exact on both). Needs torch
and transformers (the ``hf`` extra) besides jax.
"""

import re

import numpy as np

from mixle._optional import require
from mixle.backends import backend_of

__all__ = ["is_flax", "torch_twin", "quantized_twin", "flax_specs"]


def is_flax(model):
    """Whether ``model`` is a Flax module (imports nothing).

    >>> is_flax([1])
    False
    """
    record = backend_of(model)
    return record is not None and record.name == "flax"


def torch_twin(model, purpose):
    """``(twin, {torch module path: QuantizedArray})`` of a Flax causal LM (see the module docstring).

    Raises:
        ValueError: the model is not one of mixle's Flax causal LMs, or a kernel trains with a
            Qwix-only option (its codes are not mixle's).
        ImportError: torch or transformers is missing (naming the pip extra).
    """
    transformers = require("transformers", extra="hf", purpose=purpose)
    import torch

    from mixle.flax_backend.gguf_tensors import float_tensors, stored_arrays, torch_config

    fields = torch_config(model)
    config = transformers.AutoConfig.for_model(**fields)
    twin = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {name: torch.from_numpy(array.copy()) for name, array in float_tensors(model).items()}
    missing, unexpected = twin.load_state_dict(state, strict=False)
    missing = [name for name in missing if not (name == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{purpose}: the {type(model).__name__} does not match transformers' {config.model_type} "
                         f"layout (missing {missing[:4]}, unexpected {unexpected[:4]}): write a model loaded with "
                         f"mixle.lm.flax_causal_lm.load_causal_lm")
    return twin, stored_arrays(model)


def quantized_twin(model, purpose):
    """The twin (``torch_twin``) with converted layers holding the Flax kernels' codes and scales.

    The torch pipeline quantizes the twin's weights on each kernel's spec, and every stored array is
    then checked equal to the Flax model's own (the one numerics, exact on both backends); a head
    tied to the embedding is selected through the head, as torch's selection ties them.

    Raises:
        ValueError: the Flax model quantizes no kernel, or a stored array differs (a numerics bug).
    """
    from mixle.torch_backend.transforms.convert import quantize_model

    twin, arrays = torch_twin(model, purpose)
    if not arrays:
        raise ValueError(f"{purpose}: this {type(model).__name__} quantizes no kernel: prepare it with "
                         f"apply_qat(model, ..., example_inputs=...) (or convert it) first")
    tied = twin.config.tie_word_embeddings
    patterns = [(re.escape("lm_head" if tied and path == "model.embed_tokens" else path), q.spec)
                for path, q in arrays.items()]
    converted = quantize_model(twin, patterns=patterns)
    modules = dict(converted.named_modules())
    for path, flax_array in arrays.items():
        torch_array = modules[path].quantized_array()
        for part, value in flax_array.parts().items():
            if not np.array_equal(np.asarray(getattr(torch_array, part)), value):
                raise ValueError(f"{purpose}: the {part} of {path!r} differ between the Flax kernel and its torch "
                                 f"twin on {flax_array.spec.short()}: the numerics disagree (report this)")
    return converted


def flax_specs(model, specs):
    """``{Flax module path: spec}`` of ``{twin module path: spec}`` (``gguf_mix_specs`` of the twin): a
    head tied to the embedding is the embedding's ``attend``; an untied embedding stays float (a Flax
    lookup is no product QAT intercepts: a mix quantizes its float table when the file is written).

    >>> flax_specs  # doctest: +ELLIPSIS
    <function flax_specs at ...>
    """
    from mixle.flax_backend.gguf_tensors import flax_path

    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    found = {}
    for path, spec in specs.items():
        if path == "lm_head" and tied:
            continue  # the embedding's entry (gguf_mix_specs gives both one spec)
        if path == "model.embed_tokens" and not tied:
            spec = None
        found[flax_path(path)] = spec
    return found
