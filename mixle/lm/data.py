"""Text corpora for the main job: the embedded default corpus, tokenizers and a train/held-out split."""

import os

import numpy as np

__all__ = ["CharTokenizer", "ByteTokenizer", "default_text", "load_text", "load_splits", "check_block"]

SEGMENT_CHARS = 2048


def default_text():
    """The English text of CPython's bundled documentation topics (``pydoc_data.topics``).

    It ships with every CPython (about 465 kB), so the main job runs offline on a fresh machine.
    Topics are joined in sorted key order, so the text is the same on every run.

    >>> len(default_text()) > 100_000
    True
    """
    from pydoc_data import topics

    return "\n\n".join(topics.topics[key] for key in sorted(topics.topics))


def load_text(path=None):
    """The text of a UTF-8 file, or ``default_text()`` when ``path`` is None.

    Raises:
        FileNotFoundError: ``path`` does not exist (the message names it).
        ValueError: the file is not UTF-8 text, or contains no text.

    >>> load_text() == default_text()
    True
    """
    if path is None:
        return default_text()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"corpus file {path!r} does not exist: pass the path of a UTF-8 text file, "
            f"or leave it out to use the embedded default corpus"
        )
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except UnicodeDecodeError as err:
        raise ValueError(f"corpus file {path!r} is not UTF-8 text ({err.reason} at byte {err.start})") from err
    if not text.strip():
        raise ValueError(f"corpus file {path!r} is empty: it needs some text to train on")
    return text


class CharTokenizer:
    """One token per distinct character of a text; ids follow the sorted characters.

    >>> tok = CharTokenizer("abcab")
    >>> tok.vocab_size, tok.encode("cab").tolist(), tok.decode([0, 1])
    (3, [2, 0, 1], 'ab')
    """

    kind = "char"

    def __init__(self, text):
        if not text:
            raise ValueError("CharTokenizer needs a non-empty text to build its vocabulary")
        self.chars = sorted(set(text))
        self._index = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self):
        return len(self.chars)

    def encode(self, text):
        """int64 ids of ``text``; every character must be in the vocabulary."""
        try:
            return np.fromiter((self._index[ch] for ch in text), dtype=np.int64, count=len(text))
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in this tokenizer's vocabulary") from None

    def decode(self, ids):
        return "".join(self.chars[int(i)] for i in ids)


class ByteTokenizer:
    """One token per UTF-8 byte (vocabulary 256).

    >>> ByteTokenizer().encode("é").tolist(), ByteTokenizer().decode([104, 105])
    ([195, 169], 'hi')
    """

    kind = "byte"
    vocab_size = 256

    def encode(self, text):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids):
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def load_splits(path=None, held_out_fraction=0.1, seed=0, *, tokenizer="char"):
    """Tokenize a corpus and split it deterministically into train and held-out token ids.

    The text is cut into consecutive segments of 2048 characters; a seeded permutation picks
    ``held_out_fraction`` of them (at least one) for the held-out set. Each set keeps its
    segments in corpus order, so both are long runs of real text.

    Args:
        path: a UTF-8 text file, or None for the embedded default corpus (``default_text()``).
        held_out_fraction: share of segments held out, in (0, 1).
        seed: seed of the segment permutation.
        tokenizer: ``"char"`` (vocabulary = the corpus' characters) or ``"byte"`` (256).

    Returns:
        ``(train_ids, held_out_ids, tokenizer)``: two int64 numpy arrays and the tokenizer.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: empty text, a bad fraction or tokenizer, or too little text to split.

    >>> train, held, tok = load_splits()
    >>> round(len(held) / (len(train) + len(held)), 2), tok.decode(tok.encode("print"))
    (0.1, 'print')
    """
    if not isinstance(held_out_fraction, float | int) or not 0 < held_out_fraction < 1:
        raise ValueError(f"held_out_fraction={held_out_fraction!r} must be a number strictly between 0 and 1, e.g. 0.1")
    if tokenizer not in ("char", "byte"):
        raise ValueError(f"tokenizer={tokenizer!r} is unknown: use 'char' or 'byte'")
    text = load_text(path)
    if not text.strip():
        raise ValueError("the corpus text is empty: it needs some text to train on")
    segments = [text[i : i + SEGMENT_CHARS] for i in range(0, len(text), SEGMENT_CHARS)]
    if len(segments) < 2:
        raise ValueError(
            f"the corpus has {len(text)} characters, too few to split: it needs more than "
            f"{SEGMENT_CHARS} characters so that train and held-out each get a {SEGMENT_CHARS}-character segment"
        )
    n_held = min(len(segments) - 1, max(1, round(held_out_fraction * len(segments))))
    held = set(np.random.default_rng(seed).permutation(len(segments))[:n_held].tolist())
    tok = CharTokenizer(text) if tokenizer == "char" else ByteTokenizer()
    train_text = "".join(s for i, s in enumerate(segments) if i not in held)
    held_text = "".join(s for i, s in enumerate(segments) if i in held)
    return tok.encode(train_text), tok.encode(held_text), tok


def check_block(ids, block, name="ids"):
    """Raise a clear ValueError unless ``ids`` has room for one window of ``block + 1`` tokens.

    >>> check_block(np.arange(10), 9) is None
    True
    >>> check_block(np.arange(10), 10)
    Traceback (most recent call last):
    ...
    ValueError: block=10 is larger than the data: ids has 10 tokens but one training window needs block + 1 = 11; use a smaller block or a longer text
    """
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if len(ids) < block + 1:
        raise ValueError(
            f"block={block} is larger than the data: {name} has {len(ids)} tokens but one training "
            f"window needs block + 1 = {block + 1}; use a smaller block or a longer text"
        )
