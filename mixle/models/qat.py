"""Public QAT API for PyTorch and Flax models: wrap, toggle, fake-quantize, report.

Nothing here imports torch, jax or flax at import time; each call dispatches on the type of
its argument and imports only the backend it needs.
"""

from mixle._optional import is_available, require
from mixle.models.qat_report import LayerDecision, QATReport
from mixle.models.selection import LayerSelector
from mixle.task.quantize import _resolve_spec, array_kind, quantize_dequantize_array
from mixle.task.spec import QuantSpec

__all__ = [
    "QuantSpec",
    "QATReport",
    "LayerDecision",
    "QATWrapper",
    "apply_qat",
    "set_fake_quant_enabled",
    "fake_quantize",
    "fake_quantize_int4",
    "get_qat_report",
    "invalidate_fake_quant_caches",
]


def _framework(obj):
    """'torch' or 'flax' from the classes an object derives from, without importing either."""
    for cls in type(obj).__mro__:
        module = cls.__module__ or ""
        if module.startswith("torch."):
            return "torch"
        if module.startswith("flax."):
            return "flax"
    return None


def _backend(model, purpose):
    framework = _framework(model)
    if framework == "torch":
        require("torch", extra="torch", purpose=purpose)
        from mixle.models import _qat_torch

        return _qat_torch
    if framework == "flax":
        for module in ("jax", "flax", "qwix"):
            require(module, extra="jax", purpose=purpose)
        from mixle.models import _qat_flax

        return _qat_flax
    raise TypeError(
        f"{purpose} supports torch.nn.Module, flax.nnx.Module and flax.linen.Module models, "
        f"got {type(model).__name__}"
    )


def apply_qat(model, *, spec=None, patterns=(".*",), exclude=(), reconfigure=False, example_inputs=None,
              **spec_fields):
    """Make a model's selected layers fake-quantize their weights for quantization-aware training.

    PyTorch: every selected ``nn.Linear`` is swapped in place for a ``QATWrapper`` that shares
    its Parameters; weights, ``state_dict`` keys, tied weights and optimizers are untouched.

    Args:
        model: a ``torch.nn.Module`` (or a Flax module, with the ``jax`` extra).
        spec: a QuantSpec; or give its fields as keywords (``bits=4, group_size=32, ...``).
            Default: int4, per-channel, symmetric grid.
        patterns: regexes over dotted module paths, matched in full, first match wins; an entry
            may be ``(regex, QuantSpec)`` or ``(regex, None)`` (keep float). Each must match a
            layer, so typos fail loudly.
        exclude: regexes of module paths to keep in float; each must match a module.
        reconfigure: allow changing the spec of layers that are already wrapped.
        example_inputs: Flax only (required there): the positional inputs of one model call,
            e.g. ``(x,)``. The model is traced once under ``jax.grad`` (shapes only) to find which
            kernels Qwix quantizes; the report lists every kernel as quantized or skipped and why.
            Flax NNX models are changed in place (same object, same Params, class swapped to a
            Qwix subclass of theirs); Linen modules come back as a new module using the same params.

    Returns:
        The model (for torch, the replacement if the root itself is an ``nn.Linear``). Its report
        of what was wrapped or skipped and why is ``get_qat_report(model)``.

    Raises:
        ValueError: a pattern matches nothing, a spec is invalid for a layer, or a layer is
            already wrapped with another spec and ``reconfigure`` is False. The model is then
            left exactly as it was.

    >>> import torch
    >>> net = apply_qat(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), bits=4)
    >>> get_qat_report(net).wrapped
    ['0', '2']
    """
    spec = _resolve_spec(spec, spec_fields)
    if not isinstance(reconfigure, bool):
        raise TypeError(f"reconfigure must be True or False, got {reconfigure!r}")
    backend = _backend(model, "apply_qat")
    selector = LayerSelector(patterns=patterns, exclude=exclude, default_spec=spec)
    if backend.__name__.endswith("_qat_torch"):
        if example_inputs is not None:
            raise ValueError(
                "example_inputs is only used for Flax models: the PyTorch backend wraps nn.Linear layers "
                "without running the model; drop example_inputs"
            )
        return backend.apply_qat_torch(model, selector, reconfigure)
    return backend.apply_qat_flax(model, selector, reconfigure, example_inputs)


