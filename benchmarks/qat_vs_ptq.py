"""QAT vs PTQ on real text with a larger preset, and torchao's QAT side by side in the same run.

Runs ``mixle.lm.compare.run_compare`` (fp32 training, PTQ, fine-tune + PTQ, mixle QAT) and, when
torchao is installed, torchao's QAT (``IntxFakeQuantizeConfig(torch.int4, "per_channel")`` on the
same Linear layers and the tied embedding, same checkpoint, steps, batches and learning rate).
torchao's trained weights go through the same real-int4 evaluation as mixle's: mixle's
``quantize_model`` with the grid torchao fake-quantizes on (codes -8..7, scale = absmax / 7.5,
which is mixle's ``grid="qwix"``); its own fake-quant loss is reported next to it. Because that grid
has one more level than mixle's default (-7..7), the run also trains mixle's QAT and a fine-tune +
PTQ baseline on it, so the two QATs are compared on the same grid as well.

With several ``--seeds`` every figure is given per seed and as the median over seeds.

    python benchmarks/qat_vs_ptq.py                      # large preset, seed 0, torchao if present
    python benchmarks/qat_vs_ptq.py --preset default --seeds 0 1 2
    python benchmarks/qat_vs_ptq.py --preset default --seeds 0 --distill --learned-scales --act8

``--distill``, ``--learned-scales`` and ``--act8`` add mixle's QAT variants (self-distillation,
learned scales, both; 8da4w fine-tune + PTQ vs 8da4w QAT) and, with ``--act8``, torchao's 8da4w
QAT (int8 asymmetric per-token activations, int4 symmetric group-32 weights) on the same
checkpoint, batches and grid. Medians over seeds are printed per method, with each fine-tune's
time relative to the fp32 fine-tune (the training-step overhead, curve evaluations included).
"""

import argparse
import copy
import json
import math
import os
import statistics
import sys
import warnings

import torch
from torch import nn

from mixle._optional import is_available
from mixle.lm.compare import (
    ACT8_METHODS,
    OPTION_METHODS,
    MIN_DEGRADATION,
    PRESETS,
    ExternalQAT,
    format_table,
    prepare_data,
    run_compare,
    summarize,
    write_outputs,
)
from mixle.core.spec import QuantSpec


def _torchao_to_float(trained):
    """A copy of a torchao-QAT model with its fake-quantized layers back to plain ones (tie kept)."""
    from torchao.quantization.qat import FakeQuantizedEmbedding, FakeQuantizedLinear

    plain = copy.deepcopy(trained)
    for module in list(plain.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, FakeQuantizedLinear):
                setattr(module, name, child.to_linear())
            elif isinstance(child, FakeQuantizedEmbedding):
                setattr(module, name, child.to_embedding())
    assert plain.head.weight is plain.tok.weight
    return plain


def torchao_qat(bits=4):
    """An ExternalQAT entry running torchao's weight-only QAT, per-channel symmetric int4."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import FakeQuantizedEmbedding, FakeQuantizedLinear, IntxFakeQuantizeConfig, QATConfig

    dtype = {4: torch.int4, 8: torch.int8}[bits]

    def prepare(model):
        config = QATConfig(weight_config=IntxFakeQuantizeConfig(dtype, "per_channel", is_symmetric=True),
                           step="prepare")
        # Every Linear, and the token embedding (tied to the head, so stored once as ints), as in mixle.
        quantize_(model, config, filter_fn=lambda module, path: isinstance(module, nn.Linear) or path == "tok")
        assert isinstance(model.head, FakeQuantizedLinear) and isinstance(model.tok, FakeQuantizedEmbedding)
        assert model.head.weight is model.tok.weight, "torchao broke the tied head"
        return model

    return ExternalQAT(name="torchao QAT", bits=bits, prepare=prepare, to_float=_torchao_to_float,
                       spec=QuantSpec(bits=bits, grid="qwix"))


def torchao_8da4w(group_size=32):
    """An ExternalQAT entry running torchao's 8da4w QAT (QATConfig with int8 asymmetric per-token
    activations and int4 symmetric group weights), evaluated as mixle's 8da4w spec on the -8..7 grid."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import FakeQuantizedEmbedding, FakeQuantizedLinear, IntxFakeQuantizeConfig, QATConfig

    def prepare(model):
        act = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
        weight = IntxFakeQuantizeConfig(torch.int4, group_size=group_size, is_symmetric=True)
        # Linear layers (the tied head too) get activations and weights; the token embedding, tied
        # to the head and so stored once as int4, gets the weight config alone (it has no
        # activation to quantize), so training sees the weights deployment uses, as in mixle.
        quantize_(model, QATConfig(activation_config=act, weight_config=weight, step="prepare"),
                  filter_fn=lambda module, path: isinstance(module, nn.Linear))
        quantize_(model, QATConfig(weight_config=weight, step="prepare"), filter_fn=lambda module, path: path == "tok")
        assert isinstance(model.head, FakeQuantizedLinear) and isinstance(model.tok, FakeQuantizedEmbedding)
        assert model.head.weight is model.tok.weight, "torchao broke the tied head"
        return model

    spec = QuantSpec(bits=4, grid="qwix", group_size=group_size, act_bits=8, act_symmetric=False)
    return ExternalQAT(name=TORCHAO_8DA4W, bits=4, prepare=prepare, to_float=_torchao_to_float, spec=spec)


