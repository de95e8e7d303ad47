"""Refusing transformers' ``save_pretrained`` of a model holding mixle's quantized layers.

transformers' ``save_pretrained`` would write the layers' ``codes``/``scale`` tensors, which its
``from_pretrained`` skips, giving randomly initialised weights with only a warning. The guard
wraps ``transformers.modeling_utils.PreTrainedModel.save_pretrained`` once (``install``) so that
each call records, in a context variable, the model being saved; a quantized layer asked for its
state while such a call runs (``check``) refuses, unless that model has a PEFT adapter loaded
(transformers then saves the adapter alone). Every other ``state_dict`` caller (torch.save,
save_quantized, PEFT's adapter-only saves) is unaffected. Nothing here imports transformers: the
guard is installed only where it is already imported (a model of its classes exists).
"""

import contextvars
import functools
import sys

__all__ = ["install", "check"]

_SAVING = contextvars.ContextVar("mixle_transformers_save_pretrained", default=())
_MODULE = "transformers.modeling_utils"


def install():
    """Wrap transformers' ``PreTrainedModel.save_pretrained`` to record its model, once; returns
    whether the guard is in place (False while transformers is not imported).

    >>> isinstance(install(), bool)
    True
    """
    modeling = sys.modules.get(_MODULE)
    if modeling is None:
        return False
    cls = modeling.PreTrainedModel
    original = cls.__dict__["save_pretrained"]
    if getattr(original, "_mixle_guard", False):
        return True

    @functools.wraps(original)
    def save_pretrained(self, *args, **kwargs):
        token = _SAVING.set(_SAVING.get() + (self,))
        try:
            return original(self, *args, **kwargs)
        finally:
            _SAVING.reset(token)

    save_pretrained._mixle_guard = True
    cls.save_pretrained = save_pretrained
    return True


def check(prefix):
    """Raise if transformers' ``save_pretrained`` (of a model without a PEFT adapter) is running.

    >>> check("model.layers.0.mlp")  # no save_pretrained in progress: nothing to refuse
    """
    if any(not getattr(model, "_hf_peft_config_loaded", False) for model in _SAVING.get()):
        raise RuntimeError(
            f"transformers' save_pretrained cannot store mixle's quantized layer {prefix.rstrip('.')!r}: "
            f"from_pretrained would skip its codes/scale and load random weights. Save with "
            f"mixle.task.quantize.save_pretrained_compressed(model, directory) (compressed-tensors: "
            f"from_pretrained and vLLM load it) or save_quantized(model, path) (mixle's own file)"
        )
