"""The NNX model, data and training loop shared by the sharded JAX worker and its one-device reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mixle.models.qat import apply_qat, set_fake_quant_enabled

# No activation has a kernel's shape: Qwix would take such an activation for the weight.
BATCH, D_IN, D_HIDDEN, D_OUT = 16, 12, 24, 6
# Fake quant per training step: switched off for one step and on again, under the mesh.
QAT_SCHEDULE = (True, True, False, True)
KERNELS = ("hidden/kernel", "out/kernel")


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(D_IN, D_HIDDEN, rngs=rngs)
        self.out = nnx.Linear(D_HIDDEN, D_OUT, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.gelu(self.hidden(x)))


def make_data():
    """Inputs ``(steps + 1, BATCH, D_IN)`` (the last batch is a held-out probe) and targets."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(len(QAT_SCHEDULE) + 1, BATCH, D_IN)).astype(np.float32)
    y = rng.normal(size=(len(QAT_SCHEDULE), BATCH, D_OUT)).astype(np.float32)
    return x, y


def make_model(qat=True):
    """The same initial weights in every process; int4 QAT through the Flax backend unless ``qat=False``."""
    model = MLP(nnx.Rngs(0))
    if qat:
        apply_qat(model, bits=4, example_inputs=(jnp.asarray(make_data()[0][0]),))
    return model


def parameters(model):
    """Every Param as a numpy array, keyed ``module/name``."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {"/".join(map(str, path)): np.asarray(leaf.get_value()) for path, leaf in flat}


def train(model, put, qat=True):
    """Train on ``QAT_SCHEDULE`` steps; ``put`` places a host batch on the device(s).

    Returns the parameters after each step and the probe outputs with fake quant on and off
    (the model is left with fake quant on).
    """
    optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def predict(model, x):
        return model(x)

    x, y = make_data()
    history = []
    for index, enabled in enumerate(QAT_SCHEDULE):
        if qat:
            set_fake_quant_enabled(model, enabled)
        step(model, optimizer, put(x[index]), put(y[index]))
        history.append(parameters(model))
    probe = {}
    for enabled in ((True, False) if qat else (False,)):
        if qat:
            set_fake_quant_enabled(model, enabled)
        probe["on" if enabled else "off"] = np.asarray(predict(model, put(x[-1])))
    if qat:
        set_fake_quant_enabled(model, True)
    return history, probe
