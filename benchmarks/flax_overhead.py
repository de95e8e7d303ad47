"""Training-step time of mixle's Flax (NNX) QAT against fp32, with torch's beside it.

Every variant trains its own copy of the same model on the same batch (a full step: forward,
backward, SGD update; ``nnx.jit`` for Flax, eager for torch). Steps of all variants of both
frameworks are interleaved round by round in one process (the first to go rotates), so machine
load hits them alike; the table shows each variant's median step after warm-up and its ratio
to the same framework's fp32 step. ``--clock cpu`` measures process CPU time (all threads)
instead of wall time, which other jobs on a shared machine disturb less.

Shape: ``mlp`` is 4 Linear layers 512->2048->512->2048->512 with GELU, batch 256, MSE loss
(``overhead.py``'s ``mlp``). Variants: fp32; int4 per-channel, group-wise (32), per-channel with
``clip_percentile=99.9``; int8 per-channel. QAT is ``mixle.api.apply_qat`` in both frameworks.

Usage::

    python benchmarks/flax_overhead.py                  # 30 steps, wall clock, torch beside
    python benchmarks/flax_overhead.py --steps 60 --warmup 5 --clock cpu
    python benchmarks/flax_overhead.py --no-torch
"""

import argparse
import os
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
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py, beside this script)

PERCENTILE = 99.9
WIDTHS = (512, 2048, 512, 2048, 512)
BATCH = 256

VARIANTS = {
    "fp32": None,
    "int4 channel": QuantSpec(bits=4),
    "int4 g32": QuantSpec(bits=4, group_size=32),
    f"int4 channel p{PERCENTILE}": QuantSpec(bits=4, clip_percentile=PERCENTILE),
    "int8 channel": QuantSpec(bits=8),
}


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(WIDTHS, WIDTHS[1:])])

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = jax.nn.gelu(x)
        return x


def flax_step(spec, x, y):
    """A no-argument callable running one jitted Flax training step; returns its loss."""
    model = MLP(nnx.Rngs(0))
    if spec is not None:
        apply_qat(model, spec=spec, example_inputs=(x,))
    optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    return lambda: jax.block_until_ready(step(model, optimizer, x, y))


def torch_step(spec, x, y):
    """The same step in torch (eager, mixle's torch QAT layers)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(WIDTHS) - 2:
            layers.append(nn.GELU(approximate="tanh"))  # jax.nn.gelu's default
    model = nn.Sequential(*layers)
    if spec is not None:
        apply_qat(model, spec=spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return step




def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall time, or process CPU time over all threads")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: the CPUs this process may use)")
    parser.add_argument("--no-torch", action="store_true", help="time the Flax steps only")
    args = parser.parse_args()

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (BATCH, WIDTHS[0]))
    y = jax.random.normal(keys[1], (BATCH, WIDTHS[-1]))
    runs = {("flax", name): flax_step(spec, x, y) for name, spec in VARIANTS.items()}
    if not args.no_torch:
        import numpy as np
        import torch

        torch.set_num_threads(args.threads or threads)
        tx, ty = (torch.from_numpy(np.array(a)) for a in (x, y))
        runs.update({("torch", name): torch_step(spec, tx, ty) for name, spec in VARIANTS.items()})

    clock = time.perf_counter if args.clock == "wall" else time.process_time
    times = {key: [] for key in runs}
    order = list(runs)
    for round_ in tqdm(range(args.warmup + args.steps), desc="rounds", file=sys.stderr):
        shift = round_ % len(order)
        for key in order[shift:] + order[:shift]:  # rotate who goes first
            start = clock()
            runs[key]()
            if round_ >= args.warmup:
                times[key].append(clock() - start)

    frameworks = ["flax"] + ([] if args.no_torch else ["torch"])
    print(f"\nQAT training step: MLP {'->'.join(map(str, WIDTHS))} GELU, batch {BATCH}, MSE, SGD "
          f"(Flax NNX under nnx.jit; torch eager)")
    print(f"jax {jax.__version__} ({jax.default_backend()})"
          + ("" if args.no_torch else f", torch {torch.__version__} ({torch.get_num_threads()} threads)")
          + f", {threads} CPUs available, {cpu_name()}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"{args.clock} clock, median of {args.steps} steps per variant after {args.warmup} warm-up, "
          f"interleaved\n")
    header = f"{'variant':<24}" + "".join(f" {fw + ' ms':>10} {'vs fp32':>8}" for fw in frameworks)
    print(header)
    for name in VARIANTS:
        row = f"{name:<24}"
        for fw in frameworks:
            median = statistics.median(times[(fw, name)])
            row += f" {median * 1e3:>10.2f} {median / statistics.median(times[(fw, 'fp32')]):>7.2f}x"
        print(row)


if __name__ == "__main__":
    main()
