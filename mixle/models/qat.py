"""The QAT names of ``mixle`` (an alias kept for existing imports: use ``import mixle``).

Importing it imports no torch, jax or flax.
"""

from mixle.api import (  # noqa: F401
    LayerDecision,
    QATReport,
    QuantSpec,
    apply_qat,
    fake_quantize,
    fake_quantize_int4,
    get_qat_report,
    invalidate_fake_quant_caches,
    set_fake_quant_enabled,
)

__all__ = ["QuantSpec", "QATReport", "LayerDecision", "QATWrapper", "apply_qat", "set_fake_quant_enabled",
           "fake_quantize", "fake_quantize_int4", "get_qat_report", "invalidate_fake_quant_caches"]


def __getattr__(name):
    if name == "QATWrapper":  # lazily: it needs torch (a stand-in explains when torch is missing)
        import mixle

        return mixle.QATWrapper
    raise AttributeError(f"module 'mixle.models.qat' has no attribute {name!r}")
