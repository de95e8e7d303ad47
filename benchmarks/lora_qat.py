"""LoRA+QAT vs full QAT vs PTQ at int4 on the main job's model and corpus, from one fp32 checkpoint.

The main job (``mixle.lm.compare.run_compare``) trains the default ``build_causal_lm`` in fp32 on the
embedded corpus, then PTQ, an fp32 fine-tune (+ PTQ) and full QAT at int4. Two LoRA+QAT runs join
it as extra methods, trained by the same loop on the same batches with the same learning rate:

* ``LoRA+QAT``: frozen fake-quantized base, float rank-r adapters; then ``merge_lora`` and real
  int4 weights of the merged model (its loss before the merge is the "fake-quant" column).
* ``LoRA+QAT merged-fq``: ``quantize_merged=True``, the merged weight ``W + alpha/r B A`` is
  what is fake-quantized while training, so merging loses nothing.

Every int4 row is evaluated as real int4 weights. Step time (median, methods interleaved) and the
peak memory of training steps are measured on the same loop (``GradLeaf``) afterwards.

    python benchmarks/lora_qat.py            # about 15 minutes on one busy CPU thread
    python benchmarks/lora_qat.py --quick    # the main job's smoke preset, well under a minute
"""

import argparse
import copy
import os
import statistics
import textwrap
import time

import torch

from mixle.lm.compare import PRESETS, ExternalQAT, prepare_data, run_compare, write_outputs
from mixle.lm.training import window_density
from mixle.experimental.program.lora import apply_lora, merge_lora
from mixle.models.grad_leaf import GradLeaf
from mixle.models.qat import apply_qat
from mixle.models.transformer import build_causal_lm


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default=None, help="UTF-8 text file (default: the embedded corpus)")
    p.add_argument("--steps", type=int, default=None, help="fp32 steps (default: the main job's)")
    p.add_argument("--finetune-steps", type=int, default=None, help="steps of each fine-tune/QAT run")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--timing-rounds", type=int, default=5, help="interleaved rounds of step timing")
    p.add_argument("--timing-steps", type=int, default=10, help="timed steps per method per round")
    p.add_argument("--threads", type=int, default=1, help="torch threads (one is steadiest on a shared machine)")
    p.add_argument("--out-dir", default=os.path.join("mixle_runs", "lora_qat"))
    p.add_argument("--quick", action="store_true", help="the main job's smoke preset: checks the script runs")
    args = p.parse_args(argv)
    config = PRESETS["smoke" if args.quick else "default"].replace(bits=(4,), threads=args.threads)
    changes = {"corpus": args.corpus, "steps": args.steps, "finetune_steps": args.finetune_steps}
    config = config.replace(**{k: v for k, v in changes.items() if v is not None})
    if args.quick:
        args.timing_rounds, args.timing_steps = 2, 3
    return args, config


def lora_method(name, config, vocab, rank, alpha, quantize_merged):
    """An ``ExternalQAT`` entry: LoRA on a fake-quantized copy; merged back to float for real int4."""
    spec = config.spec(4)

    def prepare(model):
        return apply_lora(apply_qat(model, spec=spec), rank=rank, alpha=alpha, quantize_merged=quantize_merged)

    def to_float(trained):
        # After the merge the state_dict has exactly the base model's keys; quantize_model(., spec)
        # of this float copy gives the same int4 codes as convert() of the merged QAT model.
        merged = merge_lora(copy.deepcopy(trained))
        float_lm = build_causal_lm(vocab, config.d_model, config.n_layer, config.n_head, config.block)
        float_lm.load_state_dict(merged.state_dict())
        return float_lm

    return ExternalQAT(name=name, bits=4, prepare=prepare, to_float=to_float, spec=spec)


# ---------------------------------------------------------------------------- step time, memory