TORCHAO_8DA4W = "torchao 8da4w QAT"


def same_grid_entries(config, vocab):
    """mixle on torchao's grid (codes -8..7, scale absmax/7.5): a fine-tune + PTQ baseline and QAT.

    Both train exactly like the other fine-tunes. A QAT model's state_dict keys are those of the
    float model, so its trained weights load into a fresh float model for quantize_model.
    """
    from mixle.models.qat import apply_qat
    from mixle.models.transformer import build_causal_lm

    spec = QuantSpec(bits=4, grid="qwix")

    def as_float(trained):
        plain = build_causal_lm(vocab, config.d_model, config.n_layer, config.n_head, config.block)
        plain.load_state_dict(trained.state_dict(), strict=True)
        return plain

    return [ExternalQAT(name=BASELINE_QWIX, bits=4, prepare=lambda m: m, to_float=lambda m: m, spec=spec),
            ExternalQAT(name=QAT_QWIX, bits=4, prepare=lambda m: apply_qat(m, spec=spec), to_float=as_float,
                        spec=spec)]


BASELINE_QWIX = "fine-tune + PTQ (-8..7 grid)"
QAT_QWIX = "QAT (-8..7 grid)"


def same_grid_summary(results):
    """Recovered % of mixle's and torchao's QAT against fine-tune + PTQ on the same -8..7 grid."""
    loss = {r["method"]: r["loss"] for r in results["rows"] if r["bits"] in (4, 32)}
    if BASELINE_QWIX not in loss:
        return {}
    tuned, baseline = loss["fp32 fine-tune"], loss[BASELINE_QWIX]
    meaningful = baseline - tuned >= MIN_DEGRADATION
    return {name: {"loss": loss[name],
                   "recovered_percent": 100 * (baseline - loss[name]) / (baseline - tuned) if meaningful else None,
                   "perplexity_gap_percent": 100 * math.expm1(loss[name] - tuned)}
            for name in (QAT_QWIX, "torchao QAT") if name in loss}


def _median_summary(all_results, bits, methods, key=None):
    lines = []
    key = key or f"int{bits}"
    for method in methods:
        recovered = [r["summary"][key][method]["recovered_percent"] for r in all_results
                     if method in r["summary"].get(key, {})]
        gaps = [r["summary"][key][method]["perplexity_gap_percent"] for r in all_results
                if method in r["summary"].get(key, {})]
        if not gaps:
            continue
        rec = [x for x in recovered if x is not None]
        rec_text = (f"recovered median {statistics.median(rec):.1f}% (per seed: {', '.join(f'{x:.1f}' for x in rec)})"
                    if rec else "recovered: not meaningful (PTQ loses nothing measurable)")
        lines.append(f"{key} {method}: {rec_text}; perplexity vs fp32 fine-tune median "
                     f"{statistics.median(gaps):+.2f}% (per seed: {', '.join(f'{x:+.2f}' for x in gaps)})")
    return lines


