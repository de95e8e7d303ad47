"""What XLA's TPU compiler makes of each training step (or serving pass), compiled on a host without a TPU.

The lent TPU has 30 minutes a session; compiling needs none of it. With ``libtpu`` installed
(``pip install libtpu==0.0.42.1``, the version JAX 0.10.2 pins), JAX compiles for a TPU v5e
topology on any x86 host. For each variant of ``benchmarks/tpu_speed.py`` this prints what the
compiler decided: the step's temporaries and arguments (does it fit the chip's 15.75 GiB?) and
its cost model's HBM bytes accessed and the sum of its kernels' cycle estimates (``estimated_ms``),
each beside the float step's. Both are proxies, not times: on the 470M model, bytes +9% came
with +3.2% step time (int8) and +40% with +22% (int4 group 32). ``--hlo DIR`` writes each
optimized program.

    pip install libtpu==0.0.42.1          # in a virtual environment of its own: jax then looks for a TPU
    python benchmarks/tpu_compile.py --size 470M --variants "mixle int8" "mixle int4 g32"
    python benchmarks/tpu_compile.py --size 470M --serving --hlo DIR   # the forward passes, programs kept
    python benchmarks/tpu_compile.py --group-products                  # one group-wise kernel's product, per way

Run each variant in its own process (``--variants`` one at a time) where memory is short: a 470M
model with AdamW holds ~6.4 GB of host memory while it is built.
"""

import argparse
import os
import re
import sys
import time
from pathlib import Path
from unittest import mock

# libtpu's defaults for a host without TPU hardware: one v5e chip, this host as its only worker.
for key, value in {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-1", "TPU_WORKER_ID": "0",
                   "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}.items():
    os.environ.setdefault(key, value)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tpu_speed import (LM, SIZES, chosen, error_text, parameters, pure_forward, pure_step,  # noqa: E402
                       serving_shapes, serving_variants, training_variants)


def tpu_device(topology="v5e:1x1"):
    """The first device of a TPU ``topology`` to compile for (no hardware needed)."""
    return topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                        chips_per_host_bounds=[1, 1, 1]).devices[0]


def _compiled_facts(function, abstract, hlo_path):
    """Compile ``function`` for the TPU on ``abstract`` arguments: its memory and HBM bytes (GiB)."""
    # The host's backend is the CPU; mixle picks what it traces by the backend it runs on, so the
    # program is traced as it is on the chip.
    with mock.patch.object(jax, "default_backend", lambda: "tpu"):
        try:
            compiled = function.lower(*abstract).compile()
        except Exception as err:  # RESOURCE_EXHAUSTED: the program does not fit the chip
            return {"error": error_text(err)}
    if hlo_path is not None:
        Path(hlo_path).write_text(compiled.as_text())
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"temp_gib": memory.temp_size_in_bytes / 2**30, "args_gib": memory.argument_size_in_bytes / 2**30,
            "hbm_gib": cost.get("bytes accessed", 0.0) / 2**30, "estimate_ms": estimated_ms(compiled.as_text())}


def estimated_ms(program, clock_hz=1.5e9):
    """The sum of the compiler's own cycle estimates of the program's kernels (``estimated_cycles``
    in each fusion's backend config) at the v5e's clock (197 TFLOP/s bfloat16 from 4 MXUs of 128 x
    128: 1.5 GHz). Overlap and conditionals are not in it; on the 110M step it read 138.7 ms where
    the chip took 113.1 (float), and mixle's w8a8 1.200x / Qwix's 1.061x where the chip gave 1.100x /
    0.988x: a ranking of variants, not a time."""
    return sum(int(c) for c in re.findall(r'"estimated_cycles":"(\d+)"', program)) / clock_hz * 1e3


def _on(device, tree):
    sharding = SingleDeviceSharding(device)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def _hlo_path(hlo_dir, *parts):
    return None if hlo_dir is None else Path(hlo_dir) / ("_".join(parts).replace(" ", "_") + ".hlo.txt")


def compile_step(size, name, device, hlo_dir=None):
    """``{"step": facts}`` of one variant's training step (``_compiled_facts``, or ``{"error"}``)."""
    ids = jnp.zeros((size.batch, size.seq + 1), jnp.int32)
    model = LM(size, nnx.Rngs(0))
    maker = training_variants()[name]
    if maker is not None:
        model = maker(model, ids[:1, :9])
    step, state = pure_step(model, nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param))
    abstract = _on(device, (state, ids))
    del model, state
    return {"step": _compiled_facts(step, abstract, _hlo_path(hlo_dir, name))}


def compile_serving(size, name, device, hlo_dir=None):
    """``{shape name: facts}`` of one serving variant's forward at ``serving_shapes``."""
    model = LM(size, nnx.Rngs(0))
    maker = serving_variants()[name]
    if maker is not None:
        model = maker(model)
    forward, state = pure_forward(model)
    abstract_state = _on(device, state)
    del model, state
    return {shape_name: _compiled_facts(forward, (abstract_state, _on(device, jnp.zeros(shape, jnp.int32))),
                                        _hlo_path(hlo_dir, name, shape_name))
            for shape_name, shape in serving_shapes(size).items()}


