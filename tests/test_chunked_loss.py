"""The finetune loss computed a few tokens at a time (``mixle.lm.chunked_loss``) against the whole-batch loss.

The chunked loss runs the same float ops on each token as the whole-batch ``row_loss`` /
``distill_row_loss``, so values and gradients must be equal bit for bit (torch.equal), in one
thread and in two (where torch splits a single token's vocabulary sum among the threads, so the
chunks never leave a token alone). Both are also checked against a float64 numpy reference of
the loss and of its gradient (softmax(q) - softmax(p) for the KL), within a tolerance of a few
float32 roundings per vocabulary entry. The fused KL (``chunked_kl_tokens``), whose backward runs
autograd's ops on what its forward kept, must equal them bit for bit too.
"""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mixle.lm.chunked_loss import chunk_bounds, chunked_kl_tokens, chunked_tokens, tokens_per_chunk  # noqa: E402
from mixle.lm.distill import distill_row_loss  # noqa: E402
from mixle.lm.finetune_train import row_loss, rows_of_tokens, token_loss  # noqa: E402

ROWS, TOKENS, VOCAB = 3, 11, 257
OBJECTIVES = [(1.0, 1.0), (2.0, 1.0), (1.5, 1.0), (1.5, 0.5), (1.0, 0.0)]  # (temperature, weight)


def _inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    student = 3 * torch.randn(ROWS, TOKENS, VOCAB, generator=generator)
    teacher = 3 * torch.randn(ROWS, TOKENS, VOCAB, generator=generator)
    targets = torch.randint(0, VOCAB, (ROWS, TOKENS), generator=generator)
    return student, teacher, targets


def _numpy_rows(s, t, y, temperature, weight):
    """The per-row loss and its gradient for d(sum of rows)/d(student logits), in float64."""
    s, t = s.double().numpy(), t.double().numpy()

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    log_q, log_p, log_s = log_softmax(s / temperature), log_softmax(t / temperature), log_softmax(s)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    ce = -np.take_along_axis(log_s, y.numpy()[..., None], -1)[..., 0]
    rows = ((1 - weight) * ce + weight * temperature**2 * kl).sum(1)
    onehot = np.eye(VOCAB)[y.numpy()]
    grad = (1 - weight) * (np.exp(log_s) - onehot) + weight * temperature * (np.exp(log_q) - np.exp(log_p))
    return rows, grad


def _whole(s, t, y, temperature, weight):
    s = s.clone().requires_grad_(True)
    rows = row_loss(s, t.clone(), y, temperature, weight, overwrite_teacher=True)
    (rows.sum() * (1 / 33)).backward()
    return rows.detach(), s.grad


def _chunked(s, t, y, temperature, weight, chunk_elements, into_teacher=True):
    s = s.clone().requires_grad_(True)
    loss = functools.partial(token_loss, temperature=temperature, weight=weight)
    tokens = chunked_tokens(loss, s, t.clone(), y, grad_into_teacher=into_teacher, chunk_elements=chunk_elements)
    rows = rows_of_tokens(tokens, temperature, weight)
    (rows.sum() * (1 / 33)).backward()
    return rows.detach(), s.grad


