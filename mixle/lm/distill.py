"""Self-distillation for a fine-tune: the student learns the tokens and its own starting model's probabilities.

Per row (a window of tokens) the objective is

    loss = sum over predicted tokens of (1 - w) * CE(student, token) + w * T^2 * KL(p_T || q_T)

with ``p_T = softmax(teacher_logits / T)``, ``q_T = softmax(student_logits / T)`` (Hinton et al.
2015; the ``T^2`` keeps the soft term's gradient size independent of ``T``). ``GradLeaf(...,
distill=SelfDistillation(...))`` maximises ``-loss`` instead of ``module.log_density``.

The teacher is a *frozen snapshot* of the model at the start of the fine-tune, not the live
weights with fake-quant switched off: mixle's exact fp32 toggle would make the latter free in
memory, but those latent weights drift with every step, so the target would move with the
student and stop anchoring it to the checkpoint it started from. Cost of the snapshot: one
extra copy of the model's parameters and buffers (its fp32 bytes; no gradients, no optimizer
state), plus one no-grad forward per step (about a third of a training step's compute) whose
only kept activation is the teacher's logits, ``batch * tokens * vocab`` floats. When the
caller already holds the starting model (``mixle compare`` does), passing it as the teacher
costs no copy at all.

The module trained (and the teacher) must offer ``logits(*fields) -> (logits, targets)``:
float logits of shape ``(rows, tokens, vocab)`` and the int targets ``(rows, tokens)`` they
predict.
"""

import copy
import math
import numbers

import torch
import torch.nn.functional as F

__all__ = ["SelfDistillation", "distill_row_loss", "distill_token_loss", "DEFAULT_TEMPERATURE", "DEFAULT_WEIGHT"]

# Chosen on a validation split carved from the training text (benchmarks/tune_recovery.py, default
# model, 400 + 100 steps, seed 0), never on the held-out text: of T in {1, 2} x w in {0.1, 0.25,
# 0.5, 0.9}, w = 0.1 was best (w >= 0.5 pulls the student back toward a teacher the fine-tune
# itself improves on); T made little difference.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_WEIGHT = 0.1


def _check(name, value, low, high, low_open):
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if (value <= low if low_open else value < low) or value > high:
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ValueError(f"{name}={value!r} is out of range: use a value in {bound}")
    return float(value)


def distill_row_loss(student_logits, teacher_logits, targets, temperature=DEFAULT_TEMPERATURE,
                     weight=DEFAULT_WEIGHT):
    """Per-row distillation loss: ``sum_t (1-w) CE + w T^2 KL(teacher_T || student_T)``.

    Args:
        student_logits: float ``(rows, tokens, vocab)``, with gradient.
        teacher_logits: float ``(rows, tokens, vocab)`` (no gradient flows into it).
        targets: int64 ``(rows, tokens)``.
        temperature: T > 0 softening both distributions in the KL term.
        weight: w in [0, 1]; 0 is plain cross-entropy, 1 is pure distillation.

    Returns:
        float tensor ``(rows,)``: ``distill_token_loss(...).sum(dim=1)``.

    >>> s = torch.zeros(1, 2, 3); t = torch.zeros(1, 2, 3); y = torch.tensor([[0, 1]])
    >>> round(distill_row_loss(s, t, y, 2.0, 0.5).item(), 4)  # KL is 0; CE is 2 * log 3 * 0.5
    1.0986
    """
    return distill_token_loss(student_logits, teacher_logits, targets, temperature, weight).sum(dim=1)


