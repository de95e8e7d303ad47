"""Training-step time and peak memory of mixle QAT against fp32, torchao QAT and Brevitas.

Every variant trains a copy of the same model on the same batch (SGD, full step: forward,
backward, optimizer). Steps of all variants are interleaved round by round in one process, so
machine load hits them alike; the table shows the median step after warm-up and its ratio to
fp32. Peak memory is a separate pass per variant: the highest total of live torch CPU
allocations (torch.profiler memory events, every tensor counted: parameters, gradients,
activations, caches, temporaries) from building the model through its third training step.

Shapes: ``mlp`` is 4 Linear layers 512->2048->512->2048->512 with GELU, batch 256, MSE loss;
``transformer`` is ``mixle.models.transformer.build_causal_lm(vocab=256)`` with its defaults
(d_model 128, 3 layers, 4 heads, block 64; head tied to the embedding), batch 32 of 65 tokens,
next-token cross-entropy; ``smollm2`` is SmolLM2-135M (transformers Llama: hidden 576,
intermediate 1536, 9 heads, 3 KV heads, vocab 49152, tied head), the real checkpoint with
``--smollm2-gguf`` or else ``--smollm2-layers`` randomly initialised layers of its shapes,
batch 4 of 128 tokens, the model's own next-token loss.

llama.cpp's grids: rows ``mixle q4_0`` ... ``mixle q6_k`` (each on its fused kernel,
``mixle.torch_backend.fused_ggml``; ``q4_0 torch ops`` without it) and ``mixle mix Q4_K_M`` /
``Q6_K`` (``apply_qat(gguf_mix=...)``: each layer on the block type llama-quantize gives it, rows
of 128 falling back to Q5_0 / Q8_0). A row a shape refuses (q4_k on rows of 128, a mix on a model
with no llama.cpp architecture) is shown as not applicable. Rows ``mixle q4_0 imatrix`` ...
(``apply_qat(importance=)``, a fixed seeded importance per untied linear layer): ggml's
importance-weighted search in every training forward, on the fused kernels (``... imatrix torch
ops``: without them, the torch numerics). Under each table the step-time
ratios the issues set targets for (``PAIRS``).

``--dtypes fp32,bf16`` also runs every variant under ``torch.autocast("cpu", torch.bfloat16)``
(rows ``... +bf16``); ``bf16model`` runs it on the model cast to bfloat16 before QAT is applied
(bf16 weights, inputs and gradients; rows ``... bf16 model``). Each row's ratio is to the float
step in the same dtype, measured in the same interleaved rounds.

Usage::

    python benchmarks/overhead.py                       # both shapes, 2 threads, 30 steps
    python benchmarks/overhead.py --shapes mlp --steps 40 --threads 2 --plot overhead.png
    python benchmarks/overhead.py --no-compile --no-memory --only "fp32|int4 channel"
    python benchmarks/overhead.py --shapes smollm2 --dtypes fp32,bf16 --steps 10 --warmup 2 \
        --no-memory --no-compile --only "int4 group32$|q4_0$|q8_0$|qwix|8da4w group32$"
"""

import argparse
import copy
import contextlib
import io
import os
import re
import statistics
import sys
import textwrap
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mixle.torch_backend.kernels import fused_cpu as _fused_cpu  # noqa: E402
from mixle.models.qat import apply_qat  # noqa: E402
from mixle.core.spec import QuantSpec  # noqa: E402

PERCENTILE = 99.9


# ---------------------------------------------------------------------------------- shapes


@dataclass
class Shape:
    name: str
    description: str
    build: object  # () -> nn.Module (fp32, seeded)
    batch: object  # () -> (inputs, targets)
    loss: object  # (model, inputs, targets) -> scalar loss


def _mlp():
    torch.manual_seed(0)
    sizes = [512, 2048, 512, 2048, 512]
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


def _mlp_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(256, 512, generator=g), torch.randn(256, 512, generator=g)


def _lm():
    from mixle.models.transformer import build_causal_lm

    torch.manual_seed(0)
    return build_causal_lm(vocab=256)


def _lm_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (32, 65), generator=g), None


def _lm_loss(model, tokens, _):
    logits = model(tokens[:, :-1], all_positions=True)
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


SMOLLM2 = {"gguf": None, "layers": 4}  # set from the command line


def _smollm2():
    import transformers

    torch.manual_seed(0)
    if SMOLLM2["gguf"]:
        path = Path(SMOLLM2["gguf"])
        return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                 dtype=torch.float32)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                      num_hidden_layers=SMOLLM2["layers"], num_attention_heads=9,
                                      num_key_value_heads=3, tie_word_embeddings=True, max_position_embeddings=2048)
    return transformers.AutoModelForCausalLM.from_config(config)


