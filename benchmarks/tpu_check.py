"""Flax on an accelerator (a TPU v5e here): the Flax tests, the codes and scales against numpy, the
bfloat16 lattice, and the step timing, in one command that prints every number.

    python benchmarks/tpu_check.py --out DIR [--skip-tests | --tests FILE... | --tests rest] [--skip-numerics]
        [--speed 110M 470M 470M-b4] [--variants NAME...] [--serving-variants NAME...] [--no-serving | --no-training] [--hlo] [--search] [--act-compile]
    bash benchmarks/tpu_run.sh --speed 110M 470M 470M-b4   # on the lent TPU machine (installs the wheels)

Writes ``DIR/tests.log`` and ``DIR/results.json`` and prints their tables (the step and serving
times come from ``benchmarks/tpu_speed.py``). Needs
jax, flax, qwix, optax (and torch for the tests that compare with it); runs on CPU too, where every
count of differences must be 0 as well.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
FLAX_TESTS = ["tests/test_qat_flax.py", "tests/test_flax_fake_quant.py", "tests/test_flax_convert.py"]
# ``--tests rest``: every other Flax test file (together with FLAX_TESTS, more than one call's 10 minutes)
OTHER_FLAX_TESTS = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*flax*.py")
                          if str(path.relative_to(ROOT)) not in FLAX_TESTS)


def run_tests(out, files=FLAX_TESTS):
    """The Flax test files in one pytest process (one program holds a TPU at a time)."""
    started = time.perf_counter()
    log = out / "tests.log"
    with log.open("w") as stream:  # streamed: a run cut short by a time limit still leaves its log
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra",
                               "--durations=15", *files], cwd=ROOT, stdout=stream, stderr=subprocess.STDOUT)
    summary = [line for line in log.read_text().splitlines() if " passed" in line or " failed" in line]
    print(f"flax tests ({time.perf_counter() - started:.0f} s): {summary[-1] if summary else 'no summary'}")
    return summary[-1] if summary else proc.returncode


def block_kernels(d_model=768, d_ff=3072, seed=0):
    """One transformer block's kernels in flax's (in, out) layout: 7.1M float32 weights at d 768."""
    rng = np.random.default_rng(seed)
    shapes = {"q": (d_model, d_model), "k": (d_model, d_model), "v": (d_model, d_model), "o": (d_model, d_model),
              "up": (d_model, d_ff), "down": (d_ff, d_model)}
    return {name: (rng.standard_normal(shape) * 0.02).astype(np.float32) for name, shape in shapes.items()}


def numerics_probe():
    """Codes and scales computed by XLA on the default device (jit, eager, grad) vs numpy's."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mixle.core.array_ops import array_ops
    from mixle.core.numerics import block_shape, quantize_blocks, quantize_dequantize_array
    from mixle.core.spec import QuantSpec
    from mixle.flax_backend.fake_quant import fake_quantize_weight
    from mixle.models.qat import apply_qat

    specs = {"int4 channel": QuantSpec(bits=4), "int4 g32": QuantSpec(bits=4, group_size=32),
             "int4 g128": QuantSpec(bits=4, group_size=128), "int8 channel": QuantSpec(bits=8),
             "int4 tensor": QuantSpec(bits=4, granularity="tensor"), "qwix int4": QuantSpec(bits=4, grid="qwix"),
             "qwix int8": QuantSpec(bits=8, grid="qwix"), "int4 p99.9": QuantSpec(bits=4, clip_percentile=99.9),
             "q4_0": QuantSpec(bits=4, grid="q4_0", group_size=32), "q8_0": QuantSpec(bits=8, grid="q8_0", group_size=32)}
    kernels = block_kernels()
    rows = {}

    def codes_scales(matrix, spec):
        blocks = matrix.reshape(block_shape(matrix.shape, spec))
        codes, scale, _ = quantize_blocks(array_ops(blocks), blocks, spec)
        return codes, scale

    for label, spec in specs.items():
        diff = {"codes": 0, "scales": 0, "values eager": 0, "values grad": 0, "weights": 0, "blocks": 0}
        jitted = jax.jit(lambda m, spec=spec: codes_scales(m, spec))
        fq = jax.jit(lambda k, spec=spec: fake_quantize_weight(k, (0,), spec))
        def loss(k, spec=spec):
            values = fake_quantize_weight(k, (0,), spec)
            return values.sum(), values

        grad_fq = jax.jit(jax.grad(loss, has_aux=True))  # the values as computed inside a training step
        for kernel in kernels.values():
            matrix = np.ascontiguousarray(kernel.T)  # (out, in): blocks along the input
            codes, scale = codes_scales(matrix, spec)
            got_codes, got_scale = (np.asarray(a) for a in jitted(jnp.asarray(matrix)))
            diff["codes"] += int((got_codes != codes).sum())
            diff["scales"] += int((got_scale.view(np.uint32) != scale.view(np.uint32)).sum())
            values = (codes * scale).reshape(matrix.shape).T
            diff["values eager"] += int((np.asarray(fake_quantize_weight(jnp.asarray(kernel), (0,), spec)) != values).sum())
            diff["values grad"] += int((np.asarray(grad_fq(jnp.asarray(kernel))[1]) != values).sum())
            assert np.array_equal(np.asarray(fq(jnp.asarray(kernel))), np.asarray(fq(jnp.asarray(kernel))))
            diff["weights"] += kernel.size
            diff["blocks"] += scale.size
        rows[label] = diff
        print(f"  {label:14s} codes {diff['codes']:>7,} / {diff['weights']:,}  scales {diff['scales']:>7,} / "
              f"{diff['blocks']:,}  eager {diff['values eager']:,}  grad {diff['values grad']:,}")

    # llama.cpp's other block types (offsets, sub-scales, searches): the round trip of each kernel
    blocks = {}
    for grid in ("q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"):
        spec = QuantSpec(grid=grid)
        jitted = jax.jit(lambda m, spec=spec: quantize_dequantize_array(m, spec))
        grad_fq = jax.jit(jax.grad(lambda k, spec=spec: (lambda v: (v.sum(), v))(fake_quantize_weight(k, (0,), spec)),
                                   has_aux=True))
        diff = {"jit": 0, "eager": 0, "grad": 0, "weights": 0}
        for kernel in kernels.values():
            matrix = np.ascontiguousarray(kernel.T)
            want = quantize_dequantize_array(matrix, spec)
            diff["jit"] += int((np.asarray(jitted(jnp.asarray(matrix))) != want).sum())
            diff["eager"] += int((np.asarray(fake_quantize_weight(jnp.asarray(kernel), (0,), spec)) != want.T).sum())
            diff["grad"] += int((np.asarray(grad_fq(jnp.asarray(kernel))[1]) != want.T).sum())
            diff["weights"] += kernel.size
        blocks[grid] = diff
        print(f"  {grid:14s} values jit {diff['jit']:,} eager {diff['eager']:,} grad {diff['grad']:,} of {diff['weights']:,}",
              flush=True)

    # bfloat16 compute, float32 master weights: the product sees numpy's fake-quant of the float32
    # kernel rounded once to bfloat16 (model(eye) is the kernel the product used).
    lattice = {}
    w = kernels["up"][:768, :768]
    for label in ("int8 channel", "int4 channel", "int4 g32"):
        class Bf16(nnx.Module):
            def __init__(self):
                self.fc = nnx.Linear(768, 768, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                                     rngs=nnx.Rngs(0))
                self.fc.kernel[...] = jnp.asarray(w)

            def __call__(self, x):
                return self.fc(x)

        eye = jnp.eye(768, dtype=jnp.float32)
        model = apply_qat(Bf16(), spec=specs[label], example_inputs=(eye,))
        used = np.asarray(nnx.jit(lambda m, x: m(x))(model, eye).astype(jnp.float32))
        codes, scale = codes_scales(np.ascontiguousarray(w.T), specs[label])
        stored = np.asarray(jnp.asarray((codes * scale).reshape(768, 768).T).astype(jnp.bfloat16).astype(jnp.float32))
        lattice[label] = int((used != stored).sum())
        print(f"  bf16 compute {label:14s}: {lattice[label]:,} of {w.size:,} trained values differ from "
              f"the float32 master's lattice")
    return {"grids": rows, "llama_cpp_blocks": blocks, "bf16_lattice": lattice}


