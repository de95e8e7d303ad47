"""mixle's one API over every backend: wrap, toggle, fake-quantize, report, convert, save, load.

Nothing here imports torch, jax or flax at import time; each call finds the backend of its
argument in ``mixle.backends`` and imports only that one.
"""

from mixle import backends
from mixle._optional import is_available, require
from mixle.core.numerics import resolve_spec, quantize_dequantize_array
from mixle.core.report import LayerDecision, QATReport
from mixle.core.selection import LayerSelector
from mixle.core.spec import QuantSpec

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
    "convert",
    "quantize_model",
    "save_quantized",
    "load_quantized",
    "model_nbytes",
]


def apply_qat(model, *, spec=None, patterns=(".*",), exclude=(), opt_in=(), reconfigure=False,
              example_inputs=None, **spec_fields):
    """Make a model's selected layers fake-quantize their weights for quantization-aware training.

    PyTorch: every selected Linear-like layer (``nn.Linear``, transformers' ``Conv1D``,
    ``nn.MultiheadAttention``'s in and out projections) is swapped in place for a QAT layer that
    shares its Parameters; weights, ``state_dict`` keys, tied weights and optimizers are
    untouched. Untied ``nn.Embedding`` tables (per-row scales) and ``nn.Conv1d``/``nn.Conv2d``
    (per output channel) are opt-in: ``opt_in=("embedding", "conv")`` or a pattern matching only
    such layers selects them; an embedding tied to a selected head always follows it. PEFT
    adapters are never quantized. The report lists every floating-point weight (two or more
    dimensions), quantized or not and why, and the share of weight elements quantized.

    Args:
        model: a ``torch.nn.Module`` (or a Flax module, with the ``jax`` extra).
        spec: a QuantSpec; or give its fields as keywords (``bits=4, group_size=32, ...``).
            Default: int4, per-channel, symmetric grid.
        patterns: regexes over dotted module paths, matched in full, first match wins; an entry
            may be ``(regex, QuantSpec)`` or ``(regex, None)`` (keep float). Each must match a
            layer, so typos fail loudly.
        exclude: regexes of module paths to keep in float; each must match a module.
        opt_in: layer kinds selected besides the Linear-like ones: ``"embedding"``, ``"conv"``
            (torch only).
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
    spec = resolve_spec(spec, spec_fields)
    if not isinstance(reconfigure, bool):
        raise TypeError(f"reconfigure must be True or False, got {reconfigure!r}")
    backend = backends.for_model(model, "apply_qat")
    selector = LayerSelector(patterns=patterns, exclude=exclude, default_spec=spec, opt_in=opt_in)
    return backend.apply(model, selector, reconfigure, example_inputs)


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
    return backends.for_model(model, "set_fake_quant_enabled").set_enabled(model, enabled)


def invalidate_fake_quant_caches():
    """Make every cached fake-quantized torch weight stale, so its next use quantizes afresh.

    mixle quantizes a weight once per version and notices optimizer steps, ``load_state_dict``
    and in-place edits through the Parameter. Edits that bypass its version counter
    (``param.data.mul_(...)``, writes through a NumPy view) are not seen until the next optimizer
    step: call this after them. A no-op before any torch QAT layer has run.

    >>> invalidate_fake_quant_caches()
    """
    import sys

    module = sys.modules.get("mixle.torch_backend.fake_quant")  # nothing is cached before it is imported
    if module is not None:
        module.invalidate_caches()


def get_qat_report(model):
    """The QATReport of the last ``apply_qat`` on this model.

    >>> import torch
    >>> print(get_qat_report(apply_qat(torch.nn.Sequential(torch.nn.Linear(4, 4)))))  # doctest: +NORMALIZE_WHITESPACE
    path  kind    action   spec                  reason
    0     Linear  wrapped  int4/channel/symmetric  matched '.*'
    1 quantized, 0 left in float; weights quantized: 100.0% of 16 elements
    """
    return backends.for_model(model, "get_qat_report").report(model)


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
    spec = resolve_spec(spec, spec_fields)
    if spec.scale == "learned" or spec.act_bits is not None:
        raise ValueError(
            f"fake_quantize(x) quantizes one array with scales computed from it, so it cannot honour "
            f"{'scale=' + repr(spec.scale) if spec.scale == 'learned' else 'act_bits=' + repr(spec.act_bits)}: "
            f"learned scales and activation quantization live in the QAT layers (apply_qat)"
        )
    backend = backends.for_array(x, "fake_quantize")
    if backend is None:
        return quantize_dequantize_array(x, spec)
    return backend.fake_quantize(x, spec)


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


def convert(model):
    """Real int codes from a QAT model: each QAT layer becomes its quantized layer (a copy).

    The converted forward equals the QAT model's fake-quant forward bit for bit; tied weights
    are stored once. See ``mixle.torch_backend.convert.convert``.

    >>> import torch
    >>> [type(m).__name__ for m in convert(apply_qat(torch.nn.Sequential(torch.nn.Linear(8, 4))))]
    ['QuantizedLinear']
    """
    return backends.for_model(model, "convert").convert(model)


def quantize_model(model, spec=None, *, patterns=(".*",), exclude=(), opt_in=(), example_inputs=None,
                   **spec_fields):
    """Post-training quantization: ``convert(apply_qat(copy of model, ...))``, same grid as QAT.

    ``opt_in`` and ``example_inputs`` are as for ``apply_qat`` (the latter Flax only).

    >>> import torch
    >>> type(quantize_model(torch.nn.Linear(8, 4), bits=8)).__name__
    'QuantizedLinear'
    """
    return backends.for_model(model, "quantize_model").quantize_model(
        model, spec, patterns=patterns, exclude=exclude, opt_in=opt_in, example_inputs=example_inputs, **spec_fields)


def save_quantized(model, path, *, names=None):
    """Save a converted model as safetensors with mixle's hashed manifest; returns the manifest.

    Torch and Flax models write the same file: tensors under the equivalent torch model's
    ``state_dict`` names. A Flax module path is taken for that torch module path unless
    ``names`` maps it (``{"layers.1": "2"}`` where the torch ``nn.Sequential`` has an activation
    between; a tied ``nnx.Embed`` maps to ``(embedding path, head path)``); see
    ``mixle.flax_backend.export``. A torch model's module paths are the file's names already,
    so ``names`` is refused there.

    >>> import torch, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> save_quantized(quantize_model(torch.nn.Linear(8, 4)), path)["layers"][0]["kind"]
    'linear'
    """
    return backends.for_model(model, "save_quantized").save_quantized(model, path, names=names)


def load_quantized(path, model, *, names=None):
    """Load a ``save_quantized`` file into a copy of a float ``model`` built like the saved one.

    ``names`` (Flax models only) maps Flax module paths to the file's torch module paths, as for
    ``save_quantized``.

    >>> import torch, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> _ = save_quantized(quantize_model(torch.nn.Linear(8, 4)), path)
    >>> type(load_quantized(path, torch.nn.Linear(8, 4))).__name__
    'QuantizedLinear'
    """
    return backends.for_model(model, "load_quantized").load_quantized(path, model, names=names)


def model_nbytes(model):
    """A model's real storage bytes by kind (float, int8 codes, packed int4 codes, scales).

    >>> import torch
    >>> model_nbytes(quantize_model(torch.nn.Linear(64, 32, bias=False), bits=4)).total
    1152
    """
    return backends.for_model(model, "model_nbytes").model_nbytes(model)


class _QATWrapperUnavailable:
    """Stand-in for QATWrapper when torch is missing: constructing it explains what to install."""

    def __init__(self, *args, **kwargs):
        require("torch", extra="torch", purpose="QATWrapper")


def __getattr__(name):
    if name == "QATWrapper":
        if not is_available("torch"):
            return _QATWrapperUnavailable
        from mixle.torch_backend.layers import QATWrapper

        return QATWrapper
    raise AttributeError(f"module 'mixle.api' has no attribute {name!r}")
