"""The jax backend's numerics of the finetune job: the distillation loss, AdamW, the held-out loss
and the training loop's JAX trainer, data-parallel over a ``jax.sharding.Mesh``.

One step is what the torch job's is (``mixle.lm.finetune_train``): ``accumulate`` micro-batches of
``batch_size`` windows of ``block + 1`` training tokens in the same order (``window_order``), each
scored by the same loss (``token_loss``: KL at ``T`` for ``kl``, cross-entropy for ``ce``,
``(1 - w) CE + w T^2 KL`` for ``mix``), summed per row and averaged per predicted token of the
step; the gradient norm is clipped as ``torch.nn.utils.clip_grad_norm_`` clips it and AdamW steps
as ``torch.optim.AdamW`` does, at the warm-up + cosine rate of the shared schedule. The loop around
the steps (curve, checkpoints, Ctrl-C / SIGTERM, ``--max-minutes``) is ``mixle.lm.loop.Trainer``'s.

Data parallelism: the windows of a micro-batch are sharded over the mesh's ``data`` axis, every
parameter, the teacher and AdamW's moments are replicated; XLA sums the gradient over the devices.
The mesh takes the most devices of ``jax.devices()`` that divide ``batch_size``.

The student's forward: when every kernel it quantizes can be grouped
(``mixle.flax_backend.kernel_groups``: kernels of one spec, layout and input size quantized by one
call, the same values as their own calls), each step first fake-quantizes the trained kernels group
by group (``quantized_state``, the program the evaluations run), then runs the float graph's step on
those values: the straight-through estimator passes their gradient to the kernels unchanged, so the
step is the float model's and XLA compiles a few quantizer calls instead of one per kernel;
otherwise the wrapped model's own forward, which quantizes each kernel inside.

Compiled steps are reused: the jitted functions take the model's graphdef as a static argument, and
a QAT-wrapped model's graphdef never equals another's (``apply_qat`` makes its module classes per
call). A trainer given ``made`` (how its student was made from the float model) takes the graphdef
of an earlier student made the same way, with the same state shapes (``reused_graphdef``): a
second run of the same configuration in one process, or a resumed one, compiles nothing again.
"""

import collections
import functools
import math
import time
from dataclasses import asdict

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mixle.flax_backend.kernel_groups import float_graphdef, kernel_groups, quantized_state
from mixle.lm.finetune_data import WindowCursor
from mixle.lm.finetune_distributed import SINGLE
from mixle.lm.finetune_train import loop_config
from mixle.lm.loop import Trainer, TrainState

__all__ = ["data_mesh", "token_loss", "held_out_loss", "greedy_next_token", "JaxTrainer", "BETAS", "EPS",
           "reused_graphdef"]

BETAS, EPS = (0.9, 0.999), 1e-8  # torch.optim.AdamW's defaults
_AXIS = "data"
_GRAPHDEFS = collections.OrderedDict()  # (how made, structure, state shapes) -> the first such graphdef; newest last
_KEPT = 4  # the structures whose graphdefs (and so compiled steps) stay reusable
_ANSWER_BUCKET = 64  # a greedy answer's sequence is padded to a multiple of this: one compile per 64 tokens


def reused_graphdef(graphdef, state, made):
    """``graphdef``, or the graphdef of an earlier model of the same structure and ``state`` shapes made the
    same way (``made``: hashable, e.g. the float model's graphdef and the QAT arguments), so that the
    jitted functions keyed on it serve this model too. The last few are kept.

    >>> from mixle.lm.flax_causal_lm import CausalLM, CausalLMConfig
    >>> config = CausalLMConfig.from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
    ...     "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2})
    >>> first, second = (nnx.split(CausalLM(config, rngs=nnx.Rngs(i))) for i in range(2))
    >>> reused_graphdef(*first, "float") is first[0], reused_graphdef(*second, "float") is first[0]
    (True, True)
    """
    if made is None:
        return graphdef
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    shapes = tuple((jax.tree_util.keystr(path), np.shape(value), str(getattr(value, "dtype", type(value))))
                   for path, value in leaves)
    key = (made, repr(graphdef), shapes)
    kept = _GRAPHDEFS.pop(key, graphdef)
    _GRAPHDEFS[key] = kept
    while len(_GRAPHDEFS) > _KEPT:
        _GRAPHDEFS.popitem(last=False)
    return kept


