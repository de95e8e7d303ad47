"""Training-step time of a small random Qwen3-MoE: fp32 against mixle QAT and torchao QAT.

mixle fake-quantizes every expert matrix (per expert, along its output rows) as well as the
attention projections and the head; torchao's QAT swaps ``nn.Linear`` layers only, so it leaves
the fused experts (3-D Parameters) in float. Every variant trains a copy of the same model on the
same batch (AdamW, full step: forward, backward, optimizer); steps of all variants are
interleaved round by round in one process, so machine load hits them alike. The table shows the
median step after warm-up, its ratio to fp32, and the share of weight elements each variant
fake-quantizes.

Shape: transformers ``Qwen3MoeForCausalLM`` with hidden 256, 4 layers (all MoE), 8 experts,
top-2, expert intermediate 512, 4 heads of 64 (2 KV heads), vocab 512; batch 4 of 64 tokens,
the model's own next-token loss; ``--experts-implementation`` picks transformers' expert forward.

Usage::

    python benchmarks/moe_overhead.py                      # 2 threads, 20 steps
    python benchmarks/moe_overhead.py --threads 1 --clock cpu --steps 30   # on a busy machine
    python benchmarks/moe_overhead.py --experts-implementation eager
"""

import argparse
import contextlib
import copy
import io
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mixle.api import apply_qat, get_qat_report  # noqa: E402
from mixle.core.spec import QuantSpec  # noqa: E402
from mixle.torch_backend.kernels import fused_cpu  # noqa: E402
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py, beside this script)

SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
             decoder_sparse_step=1, mlp_only_layers=[])
BATCH, SEQ = 4, 64


@contextlib.contextmanager
def quiet():
    """Silence import-time chatter (torchao's CUDA-extension notices)."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        yield


def build(implementation):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE)).train()
    model.set_experts_implementation(implementation)
    return model


def weight_elements(model):
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2)


def mixle_variant(spec):
    def prepare(model):
        model = apply_qat(model, spec=spec)
        done, total = get_qat_report(model).weight_share
        return model, done / total

    return prepare


def torchao_variant(model):
    with quiet():
        from torchao.quantization import quantize_
        from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig
        weight = IntxFakeQuantizeConfig(torch.int4, group_size=32, is_symmetric=True)
        linear = sum(m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear)
        quantize_(model, QATConfig(weight_config=weight, step="prepare"))
    return model, linear / weight_elements(model)


VARIANTS = {
    "fp32": lambda model: (model, 0.0),
    "mixle q4_0": mixle_variant(QuantSpec(grid="q4_0")),
    "mixle q4_0 act8": mixle_variant(QuantSpec(grid="q4_0", act_bits=8)),
    "mixle int4 group32": mixle_variant(QuantSpec(bits=4, group_size=32)),
    "torchao int4 group32 (experts float)": torchao_variant,
}


def trainer(model, batch):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()

    return step




def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (median of these)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall time, or this process's CPU time (use with --threads 1 on a busy machine)")
    parser.add_argument("--experts-implementation", default="grouped_mm", choices=("eager", "batched_mm", "grouped_mm"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = build(args.experts_implementation)
    batch = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    experts = sum(p.numel() for n, p in base.named_parameters() if ".experts." in n)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs ({cpu_name()}); "
          f"load average {os.getloadavg()[0]:.2f} at start")
    print(f"Qwen3-MoE {SHAPE}; batch {BATCH}x{SEQ}; experts implementation {args.experts_implementation}; "
          f"{weight_elements(base):,} weight elements, {experts / weight_elements(base):.1%} in experts")
    print(f"mixle fused CPU fake-quant kernels: {'on' if fused_cpu.available() else 'OFF (torch ops)'}; "
          f"median of {args.steps} steps after {args.warmup} warm-up ({args.clock} clock), variants interleaved")
    names, steps, shares = [], [], []
    for name, prepare in VARIANTS.items():
        model, share = prepare(copy.deepcopy(base))
        names.append(name)
        shares.append(share)
        steps.append(trainer(model, batch))
    times, faults = [[] for _ in names], [[] for _ in names]
    now = time.perf_counter if args.clock == "wall" else time.process_time
    for r in range(args.warmup + args.steps):
        order = list(range(len(names)))
        for i in order[r % len(order):] + order[:r % len(order)]:  # rotate who goes first
            touched, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, now()
            steps[i]()
            if r >= args.warmup:
                times[i].append(now() - start)
                faults[i].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - touched)
    base_median = statistics.median(times[0])
    print(f"{'variant':<38} {'median ms':>9} {'x fp32':>7} {'min ms':>8} {'faults':>7} {'weights fake-quantized':>23}")
    for name, t, f, share in zip(names, times, faults, shares):
        median = statistics.median(t)
        print(f"{name:<38} {median * 1e3:>9.1f} {median / base_median:>7.3f} {min(t) * 1e3:>8.1f} "
              f"{statistics.median(f):>7.0f} {share:>23.1%}")
    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
