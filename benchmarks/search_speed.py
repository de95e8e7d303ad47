"""The jax finetune job's per-step fake quantization (``quantized_state``) of a SmolLM2-135M-shaped
model, q4_0 with and without the importance-weighted search, for each way ``JaxC`` runs C's running
sums (``mixle.core.c_arith.ORDERED_SUMS``), beside the float model's forward and backward at 16 x 128
tokens: which way a platform should use, and what the search costs a step.

    python benchmarks/search_speed.py [--rounds 5] [--layers 30]
    python benchmarks/tpu_check.py --skip-tests --skip-numerics --search   # on the lent TPU

Random weights and importance (the values do not change the work). Prints the compile and the
median of ``--rounds`` calls of each, each blocked on; the ways run one after another in one process.
"""

import argparse
import statistics
import time

import numpy as np

WAYS = ("loop", "lanes", "unrolled")
SMOLLM2 = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True}


def _timed(call, rounds):
    import jax

    seconds = []
    for _ in range(rounds):
        began = time.perf_counter()
        jax.block_until_ready(call())
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def time_search(rounds=5, layers=30, batch=16, block=128):
    """``{name: {"compile_s", "median_s"}}`` for the float forward+backward and each search and way."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mixle.api import apply_qat
    from mixle.core import c_arith
    from mixle.core.spec import QuantSpec
    from mixle.flax_backend.kernel_groups import kernel_groups, quantized_state
    from mixle.lm.flax_causal_lm import CausalLM, CausalLMConfig

    config = CausalLMConfig.from_dict({**SMOLLM2, "num_hidden_layers": layers})
    model = CausalLM(config, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (batch, block + 1)), jnp.int32)

    def loss(m):
        logits = m(ids[:, :-1])
        return -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), ids[:, 1:, None], -1).mean()

    results = {}
    began = time.perf_counter()
    step = nnx.jit(nnx.value_and_grad(loss))
    jax.block_until_ready(step(model))
    results["float forward + backward"] = {"compile_s": time.perf_counter() - began,
                                           "median_s": _timed(lambda: step(model), rounds)}
    rng = np.random.default_rng(1)
    inputs = {name: SMOLLM2["hidden_size"] for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")}
    inputs["mlp.down_proj"] = SMOLLM2["intermediate_size"]  # each kernel's importance: one value per input
    importance = {f"layers.{i}.{name}": rng.random(size).astype(np.float32) + 0.01 for i in range(layers)
                  for name, size in inputs.items()}
    platform = jax.default_backend()
    saved = c_arith.ORDERED_SUMS.get(platform)
    try:
        for label, extra in (("q4_0", {}), ("q4_0 imatrix", {"importance": importance})):
            student = nnx.clone(model)
            apply_qat(student, spec=QuantSpec(grid="q4_0"), exclude=("embed_tokens",),
                      example_inputs=(jnp.zeros((1, 4), jnp.int32),), **extra)
            groups, params = kernel_groups(student), nnx.state(student, nnx.Param)
            for way in WAYS:
                c_arith.ORDERED_SUMS[platform] = way
                jax.clear_caches()  # quantized_state's key does not hold the way
                began = time.perf_counter()
                jax.block_until_ready(quantized_state(groups, params))
                results[f"{label}, {way}"] = {"compile_s": time.perf_counter() - began,
                                              "median_s": _timed(lambda: quantized_state(groups, params), rounds)}
                print(f"{label}, {way}: {results[f'{label}, {way}']}", flush=True)
    finally:
        c_arith.ORDERED_SUMS[platform] = saved
    return results


def print_search(results, layers, rounds):
    """The table of ``time_search``'s results, each median beside the float step's."""
    import jax

    base = results["float forward + backward"]["median_s"]
    print(f"\nSmolLM2-135M-shaped ({layers} layers), {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"median of {rounds}; the float model's forward + backward at 16 x 128 tokens = 1.00")
    print(f"{'what':<34}{'compile s':>10}{'median ms':>11}{'x float':>9}")
    for name, entry in results.items():
        print(f"{name:<34}{entry['compile_s']:>10.1f}{entry['median_s'] * 1e3:>11.1f}{entry['median_s'] / base:>9.2f}")


def run_sized(doc, argv, measure, show):
    """Parse ``--rounds`` / ``--layers`` (a SmolLM2-shaped benchmark's command line), time, print."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args(argv)
    show(measure(args.rounds, args.layers), args.layers, args.rounds)


def main(argv=None):
    run_sized(__doc__, argv, time_search, print_search)


if __name__ == "__main__":
    main()
