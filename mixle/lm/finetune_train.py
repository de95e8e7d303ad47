"""The finetune job's training loop: resumable steps of AdamW on distillation from the float model.

One step is ``accumulate`` micro-batches of ``batch_size`` windows of ``block + 1`` training
tokens (``mixle.lm.finetune_data.window_order``), each through the student (and the frozen
teacher) via ``mixle.lm.training.window_density``, scored by ``mixle.lm.distill``'s
``distill_row_loss`` (``w = 1``: KL at T; ``w = 0``: cross-entropy), averaged per predicted
token (``mixle.lm.chunked_loss``: a few tokens at a time, so that few tensors of the logits'
size exist at once), then one AdamW step with the warm-up + cosine rate of ``mixle.lm.training.warmup_cosine``
(a ``LambdaLR``). ``--dtype bfloat16`` runs both forwards under bfloat16 autocast.

Everything a step depends on is in the trainer's state: the trained tensors, AdamW's state, the
scheduler, the data position, torch's RNG; ``state_dict`` / ``load_state_dict`` move it through a
checkpoint, so a resumed run continues bit for bit. Ctrl-C and SIGTERM ask the loop to stop after
the current step (``StopSignals``); it then writes a checkpoint and raises ``Stopped``. A
non-finite loss or gradient stops it before the optimizer step with ``NonFiniteLossError``,
leaving the last checkpoint on disk as it was.
"""

import contextlib
import functools
import math
import signal
import threading
import time
from dataclasses import asdict, dataclass, field

from mixle._optional import require
from mixle.lm.chunked_loss import chunked_tokens
from mixle.lm.distill import distill_row_loss, distill_token_loss
from mixle.lm.finetune_data import window_order
from mixle.lm.finetune_distributed import SINGLE, scaled
from mixle.lm.grad_leaf import NonFiniteLossError
from mixle.lm.training import held_out_loss, warmup_cosine, window_density

__all__ = ["steps_that_fit", "Stopped", "StopSignals", "TrainState", "FinetuneTrainer", "NonFiniteLossError",
           "row_loss", "token_loss", "rows_of_tokens", "return_free_memory"]

_PROBE_STEPS = 3  # steps timed (after the first) before a --max-minutes run fits its schedule to the time left


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
    """The counters of a run: steps done, the schedule's length, data position, time, the curve."""

    step: int = 0
    horizon: int = 1
    epoch: int = 0
    position: int = 0
    seconds: float = 0.0
    tokens: int = 0
    stopped_by: str | None = None
    curve: dict = field(default_factory=lambda: {"step": [], "train_loss": [], "eval_step": [], "held_out_loss": []})


def row_loss(logits, teacher_logits, targets, temperature, weight, *, overwrite_teacher=False):
    """``mixle.lm.distill.distill_row_loss``, with its pure-KL case (``weight == 1``) in one fused
    ``kl_div`` and fewer temporaries of the logits' size (about 100 MB each for 4 x 128 tokens of a
    49k vocabulary): no cross-entropy term computed only to be multiplied by 0, no division by a
    temperature of 1, and with ``overwrite_teacher`` the teacher's log-probabilities computed in
    the teacher logits' own memory (which then hold them). It is
    ``rows_of_tokens(token_loss(...), temperature, weight)``.

    >>> import torch
    >>> s, t, y = torch.randn(2, 3, 5), torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    >>> [torch.allclose(row_loss(s, t.clone(), y, temp, 1.0, overwrite_teacher=True), distill_row_loss(s, t, y, temp, 1.0),
    ...                 atol=1e-6) for temp in (1.0, 2.0)]
    [True, True]
    """
    tokens = token_loss(logits, teacher_logits, targets, temperature, weight, overwrite_teacher=overwrite_teacher)
    return rows_of_tokens(tokens, temperature, weight)


def token_loss(logits, teacher_logits, targets, temperature, weight, *, overwrite_teacher=False):
    """``row_loss``'s terms per predicted token, ``(rows, tokens)``; each depends only on that token's
    logits and target (for ``weight == 1`` the KL before its factor ``T^2``).

    >>> import torch
    >>> token_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), 1.0, 1.0).tolist()
    [[0.0, 0.0]]
    """
    if weight != 1.0:
        return distill_token_loss(logits, teacher_logits, targets, temperature, weight)
    import torch
    import torch.nn.functional as F

    log_q = F.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
    with torch.no_grad():
        teacher = teacher_logits.detach()
        if temperature != 1.0:
            teacher = teacher / temperature
        elif not overwrite_teacher:
            teacher = teacher.clone()
        log_p = teacher.sub_(teacher.logsumexp(dim=-1, keepdim=True))
    return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(dim=-1)


