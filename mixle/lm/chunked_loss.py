"""A per-token loss over language-model logits, computed a few tokens at a time.

Distilling a 49k-vocabulary model on 4 x 128 tokens, every tensor of the logits' shape is
``512 * 49152`` floats, about 100 MB in float32; computed whole, the KL's log-softmaxes, their
exponential, difference and product, and in backward their gradients, are several such
tensors alive at once (about four beyond the two logits at the training step's peak).
``chunked_tokens`` instead runs the loss on the tokens of one chunk at a time (``chunk_elements``
logits: 21 tokens of a 49k vocabulary), without gradient in forward and again with gradient in
backward, chunk by chunk, writing each chunk's gradient where the caller allows: into the
teacher logits' memory (then used up), else into one new tensor. Besides the two logits only
one chunk's temporaries are alive.

Exactness: each token's value of the trainer's ``token_loss`` (and of
``mixle.lm.distill.distill_token_loss``) comes from ops that act on that token's logits alone
(softmaxes and sums over its vocabulary, elementwise products), so a token's loss and its
gradient come out bit for bit as from all the tokens at once; the sums over tokens run after,
on the whole ``(rows, tokens)`` result (``tests/test_finetune.py`` compares both, and a run's
trained weights). The price is the loss's forward run twice (its log-softmaxes and
exponentials; no matmul).

``chunked_kl_tokens``, the distillation KL alone (the default objective), does not pay that price:
its forward leaves each token's student log-probabilities in the student logits' memory and the
teacher's probabilities in the teacher's, and its backward runs on them the ops autograd runs
for ``kl_div(log_softmax(s / T), log_p, log_target=True)``, in the same order, so the gradient
is still autograd's bit for bit. On Gemma 3's 262,144-word vocabulary that loss was a third of a
bfloat16 training step on 2 CPU cores.
"""

import torch

__all__ = ["CHUNK_ELEMENTS", "chunked_tokens", "chunked_kl_tokens", "tokens_per_chunk", "chunk_bounds"]

CHUNK_ELEMENTS = 1 << 20  # logits per chunk: 4 MiB of float32


def tokens_per_chunk(vocab, chunk_elements=None):
    """How many tokens' logits over ``vocab`` one chunk holds (at least two).

    >>> tokens_per_chunk(49152), tokens_per_chunk(300, 1000)
    (21, 3)
    """
    return max(2, (CHUNK_ELEMENTS if chunk_elements is None else chunk_elements) // max(1, vocab))


def chunk_bounds(count, step):
    """``[(start, stop)]`` of ``count`` tokens in chunks of ``step``; never a chunk of one token beside others.

    A sum over a vocabulary is bit for bit the same whichever tokens it is computed with, but
    for a single token torch splits that sum among the threads (a different order), so the last
    token never stands alone: it joins the chunk before.

    >>> chunk_bounds(7, 3), chunk_bounds(6, 3), chunk_bounds(1, 3)
    ([(0, 3), (3, 7)], [(0, 3), (3, 6)], [(0, 1)])
    """
    starts = list(range(0, count, step))
    if len(starts) > 1 and count - starts[-1] == 1:
        starts.pop()
    return list(zip(starts, starts[1:] + [count]))


class _ChunkedTokens(torch.autograd.Function):
    """``loss`` on ``(1, tokens, vocab)`` chunks of the flattened logits, recomputed per chunk in backward."""

    @staticmethod
    def forward(ctx, logits, teacher, targets, loss, step, grad_into_teacher):
        ctx.loss, ctx.step, ctx.grad_into_teacher = loss, step, grad_into_teacher
        ctx.save_for_backward(logits, teacher, targets)
        return torch.cat([loss(logits[:, a:b], teacher[:, a:b], targets[:, a:b]).flatten()
                          for a, b in chunk_bounds(logits.shape[1], step)]).view(1, -1)

    @staticmethod
    def backward(ctx, grad):
        logits, teacher, targets = ctx.saved_tensors
        loss, step = ctx.loss, ctx.step
        out = teacher if ctx.grad_into_teacher else torch.empty_like(logits)
        for a, b in chunk_bounds(logits.shape[1], step):
            with torch.enable_grad():
                piece = logits[:, a:b].detach().requires_grad_(True)
                values = loss(piece, teacher[:, a:b], targets[:, a:b])
                (piece_grad,) = torch.autograd.grad(values, piece, grad[:, a:b])
            out[:, a:b].copy_(piece_grad)  # these teacher tokens were read just above, and are never read again
            del piece, values, piece_grad
        return out, None, None, None, None, None


def chunked_tokens(loss, logits, teacher_logits, targets, *, grad_into_teacher=False, chunk_elements=None):
    """``loss(logits, teacher_logits, targets)``, a ``(rows, tokens)`` tensor, ``tokens_per_chunk`` tokens at a time.

    Args:
        loss: ``f(logits, teacher_logits, targets) -> (rows, tokens)`` in which each token's value
            depends only on the same token of its inputs; it must leave its inputs unchanged.
        logits: float ``(rows, tokens, vocab)``, the student's (the gradient flows into them).
        teacher_logits: float, the same shape; no gradient flows into them.
        targets: int64 ``(rows, tokens)``.
        grad_into_teacher: the teacher logits are the caller's alone: backward writes the
            gradient into their memory (their values are then gone) instead of a new tensor.
        chunk_elements: logits per chunk (whole tokens, at least two: see ``chunk_bounds``); default
            ``CHUNK_ELEMENTS``.

    Returns:
        float tensor ``(rows, tokens)``, bit for bit ``loss(logits, teacher_logits, targets)``,
        with the same gradient.

    >>> import torch.nn.functional as F
    >>> def kl(s, t, y):
    ...     return F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), reduction="none", log_target=True).sum(-1)
    >>> s, t, y = torch.randn(3, 2, 5, requires_grad=True), torch.randn(3, 2, 5), torch.zeros(3, 2, dtype=torch.long)
    >>> bool(torch.equal(chunked_tokens(kl, s, t, y, chunk_elements=10), kl(s, t, y)))
    True
    """
    if logits.shape != teacher_logits.shape or logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"logits {tuple(logits.shape)}, teacher_logits {tuple(teacher_logits.shape)} and targets "
                         f"{tuple(targets.shape)} must be (rows, tokens, vocab), the same, and (rows, tokens)")
    rows, tokens, vocab = logits.shape
    flat = (logits.reshape(1, rows * tokens, vocab), teacher_logits.detach().reshape(1, rows * tokens, vocab),
            targets.reshape(1, rows * tokens))
    step = tokens_per_chunk(vocab, chunk_elements)
    return _ChunkedTokens.apply(*flat, loss, step, grad_into_teacher).view(rows, tokens)