def set_fake_quant_enabled(model, enabled):
    """Turn fake quantization on or off for every QAT layer of a model; returns the model.

    Off, the model computes exactly what the float model computes (bit-identical outputs and
    gradients), which is how you check fp32 quality during QAT.

    >>> import torch
    >>> net = apply_qat(torch.nn.Linear(4, 4))
    >>> set_fake_quant_enabled(net, False).enabled
    False
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}")
    backend = _backend(model, "set_fake_quant_enabled")
    if backend.__name__.endswith("_qat_torch"):
        return backend.set_enabled_torch(model, enabled)
    return backend.set_enabled_flax(model, enabled)


def invalidate_fake_quant_caches():
    """Make every cached fake-quantized torch weight stale, so its next use quantizes afresh.

    mixle quantizes a weight once per version and notices optimizer steps, ``load_state_dict``
    and in-place edits through the Parameter. Edits that bypass its version counter
    (``param.data.mul_(...)``, writes through a NumPy view) are not seen until the next optimizer
    step: call this after them. A no-op before any torch QAT layer has run.

    >>> invalidate_fake_quant_caches()
    """
    import sys

    module = sys.modules.get("mixle.models._fake_quant_torch")
    if module is not None:
        module.invalidate_caches()


def get_qat_report(model):
    """The QATReport of the last ``apply_qat`` on this model.

    >>> import torch
    >>> print(get_qat_report(apply_qat(torch.nn.Sequential(torch.nn.Linear(4, 4)))))  # doctest: +NORMALIZE_WHITESPACE
    path  kind    action   spec                  reason
    0     Linear  wrapped  int4/channel/symmetric  matched '.*'
    1 quantized, 0 left in float
    """
    backend = _backend(model, "get_qat_report")
    if backend.__name__.endswith("_qat_torch"):
        return backend.report_torch(model)
    return backend.report_flax(model)


def fake_quantize(x, *, spec=None, **spec_fields):
    """Quantize-dequantize an array; for torch and jax the gradient is the straight-through one.

    The forward equals ``quantize_dequantize_array(x, spec)`` bit for bit in x's own dtype.
    The backward passes the incoming gradient unchanged, or zeroes it where ``|x|`` exceeds the
    ``clip_percentile`` threshold when ``clip_gradient=True``. numpy arrays get the forward only.

    Args:
        x: float torch tensor, jax array or numpy array (rows = axis 0 for per-channel scales).
        spec: a QuantSpec; or its fields as keywords, e.g. ``bits=4, clip_percentile=99.9``.

    >>> import numpy as np
    >>> fake_quantize(np.array([0.7, -0.1, 0.04], np.float32), bits=4).tolist()
    [0.699999988079071, -0.10000000149011612, 0.0]
    """
    spec = _resolve_spec(spec, spec_fields)
    kind = array_kind(x)
    if kind == "torch":
        from mixle.models._qat_torch import fake_quantize_tensor

        return fake_quantize_tensor(x, spec)
    if kind == "jax":
        from mixle.models._fake_quant_jax import fake_quantize_jax

        return fake_quantize_jax(x, spec)
    return quantize_dequantize_array(x, spec)


def fake_quantize_int4(x, *, spec=None, **spec_fields):
    """``fake_quantize`` at 4 bits (symmetric grid: codes -7..7).

    >>> import numpy as np
    >>> fake_quantize_int4(np.array([1.4, 0.1], np.float32)).tolist()
    [1.399999976158142, 0.0]
    """
    bits = spec.bits if spec is not None else spec_fields.setdefault("bits", 4)
    if bits != 4:
        raise ValueError(f"fake_quantize_int4 got bits={bits!r}: use fake_quantize(x, bits={bits!r})")
    return fake_quantize(x, spec=spec, **spec_fields)


class _QATWrapperUnavailable:
    """Stand-in for QATWrapper when torch is missing: constructing it explains what to install."""

    def __init__(self, *args, **kwargs):
        require("torch", extra="torch", purpose="QATWrapper")


def __getattr__(name):
    if name == "QATWrapper":
        if not is_available("torch"):
            return _QATWrapperUnavailable
        from mixle.models._qat_torch import QATWrapper

        return QATWrapper
    raise AttributeError(f"module 'mixle.models.qat' has no attribute {name!r}")
