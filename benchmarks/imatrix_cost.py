"""Cost of ggml's importance-weighted search per call (``quantize_array(..., importance=)``) beside
the reference quantizer, on a SmolLM2-135M MLP weight (576 x 1536), numpy and torch, and the bit
identity of numpy and torch.

    python benchmarks/imatrix_cost.py [--repeat 3] [--threads 1]
"""

import argparse
import os
import platform
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mixle.core.numerics import quantize_array  # noqa: E402


def median_seconds(call, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--grids", default="q4_0,q4_k,q6_k")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((576, 1536)) * 0.05).astype(np.float32)
    imp = (rng.random(1536) ** 2 * 3).astype(np.float32)
    print(f"weight {w.shape} float32, torch threads {args.threads}, CPU {platform.processor() or platform.machine()}, "
          f"median of {args.repeat}")
    for grid in args.grids.split(","):
        wt, it = torch.from_numpy(w), torch.from_numpy(imp)
        same = np.array_equal(quantize_array(w, grid=grid, importance=imp).dequantize(),
                              quantize_array(wt, grid=grid, importance=it).dequantize().numpy())
        row = [grid]
        for label, call in (("reference numpy", lambda: quantize_array(w, grid=grid)),
                            ("imatrix numpy", lambda: quantize_array(w, grid=grid, importance=imp)),
                            ("imatrix torch", lambda: quantize_array(wt, grid=grid, importance=it))):
            row.append(f"{label} {median_seconds(call, args.repeat) * 1e3:8.1f} ms")
        print(" | ".join(row) + f" | numpy == torch: {same}")


if __name__ == "__main__":
    main()