def _smollm2_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 49152, (4, 128), generator=g), None


SHAPES = {
    "mlp": Shape("mlp", "MLP 512->2048->512->2048->512 (GELU), batch 256, MSE", _mlp, _mlp_batch,
                 lambda model, x, y: F.mse_loss(model(x), y)),
    "transformer": Shape("transformer", "build_causal_lm(vocab=256): d_model 128, 3 layers, 4 heads, "
                         "tied head; batch 32 x 64 tokens, cross-entropy", _lm, _lm_batch, _lm_loss),
    "smollm2": Shape("smollm2", "SmolLM2-135M shapes (hidden 576, intermediate 1536, vocab 49152, tied); "
                     "batch 4 x 128 tokens", _smollm2, _smollm2_batch,
                     lambda model, tokens, _: model(input_ids=tokens, labels=tokens).loss),
}


# -------------------------------------------------------------------------------- variants


@dataclass
class Variant:
    name: str
    prepare: object  # fp32 model -> model to train (may be compiled)
    compiled: bool = False
    torch_ops: bool = False  # mixle's fused CPU kernels switched off: its numerics as torch ops
    autocast: bool = False  # the step under torch.autocast("cpu", dtype=torch.bfloat16)
    bf16_model: bool = False  # the model (and its float inputs) cast to bfloat16 before prepare

    @property
    def baseline(self):
        """The float row this row's ratio is taken to (same dtype)."""
        return "fp32 +bf16" if self.autocast else "fp32 bf16 model" if self.bf16_model else "fp32"


def _mixle(bits, granularity, group_size=None, percentile=None):
    spec = QuantSpec(bits=bits, granularity=granularity, group_size=group_size, clip_percentile=percentile)
    return lambda model: apply_qat(model, spec=spec)


def _mixle_grid(**fields):
    """A mixle spec by its fields (the other grids: qwix, llama.cpp's q4_0 and q8_0)."""
    spec = QuantSpec(**fields)
    return lambda model: apply_qat(model, spec=spec)


def _mixle_mix(mix):
    """A llama.cpp mix (``apply_qat(gguf_mix=...)``): rows the K-quants' 256 do not divide fall
    back as llama-quantize does (Q4_K -> Q5_0, Q6_K -> Q8_0)."""
    from mixle.api import apply_qat as api_apply_qat

    return lambda model: api_apply_qat(model, gguf_mix=mix)


def _mixle_imatrix(**fields):
    """A llama.cpp grid with an importance matrix: ``apply_qat(importance=)`` with a seeded importance
    per linear layer (not those tied to an embedding, which llama.cpp quantizes without one)."""
    from mixle.api import apply_qat as api_apply_qat

    spec = QuantSpec(**fields)

    def prepare(model):
        g = torch.Generator().manual_seed(2)
        tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        values = {path: torch.rand(m.in_features, generator=g).square().numpy() for path, m in model.named_modules()
                  if isinstance(m, nn.Linear) and id(m.weight) not in tied}
        return api_apply_qat(model, spec=spec, importance=values)

    return prepare


def _torchao(granularity):
    def prepare(model):
        with _quiet():
            from torchao.quantization import quantize_
            from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig
        if granularity == "group":
            weight = IntxFakeQuantizeConfig(torch.int4, group_size=32, is_symmetric=True)
        else:
            weight = IntxFakeQuantizeConfig(torch.int4, granularity="per_channel", is_symmetric=True)
        with _quiet():
            quantize_(model, QATConfig(weight_config=weight, step="prepare"))
        return model

    return prepare


def _mixle_learned(granularity, group_size=None):
    """int4 weights with learned scales (QuantSpec(scale="learned"), mixle.torch_backend.layers.learned_scale)."""
    spec = QuantSpec(bits=4, granularity=granularity, group_size=group_size, scale="learned")
    return lambda model: apply_qat(model, spec=spec)


def _mixle_8da4w(symmetric=False, group_size=32):
    """int8 dynamic per-token activations (asymmetric like torchao's 8da4w, or symmetric) + int4 group weights."""
    spec = QuantSpec(bits=4, group_size=group_size, act_bits=8, act_symmetric=symmetric)
    return lambda model: apply_qat(model, spec=spec)


def _torchao_8da4w(group_size=32):
    """torchao 0.18's 8da4w QAT: int8 asymmetric per-token activations, int4 symmetric group weights."""
    def prepare(model):
        with _quiet():
            from torchao.quantization import quantize_
            from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig
        act = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
        weight = IntxFakeQuantizeConfig(torch.int4, group_size=group_size, is_symmetric=True)
        with _quiet():
            quantize_(model, QATConfig(activation_config=act, weight_config=weight, step="prepare"))
        return model

    return prepare


