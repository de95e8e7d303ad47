"""The LM jobs' one training loop: ``compare`` and ``finetune`` train through ``Trainer``, differing only by config.

A step is ``accumulate`` micro-batches: each draws window starts from the job's sampler, scores
them with the job's objective (a scalar loss, already scaled to the step's mean), checks it is
finite and backpropagates it; then the gradient norm is clipped (and checked finite), the
optimizer steps and the learning-rate schedule (``base lr * schedule(step, horizon)``) moves on.
Around the steps: the held-out curve (before the first step, every ``curve_every`` steps and after
the last), a progress bar, and for a resumable run ``state_dict`` / ``load_state_dict``, Ctrl-C and
SIGTERM stopping after a step with a checkpoint (``Stopped``), checkpoints every
``checkpoint_every`` steps and a ``--max-minutes`` budget that fits the schedule to the pace seen.
A divergence raises ``NonFiniteLossError`` before the optimizer step; with ``rollback`` the weights
and the optimizer's state are first put back as they were before the step.
"""

import contextlib
import copy
import functools
import math
import signal
import threading
import time
from dataclasses import asdict, dataclass, field

from mixle._optional import require
from mixle.lm.evaluation import held_out_loss
from mixle.lm.finetune_distributed import SINGLE, scaled

__all__ = ["LoopConfig", "TrainState", "Trainer", "Stopped", "StopSignals", "Snapshot", "NonFiniteLossError",
           "steps_that_fit", "return_free_memory"]

_PROBE_STEPS = 3  # steps timed (after the first) before a --max-minutes run fits its schedule to the time left


@dataclass(frozen=True)
class LoopConfig:
    """How ``Trainer`` runs: what differs between the jobs.

    Attributes:
        steps: the schedule's length (``--max-minutes`` may shorten it).
        batch_size, accumulate: windows per micro-batch, micro-batches per step.
        tokens_per_window: predicted tokens of a window (the job's block), for tokens/s and ``tokens``.
        schedule: ``f(step, horizon) -> factor`` of every group's learning rate; None: constant.
        grad_clip: clip the gradient norm to this; None: no clipping.
        check_gradient: refuse a non-finite gradient norm before the optimizer step.
        rollback: keep a copy of the weights and optimizer state of the step before, restored on a divergence.
        curve_every: held-out evaluation every this many steps; None: every tenth of the schedule with
            ``curve_tenths``, else only before the first step and after the last.
        curve_tenths: see ``curve_every``.
        eval_batch: windows per forward pass of a curve evaluation.
        start: the step number before the first step (a curve continuing another run's).
        record_scale: the recorded training loss is the objective's value times this (per predicted token).
        autocast: ``"bfloat16"`` or ``"float32"`` (the forwards under autocast, enabled for bfloat16),
            or None (no autocast context).
        stop_on_signals: Ctrl-C and SIGTERM stop after the current step with a checkpoint (``Stopped``).
        max_minutes: a time budget for the steps and the curve's evaluations between them (not ``prepare()``
            nor the step-0 evaluation), or None; warmup_steps: the schedule's fixed warm-up, kept when
            fitting (0: a warm-up that scales with the fitted schedule).
        checkpoint_every: save every this many steps (None: never).
        trim_memory: give the C heap's free pages back after each step (``return_free_memory``).
        train_mode: put the model in train mode while training (restored afterwards); False leaves it as it is.
        advice: appended to a divergence's message (what to change).
        label: the progress bar's label.

    >>> LoopConfig(steps=10, batch_size=4, tokens_per_window=32).accumulate
    1
    """

    steps: int
    batch_size: int
    tokens_per_window: int
    accumulate: int = 1
    schedule: object = None
    grad_clip: float | None = None
    check_gradient: bool = True
    rollback: bool = False
    curve_every: int | None = None
    curve_tenths: bool = False
    eval_batch: int = 128
    start: int = 0
    record_scale: float = 1.0
    autocast: str | None = None
    stop_on_signals: bool = False
    max_minutes: float | None = None
    warmup_steps: int = 0
    checkpoint_every: int | None = None
    trim_memory: bool = False
    train_mode: bool = False
    advice: str = ""
    label: str = "train"


def steps_that_fit(budget, step, seconds, since, steps, warmup):
    """The schedule length of a run with ``budget`` seconds, ``seconds`` spent after ``step`` steps:
    the steps that fit in the time left at the pace since ``since`` (``(step, seconds)`` after the
    first step, which pays the warm-up; curve evaluations and checkpoints done meanwhile count),
    at most ``steps``, and past the ``warmup`` steps and the current one.

    >>> steps_that_fit(60.0, step=4, seconds=10.0, since=(1, 7.0), steps=1000, warmup=5)
    54
    """
    per_step = (seconds - since[1]) / max(1, step - since[0])
    fit = step + int(max(0.0, budget - seconds) / max(per_step, 1e-9))
    return min(steps, max(warmup + 1, step + 1, fit))


