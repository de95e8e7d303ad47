"""Inference speed of converted int4/int8 models against float32, on CPU.

Two parts, each at 1 and 2 threads (``torch.set_num_threads``):

* single layers (out x in) 1408x512, 4096x4096 and 11008x4096 at batch 1, 8 and 64: fp32
  ``F.linear`` vs mixle ``QuantizedLinear`` int4 (channel, group 32) and int8 (channel), and
  torch's own CPU low-bit ops on the same codes where they run: ``aten._weight_int8pack_mm``
  (int8, channel scales) and ``aten._weight_int4pack_mm_for_cpu`` (int4, group 32), and torchao's
  CPU int4 weight-only layer (its own int4 weights, bfloat16 activations; see ``torchao_int4``);
* greedy generation at batch 1 (tokens/s): mixle's ``build_causal_lm`` (d_model 512, 4 layers,
  vocab 4096; no KV cache, so every step runs the whole context) and tiny Hugging Face
  ``LlamaForCausalLM`` (random init from a config, hidden 512 and 1024, 4 layers, vocab 32000,
  KV cache) in fp32 and converted with ``quantize_model`` (every Linear, lm_head included; also on
  llama.cpp's q4_0/q8_0 grids), torchao's int4 (bfloat16), and, when llama-cpp-python is installed,
  llama.cpp running the q4_0/q8_0 conversions written with ``save_gguf`` (same prompt ids, same
  number of greedy tokens; rows say why they were skipped).

All variants of one cell run interleaved round by round in one process, so machine load hits
them alike; the tables show medians and the speed-up over fp32 (fp32 time / variant time, > 1 is
faster). Before each timed layer call an untimed read of 128 MiB evicts the caches, as a
model's other layers would (``--warm`` keeps the weight cached: then an int4 weight up to 32 MiB
is read from L3 instead of memory). ``--clock cpu`` measures process CPU time instead of wall
time (steadier on a shared machine at 1 thread; at 2 threads it adds both threads' time). The memory line estimates the
bandwidth bound: a streaming read of 256 MiB measured here, and the bytes each batch-1 product
must read.

Usage::

    python benchmarks/inference.py                 # everything (~10 min on 2 busy cores)
    python benchmarks/inference.py --quick         # fewer rounds and tokens (~3 min)
    python benchmarks/inference.py --threads 1 --parts layers --clock cpu
"""

import argparse
import gc
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mixle.api import quantize_model  # noqa: E402
from mixle.core.packing import unpack_int4  # noqa: E402
from mixle.lm.transformer import build_causal_lm  # noqa: E402
from mixle.torch_backend.kernels import packed_linear  # noqa: E402
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py, beside this script)

LAYERS = [(1408, 512), (4096, 4096), (11008, 4096)]
BATCHES = [1, 8, 64]
SKIP_SLOWER = 5
EVICT_BYTES = 128 << 20  # read before each timed layer call: 4x this machine's 32 MiB L3
MIXLE_SPECS = {"int4 ch": dict(bits=4), "int4 g32": dict(bits=4, group_size=32), "int8 ch": dict(bits=8)}
# llama.cpp's grids: mixle converts on them too, and writes them with save_gguf for llama.cpp.
GGUF_SPECS = {"q4_0": dict(bits=4, grid="q4_0"), "q8_0": dict(bits=8, grid="q8_0")}
TORCHAO = "torchao int4 g32 bf16"




def clock_fn(kind):
    return time.perf_counter if kind == "wall" else time.process_time


