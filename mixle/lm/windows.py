"""Windows of token ids: the training starts and the held-out windows an LM job evaluates on."""

import platform

import numpy as np

from mixle._optional import require

__all__ = ["held_out_windows", "CompareData", "prepare_data", "data_key", "DATA_FIELDS", "calibration_windows",
           "calibration_batches", "MIN_BATCH_TOKENS"]

# Calibration batches hold at least this many tokens: llama-imatrix (and calibrate_importance)
# skips products of fewer input rows.
MIN_BATCH_TOKENS = 16

# The config fields that decide a run's data: data built for one config serves another only if
# they agree on all of them.
DATA_FIELDS = ("corpus", "tokenizer", "held_out_fraction", "seed", "block", "eval_windows", "curve_windows")


def held_out_windows(ids, block, max_windows=None):
    """Non-overlapping windows of ``block + 1`` tokens (stride ``block``), evenly thinned to a cap.

    Every token after a window's first is predicted once, with its window as context.

    >>> held_out_windows(np.arange(10), 3).tolist()
    [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    """
    count = (len(ids) - 1) // block
    starts = np.arange(count) * block
    if max_windows is not None and count > max_windows:
        starts = starts[np.linspace(0, count - 1, max_windows).round().astype(int)]
    return np.stack([ids[s : s + block + 1] for s in starts])


def data_key(config):
    """The values of ``config``'s ``DATA_FIELDS``: equal keys, same data.

    >>> from mixle.lm.config import CompareConfig
    >>> data_key(CompareConfig())
    (None, 'char', 0.1, 0, 64, None, 64)
    """
    return tuple(getattr(config, name) for name in DATA_FIELDS)


class CompareData:
    """The tokenized corpus of a run: training ids, held-out windows and the tokenizer.

    Built by ``prepare_data(config)``, which is where bad input is refused (missing corpus file,
    empty text, a block larger than the data), before any training starts.

    Attributes:
        tokenizer: the corpus' ``CharTokenizer`` or ``ByteTokenizer``.
        block: the context length the windows are cut for.
        key: ``data_key(config)`` of the config it was built for.
        train_ids: the training text's ids (an int64 tensor).
        train_starts: every start of a training window of ``block + 1`` tokens.
        eval_windows, curve_windows: held-out windows (numpy) for the rows and for the curves.
        info: a JSON-ready description (corpus, tokenizer, vocabulary, token counts).
    """

    def __init__(self, config):
        from mixle.lm.data import check_block, load_splits

        torch = require("torch", extra="torch", purpose="mixle compare")
        train, held, self.tokenizer = load_splits(config.corpus, config.held_out_fraction, config.seed,
                                                  tokenizer=config.tokenizer)
        check_block(train, config.block, "the training text")
        check_block(held, config.block, "the held-out text")
        self.block = config.block
        self.key = data_key(config)
        self.train_ids = torch.as_tensor(train)
        self.train_starts = torch.arange(len(train) - config.block)
        self.eval_windows = held_out_windows(held, config.block, config.eval_windows)
        self.curve_windows = held_out_windows(held, config.block, config.curve_windows)
        self.info = {
            "corpus": config.corpus or f"pydoc_data.topics (CPython {platform.python_version()})",
            "tokenizer": config.tokenizer, "vocab": self.tokenizer.vocab_size,
            "train_tokens": len(train), "held_out_tokens": len(held),
            "held_out_windows": len(self.eval_windows),
            "predicted_tokens": int(self.eval_windows.shape[0] * config.block),
        }


def prepare_data(config):
    """Load, split and tokenize the corpus of ``config``; raises clear errors for bad input.

    >>> from mixle.lm.config import PRESETS
    >>> prepare_data(PRESETS["smoke"].replace(block=10**7))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: block=10000000 is larger than the data: the training text has ... tokens but one training window needs block + 1 = 10000001; use a smaller block or a longer text
    """
    return CompareData(config)


def calibration_windows(data, count):
    """``count`` windows of ``data.block`` tokens of the training text, evenly spaced over it.

    The importance matrix and GPTQ calibrate on these: they come from ``data.train_ids`` only
    (never the held-out text) and are chosen without any random draw, so the rows that use them
    leave every other row's random streams as they were.

    Args:
        data: a ``CompareData``.
        count: how many windows (at most the number of training window starts).

    Returns:
        An int64 tensor ``(count, data.block)``.

    Raises:
        ValueError: ``count`` exceeds the training windows available.

    >>> from mixle.lm.config import PRESETS
    >>> data = prepare_data(PRESETS["smoke"])
    >>> windows = calibration_windows(data, 4)
    >>> windows.shape, bool((windows[0] == data.train_ids[:data.block]).all())
    (torch.Size([4, 32]), True)
    """
    torch = require("torch", extra="torch", purpose="mixle compare")
    available = len(data.train_starts)
    if count > available:
        raise ValueError(f"calibration_windows={count} exceeds the {available} training windows of block "
                         f"{data.block}: use at most {available}, or a longer corpus")
    starts = data.train_starts[np.linspace(0, available - 1, count).round().astype(np.int64)]
    return data.train_ids[starts[:, None] + torch.arange(data.block)]


def calibration_batches(windows, batch_size):
    """``windows`` as calibration batches of about ``batch_size`` windows each, every one holding at
    least ``MIN_BATCH_TOKENS`` tokens (so an importance matrix counts every token): model keywords
    ``{"idx": (rows, block), "all_positions": True}``.

    >>> import torch
    >>> [b["idx"].shape[0] for b in calibration_batches(torch.zeros(10, 8, dtype=torch.int64), 3)]
    [3, 3, 2, 2]
    """
    count, block = windows.shape
    chunks = max(1, min(-(-count // batch_size), count * block // MIN_BATCH_TOKENS))
    return [{"idx": part, "all_positions": True} for part in np.array_split(np.arange(count), chunks)
            for part in (windows[part],)]
