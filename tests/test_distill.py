"""Self-distillation: the loss against numpy, the frozen teacher, GradLeaf and compare wiring."""

import numpy as np
import pytest
import torch

from mixle.lm.distill import SelfDistillation, distill_row_loss
from mixle.lm.grad_leaf import GradLeaf
from mixle.models.qat import apply_qat
from mixle.models.transformer import build_causal_lm


def _np_log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _np_row_loss(s, t, y, temperature, weight):
    ls = _np_log_softmax(s)
    ce = -np.take_along_axis(ls, y[..., None], axis=-1)[..., 0]
    lp, lq = _np_log_softmax(t / temperature), _np_log_softmax(s / temperature)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return ((1 - weight) * ce + weight * temperature**2 * kl).sum(-1)


@pytest.mark.parametrize("temperature,weight", [(1.0, 0.5), (2.0, 0.3), (0.5, 1.0), (3.0, 0.0)])
def test_loss_equals_numpy(temperature, weight):
    rng = np.random.default_rng(0)
    s, t = rng.normal(size=(3, 5, 7)) * 2, rng.normal(size=(3, 5, 7)) * 2
    y = rng.integers(0, 7, size=(3, 5))
    got = distill_row_loss(torch.tensor(s), torch.tensor(t), torch.tensor(y), temperature, weight)
    # float64 on both sides; differences are rounding of ~35 summed terms.
    np.testing.assert_allclose(got.numpy(), _np_row_loss(s, t, y, temperature, weight), rtol=1e-12, atol=1e-12)


def test_gradient_of_the_soft_term_pulls_toward_the_teacher():
    s = torch.zeros(1, 1, 3, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([[[2.0, 0.0, -1.0]]], dtype=torch.float64)
    distill_row_loss(s, t, torch.tensor([[0]]), 2.0, 1.0).sum().backward()
    # d/ds of T^2 KL(p_T || softmax(s/T)) is T * (q_T - p_T).
    p = np.exp(_np_log_softmax(t.numpy()[0, 0] / 2.0))
    np.testing.assert_allclose(s.grad.numpy()[0, 0], 2.0 * (np.full(3, 1 / 3) - p), rtol=1e-12)


@pytest.mark.parametrize("kw,msg", [({"temperature": 0.0}, "temperature"), ({"weight": 1.5}, "weight"),
                                    ({"temperature": float("nan")}, "temperature")])
def test_bad_settings_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        distill_row_loss(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), **kw)


class _Windows(torch.nn.Module):
    def __init__(self, lm, ids):
        super().__init__()
        self.lm, self.ids, self.offsets = lm, ids, torch.arange(lm.block + 1)

    def logits(self, starts):
        tokens = self.ids[starts[:, None] + self.offsets]
        return self.lm(tokens[:, :-1], all_positions=True), tokens[:, 1:]

    def log_density(self, starts):
        return self.lm.sequence_log_prob(self.ids[starts[:, None] + self.offsets])


def test_teacher_stays_frozen_while_the_qat_student_trains():
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (200,))
    student = _Windows(apply_qat(build_causal_lm(11, 16, 1, 2, 8), spec=None), ids)
    distill = SelfDistillation.snapshot(student, temperature=2.0, weight=0.5)
    before = {k: v.clone() for k, v in distill.teacher.state_dict().items()}
    start = {k: v.clone() for k, v in student.state_dict().items()}
    # The snapshot is the float model: its logits equal the student's with fake-quant off.
    starts = torch.arange(4)
    from mixle.models.qat import set_fake_quant_enabled

    set_fake_quant_enabled(student.lm, False)
    assert torch.equal(distill.teacher_logits(starts), student.logits(starts)[0].detach())
    set_fake_quant_enabled(student.lm, True)
    leaf = GradLeaf(student, m_steps=5, lr=1e-2, batch_size=8, distill=distill)
    leaf.fit(torch.arange(len(ids) - 9))
    after = distill.teacher.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not all(torch.equal(start[k], v) for k, v in student.state_dict().items())
    assert all(not p.requires_grad for p in distill.teacher.parameters())


def test_grad_leaf_minimises_the_distillation_objective():
    torch.manual_seed(1)
    ids = torch.randint(0, 7, (64,))
    student = _Windows(build_causal_lm(7, 8, 1, 1, 4), ids)
    distill = SelfDistillation(_Windows(build_causal_lm(7, 8, 1, 1, 4), ids), temperature=1.5, weight=0.4)
    leaf = GradLeaf(student, m_steps=1, lr=1e-3, distill=distill, optimizer=torch.optim.SGD)
    starts = torch.arange(10)
    logits, targets = student.logits(starts)
    want = distill_row_loss(logits, distill.teacher_logits(starts), targets, 1.5, 0.4).mean().item()
    leaf.fit(starts)
    assert leaf.history[0] == pytest.approx(want, rel=1e-6)  # float32 sums in another order


def test_grad_leaf_refuses_distill_without_logits():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def log_density(self, x):
            return x * self.w

    ids = torch.arange(10) % 5
    distill = SelfDistillation(_Windows(build_causal_lm(5, 8, 1, 1, 4), ids))
    with pytest.raises(TypeError, match="logits"):
        GradLeaf(Plain(), m_steps=1, lr=0.1, distill=distill)
