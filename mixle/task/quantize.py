"""The numerics and the PTQ / convert / save / load names (an alias kept for existing imports).

New code uses ``import mixle``. The numerics are imported here from ``mixle.core`` (framework-free);
the torch entry points are resolved on first use, so importing this module never imports torch.
"""

from mixle.core.checks import check_array  # noqa: F401
from mixle.core.layer_weights import (  # noqa: F401
    quantize_conv_weight,
    quantize_embedding_weight,
    quantize_linear_weight,
)
from mixle.core.numerics import (  # noqa: F401
    QuantizedArray,
    block_shape,
    clip_threshold,
    dequantize_array,
    fake_quant_forward,
    quantize_array,
    quantize_dequantize_array,
)
from mixle.core.packing import pack_int4, unpack_int4  # noqa: F401
from mixle.core.spec import QuantSpec  # noqa: F401

_LAZY = {
    "convert": "mixle.api",
    "quantize_model": "mixle.api",
    "save_quantized": "mixle.api",
    "load_quantized": "mixle.api",
    "model_nbytes": "mixle.api",
    "save_gguf": "mixle.gguf.writer",
    "load_gguf_weights": "mixle.gguf.writer",
    "quantize_mlp": "mixle.torch_backend.transforms.convert",
    "QuantizedLinear": "mixle.torch_backend.layers.quantized",
    "QuantizedEmbedding": "mixle.torch_backend.layers.quantized",
    "save_pretrained_compressed": "mixle.exports.compressed_tensors",
    "load_pretrained_compressed": "mixle.exports.compressed_tensors",
}

__all__ = ["QuantSpec", "QuantizedArray", "quantize_array", "dequantize_array", "quantize_dequantize_array",
           "clip_threshold", "fake_quant_forward", "check_array", "block_shape", "quantize_linear_weight",
           "quantize_conv_weight", "quantize_embedding_weight", "pack_int4", "unpack_int4", *_LAZY]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mixle.task.quantize' has no attribute {name!r}")
    import importlib

    if module.startswith(("mixle.torch_backend", "mixle.exports")):
        from mixle._optional import require

        require("torch", extra="torch", purpose=name)
    return getattr(importlib.import_module(module), name)
