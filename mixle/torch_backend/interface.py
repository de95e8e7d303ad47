"""The torch backend's interface: the functions every backend offers (see ``mixle.backends``)."""

from mixle.torch_backend.transforms.adapters import apply_lora, lora_parameters, lora_report, merge_lora  # noqa: F401
from mixle.torch_backend.transforms.convert import convert, quantize_model  # noqa: F401
from mixle.torch_backend import export
from mixle.torch_backend.export import model_nbytes  # noqa: F401
from mixle.torch_backend.layers.qat import SPEC_FIELDS  # noqa: F401
from mixle.torch_backend.transforms.apply import apply, report, set_enabled  # noqa: F401
from mixle.torch_backend.transforms.tie_margin import pull_toward_stored  # noqa: F401


def _refuse_names(purpose, names):
    if names is not None:
        raise TypeError(
            f"{purpose}(names=...) maps Flax module paths to the torch module paths the file uses; a torch "
            f"model's module paths are those names already, so there is nothing to map: drop names= "
            f"(got {names!r})"
        )


def save_quantized(model, path, *, names=None):
    """``mixle.torch_backend.export.save_quantized``; ``names`` (Flax only) is refused."""
    _refuse_names("save_quantized", names)
    return export.save_quantized(model, path)


def load_quantized(path, model, *, names=None):
    """``mixle.torch_backend.export.load_quantized``; ``names`` (Flax only) is refused."""
    _refuse_names("load_quantized", names)
    return export.load_quantized(path, model)
