"""LoRA+QAT vs full QAT vs PTQ at int4 on the main job's model and corpus, from one fp32 checkpoint.

Trains the default ``build_causal_lm`` in fp32 on the embedded corpus (or ``--corpus``), then from
that checkpoint: PTQ int4 (``quantize_model``); full QAT int4 (every parameter trains on the
fake-quantized model); LoRA+QAT int4 (frozen fake-quantized base, rank-r float adapters train,
then ``merge_lora`` + ``convert`` requantize the merged weights); and LoRA+QAT with
``quantize_merged=True`` (the merged weight ``W + alpha/rank B A`` is what is fake-quantized
while training, so nothing is lost at the merge). Every int4 row is scored as real converted int4 weights. Prints
held-out loss, recovered % of the PTQ gap, trainable parameters, median step time and peak step
memory side by side, and writes a PNG.

    python benchmarks/lora_qat.py            # about 10 minutes on one busy CPU thread
    python benchmarks/lora_qat.py --quick    # a smoke run in well under a minute
"""

import argparse
import copy
import math
import os
import statistics
import textwrap
import time

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from mixle.data import load_splits
from mixle.experimental.program.lora import apply_lora, lora_parameters, merge_lora
from mixle.models.qat import apply_qat
from mixle.models.transformer import build_causal_lm
from mixle.task.quantize import convert, model_nbytes, quantize_model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default=None, help="UTF-8 text file (default: the embedded corpus)")
    p.add_argument("--fp32-steps", type=int, default=2000, help="steps to train the fp32 checkpoint")
    p.add_argument("--qat-steps", type=int, default=300, help="steps for full QAT and for LoRA+QAT each")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--fp32-lr", type=float, default=3e-3)
    p.add_argument("--qat-lr", type=float, default=3e-4, help="full-QAT learning rate (all parameters)")
    p.add_argument("--lora-lr", type=float, default=3e-3, help="LoRA+QAT learning rate (adapters)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows of block+1 tokens")
    p.add_argument("--timing-rounds", type=int, default=5, help="interleaved rounds of step timing")
    p.add_argument("--timing-steps", type=int, default=10, help="timed steps per method per round")
    p.add_argument("--threads", type=int, default=1, help="torch threads (one is steadiest on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="mixle_runs", help="where the PNG goes")
    p.add_argument("--quick", action="store_true", help="tiny step counts: checks the script runs")
    args = p.parse_args(argv)
    if args.quick:
        args.fp32_steps, args.qat_steps, args.eval_windows = 60, 20, 32
        args.timing_rounds, args.timing_steps = 2, 3
    return args


# ------------------------------------------------------------------------------ data and loss


class Batches:
    """Random training windows from one seeded generator, so every method sees the same stream."""

    def __init__(self, ids, block, batch, seed):
        self.ids, self.block, self.batch = ids, block, batch
        self.rng = np.random.default_rng(seed)

    def __next__(self):
        starts = self.rng.integers(0, len(self.ids) - self.block - 1, self.batch)
        return torch.as_tensor(np.stack([self.ids[s : s + self.block + 1] for s in starts]))


def lm_loss(model, windows):
    logits = model(windows[:, :-1], all_positions=True)
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())


def held_out_windows(ids, block, count):
    count = min(count, (len(ids) - 1) // block)
    return torch.as_tensor(np.stack([ids[i * block : i * block + block + 1] for i in range(count)]))


def held_out_loss(model, windows, batch=64):
    model.eval()
    with torch.no_grad():
        total = sum(lm_loss(model, windows[i : i + batch]).item() * len(windows[i : i + batch])
                    for i in range(0, len(windows), batch))
    model.train()
    return total / len(windows)


# ------------------------------------------------------------------------------------ training


def make_step(model, params, lr, steps):
    """One AdamW training step; the learning rate follows a cosine from lr to lr/10 over ``steps``."""
    params = list(params)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    done = [0]

    def step(windows):
        progress = min(done[0], steps) / max(steps, 1)
        done[0] += 1
        for group in opt.param_groups:
            group["lr"] = lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, windows)
        loss.backward()
        opt.step()
        return loss.item()

    step.optimizer, step.params = opt, params
    return step