def _fused(s, t, temperature, chunk_elements):
    s = s.clone().requires_grad_(True)
    student = s * 1.0  # the logits a model returns: not a leaf, consumed by the loss
    rows = rows_of_tokens(chunked_kl_tokens(student, t.clone(), temperature, chunk_elements=chunk_elements),
                          temperature, 1.0)
    (rows.sum() * (1 / 33)).backward()
    return rows.detach(), s.grad


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("temperature", [1.0, 2.0, 1.5])
def test_the_fused_kl_is_the_whole_batch_loss_and_gradient_bit_for_bit(temperature, threads):
    s, t, y = _inputs(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want_rows, want_grad = _whole(s, t, y, temperature, 1.0)
        for elements in (VOCAB, 5 * VOCAB, 10**9):
            rows, grad = _fused(s, t, temperature, elements)
            assert torch.equal(rows, want_rows), elements
            assert torch.equal(grad, want_grad), elements
    finally:
        torch.set_num_threads(before)
    ref_rows, ref_grad = _numpy_rows(s, t, y, temperature, 1.0)
    eps, size = 2.0**-24, float(s.abs().max()) / min(temperature, 1.0) + np.log(VOCAB)  # as in the test below
    np.testing.assert_allclose(rows.numpy(), ref_rows, rtol=0, atol=32 * eps * TOKENS * size)
    np.testing.assert_allclose(grad.numpy(), ref_grad / 33, rtol=0, atol=32 * eps * np.abs(ref_grad / 33).max())


@pytest.mark.parametrize("temperature,weight", OBJECTIVES)
def test_chunked_loss_and_gradient_are_the_whole_batch_ones_bit_for_bit(temperature, weight):
    s, t, y = _inputs()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want_rows, want_grad = _whole(s, t, y, temperature, weight)
        # 2 tokens a chunk; 5 (a token left over, joined to the chunk before); 7; all 33 tokens in one
        for elements in (VOCAB, 5 * VOCAB, 7 * VOCAB, 10**9):
            for into_teacher in (True, False):
                rows, grad = _chunked(s, t, y, temperature, weight, elements, into_teacher)
                assert torch.equal(rows, want_rows), (elements, into_teacher)
                assert torch.equal(grad, want_grad), (elements, into_teacher)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(want_rows, distill_row_loss(s, t, y, temperature, weight)) or weight == 1.0
    ref_rows, ref_grad = _numpy_rows(s, t, y, temperature, weight)
    # float32 (eps 2**-24 a rounding): a token's loss is off by some roundings of its log-softmax's inputs,
    # at most max|logit| / T + log(VOCAB) in size; a row sums TOKENS of them. A gradient entry: some
    # roundings of the largest entry.
    eps = 2.0**-24
    size = float(s.abs().max()) / min(temperature, 1.0) + np.log(VOCAB)
    np.testing.assert_allclose(want_rows.numpy(), ref_rows, rtol=0, atol=32 * eps * TOKENS * size)
    np.testing.assert_allclose(want_grad.numpy(), ref_grad / 33, rtol=0, atol=32 * eps * np.abs(ref_grad / 33).max())


def test_a_vocabulary_larger_than_a_parallel_sum_is_exact_in_two_threads():
    """Over 32768 logits (torch's grain) a single token's sum is split among the threads: chunks never hold one."""
    generator = torch.Generator().manual_seed(1)
    s, t = torch.randn(2, 3, 40000, generator=generator), torch.randn(2, 3, 40000, generator=generator)
    y = torch.randint(0, 40000, (2, 3), generator=generator)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want_rows, want_grad = _whole(s, t, y, 1.0, 1.0)
        rows, grad = _chunked(s, t, y, 1.0, 1.0, 40000)  # 6 tokens in chunks of 2 (one token's logits asked)
        rows5, grad5 = _chunked(s, t, y, 1.0, 1.0, 5 * 40000)  # of 5, and the token left over joins them
        fused = _fused(s, t, 1.0, 40000)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(rows, want_rows) and torch.equal(grad, want_grad)
    assert torch.equal(rows5, want_rows) and torch.equal(grad5, want_grad)
    assert torch.equal(fused[0], want_rows) and torch.equal(fused[1], want_grad)


def test_chunks_never_leave_one_token_alone():
    for count in range(1, 40):
        for step in range(2, 9):
            bounds = chunk_bounds(count, step)
            assert [a for a, _ in bounds][0] == 0 and bounds[-1][1] == count
            assert all(b - a >= min(2, count) for a, b in bounds)
            assert all(b1 == a2 for (_, b1), (a2, _) in zip(bounds, bounds[1:]))
    assert tokens_per_chunk(49152) == 21 and tokens_per_chunk(10**6) == 2


def test_chunked_tokens_refuses_mismatched_shapes():
    s, t, y = _inputs()
    with pytest.raises(ValueError, match="teacher_logits"):
        chunked_tokens(lambda *a: None, s, t[:, :-1], y)
    with pytest.raises(ValueError, match="teacher_logits"):
        chunked_kl_tokens(s, t[:, :-1])