def data_mesh(batch_size, devices=None):
    """A one-axis (``"data"``) mesh of the most of ``devices`` (default ``jax.devices()``) dividing ``batch_size``.

    >>> data_mesh(4, jax.devices()[:1]).shape["data"]
    1
    """
    devices = list(jax.devices() if devices is None else devices)
    count = max(d for d in range(1, len(devices) + 1) if batch_size % d == 0)
    return Mesh(np.array(devices[:count]), (_AXIS,))


def _replicated(mesh, tree):
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def _sharded(mesh, array):
    return jax.device_put(jnp.asarray(array), NamedSharding(mesh, PartitionSpec(_AXIS)))


def token_loss(logits, teacher_logits, targets, temperature, weight):
    """The torch job's loss terms per predicted token, ``(rows, tokens)`` (``finetune_train.token_loss``):
    cross-entropy for ``weight == 0``, the KL ``KL(p_T || q_T)`` (before its factor ``T^2``) for
    ``weight == 1``, else ``(1 - w) CE + w T^2 KL``.

    >>> float(token_loss(jnp.zeros((1, 1, 4)), jnp.zeros((1, 1, 4)), jnp.zeros((1, 1), jnp.int32), 1.0, 0.0)[0, 0])
    1.3862943649291992
    """
    if weight != 1.0:
        log_softmax = jax.nn.log_softmax(logits, axis=-1)
        ce = -jnp.take_along_axis(log_softmax, targets[..., None], axis=-1)[..., 0]
        if weight == 0.0:
            return ce
    log_q = jax.nn.log_softmax(logits if temperature == 1.0 else logits / temperature, axis=-1)
    log_p = jax.nn.log_softmax(teacher_logits if temperature == 1.0 else teacher_logits / temperature, axis=-1)
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    return kl if weight == 1.0 else (1.0 - weight) * ce + weight * temperature**2 * kl


@functools.partial(jax.jit, static_argnames=("graphdef", "teacher", "temperature", "weight", "scale"))
def _micro_step(params, frozen, teacher_state, windows, *, graphdef, teacher, temperature, weight, scale):
    """``(loss, gradient)`` of one micro-batch's share of the step's loss, per predicted token, for the
    forward ``graphdef`` of ``params``: the float graph of the kernels' fake-quantized values (their
    gradient is the kernels', the straight-through estimator's), or the wrapped model's, which
    quantizes inside."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    teacher_logits = None if teacher is None else jax.lax.stop_gradient(nnx.merge(teacher, teacher_state)(inputs))

    def loss(trained):
        logits = nnx.merge(graphdef, trained, frozen)(inputs)
        tokens = token_loss(logits, logits if teacher_logits is None else teacher_logits, targets, temperature, weight)
        rows = temperature**2 * tokens.sum(axis=1) if weight == 1.0 else tokens.sum(axis=1)
        return rows.sum() * scale

    return jax.value_and_grad(loss)(params)


@jax.jit
def _zeros(tree):
    return jax.tree.map(jnp.zeros_like, tree)


@jax.jit
def _finite(tree):
    return jnp.all(jnp.stack([jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(tree)]))


@jax.jit
def _add(total, grads):
    return jax.tree.map(jnp.add, total, grads)


@jax.jit
def _grad_norm(grads):
    """The gradient's norm as ``clip_grad_norm_`` takes it: the norm of the tensors' norms."""
    return jnp.linalg.norm(jnp.stack([jnp.linalg.norm(g.ravel()) for g in jax.tree.leaves(grads)]))


@jax.jit
def _adamw(params, grads, exp_avg, exp_avg_sq, norm, clip, lr, weight_decay, step_size, correction2_sqrt):
    """One step of ``torch.optim.AdamW`` (its single-tensor formula) after ``clip_grad_norm_``'s clipping."""
    coefficient = jnp.minimum(clip / (norm + 1e-6), 1.0)
    beta1, beta2 = BETAS

    leaves, treedef = jax.tree.flatten(params)
    new_params, new_m, new_v = [], [], []
    for p, g, m, v in zip(leaves, jax.tree.leaves(grads), jax.tree.leaves(exp_avg), jax.tree.leaves(exp_avg_sq)):
        g = g * coefficient
        p = p * (1 - lr * weight_decay)
        m = m + (g - m) * (1 - beta1)
        v = v * beta2 + g * g * (1 - beta2)
        new_params.append(p - step_size * (m / (jnp.sqrt(v) / correction2_sqrt + EPS)))
        new_m.append(m)
        new_v.append(v)
    return tuple(jax.tree.unflatten(treedef, t) for t in (new_params, new_m, new_v))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _row_nll(states, windows, *, graphdef):
    logits = nnx.merge(graphdef, *states)(windows[:, :-1])
    log_softmax = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(log_softmax, windows[:, 1:, None], axis=-1).sum(axis=(1, 2))