class _ChunkedKL(torch.autograd.Function):
    """The KL of ``chunked_kl_tokens``: log q and p kept in the inputs' memory, no recomputation in backward."""

    @staticmethod
    def forward(ctx, logits, teacher, temperature, step):
        values = logits.new_empty(logits.shape[:2])
        for a, b in chunk_bounds(logits.shape[1], step):
            student, probs = logits[:, a:b], teacher[:, a:b]
            log_q = torch.log_softmax(student if temperature == 1.0 else student / temperature, dim=-1)
            if temperature != 1.0:
                probs.div_(temperature)
            log_p = probs.sub_(probs.logsumexp(dim=-1, keepdim=True))
            values[:, a:b] = torch.nn.functional.kl_div(log_q, log_p, reduction="none", log_target=True).sum(dim=-1)
            probs.exp_()  # the exp(log p) kl_div multiplied by, which its gradient multiplies by too
            student.copy_(log_q)
        ctx.temperature, ctx.step = temperature, step
        ctx.save_for_backward(logits, teacher)  # now log q and p
        return values

    @staticmethod
    def backward(ctx, grad):
        log_q, probs = ctx.saved_tensors
        for a, b in chunk_bounds(log_q.shape[1], ctx.step):
            # autograd's chain: the sum's grad spread over the vocabulary, times exp(log p), negated
            # (d/d log_q of log_p - log_q), then log_softmax's backward and the division's.
            piece = (grad[:, a:b, None] * probs[:, a:b]).neg_()
            piece = torch._log_softmax_backward_data(piece, log_q[:, a:b], -1, log_q.dtype)
            probs[:, a:b].copy_(piece if ctx.temperature == 1.0 else piece / ctx.temperature)
        return probs, None, None, None


def chunked_kl_tokens(logits, teacher_logits, temperature=1.0, *, chunk_elements=None):
    """Each token's distillation KL, ``KL(softmax(t / T) || softmax(s / T))``, ``tokens_per_chunk`` tokens at a time.

    Bit for bit ``mixle.lm.finetune_train.token_loss(logits, teacher_logits, targets, T, 1.0)`` and its
    gradient, without running the loss twice: the inputs are consumed (the caller's alone, as
    ``chunked_tokens``'s teacher under ``grad_into_teacher``): forward leaves the student's
    log-probabilities in ``logits`` (so nothing else may use or have saved them) and backward
    writes the gradient into ``teacher_logits``.

    Args:
        logits: float ``(rows, tokens, vocab)``, the student's (the gradient flows into them).
        teacher_logits: float, the same shape; no gradient flows into them.
        temperature: T of both softmaxes.
        chunk_elements: logits per chunk (default ``CHUNK_ELEMENTS``).

    Returns:
        float tensor ``(rows, tokens)``.

    >>> import torch.nn.functional as F
    >>> s, t = torch.randn(3, 2, 5), torch.randn(3, 2, 5)
    >>> log_p = t - t.logsumexp(-1, keepdim=True)
    >>> want = F.kl_div(F.log_softmax(s, -1), log_p, reduction="none", log_target=True).sum(-1)
    >>> bool(torch.equal(chunked_kl_tokens(s.clone().requires_grad_(), t.clone(), chunk_elements=10), want))
    True
    """
    if logits.shape != teacher_logits.shape or logits.dim() != 3:
        raise ValueError(f"logits {tuple(logits.shape)} and teacher_logits {tuple(teacher_logits.shape)} must be "
                         f"(rows, tokens, vocab) and the same")
    rows, tokens, vocab = logits.shape
    flat = logits.reshape(1, rows * tokens, vocab), teacher_logits.detach().reshape(1, rows * tokens, vocab)
    return _ChunkedKL.apply(*flat, float(temperature), tokens_per_chunk(vocab, chunk_elements)).view(rows, tokens)
