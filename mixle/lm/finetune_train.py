"""The finetune job's configuration of the one training loop (``mixle.lm.loop.Trainer``).

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

import functools

from mixle._optional import require
from mixle.lm.chunked_loss import chunked_kl_tokens, chunked_tokens
from mixle.lm.distill import distill_row_loss, distill_token_loss
from mixle.lm.finetune_data import WindowCursor
from mixle.lm.finetune_distributed import SINGLE
from mixle.lm.loop import (LoopConfig, NonFiniteLossError, Stopped, StopSignals, Trainer, TrainState,
                           return_free_memory, steps_that_fit)
from mixle.lm.training import warmup_cosine, window_density

__all__ = ["steps_that_fit", "Stopped", "StopSignals", "TrainState", "FinetuneTrainer", "NonFiniteLossError",
           "row_loss", "token_loss", "rows_of_tokens", "return_free_memory", "loop_config"]


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


def _named_trainable(model):
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def loop_config(config):
    """The ``LoopConfig`` of a ``FinetuneConfig``: the finetune job's settings of the one training loop.

    >>> from mixle.lm.finetune_config import FinetuneConfig
    >>> loop = loop_config(FinetuneConfig(model="m", out="o", steps=8))
    >>> loop.steps, loop.stop_on_signals, loop.rollback
    (8, True, False)
    """
    advice = (f", and the last checkpoint is kept as it was. Lower --lr (now {config.lr:g})"
              + (", use --dtype float32" if config.dtype == "bfloat16" else "")
              + (", set --grad-clip" if config.grad_clip is None else "") + ", or check the data")
    return LoopConfig(steps=config.steps, batch_size=config.batch_size, tokens_per_window=config.block,
                      accumulate=config.accumulate, schedule=warmup_cosine(config.warmup, floor=0.0),
                      grad_clip=config.grad_clip, check_gradient=True, curve_every=config.curve_every,
                      curve_tenths=True, eval_batch=config.batch_size, autocast=config.dtype, stop_on_signals=True,
                      max_minutes=config.max_minutes, warmup_steps=config.warmup or 0,
                      checkpoint_every=config.checkpoint_every, trim_memory=True, advice=advice,
                      label=f"finetune {config.target}")


class FinetuneTrainer(Trainer):
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
        self.student, self.teacher, self.finetune_config = student, teacher, config
        device = next(student.parameters()).device
        self.ids = data.train_ids.to(device)
        bos = getattr(data, "bos", None)  # every window starts with the BOS a tokenizer that adds one gives a text
        self.student_windows = window_density(student, self.ids, config.block, family, first=bos)
        self.teacher_windows = (None if teacher is None else
                                window_density(teacher, self.ids, config.block, family, first=bos))
        trainable = _named_trainable(student)
        optimizer = torch.optim.AdamW(self._groups(student, trainable, config), lr=config.lr,
                                      weight_decay=config.weight_decay)
        self._cursor = WindowCursor(len(self.ids), self.finetune_config.block, self.finetune_config.seed)
        super().__init__(student, trainable, optimizer, self._objective, self._next_starts, loop_config(config),
                         family=family, curve_windows=data.curve_windows, ranks=ranks)

    @staticmethod
    def _groups(student, trainable, config):
        from mixle.torch_backend.layers.learned_scale import param_groups

        params = [p for _, p in trainable]
        if not params:
            raise ValueError("the model has no trainable parameters: check --lora and the target")
        scale_lr = config.scale_lr or 10 * config.lr
        return param_groups(student, params, config.lr, scale_lr, config.weight_decay)

    def release(self):
        """Drop the optimizer's state, the scheduler and the teacher (after the last step), freeing their memory."""
        import gc

        self.optimizer.state.clear()
        self.optimizer = self.scheduler = self.teacher = self.teacher_windows = self.snapshot = None
        gc.collect()  # the scheduler's schedule refers back to the trainer: a cycle

    def _next_starts(self, state, count):
        """The next ``count`` window starts in the data order (moving the data position)."""
        starts = self._cursor.take(state, count)
        return self.ranks.share(starts).to(self.device)  # the same windows, shared among the processes

    def _objective(self, starts):
        """The step's share of the distillation loss of ``starts``, per predicted token."""
        torch, config = self.torch, self.finetune_config
        with self.autocast():
            logits, targets = self.student_windows.logits(starts)
            if self.teacher_windows is not None:
                with torch.no_grad():
                    teacher_logits = self.teacher_windows.logits(starts)[0]
            else:
                teacher_logits = logits.detach()
        temperature, weight = config.temperature, config.distill_weight()
        if weight == 1.0:  # both logits are ours alone (the student's nothing else saved): consumed in place
            tokens = chunked_kl_tokens(logits.float(), teacher_logits.float(), temperature)
        else:
            per_token = functools.partial(token_loss, temperature=temperature, weight=weight)
            tokens = chunked_tokens(per_token, logits.float(), teacher_logits.float(), targets,
                                    grad_into_teacher=self.teacher_windows is not None)
        del logits, teacher_logits  # alive only while the loss needs them (its saved tensors), not through backward
        rows = rows_of_tokens(tokens, temperature, weight)
        return rows.sum() * (1.0 / (config.batch_size * config.block * config.accumulate))
