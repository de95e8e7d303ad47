"""What routing the fused CPU fake-quant kernel through the torch dispatcher costs.

The same compiled kernel is called two ways, side by side in one run, on the weight shapes of
``benchmarks/overhead.py``: straight through ctypes (outputs preallocated; what eager QAT does), and through the
``torch.ops.mixle.fused_fake_quant`` custom operator whose fake (meta) implementation lets
torch.compile trace it (what compiled QAT records). Prints medians per call, the difference, and
that difference times the kernel calls of one training step of the MLP benchmark model, against
its fp32 step time measured in the same run.

    python benchmarks/custom_op_cost.py [--repeats 2000] [--threads 2]
"""

import argparse
import ctypes
import platform
import statistics
import time

import torch
from torch import nn

from mixle.core.spec import QuantSpec
from mixle.torch_backend.kernels import fused_cpu

SPEC = QuantSpec(bits=4)


def raw_call(w):
    """The kernel straight through ctypes, as before it was a custom operator."""
    width = w.shape[1]
    deq, scale = torch.empty_like(w), torch.empty((1, w.shape[0], 1))
    fused_cpu._kernels().fake_quant["f32"](
        w.data_ptr(), w.shape[0], width, -1, -1, 0.0, SPEC.scale_divisor, float(SPEC.code_min), float(SPEC.code_max),
        None, scale.data_ptr(), None, deq.data_ptr(), None, ctypes.byref(ctypes.c_int64(0)), torch.get_num_threads())
    return deq, scale


def via_dispatcher(w):
    deq, scale = torch.empty_like(w), torch.empty((1, w.shape[0], 1))
    torch.ops.mixle.fused_fake_quant(w, None, deq, scale, None, None, w.shape[1], -1, -1, 0.0,
                                     SPEC.scale_divisor, float(SPEC.code_min), float(SPEC.code_max))
    return deq, scale


def per_call_seconds(fn, repeats):
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_seconds(model, batch, steps=15):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for i in range(steps + 3):
        start = time.perf_counter()
        loss = model(batch).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not fused_cpu.available():
        raise SystemExit("the fused kernels could not be built here (no C++ compiler)")
    print(f"CPU {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads, "
          f"{args.repeats} calls per shape, int4 per-channel")
    mlp = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.GELU(),
                        nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
    models = {"mlp 512-2048-512-2048-512, batch 256": (mlp, torch.randn(256, 512))}
    probe = torch.randn(4, 8)
    assert torch.equal(raw_call(probe)[0], via_dispatcher(probe)[0]) and torch.equal(raw_call(probe)[0], fused_cpu.fake_quant(probe, SPEC)[0])
    print(f"{'weight':>12} {'ctypes us':>10} {'custom op us':>13} {'extra us':>9}")
    extra_of = {}
    for shape in ((2048, 512), (512, 2048)):
        w = torch.randn(shape)
        direct = per_call_seconds(lambda: raw_call(w), args.repeats)
        via_op = per_call_seconds(lambda: via_dispatcher(w), args.repeats)
        extra_of[shape] = via_op - direct
        print(f"{str(shape):>12} {direct * 1e6:10.1f} {via_op * 1e6:13.1f} {(via_op - direct) * 1e6:9.1f}")
    # A QAT training step calls the kernel about twice per layer (forward quantize, backward rebuild).
    for name, (model, batch) in models.items():
        fp32 = step_seconds(model, batch)
        extra = sum(2 * extra_of[tuple(m.weight.shape)] for m in model.modules() if isinstance(m, nn.Linear))
        print(f"{name}: fp32 step {fp32 * 1e3:.2f} ms; dispatcher cost per QAT step {extra * 1e6:.0f} us "
              f"= {extra / fp32:.2%} of the fp32 step")


if __name__ == "__main__":
    main()