def cost_models(config, vocab, rank, alpha):
    """Each method's trainable model, on fresh weights (step cost does not depend on their values)."""
    torch.manual_seed(config.seed)
    lm = build_causal_lm(vocab, config.d_model, config.n_layer, config.n_head, config.block)
    spec = config.spec(4)
    return {
        "fp32 fine-tune": copy.deepcopy(lm),
        "QAT": apply_qat(copy.deepcopy(lm), spec=spec),
        "LoRA+QAT": apply_lora(apply_qat(copy.deepcopy(lm), spec=spec), rank=rank, alpha=alpha),
        "LoRA+QAT merged-fq": apply_lora(apply_qat(copy.deepcopy(lm), spec=spec), rank=rank, alpha=alpha,
                                         quantize_merged=True),
    }


def _leaf(model, data, config, steps, callback):
    # The main job's training settings (mixle.lm.compare), one GradLeaf per method.
    return GradLeaf(window_density(model, data.train_ids), m_steps=steps, lr=config.finetune_lr,
                    batch_size=config.batch_size, optimizer=torch.optim.AdamW, grad_clip=float(config.block),
                    seed=config.seed + 2, callback=callback)


def median_step_seconds(leaves, stamps, data, rounds):
    """Median seconds between consecutive steps of each method's loop, methods interleaved by round."""
    from tqdm import tqdm

    times = {name: [] for name in leaves}
    for _ in tqdm(range(rounds), desc="timing steps", leave=False):
        for name, leaf in leaves.items():
            stamps[name].clear()
            leaf.fit(data.train_starts)
            times[name] += [b - a for a, b in zip(stamps[name], stamps[name][1:])]  # first step: warm-up
    return {name: statistics.median(t) for name, t in times.items()}


