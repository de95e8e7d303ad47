"""SentencePiece tokenizers in a GGUF file: llama.cpp's ``llama`` tokenizer model, as its converter writes it.

Gemma 2 and 3, Llama 2 and Mistral v0.1-style checkpoints tokenize with SentencePiece: a
``tokenizer.model`` file whose pieces carry scores (llama.cpp merges the pair of highest score
first) and kinds (normal, unknown, control, user-defined, byte). transformers loads it as a fast
tokenizer whose ``tokenizer.json`` model is BPE with byte fallback (or Unigram), but keeps the
scores only in the ``tokenizer.model`` file it was loaded from (and does not save it again), so
that file is what the keys are read from. For a model directory holding it, llama.cpp's
``convert_hf_to_gguf.py`` writes:

* ``tokenizer.ggml.model`` ``"llama"`` and ``tokenizer.ggml.pre`` ``"default"``;
* one token, score and type per embedding row: the file's pieces by id (gguf-py's
  ``SentencePieceVocab`` reads them), ``[PAD<id>]`` tokens of score -10000 and type UNUSED past them;
  each added token of the tokenizer (its ``added_tokens_decoder``) replaces its id's piece with
  score -1000, CONTROL when it is special or shaped like one (``<|...|>``, ``<unused...>``,
  ``<mask>``, ...), else USER_DEFINED with SentencePiece's ``▁`` written as a space;
* the special-token ids, ``add_bos_token`` / ``add_eos_token`` and the chat template (gguf-py's
  ``SpecialVocab``, as for every tokenizer);
* ``tokenizer.ggml.add_space_prefix``: per architecture (``SENTENCEPIECE_ARCHS``).

Any other SentencePiece case is refused with the reason: an architecture whose converter writes
its vocabulary another way, a tokenizer without its ``tokenizer.model``, or one whose
``tokenizer.model`` holds other pieces than the tokenizer.
"""

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mixle._optional import require

__all__ = ["SentencePieceArch", "SENTENCEPIECE_ARCHS", "is_sentencepiece", "looks_special", "sentencepiece_file",
           "add_sentencepiece_vocab"]

# llama.cpp's token types (LLAMA_TOKEN_TYPE_*).
UNUSED, CONTROL, USER_DEFINED = 5, 3, 4
_PAD_SCORE, _ADDED_SCORE = -10000.0, -1000.0


@dataclass(frozen=True, kw_only=True)
class SentencePieceArch:
    """How llama.cpp's converter writes a SentencePiece vocabulary for one architecture.

    Attributes:
        arch: llama.cpp's architecture name (``general.architecture``).
        space_prefix: ``"config"``: the tokenizer config's ``add_prefix_space``, when it has one,
            written before the vocabulary (Llama's converter); ``"off"``: False, written after it (Gemma's).

    >>> SentencePieceArch(arch="gemma3", space_prefix="off").space_prefix
    'off'
    """

    arch: str
    space_prefix: str

    def __post_init__(self):
        if not (isinstance(self.arch, str) and self.arch):
            raise ValueError(f"arch={self.arch!r} must be llama.cpp's architecture name, e.g. 'gemma3'")
        if self.space_prefix not in ("config", "off"):
            raise ValueError(f"space_prefix={self.space_prefix!r} must be 'config' or 'off'")


# The architectures whose converter writes a tokenizer.model as _set_vocab_sentencepiece does.
SENTENCEPIECE_ARCHS = {record.arch: record for record in (
    SentencePieceArch(arch="llama", space_prefix="config"),  # Llama 2, Mistral, Mixtral
    SentencePieceArch(arch="gemma2", space_prefix="off"),
    SentencePieceArch(arch="gemma3", space_prefix="off"),
)}


def is_sentencepiece(tokenizer):
    """Whether a transformers fast ``tokenizer`` is of SentencePiece origin: a Unigram model, or BPE
    with byte fallback (byte-level BPE is llama.cpp's ``gpt2`` model instead).

    >>> from tokenizers import Tokenizer, models
    >>> from transformers import PreTrainedTokenizerFast
    >>> is_sentencepiece(PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(byte_fallback=True))))
    True
    """
    model = json.loads(tokenizer.backend_tokenizer.to_str()).get("model") or {}
    return model.get("type") == "Unigram" or (model.get("type") == "BPE" and bool(model.get("byte_fallback")))


