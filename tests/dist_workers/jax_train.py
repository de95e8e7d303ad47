"""Worker: data-parallel QAT of an NNX model over a 2-device CPU mesh; saves what the tests check.

Launched by tests/test_distributed_jax.py in its own process, because the device count is fixed
when jax starts: ``XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m
tests.dist_workers.jax_train OUT DEADLINE``.
"""

import json
import sys


def train(out):
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from tests.dist_workers import jax_setup

    if jax.device_count() != 2:
        raise RuntimeError(f"expected 2 host devices from XLA_FLAGS, got {jax.devices()}")
    # Auto axes: jit inserts the gradient all-reduce itself. (jax.make_mesh defaults to Explicit
    # axes, where the kernel gradient's contraction over the sharded batch needs an out_sharding.)
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))
    replicated, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))

    model = jax_setup.make_model()
    nnx.update(model, jax.device_put(nnx.state(model), replicated))
    history, probe = jax_setup.train(model, lambda batch: jax.device_put(batch, rows))

    facts = {"batch_shards": [list(s.data.shape) for s in jax.device_put(jax_setup.make_data()[0][0], rows)
                              .addressable_shards]}
    facts["params"] = {}
    for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = leaf.get_value()
        copies = [np.asarray(shard.data) for shard in value.addressable_shards]
        facts["params"]["/".join(map(str, path))] = {
            "replicated": value.sharding.is_fully_replicated,
            "devices": len(value.sharding.device_set),
            "copies_identical": all(np.array_equal(copies[0], c) for c in copies[1:]),
        }
    arrays = {f"params/{step}/{name}": value for step, params in enumerate(history) for name, value in params.items()}
    arrays.update({f"probe/{key}": value for key, value in probe.items()})
    np.savez(f"{out}/result.npz", **arrays)
    with open(f"{out}/facts.json", "w") as f:
        json.dump(facts, f)


def main(out, deadline):
    from tests.dist_workers.guard import bound_lifetime

    bound_lifetime(float(deadline), out)
    train(out)


if __name__ == "__main__":
    main(*sys.argv[1:])