def _storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def peak_training_bytes(leaf, data):
    """Peak bytes of torch CPU tensors while the loop trains: what lives before plus the transient peak.

    Before: parameters, buffers and optimizer state, once per storage (gradients are dropped
    first: the profiler does not see frees of blocks allocated before it started). Transient:
    the running sum of the CPU allocator's alloc/free events during ``leaf.fit``.
    """
    leaf.optimizer.zero_grad(set_to_none=True)
    module = leaf.module
    state = [t for s in leaf.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    before = _storage_bytes(list(module.parameters()) + list(module.buffers()) + state)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        leaf.fit(data.train_starts)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    running = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        running += e.nbytes()
        peak = max(peak, running)
    return before + peak


def measure_costs(config, data, args):
    models = cost_models(config, data.tokenizer.vocab_size, args.rank, args.alpha)
    trainable = {name: sum(p.numel() for p in m.parameters() if p.requires_grad) for name, m in models.items()}
    stamps = {name: [] for name in models}
    leaves = {name: _leaf(m, data, config, args.timing_steps + 1,
                          lambda step, loss, s=stamps[name]: s.append(time.perf_counter()))
              for name, m in models.items()}
    previous = torch.get_num_threads()
    torch.set_num_threads(config.threads or previous)
    try:
        seconds = median_step_seconds(leaves, stamps, data, args.timing_rounds)
        peaks = {name: peak_training_bytes(leaf, data) for name, leaf in leaves.items()}
    finally:
        torch.set_num_threads(previous)
    return trainable, seconds, peaks


# ---------------------------------------------------------------------------------------- report


def report(results, trainable, seconds, peaks, config, args):
    rows = results["rows"]
    summary = results["summary"]["int4"]
    checkpoint_ptq = next(r["loss"] for r in rows if r["method"] == "PTQ" and r["bits"] == 4)
    base_t, base_m = seconds["fp32 fine-tune"], peaks["fp32 fine-tune"]
    header = (f"{'method':19} {'bits':>4} {'held-out':>9} {'fake-q':>7} {'recovered':>9} {'trainable':>10} "
              f"{'step ms':>8} {'vs fp32':>7} {'peak MiB':>8} {'vs fp32':>7} {'bytes':>9}")
    lines = [header, "-" * len(header)]
    for row in rows:
        name = row["method"]
        recovered = (summary.get(name) or {}).get("recovered_percent")
        cells = [f"{name:19}", f"{'fp32' if row['bits'] == 32 else 'int' + str(row['bits']):>4}", f"{row['loss']:9.4f}",
                 f"{row['fake_quant_loss']:7.4f}" if "fake_quant_loss" in row else f"{'-':>7}",
                 f"{recovered:8.1f}%" if recovered is not None else f"{'-':>9}"]
        if name in seconds:
            cells += [f"{trainable[name]:>10,}", f"{1e3 * seconds[name]:8.1f}", f"{seconds[name] / base_t:6.2f}x",
                      f"{peaks[name] / 2**20:8.2f}", f"{peaks[name] / base_m:6.2f}x"]
        else:
            cells += [f"{'-':>10}", f"{'-':>8}", f"{'-':>7}", f"{'-':>8}", f"{'-':>7}"]
        lines.append(" ".join(cells + [f"{row['bytes']:>9,}"]))
    env, data = results["environment"], results["data"]
    lines += [
        "",
        *[f"int4: {v['note']}" for v in summary.values() if isinstance(v, dict)],
        f"held-out loss below PTQ of the fp32 checkpoint ({checkpoint_ptq:.4f}): "
        + ", ".join(f"{r['method']} {checkpoint_ptq - r['loss']:+.4f} nats"
                    for r in rows if r["method"] in ("QAT", "LoRA+QAT", "LoRA+QAT merged-fq")),
        f"recovered = (fine-tune+PTQ loss - loss) / (fine-tune+PTQ loss - fp32 fine-tune loss), as in the main job. "
        f"fake-q: held-out loss of the trained QAT model before merge/convert. LoRA rank {args.rank}, alpha "
        f"{args.alpha:g}, adapters on every block Linear (the head is tied to the embedding, so it has none).",
        f"{config.steps} fp32 steps, then {config.finetune_steps} steps per fine-tune (lr {config.finetune_lr:g}, "
        f"batch {config.batch_size}x{config.block}); model d_model={config.d_model} n_layer={config.n_layer} "
        f"n_head={config.n_head}, {results['model']['parameters']:,} parameters; {data['predicted_tokens']:,} held-out "
        f"tokens; torch {env['torch']}, {env['threads']} thread(s); one seed.",
        f"step: median over {args.timing_rounds}x{args.timing_steps} steps of the main job's loop (GradLeaf, which "
        f"snapshots all parameters each step), methods interleaved; peak: torch CPU tensor bytes while training "
        f"(parameters, gradients, optimizer state, activations, loop snapshot), from profiler alloc/free events.",
    ]
    return "\n".join(lines)


def plot_costs(trainable, seconds, peaks, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(seconds)
    labels = [f"{textwrap.fill(n, 16, break_on_hyphens=False)}\n{trainable[n]:,} trainable" for n in names]
    colors = ["0.7", "tab:blue", "tab:green", "tab:olive"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(labels, [1e3 * seconds[n] for n in names], color=colors)
    axes[0].set_ylabel("median training step (ms)")
    axes[1].bar(labels, [peaks[n] / 2**20 for n in names], color=colors)
    axes[1].set_ylabel("peak training memory (MiB)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("cost of a training step: fp32 vs full QAT vs LoRA+QAT (int4)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None):
    args, config = parse_args(argv)
    data = prepare_data(config)
    vocab = data.tokenizer.vocab_size
    external = [lora_method("LoRA+QAT", config, vocab, args.rank, args.alpha, False),
                lora_method("LoRA+QAT merged-fq", config, vocab, args.rank, args.alpha, True)]
    results = run_compare(config, data=data, external=external)
    trainable, seconds, peaks = measure_costs(config, data, args)
    text = report(results, trainable, seconds, peaks, config, args)
    print("\n" + text)
    paths = write_outputs(results, args.out_dir)  # results.json, table.txt, compare.png (losses, curves)
    with open(os.path.join(args.out_dir, "lora_qat.txt"), "w") as handle:
        handle.write(text + "\n")
    cost_png = plot_costs(trainable, seconds, peaks, os.path.join(args.out_dir, "lora_qat_cost.png"))
    print(f"\nwrote {', '.join(sorted(paths.values()))}, {cost_png} and lora_qat.txt in {args.out_dir}")
    return results, trainable, seconds, peaks


if __name__ == "__main__":
    main()
