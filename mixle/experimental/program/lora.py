"""LoRA adapters composable with QAT (an alias: the API is ``mixle.apply_lora`` and friends).

``LoRALinear`` and ``QATLoRALinear`` are the torch layers (``mixle.torch_backend.layers.lora``).
"""

from mixle.api import apply_lora, get_lora_report, lora_parameters, merge_lora  # noqa: F401
from mixle.core.lora_spec import LoRASpec  # noqa: F401
from mixle.core.spec import QuantSpec  # noqa: F401

__all__ = ["LoRASpec", "LoRALinear", "QATLoRALinear", "apply_lora", "merge_lora", "get_lora_report",
           "lora_parameters"]


def __getattr__(name):
    if name in ("LoRALinear", "QATLoRALinear"):
        from mixle._optional import is_available, stand_in

        if not is_available("torch"):
            return stand_in(name, "torch")
        from mixle.torch_backend.layers import lora as torch_lora

        return getattr(torch_lora, name)
    raise AttributeError(f"module 'mixle.experimental.program.lora' has no attribute {name!r}")
