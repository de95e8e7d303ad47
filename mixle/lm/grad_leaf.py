"""GradLeaf: a leaf distribution whose M-step is gradient descent on a torch module's log density.

The contract with the module is one method: ``module.log_density(*fields)`` returns a float
tensor with one log density per row of the fields (rows along axis 0), differentiable with
respect to the module's parameters. The leaf never looks inside the module, so a model wrapped
by ``apply_qat`` (or by anything else that keeps ``log_density``) trains through it unchanged.

Data are a tuple of *fields*: numpy arrays or tensors with the same number of rows (a single
array is one field). The sufficient statistic of the estimator is ``(fields, weights)``: the data
fields plus one non-negative weight per row (e.g. a mixture component's responsibilities).
"""

import math
import numbers

import numpy as np
import torch

from mixle.lm.loop import NonFiniteLossError, Snapshot

__all__ = ["GradLeaf", "GradEstimator", "NonFiniteLossError"]


def _as_fields(data):
    fields = data if isinstance(data, tuple) else (data,)
    if not fields:
        raise ValueError("data has no fields: pass an array, or a tuple of arrays with one row per observation")
    tensors = []
    for i, field in enumerate(fields):
        if not isinstance(field, torch.Tensor):
            try:
                field = torch.as_tensor(np.asarray(field))
            except (TypeError, ValueError) as err:
                raise TypeError(f"data field {i} of type {type(field).__name__} is not an array: {err}") from None
        if field.dim() == 0:
            raise ValueError(f"data field {i} is a scalar: each field needs one row per observation on axis 0")
        tensors.append(field)
    rows = {len(t) for t in tensors}
    if len(rows) != 1:
        raise ValueError(f"data fields have different numbers of rows {[len(t) for t in tensors]}: they must match")
    if 0 in rows:
        raise ValueError("data has no rows: the M-step needs at least one observation")
    return tuple(tensors)


def _as_weights(weights, rows):
    if weights is None:
        return torch.ones(rows, dtype=torch.float64)
    w = torch.as_tensor(np.asarray(weights.detach().cpu() if isinstance(weights, torch.Tensor) else weights),
                        dtype=torch.float64)
    if w.shape != (rows,):
        raise ValueError(f"weights must have shape ({rows},), one per row, got {tuple(w.shape)}")
    if not torch.isfinite(w).all() or (w < 0).any():
        raise ValueError("weights must be finite and non-negative")
    if w.sum() <= 0:
        raise ValueError("weights sum to zero: at least one row needs a positive weight")
    return w


def _positive_int(name, value, allow_none=False):
    if allow_none and value is None:
        return None
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")
    return int(value)


def _all_finite(module):
    return all(bool(torch.isfinite(t).all()) for t in list(module.parameters()) + list(module.buffers())
               if t.is_floating_point())


