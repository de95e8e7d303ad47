"""A QAT model's float weights as a plain transformers checkpoint (``save_pretrained_float``).

What QAT trains are float master weights; the lattice it trains on is the one the grid's quantizer
makes of them. On llama.cpp's grids (``q4_0``, ``q8_0``, the K-quants, the mixes) that quantizer is
``llama-quantize``'s, bit for bit, so the master weights written as they are (float32, no rounding)
are a checkpoint that llama.cpp's own tools turn into the trained file:
``convert_hf_to_gguf.py --outtype f32`` keeps every value, and ``llama-quantize`` of that file
computes the blocks QAT trained, for every architecture the converter knows, including those
``save_gguf`` does not write.

The checkpoint is what ``from_pretrained`` of the model's class expects: ``config.json``, the
weights as safetensors, the generation config and, if given, the tokenizer, all written by
transformers' own ``save_pretrained``. Only the architecture's own tensors are written: mixle's
additions (a learned scale) are left out and listed in the result, since a float checkpoint has no
place for them.
"""

import contextlib
import copy
import os
import shutil
from pathlib import Path

from mixle._optional import require
from mixle.core.fileformat import checked_directory, replace_directory_atomically
from mixle.gguf.sentencepiece_vocab import sentencepiece_file

__all__ = ["save_pretrained_float", "check_savable"]


def _refuse_layers(model):
    """ValueError for layers without float master weights (converted) or with unmerged adapters."""
    from mixle.torch_backend.layers.lora import LoRALinear
    from mixle.torch_backend.layers.quantized import QuantizedEmbedding, QuantizedLinear, QuantizedWeight

    for path, module in model.named_modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding, QuantizedWeight)):
            raise ValueError(f"layer {path!r} is converted to integer codes: a float checkpoint needs the float "
                             f"weights, so save the QAT model before convert (or write the codes with "
                             f"save_gguf / save_pretrained_compressed)")
        if isinstance(module, LoRALinear):
            raise ValueError(f"layer {path!r} holds LoRA adapters: merge them first (mixle.merge_lora(model)), so "
                             f"the checkpoint's weights are the ones quantized")


def _architecture_keys(model, torch):
    """The state_dict keys of the model's class built from its config, without memory (meta device)."""
    config = copy.deepcopy(model.config)
    config.__dict__.pop("quantization_config", None)
    with torch.device("meta"):
        skeleton = type(model)(config)
    return list(skeleton.state_dict())


