"""Start QAT with every weight inside the quantization bin PTQ chose for it.

A float weight that sits exactly on a rounding tie of the target lattice is rounded one way by
PTQ, and the first optimizer step (whatever its size: Adam's first update is ``lr * sign(grad)``)
sends it to whichever side its gradient prefers, a full lattice step at once. When many weights
sit on ties this is a jump away from PTQ. It happens when the float model is itself a
dequantized llama.cpp file whose lattice divides the target's: Q5_0's scale is ``max / -16`` and
Q4_0's ``max / -8``, so every odd Q5_0 code is a Q4_0 tie (about half the weights of a Gemma 3
Q4_K_M file's Q5_0 matrices).

``pull_toward_stored`` moves each quantized weight the fraction ``margin`` of the way to the value
its layer stores: ``w + margin * (q - w)``. The stored values stay the same (checked), the model's
quantized output is unchanged, and a weight on a tie is ``margin`` half-steps inside PTQ's bin, so
it changes bins only once its gradient has kept one sign for a while.
"""

import torch

__all__ = ["pull_toward_stored"]


def _quantized_weights(model):
    """``(path, module, name)`` of every weight a QAT layer of ``model`` quantizes."""
    for path, module in model.named_modules():
        if getattr(module, "spec", None) is None:
            continue
        if hasattr(module, "quantized_weights"):
            yield from ((f"{path}.{name}", module, name) for name in module.quantized_weights())
        elif hasattr(module, "quantized_weight") and isinstance(getattr(module, "weight", None), torch.nn.Parameter):
            yield f"{path}.weight", module, "weight"


def _stored(module, name):
    """The values ``module`` stores for its weight ``name`` (in the weight's layout)."""
    param = getattr(module, name)
    value = module.quantized_weights()[name] if hasattr(module, "quantized_weights") else module.quantized_weight()
    value = value.detach()
    return value if value.shape == param.shape else value.t()


def pull_toward_stored(model, margin):
    """Move every QAT weight of ``model`` the fraction ``margin`` toward the value its layer stores.

    Args:
        model: a model wrapped by ``apply_qat`` (fake-quant enabled).
        margin: the fraction, in ``[0, 1)``; 0 changes nothing.

    Returns:
        ``{"margin", "weights", "layers", "kept"}``: the weights moved, the layers moved, and the
        paths of layers left as they were because moving them would have changed what they store
        (a scale search that lands elsewhere for the moved weights).

    Raises:
        ValueError: ``margin`` outside ``[0, 1)``.

    >>> import torch
    >>> from mixle.api import apply_qat
    >>> net = apply_qat(torch.nn.Sequential(torch.nn.Linear(32, 2)), grid="q4_0")
    >>> before = net[0].quantized_weight().clone()
    >>> pull_toward_stored(net, 0.25)["layers"], torch.equal(net[0].quantized_weight(), before)
    (1, True)
    """
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 <= margin < 1:
        raise ValueError(f"margin={margin!r} must be a number in [0, 1), e.g. 0.05 (0 leaves the weights as they are)")
    moved = {"margin": float(margin), "weights": 0, "layers": 0, "kept": []}
    if margin == 0:
        return moved
    saved = []  # (param, its values before): a failure puts every weight back
    try:
        with torch.no_grad():
            for path, module, name in list(_quantized_weights(model)):
                param = getattr(module, name)
                stored = _stored(module, name).clone()
                saved.append((param, param.detach().clone()))
                param.add_(margin * (stored - param))
                if not torch.equal(_stored(module, name), stored):
                    param.copy_(saved.pop()[1])
                    moved["kept"].append(path)
                    continue
                moved["weights"] += int(param.numel())
                moved["layers"] += 1
    except BaseException:
        with torch.no_grad():
            for param, before in saved:
                param.copy_(before)
        raise
    return moved