def looks_special(text):
    """An added token llama.cpp's converter types CONTROL even when the tokenizer does not call it special.

    >>> looks_special("<|im_end|>"), looks_special("<unused12>"), looks_special("<start_of_turn>")
    (True, True, False)
    """
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or any(text.startswith(head) and text.endswith(tail) for head, tail in (("<|", "|>"), ("<｜", "｜>"),
                                                                                   ("<unused", ">"))))


def sentencepiece_file(tokenizer):
    """The ``tokenizer.model`` a transformers ``tokenizer`` was loaded from, or None: the one in the
    directory it was loaded from, else its ``vocab_file`` given as an absolute path.

    >>> class Tokenizer:
    ...     vocab_file, name_or_path = None, "/nowhere"
    >>> sentencepiece_file(Tokenizer()) is None
    True
    """
    where = getattr(tokenizer, "name_or_path", None)
    found = [os.path.join(where, "tokenizer.model")] if isinstance(where, str) and where else []
    found += [path for path in (getattr(tokenizer, "vocab_file", None),
                                (getattr(tokenizer, "init_kwargs", None) or {}).get("vocab_file"))
              if isinstance(path, str) and os.path.isabs(path)]  # a relative one names no directory
    return next((path for path in found if os.path.isfile(path)), None)


def _name(tokenizer):
    where = getattr(tokenizer, "name_or_path", None)
    return f"{type(tokenizer).__name__}" + (f" of {where!r}" if where else "")


def _check_arch(tokenizer, arch):
    if arch in SENTENCEPIECE_ARCHS:
        return SENTENCEPIECE_ARCHS[arch]
    raise ValueError(
        f"tokenizer={_name(tokenizer)} is a SentencePiece tokenizer, whose GGUF keys llama.cpp's converter writes its "
        f"own way for each architecture; mixle writes them as it does for {', '.join(SENTENCEPIECE_ARCHS)}, not for "
        f"arch={arch!r}: pass source_gguf= a GGUF of the model converted by llama.cpp (its keys are copied), or "
        f"vocab=[token of each id] (the file then runs on token ids)")


def _model_file(tokenizer):
    path = sentencepiece_file(tokenizer)
    if path is None:
        raise ValueError(
            f"tokenizer={_name(tokenizer)} is a SentencePiece tokenizer without its tokenizer.model file: llama.cpp's "
            f"'llama' tokenizer merges pieces by the scores only that file holds (transformers keeps them nowhere "
            f"else and does not save the file again): load the tokenizer from the model's directory with its "
            f"tokenizer.model (AutoTokenizer.from_pretrained(directory)), or pass source_gguf= a GGUF of the model")
    return path


def _pieces(gguf, scratch, path, tokenizer):
    """``[(text bytes, score, type)]`` of the SentencePiece file (gguf-py's reader), checked against the tokenizer."""
    require("sentencepiece", extra="hf", purpose="writing a SentencePiece tokenizer into a GGUF file")
    shutil.copyfile(path, os.path.join(scratch, "tokenizer.model"))
    try:
        vocab = gguf.SentencePieceVocab(Path(scratch))
    except (OSError, RuntimeError, ValueError) as err:
        raise ValueError(f"tokenizer={_name(tokenizer)}: its SentencePiece file {path!r} cannot be read "
                         f"({type(err).__name__}: {err}): the file is damaged; fetch it again") from None
    pieces = list(vocab.sentencepiece_tokens())
    added = tokenizer.added_tokens_decoder
    theirs = tokenizer.convert_ids_to_tokens(list(range(len(pieces))))
    for index, ((text, _, _), token) in enumerate(zip(pieces, theirs)):
        if index not in added and text.decode("utf-8") != token:
            raise ValueError(f"tokenizer={_name(tokenizer)}: the SentencePiece file {path!r} is not this tokenizer's "
                             f"(id {index} is {text.decode('utf-8')!r} there and {token!r} in the tokenizer): pass "
                             f"the tokenizer loaded from the directory of its own tokenizer.model")
    return pieces


def _adds(tokenizer):
    """``{"bos": bool, "eos": bool}``: whether the tokenizer puts its BOS / EOS around a text (what it
    does, which its ``add_bos_token`` attribute does not always say)."""
    plain, marked = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("a", add_special_tokens=True)
    found = {}
    for kind, where in (("bos", 0), ("eos", -1)):
        token_id = getattr(tokenizer, f"{kind}_token_id", None)
        if token_id is not None:
            found[kind] = len(marked) > len(plain) and marked[where] == token_id
    return found


