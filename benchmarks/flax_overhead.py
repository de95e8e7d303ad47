"""Training-step time of mixle's Flax (NNX) QAT against fp32, beside torch's ``overhead.py``.

Every variant trains its own copy of the same NNX model on the same batch (a full step under
``nnx.jit``: forward, backward, SGD update). Steps of all variants are interleaved round by
round in one process, so machine load hits them alike; the table shows the median step after
warm-up and its ratio to fp32.

Shape: ``mlp`` is 4 ``nnx.Linear`` layers 512->2048->512->2048->512 with GELU, batch 256, MSE
loss (the torch benchmark's ``mlp``). Variants: fp32, int4 per-channel, int4 per-channel with
``clip_percentile=99.9``.

Usage::

    python benchmarks/flax_overhead.py                  # 30 steps
    python benchmarks/flax_overhead.py --steps 60 --warmup 5
"""

import argparse
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.simplefilter("ignore", DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mixle.api import apply_qat  # noqa: E402
from mixle.core.spec import QuantSpec  # noqa: E402

PERCENTILE = 99.9
WIDTHS = (512, 2048, 512, 2048, 512)
BATCH = 256


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(WIDTHS, WIDTHS[1:])])

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = jax.nn.gelu(x)
        return x


VARIANTS = {
    "fp32": None,
    "int4 channel": QuantSpec(bits=4),
    f"int4 channel p{PERCENTILE}": QuantSpec(bits=4, clip_percentile=PERCENTILE),
}


def build(spec, x):
    model = MLP(nnx.Rngs(0))
    if spec is not None:
        apply_qat(model, spec=spec, example_inputs=(x,))
    optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    return model, optimizer, step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
    args = parser.parse_args()

    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (BATCH, WIDTHS[0]))
    y = jax.random.normal(keys[1], (BATCH, WIDTHS[-1]))
    runs = {name: build(spec, x) for name, spec in VARIANTS.items()}
    times = {name: [] for name in runs}
    for round_ in tqdm(range(args.warmup + args.steps), desc="rounds"):
        for name, (model, optimizer, step) in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(step(model, optimizer, x, y))
            if round_ >= args.warmup:
                times[name].append(time.perf_counter() - start)

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"\nFlax NNX QAT step time: MLP {'->'.join(map(str, WIDTHS))} GELU, batch {BATCH}, MSE, SGD, nnx.jit")
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {threads} CPU threads available, "
          f"{platform.processor() or platform.machine()}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"{args.steps} timed steps per variant after {args.warmup} warm-up, interleaved\n")
    base = statistics.median(times["fp32"])
    print(f"{'variant':<24} {'median ms':>10} {'vs fp32':>8}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<24} {median * 1e3:>10.2f} {median / base:>7.2f}x")


if __name__ == "__main__":
    main()
