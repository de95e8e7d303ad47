"""The backends, as data: which models and arrays each one takes and where its functions live.

Every backend's interface module offers the same functions (``apply``, ``set_enabled``,
``report``, ``convert``, ``quantize_model``, ``save_quantized``, ``load_quantized``,
``model_nbytes``, ``apply_lora``, ``merge_lora``, ``lora_report``, ``lora_parameters``) and
``SPEC_FIELDS``, the QuantSpec fields it honours; one it cannot offer raises TypeError with the
reason. ``mixle.api`` finds a backend here, never by sniffing module names elsewhere. Nothing is
imported until a backend is asked for.
"""

import importlib
from dataclasses import dataclass

from mixle._optional import require
from mixle.core.array_ops import array_kind


@dataclass(frozen=True, kw_only=True)
class Backend:
    """One backend.

    Attributes:
        name: its name in messages and in ``Grid.backends``.
        interface: the module offering the backend functions.
        packages: what that module needs installed.
        extra: the pip extra that installs them.
        model_roots: module prefixes of the model classes it takes (matched along the MRO).
        array_kind: the ``array_kind`` of the arrays it fake-quantizes.
        array_module: the module whose ``fake_quantize(x, spec)`` takes those arrays.
        array_packages: what that module needs.
    """

    name: str
    interface: str
    packages: tuple
    extra: str
    model_roots: tuple
    array_kind: str
    array_module: str
    array_packages: tuple


BACKENDS = (
    Backend(name="torch", interface="mixle.torch_backend.interface", packages=("torch",), extra="torch",
            model_roots=("torch.",), array_kind="torch", array_module="mixle.torch_backend.fake_quant",
            array_packages=("torch",)),
    Backend(name="flax", interface="mixle.flax_backend.interface", packages=("jax", "flax", "qwix"), extra="jax",
            model_roots=("flax.",), array_kind="jax", array_module="mixle.flax_backend.fake_quant",
            array_packages=("jax",)),
)


def backend_of(model):
    """The Backend record whose model classes ``model`` derives from, or None (imports nothing).

    >>> backend_of([1, 2]) is None
    True
    """
    for cls in type(model).__mro__:
        module = cls.__module__ or ""
        for backend in BACKENDS:
            if module.startswith(backend.model_roots):
                return backend
    return None


def for_model(model, purpose):
    """The interface module of the backend that takes ``model``.

    Raises:
        TypeError: no backend takes this object.
        ImportError: the backend's packages are missing (naming the pip extra).
    """
    backend = backend_of(model)
    if backend is None:
        raise TypeError(
            f"{purpose} supports torch.nn.Module, flax.nnx.Module and flax.linen.Module models, "
            f"got {type(model).__name__}"
        )
    for package in backend.packages:
        require(package, extra=backend.extra, purpose=purpose)
    return importlib.import_module(backend.interface)


def for_array(x, purpose):
    """The module whose ``fake_quantize`` takes array ``x``, or None for numpy arrays.

    >>> import numpy as np
    >>> for_array(np.zeros(2), "fake_quantize") is None
    True
    """
    kind = array_kind(x)
    for backend in BACKENDS:
        if backend.array_kind == kind:
            for package in backend.array_packages:
                require(package, extra=backend.extra, purpose=purpose)
            return importlib.import_module(backend.array_module)
    return None
