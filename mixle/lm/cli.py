"""The ``mixle`` command line: ``mixle compare`` runs the QAT-vs-PTQ comparison on real text;
``mixle finetune`` turns a pretrained checkpoint into a QAT-trained quantized file."""

import argparse
import sys

from mixle.lm.flags import add_flags, changes_from_args

__all__ = ["main", "build_parser", "config_from_args"]


def build_parser():
    """The argument parser of the ``mixle`` command; ``compare``'s flags are ``CompareConfig``'s fields.

    >>> build_parser().parse_args(["compare", "--steps", "5", "--no-gguf"]).steps
    5
    """
    from mixle.lm.config import PRESETS, CompareConfig

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
    add_flags(cmp, CompareConfig)
    cmp.add_argument("--out-dir", default="mixle_runs/compare", help="output directory (default: %(default)s)")
    cmp.add_argument("--no-progress", action="store_true", help="no progress bars")
    cmp.set_defaults(subparser=cmp)
    _add_finetune(commands)
    return parser


def _add_finetune(commands):
    """The ``finetune`` subcommand; its flags are ``FinetuneConfig``'s fields."""
    from mixle.lm.finetune_config import FinetuneConfig

    ft = commands.add_parser(
        "finetune",
        help="QAT-fine-tune a pretrained causal LM (directory, GGUF or hub id) into a q4_0 / Q4_K_M / int4 file",
        description="Load a pretrained transformers causal LM (a directory with config, safetensors and tokenizer; "
                    "a GGUF file; or a hub id where the hub is reachable), evaluate it in float and after PTQ on "
                    "the target, fine-tune it with quantization-aware training distilled from the float model, and "
                    "write the GGUF (and a compressed-tensors directory for integer grids), results.json, "
                    "table.txt, finetune.png and a README.md model card into --out. Ctrl-C or SIGTERM writes a "
                    "checkpoint; --resume DIR continues exactly where it stopped.")
    add_flags(ft, FinetuneConfig)
    ft.add_argument("--resume", metavar="DIR", help="continue the interrupted run whose --out is DIR (its flags are "
                                                    "taken from its checkpoint)")
    ft.add_argument("--no-progress", action="store_true", help="no progress bar")
    ft.set_defaults(subparser=ft)


def config_from_args(args):
    """The CompareConfig of a parsed ``compare`` command: the preset with the given flags applied.

    >>> config_from_args(build_parser().parse_args(["compare", "--preset", "smoke", "--bits", "4"])).bits
    (4,)
    """
    from mixle.lm.config import PRESETS, CompareConfig

    return PRESETS[args.preset].replace(**changes_from_args(args, CompareConfig))


def main(argv=None):
    """Entry point of ``mixle`` / ``python -m mixle``; returns the exit status.

    Bad flags exit with status 2 and a usage line; a failed run prints one ``mixle: error:`` line
    (no traceback) and exits 1; Ctrl-C exits 130.

    >>> main(["compare", "--preset", "smoke", "--bits", "3"])  # prints the usage and the reason
    Traceback (most recent call last):
    SystemExit: 2
    """
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command == "compare":
            return _compare(args)
        if args.command == "finetune":
            from mixle.lm.finetune_cli import finetune_command

            return finetune_command(args)
    except KeyboardInterrupt:
        return _fail("interrupted (Ctrl-C); no complete run was written", status=130)
    parser.error(f"unknown command {args.command!r}")


def _fail(message, status=1):
    print(f"mixle: error: {message}", file=sys.stderr)
    return status


def _compare(args):
    from mixle.lm.compare import run_compare  # looked up at each run (tests replace it)
    from mixle.lm.grad_leaf import NonFiniteLossError
    from mixle.lm.report import check_out_dir, format_table, write_outputs
    from mixle.lm.windows import prepare_data

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
        what = str(err).split(": training stopped")[0]
        return _fail(f"training diverged ({what}): lower --lr or --finetune-lr, or check the corpus")
    print(format_table(results), flush=True)  # the result is shown before anything can fail to write
    try:
        paths = write_outputs(results, args.out_dir)
    except OSError as err:
        return _fail(f"could not write the outputs into {args.out_dir} ({err.strerror or err}); the table above is "
                     f"this run's result, and the folder holds no complete.json for it")
    print(f"\nwrote {paths['table.txt']}, {paths['results.json']}, {paths['compare.png']} and {paths['complete.json']}")
    return 0
