"""The LM jobs' evaluator: mean next-token cross-entropy of a causal LM over held-out windows."""

import math  # noqa: F401  (its doctest compares with math.log)

from mixle._optional import require
from mixle.lm.family import family_of

__all__ = ["held_out_loss"]


def _torch():
    return require("torch", extra="torch", purpose="evaluating a causal LM")


def held_out_loss(model, windows, batch=128, *, family=None):
    """Mean next-token cross-entropy (nats) of ``model`` over ``windows``, in eval mode.

    Args:
        model: a causal LM of any family (float, QAT-wrapped or converted to int weights), on
            any device (the windows are moved to it).
        windows: int token windows, shape ``(count, length)``.
        batch: windows per forward pass.
        family: the model's ``ModelFamily`` (default: ``family_of(model)``).

    >>> import numpy as np, torch
    >>> from mixle.lm.transformer import build_causal_lm
    >>> lm = build_causal_lm(vocab=10, d_model=8, n_layer=1, n_head=2, block=4)
    >>> _ = torch.nn.init.zeros_(lm.head.weight)  # every logit 0: uniform over the 10 tokens
    >>> round(held_out_loss(lm, np.zeros((3, 5), dtype=np.int64)), 4), round(math.log(10), 4)
    (2.3026, 2.3026)
    """
    torch = _torch()
    family = family or family_of(model)
    device = next((t.device for t in model.parameters()), None)  # the windows go where the model is
    windows = torch.as_tensor(windows, device=device)
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        with torch.no_grad():
            for i in range(0, len(windows), batch):
                total -= family.sequence_log_prob(model, windows[i : i + batch]).double().sum().item()
    finally:
        model.train(was_training)
    return total / (windows.shape[0] * (windows.shape[1] - 1))
