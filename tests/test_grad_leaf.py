"""GradLeaf: the weighted M-step, its estimator contract, non-finite safety, and QAT models going through it."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from mixle.lm.data import load_splits
from mixle.models.grad_leaf import GradEstimator, GradLeaf, NonFiniteLossError
from mixle.models.qat import QATWrapper, apply_qat
from mixle.models.transformer import build_causal_lm


class Gaussian(nn.Module):
    """Unit-variance Gaussian with a learnable mean."""

    def __init__(self, mu=0.0):
        super().__init__()
        self.mu = nn.Parameter(torch.tensor(float(mu), dtype=torch.float64))

    def log_density(self, x):
        return -0.5 * (x - self.mu) ** 2 - 0.5 * math.log(2 * math.pi)


def test_full_batch_m_step_reaches_the_weighted_mean():
    x = np.array([0.0, 1.0, 2.0, 10.0])
    w = np.array([1.0, 2.0, 3.0, 0.0])
    # With SGD at lr 0.5 the mean halves its distance to the weighted mean every step.
    leaf = GradLeaf(Gaussian(), m_steps=60, lr=0.5, optimizer=torch.optim.SGD)
    out = leaf.estimator().estimate(None, ((torch.tensor(x),), w))
    assert out is leaf
    assert leaf.module.mu.item() == pytest.approx((w * x).sum() / w.sum(), abs=1e-12)  # 8/6


def test_objective_uses_weights_normalised_to_one():
    x = np.array([0.5, -1.0, 3.0])
    w = np.array([2.0, 1.0, 1.0])
    leaf = GradLeaf(Gaussian(mu=0.25), m_steps=1, lr=1e-3)
    leaf.fit(torch.tensor(x), weights=w)
    log_density = -0.5 * (x - 0.25) ** 2 - 0.5 * math.log(2 * math.pi)
    assert leaf.history[0] == pytest.approx(-(w / w.sum() * log_density).sum(), rel=1e-12)


def test_minibatch_loss_is_an_unbiased_rescaling_of_the_sampled_rows():
    x = np.linspace(-2, 2, 10)
    w = np.arange(1.0, 11.0)
    leaf = GradLeaf(Gaussian(mu=0.5), m_steps=1, lr=1e-6, batch_size=4, seed=7)
    leaf.fit(torch.tensor(x), weights=w)
    idx = torch.randperm(10, generator=torch.Generator().manual_seed(7))[:4].numpy()
    log_density = -0.5 * (x[idx] - 0.5) ** 2 - 0.5 * math.log(2 * math.pi)
    assert leaf.history[0] == pytest.approx(-(w[idx] / w.sum() * log_density).sum() * 10 / 4, rel=1e-6)


def test_seq_log_density_scores_in_eval_mode_without_gradients_and_restores_the_mode():
    class ModeAware(Gaussian):
        def log_density(self, x):
            assert not torch.is_grad_enabled()
            return super().log_density(x) + (0.0 if self.training else 1.0)

    module = ModeAware(mu=1.0)
    module.train()
    leaf = GradLeaf(module, m_steps=1, lr=0.1, eval_batch_size=2)
    x = np.array([0.0, 1.0, 3.0])
    got = leaf.seq_log_density(torch.tensor(x))
    np.testing.assert_allclose(got, -0.5 * (x - 1.0) ** 2 - 0.5 * math.log(2 * math.pi) + 1.0)
    assert got.dtype == np.float64 and module.training


def test_non_finite_loss_stops_and_restores_the_last_good_weights_and_optimizer_state():
    class LogBarrier(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))

        def log_density(self, x):  # loss = -log p + 3p: the gradient -1/p + 3 pushes p below zero
            return torch.log(self.p) - 3.0 * self.p + 0 * x

    module = LogBarrier()
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    leaf = GradLeaf(module, m_steps=50, optimizer=optimizer)
    # Step 1: loss 3 at p = 1, gradient 2, so p becomes -1 and the loss of step 2 is NaN.
    with pytest.raises(NonFiniteLossError, match="loss became nan at step 2 of 50.*restored"):
        leaf.fit(torch.zeros(3))
    assert module.p.item() == 1.0  # p after step 1 was 1 - (3 - 1) = -1: back to the last finite one
    assert optimizer.param_groups[0]["lr"] == 1.0
    assert leaf.history == [pytest.approx(3.0)]


def test_non_finite_after_adam_steps_restores_adam_state_to_match_the_weights():
    class Blowup(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.tensor(0.0))

        def log_density(self, x):  # finite while p < 0.35, then NaN
            return -(self.p - 1.0) ** 2 + torch.where(self.p < 0.35, 0.0, float("nan")) + 0 * x

    module = Blowup()
    leaf = GradLeaf(module, m_steps=100, lr=0.1)  # Adam: p grows by about lr per step
    with pytest.raises(NonFiniteLossError):
        leaf.fit(torch.zeros(2))
    finite_steps = len(leaf.history)
    assert 3 <= finite_steps <= 5
    assert module.p.item() < 0.35
    # Adam's step count belongs to the restored weights: one update fewer than losses seen.
    assert int(leaf.optimizer.state[module.p]["step"]) == finite_steps - 1
    leaf.optimizer.param_groups[0]["lr"] = 0.01
    leaf.m_steps = 3
    leaf.fit(torch.zeros(2))  # training can continue from the restored state
    assert len(leaf.history) == finite_steps + 3


def test_bad_input_gets_clear_errors_and_changes_nothing():
    module = Gaussian(mu=0.5)
    with pytest.raises(TypeError, match="log_density"):
        GradLeaf(nn.Linear(2, 2), m_steps=1, lr=0.1)
    with pytest.raises(ValueError, match="m_steps must be a positive int, got 0"):
        GradLeaf(module, m_steps=0, lr=0.1)
    with pytest.raises(ValueError, match="lr must be a positive finite number, got None"):
        GradLeaf(module, m_steps=1)
    with pytest.raises(ValueError, match="optimizer is an optimizer instance.*lr must be None"):
        GradLeaf(module, m_steps=1, lr=0.1, optimizer=torch.optim.SGD(module.parameters(), lr=0.1))
    leaf = GradLeaf(module, m_steps=5, lr=0.1)
    est = leaf.estimator()
    assert isinstance(est, GradEstimator)
    x = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match=r"weights must have shape \(2,\)"):
        est.estimate(None, ((x,), [1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="finite and non-negative"):
        est.estimate(None, ((x,), [1.0, -1.0]))
    with pytest.raises(ValueError, match="sum to zero"):
        est.estimate(None, ((x,), [0.0, 0.0]))
    with pytest.raises(ValueError, match="nobs=3 does not match the 2 rows"):
        est.estimate(3, ((x,), None))
    with pytest.raises(ValueError, match="different numbers of rows"):
        est.estimate(None, ((x, torch.zeros(3)), None))
    with pytest.raises(ValueError, match="suff_stat must be a pair"):
        est.estimate(None, x)
    assert module.mu.item() == 0.5 and leaf.history == []


def test_an_optimizer_built_before_apply_qat_keeps_training_the_same_tensors():
    class Regression(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

        def log_density(self, x, y):
            return -0.5 * (self.net(x)[:, 0] - y) ** 2

    torch.manual_seed(0)
    module = Regression()
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    apply_qat(module, bits=4)
    assert isinstance(module.net[0], QATWrapper)
    x = torch.randn(64, 4)
    y = x.sum(1)
    before = module.net[0].weight.detach().clone()
    leaf = GradLeaf(module, m_steps=30, optimizer=optimizer).fit((x, y))
    assert not torch.equal(module.net[0].weight, before)
    assert leaf.history[-1] < leaf.history[0]


class WindowLM(nn.Module):
    """The user's module: log-density of a window of tokens under the causal LM."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def log_density(self, windows):
        return self.lm.sequence_log_prob(windows)