def _mkdir(path):
    path.mkdir(parents=True, exist_ok=True)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "tpu_check_out")))
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--tests", nargs="+", default=FLAX_TESTS, help="test files (default: the Flax numerics' three; "
                        "'rest': every other Flax test file)")
    parser.add_argument("--skip-numerics", action="store_true")
    parser.add_argument("--speed", nargs="*", default=[], help="model sizes of tpu_speed.py to time")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", nargs="+", help="training variants of tpu_speed.py (default: all)")
    parser.add_argument("--serving-variants", nargs="+", help="serving variants of tpu_speed.py (default: all)")
    parser.add_argument("--no-serving", action="store_true")
    parser.add_argument("--no-training", action="store_true", help="with --speed: the serving passes only")
    parser.add_argument("--hlo", action="store_true", help="also write each step's HLO and XLA's memory estimate")
    parser.add_argument("--profile", action="store_true", help="also write a profiler trace of two steps per variant")
    parser.add_argument("--search", action="store_true",
                        help="time the jax finetune job's per-step q4_0 searches per way of summing (search_speed.py)")
    parser.add_argument("--act-compile", action="store_true",
                        help="time the compile of act_bits=8's product-input roundings (act_bits_compile.py)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    if not args.skip_tests:  # first: a TPU is held by one process, and this one takes it below
        results["tests"] = run_tests(args.out, OTHER_FLAX_TESTS if args.tests == ["rest"] else args.tests)
    import jax

    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"python {platform.python_version()}")
    results.update(device=device.device_kind, jax=jax.__version__)
    if args.speed:
        from tpu_speed import (SIZES, chosen, print_serving, print_training, serving_variants, time_serving,
                               time_training, training_variants)

        # named variants checked before any chip time is spent
        chosen(args.variants, training_variants(), "--variants")
        chosen(args.serving_variants, serving_variants(), "--serving-variants")

        for size in args.speed:
            if not args.no_training:
                results[f"training {size}"] = time_training(
                    SIZES[size], args.rounds, 8, args.variants, hlo_dir=_mkdir(args.out / f"hlo-{size}") if args.hlo else None,
                    profile_dir=args.out / f"profile-{size}" if args.profile else None)
                print_training(size, results[f"training {size}"])
                (args.out / "results.json").write_text(json.dumps(results, indent=1))
            if not size.endswith("-b4") and not args.no_serving:
                results[f"serving {size}"] = time_serving(SIZES[size], args.rounds, 8, args.serving_variants)
                print_serving(size, results[f"serving {size}"])
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
    if args.search:
        from search_speed import print_search, time_search

        results["search"] = time_search(args.rounds)
        print_search(results["search"], 30, args.rounds)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    if args.act_compile:
        from act_bits_compile import print_compiles, time_compiles

        results["act compile"] = time_compiles(args.rounds)
        print_compiles(results["act compile"], 30, args.rounds)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    if not args.skip_numerics:  # after the timings: its compiles of every grid take a while
        results["numerics"] = numerics_probe()
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
