"""The finetune job's data: the text tokenized with the model's own tokenizer, split, cut into windows.

The training text is the files of ``--data`` (or the embedded corpus) in order, each tokenized
without special tokens and joined with the tokenizer's end-of-text token when it has one. Its
last ``held_out_fraction`` of tokens is held out: never trained on, cut into non-overlapping
windows of ``block + 1`` tokens for the reported perplexities (at most ``eval_windows``, evenly
spread) and the training curve. ``--eval-data`` is a second held-out text, all of it evaluated.
When the tokenizer starts every text with a BOS token (Gemma's does; ``bos_of``), every window,
training, calibration and held-out alike, starts with it in place of its first token, as
llama.cpp's ``llama-perplexity`` does: such a model predicts badly from a context without it.

The training order (``window_order``): each epoch a seeded offset in ``[0, block)`` and a seeded
permutation of the non-overlapping windows from that offset, so the data position of a run is
``(epoch, index)`` and a resumed run sees exactly the windows the uninterrupted one would.
"""

import hashlib
import platform
from dataclasses import dataclass

import numpy as np

from mixle._optional import require
from mixle.lm.family import TransformersTokenizer
from mixle.lm.finetune_load import load_texts, tokens_needed
from mixle.lm.windows import held_out_windows

__all__ = ["FinetuneData", "prepare_finetune_data", "window_order", "WindowCursor", "tokenize_texts", "bos_of"]


@dataclass
class FinetuneData:
    """The tokenized data of a run.

    Attributes:
        train_ids: the training tokens (int64 tensor).
        eval_windows, curve_windows: held-out windows (numpy, ``(count, block + 1)``) of the
            reported evaluations and of the training curve.
        extra_windows: the ``--eval-data`` windows, or None.
        info: JSON-ready description (sources, token counts, windows).
        digest: sha256 of the training and held-out tokens (a resumed run must see the same).
        bos: the id every window starts with (``bos_of``), or None.
    """

    train_ids: object
    eval_windows: np.ndarray
    curve_windows: np.ndarray
    extra_windows: np.ndarray | None
    info: dict
    digest: str
    bos: int | None = None


