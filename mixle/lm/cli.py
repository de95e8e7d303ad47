"""The ``mixle`` command line: ``mixle compare`` runs the QAT-vs-PTQ comparison on real text."""

import argparse
import sys

__all__ = ["main", "build_parser", "config_from_args"]


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def build_parser():
    """The argument parser of the ``mixle`` command."""
    from mixle.lm.compare import PRESETS

    parser = argparse.ArgumentParser(prog="mixle", description="Quantization-aware training toolkit.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cmp = commands.add_parser(
        "compare", help="train a small causal LM, then compare PTQ, fine-tune + PTQ and QAT at int4/int8",
        description="Train a causal LM in fp32 on real text, then for each bit width compare PTQ of it, "
                    "a fine-tune for N more steps followed by PTQ, and QAT for the same N steps; all "
                    "evaluated as real int weights on held-out text. Writes table.txt, results.json, "
                    "compare.png and, last, complete.json (their sha256) into the output directory.")
    cmp.add_argument("--preset", choices=sorted(PRESETS), default="default",
                     help="starting configuration; the flags below override it (default: %(default)s)")
    cmp.add_argument("--steps", type=_positive_int, help="fp32 training steps from scratch")
    cmp.add_argument("--finetune-steps", type=_positive_int, help="extra steps for QAT and for the fp32 fine-tune")
    cmp.add_argument("--bits", type=int, nargs="+", help="bit widths to compare: 4 and/or 8")
    cmp.add_argument("--d-model", type=_positive_int, help="model width")
    cmp.add_argument("--n-layer", type=_positive_int, help="transformer blocks")
    cmp.add_argument("--n-head", type=_positive_int, help="attention heads")
    cmp.add_argument("--block", type=_positive_int, help="context length in tokens")
    cmp.add_argument("--batch-size", type=_positive_int, help="windows per training step")
    cmp.add_argument("--lr", type=float, help="peak learning rate of fp32 training")
    cmp.add_argument("--finetune-lr", type=float, help="peak learning rate of QAT and the fp32 fine-tune")
    cmp.add_argument("--group-size", type=_positive_int, help="per-group scales of this many inputs (default: per channel)")
    cmp.add_argument("--clip-percentile", type=float, help="scale from this percentile of |w| (default: the max)")
    cmp.add_argument("--corpus", help="a UTF-8 text file (default: the embedded CPython documentation topics)")
    cmp.add_argument("--tokenizer", choices=("char", "byte"), help="char- or byte-level tokens (default: char)")
    cmp.add_argument("--eval-windows", type=_positive_int, help="evaluate on at most this many held-out windows")
    cmp.add_argument("--seed", type=int, help="seed of initialisation, split and batches")
    cmp.add_argument("--threads", type=_positive_int, help="torch CPU threads")
    cmp.add_argument("--distill", action="store_true",
                     help="also run QAT with self-distillation from the fp32 checkpoint (mixle.lm.distill)")
    cmp.add_argument("--distill-temperature", type=float, help="temperature T of the distillation KL term")
    cmp.add_argument("--distill-weight", type=float, help="weight w in (0, 1] of the distillation KL term")
    cmp.add_argument("--learned-scales", action="store_true",
                     help="also run QAT with learned scales (QuantSpec(scale='learned'); with --distill also both)")
    cmp.add_argument("--scale-lr", type=float, help="learning rate of the learned scales (default: 10 x --finetune-lr)")
    cmp.add_argument("--act8", action="store_true",
                     help="also compare 8da4w (int8 per-token activations, int4 group-32 weights): fine-tune + PTQ vs QAT")
    cmp.add_argument("--no-gguf", dest="gguf", action="store_false", default=None,
                     help="leave out the llama.cpp rows (QAT on q4_0 vs fine-tune + PTQ into Q4_0, evaluated from "
                          "the GGUF file; also run in llama.cpp when llama-cpp-python is installed)")
    cmp.add_argument("--out-dir", default="mixle_runs/compare", help="output directory (default: %(default)s)")
    cmp.add_argument("--no-progress", action="store_true", help="no progress bars")
    cmp.set_defaults(subparser=cmp)
    return parser


_FIELDS = ("steps", "finetune_steps", "bits", "d_model", "n_layer", "n_head", "block", "batch_size", "lr",
           "finetune_lr", "group_size", "clip_percentile", "corpus", "tokenizer", "eval_windows", "seed", "threads",
           "distill_temperature", "distill_weight", "scale_lr")


def config_from_args(args):
    """The CompareConfig of a parsed ``compare`` command: the preset with the given flags applied."""
    from mixle.lm.compare import PRESETS

    changes = {name: getattr(args, name) for name in _FIELDS if getattr(args, name) is not None}
    for flag in ("distill", "learned_scales", "act8"):
        if getattr(args, flag, False):
            changes[flag] = True
    if getattr(args, "gguf", None) is False:
        changes["gguf"] = False
    if "bits" in changes:
        changes["bits"] = tuple(changes["bits"])
    return PRESETS[args.preset].replace(**changes)


def main(argv=None):
    """Entry point of ``mixle`` / ``python -m mixle``; returns the exit status.

    Bad flags exit with status 2 and a usage line; a failed run prints one ``mixle: error:`` line
    (no traceback) and exits 1; Ctrl-C exits 130.
    """
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command == "compare":
            return _compare(args)
    except KeyboardInterrupt:
        return _fail("interrupted (Ctrl-C); no complete run was written", status=130)
    parser.error(f"unknown command {args.command!r}")


def _fail(message, status=1):
    print(f"mixle: error: {message}", file=sys.stderr)
    return status


def _compare(args):
    from mixle.lm.compare import check_out_dir, format_table, prepare_data, run_compare, write_outputs
    from mixle.lm.grad_leaf import NonFiniteLossError

    try:
        config = config_from_args(args)
        data = prepare_data(config)  # missing corpus, empty text, block larger than the data
        check_out_dir(args.out_dir)  # before training: a finished run is never lost to a bad --out-dir
    except (FileNotFoundError, ValueError, TypeError) as err:
        args.subparser.error(str(err).replace("out_dir=", "--out-dir "))
    except ImportError as err:
        return _fail(str(err))
    try:
        results = run_compare(config, data=data, progress=not args.no_progress)
    except NonFiniteLossError as err:
        what = str(err).split(": stopped")[0]
        return _fail(f"training diverged ({what}): lower --lr or --finetune-lr, or check the corpus")
    print(format_table(results), flush=True)  # the result is shown before anything can fail to write
    try:
        paths = write_outputs(results, args.out_dir)
    except OSError as err:
        return _fail(f"could not write the outputs into {args.out_dir} ({err.strerror or err}); the table above is "
                     f"this run's result, and the folder holds no complete.json for it")
    print(f"\nwrote {paths['table.txt']}, {paths['results.json']}, {paths['compare.png']} and {paths['complete.json']}")
    return 0