def interleaved(fns, rounds, clock, budget_s, progress=None, flush=None):
    """Median seconds of each fn, called round by round (one warm-up round first); ``flush()``
    (untimed) before each call."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    start = time.perf_counter()
    for r in range(rounds):
        for name, fn in fns.items():
            if flush is not None:
                flush()
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
        if progress is not None:
            progress.update(1)
        if r >= 2 and time.perf_counter() - start > budget_s:
            break
    return {name: statistics.median(v) for name, v in times.items()}


def stream_bandwidth(clock):
    """GB/s of summing a 256 MiB float32 tensor (a read-only stream), median of 5."""
    big = torch.ones(64 << 20)
    big.sum()
    seconds = interleaved({"sum": big.sum}, 5, clock, 10.0)["sum"]
    del big
    return (256 << 20) / seconds / 1e9


# ------------------------------------------------------------------------------------ layers


def torch_int4pack(codes_i8, scale, out_features, in_features, group=32):
    """aten int4pack weight (codes + 8 as uint4, zero 0) and its scales_and_zeros for the same weight."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((codes_i8.to(torch.int32) + 8).contiguous(), 1)
    scales = scale.reshape(out_features, in_features // group).t().contiguous()
    scales_and_zeros = torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)


def torchao_int4(module):
    """``(module', None)``: a bfloat16 copy of ``module`` with torchao's CPU int4 weight-only path
    (``Int4OpaqueTensor``, group 32) on its Linears, or ``(None, why)`` where it does not run here.

    In this torchao (0.18) the CPU layout is the prototype ``PrototypeInt4WeightOnlyConfig``
    (``Int4WeightOnlyConfig``'s formats need CUDA or the mslk package). It multiplies with
    ``aten._weight_int4pack_mm_for_cpu``, fast for bfloat16 activations only (float32 ones take a
    slow path: the "aten int4pack" column), so it runs in bfloat16: other numerics than the rest.
    """
    try:
        import copy

        from torchao.quantization import quantize_
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    except Exception as error:  # not installed, or built for another torch
        return None, f"{type(error).__name__}: {error}".splitlines()[0]
    try:
        quantized = copy.deepcopy(module).to(torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_(quantized, PrototypeInt4WeightOnlyConfig(group_size=32))
        return quantized, None
    except Exception as error:
        return None, f"{type(error).__name__}: {error}".splitlines()[0]


def layer_variants(out_features, in_features):
    """{name: (fn(x), note)} for one shape; also checks every variant against fp32's output."""
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=False)
    weight = linear.weight.detach()
    variants = {"fp32": lambda x: F.linear(x, weight)}
    quantized = {}
    for name, fields in MIXLE_SPECS.items():
        quantized[name] = layer = quantize_model(linear, **fields)
        variants[name] = layer
    int8 = quantized["int8 ch"]
    codes8, scale8 = int8.codes, int8.scale.reshape(-1).contiguous()
    variants["aten int8pack"] = lambda x: torch.ops.aten._weight_int8pack_mm(x, codes8, scale8)
    g32 = quantized["int4 g32"]
    try:
        variants["aten int4pack g32"] = torch_int4pack(unpack_int4(g32.codes, g32.weight_shape), g32.scale,
                                                       out_features, in_features)
    except RuntimeError as error:  # not in every torch build
        print(f"  aten int4pack unavailable: {error}".splitlines()[0])
    torchao_fn, reason = torchao_int4(linear)
    if torchao_fn is None:
        print(f"  torchao int4 unavailable: {reason}")
    else:
        variants[TORCHAO] = lambda x: torchao_fn(x.to(torch.bfloat16))
    x = torch.randn(3, in_features)
    with torch.no_grad():
        for name, reference in (("aten int8pack", int8), ("aten int4pack g32", g32)):
            if name in variants:
                with packed_linear.switched_off():
                    exact = reference(x)
                err = (variants[name](x) - exact).abs().max().item()
                if err > 1e-3 * exact.abs().max().item():
                    print(f"  warning: {name} differs from mixle's weight by {err:.3g}")
    return variants, weight.numel()


