"""``mixle finetune`` on the command line: flags to a ``FinetuneConfig``, the run, one-line errors.

Exit status: 0 done; 2 bad flags (with the usage line); 1 a run that failed (one ``mixle: error:``
line naming the input and the fix: a bad model, data, target or output directory, a diverged
loss, a failed write); 130 stopped by Ctrl-C or SIGTERM (the checkpoint is written and the line
says how to resume).
"""

import os
import sys
from pathlib import Path

from mixle.lm.flags import changes_from_args

__all__ = ["finetune_command", "config_from_finetune_args"]


def _fail(message, status=1):
    print(f"mixle: error: {message}", file=sys.stderr)
    return status


def config_from_finetune_args(args):
    """The ``FinetuneConfig`` of parsed ``finetune`` flags; with ``--resume DIR``, the interrupted run's.

    Raises:
        ValueError, FileNotFoundError: missing ``--model`` / ``--out``, a bad value, a checkpoint
            that cannot be read, or a flag that differs from the interrupted run's.

    >>> from mixle.lm.cli import build_parser
    >>> config_from_finetune_args(build_parser().parse_args(["finetune", "--model", "m", "--out", "o"])).target
    'q4_0'
    """
    from mixle.lm.finetune_checkpoint import CHECKPOINT, config_of_checkpoint, read_checkpoint
    from mixle.lm.finetune_config import FinetuneConfig

    changes = changes_from_args(args, FinetuneConfig)
    if args.resume is None:
        missing = [flag for flag in ("model", "out") if flag not in changes]
        if missing:
            raise ValueError(f"{' and '.join('--' + m for m in missing)} required (or --resume DIR to continue a run)")
        return FinetuneConfig(**changes)
    if "out" in changes and os.path.realpath(changes["out"]) != os.path.realpath(args.resume):
        raise ValueError(f"--out {changes['out']} differs from --resume {args.resume}: a resumed run writes into "
                         f"its own directory; leave --out out")
    changes["out"] = args.resume
    path = Path(args.resume) / CHECKPOINT
    return config_of_checkpoint(read_checkpoint(path), FinetuneConfig, changes, path)


def _message(err):
    """``err``'s text with the config's ``name=`` written as the flag ``--name``."""
    import re

    names = "model|out|target|data|eval_data|block|lr|steps|float_matrices|device|dtype|objective|imatrix|gptq"
    return re.sub(rf"\b({names})=", lambda m: "--" + m.group(1).replace("_", "-") + " ", str(err))


def finetune_command(args):
    """Run ``mixle finetune`` for parsed ``args``; returns the exit status (see the module docstring).

    >>> finetune_command  # doctest: +ELLIPSIS
    <function finetune_command at ...>
    """
    from mixle.lm.finetune_run import run_finetune
    from mixle.lm.finetune_report import format_table
    from mixle.lm.finetune_train import NonFiniteLossError, Stopped

    try:
        config = config_from_finetune_args(args)
    except (FileNotFoundError, ValueError) as err:
        args.subparser.error(_message(err))
    try:
        results = run_finetune(config, resume=args.resume is not None, progress=not args.no_progress)
    except Stopped as stop:
        return _fail(f"{stop} (checkpoint {os.path.join(config.out, 'checkpoint.pt')}); continue with: "
                     f"python -m mixle finetune --resume {config.out}", status=130)
    except KeyboardInterrupt:
        return _fail(f"interrupted; {config.out} keeps its last checkpoint, if one was written "
                     f"(continue with --resume {config.out})", status=130)
    except NonFiniteLossError as err:
        return _fail(f"training diverged: {err}")
    except (FileNotFoundError, ValueError, ImportError) as err:
        return _fail(_message(err))
    except OSError as err:
        return _fail(f"could not write into {config.out} ({err.strerror or err}): free some space or choose another "
                     f"--out; the last checkpoint, if any, is kept")
    if results is None:  # a process other than rank 0 under torchrun: rank 0 prints and writes
        return 0
    print(format_table(results), flush=True)
    print(f"\nwrote {', '.join(sorted(results['files'].values()) + ['results.json', 'table.txt', 'finetune.png', 'README.md'])} "
          f"into {config.out}")
    return 0
