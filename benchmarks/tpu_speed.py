"""Training-step and serving times of a decoder-only NNX LM in bfloat16, mixle's QAT beside Qwix's.

The model: RMSNorm, causal attention, GELU MLP, untied head, float32 master weights computing in
bfloat16, AdamW, one ``nnx.jit`` step with the model and optimizer donated. A variant's step is
timed as ``--pipeline`` steps dispatched back to back and blocked once; variants run one
after another, each alone on the chip (float first and last), and the table gives each one's median
and its ratio to the float step's median.

Serving: forward only, ``nnx.jit``, float (float32 parameters computing in bfloat16) against
``mixle.convert`` of QAT models and Qwix's PTQ models of the same bits.

    python benchmarks/tpu_speed.py --size 110M          # on the TPU (tpu_check.py runs it)
    python benchmarks/tpu_speed.py --size tiny --rounds 2   # a smoke run on CPU
"""

import argparse
import gzip
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

warnings.simplefilter("ignore", DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass(frozen=True)
class Size:
    layers: int
    d_model: int
    d_ff: int
    heads: int
    seq: int
    batch: int
    vocab: int = 32000
    # Recompute each block's activations in the backward (nnx.remat): "all", or "kernels" (keep mixle's
    # quantized kernels: jax.checkpoint_policies.save_only_these_names(QUANTIZED_KERNEL)); None: no remat.
    remat: str | None = None


SIZES = {"110M": Size(12, 768, 3072, 12, 1024, 8), "470M": Size(8, 2048, 8192, 16, 2048, 2),
         "470M-b3": Size(8, 2048, 8192, 16, 2048, 3), "470M-b4": Size(8, 2048, 8192, 16, 2048, 4),
         "470M-b4-remat": Size(8, 2048, 8192, 16, 2048, 4, remat="all"),
         "470M-b4-remat-kernels": Size(8, 2048, 8192, 16, 2048, 4, remat="kernels"),
         "tiny": Size(2, 64, 256, 4, 32, 2, vocab=256)}
# The matmul layers QAT applies to (attention's QK and PV products stay bfloat16, as in Qwix's recipes).
LINEAR = r".*(qkv|out|up|down|head)"


class Block(nnx.Module):
    def __init__(self, size, rngs):
        kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32, use_bias=False, rngs=rngs)
        self.heads = size.heads
        self.norm1 = nnx.RMSNorm(size.d_model, dtype=jnp.bfloat16, rngs=rngs)
        self.qkv = nnx.Linear(size.d_model, 3 * size.d_model, **kw)
        self.out = nnx.Linear(size.d_model, size.d_model, **kw)
        self.norm2 = nnx.RMSNorm(size.d_model, dtype=jnp.bfloat16, rngs=rngs)
        self.up = nnx.Linear(size.d_model, size.d_ff, **kw)
        self.down = nnx.Linear(size.d_ff, size.d_model, **kw)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(b, t, 3 * self.heads, d // self.heads), 3, axis=2)
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attn.reshape(b, t, d))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class LM(nnx.Module):
    def __init__(self, size, rngs):
        self.embed = nnx.Embed(size.vocab, size.d_model, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
        self.blocks = nnx.List([Block(size, rngs) for _ in range(size.layers)])
        self.norm = nnx.RMSNorm(size.d_model, dtype=jnp.bfloat16, rngs=rngs)
        self.head = nnx.Linear(size.d_model, size.vocab, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                               use_bias=False, rngs=rngs)
        self.remat = size.remat

    def __call__(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            if self.remat is None:
                x = block(x)
            else:
                x = nnx.remat(lambda block, x: block(x), policy=remat_policy(self.remat))(block, x)
        return self.head(self.norm(x))


def remat_policy(remat):
    """``nnx.remat``'s policy for ``Size.remat``: None (recompute everything) or one keeping mixle's
    quantized kernels (``mixle.flax_backend.fake_quant.QUANTIZED_KERNEL``)."""
    from mixle.flax_backend.fake_quant import QUANTIZED_KERNEL

    return {"all": None, "kernels": jax.checkpoint_policies.save_only_these_names(QUANTIZED_KERNEL)}[remat]


def parameters(size):
    per_block = 4 * size.d_model**2 + 2 * size.d_model * size.d_ff
    return size.layers * per_block + 2 * size.vocab * size.d_model


def training_variants():
    """name -> function(model, ids) giving the model to train (None: float)."""
    import qwix

    from mixle.api import apply_qat

    def mixle_qat(**fields):
        return lambda model, ids: apply_qat(model, patterns=(LINEAR,), example_inputs=(ids,), **fields)

    def qwix_qat(**fields):
        def make(model, ids):
            rule = qwix.QtRule(module_path=LINEAR, **fields)
            return qwix.quantize_model(model, qwix.QtProvider([rule]), ids)
        return make

    return {
        "float bf16": None,
        "mixle int8": mixle_qat(bits=8),
        "mixle int4 channel": mixle_qat(bits=4),
        "mixle int4 g32": mixle_qat(bits=4, group_size=32),
        "mixle int4 g128": mixle_qat(bits=4, group_size=128),
        "mixle w8a8": mixle_qat(bits=8, act_bits=8),
        "mixle w8a8 bwd int8": mixle_qat(bits=8, act_bits=8, bwd_bits=8),
        "qwix w8a8": qwix_qat(weight_qtype="int8", act_qtype="int8"),
        "qwix w8a8 bwd int8": qwix_qat(weight_qtype="int8", act_qtype="int8", bwd_qtype="int8"),
        "qwix int4": qwix_qat(weight_qtype="int4"),
    }


def train_step(model, optimizer, ids):
    def loss_fn(m):
        logits = m(ids[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _timed(run, rounds, pipeline):
    """Seconds per call of ``run`` (returns an array), ``rounds`` medians of ``pipeline`` back-to-back calls."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(pipeline):
            out = run()
        out.block_until_ready()
        times.append((time.perf_counter() - start) / pipeline)
    return times


def chosen(names, makers, option):
    """``names`` (all of ``makers`` when None), each one checked to be a variant."""
    unknown = sorted(set(names or ()) - set(makers))
    if unknown:
        raise ValueError(f"{option}: no variant named {unknown}; the variants are {list(makers)}")
    return list(names or makers)


def error_text(err):
    return f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"


def _summary(times, float_times):
    """Median time and its ratio to the float variant's median (float timed first and last)."""
    base = statistics.median(float_times)
    return {"ms": 1e3 * statistics.median(times), "ratio": statistics.median(times) / base,
            "ratio_range": [min(times) / base, max(times) / base]}


def pure_step(model, optimizer):
    """``(step, state)``: ``train_step`` as a jitted function of the split ``(model, optimizer)``
    state and the token ids, the state donated as the timed step donates it."""
    graphdef, state = nnx.split((model, optimizer))

    def pure(state, ids):
        m, o = nnx.merge(graphdef, state)
        loss = train_step(m, o, ids)
        return loss, nnx.state((m, o))

    return jax.jit(pure, donate_argnums=0), state


def compiled_step(model, optimizer, ids, hlo_path=None):
    """XLA's memory estimate of one training step (GiB of temporaries and arguments), and its
    optimized HLO written gzipped to ``hlo_path`` (where the step's time goes, read off the chip)."""
    step, state = pure_step(model, optimizer)
    compiled = step.lower(state, ids).compile()
    if hlo_path is not None:
        with gzip.open(hlo_path, "wt") as stream:
            stream.write(compiled.as_text())
    memory = compiled.memory_analysis()
    return {"temp_gib": memory.temp_size_in_bytes / 2**30, "args_gib": memory.argument_size_in_bytes / 2**30}


def time_training(size, rounds, pipeline, names=None, hlo_dir=None, profile_dir=None):
    """``{variant: {"ms", "ratio", "ratio_range"} or {"error"}}``, one variant on the chip at a time.

    A 470M model with AdamW holds ~5.6 GB, so variants cannot stay resident side by side: each is
    built, compiled, timed and freed in turn, float first and last, in one process. With
    ``profile_dir``, a profiler trace of two more steps of each variant is written to
    ``profile_dir/variant`` (``xprof``'s ``hlo_stats`` tool reads each fusion's time off it).
    """
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, size.vocab, (size.batch, size.seq + 1)), jnp.int32)
    makers = training_variants()
    names = chosen(names, makers, "--variants")
    times, memory = {}, {}
    for name in ["float bf16", *[n for n in names if n != "float bf16"], "float bf16"]:
        model = LM(size, nnx.Rngs(0))
        try:
            if makers[name] is not None:
                model = makers[name](model, ids[:, :-1])
            optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
            step = nnx.jit(train_step, donate_argnums=(0, 1))
            step(model, optimizer, ids).block_until_ready()  # compile
            times.setdefault(name, []).extend(_timed(lambda: step(model, optimizer, ids), rounds, pipeline))
            trace = None if profile_dir is None else Path(profile_dir) / name.replace(" ", "_")
            if trace is not None and not trace.exists():  # float: its first run only
                with jax.profiler.trace(str(trace)):
                    _timed(lambda: step(model, optimizer, ids), 1, 2)
        except Exception as err:  # e.g. RESOURCE_EXHAUSTED: reported, the others still run
            times[name] = error_text(err)
        if hlo_dir is not None and not isinstance(times[name], str):
            try:  # the estimate compiles the step once more: its failure leaves the timing standing
                memory[name] = compiled_step(model, optimizer, ids, Path(hlo_dir) / f"{name.replace(' ', '_')}.hlo.txt.gz")
            except Exception as err:
                memory[name] = {"hlo_error": error_text(err)}
        print(f"    {name}: {times[name] if isinstance(times[name], str) else f'{1e3 * statistics.median(times[name]):.2f} ms'}",
              flush=True)
        del model
        optimizer = step = None
    return {name: {"error": t} if isinstance(t, str) else {**_summary(t, times["float bf16"]), **memory.get(name, {})}
            for name, t in times.items()}


def serving_variants():
    """name -> function(model) giving the model to serve (None: float)."""
    import qwix

    from mixle.api import apply_qat, convert

    example = jnp.zeros((1, 8), jnp.int32)

    def converted(**fields):
        return lambda model: convert(apply_qat(model, patterns=(LINEAR,), example_inputs=(example,), **fields))

    def ptq(**fields):
        rule = qwix.QuantizationRule(module_path=LINEAR, **fields)
        return lambda model: qwix.quantize_model(model, qwix.PtqProvider([rule]), example)

    return {"float bf16": None, "mixle int8": converted(bits=8), "mixle int4 channel": converted(bits=4),
            "mixle int4 g32": converted(bits=4, group_size=32), "mixle int4 g128": converted(bits=4, group_size=128),
            "mixle w8a8": converted(bits=8, act_bits=8),
            "mixle int4 g32 view": lambda model: contracting_group_views(converted(bits=4, group_size=32)(model)),
            "qwix ptq int8": ptq(weight_qtype="int8"), "qwix ptq w8a8": ptq(weight_qtype="int8", act_qtype="int8")}


def contracting_group_views(model):
    """An experiment on a converted model: every Linear with group-wise codes multiplies its input by
    the group view (``group_view.group_view_dot``), as ``convert`` does for groups of 128 and for
    vocabulary-wide kernels only; for the layers' groups of 32 XLA re-lays out the view first
    (timed, to show why)."""
    from mixle.flax_backend.convert import QuantizedKernel
    from mixle.flax_backend.group_view import group_view_class

    for _, module in nnx.iter_modules(model):
        kernel = vars(module).get("kernel")
        if isinstance(module, nnx.Linear) and isinstance(kernel, QuantizedKernel) and kernel.get_raw_value().view:
            group_size = kernel.get_raw_value().spec.group_size
            object.__setattr__(module, "__class__", group_view_class(type(module), group_size))
    return model


def serving_shapes(size):
    """The forward's token shapes: 16 sequences of 1 token, one sequence of ``size.seq``."""
    return {"16x1": (16, 1), f"1x{size.seq}": (1, size.seq)}


def pure_forward(model):
    """``(forward, state)``: the model's call as a jitted function of its split state and the ids.

    Served this way, a call costs one dispatch; ``nnx.jit`` walks the module graph in Python at
    every call (about 4 ms for this LM on a 2-core host), which at 16 x 1 tokens outlasts the
    chip's work and would be what a benchmark times.
    """
    graphdef, state = nnx.split(model)
    return jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids)), state


