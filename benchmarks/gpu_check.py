"""The GPU check, prepared to run in under 5 minutes on one accelerator (an H200), all in one run.

Prints one table of medians and ratios:

* **train step**: a SmolLM2-135M-shaped Llama (hidden 576, intermediate 1536, 9 heads, 3 KV heads,
  vocab 49152, tied head; ``--layers`` of its 30 layers, random weights: nothing to download)
  under bf16 autocast, AdamW: the float step, mixle QAT on every grid (int4 group 32, qwix,
  q4_0, q8_0, 8da4w), torchao's int4 group-32 QAT beside them, eager; and compiled (each decoder
  layer and the head compiled, so one compile serves all layers) for float, mixle int4 group 32
  and q4_0 and torchao (each compile costs tens of seconds); ratio to the float step of the same
  mode, steps interleaved round by round.
* **converted matmul**: ``QuantizedLinear`` (int4 group 32, q4_0, q8_0) against a bf16 ``F.linear``
  of the same shape, at 1 and 512 tokens, eager and compiled.
* **host syncs**: every QAT layer kind's forward and backward on the device under
  ``torch.cuda.set_sync_debug_mode("error")`` (any synchronising call raises), and the count of
  host-reading ops a dispatch mode saw; both must be 0 on an accelerator (on a CPU the values
  are read where they live, which is no synchronisation, so the count there is not 0).
* **exactness**: the fake-quantized weights computed on the device (eager and compiled) against
  the CPU numerics, bit for bit.

Usage::

    python benchmarks/gpu_check.py                      # cuda, full shapes (< 5 minutes on an H200)
    python benchmarks/gpu_check.py --device cpu --quick # tiny shapes, seconds (the test suite runs it)
    python benchmarks/gpu_check.py --no-compile --layers 30  # the whole model, eager steps only

Each section prints when it is done, with the seconds so far, so a slow compile shows itself.
"""

import argparse
import collections
import contextlib
import copy
import io
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mixle.api import apply_qat, convert  # noqa: E402
from mixle.core.spec import QuantSpec  # noqa: E402
from mixle.torch_backend.fake_quant import fake_quantize  # noqa: E402

GRIDS = {
    "int4 g32": dict(bits=4, group_size=32),
    "qwix int4 g32": dict(bits=4, group_size=32, grid="qwix"),
    "q4_0": dict(bits=4, grid="q4_0"),
    "q8_0": dict(bits=8, grid="q8_0"),
    "8da4w g32": dict(bits=4, group_size=32, act_bits=8, act_symmetric=False),
}
QUICK_GRIDS = ("int4 g32", "q4_0")  # --quick: the plain grid and a llama.cpp one, no torchao
COMPILED_ROWS = ("float", "mixle int4 g32", "mixle q4_0", "torchao int4 g32")
READS = {"aten._local_scalar_dense", "aten.equal", "aten.lift_fresh", "aten.nonzero", "aten._unique2",
         "aten.masked_select", "aten.item"}


