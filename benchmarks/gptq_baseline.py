"""GPTQ vs round-to-nearest PTQ on the main job's model (``python -m mixle compare``'s fp32 phase).

Trains the main job's fp32 model (``mixle.lm.compare.CompareRun.pretrain``: the preset's size,
data, seed and steps; ``--steps`` shortens it; ``--checkpoint`` keeps it for reruns), then
quantizes it with ``quantize_model`` (round to nearest) and ``gptq_quantize`` onto the same grids
and prints held-out perplexity (``mixle.lm.training.held_out_loss`` on the job's held-out windows)
and real bytes (``model_nbytes``) for each. Calibration: ``--calib-windows`` windows of the
training text (never the held-out text), every position's inputs.

    python benchmarks/gptq_baseline.py                        # default preset, 1600 fp32 steps
    python benchmarks/gptq_baseline.py --steps 400 --checkpoint /tmp/fp32.pt
"""

import argparse
import json
import math
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import mixle  # noqa: E402
from mixle.lm.compare import PRESETS, CompareRun, prepare_data  # noqa: E402
from mixle.lm.training import held_out_loss  # noqa: E402

# (row name, spec fields, gptq options or None for round to nearest)
ROWS = (
    ("RTN int4 g32", dict(bits=4, group_size=32), None),
    ("GPTQ int4 g32", dict(bits=4, group_size=32), dict()),
    ("GPTQ int4 g32 (one pass, float inputs)", dict(bits=4, group_size=32), dict(sequential=False)),
    ("GPTQ int4 g32 (tied head too)", dict(bits=4, group_size=32), dict(tied="gptq")),
    ("RTN int4 g128", dict(bits=4, group_size=128), None),
    ("GPTQ int4 g128", dict(bits=4, group_size=128), dict()),
    ("RTN int4 per-channel", dict(bits=4), None),
    ("GPTQ int4 per-channel", dict(bits=4), dict()),
    ("RTN q4_0 (llama.cpp grid)", dict(grid="q4_0"), None),
    ("GPTQ q4_0 (llama.cpp grid)", dict(grid="q4_0"), dict()),
)


def fp32_model(config, data, checkpoint):
    run = CompareRun(config, data, progress=False)
    lm = run.build_model()
    if checkpoint and os.path.exists(checkpoint):
        lm.load_state_dict(torch.load(checkpoint))
        return lm, 0.0
    start = time.perf_counter()
    lm = run.pretrain(lm)
    if checkpoint:
        torch.save(lm.state_dict(), checkpoint)
    return lm, time.perf_counter() - start


def calibration_batches(data, windows, batch, seed):
    generator = torch.Generator().manual_seed(seed)
    starts = data.train_starts[torch.randperm(len(data.train_starts), generator=generator)[:windows]]
    rows = data.train_ids[starts[:, None] + torch.arange(data.block)]
    return [{"idx": rows[i:i + batch], "all_positions": True} for i in range(0, len(rows), batch)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="default", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=None, help="fp32 training steps (default: the preset's)")
    parser.add_argument("--checkpoint", default=None, help="load the fp32 model from / save it to this file")
    parser.add_argument("--calib-windows", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = PRESETS[args.preset]
    if args.steps is not None:
        config = config.replace(steps=args.steps)
    data = prepare_data(config)
    lm, train_seconds = fp32_model(config, data, args.checkpoint)
    batches = calibration_batches(data, args.calib_windows, 32, config.seed + 1)
    loss = held_out_loss(lm, data.eval_windows)
    rows = [{"method": "float", "loss": loss, "ppl": math.exp(loss), "bytes": mixle.model_nbytes(lm).total,
             "seconds": 0.0}]
    for name, fields, gptq in ROWS:
        if config.d_model % fields.get("group_size", 1):
            print(f"skipped {name}: its group size does not divide d_model={config.d_model}")
            continue
        start = time.perf_counter()
        q = mixle.quantize_model(lm, **fields) if gptq is None else mixle.gptq_quantize(lm, batches, **fields, **gptq)
        seconds = time.perf_counter() - start
        loss = held_out_loss(q, data.eval_windows)
        rows.append({"method": name, "loss": loss, "ppl": math.exp(loss), "bytes": mixle.model_nbytes(q).total,
                     "seconds": seconds})
    print(f"preset={args.preset} d_model={config.d_model} n_layer={config.n_layer} block={config.block} "
          f"fp32 steps={config.steps} (trained in {train_seconds:.0f} s) calibration={args.calib_windows} windows "
          f"x {config.block} tokens (training text); held-out windows={len(data.eval_windows)}; "
          f"threads={torch.get_num_threads()} cpu={platform.processor() or platform.machine()}")
    print(f"{'method':42s} {'loss':>8s} {'ppl':>8s} {'bytes':>9s} {'quantize s':>10s}")
    for row in rows:
        print(f"{row['method']:42s} {row['loss']:8.4f} {row['ppl']:8.3f} {row['bytes']:9d} {row['seconds']:10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