class NonFiniteLossError(FloatingPointError):
    """Training diverged (a NaN or infinite loss, gradient or weight); no optimizer step was taken on it."""


class Stopped(Exception):
    """Training stopped on Ctrl-C or SIGTERM after a step; its checkpoint is written.

    Attributes:
        step: the steps done; signal_name: ``"SIGINT"`` or ``"SIGTERM"``.
    """

    def __init__(self, step, signal_name):
        super().__init__(f"stopped by {signal_name} after step {step}")
        self.step, self.signal_name = step, signal_name


class StopSignals(contextlib.AbstractContextManager):
    """Meanwhile, Ctrl-C (SIGINT) and SIGTERM set ``requested`` instead of interrupting a step.

    A second signal while one is pending interrupts at once (``KeyboardInterrupt``). Outside the
    main thread signals cannot be caught, and nothing changes.

    >>> import os, signal
    >>> with StopSignals() as signals:
    ...     os.kill(os.getpid(), signal.SIGTERM)
    >>> signals.requested
    'SIGTERM'
    """

    def __init__(self):
        self.requested, self.previous = None, {}

    def _handle(self, signum, frame):
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}
        return False


@dataclass
class TrainState:
    """The counters of a run: steps done, the schedule's length (``fitted`` once a time budget set it),
    data position, time, the curve, and the QAT and float steps' timing if one was asked for."""

    step: int = 0
    horizon: int = 1
    epoch: int = 0
    position: int = 0
    seconds: float = 0.0
    tokens: int = 0
    stopped_by: str | None = None
    fitted: bool = False
    step_timing: dict | None = None
    curve: dict = field(default_factory=lambda: {"step": [], "train_loss": [], "eval_step": [], "held_out_loss": []})


class Snapshot:
    """A copy of a module's parameters and buffers and an optimizer's state, to roll back to.

    >>> import torch
    >>> layer = torch.nn.Linear(1, 1)
    >>> snapshot = Snapshot(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    >>> _ = layer.weight.data.fill_(7.0); snapshot.restore(); layer.weight.item() != 7.0
    True
    """

    def __init__(self, module, optimizer):
        self.module, self.optimizer = module, optimizer
        self.tensors = [t for t in list(module.parameters()) + list(module.buffers())]
        self.saved = [t.detach().clone() for t in self.tensors]
        self.take()

    def take(self):
        """Copy the current weights and optimizer state."""
        import torch

        with torch.no_grad():
            for saved, live in zip(self.saved, self.tensors):
                saved.copy_(live)
        self.opt_state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                              for k, v in s.items()} for p, s in self.optimizer.state.items()}

    def restore(self):
        """Put the copied weights and optimizer state back."""
        import torch

        with torch.no_grad():
            for saved, live in zip(self.saved, self.tensors):
                live.copy_(saved)
        self.optimizer.state.clear()
        for p, s in self.opt_state.items():
            self.optimizer.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                                       for k, v in s.items()}