def time_serving(size, rounds, calls, names=None):
    """Forward-only times at 16 x 1 and 1 x seq tokens, converted and PTQ models beside float (one at a time;
    ``names``: the serving variants to time, float always)."""
    shapes = serving_shapes(size)
    makers = serving_variants()
    times = {}
    for name in ["float bf16", *[n for n in chosen(names, makers, "--serving-variants") if n != "float bf16"]]:
        make = makers[name]
        model = LM(size, nnx.Rngs(0))
        try:
            forward, state = pure_forward(make(model) if make is not None else model)
            for shape_name, shape in shapes.items():
                ids = jnp.zeros(shape, jnp.int32)
                try:
                    forward(state, ids).block_until_ready()
                    times.setdefault(name, {})[shape_name] = _timed(lambda: forward(state, ids), rounds, calls)
                except Exception as err:
                    times.setdefault(name, {})[shape_name] = error_text(err)
        except Exception as err:
            times[name] = {shape_name: error_text(err) for shape_name in shapes}
        model = state = None
    results = {}
    for name, per_shape in times.items():
        for shape_name, t in per_shape.items():
            results.setdefault(name, {})[shape_name] = (
                {"error": t} if isinstance(t, str) else _summary(t, times["float bf16"][shape_name]))
    return results


def print_training(size_name, results):
    size = SIZES[size_name]
    print(f"training step, {size_name}: {size.layers} x d{size.d_model}, mlp {size.d_ff}, seq {size.seq}, "
          f"batch {size.batch}, {parameters(size) / 1e6:.0f}M parameters, bf16 compute, fp32 master, AdamW")
    for name, row in results.items():
        if "error" in row:
            print(f"  {name:22s} {row['error']}")
        else:
            lo, hi = row["ratio_range"]
            memory = f"  temporaries {row['temp_gib']:.2f} GiB" if "temp_gib" in row else ""
            print(f"  {name:22s} {row['ms']:8.2f} ms  {row['ratio']:.3f}x  (rounds {lo:.3f}-{hi:.3f}){memory}")


def print_serving(size_name, results):
    print(f"serving (forward only), {size_name}")
    for name, shapes in results.items():
        cells = [f"{shape}: " + (v["error"] if "error" in v else f"{v['ms']:.2f} ms {v['ratio']:.3f}x")
                 for shape, v in shapes.items()]
        print(f"  {name:22s} " + "   ".join(cells))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pipeline", type=int, default=8)
    parser.add_argument("--no-serving", action="store_true")
    parser.add_argument("--hlo", type=Path, help="write each variant's optimized step HLO and memory estimate here")
    parser.add_argument("--profile", type=Path, help="write a profiler trace of two steps per variant here")
    args = parser.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    if args.hlo:
        args.hlo.mkdir(parents=True, exist_ok=True)
    out = {"training": time_training(SIZES[args.size], args.rounds, args.pipeline, hlo_dir=args.hlo,
                                         profile_dir=args.profile)}
    print_training(args.size, out["training"])
    if not args.no_serving:
        out["serving"] = time_serving(SIZES[args.size], args.rounds, args.pipeline)
        print_serving(args.size, out["serving"])
    return out


if __name__ == "__main__":
    main()