class GradLeaf:
    """A leaf whose M-step runs ``m_steps`` of gradient descent on the weighted log density.

    Each step samples ``batch_size`` rows uniformly without replacement (all rows when None) and
    minimises ``-(w * module.log_density(*x)).sum()`` with weights normalised to sum to one over
    all rows (rescaled by rows / batch_size, so every minibatch is an unbiased estimate of the
    full objective). The optimizer and its state persist across M-steps.

    Args:
        module: a ``torch.nn.Module`` with ``log_density(*fields) -> tensor of shape (rows,)``.
        m_steps: gradient steps per M-step (``estimate`` call).
        lr: learning rate. Required unless ``optimizer`` is an optimizer you built (which then
            keeps its own learning rates and must be given without ``lr``).
        batch_size: rows per step; None uses every row.
        optimizer: None (``torch.optim.Adam``), an optimizer class or factory called as
            ``optimizer(params, lr=lr)``, or a ``torch.optim.Optimizer`` over the module's params.
        lr_schedule: ``f(step, m_steps) -> factor`` multiplying each group's learning rate at
            every step of an M-step (restored afterwards); None keeps it constant.
        grad_clip: clip the global gradient norm to this value; None does not clip.
        seed: seed of the minibatch sampler.
        progress: a label to show a tqdm bar for each M-step; None shows none.
        progress_scale: factor applied to the loss shown on the bar (e.g. ``1 / tokens per row``
            to show a per-token loss); the history keeps the objective itself.
        callback: ``f(step, loss)`` called after every step (e.g. to record held-out curves).
        eval_batch_size: rows per forward pass in ``seq_log_density``.
        distill: a ``mixle.lm.distill.SelfDistillation``: train on its distillation objective
            (``distill.row_log_density(module, *x)``, which needs ``module.logits``) instead of
            ``module.log_density``; None trains on the log density. Evaluation is unchanged.

    Attributes:
        history: the training objective (a float) of every step taken so far.

    >>> class Gauss(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.mu = torch.nn.Parameter(torch.zeros(()))
    ...     def log_density(self, x):
    ...         return -0.5 * (x - self.mu) ** 2 - 0.5 * math.log(2 * math.pi)
    >>> leaf = GradLeaf(Gauss(), m_steps=200, lr=0.1).fit(torch.tensor([1.0, 2.0, 3.0]))
    >>> round(leaf.module.mu.item(), 3)
    2.0
    """

    def __init__(self, module, *, m_steps, lr=None, batch_size=None, optimizer=None, lr_schedule=None,
                 grad_clip=None, seed=0, progress=None, progress_scale=1.0, callback=None, eval_batch_size=1024, distill=None):
        if not isinstance(module, torch.nn.Module) or not callable(getattr(module, "log_density", None)):
            raise TypeError(
                f"GradLeaf needs a torch.nn.Module with a log_density(*fields) method returning one "
                f"log density per row, got {type(module).__name__}"
            )
        self.module = module
        self.m_steps = _positive_int("m_steps", m_steps)
        self.batch_size = _positive_int("batch_size", batch_size, allow_none=True)
        self.eval_batch_size = _positive_int("eval_batch_size", eval_batch_size)
        if isinstance(optimizer, torch.optim.Optimizer):
            if lr is not None:
                raise ValueError(
                    "optimizer is an optimizer instance with its own learning rates, so lr must be None: "
                    "set lr when you build the optimizer, or pass optimizer as a class/factory"
                )
            own = {id(p) for p in module.parameters()}
            if not any(id(p) in own for g in optimizer.param_groups for p in g["params"]):
                raise ValueError("optimizer does not train any parameter of module: build it from module.parameters()")
        else:
            if not isinstance(lr, numbers.Real) or isinstance(lr, bool) or not (math.isfinite(lr) and lr > 0):
                raise ValueError(f"lr must be a positive finite number, got {lr!r}")
            if optimizer is not None and not callable(optimizer):
                raise TypeError(f"optimizer must be None, a torch optimizer, or a factory/class, got {optimizer!r}")
        if lr_schedule is not None and not callable(lr_schedule):
            raise TypeError(f"lr_schedule must be a callable f(step, m_steps) -> factor, got {lr_schedule!r}")
        if grad_clip is not None and not (isinstance(grad_clip, numbers.Real) and grad_clip > 0):
            raise ValueError(f"grad_clip must be a positive number or None, got {grad_clip!r}")
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be a callable f(step, loss), got {callback!r}")
        if distill is not None and not callable(getattr(distill, "row_log_density", None)):
            raise TypeError(f"distill must be a mixle.lm.distill.SelfDistillation or None, got {distill!r}")
        if distill is not None and not callable(getattr(module, "logits", None)):
            raise TypeError(f"distill needs module.logits(*fields) -> (logits, targets); "
                            f"{type(module).__name__} has none")
        self.distill = distill
        self.lr = lr
        self._optimizer_arg = optimizer
        self._optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        if not isinstance(progress_scale, numbers.Real) or isinstance(progress_scale, bool):
            raise TypeError(f"progress_scale must be a number, got {progress_scale!r}")
        self.lr_schedule, self.grad_clip, self.progress, self.callback = lr_schedule, grad_clip, progress, callback
        self.progress_scale = float(progress_scale)
        self.generator = torch.Generator().manual_seed(seed)
        self.history = []

    @property
    def optimizer(self):
        """The optimizer (built on first use from the module's trainable parameters)."""
        if self._optimizer is None:
            params = [p for p in self.module.parameters() if p.requires_grad]
            if not params:
                raise ValueError("module has no trainable parameters (requires_grad=True) for the M-step")
            factory = self._optimizer_arg or torch.optim.Adam
            self._optimizer = factory(params, lr=self.lr)
        return self._optimizer

    def _device(self):
        for tensor in self.module.parameters():
            return tensor.device
        return torch.device("cpu")

    def log_density(self, *fields):
        """``module.log_density`` on the given fields (in the module's current mode, with grad)."""
        device = self._device()
        return self.module.log_density(*(f.to(device) for f in _as_fields(fields)))

    def seq_log_density(self, data):
        """Log density of every row, as a float64 numpy array, in eval mode and without gradients.

        The module's train/eval mode is restored afterwards.
        """
        fields = _as_fields(data)
        rows, device = len(fields[0]), self._device()
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                parts = [self.module.log_density(*(f[i : i + self.eval_batch_size].to(device) for f in fields))
                         for i in range(0, rows, self.eval_batch_size)]
        finally:
            self.module.train(was_training)
        return torch.cat([p.reshape(-1) for p in parts]).double().cpu().numpy()

    def estimator(self):
        """The estimator whose ``estimate(nobs, (fields, weights))`` runs this leaf's M-step."""
        return GradEstimator(self)

    def fit(self, data, weights=None):
        """Run one M-step on ``data`` (fields, optional per-row weights); returns the leaf.

        >>> class Const(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.b = torch.nn.Parameter(torch.zeros(()))
        ...     def log_density(self, x):
        ...         return self.b * x - torch.log(1 + torch.exp(self.b))  # Bernoulli, logit b
        >>> leaf = GradLeaf(Const(), m_steps=300, lr=0.1).fit(torch.tensor([1.0, 1.0, 1.0, 0.0]))
        >>> round(torch.sigmoid(leaf.module.b).item(), 2)
        0.75
        """
        fields = _as_fields(data)
        return self.estimator().estimate(None, (fields, weights))

    def _diverged(self, what, step, base_lrs):
        return (f"{what} at step {step + 1} of {self.m_steps}: stopped, and the module's weights and optimizer "
                f"state were restored to the last step with a finite loss. Lower lr (now {base_lrs}), set "
                f"grad_clip, or check the data for NaN/inf")

    def _progress_bar(self):
        """A tqdm bar over the M-step's steps when ``progress`` is set, else None."""
        if not self.progress:
            return None
        from mixle._optional import require

        return require("tqdm.auto", extra="bench", purpose="progress bars").tqdm(
            total=self.m_steps, desc=str(self.progress), leave=False)

    def _row_log_density(self, x, batch, step, snapshot, base_lrs):
        """The objective's per-row log density of minibatch ``x`` (one value per row, checked)."""
        try:
            log_density = (self.module.log_density(*x) if self.distill is None
                           else self.distill.row_log_density(self.module, *x))
        except Exception as error:
            # A step left a weight non-finite and the forward refused it (e.g. a QAT
            # quantizer's ValueError) before the loss could show NaN: the same divergence.
            if step and not _all_finite(self.module):
                snapshot.restore()
                raise NonFiniteLossError(self._diverged(f"the module's weights became non-finite and "
                                                        f"its forward failed ({error})", step, base_lrs)) from error
            raise
        if log_density.shape != (batch,):
            raise ValueError(
                f"module.log_density returned shape {tuple(log_density.shape)} for {batch} rows: "
                f"it must return one log density per row, shape ({batch},)"
            )
        return log_density

    def _descend(self, loss, optimizer):
        """One optimizer step on ``loss`` (gradient norm clipped to ``grad_clip`` when set)."""
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(
                [p for g in optimizer.param_groups for p in g["params"]], self.grad_clip)
        optimizer.step()

    def _after_step(self, step, value, bar):
        self.history.append(value)
        if self.callback is not None:
            self.callback(step, value)
        if bar is not None:
            bar.update(1)
            if step % 10 == 0 or step == self.m_steps - 1:
                bar.set_postfix(loss=f"{value * self.progress_scale:.4g}", refresh=False)

    def _m_step(self, fields, weights):
        rows = len(fields[0])
        norm = weights / weights.sum()
        batch = rows if self.batch_size is None else min(self.batch_size, rows)
        device, optimizer = self._device(), self.optimizer
        base_lrs = [g["lr"] for g in optimizer.param_groups]
        snapshot = Snapshot(self.module, optimizer)
        was_training = self.module.training
        bar = self._progress_bar()
        self.module.train()
        try:
            for step in range(self.m_steps):
                if self.lr_schedule is not None:
                    factor = float(self.lr_schedule(step, self.m_steps))
                    for group, base in zip(optimizer.param_groups, base_lrs):
                        group["lr"] = base * factor
                idx = None if batch == rows else torch.randperm(rows, generator=self.generator)[:batch]
                x = tuple((f if idx is None else f[idx]).to(device) for f in fields)
                w = (norm if idx is None else norm[idx]).to(device) * (rows / batch)
                log_density = self._row_log_density(x, batch, step, snapshot, base_lrs)
                loss = -(w.to(log_density.dtype) * log_density).sum()
                value = loss.item()
                if not math.isfinite(value):
                    snapshot.restore()
                    raise NonFiniteLossError(self._diverged(f"the M-step loss became {value}", step, base_lrs))
                if step:
                    snapshot.take()
                self._descend(loss, optimizer)
                self._after_step(step, value, bar)
        finally:
            for group, base in zip(optimizer.param_groups, base_lrs):
                group["lr"] = base
            self.module.train(was_training)
            if bar is not None:
                bar.close()
        return self


