"""The finetune job's checkpoint: one file holding everything a resumed run needs to continue exactly.

``checkpoint.pt`` in the output directory holds the run's config, the digest of its data, the
trained tensors (by parameter name), AdamW's state, the scheduler's state, the data position
(epoch and index of the window order), torch's RNG state, the curve and counters so far, and
the float / PTQ evaluations done before training. It is written with ``torch.save`` through
``replace_atomically`` (a crash leaves the previous checkpoint) and read with
``torch.load(weights_only=True)`` (no pickled code; memory-mapped, so reading its config costs
nothing), then checked against the run resuming it.
"""

import dataclasses
import os
from pathlib import Path

from mixle._optional import require
from mixle.core.fileformat import replace_atomically

__all__ = ["CHECKPOINT", "FORMAT", "TRANSIENT", "write_checkpoint", "read_checkpoint", "config_of_checkpoint",
           "check_new_out", "check_backend"]

CHECKPOINT = "checkpoint.pt"
FORMAT = "mixle.finetune.checkpoint"
VERSION = 1
# Name prefixes of what a run makes in --out and removes itself (write probes, scratch directories):
# ignored by ``check_new_out``, since under torchrun one process may probe while another checks.
TRANSIENT = (".mixle-write-check-", ".mixle-finetune-")


def write_checkpoint(path, payload):
    """Write ``payload`` (a dict of tensors, numbers, strings, lists and dicts) to ``path`` atomically.

    >>> import os, tempfile, torch
    >>> path = os.path.join(tempfile.mkdtemp(), CHECKPOINT)
    >>> write_checkpoint(path, {"step": 3, "weights": {"w": torch.ones(2)}})
    >>> read_checkpoint(path)["step"]
    3
    """
    torch = require("torch", extra="torch", purpose="a finetune checkpoint")
    replace_atomically(path, lambda tmp: torch.save({"format": FORMAT, "version": VERSION, **payload}, tmp))


def read_checkpoint(path):
    """The payload of a checkpoint written by ``write_checkpoint``; ValueError naming the file otherwise.

    >>> read_checkpoint("/no/such/checkpoint.pt")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    FileNotFoundError: resume: '/no/such/checkpoint.pt' does not exist: ...
    """
    torch = require("torch", extra="torch", purpose="a finetune checkpoint")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"resume: {str(path)!r} does not exist: --resume takes the --out directory of an "
                                f"interrupted run, which holds its {CHECKPOINT}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch raises many kinds for a damaged file
        raise ValueError(f"resume: {str(path)!r} is not a readable checkpoint ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}): it is damaged; start the run again") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or payload.get("version") != VERSION:
        raise ValueError(f"resume: {str(path)!r} is not a mixle finetune checkpoint (version {VERSION})")
    return payload


def config_of_checkpoint(payload, config_type, changes, path):
    """The config of the run a checkpoint belongs to, with ``changes`` that may differ on resume.

    Args:
        payload: ``read_checkpoint``'s result.
        config_type: the config dataclass (``FinetuneConfig``).
        changes: ``{field: value}`` given for the resumed run (e.g. from the command line).
        path: the checkpoint (for messages).

    Raises:
        ValueError: a change to a field that decides the result (the message names the flag).

    >>> from mixle.lm.finetune_config import FinetuneConfig
    >>> payload = {"config": dataclasses.asdict(FinetuneConfig(model="m", out="o"))}
    >>> config_of_checkpoint(payload, FinetuneConfig, {"max_minutes": 5.0}, "c.pt").max_minutes
    5.0
    """
    from mixle.lm.finetune_config import RESULT_FIELDS

    saved = dict(payload["config"])
    for name in ("data", "eval_data"):
        if saved.get(name) is not None:
            saved[name] = tuple(saved[name])
    for name, value in changes.items():
        if name in RESULT_FIELDS and value != saved.get(name):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {value!r} differs from the interrupted run's {saved.get(name)!r} ({str(path)!r}): "
                             f"a resumed run continues that run exactly; leave {flag} out, or start a new run "
                             f"with another --out")
        saved[name] = value
    known = {f.name for f in dataclasses.fields(config_type)}
    return config_type(**{k: v for k, v in saved.items() if k in known})