def run_layers(args, clock, threads, bandwidth):
    from tqdm import tqdm

    rows = []
    cells = len(LAYERS) * len(args.batches)
    flush = None
    if not args.warm:  # evict the weights from the caches, as the other layers of a model would
        evictor = torch.ones(EVICT_BYTES // 4)
        flush = evictor.sum
    with tqdm(total=cells * args.rounds, desc=f"layers, {threads} thread(s)", leave=False) as progress:
        for out_features, in_features in LAYERS:
            variants, count = layer_variants(out_features, in_features)
            slow = set()  # torch's ops more than SKIP_SLOWER x fp32 at a smaller batch: not timed again
            for batch in args.batches:
                x = torch.randn(batch, in_features)
                fns = {name: (lambda fn=fn: fn(x)) for name, fn in variants.items() if name not in slow}
                with torch.no_grad():
                    med = interleaved(fns, args.rounds, clock, args.budget, progress, flush)
                slow |= {name for name, t in med.items() if name.startswith("aten") and t > SKIP_SLOWER * med["fp32"]}
                rows.append(((out_features, in_features), batch, med, count))
            del variants
            gc.collect()
    names = list(dict.fromkeys(n for row in rows for n in row[2]))
    print(f"\nSingle layers, {threads} thread(s): median ms (speed-up over fp32); "
          f"'-': more than {SKIP_SLOWER}x slower than fp32 at a smaller batch, not timed")
    print("| layer | batch | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for shape, batch, med, _ in rows:
        cells = [f"{med[n] * 1e3:,.2f} ({med['fp32'] / med[n]:.2f}x)" if n in med else "-" for n in names]
        print(f"| {shape[0]}x{shape[1]} | {batch} | " + " | ".join(cells) + " |")
    print(f"Batch-1 read-bandwidth bound at {bandwidth:.1f} GB/s (streaming read, {threads} thread(s)):")
    for (out_features, in_features), batch, med, count in rows:
        if batch != 1:
            continue
        int4 = count / 2 + out_features * in_features / 32 * 4  # codes + group-32 scales
        print(f"  {out_features}x{in_features}: fp32 {count * 4 / bandwidth / 1e6:.2f} ms, "
              f"int8 {count / bandwidth / 1e6:.2f} ms, int4 g32 {int4 / bandwidth / 1e6:.2f} ms of pure reading "
              f"(measured: fp32 {med['fp32'] * 1e3:.2f}, int8 {med['int8 ch'] * 1e3:.2f}, "
              f"int4 g32 {med['int4 g32'] * 1e3:.2f})")


# ---------------------------------------------------------------------------------- generate


def greedy(model, prompt, tokens):
    """Greedy decoding of a mixle CausalLM (no KV cache: each step runs the whole context)."""
    ids = prompt
    for _ in range(tokens):
        next_id = model(ids[:, -model.block:]).argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
    return ids


def llama(hidden):
    from mixle._optional import require

    transformers = require("transformers", extra="bench", purpose="the Llama generate benchmark")
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                      num_hidden_layers=4, num_attention_heads=hidden // 64,
                                      num_key_value_heads=hidden // 64, vocab_size=32000,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def llama_cpp_variants(fp32, prompt, tokens, threads, directory):
    """{"llama.cpp Q4_0"/"Q8_0": greedy generation fn} of ``fp32`` converted on those grids and
    written with ``save_gguf``, or ({}, why) without llama-cpp-python."""
    from mixle.lm.llama_cpp_eval import llama_cpp_module, llama_cpp_problem

    llama_cpp = llama_cpp_module()
    if llama_cpp is None:
        return {}, llama_cpp_problem() or "llama-cpp-python is not installed"
    from mixle.task.quantize import save_gguf

    ids = prompt[0].tolist()
    fns = {}
    for grid, fields in GGUF_SPECS.items():
        path = Path(directory) / f"model-{grid}.gguf"
        save_gguf(quantize_model(fp32, **fields), path)
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=0, n_threads=threads,  # n_ctx 0: the model's own
                              n_threads_batch=threads, verbose=False)

        def generate(llm=llm):
            out = []
            for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):  # greedy
                out.append(token)
                if len(out) == tokens:
                    return out
        fns[f"llama.cpp {grid.upper()}"] = generate
    return fns, None