def _class_defaults(tokenizer):
    """The special-token kinds the tokenizer has only from its class's defaults (transformers' Gemma
    tokenizer names a ``<mask>`` its files do not): the converter, reading the files, writes no id for them."""
    import inspect

    try:
        defaults = inspect.signature(type(tokenizer).__init__).parameters
    except (TypeError, ValueError):
        return []
    given = getattr(tokenizer, "init_kwargs", None) or {}
    return [kind for kind in ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
            if isinstance(given.get(f"{kind}_token"), str) and f"{kind}_token" in defaults
            and given[f"{kind}_token"] == defaults[f"{kind}_token"].default]


def _flags_and_config(tokenizer, scratch, config):
    """The scratch directory as the converter reads a model's: the tokenizer's files, with its add-BOS/EOS
    flags in ``tokenizer_config.json`` (transformers saves them in ``tokenizer.json`` only) and without
    the special tokens of its class's defaults, and ``config.json``.
    Returns the tokenizer config's ``add_prefix_space``."""
    tokenizer.save_pretrained(scratch)
    if config is not None and hasattr(config, "to_json_file"):
        config.to_json_file(os.path.join(scratch, "config.json"))
    settings_path = os.path.join(scratch, "tokenizer_config.json")
    settings = {}
    if os.path.isfile(settings_path):
        with open(settings_path, encoding="utf-8") as handle:
            settings = json.load(handle)
    for kind, flag in _adds(tokenizer).items():
        settings[f"add_{kind}_token"] = flag
    for kind in _class_defaults(tokenizer):
        settings.pop(f"{kind}_token", None)
    with open(settings_path, "w", encoding="utf-8") as handle:
        json.dump(settings, handle)
    return settings.get("add_prefix_space")


def add_sentencepiece_vocab(writer, tokenizer, n_vocab, arch, config, gguf):
    """Add to a gguf-py ``writer`` the ``tokenizer.*`` keys llama.cpp's converter writes for the
    SentencePiece ``tokenizer`` of an ``arch`` model of ``n_vocab`` embedding rows (the module docstring).

    Args:
        writer: a scratch ``gguf.GGUFWriter``.
        tokenizer: a transformers fast tokenizer of SentencePiece origin (``is_sentencepiece``).
        n_vocab: the rows of the model's token embedding.
        arch: llama.cpp's architecture name (``SENTENCEPIECE_ARCHS``).
        config: the transformers model config (its special-token ids), or None.
        gguf: the gguf-py module.

    Returns:
        Where the pieces were read from, in words.

    Raises:
        ValueError: an architecture outside ``SENTENCEPIECE_ARCHS``, no or another tokenizer's
            ``tokenizer.model``; the message names the tokenizer and the fix.

    >>> add_sentencepiece_vocab(None, None, 4, "phi3", None, None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: tokenizer=NoneType is a SentencePiece tokenizer, ... not for arch='phi3': pass source_gguf= ...
    """
    record = _check_arch(tokenizer, arch)
    path = _model_file(tokenizer)
    with tempfile.TemporaryDirectory() as scratch:
        space_prefix = _flags_and_config(tokenizer, scratch, config)
        pieces = _pieces(gguf, scratch, path, tokenizer)
        special = gguf.SpecialVocab(scratch, n_vocab=n_vocab)
    tokens, scores = [f"[PAD{i}]".encode() for i in range(n_vocab)], [_PAD_SCORE] * n_vocab
    types = [UNUSED] * n_vocab
    for index, (text, score, kind) in enumerate(pieces[:n_vocab]):
        tokens[index], scores[index], types[index] = text, score, int(kind)
    for index, added in tokenizer.added_tokens_decoder.items():
        if index >= n_vocab:
            continue
        text = added.content
        if added.special or looks_special(text):
            types[index] = CONTROL
        else:
            text, types[index] = text.replace("\u2581", " "), USER_DEFINED
        tokens[index], scores[index] = text.encode("utf-8"), _ADDED_SCORE
    if record.space_prefix == "config" and isinstance(space_prefix, bool):
        writer.add_add_space_prefix(space_prefix)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    special.add_to_gguf(writer, quiet=True)
    if record.space_prefix == "off":
        writer.add_add_space_prefix(False)
    return f"SentencePiece file {path}"
