"""The Flax backend's interface: the functions every backend offers (see ``mixle.backends``).

Converting, saving and LoRA are not implemented for Flax models yet; those functions refuse
with the reason instead of doing something else.
"""

from mixle.flax_backend.qat import SPEC_FIELDS, apply, report, set_enabled  # noqa: F401


def _not_yet(purpose, instead):
    def refuse(model, *args, **kwargs):
        raise TypeError(f"{purpose} takes a torch.nn.Module; Flax models are not supported by {purpose} yet: "
                        f"{instead}")

    refuse.__name__ = purpose
    return refuse


_FILES = "train with mixle's Flax QAT and evaluate with set_fake_quant_enabled; integer export needs torch"
convert = _not_yet("convert", _FILES)
quantize_model = _not_yet("quantize_model", _FILES)
save_quantized = _not_yet("save_quantized", _FILES)
load_quantized = _not_yet("load_quantized", _FILES)
model_nbytes = _not_yet("model_nbytes", _FILES)
_LORA = "use flax.nnx.LoRA / nnx.LoRALinear (mixle has no Flax LoRA layers)"
apply_lora = _not_yet("apply_lora", _LORA)
merge_lora = _not_yet("merge_lora", _LORA)
lora_report = _not_yet("get_lora_report", _LORA)
lora_parameters = _not_yet("lora_parameters", _LORA)
