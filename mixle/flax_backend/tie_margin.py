"""Start QAT of a Flax model with every kernel weight inside the bin PTQ chose for it.

The Flax half of ``mixle.torch_backend.transforms.tie_margin`` (which says why): each kernel a
QAT-wrapped model quantizes moves the fraction ``margin`` of the way to the values its
fake-quantized forward uses, ``w + margin * (q - w)``, and what it stores stays the same (checked).
"""

import jax.numpy as jnp
import numpy as np

from mixle.flax_backend.qat import qat_state, quantized_kernels

__all__ = ["pull_toward_stored"]


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
    if qat_state(model) is None:
        raise ValueError(f"model={type(model).__name__}: pull_toward_stored needs a model wrapped by apply_qat")
    moved = {"margin": float(margin), "weights": 0, "layers": 0, "kept": []}
    if margin == 0:
        return moved
    pulled_kernels = []  # assigned once every kernel is computed: a failure changes nothing
    for kernel in quantized_kernels(model):
        values = np.asarray(kernel.param.get_raw_value(), np.float32)
        stored, target = kernel.stored(values)
        pulled = (values + np.float32(margin) * (target - values)).astype(np.float32)
        before, after = stored.parts(), kernel.stored(pulled)[0].parts()
        if before.keys() != after.keys() or not all(np.array_equal(before[k], after[k]) for k in before):
            moved["kept"].append(f"{kernel.owner}.{kernel.name}")
            continue
        pulled_kernels.append((kernel.param, pulled))
        moved["weights"] += int(values.size)
        moved["layers"] += 1
    for param, pulled in pulled_kernels:
        param[...] = jnp.asarray(pulled, param.get_raw_value().dtype)
    return moved