def train(step, batches, steps, desc):
    bar = tqdm(range(steps), desc=desc, unit="step", leave=False)
    for _ in bar:
        loss = step(next(batches))
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)


def median_step_seconds(steps, batches, rounds, per_round):
    """Median wall time of one training step per method, the methods interleaved round by round."""
    times = {name: [] for name in steps}
    for _ in tqdm(range(rounds), desc="timing steps", leave=False):
        for name, step in steps.items():
            step(next(batches))  # warm-up after switching method
            for _ in range(per_round):
                start = time.perf_counter()
                step(next(batches))
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def peak_step_bytes(step, windows):
    """Peak bytes of torch CPU tensors during one step: what lives before it plus the transient peak.

    Live before: parameters and optimizer state (counted once per storage; gradients are
    dropped first, since the profiler cannot see frees of blocks allocated before it started).
    Transient: the running sum of the CPU allocator's alloc/free events during the step.
    """
    step.optimizer.zero_grad(set_to_none=True)
    state = [t for s in step.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    before = _storage_bytes(list(step.params) + state)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        step(windows)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    running = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        running += e.nbytes()
        peak = max(peak, running)
    return before + peak


# ---------------------------------------------------------------------------------------- main


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train_ids, held_ids, tok = load_splits(args.corpus)
    fp32 = build_causal_lm(tok.vocab_size)
    block = fp32.block
    held = held_out_windows(held_ids, block, args.eval_windows)
    print(f"corpus: {len(train_ids)} train / {len(held_ids)} held-out tokens, vocab {tok.vocab_size}; "
          f"model d_model=128 n_layer=3 n_head=4 block={block} ({sum(p.numel() for p in fp32.parameters())} "
          f"parameters, head tied); batch {args.batch}x{block} tokens; torch threads {torch.get_num_threads()}; "
          f"int4 per-channel symmetric; LoRA r={args.rank} alpha={args.alpha:g}")

    train(make_step(fp32, fp32.parameters(), args.fp32_lr, args.fp32_steps),
          Batches(train_ids, block, args.batch, args.seed), args.fp32_steps, "fp32 checkpoint")

    full = apply_qat(copy.deepcopy(fp32), bits=4)
    lora = apply_lora(apply_qat(copy.deepcopy(fp32), bits=4), rank=args.rank, alpha=args.alpha)
    merged_fq = apply_lora(apply_qat(copy.deepcopy(fp32), bits=4), rank=args.rank, alpha=args.alpha,
                           quantize_merged=True)
    cont = copy.deepcopy(fp32)
    steps = {
        "fp32 (continued)": make_step(cont, cont.parameters(), args.qat_lr, args.qat_steps),
        "QAT int4 (full)": make_step(full, full.parameters(), args.qat_lr, args.qat_steps),
        "LoRA+QAT int4": make_step(lora, lora_parameters(lora), args.lora_lr, args.qat_steps),
        "LoRA+QAT int4 merged-fq": make_step(merged_fq, lora_parameters(merged_fq), args.lora_lr, args.qat_steps),
    }
    trainable = {name: sum(p.numel() for p in step.params) for name, step in steps.items()}
    for name, step in steps.items():
        train(step, Batches(train_ids, block, args.batch, args.seed + 1), args.qat_steps, name)

    # Score every int4 row as real int4 weights; the LoRA model is merged in a copy, so the
    # timing below can still run the adapters.
    int4 = {"PTQ int4": quantize_model(fp32, bits=4), "QAT int4 (full)": convert(full),
            "LoRA+QAT int4": convert(merge_lora(copy.deepcopy(lora))),
            "LoRA+QAT int4 merged-fq": convert(merge_lora(copy.deepcopy(merged_fq)))}
    unmerged = held_out_loss(lora, held)  # q(W) + float adapter, before the merge requantizes
    scored = {"fp32 checkpoint": fp32, "fp32 (continued)": cont, **int4}
    losses = {name: held_out_loss(model, held) for name, model in scored.items()}
    nbytes = {name: model_nbytes(model).total for name, model in scored.items()}

    timing = median_step_seconds(steps, Batches(train_ids, block, args.batch, args.seed + 2),
                                 args.timing_rounds, args.timing_steps)
    probe = next(Batches(train_ids, block, args.batch, args.seed + 3))
    peaks = {name: peak_step_bytes(step, probe) for name, step in steps.items()}
    gap = losses["PTQ int4"] - losses["fp32 checkpoint"]

    print()
    header = (f"{'method':23} {'held-out loss':>13} {'recovered':>9} {'trainable':>10} {'step ms':>8} "
              f"{'vs fp32':>7} {'peak MB':>8} {'vs fp32':>7} {'model bytes':>11}")
    print(header)
    print("-" * len(header))
    base_t, base_m = timing["fp32 (continued)"], peaks["fp32 (continued)"]
    for name, loss in losses.items():
        recovered = f"{100 * (losses['PTQ int4'] - loss) / gap:8.1f}%" if name in int4 and gap > 0 else f"{'-':>9}"
        if name in steps:
            cols = (f"{trainable[name]:>10} {1e3 * timing[name]:8.1f} {timing[name] / base_t:6.2f}x "
                    f"{peaks[name] / 2**20:8.2f} {peaks[name] / base_m:6.2f}x")
        else:
            cols = f"{'-':>10} {'-':>8} {'-':>7} {'-':>8} {'-':>7}"
        print(f"{name:23} {loss:13.4f} {recovered} {cols} {nbytes[name]:>11}")
    print(f"\nrecovered = (PTQ loss - loss) / (PTQ loss - fp32 checkpoint loss); PTQ gap {gap:.4f} nats. "
          f"Full QAT and LoRA+QAT trained {args.qat_steps} steps each from the checkpoint (peak lr {args.qat_lr:g} / "
          f"{args.lora_lr:g}, cosine to 1/10); 'fp32 (continued)' is the same extra training without quantization. "
          f"LoRA+QAT int4 before its merge (int4 base + float adapter, not storable as int4): {unmerged:.4f}; "
          f"merged-fq trains the merged weight's int4 grid directly, so it has no merge loss. "
          f"Step time: median of {args.timing_rounds}x{args.timing_steps} steps, methods interleaved. "
          f"Peak: torch CPU tensor bytes of one step (params, grads, optimizer state, activations; profiler). "
          f"One seed; held-out losses are single runs.")
    plot(losses, timing, peaks, trainable, args)
    return losses, timing, peaks, trainable


def plot(losses, timing, peaks, trainable, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    names = list(losses)
    axes[0].barh(names, [losses[n] for n in names], color=["0.6", "0.75", "tab:red", "tab:blue", "tab:green", "tab:olive"])
    axes[0].set_xlim(min(losses.values()) - 0.05, max(losses.values()) + 0.02)
    axes[0].set_xlabel("held-out loss (nats/char)")
    trained = list(timing)
    labels = [f"{textwrap.fill(n, 16)}\n{trainable[n]:,} trainable" for n in trained]
    axes[1].bar(labels, [1e3 * timing[n] for n in trained], color=["0.75", "tab:blue", "tab:green", "tab:olive"])
    axes[1].set_ylabel("median step (ms)")
    axes[2].bar(labels, [peaks[n] / 2**20 for n in trained], color=["0.75", "tab:blue", "tab:green", "tab:olive"])
    axes[2].set_ylabel("peak step memory (MiB)")
    for ax in axes[1:]:
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"int4 from one fp32 checkpoint: PTQ vs full QAT vs LoRA+QAT (r={args.rank})")
    fig.tight_layout()
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "lora_qat.png")
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