def rows_of_tokens(tokens, temperature, weight):
    """The per-row loss of ``token_loss``'s ``tokens``: their sum over each row (times ``T^2`` for ``weight == 1``).

    >>> import torch
    >>> rows_of_tokens(torch.ones(2, 3), 2.0, 1.0).tolist(), rows_of_tokens(torch.ones(2, 3), 2.0, 0.5).tolist()
    ([12.0, 12.0], [3.0, 3.0])
    """
    return temperature**2 * tokens.sum(dim=1) if weight == 1.0 else tokens.sum(dim=1)


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


def _named_trainable(model):
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


class FinetuneTrainer:
    """Trains ``student`` (QAT-wrapped, its trainable parameters chosen) on ``data`` per ``config``.

    Args:
        student: the model to train, on its device.
        teacher: the frozen float model to distil from, or None (``objective="ce"``).
        family: the models' ``ModelFamily``.
        data: the run's ``FinetuneData``.
        config: the run's ``FinetuneConfig``.
        ranks: the run's processes (``mixle.lm.finetune_distributed``): each trains on its share
            of every micro-batch, and they agree on every decision; default one process.

    >>> FinetuneTrainer.__name__
    'FinetuneTrainer'
    """

    def __init__(self, student, teacher, family, data, config, ranks=SINGLE):
        torch = require("torch", extra="torch", purpose="mixle finetune")
        self.torch, self.student, self.teacher, self.family, self.config = torch, student, teacher, family, config
        self.ranks = ranks
        self.device = next(student.parameters()).device
        self.ids = data.train_ids.to(self.device)
        self.curve_windows = data.curve_windows
        self.student_windows = window_density(student, self.ids, config.block, family)
        self.teacher_windows = None if teacher is None else window_density(teacher, self.ids, config.block, family)
        self.trainable = _named_trainable(student)
        self.optimizer = torch.optim.AdamW(self._groups(), lr=config.lr, weight_decay=config.weight_decay)
        self.state = TrainState(horizon=config.steps)
        schedule = warmup_cosine(config.warmup_steps(), floor=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lambda step: schedule(step, self.state.horizon))
        self._order, self._order_epoch = None, None

    def _groups(self):
        from mixle.torch_backend.layers.learned_scale import param_groups

        params = [p for _, p in self.trainable]
        if not params:
            raise ValueError("the model has no trainable parameters: check --lora and the target")
        scale_lr = self.config.scale_lr or 10 * self.config.lr
        return param_groups(self.student, params, self.config.lr, scale_lr, self.config.weight_decay)

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

    def release(self):
        """Drop the optimizer's state, the scheduler and the teacher (after the last step), freeing their memory."""
        import gc

        self.optimizer.state.clear()
        self.optimizer = self.scheduler = self.teacher = self.teacher_windows = None
        gc.collect()  # the scheduler's schedule refers back to the trainer: a cycle

    # ------------------------------------------------------------------ one step

    def _next_starts(self, count):
        """The next ``count`` window starts in the data order (moving the data position)."""
        torch, state, config = self.torch, self.state, self.config
        taken = []
        while count:
            if self._order_epoch != state.epoch:
                self._order = window_order(len(self.ids), config.block, config.seed, state.epoch)
                self._order_epoch = state.epoch
            part = self._order[state.position : state.position + count]
            taken.append(part)
            count -= len(part)
            state.position += len(part)
            if state.position >= len(self._order):
                state.epoch, state.position = state.epoch + 1, 0
        return self.ranks.share(torch.cat(taken)).to(self.device)  # the same windows, shared among the processes

    def _autocast(self):
        enabled = self.config.dtype == "bfloat16"
        return self.torch.autocast(device_type=self.device.type, dtype=self.torch.bfloat16, enabled=enabled)

    def _diverged(self, what):
        return NonFiniteLossError(
            f"{what} at step {self.state.step + 1}: training stopped before the optimizer step, and the last "
            f"checkpoint is kept as it was. Lower --lr (now {self.config.lr:g})"
            + (", use --dtype float32" if self.config.dtype == "bfloat16" else "")
            + (", set --grad-clip" if self.config.grad_clip is None else "") + ", or check the data")

    def _micro_step(self, starts, scale):
        torch, config = self.torch, self.config
        with self._autocast():
            try:
                logits, targets = self.student_windows.logits(starts)
            except (ValueError, RuntimeError):
                if not self.weights_finite():
                    raise self._diverged("the trained weights became non-finite") from None
                raise
            if self.teacher_windows is not None:
                with torch.no_grad():
                    teacher_logits = self.teacher_windows.logits(starts)[0]
            else:
                teacher_logits = logits.detach()
        temperature, weight = config.temperature, config.distill_weight()
        per_token = functools.partial(token_loss, temperature=temperature, weight=weight)
        tokens = chunked_tokens(per_token, logits.float(), teacher_logits.float(), targets,
                                grad_into_teacher=self.teacher_windows is not None)  # the teacher's logits are ours alone
        del logits, teacher_logits  # alive only while the loss needs them (its saved tensors), not through backward
        rows = rows_of_tokens(tokens, temperature, weight)
        loss = rows.sum() * scale
        value = self.ranks.total(loss.item())  # the whole batch's: every process takes the same decision
        if not math.isfinite(value):
            raise self._diverged(f"the training loss became {value}")
        scaled(loss, self.ranks).backward()
        return value

    def step(self):
        """One optimizer step; returns its loss per predicted token."""
        torch, config = self.torch, self.config
        self.optimizer.zero_grad(set_to_none=True)
        scale = 1.0 / (config.batch_size * config.block * config.accumulate)
        value = sum(self._micro_step(self._next_starts(config.batch_size), scale) for _ in range(config.accumulate))
        params = [p for _, p in self.trainable]
        norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip or math.inf)
        if not bool(torch.isfinite(norm)):
            raise self._diverged(f"the gradient norm became {float(norm)}")
        self.optimizer.step()
        self.scheduler.step()
        return_free_memory()
        return value

    # ------------------------------------------------------------------ the loop

    def evaluate_curve(self):
        """Held-out loss of the student on the curve windows, recorded at the current step."""
        loss = held_out_loss(self.student, self.curve_windows, batch=self.config.batch_size, family=self.family)
        self.state.curve["eval_step"].append(self.state.step)
        self.state.curve["held_out_loss"].append(loss)

    def _curve_due(self):
        every = self.config.curve_every or max(1, self.state.horizon // 10)
        return self.state.step % every == 0 or self.state.step == self.state.horizon

    def _fit_horizon(self, budget, since):
        """A ``--max-minutes`` run's schedule length, from ``steps_that_fit``."""
        state, config = self.state, self.config
        state.horizon = steps_that_fit(budget, state.step, state.seconds, since, config.steps, config.warmup_steps())

    def train(self, save, progress=False, callback=None):
        """Run steps until the schedule's end (or ``--max-minutes``); ``save()`` writes a checkpoint.

        Raises:
            Stopped: Ctrl-C or SIGTERM (after the step in progress, with a checkpoint saved).
            NonFiniteLossError: the loss or gradient diverged (no checkpoint written).
        """
        state, config = self.state, self.config
        budget = None if config.max_minutes is None else 60.0 * config.max_minutes
        tokens_per_step = config.batch_size * config.block * config.accumulate
        bar = _bar(progress and self.ranks.main, state, config)
        began, base = time.perf_counter(), state.seconds
        try:
            with StopSignals() as signals:
                if state.step == 0 and not state.curve["eval_step"]:
                    self.evaluate_curve()
                while state.step < state.horizon:
                    if budget is not None and state.seconds >= budget:
                        state.stopped_by = "max_minutes"
                        break
                    tick = time.perf_counter()
                    loss = self.step()
                    state.step, state.tokens = state.step + 1, state.tokens + tokens_per_step
                    state.curve["step"].append(state.step)
                    state.curve["train_loss"].append(loss)
                    state.seconds = self.ranks.slowest(base + time.perf_counter() - began)  # one clock for all
                    fitting = budget is not None and base == 0.0  # a resumed run keeps its schedule
                    if fitting and state.step == 1:
                        since = (state.step, state.seconds)
                    if fitting and state.step == 1 + _PROBE_STEPS:
                        self._fit_horizon(budget, since)
                    if self._curve_due():
                        self.evaluate_curve()
                        if fitting and state.step > 1 + _PROBE_STEPS and state.step < state.horizon:
                            state.seconds = self.ranks.slowest(base + time.perf_counter() - began)
                            self._fit_horizon(budget, since)  # refitted to the pace seen so far
                    if bar is not None:
                        _show(bar, state, loss, tokens_per_step / (time.perf_counter() - tick))
                    if state.step % config.checkpoint_every == 0 and state.step < state.horizon:
                        save()
                    if callback is not None:
                        callback(self)
                    requested = self.ranks.stop_request(signals.requested)  # a signal to any process stops all
                    if requested:
                        save()
                        raise Stopped(state.step, requested)
        finally:
            if bar is not None:
                bar.close()
        self.optimizer.zero_grad(set_to_none=True)  # the gradients are not needed past the last step
        if state.stopped_by is None:  # the schedule's end: --steps, or the steps --max-minutes fitted
            state.stopped_by = "steps" if state.horizon == config.steps else "max_minutes"
        return state


def _bar(progress, state, config):
    if not progress:
        return None
    tqdm = require("tqdm.auto", extra="bench", purpose="the progress bar").tqdm
    return tqdm(total=state.horizon, initial=state.step, desc=f"finetune {config.target}", unit="step",
                dynamic_ncols=True)


def _show(bar, state, loss, tokens_per_second):
    if bar.total != state.horizon:
        bar.total = state.horizon
    bar.set_postfix_str(f"loss={loss:.4f}, {tokens_per_second:,.0f} tok/s", refresh=False)
    bar.update(1)