def _windows(ids, length, count, rng):
    starts = rng.integers(0, len(ids) - length, count)
    return torch.as_tensor(np.stack([ids[s : s + length] for s in starts]))


def test_seed_usage_qat_causal_lm_trains_through_grad_leaf_unchanged():
    """build_causal_lm -> apply_qat -> GradLeaf -> estimator().estimate(None, suff_stat)."""
    train, held, tok = load_splits()
    rng = np.random.default_rng(0)
    train_windows = _windows(train, 33, 512, rng)
    held_windows = _windows(held, 33, 64, rng)
    torch.manual_seed(0)
    lm = apply_qat(build_causal_lm(tok.vocab_size, d_model=32, n_layer=1, n_head=2, block=32), bits=4)
    leaf = GradLeaf(WindowLM(lm), m_steps=60, lr=3e-3, batch_size=16)
    before = leaf.seq_log_density(held_windows).mean()
    trained = leaf.estimator().estimate(None, ((train_windows,), np.ones(len(train_windows))))
    after = trained.seq_log_density(held_windows).mean()
    # Uniform over the vocabulary is -32 * log(vocab) per window; training must beat it clearly.
    assert before == pytest.approx(-32 * math.log(tok.vocab_size), rel=0.05)
    assert after > before + 0.2 * 32
    wrappers = [m for m in trained.module.modules() if isinstance(m, QATWrapper)]
    assert len(wrappers) == 5 and all(w.enabled for w in wrappers)
    assert lm.head.weight is lm.tok.weight


class Exploding(nn.Module):
    """A linear read-out whose gradient (1e35) sends the weights to inf in one SGD step at lr 1e10,
    while the loss of the step that made that update is finite."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def log_density(self, x):
        return self.lin(x).sum(-1) * 1e38


@pytest.mark.parametrize("qat", [False, True], ids=["float", "qat"])
def test_a_diverged_model_is_restored_to_its_last_finite_state_with_or_without_qat(qat):
    module = Exploding()
    if qat:
        module.lin = apply_qat(module.lin, bits=4)
    before = [p.detach().clone() for p in module.parameters()]
    leaf = GradLeaf(module, m_steps=5, lr=1e10, optimizer=torch.optim.SGD)
    with pytest.raises(NonFiniteLossError, match=r"at step 2 of 5: stopped.*restored.*set grad_clip"):
        leaf.fit(torch.full((3, 4), 1e-3))
    assert leaf.history and all(math.isfinite(v) for v in leaf.history)
    for p, b in zip(module.parameters(), before):
        assert torch.equal(p, b)  # back to the weights of the last finite loss (here: the start)