def bos_of(tokenizer):
    """The BOS id ``tokenizer`` starts a text with, or None when its encoding adds none.

    >>> from tokenizers import Tokenizer as Backend, models
    >>> from transformers import PreTrainedTokenizerFast
    >>> bos_of(PreTrainedTokenizerFast(tokenizer_object=Backend(models.WordLevel({"a": 0}, unk_token="a"))))
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer.encode("a")
    return int(bos) if len(ids) and int(ids[0]) == int(bos) else None


def _from_bos(windows, bos):
    if bos is None or windows is None:
        return windows
    windows = windows.copy()
    windows[:, 0] = bos
    return windows


def tokenize_texts(texts, tokenizer):
    """The ids of ``[(name, text)]``, joined by the tokenizer's end-of-text token when it has one.

    >>> from tokenizers import Tokenizer as Backend, models, pre_tokenizers
    >>> from transformers import PreTrainedTokenizerFast
    >>> backend = Backend(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    >>> backend.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> tokenize_texts([("x", "a b"), ("y", "b")], PreTrainedTokenizerFast(tokenizer_object=backend)).tolist()
    [1, 2, 2]
    """
    wrapped = TransformersTokenizer(tokenizer)
    eos = getattr(tokenizer, "eos_token_id", None)
    parts = []
    for index, (_, text) in enumerate(texts):
        if index and eos is not None:
            parts.append(np.asarray([eos], dtype=np.int64))
        parts.append(wrapped.encode(text))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _texts(paths):
    if paths:
        return load_texts(paths), ", ".join(paths)
    from mixle.lm.data import default_text

    name = f"pydoc_data.topics (CPython {platform.python_version()})"
    return [(name, default_text())], name


def _extra_windows(config, tokenizer):
    if not config.eval_data:
        return None, None
    texts, name = _texts(config.eval_data)
    ids = tokenize_texts(texts, tokenizer)
    if len(ids) < config.block + 1:
        raise ValueError(f"eval_data {name!r} has {len(ids)} tokens with the model's tokenizer, fewer than one window of "
                         f"block + 1 = {config.block + 1}: use a longer text or a smaller --block")
    windows = _from_bos(held_out_windows(ids, config.block, config.eval_windows), bos_of(tokenizer))
    return windows, {"source": name, "tokens": int(len(ids)), "windows": int(len(windows))}


def prepare_finetune_data(config, tokenizer, context):
    """Tokenize, split and window the data of ``config`` with the model's ``tokenizer``.

    Args:
        config: a ``FinetuneConfig``.
        tokenizer: the model's transformers tokenizer.
        context: the model's context length (``block`` must not exceed it).

    Raises:
        FileNotFoundError, ValueError: bad data (see ``load_texts``), or too few tokens for one
            training and one held-out window, or a block longer than the model's context.

    >>> prepare_finetune_data  # doctest: +ELLIPSIS
    <function prepare_finetune_data at ...>
    """
    torch = require("torch", extra="torch", purpose="mixle finetune")
    if config.block > context:
        raise ValueError(f"block={config.block} is longer than the model's context of {context} tokens: "
                         f"use --block {context} or less")
    texts, name = _texts(config.data)
    ids = tokenize_texts(texts, tokenizer)
    needed = tokens_needed(config.block, config.held_out_fraction)
    if len(ids) < needed:
        raise ValueError(f"the data ({name}) has {len(ids)} tokens with the model's tokenizer, but --block "
                         f"{config.block} needs at least {needed} (one window of block + 1 = {config.block + 1} "
                         f"tokens held out as {config.held_out_fraction:g} of the text, and one to train on): "
                         f"use a longer text or a smaller --block")
    held_count = max(config.block + 1, round(config.held_out_fraction * len(ids)))
    train, held = ids[:-held_count], ids[-held_count:]
    bos = bos_of(tokenizer)
    eval_windows = _from_bos(held_out_windows(held, config.block, config.eval_windows), bos)
    extra, extra_info = _extra_windows(config, tokenizer)
    digest = hashlib.sha256(train.tobytes() + b"|" + held.tobytes() + (b"" if bos is None else b"|bos%d" % bos))
    digest = digest.hexdigest()
    info = {"source": name, "files": len(texts), "tokens": int(len(ids)), "train_tokens": int(len(train)),
            "held_out_tokens": int(len(held)), "held_out_windows": int(len(eval_windows)),
            "predicted_tokens": int(eval_windows.shape[0] * config.block), "vocab": len(tokenizer),
            "eval_data": extra_info, "windows_start_with_bos": bos is not None}
    return FinetuneData(torch.as_tensor(train), eval_windows,
                        _from_bos(held_out_windows(held, config.block, config.curve_windows), bos), extra, info, digest,
                        bos)


def window_order(length, block, seed, epoch):
    """The training window starts of ``epoch``: a seeded offset, then a seeded permutation of the
    non-overlapping windows of ``block + 1`` tokens from it (an int64 tensor).

    >>> sorted(window_order(10, 3, seed=0, epoch=0).tolist()) in ([0, 3, 6], [1, 4], [2, 5])
    True
    """
    torch = require("torch", extra="torch", purpose="mixle finetune")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    offset = int(torch.randint(0, block, (1,), generator=generator))
    count = (length - 1 - offset) // block
    if count < 1:
        offset, count = 0, (length - 1) // block
    return offset + torch.randperm(count, generator=generator) * block


class WindowCursor:
    """Window starts in ``window_order``, epoch after epoch, from a training state's data position.

    ``take(state, count)`` returns the next ``count`` starts (int64 tensor) and moves ``state.epoch``
    and ``state.position`` past them; each epoch's order is computed once.

    >>> from types import SimpleNamespace
    >>> cursor, state = WindowCursor(10, 3, seed=0), SimpleNamespace(epoch=0, position=0)
    >>> len(cursor.take(state, 5)), state.epoch >= 1
    (5, True)
    """

    def __init__(self, length, block, seed):
        self.length, self.block, self.seed = length, block, seed
        self._order, self._epoch = None, None

    def take(self, state, count):
        import torch

        taken = []
        while count:
            if self._epoch != state.epoch:
                self._order, self._epoch = window_order(self.length, self.block, self.seed, state.epoch), state.epoch
            part = self._order[state.position : state.position + count]
            taken.append(part)
            count -= len(part)
            state.position += len(part)
            if state.position >= len(self._order):
                state.epoch, state.position = state.epoch + 1, 0
        return torch.cat(taken)
