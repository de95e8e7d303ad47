"""One way to change a model: every step is recorded with its undo, so a transform finishes or
leaves the model exactly as it was (modules, attributes, weights and ``requires_grad`` flags).

apply_qat, convert, quantize_model, load_quantized, apply_lora and merge_lora all commit their
plan through ``Change``; an exception raised anywhere inside (even a KeyboardInterrupt) undoes
the steps already taken, newest first, before it propagates.
"""

import torch

_MISSING = object()


class Change:
    """A context manager that records model edits and undoes them all if the block fails.

    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    >>> first = net[0]
    >>> try:
    ...     with Change() as change:
    ...         _ = change.swap(net, {id(first): nn.Identity()})
    ...         raise RuntimeError("interrupted")
    ... except RuntimeError:
    ...     pass
    >>> net[0] is first
    True
    """

    def __init__(self):
        self._undo = []

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if kind is not None:
            for undo in reversed(self._undo):
                undo()
        self._undo.clear()
        return False

    def set(self, obj, name, value):
        """``setattr(obj, name, value)``, restoring the old attribute (or its absence) on failure."""
        old = getattr(obj, name, _MISSING)

        def undo():
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)

        setattr(obj, name, value)
        self._undo.append(undo)

    def delete(self, obj, name):
        """``delattr(obj, name)`` if it exists, restored on failure."""
        if name in vars(obj):
            old = vars(obj)[name]
            delattr(obj, name)
            self._undo.append(lambda: setattr(obj, name, old))

    def copy_(self, tensor, value):
        """Overwrite ``tensor`` in place (under no_grad), keeping a copy to restore on failure."""
        with torch.no_grad():
            backup = tensor.detach().clone()
            tensor.copy_(value)

        def undo():
            with torch.no_grad():
                tensor.copy_(backup)

        self._undo.append(undo)

    def requires_grad(self, param, flag):
        """``param.requires_grad_(flag)``, restored on failure."""
        old = param.requires_grad
        param.requires_grad_(flag)
        self._undo.append(lambda: param.requires_grad_(old))

    def swap(self, model, replacements):
        """Put ``replacements[id(child)]`` in place of each such child, under every parent (a
        module reachable under several paths is swapped everywhere).

        Returns:
            The new root: ``replacements[id(model)]`` if the root itself is replaced, else ``model``.
        """
        parents = {id(m): m for m in model.modules()}
        for new in replacements.values():  # a replacement may hold replaced children (an MHA's out_proj)
            parents.update({id(m): m for m in new.modules()})
        parents = parents.values()
        for parent in list(parents):
            for name, child in list(parent.named_children()):
                if id(child) in replacements:
                    self.set(parent, name, replacements[id(child)])
        return replacements.get(id(model), model)
