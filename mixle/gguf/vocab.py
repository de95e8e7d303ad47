"""The ``tokenizer.ggml.*`` vocabulary of a GGUF file, in llama.cpp's ``gpt2`` (byte-level BPE) form.

Token strings are GPT-2's byte-level form: each UTF-8 byte of a token is one character (printable
Latin-1 bytes stand for themselves, the others, such as space and newline, for the characters
from U+0100 on: a space is ``"Ġ"``, a newline ``"Ċ"``). Sources, in ``vocabulary``:

* a Hugging Face fast tokenizer with a byte-level BPE model: its tokens (already in that form),
  merges, added tokens (special ones typed CONTROL) and BOS/EOS ids; rows of the embedding past
  the tokenizer's ids get unused ``[PAD<id>]`` tokens;
* ``vocab``: one str/bytes token per id (mixle's ``CharTokenizer`` / ``ByteTokenizer`` give it);
  merges are every split of a token into two tokens;
* nothing: placeholder tokens ``<|0|>``, ``<|1|>``, ...; the file then runs on token ids only.

llama.cpp refuses a gpt2 vocabulary without merges, so when there are none (e.g. one token per
character) one placeholder merge of the first two tokens is written: llama.cpp uses it only when
it tokenizes text, where a merged symbol that is no token falls back to its parts.
"""

import json
from dataclasses import dataclass

__all__ = ["Vocabulary", "vocabulary", "byte_symbols", "check_token_ids", "split_merges"]

# llama.cpp's token types (LLAMA_TOKEN_TYPE_*).
NORMAL, UNUSED, CONTROL, USER_DEFINED = 1, 5, 3, 4


@dataclass
class Vocabulary:
    """Token strings, types and merges for ``tokenizer.ggml.*``, and optional BOS/EOS ids."""

    tokens: list
    types: list
    merges: list
    bos: int | None = None
    eos: int | None = None


def byte_symbols():
    """GPT-2's byte-to-character table ``{byte: character}``.

    >>> byte_symbols()[ord(" ")], byte_symbols()[ord("a")], byte_symbols()[ord("\\n")]
    ('Ġ', 'a', 'Ċ')
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return symbols


def split_merges(tokens):
    """Merges for a vocabulary without its own: each token's first split into two tokens.

    >>> split_merges(["a", "b", "ab", "ba"])
    ['a b', 'b a']
    """
    known = set(tokens)
    merges = []
    for token in tokens:
        for cut in range(1, len(token)):
            if token[:cut] in known and token[cut:] in known:
                merges.append(f"{token[:cut]} {token[cut:]}")
                break
    return merges


def _from_hf(tokenizer, n_vocab):
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model, pre = state.get("model") or {}, json.dumps(state.get("pre_tokenizer"))
    if model.get("type") != "BPE" or '"ByteLevel"' not in pre:
        raise ValueError(
            f"tokenizer={type(tokenizer).__name__} has a {model.get('type')} model without GPT-2's byte-level "
            f"pre-tokenizer, which llama.cpp's gpt2 tokenizer does not reproduce: pass vocab=[token of each id] "
            f"(the file then runs on token ids)"
        )
    ids = check_token_ids(tokenizer, n_vocab)
    tokens, types = [f"[PAD{i}]" for i in range(n_vocab)], [UNUSED] * n_vocab
    for token, index in ids.items():
        tokens[index], types[index] = token, NORMAL
    for added in state.get("added_tokens", []):
        if added["id"] < n_vocab:
            types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if not merges:
        merges = split_merges(tokens)
    return Vocabulary(tokens, types, merges, tokenizer.bos_token_id, tokenizer.eos_token_id)


def check_token_ids(tokenizer, n_vocab):
    """The ``{token: id}`` of a Hugging Face ``tokenizer`` after checking that an embedding of
    ``n_vocab`` rows has a row for every id (ids 0..N-1 need N rows); ValueError otherwise.

    The one check of the GGUF writer (``vocabulary``) and of ``mixle finetune`` before training.

    >>> class Tokenizer:
    ...     def get_vocab(self):
    ...         return {"a": 0, "b": 1, "<|endoftext|>": 2}
    >>> check_token_ids(Tokenizer(), 2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: the tokenizer has ids 0..2 (id 2 is '<|endoftext|>'), which need 3 embedding rows, but the model's ...
    """
    ids = tokenizer.get_vocab()
    top = max(ids.values(), default=-1)
    if top >= n_vocab:
        last = next(token for token, index in ids.items() if index == top)
        raise ValueError(f"the tokenizer has ids 0..{top} (id {top} is {last!r}), which need {top + 1} embedding "
                         f"rows, but the model's embedding has {n_vocab} (ids 0..{n_vocab - 1}): pass the "
                         f"tokenizer the model was trained with (a directory with its tokenizer.json), or resize the "
                         f"embedding to {top + 1} rows (model.resize_token_embeddings({top + 1}))")
    return ids


def _token_bytes(vocab, tokenizer, n_vocab):
    if tokenizer is not None:
        if getattr(tokenizer, "kind", None) == "byte":  # mixle's ByteTokenizer: id = byte
            vocab = [bytes([i]) for i in range(tokenizer.vocab_size)]
        elif hasattr(tokenizer, "chars"):  # mixle's CharTokenizer
            vocab = list(tokenizer.chars)
        else:
            raise TypeError(f"tokenizer={type(tokenizer).__name__} is not a mixle CharTokenizer or ByteTokenizer "
                            f"or a Hugging Face fast tokenizer: pass vocab=[token string of each id] instead")
    vocab = list(vocab)
    if len(vocab) != n_vocab:
        raise ValueError(f"vocab has {len(vocab)} tokens but the model's embedding has {n_vocab} rows: "
                         f"pass one token per id")
    out = []
    for index, token in enumerate(vocab):
        if isinstance(token, str):
            token = token.encode("utf-8")
        if not isinstance(token, bytes) or not token:
            raise ValueError(f"vocab[{index}]={vocab[index]!r} must be a non-empty str or bytes")
        out.append(token)
    if len(set(out)) != len(out):
        raise ValueError("vocab has repeated tokens: each id needs its own token")
    return out


def vocabulary(n_vocab, vocab=None, tokenizer=None):
    """The ``Vocabulary`` of a model with ``n_vocab`` embedding rows (see the module docstring).

    >>> v = vocabulary(3, vocab=["a", " ", "a "])
    >>> v.tokens, v.types, v.merges
    (['a', 'Ġ', 'aĠ'], [1, 1, 1], ['a Ġ'])
    """
    if vocab is not None and tokenizer is not None:
        raise ValueError("pass vocab=... or tokenizer=..., not both")
    if tokenizer is not None and hasattr(tokenizer, "backend_tokenizer"):
        return _from_hf(tokenizer, n_vocab)
    if vocab is None and tokenizer is None:
        tokens = [f"<|{i}|>" for i in range(n_vocab)]
    else:
        symbols = byte_symbols()
        tokens = ["".join(symbols[b] for b in token) for token in _token_bytes(vocab, tokenizer, n_vocab)]
    merges = split_merges(tokens)
    if not merges and n_vocab >= 2:
        merges = [f"{tokens[0]} {tokens[1]}"]
    return Vocabulary(tokens, [NORMAL] * n_vocab, merges)
