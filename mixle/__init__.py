"""mixle: quantization-aware training (int4/int8) for PyTorch and Flax models.

The whole user API is offered here by name and imported on first use, so ``import mixle`` needs
neither torch nor jax. A name whose module needs torch is still listed without torch; using it
then raises an ImportError naming the pip extra to install.

>>> import mixle
>>> {"apply_qat", "convert", "save_gguf"} <= set(dir(mixle))
True
"""

from mixle._version import __version__

# The formats mixle ships join mixle's own grids (mixle.core.grids) before any module looks a grid
# up: llama.cpp's block types, then QLoRA's NF4. Both import numpy only.
from mixle.gguf import formats as _llama_cpp_formats  # noqa: E402, F401
from mixle.core import nf4 as _nf4  # noqa: E402, F401

_API = "mixle.api"
_NUMERICS = "mixle.core.numerics"

# name -> (the module that defines it, the package its import needs beyond numpy, or None)
_FACE = {
    **{name: (_API, None) for name in (
        "apply_qat", "set_fake_quant_enabled", "pull_toward_stored", "get_qat_report", "invalidate_fake_quant_caches",
        "fake_quantize", "fake_quantize_int4", "convert", "quantize_model", "calibrate_importance", "gptq_quantize",
        "save_quantized", "load_quantized", "model_nbytes", "apply_lora", "merge_lora", "get_lora_report",
        "lora_parameters", "QATReport", "LayerDecision")},
    **{name: (_NUMERICS, None) for name in (
        "QuantizedArray", "quantize_array", "dequantize_array", "quantize_dequantize_array")},
    "QuantSpec": ("mixle.core.spec", None),
    "LoRASpec": ("mixle.core.lora_spec", None),
    "GRIDS": ("mixle.core.grids", None),
    "pack_int4": ("mixle.core.packing", None),
    "unpack_int4": ("mixle.core.packing", None),
    "QATWrapper": ("mixle.torch_backend.layers.qat", "torch"),
    "QUANTIZED_KERNEL": ("mixle.flax_backend.fake_quant", "jax"),
    "save_gguf": ("mixle.gguf.writer", "torch"),
    "load_gguf_weights": ("mixle.gguf.writer", "torch"),
    "gguf_mix_types": ("mixle.gguf.writer", "torch"),
    "gguf_mix_specs": ("mixle.gguf.writer", "torch"),
    "GGUF_MIXES": ("mixle.gguf.mixes", None),
    "save_imatrix": ("mixle.gguf.imatrix_file", None),
    "load_imatrix": ("mixle.gguf.imatrix_file", None),
    "read_imatrix": ("mixle.gguf.imatrix_file", None),
    "write_imatrix": ("mixle.gguf.imatrix_file", None),
    "save_pretrained_compressed": ("mixle.exports.compressed_tensors", "torch"),
    "load_pretrained_compressed": ("mixle.exports.compressed_tensors", "torch"),
    "save_pretrained_float": ("mixle.exports.hf_checkpoint", "torch"),
    "build_causal_lm": ("mixle.lm.transformer", "torch"),
    "GradLeaf": ("mixle.lm.grad_leaf", "torch"),
    "SelfDistillation": ("mixle.lm.distill", "torch"),
}

__all__ = ["__version__", *_FACE]


def __getattr__(name):
    # Lazy so that `import mixle` never imports torch, jax or flax.
    if name not in _FACE:
        raise AttributeError(f"module 'mixle' has no attribute {name!r}")
    import importlib

    from mixle._optional import is_available, stand_in

    module, package = _FACE[name]
    if package is not None and not is_available(package):
        return stand_in(name, package)
    return getattr(importlib.import_module(module), name)


def __dir__():
    return sorted(__all__)