def merge(dirs):
    """Medians over the runs saved (summary.json) in ``dirs``, one process per seed run side by side."""
    runs = []
    for folder in dirs:
        with open(os.path.join(folder, "summary.json")) as handle:
            runs += json.load(handle)["runs"]
    bits = sorted({b for r in runs for b in r["config"]["bits"]})
    methods = ["QAT", *OPTION_METHODS, "torchao QAT"]
    lines = [line for b in bits for line in _median_summary(runs, b, methods)]
    lines += _median_summary(runs, 4, [*ACT8_METHODS, TORCHAO_8DA4W], key="8da4w")
    lines += _median_table(runs)
    config = runs[0]["config"]
    lines.append(f"seeds {[r['config']['seed'] for r in runs]}: {runs[0]['model']['parameters']:,} parameters, "
                 f"d_model={config['d_model']}, n_layer={config['n_layer']}, {config['steps']} fp32 steps + "
                 f"{config['finetune_steps']} fine-tune steps, distill T={config['distill_temperature']} "
                 f"w={config['distill_weight']}, scale_lr={config['scale_lr'] or 10 * config['finetune_lr']:g}; "
                 f"torch {runs[0]['environment']['torch']}, {runs[0]['environment']['threads']} threads")
    print("\n".join(lines))
    return 0


