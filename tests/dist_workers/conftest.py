"""The worker modules import torch or jax at import time: collect them (for doctests) only when installed."""

import importlib.util


def _missing(*modules):
    return any(importlib.util.find_spec(module) is None for module in modules)


collect_ignore = []
if _missing("torch"):
    collect_ignore += ["torch_setup.py", "torch_train.py"]
if _missing("torch", "transformers"):
    collect_ignore += ["finetune_worker.py"]
if _missing("jax", "flax", "qwix", "optax"):
    collect_ignore += ["jax_setup.py", "jax_train.py"]