def _brevitas(per_channel):
    def prepare(model):
        with _quiet():
            import brevitas.nn as qnn
            from brevitas.quant import Int8WeightPerChannelFloat, Int8WeightPerTensorFloat
        quant = Int8WeightPerChannelFloat if per_channel else Int8WeightPerTensorFloat
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    layer = qnn.QuantLinear(child.in_features, child.out_features, bias=child.bias is not None,
                                            weight_quant=quant, weight_bit_width=4)
                    layer.weight = child.weight  # shared Parameter: a tied head stays tied
                    layer.bias = child.bias
                    setattr(parent, name, layer)
        return model

    return prepare


def _compiled(prepare):
    return lambda model: torch.compile(prepare(model), fullgraph=True)


def _installed(module):
    with _quiet():
        try:
            __import__(module)
        except Exception:  # noqa: BLE001 - any import failure means the peer is unavailable
            return False
    return True


DTYPE_SUFFIXES = (" +bf16", " bf16 model")  # row-name suffixes of the autocast and bf16-model rows


def variants(compile_rows, dtypes=("fp32",)):
    rows = _fp32_variants(compile_rows)
    out = rows if "fp32" in dtypes else []
    if "bf16" in dtypes:
        out = out + [Variant(f"{row.name} +bf16", row.prepare, row.compiled, row.torch_ops, autocast=True)
                     for row in rows]
    if "bf16model" in dtypes:
        out = out + [Variant(f"{row.name} bf16 model", row.prepare, row.compiled, row.torch_ops, bf16_model=True)
                     for row in rows]
    return out


def _base_name(name):
    for suffix in DTYPE_SUFFIXES:
        name = name.removesuffix(suffix)
    return name