class GradEstimator:
    """Runs a GradLeaf's M-step: ``estimate(nobs, (fields, weights))`` trains and returns the leaf.

    ``nobs`` follows the estimator protocol: None, or the number of rows (checked).
    """

    def __init__(self, leaf):
        self.leaf = leaf

    def estimate(self, nobs, suff_stat):
        """Train the leaf's module on ``suff_stat = (fields, weights)``; returns the leaf.

        Args:
            nobs: None or the number of rows in the fields.
            suff_stat: ``(fields, weights)``: a tuple of arrays (or one array) with one row per
                observation, and per-row non-negative weights (None means all ones).

        Raises:
            ValueError: malformed fields or weights, or ``nobs`` not matching the rows.
            NonFiniteLossError: the loss became NaN/inf (the last good weights are restored).
        """
        if not isinstance(suff_stat, tuple | list) or len(suff_stat) != 2:
            raise ValueError("suff_stat must be a pair (fields, weights): the data fields and one weight per row")
        fields = _as_fields(suff_stat[0])
        weights = _as_weights(suff_stat[1], len(fields[0]))
        if nobs is not None and nobs != len(fields[0]):
            raise ValueError(f"nobs={nobs!r} does not match the {len(fields[0])} rows of the data")
        return self.leaf._m_step(fields, weights)
