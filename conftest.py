"""Doctest collection: skip modules whose optional dependencies (torch, jax/flax/qwix) are missing."""

import importlib.util
import os
import pathlib

# The tests compare matmul outputs with float32 references. A TPU multiplies float32 matrices in
# bfloat16 passes unless asked for full precision (its quantization numerics are exact either way).
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")


def _missing(*modules):
    return any(importlib.util.find_spec(module) is None for module in modules)


_ROOT = pathlib.Path(__file__).parent
_NEEDS = {
    ("torch",): "import torch",
    ("jax", "flax", "qwix"): "import jax",
}

collect_ignore = []
for modules, marker in _NEEDS.items():
    if _missing(*modules):
        for path in (_ROOT / "mixle").rglob("*.py"):
            text = path.read_text()
            if marker in text or f'require("{modules[0]}"' in text:
                collect_ignore.append(str(path))