@contextlib.contextmanager
def quiet():
    """Silence the peers' import-time chatter (torchao's notices)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(runs, device, rounds):
    """Median milliseconds of each callable in ``runs`` (a dict), interleaved round by round."""
    times = {name: [] for name in runs}
    for r in range(rounds + 1):  # round 0 warms up (and compiles)
        names = list(runs)
        for name in names[r % len(names):] + names[: r % len(names)]:
            sync(device)
            start = time.perf_counter()
            runs[name]()
            sync(device)
            if r:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def smollm2(layers, quick):
    import transformers

    if quick:
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    else:
        config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                          num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                                          tie_word_embeddings=True, max_position_embeddings=2048)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def torchao_int4(model):
    with quiet():
        from torchao.quantization import quantize_
        from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

        weight = IntxFakeQuantizeConfig(torch.int4, group_size=32, is_symmetric=True)
        quantize_(model, QATConfig(weight_config=weight, step="prepare"))
    return model


def compiled_regions(model, backend):
    """Compile each decoder layer and the head (one compile serves every layer of a kind)."""
    for layer in model.model.layers:
        layer.compile(backend=backend)
    model.lm_head.compile(backend=backend)
    return model


def trainer(model, tokens, device):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()

    return step


def train_rows(args, device):
    """``[(row, ms, ratio)]`` of the training steps."""
    base = smollm2(args.layers, args.quick)
    tokens = torch.randint(0, base.config.vocab_size, (2, 16) if args.quick else (8, 512), device=device)
    prepares = {"float": lambda m: m}
    prepares.update({f"mixle {name}": (lambda m, f=GRIDS[name]: apply_qat(m, **f)) for name in grids(args)})
    if not args.quick and importable("torchao"):
        prepares["torchao int4 g32"] = torchao_int4
    backend = "eager" if args.quick else "inductor"
    rows = []
    for mode in ("eager",) if args.quick or args.no_compile else ("eager", "compiled"):  # quick: matmuls only
        runs = {}
        for name, prepare in prepares.items():
            if mode == "compiled" and name not in COMPILED_ROWS:
                continue
            model = prepare(copy.deepcopy(base).to(device))
            if mode == "compiled":
                model = compiled_regions(model, backend)
            runs[name] = trainer(model, tokens, device)
        with quiet():
            timing = median_ms(runs, device, args.rounds)
        rows += [(f"train {mode}: {name}", ms, ms / timing["float"]) for name, ms in timing.items()]
    return rows


def matmul_rows(args, device):
    """``[(row, ms, ratio to bf16 F.linear)]`` of converted layers, eager and compiled."""
    out_features, in_features = (128, 64) if args.quick else (1536, 576)
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features).to(device)
    rows = []
    for tokens in (4,) if args.quick else (1, 512):
        x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16)
        weight, bias = linear.weight.detach().bfloat16(), linear.bias.detach().bfloat16()
        runs = {"bf16 F.linear": lambda: F.linear(x, weight, bias)}
        for name in QUICK_GRIDS if args.quick else ("int4 g32", "q4_0", "q8_0"):
            layer = convert(apply_qat(nn.Sequential(copy.deepcopy(linear).bfloat16()), **GRIDS[name]))[0]
            runs[f"{name} eager"] = lambda layer=layer: layer(x)
            compiled = torch.compile(layer, backend="eager" if args.quick else "inductor")
            runs[f"{name} compiled"] = lambda layer=compiled: layer(x)
        with torch.no_grad(), quiet():
            timing = median_ms(runs, device, args.rounds * (1 if args.quick else 5))
        rows += [(f"matmul {tokens} tok: {name}", ms, ms / timing["bf16 F.linear"]) for name, ms in timing.items()]
    return rows


class Reads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        if name in READS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def sync_rows(args, device):
    """``[(row, count, None)]``: host reads in every layer kind's QAT step on the device."""
    from transformers.pytorch_utils import Conv1D

    kinds = {
        "linear": (lambda: nn.Sequential(nn.Linear(64, 64)), lambda: (torch.randn(4, 64, device=device),)),
        "conv1d_hf": (lambda: nn.Sequential(Conv1D(64, 64)), lambda: (torch.randn(4, 64, device=device),)),
        "embedding": (lambda: nn.Sequential(nn.Embedding(50, 64)), lambda: (torch.randint(0, 50, (4, 6), device=device),)),
        "conv2d": (lambda: nn.Sequential(nn.Conv2d(32, 64, 3)), lambda: (torch.randn(2, 32, 6, 6, device=device),)),
        "mha": (lambda: nn.MultiheadAttention(64, 4), lambda: (torch.randn(5, 2, 64, device=device),) * 3),
    }
    rows = []
    for grid in grids(args):
        fields, total, error = GRIDS[grid], 0, ""
        for kind, (build, inputs) in kinds.items():
            model = apply_qat(build(), **fields, opt_in=("embedding",)).to(device)
            reads = Reads()
            debug = torch.cuda.set_sync_debug_mode if device.type == "cuda" else (lambda mode: None)
            try:
                debug("error")
                with reads:
                    for _ in range(2):
                        out = model(*inputs())
                        (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()
            except RuntimeError as err:
                error = f" ({kind}: {str(err).splitlines()[0][:60]})"
            finally:
                debug("default")
            total += sum(reads.counts.values())
        rows.append((f"host syncs: {grid}{error}", float(total + bool(error)), None))
    return rows


def exact_rows(args, device):
    """``[(row, % of fake-quantized values equal to the CPU numerics', None)]``."""
    torch.manual_seed(0)
    quick = args.quick
    weight = torch.randn((128, 64) if quick else (1536, 576)) * 0.02
    rows = []
    for name in grids(args):
        spec = QuantSpec(**{k: v for k, v in GRIDS[name].items() if not k.startswith("act")})
        expected = fake_quantize(weight, spec)
        on_device = weight.to(device)
        for mode, fn in (("eager", fake_quantize), ("compiled", torch.compile(fake_quantize, backend="eager" if quick
                                                                              else "inductor"))):
            got = fn(on_device, spec).cpu()
            rows.append((f"exact {mode}: {name}", 100.0 * float((got == expected).float().mean()), None))
    return rows


def grids(args):
    return QUICK_GRIDS if args.quick else tuple(GRIDS)


def importable(module):
    with quiet():
        try:
            __import__(module)
        except Exception:  # noqa: BLE001 - any import failure means the peer is unavailable
            return False
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a few rounds (seconds on a CPU)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the SmolLM2 shapes (of 30)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per table (default 10, quick 1)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled training steps (the slow part)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 10)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(f"torch {torch.__version__} on {name}; {'quick ' if args.quick else ''}medians of {args.rounds} rounds")
    rows, start = [], time.perf_counter()
    for section in (sync_rows, exact_rows, matmul_rows, train_rows):
        rows += section(args, device)
        print(f"{section.__name__}: done at {time.perf_counter() - start:.0f} s", flush=True)
    print(f"{'row (values: ms, except syncs: count, exact: % equal)':<56} {'value':>10} {'ratio':>7}")
    for row, value, ratio in rows:
        print(f"{row:<56} {value:>10.3f} {'' if ratio is None else f'{ratio:.3f}':>7}")
    return rows


if __name__ == "__main__":
    main()