def _fp32_variants(compile_rows):
    rows = [Variant("fp32", lambda model: model)]
    for bits in (4, 8):
        for granularity, group_size, label in (("tensor", None, "tensor"), ("channel", None, "channel"),
                                               ("group", 32, "group32")):
            for percentile in (None, PERCENTILE):
                suffix = f" p{PERCENTILE:g}" if percentile else ""
                rows.append(Variant(f"mixle int{bits} {label}{suffix}", _mixle(bits, granularity, group_size, percentile)))
    for percentile in (None, PERCENTILE):
        suffix = f" p{PERCENTILE:g}" if percentile else ""
        rows.append(Variant(f"mixle int4 channel{suffix} torch ops", _mixle(4, "channel", None, percentile),
                            torch_ops=True))
    if _installed("torchao"):
        rows.append(Variant("torchao int4 group32", _torchao("group")))
        rows.append(Variant("torchao int4 channel", _torchao("channel")))
    rows.append(Variant("mixle qwix int4 group32", _mixle_grid(bits=4, group_size=32, grid="qwix")))
    rows.append(Variant("mixle q4_0", _mixle_grid(bits=4, grid="q4_0")))
    rows.append(Variant("mixle q8_0", _mixle_grid(bits=8, grid="q8_0")))
    rows.append(Variant("mixle q4_0 a8", _mixle_grid(bits=4, grid="q4_0", act_bits=8)))
    for grid in ("q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "mxfp4", "nf4"):  # the other block types
        rows.append(Variant(f"mixle {grid}", _mixle_grid(grid=grid)))
    rows.append(Variant("mixle q4_0 torch ops", _mixle_grid(bits=4, grid="q4_0"), torch_ops=True))
    for grid in ("q4_0", "q4_k", "q6_k"):  # with an importance matrix: the weighted search in every forward
        rows.append(Variant(f"mixle {grid} imatrix", _mixle_imatrix(grid=grid)))
    rows.append(Variant("mixle q4_k imatrix torch ops", _mixle_imatrix(grid="q4_k"), torch_ops=True))
    for mix in ("Q4_K_M", "Q6_K"):  # each layer on the block type llama.cpp's quantizer gives it
        rows.append(Variant(f"mixle mix {mix}", _mixle_mix(mix)))
    rows.append(Variant("mixle int4 channel learned", _mixle_learned("channel")))
    rows.append(Variant("mixle int4 group32 learned", _mixle_learned("group", 32)))
    rows.append(Variant("mixle 8da4w group32", _mixle_8da4w()))
    rows.append(Variant("mixle 8da4w group32 a8 symmetric", _mixle_8da4w(symmetric=True)))
    if _installed("torchao"):
        rows.append(Variant("torchao 8da4w group32", _torchao_8da4w()))
    if _installed("brevitas"):
        rows.append(Variant("brevitas int4 tensor", _brevitas(per_channel=False)))
        rows.append(Variant("brevitas int4 channel", _brevitas(per_channel=True)))
    if compile_rows:
        rows.append(Variant("fp32 compiled", _compiled(lambda model: model), compiled=True))
        rows.append(Variant("mixle int4 channel compiled", _compiled(_mixle(4, "channel")), compiled=True))
        rows.append(Variant("mixle int4 group32 compiled", _compiled(_mixle(4, "group", 32)), compiled=True))
        rows.append(Variant("mixle 8da4w group32 compiled", _compiled(_mixle_8da4w()), compiled=True))
    return rows


@contextlib.contextmanager
def _quiet():
    """Silence the peers' import-time chatter (torchao's CUDA-extension notices)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


# ---------------------------------------------------------------------------------- timing


def _trainer(shape, variant, base, data):
    inputs, targets = data
    base = copy.deepcopy(base)
    if variant.bf16_model:
        base = base.bfloat16()
        inputs, targets = (t.bfloat16() if t is not None and t.is_floating_point() else t for t in (inputs, targets))
    model = variant.prepare(base)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        with _fused_cpu.switched_off() if variant.torch_ops else contextlib.nullcontext():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant.autocast):
                loss = shape.loss(model, inputs, targets)
            loss.backward()
            optimizer.step()

    return step


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def time_steps(shape, rows, steps, warmup, clock="wall"):
    """Median seconds per step of each variant, steps interleaved round by round; ``clock="cpu"``
    counts this process's CPU time (with 1 thread: immune to other processes taking the cores)."""
    now = CLOCKS[clock]
    from tqdm import tqdm

    base, data = shape.build(), shape.batch()
    trainers = []
    with _quiet():
        for row in rows:
            try:
                trainers.append(_trainer(shape, row, base, data))
            except ValueError as error:  # e.g. q4_k on rows of 128: refused, as apply_qat says
                trainers.append(None)
                print(f"{shape.name}: {row.name} skipped: {str(error)[:160]}", file=sys.stderr)
    times = [[] for _ in rows]
    for r in tqdm(range(warmup + steps), desc=f"{shape.name}: rounds", file=sys.stderr):
        order = [i for i in range(len(rows)) if trainers[i] is not None]
        order = order[r % len(order):] + order[: r % len(order)]  # rotate who goes first
        for i in order:
            start = now()
            trainers[i]()
            elapsed = now() - start
            if r >= warmup:
                times[i].append(elapsed)
    return [(statistics.median(t), min(t)) if t else None for t in times]


# ---------------------------------------------------------------------------------- memory


def peak_memory(shape, variant, steps=3):
    """Peak bytes of live torch CPU allocations from building the model through ``steps`` steps."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # nothing from earlier variants may be freed (a negative event) while profiling
    with _quiet(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step = _trainer(shape, variant, shape.build(), shape.batch())
        for _ in range(steps):
            step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


# ---------------------------------------------------------------------------------- report


def report(shape, rows, timing, memory):
    """Median step time and its ratio to the float step in the same dtype (the measure); the
    fastest step as a load check."""
    by_name = dict(zip((row.name for row in rows), timing))
    lines = [f"\n== {shape.name}: {shape.description}",
             f"{'variant':<40} {'median ms':>9} {'x float':>7} {'min ms':>8} {'x float':>7} "
             f"{'peak MB':>8} {'x float':>7}  note"]
    for row, timed in zip(rows, timing):
        if timed is None:
            lines.append(f"{row.name:<40} {'-':>9} {'-':>7} {'-':>8} {'-':>7}  not applicable to this shape")
            continue
        median, fastest = timed
        base_median, base_min = by_name.get(row.baseline, (median, fastest))
        mem, base_mem = memory.get(row.name), memory.get(row.baseline)
        mem_cols = f"{mem / 2**20:>8.1f} {mem / base_mem:>7.3f}" if mem and base_mem else f"{'-':>8} {'-':>7}"
        compiled_float = by_name.get(row.baseline.replace("fp32", "fp32 compiled", 1))
        note = ""
        if row.compiled and compiled_float and not row.name.startswith("fp32 compiled"):
            note = f"{median / compiled_float[0]:.3f}x float compiled"
        lines.append(f"{row.name:<40} {median * 1e3:>9.2f} {median / base_median:>7.3f} {fastest * 1e3:>8.2f} "
                     f"{fastest / base_min:>7.3f} {mem_cols}  {note}")
    print("\n".join(lines + _pair_ratios(by_name)), flush=True)


# Step-time ratios the issues set targets for (llama.cpp's grids), printed where both rows ran.
PAIRS = (("mixle q4_0", "fp32"), ("mixle q8_0", "fp32"), ("mixle int4 group32", "fp32"),
         ("torchao int4 group32", "fp32"), ("mixle q4_k", "fp32"), ("mixle q4_k", "mixle q4_0"),
         ("mixle mix Q4_K_M", "fp32"), ("mixle mix Q4_K_M", "mixle q4_0"), ("mixle q6_k", "fp32"),
         ("mixle q4_0 imatrix", "mixle q4_0"), ("mixle q4_k imatrix", "mixle q4_k"), ("mixle q6_k imatrix", "mixle q6_k"),
         ("mixle q4_k imatrix", "fp32"))


def _pair_ratios(by_name):
    lines = []
    for dtype in ("",) + DTYPE_SUFFIXES:
        for a, b in PAIRS:
            a, b = a + dtype, b + dtype
            if by_name.get(a) and by_name.get(b):
                lines.append(f"  {a} / {b}: {by_name[a][0] / by_name[b][0]:.3f} (median step)")
    return lines


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 7), squeeze=False)
    for ax, (shape, rows, timing) in zip(axes[0], results):
        names = [row.name for row in rows][::-1]
        ratios = [t[0] / timing[0][0] if t else 0.0 for t in timing][::-1]
        colors = ["tab:blue" if n.startswith("mixle") else "tab:gray" if n.startswith("fp32") else "tab:orange"
                  for n in names]
        ax.barh(names, ratios, color=colors)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.axvline(1.1, color="tab:green", lw=0.8, ls="--", label="1.10x fp32")
        ax.set_xlabel("training-step time / fp32 step time (median)")
        ax.set_title(textwrap.fill(shape.description, 60), fontsize=9)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant (median of these)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant first")
    parser.add_argument("--shapes", default="mlp,transformer", help="comma list of: " + ", ".join(SHAPES))
    parser.add_argument("--only", default=None, help="regex: keep variants whose name (without its dtype suffix) matches "
                        "(the float rows always kept)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    parser.add_argument("--plot", default=None, help="write a bar chart of the ratios to this PNG")
    parser.add_argument("--dtypes", default="fp32", help="comma list of fp32, bf16, bf16model (bf16: the step "
                        "under torch.autocast('cpu', torch.bfloat16); bf16model: the model cast to bfloat16; "
                        "ratios to the float step in the same dtype)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or this process's CPU time (use with --threads 1 on a busy machine)")
    parser.add_argument("--smollm2-gguf", default=None, help="the smollm2 shape loads this SmolLM2-135M .gguf")
    parser.add_argument("--smollm2-layers", type=int, default=4, help="without it: this many layers of its shapes")
    args = parser.parse_args(argv)
    if args.steps < 10:
        parser.error(f"--steps={args.steps}: use at least 10 so the medians mean something")
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}: choose from {list(SHAPES)}")
    bad_dtypes = [d for d in args.dtypes.split(",") if d not in ("fp32", "bf16", "bf16model")]
    if bad_dtypes:
        parser.error(f"--dtypes: unknown {bad_dtypes}: choose from fp32, bf16, bf16model")

    torch.set_num_threads(args.threads)
    SMOLLM2.update(gguf=args.smollm2_gguf, layers=args.smollm2_layers)
    rows = variants(compile_rows=not args.no_compile, dtypes=args.dtypes.split(","))
    if args.only:
        rows = [r for r in rows if _base_name(r.name) == "fp32" or re.search(args.only, _base_name(r.name))]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"median of {args.steps} steps after {args.warmup} warm-up ({args.clock} clock), variants interleaved; "
          f"clipping percentile {PERCENTILE}; load average {os.getloadavg()[0]:.2f} at start")
    print(f"mixle fused CPU fake-quant kernels: "
          f"{'on, ' + _fused_cpu.library_path() if _fused_cpu.available() else 'OFF (torch ops)'}; "
          f"'torch ops' rows switch them off")
    print("median/min ms: median and fastest of the timed steps; peak MB: highest live torch CPU "
          "allocations (torch.profiler memory events) from model build through 3 steps; compiled "
          "rows have no memory pass")
    results = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        timing = time_steps(shape, rows, args.steps, args.warmup, args.clock)
        memory = {}
        if not args.no_memory:
            for row in rows:
                if not row.compiled:
                    with contextlib.suppress(ValueError):  # a row the shape refuses
                        memory[row.name] = peak_memory(shape, row)
        report(shape, rows, timing, memory)
        results.append((shape, rows, timing))
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
