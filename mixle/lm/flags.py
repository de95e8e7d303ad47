"""A job's config dataclass as command-line flags, and parsed flags back as config changes.

A field becomes a flag when it is declared with ``option(default, help, ...)``: the help text (and
any argparse setting the annotation cannot tell, such as ``type=positive_int`` or ``choices``)
lives in the field's metadata, so a config knob is written once, in its dataclass. Fields
declared without ``option`` have no flag.

What the flags look like, from the field's name, annotation and default:

* ``finetune_steps: int`` becomes ``--finetune-steps FINETUNE_STEPS`` (``type=int``); ``X | None``
  is parsed as ``X``; ``str`` takes the text as it is.
* ``bits: tuple[int, ...]`` becomes ``--bits BITS [BITS ...]`` and is handed back as a tuple.
* a ``bool`` defaulting to False becomes ``--name`` (sets True); one defaulting to True becomes
  ``--no-name`` (sets False).

Every flag's argparse default is None, meaning "not given": ``changes_from_args`` returns only
the fields whose flags were given, to be applied over a preset with ``dataclasses.replace``.
"""

import argparse
import dataclasses
import types
import typing

__all__ = ["option", "positive_int", "add_flags", "changes_from_args", "flag_of"]

_KEY = "flag"  # the metadata key of a field's command-line settings


def option(default, help, **argparse_settings):
    """A dataclass field with a command-line flag: its default, help text and argparse settings.

    Args:
        default: the field's default (immutable: a number, str, tuple, bool or None).
        help: the flag's ``--help`` text.
        **argparse_settings: passed to ``add_argument`` over what the annotation implies, e.g.
            ``type=positive_int`` or ``choices=("char", "byte")``.

    >>> @dataclasses.dataclass(frozen=True)
    ... class Config:
    ...     steps: int = option(10, "training steps", type=positive_int)
    >>> dataclasses.fields(Config)[0].metadata["flag"]["help"]
    'training steps'
    """
    return dataclasses.field(default=default, metadata={_KEY: {"help": help, **argparse_settings}})


def positive_int(text):
    """The argparse type of a flag that takes an int >= 1.

    >>> positive_int("3")
    3
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _flagged(cls):
    return [f for f in dataclasses.fields(cls) if _KEY in f.metadata]


def _base_type(annotation):
    """``X`` of ``X | None`` (or ``Optional[X]``), else the annotation itself."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(kinds) == 1:
            return kinds[0]
    return annotation


def flag_of(field):
    """The flag name of a dataclass field declared with ``option``.

    >>> @dataclasses.dataclass
    ... class Config:
    ...     gguf: bool = option(True, "write the GGUF rows")
    >>> flag_of(dataclasses.fields(Config)[0])
    '--no-gguf'
    """
    name = field.name.replace("_", "-")
    return f"--no-{name}" if _base_type(field.type) is bool and field.default is True else f"--{name}"


def _settings(field):
    """The ``add_argument`` keywords of ``field``'s flag."""
    kind = _base_type(field.type)
    settings = {"dest": field.name, "default": None}
    if kind is bool:
        settings["action"] = "store_false" if field.default is True else "store_true"
    elif typing.get_origin(kind) is tuple:
        settings.update(nargs="+", type=typing.get_args(kind)[0])
    elif kind in (int, float):
        settings["type"] = kind
    elif kind is not str:
        raise TypeError(f"field {field.name!r}: no command-line flag for a {kind!r}; give type= in option()")
    return {**settings, **field.metadata[_KEY]}


def add_flags(parser, cls):
    """Add a flag to ``parser`` for every field of dataclass ``cls`` declared with ``option``.

    >>> @dataclasses.dataclass(frozen=True)
    ... class Config:
    ...     lr: float = option(0.1, "learning rate")
    ...     seed: int = 0  # no flag
    >>> parser = argparse.ArgumentParser()
    >>> add_flags(parser, Config)
    >>> parser.parse_args(["--lr", "0.5"]).lr, parser.parse_args([]).lr
    (0.5, None)
    """
    for field in _flagged(cls):
        parser.add_argument(flag_of(field), **_settings(field))


def changes_from_args(args, cls):
    """``{field: value}`` of the flags of ``cls`` given on the command line (see ``add_flags``).

    >>> @dataclasses.dataclass(frozen=True)
    ... class Config:
    ...     bits: tuple[int, ...] = option((4,), "bit widths")
    ...     fast: bool = option(False, "go fast")
    >>> parser = argparse.ArgumentParser()
    >>> add_flags(parser, Config)
    >>> changes_from_args(parser.parse_args(["--bits", "4", "8"]), Config)
    {'bits': (4, 8)}
    >>> dataclasses.replace(Config(), **changes_from_args(parser.parse_args(["--fast"]), Config))
    Config(bits=(4,), fast=True)
    """
    changes = {}
    for field in _flagged(cls):
        value = getattr(args, field.name, None)
        if value is not None:
            changes[field.name] = tuple(value) if isinstance(value, list) else value
    return changes
