"""mixle: quantization-aware training (int4/int8) for PyTorch and Flax models."""

__version__ = "0.1.0"

_LAZY = {
    "QuantSpec": "mixle.core.spec",
    "apply_qat": "mixle.models.qat",
    "set_fake_quant_enabled": "mixle.models.qat",
    "fake_quantize": "mixle.models.qat",
    "fake_quantize_int4": "mixle.models.qat",
    "QATWrapper": "mixle.models.qat",
    "get_qat_report": "mixle.models.qat",
    "quantize_model": "mixle.task.quantize",
    "convert": "mixle.task.quantize",
    "model_nbytes": "mixle.task.quantize",
    "save_quantized": "mixle.task.quantize",
    "load_quantized": "mixle.task.quantize",
    "build_causal_lm": "mixle.models.transformer",
    "GradLeaf": "mixle.models.grad_leaf",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    # Lazy so that `import mixle` never imports torch, jax or flax.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mixle' has no attribute {name!r}")
