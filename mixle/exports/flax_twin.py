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

from mixle._optional import require
from mixle.backends import backend_of

__all__ = ["is_flax", "torch_twin", "flax_specs"]


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
    state = {name: torch.from_numpy(array) for name, array in float_tensors(model).items()}
    missing, unexpected = twin.load_state_dict(state, strict=False)
    missing = [name for name in missing if not (name == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{purpose}: the {type(model).__name__} does not match transformers' {config.model_type} "
                         f"layout (missing {missing[:4]}, unexpected {unexpected[:4]}): write a model loaded with "
                         f"mixle.lm.flax_causal_lm.load_causal_lm")
    return twin, stored_arrays(model)


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