def distill_token_loss(student_logits, teacher_logits, targets, temperature=DEFAULT_TEMPERATURE,
                       weight=DEFAULT_WEIGHT):
    """``distill_row_loss``'s terms per predicted token, ``(rows, tokens)``: ``(1-w) CE + w T^2 KL``.

    Each token's value depends only on its own logits and target.

    >>> s = torch.zeros(1, 2, 3); t = torch.zeros(1, 2, 3); y = torch.tensor([[0, 1]])
    >>> distill_token_loss(s, t, y, 1.0, 0.0).shape
    torch.Size([1, 2])
    """
    temperature = _check("temperature", temperature, 0.0, math.inf, True)
    weight = _check("weight", weight, 0.0, 1.0, False)
    rows, tokens, vocab = student_logits.shape
    if teacher_logits.shape != student_logits.shape or targets.shape != (rows, tokens):
        raise ValueError(f"shapes disagree: student {tuple(student_logits.shape)}, teacher "
                         f"{tuple(teacher_logits.shape)}, targets {tuple(targets.shape)}")
    ce = F.cross_entropy(student_logits.flatten(0, 1), targets.flatten(), reduction="none").view(rows, tokens)
    if weight == 0.0:
        return ce
    log_q = F.log_softmax(student_logits / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits.detach().to(student_logits.dtype) / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    return (1.0 - weight) * ce + weight * temperature**2 * kl


class SelfDistillation:
    """The teacher and the mixing of a distilled fine-tune (pass it as ``GradLeaf(distill=...)``).

    Args:
        teacher: a module with ``logits(*fields) -> (logits, targets)``: the model at the start
            of the fine-tune. It is used as given (never copied) and frozen: its parameters get
            ``requires_grad=False`` and it runs in eval mode without gradients. Use
            ``SelfDistillation.snapshot(module)`` to copy the module about to be trained.
        temperature: T of the soft term (default ``DEFAULT_TEMPERATURE``).
        weight: w of the soft term, in [0, 1] (default ``DEFAULT_WEIGHT``).

    >>> class Bigram(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.table = torch.nn.Parameter(torch.zeros(4, 4))
    ...     def logits(self, x):
    ...         return self.table[x[:, :-1]], x[:, 1:]
    >>> d = SelfDistillation.snapshot(Bigram(), temperature=2.0, weight=0.5)
    >>> d.row_log_density(Bigram(), torch.tensor([[0, 1, 2]])).shape
    torch.Size([1])
    """

    def __init__(self, teacher, temperature=DEFAULT_TEMPERATURE, weight=DEFAULT_WEIGHT):
        if not isinstance(teacher, torch.nn.Module) or not callable(getattr(teacher, "logits", None)):
            raise TypeError(f"teacher must be a torch.nn.Module with logits(*fields) -> (logits, targets), "
                            f"got {type(teacher).__name__}")
        self.temperature = _check("temperature", temperature, 0.0, math.inf, True)
        self.weight = _check("weight", weight, 0.0, 1.0, False)
        for param in teacher.parameters():
            param.requires_grad_(False)
        self.teacher = teacher.eval()

    @classmethod
    def snapshot(cls, module, temperature=DEFAULT_TEMPERATURE, weight=DEFAULT_WEIGHT):
        """A SelfDistillation whose teacher is a frozen copy of ``module`` as it is now.

        A QAT-wrapped module's copy has fake-quant switched off (mixle's toggle is exact), so the
        teacher is the float model. Memory: one copy of the module's parameters and buffers.
        """
        teacher = copy.deepcopy(module)
        from mixle.torch_backend.transforms import apply as qat

        if qat.qat_layers(teacher):
            from mixle.api import set_fake_quant_enabled

            set_fake_quant_enabled(teacher, False)
        return cls(teacher, temperature, weight)

    def teacher_logits(self, *fields):
        """The teacher's logits on ``fields`` (no gradient)."""
        with torch.no_grad():
            return self.teacher.logits(*fields)[0]

    def row_log_density(self, student, *fields):
        """``-distill_row_loss`` of ``student`` on ``fields``: what GradLeaf maximises, shape ``(rows,)``."""
        logits, targets = student.logits(*fields)
        return -distill_row_loss(logits, self.teacher_logits(*fields), targets, self.temperature, self.weight)