def return_free_memory():
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere nothing).

    A training step frees thousands of layer-sized tensors that glibc keeps in its heap between
    long-lived ones (AdamW's moments, gradients), where they stay resident: on SmolLM2-135M about
    20 MB a layer. Returned after every step and phase, they do not add up to the next peak.
    Returns whether memory could be returned.

    >>> isinstance(return_free_memory(), bool)
    True
    """
    trim = _malloc_trim()
    return bool(trim is not None and trim(0))


@functools.cache
def _malloc_trim():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


class Trainer:
    """Trains ``model`` by ``objective`` on window starts from ``sampler``, as ``config`` says.

    Args:
        model: the model trained (its parameters ``trainable`` are what the optimizer steps).
        trainable: ``[(name, parameter)]`` trained, in the order the gradient norm is taken.
        optimizer: a torch optimizer over them; its groups' learning rates are the schedule's bases.
        objective: ``f(starts) -> loss``, a scalar tensor: this micro-batch's share of the step's loss.
        sampler: ``f(state, count) -> starts`` of the next micro-batch (it may move ``state``'s data position).
        config: a ``LoopConfig``.
        family: the model's ``ModelFamily``; curve_windows: held-out windows of the curve (None: no curve).
        ranks: the processes (``mixle.lm.finetune_distributed``); default one process.

    >>> import torch
    >>> layer, x = torch.nn.Linear(1, 1), torch.linspace(-1, 1, 8)[:, None]
    >>> objective = lambda starts: ((layer(x[starts]) - 2 * x[starts]) ** 2).mean()
    >>> trainer = Trainer(layer, list(layer.named_parameters()), torch.optim.SGD(layer.parameters(), lr=0.1),
    ...                   objective, lambda state, count: torch.arange(count),
    ...                   LoopConfig(steps=3, batch_size=8, tokens_per_window=1))
    >>> trainer.train().step
    3
    """

    def __init__(self, model, trainable, optimizer, objective, sampler, config, *, family=None, curve_windows=None,
                 ranks=SINGLE):
        torch = require("torch", extra="torch", purpose="training")
        self.torch, self.model, self.trainable, self.optimizer = torch, model, trainable, optimizer
        self.objective, self.sampler, self.config, self.family = objective, sampler, config, family
        self.curve_windows, self.ranks = curve_windows, ranks
        self.device = next(model.parameters()).device
        self.state = TrainState(horizon=config.steps)
        schedule = config.schedule or (lambda step, horizon: 1.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule(step, self.state.horizon))
        self.snapshot = Snapshot(model, optimizer) if config.rollback else None

    # ------------------------------------------------------------------ state through a checkpoint

    def state_dict(self):
        """Everything the next step depends on (tensors on the CPU)."""
        torch = self.torch
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        tensors, optimizer = self.ranks.training_state(self.optimizer, self.trainable)  # whole, gathered from shards
        return {"state": asdict(self.state), "optimizer": optimizer, "scheduler": self.scheduler.state_dict(),
                "rng": rng, "trainable": tensors}

    def weights_finite(self):
        """Whether every trained tensor is finite (in every process)."""
        return self.ranks.finite([p for _, p in self.trainable])

    def load_state_dict(self, payload, source):
        """Continue from ``state_dict()``'s ``payload``; ValueError naming ``source`` if it does not fit."""
        torch = self.torch
        saved = payload["trainable"]
        mine = dict(self.trainable)
        if set(saved) != set(mine) or any(tuple(saved[k].shape) != tuple(mine[k].shape) for k in mine):
            raise ValueError(f"resume: {str(source)!r} holds other trained tensors than this run trains "
                             f"(e.g. {sorted(set(saved) ^ set(mine))[:3]}): it belongs to another model or target")
        self.ranks.load_training_state(self.optimizer, self.trainable, saved, payload["optimizer"])
        self.scheduler.load_state_dict(payload["scheduler"])
        self.state = TrainState(**payload["state"])
        torch.set_rng_state(payload["rng"]["torch"])
        if "cuda" in payload["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(payload["rng"]["cuda"], self.device)

    # ------------------------------------------------------------------ one step

    def autocast(self):
        """The forwards' autocast context (``config.autocast``), or none."""
        if self.config.autocast is None:
            return contextlib.nullcontext()
        return self.torch.autocast(device_type=self.device.type, dtype=self.torch.bfloat16,
                                   enabled=self.config.autocast == "bfloat16")

    def diverged(self, what):
        """The ``NonFiniteLossError`` of a divergence (after rolling back, with ``config.rollback``)."""
        restored = ""
        if self.snapshot is not None:
            self.snapshot.restore()
            restored = ", and the weights and optimizer state were restored to the last step with a finite loss"
        return NonFiniteLossError(f"{what} at step {self.state.step + 1}: training stopped before the optimizer "
                                  f"step{restored}{self.config.advice}")

    def micro_step(self, starts):
        """Backpropagate the objective of ``starts``; returns its value (summed over the processes)."""
        try:
            loss = self.objective(starts)
        except Exception as error:
            if not self.weights_finite():  # a forward refused a non-finite weight before the loss showed it
                raise self.diverged(f"the trained weights became non-finite ({error})") from error
            raise
        value = self.ranks.total(loss.item())  # the whole batch's: every process takes the same decision
        if not math.isfinite(value):
            raise self.diverged(f"the training loss became {value}")
        scaled(loss, self.ranks).backward()
        return value

    def step(self):
        """One optimizer step; returns its loss (the objective's values summed over the micro-batches)."""
        torch, config = self.torch, self.config
        if self.snapshot is not None and self.state.step:
            self.snapshot.take()
        self.optimizer.zero_grad(set_to_none=True)
        value = sum(self.micro_step(self.sampler(self.state, config.batch_size)) for _ in range(config.accumulate))
        if config.grad_clip is not None or config.check_gradient:  # the norm: clipped to grad_clip, else only read
            norm = torch.nn.utils.clip_grad_norm_([p for _, p in self.trainable], config.grad_clip or math.inf)
            if config.check_gradient and not bool(torch.isfinite(norm)):
                raise self.diverged(f"the gradient norm became {float(norm)}")
        self.optimizer.step()
        self.scheduler.step()
        if config.trim_memory:
            return_free_memory()
        return value

    def drop_gradients(self):
        """Free the gradients (after the last step)."""
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ the loop

    def evaluate_curve(self):
        """Held-out loss of the model on the curve windows, recorded at the current step."""
        if self.curve_windows is None:
            return
        loss = held_out_loss(self.model, self.curve_windows, batch=self.config.eval_batch, family=self.family)
        self.state.curve["eval_step"].append(self.config.start + self.state.step)
        self.state.curve["held_out_loss"].append(loss)

    def _curve_due(self):
        config, state = self.config, self.state
        every = config.curve_every or (max(1, state.horizon // 10) if config.curve_tenths else None)
        return bool(every and state.step % every == 0) or state.step == state.horizon

    def _fit_horizon(self, budget, since):
        """A ``--max-minutes`` run's schedule length, from ``steps_that_fit``."""
        state, config = self.state, self.config
        state.horizon = steps_that_fit(budget, state.step, state.seconds, since, config.steps, config.warmup_steps)
        state.fitted = True

    def prepare(self):
        """Compile what a step runs, before the budget's clock starts (a torch step compiles nothing)."""

    def train(self, save=None, progress=False, callback=None):
        """Run steps until the schedule's end (or ``max_minutes``); ``save()`` writes a checkpoint.

        Raises:
            Stopped: Ctrl-C or SIGTERM with ``stop_on_signals`` (after the step in progress, with a checkpoint saved).
            NonFiniteLossError: the loss or gradient diverged (no checkpoint written).
        """
        was_training = self.model.training if self.config.train_mode else None
        if self.config.train_mode:
            self.model.train()
        bar = _bar(progress and self.ranks.main, self.state, self.config)
        try:
            signals = StopSignals() if self.config.stop_on_signals else contextlib.nullcontext()
            with signals:
                self._run(save, bar, callback, signals)
        finally:
            if bar is not None:
                bar.close()
            if self.config.train_mode:
                self.model.train(was_training)
        self.drop_gradients()  # the gradients are not needed past the last step
        state = self.state
        if state.stopped_by is None:  # the schedule's end: the steps, or the steps max_minutes fitted
            state.stopped_by = "steps" if state.horizon == self.config.steps else "max_minutes"
        return state

    def _run(self, save, bar, callback, signals):
        state, config = self.state, self.config
        budget = None if config.max_minutes is None else 60.0 * config.max_minutes
        tokens_per_step = config.batch_size * config.tokens_per_window * config.accumulate
        self.prepare()
        if state.step == 0 and not state.curve["eval_step"]:
            self.evaluate_curve()
        began, base = time.perf_counter(), state.seconds  # the budget counts the steps and the curve between them
        # A run stopped before its schedule was fitted fits it when resumed; a fitted one keeps it.
        fitting, since = budget is not None and not state.fitted, None
        while state.step < state.horizon:
            if budget is not None and state.seconds >= budget:
                state.stopped_by = "max_minutes"
                break
            tick = time.perf_counter()
            loss = self.step()
            state.step, state.tokens = state.step + 1, state.tokens + tokens_per_step
            state.curve["step"].append(config.start + state.step)
            state.curve["train_loss"].append(loss * config.record_scale)
            state.seconds = self.ranks.slowest(base + time.perf_counter() - began)  # one clock for all
            if fitting and since is None:  # the pace is timed from the end of this call's first step
                since = (state.step, state.seconds)
            elif fitting and state.step == since[0] + _PROBE_STEPS:
                self._fit_horizon(budget, since)
            if self._curve_due():
                self.evaluate_curve()
                if fitting and state.step > since[0] + _PROBE_STEPS and state.step < state.horizon:
                    state.seconds = self.ranks.slowest(base + time.perf_counter() - began)
                    self._fit_horizon(budget, since)  # refitted to the pace seen so far
            if bar is not None:
                _show(bar, state, loss * config.record_scale, tokens_per_step / (time.perf_counter() - tick))
            if config.checkpoint_every and state.step % config.checkpoint_every == 0 and state.step < state.horizon:
                save()
            if callback is not None:
                callback(self)
            requested = self.ranks.stop_request(getattr(signals, "requested", None))  # a signal to any process stops all
            if requested:
                save()
                raise Stopped(state.step, requested)


def _bar(progress, state, config):
    if not progress:
        return None
    tqdm = require("tqdm.auto", extra="bench", purpose="the progress bar").tqdm
    return tqdm(total=state.horizon, initial=state.step, desc=config.label, unit="step", dynamic_ncols=True)


def _show(bar, state, loss, tokens_per_second):
    if bar.total != state.horizon:
        bar.total = state.horizon
    bar.set_postfix_str(f"loss={loss:.4f}, {tokens_per_second:,.0f} tok/s", refresh=False)
    bar.update(1)
