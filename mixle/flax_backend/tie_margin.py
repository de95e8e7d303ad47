"""Start QAT of a Flax model with every kernel weight inside the bin PTQ chose for it.

The Flax half of ``mixle.torch_backend.transforms.tie_margin`` (which says why): each kernel a
QAT-wrapped model quantizes moves the fraction ``margin`` of the way to the values its
fake-quantized forward uses, ``w + margin * (q - w)``, and what it stores stays the same (checked).
"""

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mixle.core.numerics import quantize_array
from mixle.flax_backend.fake_quant import weight_layout
from mixle.flax_backend.provider import QUANTIZED
from mixle.flax_backend.qat import qat_state

__all__ = ["pull_toward_stored"]


def _stored(kernel, spec, layout, importance, name):
    """The codes of ``kernel`` (numpy) and the values they stand for, in the kernel's own layout."""
    perm, out_count = weight_layout(kernel.ndim, layout)
    moved = np.transpose(kernel, perm)
    matrix = moved.reshape(math.prod(kernel.shape[a] for a in perm[:out_count]), -1)
    stored = quantize_array(matrix, spec, name=name, importance=importance)
    values = np.transpose(np.asarray(stored.dequantize(), np.float32).reshape(moved.shape), np.argsort(perm))
    return stored, values


def pull_toward_stored(model, margin):
    """Move every quantized kernel of a QAT-wrapped Flax ``model`` the fraction ``margin`` toward the
    values it stores (see the module docstring).

    Args:
        model: a Flax model wrapped by ``apply_qat``.
        margin: the fraction, in ``[0, 1)``; 0 changes nothing.

    Returns:
        ``{"margin", "weights", "layers", "kept"}`` as the torch backend's ``pull_toward_stored``.

    Raises:
        ValueError: ``margin`` outside ``[0, 1)``, or ``model`` not QAT-wrapped.

    >>> pull_toward_stored  # doctest: +ELLIPSIS
    <function pull_toward_stored at ...>
    """
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 <= margin < 1:
        raise ValueError(f"margin={margin!r} must be a number in [0, 1), e.g. 0.05 (0 leaves the weights as they are)")
    state = qat_state(model)
    if state is None:
        raise ValueError(f"model={type(model).__name__}: pull_toward_stored needs a model wrapped by apply_qat")
    moved = {"margin": float(margin), "weights": 0, "layers": 0, "kept": []}
    if margin == 0:
        return moved
    modules = {".".join(str(p) for p in path): module for path, module in nnx.iter_modules(model)}
    for (owner, name), (record, _) in sorted(state.provider.records.items()):
        spec = state.specs.get(owner)
        if record != QUANTIZED or spec is None:
            continue
        param = vars(modules[owner])[name]
        kernel = np.asarray(param.get_raw_value(), np.float32)
        args = (spec, state.provider.layouts[(owner, name)], state.provider.importance.get(owner), f"{owner}.{name}")
        stored, values = _stored(kernel, *args)
        pulled = (kernel + np.float32(margin) * (values - kernel)).astype(np.float32)
        again, _ = _stored(pulled, *args)
        before, after = stored.parts(), again.parts()
        if before.keys() != after.keys() or not all(np.array_equal(before[k], after[k]) for k in before):
            moved["kept"].append(f"{owner}.{name}")
            continue
        param[...] = jnp.asarray(pulled, param.get_raw_value().dtype)
        moved["weights"] += int(kernel.size)
        moved["layers"] += 1
    return moved