def run_generate(args, clock, threads):
    import tempfile

    from tqdm import tqdm

    models = [("mixle CausalLM d512", lambda: build_causal_lm(vocab=4096, d_model=512, n_layer=4, n_head=8,
                                                               block=128).eval(), False)]
    for hidden in args.llama:
        models.append((f"HF Llama h{hidden}", lambda hidden=hidden: llama(hidden), True))
    rows, notes = [], []
    with tqdm(total=len(models) * args.gen_rounds, desc=f"generate, {threads} thread(s)", leave=False) as progress, \
            tempfile.TemporaryDirectory() as directory:
        for name, build, is_hf in models:
            try:
                fp32 = build()
            except ImportError as error:
                print(f"  {name}: skipped ({error})")
                continue
            variants = {"fp32": fp32}
            for spec_name, fields in {**MIXLE_SPECS, **GGUF_SPECS}.items():
                variants[spec_name] = quantize_model(fp32, **fields).eval()
            torchao_model, reason = torchao_int4(fp32)
            if torchao_model is None:
                notes.append(f"{name}: torchao int4 does not run here: {reason}")
            else:
                variants[TORCHAO] = torchao_model.eval()
            prompt = torch.randint(0, 4096, (1, 8))
            if is_hf:
                def make(model):
                    return lambda: model.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                                  do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
            else:
                def make(model):
                    return lambda: greedy(model, prompt, args.tokens)
            fns = {spec_name: make(model) for spec_name, model in variants.items()}
            cpp, reason = llama_cpp_variants(fp32, prompt, args.tokens, threads, directory)
            if reason and reason not in notes:
                notes.append(reason)
            fns.update(cpp)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # generation-config chatter
                med = interleaved(fns, args.gen_rounds, clock, args.budget * 3, progress)
            rows.append((name, med))
            del variants, fns, fp32, cpp
            gc.collect()
    if not rows:
        return
    names = list(dict.fromkeys(n for _, med in rows for n in med))
    print(f"\nGreedy generate at batch 1, {args.tokens} new tokens after 8, {threads} thread(s): "
          f"median tokens/s (speed-up over fp32)")
    print("| model | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for name, med in rows:
        cells = [f"{args.tokens / med[n]:,.1f} ({med['fp32'] / med[n]:.2f}x)" if n in med else "-" for n in names]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("q4_0/q8_0: mixle converted on llama.cpp's grids; llama.cpp Q4_0/Q8_0: the same conversions written "
          "with save_gguf, run by llama-cpp-python (its own KV cache; mixle's CausalLM loop has none, so each of "
          f"its steps runs the whole context). {TORCHAO}: torchao's own int4 weights, bfloat16 activations.")
    for note in notes:
        print(f"  skipped: {note}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds per layer cell, 1 generate round, 16 tokens")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--parts", nargs="+", choices=["layers", "generate"], default=["layers", "generate"])
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    parser.add_argument("--llama", type=int, nargs="*", default=[512, 1024], help="hidden sizes of the HF Llamas")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--warm", action="store_true",
                        help="keep each layer's weight in cache between calls (no eviction read)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per layer cell (default 9, quick 3)")
    parser.add_argument("--budget", type=float, default=None, help="seconds per cell before stopping early")
    args = parser.parse_args()
    args.rounds = args.rounds or (3 if args.quick else 9)
    args.gen_rounds = 2 if args.quick else 3
    args.tokens = 16 if args.quick else 32
    args.budget = args.budget or (8.0 if args.quick else 20.0)
    clock = clock_fn(args.clock)
    kernel = (f"packed kernel {packed_linear.isa()} ({packed_linear._library().path})"
              if packed_linear.available() else "packed kernel OFF (exact dequantize path)")
    print(f"CPU: {cpu_name(isa=True)}; torch {torch.__version__}; {kernel}; clock: {args.clock}")
    print(f"layers (out x in): {', '.join(f'{o}x{i}' for o, i in LAYERS)}; batches {args.batches}; "
          f"{args.rounds} rounds per cell (fewer past {args.budget:.0f} s); "
          + ("weights stay cached between calls" if args.warm else
             f"caches evicted before each call (untimed read of {EVICT_BYTES >> 20} MiB)"))
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n=== {torch.get_num_threads()} thread(s) ===")
        if "layers" in args.parts:
            run_layers(args, clock, threads, stream_bandwidth(clock))
        if "generate" in args.parts:
            run_generate(args, clock, threads)


if __name__ == "__main__":
    main()
