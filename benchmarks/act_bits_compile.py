"""What ``act_bits=8`` on llama.cpp's grids adds to the jax finetune job's compiled forward: the float graph
of a SmolLM2-135M-shaped model's q4_0 kernel groups (``mixle.flax_backend.kernel_groups``), without the
flag and with each llama.cpp build's Q8_0 rounding of the product inputs (``QuantSpec.act_rounding``).

    python benchmarks/act_bits_compile.py [--layers 30] [--rounds 5]
    python benchmarks/tpu_check.py --skip-tests --skip-numerics --act-compile   # on the lent TPU

Random weights (the values do not change the work), 16 x 128 tokens. Prints, per variant, the lines of
HLO that jax lowers the forward to, XLA's compile time, and the median of ``--rounds`` calls beside the
forward without the flag; the variants run one after another in one process.
"""

import statistics
import time

import numpy as np

from search_speed import SMOLLM2, run_sized

VARIANTS = {"no act_bits": {}, "act_bits=8 (reference)": {"act_bits": 8},
            "act_bits=8, act_rounding=x86": {"act_bits": 8, "act_rounding": "x86"}}


def time_compiles(rounds=5, layers=30, batch=16, block=128):
    """``{variant: {"hlo_lines", "compile_s", "median_s"}}`` of the q4_0 float graph's forward."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mixle.api import apply_qat
    from mixle.flax_backend.kernel_groups import float_graphdef, kernel_groups, quantized_state
    from mixle.lm.flax_causal_lm import CausalLM, CausalLMConfig

    config = CausalLMConfig.from_dict({**SMOLLM2, "num_hidden_layers": layers})
    ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (batch, block)), jnp.int32)
    results = {}
    for name, fields in VARIANTS.items():
        model = CausalLM(config, rngs=nnx.Rngs(0))
        apply_qat(model, grid="q4_0", exclude=("embed_tokens",), example_inputs=(ids[:1, :8],), **fields)
        graphdef, state = float_graphdef(model), quantized_state(kernel_groups(model), nnx.state(model))
        lowered = jax.jit(lambda s, graphdef=graphdef: nnx.merge(graphdef, s)(ids)).lower(state)
        began = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - began
        jax.block_until_ready(compiled(state))
        seconds = []
        for _ in range(rounds):
            began = time.perf_counter()
            jax.block_until_ready(compiled(state))
            seconds.append(time.perf_counter() - began)
        results[name] = {"hlo_lines": lowered.as_text().count("\n"), "compile_s": compile_s,
                         "median_s": statistics.median(seconds)}
        print(f"{name}: {results[name]}", flush=True)
    return results


def print_compiles(results, layers, rounds):
    """The table of ``time_compiles``' results, each beside the forward without act_bits."""
    import jax

    base = results["no act_bits"]
    print(f"\nSmolLM2-135M-shaped ({layers} layers) q4_0 forward at 16 x 128 tokens, {jax.devices()[0].device_kind}, "
          f"jax {jax.__version__}, median of {rounds}")
    print(f"{'variant':<32}{'HLO lines':>11}{'compile s':>11}{'x':>7}{'median ms':>11}{'x':>7}")
    for name, entry in results.items():
        print(f"{name:<32}{entry['hlo_lines']:>11,}{entry['compile_s']:>11.1f}"
              f"{entry['compile_s'] / base['compile_s']:>7.2f}{entry['median_s'] * 1e3:>11.1f}"
              f"{entry['median_s'] / base['median_s']:>7.2f}")


def main(argv=None):
    run_sized(__doc__, argv, time_compiles, print_compiles)


if __name__ == "__main__":
    main()