def _median_table(all_results):
    """Median held-out loss and perplexity per method over seeds, and each fine-tune's time vs the fp32 one."""
    keys = list(dict.fromkeys((r["method"], r["bits"]) for res in all_results for r in res["rows"]))
    lines = ["", f"{'method (median over seeds)':<30}{'bits':>5}{'loss':>9}{'perplexity':>12}{'seeds':>6}"]
    for method, bits in keys:
        losses = [r["loss"] for res in all_results for r in res["rows"] if r["method"] == method and r["bits"] == bits]
        loss = statistics.median(losses)
        lines.append(f"{method:<30}{'fp32' if bits == 32 else f'int{bits}':>5}{loss:>9.4f}{math.exp(loss):>12.4f}"
                     f"{len(losses):>6}")
    phases = list(dict.fromkeys(p for res in all_results for p in res["seconds"] if p not in ("fp32", "fp32 fine-tune")))
    ratios = {p: statistics.median(res["seconds"][p] / res["seconds"]["fp32 fine-tune"]
                                   for res in all_results if p in res["seconds"]) for p in phases}
    lines.append("fine-tune time vs fp32 fine-tune, median over seeds (same steps; includes curve evaluations): "
                 + ", ".join(f"{p} {r:.2f}x" for p, r in ratios.items()))
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="large")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--finetune-steps", type=int)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's setting)")
    parser.add_argument("--no-torchao", action="store_true", help="skip torchao even if it is installed")
    parser.add_argument("--no-torchao-weight-only", action="store_true",
                        help="skip torchao's weight-only int4 QAT (keep its 8da4w QAT with --act8)")
    parser.add_argument("--no-same-grid", action="store_true",
                        help="skip mixle's fine-tune + PTQ and QAT on torchao's -8..7 grid")
    parser.add_argument("--distill", action="store_true", help="add QAT + self-distillation rows")
    parser.add_argument("--learned-scales", action="store_true", help="add QAT + learned scales rows")
    parser.add_argument("--act8", action="store_true", help="add 8da4w rows (mixle PTQ, mixle QAT, torchao QAT)")
    parser.add_argument("--distill-temperature", type=float)
    parser.add_argument("--distill-weight", type=float)
    parser.add_argument("--scale-lr", type=float)
    parser.add_argument("--bits", type=int, nargs="+")
    parser.add_argument("--out-dir", default="mixle_runs/qat_vs_ptq")
    parser.add_argument("--merge", nargs="+", metavar="DIR",
                        help="no training: print the medians over the runs saved in these --out-dir folders "
                             "(e.g. one process per seed, run side by side)")
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge)

    changes = {k: v for k, v in (("steps", args.steps), ("finetune_steps", args.finetune_steps),
                                 ("threads", args.threads), ("distill_temperature", args.distill_temperature),
                                 ("distill_weight", args.distill_weight), ("scale_lr", args.scale_lr),
                                 ("bits", tuple(args.bits) if args.bits else None)) if v is not None}
    changes.update({k: True for k in ("distill", "learned_scales", "act8") if getattr(args, k)})
    base = PRESETS[args.preset].replace(**changes)
    external = []
    if not args.no_torchao:
        if is_available("torchao"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if not args.no_torchao_weight_only:
                    external.append(torchao_qat(4))
                if args.act8:
                    external.append(torchao_8da4w(base.act8_group_size))
        else:
            print("torchao is not installed (pip install mixle[bench]): running mixle only", file=sys.stderr)

    all_results = []
    for seed in args.seeds:
        config = base.replace(seed=seed)
        data = prepare_data(config)
        entries = list(external)
        if not args.no_same_grid and 4 in config.bits:
            entries = same_grid_entries(config, data.tokenizer.vocab_size) + entries
        results = run_compare(config, data=data, external=entries)
        results["same_grid"] = same_grid_summary(results)
        if results["same_grid"]:
            # Each QAT against the PTQ baseline on its own grid: the -8..7 ones are summarised below.
            results["summary"] = summarize(results["rows"], config.bits, (), [TORCHAO_8DA4W])
        out = os.path.join(args.out_dir, f"seed{seed}")
        write_outputs(results, out)
        print(f"\n=== preset {args.preset}, seed {seed} ({out}) ===")
        print(format_table(results))
        for row in results["rows"]:
            if row["method"] not in ("QAT", BASELINE_QWIX, *OPTION_METHODS, *ACT8_METHODS) and "fake_quant_loss" in row:
                print(f"{row['method']}: its own fake-quant loss {row['fake_quant_loss']:.4f}, real int{row['bits']} "
                      f"({row['spec']}) {row['loss']:.4f}")
        for name, entry in results["same_grid"].items():
            recovered = ("PTQ loses nothing measurable" if entry["recovered_percent"] is None
                         else f"recovers {entry['recovered_percent']:.1f}% of what {BASELINE_QWIX} loses")
            print(f"int4 on the -8..7 grid, {name}: {recovered}; perplexity "
                  f"{entry['perplexity_gap_percent']:+.2f}% vs fp32 fine-tune")
        seconds = results["seconds"]
        tuned = seconds["fp32 fine-tune"]
        print("fine-tune phase time vs fp32 fine-tune (same steps, includes curve evaluations): "
              + ", ".join(f"{phase} {s:.0f} s ({s / tuned:.2f}x)" for phase, s in seconds.items() if phase != "fp32"))
        all_results.append(results)

    methods = ["QAT", *OPTION_METHODS] + [e.name for e in external if e.spec.act_bits is None]
    lines = [line for bits in base.bits for line in _median_summary(all_results, bits, methods)]
    lines += _median_summary(all_results, 4, [*ACT8_METHODS, TORCHAO_8DA4W], key="8da4w")
    lines += _median_table(all_results)
    for name in (QAT_QWIX, "torchao QAT"):
        runs = [r["same_grid"][name] for r in all_results if name in r.get("same_grid", {})]
        if runs:
            rec = [x["recovered_percent"] for x in runs if x["recovered_percent"] is not None]
            gap = [x["perplexity_gap_percent"] for x in runs]
            rec_text = (f"recovered median {statistics.median(rec):.1f}% (per seed: {', '.join(f'{x:.1f}' for x in rec)})"
                        if rec else "recovered: not meaningful (PTQ loses nothing measurable)")
            lines.append(f"int4 -8..7 grid, {name}: {rec_text}; perplexity vs fp32 fine-tune median "
                         f"{statistics.median(gap):+.2f}% (per seed: {', '.join(f'{x:+.2f}' for x in gap)})")
    first = all_results[0]
    lines.append(f"preset {args.preset}: {first['model']['parameters']:,} parameters, d_model={base.d_model}, "
                 f"n_layer={base.n_layer}, block={base.block}, batch {base.batch_size}, {base.steps} fp32 steps + "
                 f"{base.finetune_steps} fine-tune steps; seeds {args.seeds}; torch {first['environment']['torch']}, "
                 f"{first['environment']['threads']} threads")
    print("\n" + "\n".join(lines))
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "summary.json"), "w") as handle:
        json.dump({"preset": args.preset, "seeds": args.seeds, "lines": lines,
                   "runs": [{k: r[k] for k in ("config", "environment", "data", "model", "rows", "summary",
                                               "same_grid", "seconds")}
                            for r in all_results]}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
