"""The fine-tuning loop with divergence rollback (a face over ``mixle.lm.grad_leaf``)."""

from mixle.lm.grad_leaf import GradEstimator, GradLeaf, NonFiniteLossError  # noqa: F401

__all__ = ["GradLeaf", "GradEstimator", "NonFiniteLossError"]
