"""The Flax backend's interface: the functions every backend offers (see ``mixle.backends``).

``convert``, ``quantize_model`` and ``model_nbytes`` take NNX models (Linen: see
``mixle.flax_backend.convert.convert_linen`` and ``model_nbytes(module, variables)``);
``save_quantized`` / ``load_quantized`` write and read the same file as torch
(``mixle.flax_backend.export``). LoRA is not implemented for Flax models; those functions
refuse with the reason instead of doing something else.
"""

from mixle.flax_backend.convert import convert, model_nbytes, quantize_model  # noqa: F401
from mixle.flax_backend.export import load_quantized, save_quantized  # noqa: F401
from mixle.flax_backend.qat import SPEC_FIELDS, apply, report, set_enabled  # noqa: F401


def _not_yet(purpose, instead):
    def refuse(model, *args, **kwargs):
        raise TypeError(f"{purpose} takes a torch.nn.Module; Flax models are not supported by {purpose} yet: "
                        f"{instead}")

    refuse.__name__ = purpose
    return refuse


_LORA = "use flax.nnx.LoRA / nnx.LoRALinear (mixle has no Flax LoRA layers)"
apply_lora = _not_yet("apply_lora", _LORA)
merge_lora = _not_yet("merge_lora", _LORA)
lora_report = _not_yet("get_lora_report", _LORA)
lora_parameters = _not_yet("lora_parameters", _LORA)
