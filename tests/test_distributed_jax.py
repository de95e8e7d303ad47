"""QAT of an NNX model under jax.sharding: a 2-device CPU mesh (own process) against one device."""

import json
import sys
import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("qwix")
pytest.importorskip("optax")

from tests.dist_workers import jax_setup  # noqa: E402
from tests.dist_workers.launch import run_bounded, worker_env  # noqa: E402
from tests.test_numerics import reference_codes_scales  # noqa: E402

DEADLINE_S = 90  # the worker exits by itself after this; the launcher kills it at +15 s
STEPS = range(len(jax_setup.QAT_SCHEDULE))
# Measured max |2-device mesh - one device| over all parameters and steps: 6e-8.
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("jax_mesh")
    env = worker_env(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    run_bounded([sys.executable, "-m", "tests.dist_workers.jax_train",
                 workdir, DEADLINE_S], env=env, timeout=DEADLINE_S + 15, workdir=workdir)
    with np.load(workdir / "result.npz") as arrays:
        result = dict(arrays)
    result["facts"] = json.loads((workdir / "facts.json").read_text())
    return result


def one_device():
    device = jax.devices()[0]
    return lambda batch: jax.device_put(batch, device)


@pytest.fixture(scope="module")
def reference():
    return jax_setup.train(jax_setup.make_model(), one_device())


def history_of(sharded):
    return [{name: sharded[f"params/{step}/{name}"] for name in ("hidden/bias", "hidden/kernel", "out/bias",
                                                                   "out/kernel")} for step in STEPS]


def numpy_forward(params, x, fake_quant):
    """The MLP in plain numpy (tanh GELU, as jax.nn.gelu); kernels are (in, out): one scale per column."""
    def kernel(name):
        w = params[f"{name}/kernel"]
        return reference_codes_scales(w.T, 4, "channel")[2].T if fake_quant else w

    h = x @ kernel("hidden") + params["hidden/bias"]
    h = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    return h @ kernel("out") + params["out/bias"]


def test_mesh_splits_the_batch_and_keeps_one_identical_copy_of_each_param_per_device(sharded):
    facts = sharded["facts"]
    assert facts["batch_shards"] == [[jax_setup.BATCH // 2, jax_setup.D_IN]] * 2
    assert sorted(facts["params"]) == ["hidden/bias", "hidden/kernel", "out/bias", "out/kernel"]
    for name, param in facts["params"].items():
        assert param == {"replicated": True, "devices": 2, "copies_identical": True}, name


def test_reference_trains_and_fake_quant_changes_it(reference):
    """Guards the comparison below: a mesh run that lost QAT (or did not train) could not match."""
    history, _ = reference
    initial = jax_setup.parameters(jax_setup.make_model())
    assert min(np.abs(history[0][n] - initial[n]).max() for n in initial) > 100 * TOLERANCE["atol"]
    float_history, _ = jax_setup.train(jax_setup.make_model(qat=False), one_device(), qat=False)
    assert max(np.abs(history[-1][n] - float_history[-1][n]).max() for n in initial) > 1e-3


def test_mesh_training_matches_one_device_after_every_step(sharded, reference):
    history = history_of(sharded)
    for step in STEPS:
        assert history[step].keys() == reference[0][step].keys()
        for name, value in reference[0][step].items():
            np.testing.assert_allclose(history[step][name], value, **TOLERANCE, err_msg=f"step {step}, {name}")


def test_toggle_under_the_mesh_gives_float_and_numpy_fake_quant_outputs(sharded):
    params = history_of(sharded)[-1]
    probe = jax_setup.make_data()[0][-1]
    np.testing.assert_allclose(sharded["probe/off"], numpy_forward(params, probe, False), rtol=0, atol=1e-5)
    np.testing.assert_allclose(sharded["probe/on"], numpy_forward(params, probe, True), rtol=0, atol=1e-5)
    assert np.abs(sharded["probe/on"] - sharded["probe/off"]).max() > 1e-2
