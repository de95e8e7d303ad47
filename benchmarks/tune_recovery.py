"""Choose the distillation temperature/weight and the learned-scale learning rate on a validation
split carved from the *training* text (the held-out text is never looked at).

The last ``--val-fraction`` of the training ids becomes the validation text; the fp32 model trains
on the rest exactly like ``mixle compare`` (same preset), then every candidate fine-tune (int4 QAT
with the preset's spec) starts from that checkpoint with the same batches, and the validation loss
of its real int4 model (``convert``) is printed beside fp32 fine-tune, fine-tune + PTQ and plain QAT.

    python benchmarks/tune_recovery.py --preset default --threads 2
"""

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mixle.api import apply_qat, convert, quantize_model, set_fake_quant_enabled  # noqa: E402
from mixle.lm.compare import PRESETS, CompareRun, held_out_windows, prepare_data  # noqa: E402


def carve_validation(data, config, fraction):
    """Train on the first ``1 - fraction`` of the training ids; validate on the rest."""
    ids = data.train_ids
    cut = int(len(ids) * (1 - fraction))
    val = ids[cut:].numpy()
    data.train_starts = torch.arange(cut - config.block)  # every training window lies before the cut
    data.eval_windows = held_out_windows(val, config.block, config.eval_windows)
    data.curve_windows = held_out_windows(val, config.block, config.curve_windows)
    data.info = dict(data.info, validation_tokens=len(val), train_tokens=cut)
    return data


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--steps", type=int, help="fp32 training steps (default: the preset's)")
    parser.add_argument("--finetune-steps", type=int, help="fine-tune steps (default: the preset's)")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--checkpoint", help="reuse the fp32 model saved here by an earlier run with the same "
                                             "preset, seed and steps (saved here if the file does not exist)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 2.0])
    parser.add_argument("--weights", type=float, nargs="*", default=[0.1, 0.25, 0.5, 0.9])
    parser.add_argument("--scale-lr-factors", type=float, nargs="*", default=[1.0, 10.0, 30.0],
                        help="learned-scale lr as multiples of the preset's finetune_lr")
    parser.add_argument("--combine", action="store_true",
                        help="also every learned-scale lr x distillation setting together (learned + distill)")
    return parser.parse_args(argv)


def fp32_checkpoint(run, path):
    """The fp32 model: loaded from ``path`` if it exists, else trained (and saved there when given)."""
    lm = run.build_model()
    if path and Path(path).exists():
        lm.load_state_dict(torch.load(path))
    else:
        run.pretrain(lm)
        if path:
            torch.save(lm.state_dict(), path)
    return lm


def candidates(args, config):
    """``(name, config changes, learned scales, distill)`` of every candidate fine-tune."""
    if args.combine:
        return [(f"QAT + learned x{factor:g} + distill T={temperature:g} w={weight:g}",
                 dict(scale_lr=config.finetune_lr * factor, distill_temperature=temperature, distill_weight=weight),
                 True, True)
                for factor, temperature, weight in itertools.product(args.scale_lr_factors, args.temperatures,
                                                                     args.weights)]
    learned = [(f"QAT + learned scales, scale_lr x{factor:g}", dict(scale_lr=config.finetune_lr * factor), True, False)
               for factor in args.scale_lr_factors]
    distilled = [(f"QAT + distill, T={temperature:g} w={weight:g}",
                  dict(distill_temperature=temperature, distill_weight=weight), False, True)
                 for temperature, weight in itertools.product(args.temperatures, args.weights)]
    return learned + distilled


def print_summary(args, data, run, results, floats):
    base, tuned_loss = results["fine-tune + PTQ"], results["fp32 fine-tune"]
    print(f"\nvalidation ({data.info['validation_tokens']:,} tokens carved from the training text; preset "
          f"{args.preset}, seed {args.seed}): recovered % of fine-tune + PTQ's degradation, perplexity vs fp32 fine-tune")
    for name, loss in results.items():
        if name in ("fp32 fine-tune", "fine-tune + PTQ"):
            continue
        line = f"{name:<40} {100 * (base - loss) / (base - tuned_loss):6.1f}%  {100 * math.expm1(loss - tuned_loss):+.2f}%"
        if name in floats:  # of the int model's gap to fp32 fine-tune, the share already in its float weights
            line += (f"   float weights {100 * math.expm1(floats[name] - tuned_loss):+.2f}%, "
                     f"rounding {100 * math.expm1(loss - floats[name]):+.2f}%")
        print(line)
    print("phase seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in run.seconds.items()))


def main(argv=None):
    args = parse_args(argv)
    changes = {k: v for k, v in (("steps", args.steps), ("finetune_steps", args.finetune_steps)) if v is not None}
    config = PRESETS[args.preset].replace(seed=args.seed, bits=(4,), threads=args.threads, **changes)
    if config.threads:
        torch.set_num_threads(config.threads)
    data = carve_validation(prepare_data(config), config, args.val_fraction)
    run = CompareRun(config, data, progress=True)
    lm = fp32_checkpoint(run, args.checkpoint)
    spec = config.spec(4)
    results, floats = {}, {}

    def report(name, model, qat=True):
        if qat:
            # The same trained weights with fake-quant off: splits QAT's remaining gap to the fp32
            # fine-tune into "the float weights are worse" and "rounding them costs".
            set_fake_quant_enabled(model, False)
            floats[name] = run.loss(model)
            set_fake_quant_enabled(model, True)
            model = convert(model)
        results[name] = run.loss(model)
        print(f"{name:<40} validation loss {results[name]:.4f}", flush=True)

    tuned = run.finetune(lm, "fp32 fine-tune")
    report("fp32 fine-tune", tuned, qat=False)
    report("fine-tune + PTQ", quantize_model(tuned, spec), qat=False)
    report("QAT", run.finetune(lm, "QAT", lambda m: apply_qat(m, spec=spec)))
    for name, settings, learned, distill in candidates(args, config):
        run.config = config.replace(**settings)
        trial = spec.replace(scale="learned") if learned else spec
        report(name, run.finetune(lm, name, lambda m, s=trial: apply_qat(m, spec=s), distill=distill))
    print_summary(args, data, run, results, floats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