def _loader_quantization(model):
    """The quantization method transformers loaded ``model`` with (``"gguf"``: dequantized to float
    weights, written as such), or None; ValueError for one whose weights are not float."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return None
    method = quantizer.quantization_config.quant_method
    method = getattr(method, "value", method)
    if method != "gguf":
        raise ValueError(f"the model was loaded quantized by transformers ({method}): its weights are not float, so "
                         f"there is no float checkpoint to write; load the float model (or a GGUF file, which "
                         f"transformers dequantizes)")
    return method


def check_savable(model):
    """The state_dict keys ``save_pretrained_float`` writes for ``model``; raises what it would raise first.

    The finetune job calls it on the float model before training, so a model it cannot write is
    refused before any work.

    Raises:
        TypeError: ``model`` is not a transformers PreTrainedModel.
        ValueError: a converted layer, unmerged LoRA adapters, weights transformers loaded
            quantized (other than GGUF's, dequantized to float), or a weight of the architecture
            missing from the model.

    >>> check_savable(object())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: save_pretrained_float takes a transformers PreTrainedModel ..., got object
    """
    torch = require("torch", extra="torch", purpose="save_pretrained_float")
    transformers = require("transformers", extra="hf", purpose="save_pretrained_float")
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"save_pretrained_float takes a transformers PreTrainedModel (it writes its config.json and "
                        f"from_pretrained rebuilds it), got {type(model).__name__}")
    _refuse_layers(model)
    _loader_quantization(model)
    found = model.state_dict()
    keys = _architecture_keys(model, torch)
    missing = [key for key in keys if key not in found]
    if missing:
        raise ValueError(f"the model has no {missing[0]!r}, a weight of {type(model).__name__} (of {len(missing)} "
                         f"missing): save a model of the class its config builds")
    return keys


@contextlib.contextmanager
def _as_float_model(model):
    """``model`` without the marks of transformers' GGUF loader (its quantizer, the config's
    ``quantization_config``), which make ``save_pretrained`` refuse; put back afterwards."""
    if _loader_quantization(model) is None:
        yield
        return
    marks = {name: model.__dict__[name] for name in ("hf_quantizer", "is_quantized") if name in model.__dict__}
    config = model.config.__dict__.pop("quantization_config", None)
    try:
        model.__dict__.update(hf_quantizer=None, is_quantized=False)
        yield
    finally:
        for name in ("hf_quantizer", "is_quantized"):
            model.__dict__.pop(name, None)
        model.__dict__.update(marks)
        if config is not None:
            model.config.quantization_config = config


def save_pretrained_float(model, directory, *, tokenizer=None, overwrite=False):
    """Write a (QAT-wrapped) transformers model's float weights as a plain transformers checkpoint.

    The weights are written as they are (a QAT model's float32 master weights stay float32), by
    the model's own ``save_pretrained`` (safetensors, ``config.json``, generation config), so
    ``from_pretrained`` gives the float model back and ``convert_hf_to_gguf.py --outtype f32``
    followed by ``llama-quantize`` makes the blocks QAT trained on a llama.cpp grid.

    Args:
        model: a transformers ``PreTrainedModel``, float or with mixle QAT layers (not converted;
            LoRA adapters merged). Not modified.
        directory: the checkpoint directory. Written to a temporary sibling and renamed into
            place, so a failure leaves nothing behind; with ``overwrite`` a previous directory is
            kept as it was until the new one is in place.
        tokenizer: optional transformers tokenizer, saved into the directory too.
        overwrite: replace an existing non-empty ``directory`` (otherwise refused).

    Returns:
        ``{"tensors": count, "bytes": of the weights, "dtypes": [...], "left_out": [keys]}``:
        ``left_out`` lists state entries that are mixle's, not the architecture's (learned scales).

    Raises:
        TypeError: ``model`` is not a transformers PreTrainedModel, or a bad argument type.
        ValueError: a converted layer or unmerged LoRA adapters (no float weights to write), weights
            transformers loaded quantized (a GGUF file's, dequantized to float, are written), or a
            weight of the architecture missing from the model.
        FileExistsError: ``directory`` is a file, or is not empty and ``overwrite`` is False.

    >>> import tempfile, transformers
    >>> from mixle.api import apply_qat
    >>> config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    >>> qat = apply_qat(transformers.LlamaForCausalLM(config), grid="q4_0", bits=4, exclude=("lm_head",))
    >>> written = save_pretrained_float(qat, tempfile.mkdtemp() + "/hf")
    >>> written["dtypes"], written["left_out"]
    (['float32'], [])
    """
    keys = check_savable(model)
    target = checked_directory(directory, overwrite)
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(f"tokenizer must have a save_pretrained method (a transformers tokenizer), got "
                        f"{type(tokenizer).__name__}")
    found = model.state_dict()
    state = {key: found[key].detach() for key in keys}
    left_out = sorted(key for key in found if key not in state)
    stored = {(t.data_ptr(), t.dtype, tuple(t.shape)): t for t in state.values()}.values()  # a tied weight once
    info = {"tensors": len(state), "bytes": sum(t.numel() * t.element_size() for t in stored),
            "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()}),
            "left_out": left_out}

    def write(tmp):
        with _as_float_model(model):
            model.save_pretrained(tmp, state_dict=state)
        if tokenizer is not None:
            _save_tokenizer(tokenizer, tmp)
        return info

    return replace_directory_atomically(target, write, overwrite)


def _save_tokenizer(tokenizer, directory):
    """``tokenizer.save_pretrained(directory)``, with the SentencePiece ``tokenizer.model`` it was loaded
    from (transformers does not save it again, and a GGUF's token scores come from it)."""
    tokenizer.save_pretrained(directory)
    model_file = sentencepiece_file(tokenizer)
    if model_file is not None and not os.path.exists(os.path.join(directory, "tokenizer.model")):
        shutil.copyfile(model_file, os.path.join(directory, "tokenizer.model"))
