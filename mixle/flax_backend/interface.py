"""The Flax backend's interface: the functions every backend offers (see ``mixle.backends``).

``convert``, ``quantize_model`` and ``model_nbytes`` take NNX models (Linen: see
``mixle.flax_backend.convert.convert_linen`` and ``model_nbytes(module, variables)``);
``save_quantized`` / ``load_quantized`` write and read the same file as torch
(``mixle.flax_backend.export``); the LoRA functions take NNX models (``mixle.flax_backend.lora``).
"""

from mixle.flax_backend.convert import convert, model_nbytes, quantize_model  # noqa: F401
from mixle.flax_backend.export import load_quantized, save_quantized  # noqa: F401
from mixle.flax_backend.lora import apply_lora, lora_parameters, lora_report, merge_lora  # noqa: F401
from mixle.flax_backend.qat import SPEC_FIELDS, apply, report, set_enabled  # noqa: F401
from mixle.flax_backend.tie_margin import pull_toward_stored  # noqa: F401

