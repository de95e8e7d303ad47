"""The torch backend's interface: the functions every backend offers (see ``mixle.backends``)."""

from mixle.torch_backend.adapters import apply_lora, lora_parameters, lora_report, merge_lora  # noqa: F401
from mixle.torch_backend.convert import convert, quantize_model  # noqa: F401
from mixle.torch_backend.export import load_quantized, model_nbytes, save_quantized  # noqa: F401
from mixle.torch_backend.layers import SPEC_FIELDS  # noqa: F401
from mixle.torch_backend.qat import apply, report, set_enabled  # noqa: F401
