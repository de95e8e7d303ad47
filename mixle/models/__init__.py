"""Public faces: mixle.models.qat, mixle.models.transformer and mixle.models.grad_leaf."""
