"""Imports of optional dependencies that fail with the pip extra to install."""

import importlib

_EXTRA_OF = {
    "torch": "torch",
    "jax": "jax",
    "flax": "jax",
    "qwix": "jax",
    "optax": "jax",
    "matplotlib": "bench",
    "tqdm": "bench",
    "transformers": "hf",
    "peft": "hf",
    "sentencepiece": "hf",
    "gguf": "gguf",
}


def require(module, extra=None, purpose=None):
    """Import ``module`` or raise an ImportError naming the pip extra that provides it.

    Args:
        module: dotted module name, e.g. ``"torch"`` or ``"flax.nnx"``.
        extra: the mixle extra that installs it; guessed from the top-level name if omitted.
        purpose: what needs it, used in the error message.

    Returns:
        The imported module.

    >>> require("json").dumps([1])
    '[1]'
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.split(".")[0]
        extra = extra or _EXTRA_OF.get(top, "all")
        need = f" for {purpose}" if purpose else ""
        raise ImportError(
            f"mixle needs {top!r}{need}, which is not installed: "
            f"run `pip install mixle[{extra}]` (or `pip install -e .[{extra}]` from a checkout)."
        ) from err


def is_available(module):
    """True if ``module`` can be imported (without importing it when it is absent).

    >>> is_available("json")
    True
    """
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def stand_in(name, package, extra=None):
    """A stand-in for ``name`` when ``package`` is missing: calling it raises ``require``'s error.

    It is a class, so ``isinstance(x, stand_in(...))`` is simply False.

    >>> Missing = stand_in("QATWrapper", "no_such_package_here", extra="torch")
    >>> Missing()
    Traceback (most recent call last):
    ...
    ImportError: mixle needs 'no_such_package_here' for QATWrapper, which is not installed: run `pip install mixle[torch]` (or `pip install -e .[torch]` from a checkout).
    """

    def explain(*args, **kwargs):
        require(package, extra=extra, purpose=name)

    return type(name, (), {"__new__": lambda cls, *args, **kwargs: explain(), "__doc__": f"{name} (needs {package})"})