def held_out_loss(model, windows, batch, mesh=None, states=None):
    """Mean next-token cross-entropy (nats) of a Flax causal LM over ``windows`` ``(count, length)``,
    ``batch`` windows a call (the last padded; sharded over ``mesh``'s ``data`` axis), summed in
    float64 as the torch job's ``held_out_loss``.

    ``states``: ``(graphdef, *states)`` of the model already split (the trainer's), instead of ``model``.

    >>> from mixle.lm.flax_causal_lm import CausalLM, CausalLMConfig
    >>> lm = CausalLM(CausalLMConfig.from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
    ...     "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}), rngs=nnx.Rngs(0))
    >>> lm.embed_tokens.embedding[...] = jnp.zeros((10, 8))  # tied head: every logit 0
    >>> round(held_out_loss(lm, np.zeros((3, 5), np.int64), 2), 4), round(math.log(10), 4)
    (2.3026, 2.3026)
    """
    graphdef, *parts = nnx.split(model) if states is None else states
    mesh = mesh or data_mesh(batch, jax.devices()[:1])
    parts = _replicated(mesh, tuple(parts))
    windows = np.asarray(windows, np.int32)
    total = 0.0
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        padded = np.concatenate([chunk, np.repeat(chunk[-1:], batch - len(chunk), axis=0)])
        rows = np.asarray(_row_nll(parts, _sharded(mesh, padded), graphdef=graphdef), np.float64)
        total += float(rows[: len(chunk)].sum())
    return total / (windows.shape[0] * (windows.shape[1] - 1))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _logits_at(states, ids, position, *, graphdef):
    return nnx.merge(graphdef, *states)(ids)[0, position]


