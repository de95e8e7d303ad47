"""The LM jobs' training loop and evaluator, for a causal LM of any family (``mixle.lm.family``).

Training is a ``GradLeaf`` M-step on windows of ``block + 1`` tokens of the training ids (each
step samples window starts), optionally distilled from a frozen teacher (``mixle.lm.distill``);
evaluation is the mean next-token cross-entropy over fixed held-out windows.
"""

import math
import time
from dataclasses import dataclass

from mixle._optional import require
from mixle.lm.family import family_of

__all__ = ["warmup_cosine", "window_density", "held_out_loss", "train", "TrainLog"]


def _torch():
    return require("torch", extra="torch", purpose="training a causal LM")


def warmup_cosine(warmup, floor=0.0):
    """An ``lr_schedule(step, m_steps)`` for GradLeaf: linear warm-up, then cosine decay to ``floor``.

    >>> f = warmup_cosine(10, floor=0.1)
    >>> round(f(0, 100), 2), f(9, 100), round(f(99, 100), 3)
    (0.1, 1.0, 0.1)
    """

    def schedule(step, m_steps):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, m_steps - 1 - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return schedule


def window_density(model, ids, block=None, family=None):
    """The module GradLeaf trains: ``log_density(starts)``, the log-prob of the windows at ``starts``.

    Args:
        model: a causal LM of any family; it is the returned module's ``lm`` (not copied).
        ids: the training text's token ids, an int64 tensor.
        block: windows hold ``block + 1`` tokens (default: the model's context length).
        family: the model's ``ModelFamily`` (default: ``family_of(model)``).

    Returns:
        A ``torch.nn.Module`` with ``log_density(starts)`` (shape ``(rows,)``) and, for
        distillation, ``logits(starts) -> (logits, targets)`` of the same windows.

    >>> import torch
    >>> from mixle.lm.transformer import build_causal_lm
    >>> lm, ids = build_causal_lm(vocab=10, d_model=8, n_layer=1, n_head=2, block=4), torch.arange(10)
    >>> window_density(lm, ids).log_density(torch.tensor([0, 5])).shape
    torch.Size([2])
    """
    torch = _torch()
    family = family or family_of(model)
    length = (family.context_length(model) if block is None else block) + 1

    class WindowDensity(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = model
            self.offsets = torch.arange(length)
            self.ids = ids

        def log_density(self, starts):
            return family.sequence_log_prob(self.lm, self.ids[starts[:, None] + self.offsets])

        def logits(self, starts):  # for distillation: next-token logits of the windows and their targets
            tokens = self.ids[starts[:, None] + self.offsets]
            return family.logits(self.lm, tokens[:, :-1]), tokens[:, 1:]

    return WindowDensity()


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


@dataclass(frozen=True)
class TrainLog:
    """What ``train`` records.

    Attributes:
        curve: ``{"step", "train_loss"}`` (per-token training loss of every step) and
            ``{"eval_step", "held_out_loss"}`` (on the curve windows, before the first step,
            every ``curve_every`` steps and after the last).
        seconds: wall time of the training steps (and the curve evaluations among them).
    """

    curve: dict
    seconds: float


class _Curve:
    """The curves of one training run (steps counted from ``start``)."""

    def __init__(self, model, family, windows, every, steps, start, per_token):
        self.model, self.family, self.windows, self.every = model, family, windows, every
        self.steps, self.start, self.per_token = steps, start, per_token
        self.points = {"step": [], "train_loss": [], "eval_step": [], "held_out_loss": []}

    def evaluate(self, step):
        if self.windows is not None:
            self.points["eval_step"].append(self.start + step)
            self.points["held_out_loss"].append(held_out_loss(self.model, self.windows, family=self.family))

    def record(self, step, loss):
        """GradLeaf's callback after each step."""
        self.points["step"].append(self.start + step + 1)
        self.points["train_loss"].append(loss * self.per_token)
        if (self.every and (step + 1) % self.every == 0) or step + 1 == self.steps:
            self.evaluate(step + 1)


def train(model, ids, starts, *, steps, lr, batch_size, block, schedule=None, seed=0, optimizer=None,
          grad_clip=None, teacher=None, temperature=1.0, weight=0.1, curve_windows=None, curve_every=None,
          start=0, progress=None, family=None):
    """Train ``model`` in place for ``steps`` steps on windows of ``block + 1`` tokens of ``ids``.

    Each step draws ``batch_size`` window starts from ``starts`` (seeded by ``seed``) and takes
    an optimizer step on their summed next-token cross-entropy (or, with a ``teacher``, on
    ``mixle.lm.distill``'s distillation objective).

    Args:
        model: a causal LM of any family (float or QAT-wrapped).
        ids: the training text's ids (int64 tensor); starts: the allowed window starts.
        steps, lr, batch_size, block: steps, peak learning rate, windows per step, window size.
        schedule: ``f(step, steps) -> factor`` of ``lr`` (e.g. ``warmup_cosine``); None: constant.
        seed: seeds the window sampling.
        optimizer: an optimizer class or ``f(params, lr)`` factory (default ``torch.optim.AdamW``).
        grad_clip: clip the gradient norm to this (None: no clipping).
        teacher: a frozen model of the same family to distill from, at ``temperature`` and
            ``weight`` (``mixle.lm.distill``'s defaults); None trains on the tokens alone.
        curve_windows, curve_every: held-out windows evaluated for the curve every
            ``curve_every`` steps (and before and after training); None records no held-out curve.
        start: the step number before the first step (for curves that continue another run's).
        progress: a label to show a progress bar with; None shows none.
        family: the model's ``ModelFamily`` (default: ``family_of(model)``).

    Returns:
        A ``TrainLog``.

    Raises:
        NonFiniteLossError: the loss diverged (the last good weights are restored).

    >>> import torch
    >>> from mixle.lm.transformer import build_causal_lm
    >>> lm, ids = build_causal_lm(vocab=4, d_model=8, n_layer=1, n_head=2, block=4), torch.arange(40) % 4
    >>> log = train(lm, ids, torch.arange(30), steps=40, lr=0.01, batch_size=8, block=4)
    >>> len(log.curve["train_loss"]), log.curve["train_loss"][-1] < log.curve["train_loss"][0]
    (40, True)
    """
    from mixle.lm.grad_leaf import GradLeaf

    torch = _torch()
    family = family or family_of(model)
    per_token = 1.0 / block
    curve = _Curve(model, family, curve_windows, curve_every, steps, start, per_token)
    curve.evaluate(0)
    distill = None
    if teacher is not None:
        from mixle.lm.distill import SelfDistillation

        distill = SelfDistillation(window_density(teacher, ids, block, family), temperature, weight)
    leaf = GradLeaf(window_density(model, ids, block, family), m_steps=steps, lr=lr, batch_size=batch_size,
                    optimizer=optimizer or torch.optim.AdamW, lr_schedule=schedule, grad_clip=grad_clip,
                    seed=seed, progress=progress, progress_scale=per_token, callback=curve.record, distill=distill)
    began = time.perf_counter()
    leaf.fit(starts)
    return TrainLog(curve.points, round(time.perf_counter() - began, 2))
