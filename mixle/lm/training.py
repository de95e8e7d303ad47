"""The LM jobs' training loop and evaluator, for a causal LM of any family (``mixle.lm.family``).

``train`` is the ``compare`` job's configuration of the one training loop (``mixle.lm.loop``):
steps on windows of ``block + 1`` tokens of the training ids (each step samples window starts),
optionally distilled from a frozen teacher (``mixle.lm.distill``); evaluation
(``mixle.lm.evaluation.held_out_loss``) is the mean next-token cross-entropy over fixed held-out windows.
"""

import math
import time
from dataclasses import dataclass

from mixle._optional import require
from mixle.lm.evaluation import held_out_loss
from mixle.lm.family import family_of
from mixle.lm.loop import LoopConfig, Trainer

__all__ = ["warmup_cosine", "window_density", "held_out_loss", "train", "TrainLog"]


def _torch():
    return require("torch", extra="torch", purpose="training a causal LM")


def warmup_cosine(warmup, floor=0.0):
    """An ``lr_schedule(step, m_steps)`` for GradLeaf: linear warm-up, then cosine decay to ``floor``.

    ``warmup`` is a number of steps, or None: 5% of ``m_steps`` (at least 1), so a schedule whose
    length is fitted to a time budget warms up over 5% of the steps that fit.

    >>> f = warmup_cosine(10, floor=0.1)
    >>> round(f(0, 100), 2), f(9, 100), round(f(99, 100), 3)
    (0.1, 1.0, 0.1)
    """

    def schedule(step, m_steps):
        steps = max(1, m_steps // 20) if warmup is None else warmup
        if step < steps:
            return (step + 1) / steps
        progress = (step - steps) / max(1, m_steps - 1 - steps)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return schedule


def window_density(model, ids, block=None, family=None, first=None):
    """The module GradLeaf trains: ``log_density(starts)``, the log-prob of the windows at ``starts``.

    Args:
        model: a causal LM of any family; it is the returned module's ``lm`` (not copied).
        ids: the training text's token ids, an int64 tensor.
        block: windows hold ``block + 1`` tokens (default: the model's context length).
        family: the model's ``ModelFamily`` (default: ``family_of(model)``).
        first: a token id every window starts with in place of its first token (the BOS of a
            tokenizer that adds one, as llama.cpp's perplexity does), or None.

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

        def windows(self, starts):
            tokens = self.ids[starts[:, None] + self.offsets]
            if first is not None:
                tokens = tokens.clone()
                tokens[:, 0] = first
            return tokens

        def log_density(self, starts):
            return family.sequence_log_prob(self.lm, self.windows(starts))

        def logits(self, starts):  # for distillation: next-token logits of the windows and their targets
            tokens = self.windows(starts)
            return family.logits(self.lm, tokens[:, :-1]), tokens[:, 1:]

    return WindowDensity()


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


def _objective(windows, rows, batch, distill):
    """The weighted log-density objective of ``GradLeaf``: minus the mean over the batch of each
    window's log-probability (or, with ``distill``, of its distillation objective)."""
    torch = _torch()
    norm = torch.ones(rows, dtype=torch.float64)
    norm = norm / norm.sum()
    device = next(windows.parameters()).device
    weights = (norm[:batch]).to(device) * (rows / batch)  # every row weighs the same: the batch's share of it

    def objective(starts):
        log_density = windows.log_density(starts) if distill is None else distill.row_log_density(windows, starts)
        if log_density.shape != (batch,):
            raise ValueError(f"log_density returned shape {tuple(log_density.shape)} for {batch} rows: "
                             f"it must return one log density per row, shape ({batch},)")
        return -(weights.to(log_density.dtype) * log_density).sum()

    return objective


def _sampler(starts, batch, seed, device):
    """Each step's ``batch`` window starts, drawn from ``starts`` without replacement (all of them when
    ``batch`` covers them) by a generator seeded with ``seed``."""
    torch = _torch()
    generator = torch.Generator().manual_seed(seed)
    starts = torch.as_tensor(starts)
    rows = len(starts)

    def sample(state, count):
        drawn = starts if batch == rows else starts[torch.randperm(rows, generator=generator)[:batch]]
        return drawn.to(device)

    return sample


def _distillation(teacher_windows, temperature, weight):
    from mixle.lm.distill import SelfDistillation

    return SelfDistillation(teacher_windows, temperature, weight)


def _optimizer(model, factory, lr):
    """``(factory(trainable parameters, lr=lr), [(name, parameter)] in the optimizer's order)``."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters (requires_grad=True) to train")
    optimizer = factory(params, lr=lr)
    names = {id(p): name for name, p in model.named_parameters()}
    return optimizer, [(names[id(p)], p) for group in optimizer.param_groups for p in group["params"]]


def train(model, ids, starts, *, steps, lr, batch_size, block, schedule=None, seed=0, optimizer=None,
          grad_clip=None, teacher=None, temperature=1.0, weight=0.1, curve_windows=None, curve_every=None,
          start=0, progress=None, family=None):
    """Train ``model`` in place for ``steps`` steps on windows of ``block + 1`` tokens of ``ids``.

    Each step draws ``batch_size`` window starts from ``starts`` (seeded by ``seed``) and takes
    an optimizer step on their summed next-token cross-entropy (or, with a ``teacher``, on
    ``mixle.lm.distill``'s distillation objective), through ``mixle.lm.loop.Trainer``.

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
    torch = _torch()
    family = family or family_of(model)
    windows = window_density(model, ids, block, family)
    distill = None if teacher is None else _distillation(window_density(teacher, ids, block, family), temperature,
                                                         weight)
    optimizer, trainable = _optimizer(model, optimizer or torch.optim.AdamW, lr)
    rows = len(starts)
    batch = min(batch_size, rows)  # every row when the batch covers them
    config = LoopConfig(steps=steps, batch_size=batch, tokens_per_window=block, schedule=schedule,
                        grad_clip=grad_clip, check_gradient=False, rollback=True, curve_every=curve_every, start=start,
                        record_scale=1.0 / block, train_mode=True, label=str(progress),
                        advice=f". Lower lr (now {[g['lr'] for g in optimizer.param_groups]}), set grad_clip, "
                               f"or check the data for NaN/inf")
    trainer = Trainer(model, trainable, optimizer, _objective(windows, rows, batch, distill),
                      _sampler(starts, batch, seed, next(model.parameters()).device), config, family=family,
                      curve_windows=curve_windows)
    trainer.evaluate_curve()  # before the clock starts
    began = time.perf_counter()
    state = trainer.train(progress=progress is not None)
    return TrainLog(state.curve, round(time.perf_counter() - began, 2))