def group_products(kernel_in=2048, tokens=16, group=32):
    """One int4 group-wise kernel's 16-token product, written each way a converted model could
    dequantize it (``codes * scale`` in float32, rounded to bfloat16), beside the float32 kernel and
    per-channel codes: ``{(way, out): facts}`` for a 2048 x 8192 kernel and the 32,000-wide head."""
    f32, bf16, s4 = jnp.float32, jnp.bfloat16, jnp.int4
    k, g = kernel_in, kernel_in // group

    def ways(n):
        return {  # name -> (product, shapes and dtypes of the kernel's arrays)
            "float32 kernel": (lambda x, w: x @ w.astype(bf16), [((k, n), f32)]),
            "per channel, (out, in) codes": (lambda x, c, s: x @ (c.astype(f32) * s).astype(bf16).T,
                                             [((n, k), s4), ((n, 1), f32)]),
            "group view reshaped (convert)": (lambda x, c, s: x @ (c.astype(f32) * s).astype(bf16).reshape(k, n),
                                              [((g, group, n), s4), ((g, 1, n), f32)]),
            "kernel layout, scales repeated": (
                lambda x, c, s: x @ (c.astype(f32) * jnp.repeat(s, group, axis=0)).astype(bf16),
                [((k, n), s4), ((g, n), f32)]),
            "(out, in) codes, transposed": (
                lambda x, c, s: x @ (c.reshape(n, g, group).astype(f32) * s[..., None]).astype(bf16).reshape(n, k).T,
                [((n, k), s4), ((n, g), f32)]),
            "group view contracted": (
                lambda x, c, s: jnp.einsum("tgk,gkn->tn", x.reshape(tokens, g, group), (c.astype(f32) * s).astype(bf16)),
                [((g, group, n), s4), ((g, 1, n), f32)]),
        }

    device, rows = tpu_device(), {}
    for n in (8192, 32000):
        for name, (product, arrays) in ways(n).items():
            abstract = _on(device, (jnp.zeros((tokens, k), bf16), *(jnp.zeros(shape, dtype) for shape, dtype in arrays)))
            rows[name, n] = facts = _compiled_facts(jax.jit(product), abstract, None)
            print(f"  {name:32s} {k} x {n:<6d} estimate {facts['estimate_ms'] * 1e3:7.1f} us  "
                  f"HBM bytes {facts['hbm_gib'] * 1024:6.1f} MiB", flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--variants", nargs="+", help="variants of tpu_speed.py (default: all)")
    parser.add_argument("--serving", action="store_true", help="the serving forward passes instead of the step")
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--hlo", type=Path, help="write each optimized program here")
    parser.add_argument("--group-products", action="store_true",
                        help="one int4 group-32 kernel's product, per way of dequantizing it (group_products)")
    args = parser.parse_args(argv)
    if args.group_products:
        return group_products()
    variants, compile_one = (serving_variants(), compile_serving) if args.serving else (training_variants(), compile_step)
    try:
        names = chosen(args.variants, variants, "--variants")
    except ValueError as err:
        parser.error(str(err))
    if args.hlo:
        args.hlo.mkdir(parents=True, exist_ok=True)
    device = tpu_device(args.topology)
    size = SIZES[args.size]
    print(f"compiled for {device.device_kind} ({args.topology}) on {os.cpu_count()} host cores, jax {jax.__version__}; "
          f"{args.size}: {size.layers} x d{size.d_model}, mlp {size.d_ff}, seq {size.seq}, batch {size.batch}, "
          f"{parameters(size) / 1e6:.0f}M parameters; {'serving' if args.serving else 'training step'}")
    rows = {}
    for name in ["float bf16", *[n for n in names if n != "float bf16"]]:
        started = time.perf_counter()
        rows[name] = compile_one(size, name, device, args.hlo)
        for program, row in rows[name].items():
            label = f"{name} {program}" if args.serving else name
            if "error" in row:
                print(f"  {label:28s} {row['error']}", flush=True)
                continue
            base = rows["float bf16"][program]
            ratio = f"{row['hbm_gib'] / base['hbm_gib']:.3f}x" if base.get("hbm_gib") else "-"
            estimate = f"{row['estimate_ms'] / base['estimate_ms']:.3f}x" if base.get("estimate_ms") else "-"
            print(f"  {label:28s} temporaries {row['temp_gib']:6.2f} GiB  arguments {row['args_gib']:6.2f} GiB  "
                  f"HBM bytes {row['hbm_gib']:7.2f} GiB ({ratio})  estimate {row['estimate_ms']:7.2f} ms ({estimate})",
                  flush=True)
        print(f"    ({time.perf_counter() - started:.0f} s to build and compile)", flush=True)
    return rows


if __name__ == "__main__":
    main()