def greedy_next_token(model, mesh=None, states=None):
    """``next_token(ids) -> int`` of a Flax causal LM for ``finetune_chat.greedy_answers``: the argmax
    of its float32 logits after the list ``ids``.

    The sequence is right-padded to a multiple of 64 tokens (the causal mask keeps the padding out
    of the logits read), so a few compiles serve every step of every answer.

    Args:
        model: the Flax causal LM (float, fake-quantized or converted), or None with ``states``.
        mesh: the run's ``data_mesh`` (default: the first device); the model is replicated on it.
        states: ``(graphdef, *states)`` of the model already split (the trainer's).

    >>> from mixle.lm.flax_causal_lm import CausalLM, CausalLMConfig
    >>> lm = CausalLM(CausalLMConfig.from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
    ...     "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}), rngs=nnx.Rngs(0))
    >>> next_token = greedy_next_token(lm)
    >>> next_token([1, 2, 3]) == int(np.argmax(lm(jnp.asarray([[1, 2, 3]]))[0, -1]))
    True
    """
    graphdef, *parts = nnx.split(model) if states is None else states
    mesh = mesh or data_mesh(1, jax.devices()[:1])
    parts = _replicated(mesh, tuple(parts))

    def next_token(ids):
        padded = np.zeros((1, -(-len(ids) // _ANSWER_BUCKET) * _ANSWER_BUCKET), np.int32)
        padded[0, : len(ids)] = ids
        logits = _logits_at(parts, _replicated(mesh, padded), len(ids) - 1, graphdef=graphdef)
        return int(np.argmax(np.asarray(logits, np.float32)))

    return next_token


def _flat(state):
    return {".".join(str(p) for p in path): value for path, value in nnx.to_flat_state(state)}


class JaxTrainer(Trainer):
    """Trains the kernels ``trained`` of the QAT-wrapped Flax ``student`` distilled from ``teacher``.

    Args:
        student: the QAT-wrapped Flax causal LM (updated in place by ``finish``).
        teacher: the float Flax model (frozen), or None (``objective="ce"``).
        data: the run's ``FinetuneData``.
        config: the run's ``FinetuneConfig``.
        trained: dotted paths of the trained Params (``layers.0.mlp.up_proj.kernel``).
        mesh: the ``data_mesh`` the steps run on.
        made: how ``student`` was made from the float model (hashable), to reuse the compiled steps
            of an earlier trainer of a student made so (``reused_graphdef``); None: compile its own.

    >>> JaxTrainer.__name__
    'JaxTrainer'
    """

    def __init__(self, student, teacher, data, config, trained, mesh, made=None,  # noqa: D107 (the loop's fields)
                 float_model=None):
        self.model, self.finetune_config, self.mesh, self.ranks = student, config, mesh, SINGLE
        self.float_model = float_model  # for --step-timing: the float model's step, timed beside the QAT step
        self.config = loop_config(config)
        self.curve_windows, self.family = data.curve_windows, None
        self.state = TrainState(horizon=config.steps)
        wanted = set(trained)
        self._split = split = (lambda path, _: ".".join(map(str, path)) in wanted, ...)
        graphdef, params, frozen = nnx.split(student, *split)
        self.groups = kernel_groups(student)
        if self.groups is not None and {path for group in self.groups for path in group.paths} <= wanted:
            graphdef = float_graphdef(student, *split)  # the kernels' fake quantization runs before it, by group
        else:
            self.groups = None
        self.graphdef = reused_graphdef(graphdef, nnx.state(student),
                                        None if made is None else (made, tuple(sorted(wanted))))
        self.names = sorted(_flat(params))
        if not self.names:
            raise ValueError("the model has no trainable parameters: check the target")
        self.params, self.frozen = _replicated(mesh, params), _replicated(mesh, frozen)
        self.teacher, self.teacher_state = (None, None) if teacher is None else nnx.split(teacher)
        self.teacher_state = None if teacher is None else _replicated(mesh, self.teacher_state)
        self.exp_avg, self.exp_avg_sq = _zeros(self.params), _zeros(self.params)
        self.ids = np.asarray(data.train_ids.numpy() if hasattr(data.train_ids, "numpy") else data.train_ids)
        self._cursor = WindowCursor(len(self.ids), self.finetune_config.block, self.finetune_config.seed)

    # ------------------------------------------------------------------ state through a checkpoint

    def state_dict(self):
        """The trained tensors, AdamW's moments and the loop's counters (torch tensors of numpy's bytes)."""
        import torch

        def tensors(tree):
            return {name: torch.from_numpy(np.array(value)) for name, value in _flat(tree).items()}

        return {"state": asdict(self.state), "trainable": tensors(self.params),
                "optimizer": {"exp_avg": tensors(self.exp_avg), "exp_avg_sq": tensors(self.exp_avg_sq)}}

    def load_state_dict(self, payload, source):
        """Continue from ``state_dict()``'s ``payload``; ValueError naming ``source`` if it does not fit."""
        saved, mine = payload["trainable"], _flat(self.params)
        if set(saved) != set(mine) or any(tuple(saved[k].shape) != tuple(mine[k].shape) for k in mine):
            raise ValueError(f"resume: {str(source)!r} holds other trained tensors than this run trains "
                             f"(e.g. {sorted(set(saved) ^ set(mine))[:3]}): it belongs to another model or target")

        def tree(tensors):  # the structure of self.params (its Param nodes too): the compiled steps still fit
            state = nnx.from_flat_state([(path, variable.replace(jnp.asarray(tensors[".".join(map(str, path))].numpy())))
                                         for path, variable in nnx.to_flat_state(self.params)])
            return _replicated(self.mesh, state)

        self.params = tree(saved)
        self.exp_avg, self.exp_avg_sq = tree(payload["optimizer"]["exp_avg"]), tree(payload["optimizer"]["exp_avg_sq"])
        self.state = TrainState(**payload["state"])

    def weights_finite(self):
        """Whether every trained tensor is finite."""
        return bool(_finite(self.params))

    # ------------------------------------------------------------------ one step

    def _next_starts(self, count):
        """The next ``count`` window starts of the torch job's order (moving the data position)."""
        return self._cursor.take(self.state, count).numpy()

    def micro_step(self, starts, trained=None):
        """``(loss, gradient)`` of the micro-batch of windows at ``starts``: its share of a step's loss.

        ``trained``: the step's ``eval_states()[1]`` (computed if not given). With kernel groups, the
        kernels are fake-quantized by the program the evaluations run, and the step is the float
        graph's on those values, whose gradient the straight-through estimator passes to the kernels
        unchanged: the step compiles what the float model's step compiles, the quantizer apart.

        >>> JaxTrainer.micro_step  # doctest: +ELLIPSIS
        <function JaxTrainer.micro_step at ...>
        """
        windows = self.ids[np.asarray(starts)[:, None] + np.arange(self.finetune_config.block + 1)].astype(np.int32)
        args, static = self._micro_step_arguments(windows, trained)
        return _micro_step(*args, **static)

    def _micro_step_arguments(self, windows, trained, float_forward=None):
        """``_micro_step``'s arguments: the student's forward, or ``float_forward`` (graphdef, params, frozen)."""
        config = self.finetune_config
        graphdef, trained, frozen = float_forward or (
            self.graphdef, self.eval_states()[1] if trained is None else trained, self.frozen)
        return ((trained, frozen, self.teacher_state, _sharded(self.mesh, windows)),
                dict(graphdef=graphdef, teacher=self.teacher, temperature=config.temperature,
                     weight=config.distill_weight(), scale=1.0 / (config.batch_size * config.block * config.accumulate)))

    def prepare(self):
        """Compile the kernels' fake quantization, the micro-step and AdamW before the budget's clock starts:
        on a TPU they take a minute or two, as long as a few hundred steps of a small model. jit's own cache
        keeps what ``lower(...).compile()`` compiled for the first step's call with the same arguments."""
        config = self.finetune_config
        args, static = self._micro_step_arguments(np.zeros((config.batch_size, config.block + 1), np.int32), None)
        _micro_step.lower(*args, **static).compile()
        grads = self.params  # a gradient has the trained tensors' shapes and sharding
        _adamw.lower(self.params, grads, self.exp_avg, self.exp_avg_sq, _grad_norm(grads), 1.0, 1.0, 0.0, 1.0,
                     1.0).compile()
        if config.step_timing and self.state.step_timing is None and self.float_model is not None:
            self.state.step_timing = self._timed_steps(config.step_timing)
        self.float_model = None

    def _timed_steps(self, count):
        """``--step-timing``: median milliseconds of ``count`` QAT steps and of ``count`` steps of the float
        model training the same tensors, interleaved on one batch of the training windows (each kind's
        first call apart: it compiles); nothing they compute is kept."""
        config = self.finetune_config
        graphdef, params, frozen = nnx.split(self.float_model, *self._split)
        params, frozen = _replicated(self.mesh, params), _replicated(self.mesh, frozen)
        moments = _zeros(params), _zeros(params)
        span = config.block + 1
        starts = (np.arange(config.batch_size) * span) % max(1, len(self.ids) - span)
        windows = self.ids[starts[:, None] + np.arange(span)].astype(np.int32)

        def one_step(float_forward, trained, exp_avg, exp_avg_sq):
            args, static = self._micro_step_arguments(windows, None, float_forward)
            total = None
            for _ in range(config.accumulate):
                _, grads = _micro_step(*args, **static)
                total = grads if total is None else _add(total, grads)
            return _adamw(trained, total, exp_avg, exp_avg_sq, _grad_norm(total), math.inf, config.lr,
                          config.weight_decay, config.lr, 1.0)

        steps = {"qat": lambda: one_step(None, self.params, self.exp_avg, self.exp_avg_sq),
                 "float": lambda: one_step((graphdef, params, frozen), params, *moments)}
        times = {name: [] for name in steps}
        for attempt in range(count + 1):
            for name, step in steps.items():
                tick = time.perf_counter()
                jax.block_until_ready(step())
                if attempt:
                    times[name].append(1e3 * (time.perf_counter() - tick))
        qat, plain = (float(np.median(times[name])) for name in ("qat", "float"))
        device = jax.devices()[0]
        return {"steps": count, "qat_ms": qat, "float_ms": plain, "ratio": qat / plain,
                "tokens": config.batch_size * config.block * config.accumulate,
                "devices": f"{self.mesh.size} x {device.device_kind}"}

    def step(self):
        """One optimizer step; returns its loss (the micro-batches' values summed)."""
        config = self.finetune_config
        value, total = 0.0, None
        trained = self.eval_states()[1]  # the kernels do not move within a step
        for _ in range(config.accumulate):
            loss, grads = self.micro_step(self._next_starts(config.batch_size), trained)
            loss = float(loss)
            if not math.isfinite(loss):
                raise self.diverged(f"the training loss became {loss}")
            value += loss
            total = grads if total is None else _add(total, grads)
        norm = _grad_norm(total)
        if not bool(jnp.isfinite(norm)):
            raise self.diverged(f"the gradient norm became {float(norm)}")
        step = self.state.step + 1  # AdamW's step count: the steps done, this one included
        lr = config.lr * self.config.schedule(self.state.step, self.state.horizon)  # LambdaLR's rate of this step
        correction1, correction2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
        self.params, self.exp_avg, self.exp_avg_sq = _adamw(
            self.params, total, self.exp_avg, self.exp_avg_sq, norm, math.inf if config.grad_clip is None else
            config.grad_clip, lr, config.weight_decay, lr / correction1, math.sqrt(correction2))
        return value

    def drop_gradients(self):
        """Nothing to drop: a step's gradient lives only within it."""

    def eval_states(self):
        """``(graphdef, params, frozen)`` of the student's forward as ``held_out_loss`` takes them: with
        kernel groups, the float graph and the kernels' fake-quantized values (computed once)."""
        params = self.params if self.groups is None else quantized_state(self.groups, self.params)
        return self.graphdef, params, self.frozen

    def evaluate_curve(self):
        """Held-out loss of the student on the curve windows, recorded at the current step."""
        loss = held_out_loss(None, self.curve_windows, self.config.eval_batch, self.mesh, states=self.eval_states())
        self.state.curve["eval_step"].append(self.config.start + self.state.step)
        self.state.curve["held_out_loss"].append(loss)

    def finish(self):
        """Put the trained tensors into the student (in place), drop AdamW's state and the teacher; returns it."""
        nnx.update(self.model, jax.device_get(self.params))
        self.exp_avg = self.exp_avg_sq = self.teacher = self.teacher_state = None
        return self.model