def check_backend(payload, config, path):
    """Refuse to resume a checkpoint with another ``--backend`` than the one that wrote it (its trained
    tensors and optimizer state are that backend's; a checkpoint without the field is torch's).

    >>> from mixle.lm.finetune_config import FinetuneConfig
    >>> check_backend({"config": {"backend": "jax"}}, FinetuneConfig(model="m", out="o"), "c.pt")
    Traceback (most recent call last):
    ...
    ValueError: resume: 'c.pt' was written by --backend jax, this run is --backend torch: resume it with --backend jax (or leave --backend out on the command line), or start a new run with another --out
    """
    saved = dict(payload.get("config") or {}).get("backend", "torch")
    if saved != config.backend:
        raise ValueError(f"resume: {str(path)!r} was written by --backend {saved}, this run is --backend "
                         f"{config.backend}: resume it with --backend {saved} (or leave --backend out on the command "
                         f"line), or start a new run with another --out")


def check_new_out(out, config):
    """Refuse an output directory a new run would write into over other files.

    ``out`` must not exist, or be empty, or ``config.overwrite`` be set. A directory holding an
    interrupted run's checkpoint is refused saying to continue it with ``--resume`` (and, when that
    run's flags are not these, which differ); any other content is refused naming it.

    Args:
        out: the run's ``--out``.
        config: the new run's ``FinetuneConfig``.

    Raises:
        ValueError: the message names the directory, what it holds and the fix.

    >>> import tempfile
    >>> from mixle.lm.finetune_config import FinetuneConfig
    >>> out = tempfile.mkdtemp()
    >>> check_new_out(out, FinetuneConfig(model="m", out=out))
    >>> _ = open(os.path.join(out, "notes.txt"), "w").write("mine")
    >>> check_new_out(out, FinetuneConfig(model="m", out=out))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: out=... is not empty (it holds notes.txt): ...
    """
    path = Path(out)
    if config.overwrite or not path.is_dir():
        return
    entries = sorted(p.name for p in path.iterdir() if not p.name.startswith(TRANSIENT))
    if CHECKPOINT in entries:
        raise ValueError(_interrupted(path, config))
    if entries:
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise ValueError(f"out={str(out)!r} is not empty (it holds {shown}): this run would write over files of the "
                         f"same names; choose a new or empty directory, or pass --overwrite to write into it anyway")


def _interrupted(path, config):
    """The refusal of a new run in a directory holding a checkpoint: resume it; which flags differ, if any."""
    from mixle.lm.finetune_config import RESULT_FIELDS

    out = str(config.out)
    fix = f"continue it with --resume {out}, or pass --overwrite to discard it and start this run there"
    try:
        payload = read_checkpoint(path / CHECKPOINT)
        saved, step = dict(payload["config"]), payload.get("state", {}).get("step")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return (f"out={out!r} holds a {CHECKPOINT} that cannot be read ({str(err).splitlines()[0]}): choose another "
                f"--out, or pass --overwrite to discard it")
    mine = dataclasses.asdict(config)
    differ = [name for name in ("model",) + RESULT_FIELDS if _normal(saved.get(name)) != _normal(mine.get(name))]
    at = f" after step {step}" if step is not None else ""
    if not differ:
        return f"out={out!r} holds an interrupted run's {CHECKPOINT}: this very run, stopped{at}; {fix}"
    flags = ", ".join(f"--{name.replace('_', '-')} {saved.get(name)!r} (here {mine.get(name)!r})" for name in differ[:4])
    return (f"out={out!r} holds an interrupted run's {CHECKPOINT}, stopped{at}, of another run ({flags}): {fix}, "
            f"or choose another --out")


def _normal(value):
    return list(value) if isinstance(value, tuple | list) else value
