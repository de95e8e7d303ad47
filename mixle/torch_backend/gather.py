"""What a file writer needs of a torch model, gathered on the torch side in one call and handed on
framework-free: each tensor's float weight as a float32 numpy array, or the ``QuantizedArray`` the
file stores for a quantized layer (``written_array``: its own codes and scales), so that the writer
(``mixle.gguf.writer``) never touches torch.
"""

import torch
from torch import nn

from mixle.torch_backend.layers.layer_kinds import written_array
from mixle.torch_backend.transforms.convert import check_convertible

__all__ = ["check_writable", "gather_weights"]


def check_writable(model, what="save_gguf"):
    """Refuse what is no torch model, or a model with QAT layers a file cannot store (e.g. LoRA
    layers: fold them in first; ``check_convertible``).

    >>> check_writable(nn.Linear(2, 2))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what} takes a torch.nn.Module, got {type(model).__name__}")
    check_convertible(model)


def gather_weights(parts, given=None):
    """``{tensor name: numpy float32 array or QuantizedArray}``: the data of every tensor of a file.

    Args:
        parts: what the file holds, each with ``name``, ``path`` (the model path), ``module`` and
            ``attr`` (a layer and its weight; None for a tensor of its own), ``tensor`` (a float
            tensor written as it is: a norm, a bias, a float router) and ``row_slice`` (the rows of
            an expert weight the tensor takes): ``mixle.gguf.layouts.Part``.
        given: ``{model path: QuantizedArray}`` written instead of that layer's own weight.

    Returns:
        For a quantized layer (or a ``given`` path) its ``QuantizedArray`` (a fused expert weight's
        whole array, shared by the tensors that take its rows); else the float32 numpy array
        (an expert weight's row slice taken).

    Raises:
        ValueError: a QAT layer whose weight cannot be stored; the message names the layer.

    >>> gather_weights([type("Part", (), dict(name="w", path="fc", module=nn.Linear(2, 3), attr="weight",
    ...                                      tensor=None, row_slice=None))])["w"].shape
    (3, 2)
    """
    given = {} if given is None else given
    stored, out = {}, {}
    with torch.no_grad():
        for part in parts:
            if part.module is None:
                out[part.name] = _numpy(part.tensor)
                continue
            quantized = given.get(part.path)
            if quantized is None:
                quantized = _stored(part, stored)
            if quantized is not None:
                out[part.name] = quantized
            elif part.tensor is not None:  # a float matrix llama.cpp keeps F32 (a router)
                out[part.name] = _numpy(part.tensor)
            else:
                weight = getattr(part.module, part.attr).detach()
                out[part.name] = _numpy(weight if part.row_slice is None else weight[..., part.row_slice, :])
    return out


def _stored(part, stored):
    """The layer's stored array, or None (float); ``stored`` caches them by model path (a fused
    weight's gate and up share one)."""
    if part.path not in stored:
        try:
            stored[part.path] = written_array(part.module, part.attr)
        except ValueError as err:
            raise ValueError(str(err) if str(err).startswith("layer ") else f"layer {part.path!r}: {err}") from None
    return stored[part.path]


def _numpy(tensor):
    return tensor.detach().cpu().to(torch.float32).numpy()
