"""Windows of token ids: the training starts and the held-out windows an LM job evaluates on."""

import platform

import numpy as np

from mixle._optional import require

__all__ = ["held_out_windows", "CompareData", "prepare_data", "data_key", "DATA_FIELDS"]

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
