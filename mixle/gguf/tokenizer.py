"""The tokenizer of a GGUF file mixle writes: every ``tokenizer.*`` key, as llama.cpp's converter writes it.

llama.cpp tokenizes a user's text with what the file's ``tokenizer.*`` metadata says: the
vocabulary and merges, but also the pre-tokenizer name (``tokenizer.ggml.pre``: how text is split
before merging), the special-token ids and whether BOS/EOS are added, and the chat template
llama-server and Ollama format conversations with. ``gguf_tokenizer`` gives all of it
(``GGUFTokenizer``) from one of:

* ``source_gguf``, the GGUF file the model was read from (``mixle finetune --model X.gguf``):
  every ``tokenizer.*`` key is copied verbatim, in the file's order, with its value type (strings
  as their raw bytes), so the new file tokenizes exactly as the source file does.
* a transformers fast tokenizer with a byte-level BPE model (llama.cpp's ``gpt2`` vocabulary),
  derived as llama.cpp's ``convert_hf_to_gguf.py`` derives it from a model directory:

  - tokens and types: each id's token (``tokenizer.get_vocab()``); ids past the tokenizer's, up to
    the embedding's rows, are UNUSED ``[PAD<id>]``; an added token is CONTROL when it is special
    or shaped like one (``<|...|>``, ``<｜...｜>``, ``<pad>``, ...), else USER_DEFINED, and one
    the tokenizer does not normalize is written as the tokenizer decodes its own encoding;
  - merges, special-token ids (bos, eos, unk, sep, pad, cls, mask), ``add_bos_token`` /
    ``add_eos_token`` and the chat template: gguf-py's ``SpecialVocab`` (the converter's own
    reader) on the tokenizer's files as ``save_pretrained`` writes them, beside the model's
    ``config.json``; with no merges, every split of a token into two tokens (llama.cpp refuses a
    gpt2 vocabulary without merges);
  - ``add_space_prefix`` for a ``llama`` model, as the converter writes it: the tokenizer
    config's ``add_prefix_space`` when it has one;
  - the pre-tokenizer name: ``tokenizer_pre=`` when given (written as is), else derived from the
    tokenizer's own definition. The converter names it by hashing the tokenizer's ids of a test
    text against the models it knows; mixle instead recognizes the definition itself (the
    ``pre_tokenizer`` and BPE model of ``tokenizer.json``; a normalizer other than NFC, which
    llama.cpp does not apply either, is refused): ``PRE_TOKENIZERS`` maps each definition llama.cpp
    reproduces to the name the converter writes for the model family it comes from. llama.cpp
    splits text the same way under every name that shares a definition (StarCoder's
    ``"starcoder"`` splits as ``"smollm"``, DeepSeek-R1-Distill-Qwen's ``"deepseek-r1-qwen"`` as
    ``"qwen2"``), so for such a model only the name differs from the converter's; pass
    ``tokenizer_pre=`` to write that one. A definition outside the table is refused rather than
    written under a name llama.cpp would split text differently with (its ``"default"`` is
    what a file without the key gets): the message names the fixes.

* a transformers tokenizer of SentencePiece origin (Gemma 2 and 3, Llama 2, Mistral: a Unigram or
  byte-fallback BPE ``tokenizer.json`` model), loaded from a directory with its ``tokenizer.model``:
  llama.cpp's ``llama`` tokenizer model with per-token scores and types, as the converter writes it
  for the ``llama``, ``gemma2`` and ``gemma3`` architectures (``mixle.gguf.sentencepiece_vocab``);
  any other SentencePiece case is refused with the reason.
* ``vocab``, a mixle ``CharTokenizer`` / ``ByteTokenizer`` or nothing: mixle's own vocabulary
  (``mixle.gguf.vocab.vocabulary``: model, tokens, types, merges); such a file runs on token ids.
"""

import json
import os
import tempfile
from dataclasses import dataclass

from mixle._optional import require
from mixle.gguf.sentencepiece_vocab import add_sentencepiece_vocab, is_sentencepiece, looks_special
from mixle.gguf.vocab import check_token_ids, split_merges, vocabulary

__all__ = ["GGUFTokenizer", "gguf_tokenizer", "pre_tokenizer_name", "split_as_llama_cpp", "PRE_TOKENIZERS"]

# llama.cpp's token types (LLAMA_TOKEN_TYPE_*).
NORMAL, UNUSED, CONTROL, USER_DEFINED = 1, 5, 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(use_regex):
    return {"type": "ByteLevel", "add_prefix_space": False, "use_regex": use_regex}


def _split_then_bytes(regex):
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, _byte_level(False)]}


# llama.cpp's pre-tokenizer name -> (tokenizer.json's pre_tokenizer without its offset-only fields,
# the BPE model's ignore_merges): the definitions llama.cpp splits text exactly as, named as the
# converter names them for GPT-2, SmolLM, Llama 3 and Qwen2.
PRE_TOKENIZERS = {
    "gpt-2": (_byte_level(True), False),
    "smollm": ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                      _byte_level(True)]}, False),
    "llama-bpe": (_split_then_bytes(_LLAMA3_SPLIT), True),
    "qwen2": (_split_then_bytes(_QWEN2_SPLIT), False),
}
_OFFSET_ONLY = ("trim_offsets",)


@dataclass(frozen=True)
class GGUFTokenizer:
    """Every ``tokenizer.*`` key of a GGUF file.

    Attributes:
        entries: ``((key, value, GGUFValueType, array item type or None), ...)`` in writing order,
            as gguf-py's ``GGUFWriter.add_key_value`` takes them.
        origin: where they come from, in words (for reports and messages).
    """

    entries: tuple
    origin: str

    def value(self, key, default=None):
        """The value of ``key`` (e.g. ``"tokenizer.ggml.pre"``), or ``default``; strings copied from a
        source file are the bytes it stores."""
        return next((value for name, value, _, _ in self.entries if name == key), default)

    @property
    def n_tokens(self):
        """How many tokens the vocabulary has (one per embedding row)."""
        return len(self.value("tokenizer.ggml.tokens", ()))

    def add_to(self, writer):
        """Add every key to a gguf-py ``GGUFWriter``."""
        for key, value, value_type, item_type in self.entries:
            writer.add_key_value(key, value, value_type, sub_type=item_type)


def gguf_tokenizer(n_vocab, *, vocab=None, tokenizer=None, source_gguf=None, tokenizer_pre=None, arch=None,
                   config=None):
    """The ``tokenizer.*`` keys of a GGUF file for a model of ``n_vocab`` embedding rows (see the module docstring).

    Args:
        n_vocab: the rows of the model's token embedding (one token each).
        vocab: the token of each id (str or bytes); mixle's vocabulary.
        tokenizer: a transformers fast tokenizer, byte-level BPE or of SentencePiece origin (derived as
            llama.cpp's converter does), a mixle ``CharTokenizer`` / ``ByteTokenizer``, or a ``GGUFTokenizer`` (used as is).
        source_gguf: instead, the path of the GGUF file the model was read from: its ``tokenizer.*``
            keys are copied verbatim.
        tokenizer_pre: with a transformers tokenizer, llama.cpp's pre-tokenizer name to write
            (``tokenizer.ggml.pre``) instead of the one derived from the tokenizer.
        arch: llama.cpp's architecture of the file (``"llama"``, ``"smollm3"``: ``add_space_prefix``, as converted).
        config: the transformers model config (its special-token ids, as the converter reads ``config.json``).

    Returns:
        A ``GGUFTokenizer``.

    Raises:
        ValueError: more than one source, a vocabulary that does not fit ``n_vocab``, a source GGUF
            without a vocabulary, or a pre-tokenizer llama.cpp does not reproduce; the message names
            the argument and the fix.

    >>> words = gguf_tokenizer(3, vocab=["a", " ", "a "])
    >>> words.value("tokenizer.ggml.tokens"), words.value("tokenizer.ggml.merges"), words.n_tokens
    (['a', 'Ġ', 'aĠ'], ['a Ġ'], 3)
    """
    given = [name for name, value in (("vocab", vocab), ("tokenizer", tokenizer), ("source_gguf", source_gguf))
             if value is not None]
    if len(given) > 1:
        both = "both" if len(given) == 2 else "all of"
        raise ValueError(f"pass one of vocab=, tokenizer= or source_gguf=, not {both} {' and '.join(given)}")
    is_transformers = tokenizer is not None and hasattr(tokenizer, "backend_tokenizer")
    if tokenizer_pre is not None and not (isinstance(tokenizer_pre, str) and tokenizer_pre.strip()):
        raise ValueError(f"tokenizer_pre={tokenizer_pre!r} must be llama.cpp's pre-tokenizer name, e.g. 'smollm'")
    if tokenizer_pre is not None and not is_transformers:
        raise ValueError(f"tokenizer_pre={tokenizer_pre!r} names the pre-tokenizer of a transformers tokenizer: pass "
                         f"tokenizer= too (a source_gguf's own name is copied with the rest)")
    gguf = require("gguf", extra="gguf", purpose="writing a GGUF tokenizer")
    if isinstance(tokenizer, GGUFTokenizer):
        if tokenizer.n_tokens != n_vocab:
            raise ValueError(f"tokenizer ({tokenizer.origin}) has {tokenizer.n_tokens} tokens but the model's "
                             f"embedding has {n_vocab} rows: pass the tokenizer of this model")
        return tokenizer
    if source_gguf is not None:
        return _from_gguf(source_gguf, n_vocab, gguf)
    if is_transformers:
        return _from_transformers(tokenizer, n_vocab, tokenizer_pre, arch, config, gguf)
    words = vocabulary(n_vocab, vocab, tokenizer)
    writer = gguf.GGUFWriter(None, arch or "gpt2")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(words.tokens)
    writer.add_token_types(words.types)
    writer.add_token_merges(words.merges)
    for method, token_id in (("add_bos_token_id", words.bos), ("add_eos_token_id", words.eos)):
        if token_id is not None:
            getattr(writer, method)(token_id)
    return GGUFTokenizer(_entries(writer), "mixle's vocabulary" if vocab is not None or tokenizer is not None
                         else "placeholder tokens")


def _entries(writer):
    """The ``tokenizer.*`` keys a scratch ``GGUFWriter`` was given, as ``GGUFTokenizer.entries``."""
    entries = tuple((key, item.value, item.type, item.sub_type) for key, item in writer.kv_data[0].items()
                    if key.startswith("tokenizer."))
    writer.close()
    return entries


# ---------------------------------------------------------------------------------------- a source GGUF


def _from_gguf(path, n_vocab, gguf):
    """Every ``tokenizer.*`` key of the GGUF file ``path``, verbatim."""
    where = f"source_gguf={os.fspath(path)!r}"
    try:
        reader = gguf.GGUFReader(os.fspath(path))
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        raise ValueError(f"{where} cannot be read as a GGUF file ({type(err).__name__}: {err}): pass the .gguf file "
                         f"the model was read from") from None
    entries = tuple(_copied(key, field, gguf, where) for key, field in reader.fields.items()
                    if key.startswith("tokenizer."))
    words = GGUFTokenizer(entries, f"copied from {os.fspath(path)}")
    if not words.n_tokens:
        raise ValueError(f"{where} has no tokenizer.ggml.tokens, so llama.cpp could not run the file written from it: "
                         f"pass tokenizer= (the model's transformers tokenizer) instead")
    if words.n_tokens != n_vocab:
        raise ValueError(f"{where} has {words.n_tokens} tokens but the model's embedding has {n_vocab} rows: pass the "
                         f"GGUF file this model was read from")
    return words


def _copied(key, field, gguf, where):
    """One metadata field as a ``GGUFTokenizer`` entry: strings as their bytes, numbers as they were."""
    kinds = gguf.GGUFValueType
    value_type = field.types[0]
    if value_type == kinds.STRING:
        return key, bytes(field.parts[field.data[0]]), value_type, None
    if value_type != kinds.ARRAY:
        return key, field.contents(), value_type, None
    item_type = field.types[-1]
    if len(field.types) != 2 or not field.data:
        raise ValueError(f"{where}: {key!r} is an empty or nested array, which gguf-py cannot write back: remove the "
                         f"key from the source file, or pass tokenizer= instead")
    if item_type == kinds.STRING:
        return key, [bytes(field.parts[index]) for index in field.data], value_type, item_type
    return key, field.contents(), value_type, item_type


# ---------------------------------------------------------------------------------- a transformers tokenizer


def _canonical(node):
    """A tokenizer.json definition without the fields that change only offsets, not the split."""
    if isinstance(node, dict):
        return {key: _canonical(value) for key, value in node.items() if key not in _OFFSET_ONLY}
    if isinstance(node, list):
        return [_canonical(value) for value in node]
    return node


def _with_offsets(node):
    """A ``PRE_TOKENIZERS`` definition with the offset-only fields tokenizers needs, at their defaults."""
    if isinstance(node, dict):
        node = {key: _with_offsets(value) for key, value in node.items()}
        if node.get("type") == "ByteLevel":
            node.setdefault("trim_offsets", True)
    elif isinstance(node, list):
        node = [_with_offsets(value) for value in node]
    return node


def split_as_llama_cpp(tokenizer, pre):
    """Make a transformers fast byte-level BPE ``tokenizer`` split text as llama.cpp does for the
    pre-tokenizer name ``pre`` (a GGUF's ``tokenizer.ggml.pre``), so training sees the ids a user's
    prompt gets from llama.cpp. transformers' GGUF loader gives every gpt2-type vocabulary GPT-2's
    split, which differs e.g. on digit runs for ``"smollm"``. A name outside ``PRE_TOKENIZERS``
    leaves the tokenizer as it is.

    Returns:
        True when the tokenizer now splits as ``pre`` names, False when it was left as it is.

    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> from transformers import PreTrainedTokenizerFast
    >>> backend = Tokenizer(models.BPE())
    >>> backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    >>> tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    >>> split_as_llama_cpp(tokenizer, "smollm"), pre_tokenizer_name(tokenizer)
    (True, 'smollm')
    """
    if pre not in PRE_TOKENIZERS:
        return False
    tokenizers = require("tokenizers", "hf")
    definition, ignore_merges = PRE_TOKENIZERS[pre]
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    state["pre_tokenizer"] = _with_offsets(definition)
    state["model"]["ignore_merges"] = ignore_merges
    rebuilt = tokenizers.Tokenizer.from_str(json.dumps(state))
    tokenizer.backend_tokenizer.pre_tokenizer = rebuilt.pre_tokenizer
    tokenizer.backend_tokenizer.model = rebuilt.model
    return True


def pre_tokenizer_name(tokenizer):
    """llama.cpp's pre-tokenizer name for a transformers fast byte-level BPE ``tokenizer`` (``PRE_TOKENIZERS``).

    Raises:
        ValueError: a definition llama.cpp does not reproduce, naming it and the fixes.

    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> from transformers import PreTrainedTokenizerFast
    >>> backend = Tokenizer(models.BPE())
    >>> backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
    ...                                                  pre_tokenizers.ByteLevel(add_prefix_space=False)])
    >>> pre_tokenizer_name(PreTrainedTokenizerFast(tokenizer_object=backend))
    'smollm'
    """
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model, normalizer = state.get("model") or {}, state.get("normalizer")
    pre = _canonical(state.get("pre_tokenizer"))
    plain_bpe = (model.get("type") == "BPE" and model.get("dropout") is None and not model.get("byte_fallback")
                 and not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix"))
    fix = ("pass tokenizer_pre= the name llama.cpp's convert_hf_to_gguf.py writes for this model (the "
           "tokenizer.ggml.pre of a GGUF of it), or source_gguf= a GGUF of the model to copy its tokenizer from")
    if normalizer is not None and normalizer != {"type": "NFC"}:
        raise ValueError(f"the tokenizer normalizes text ({json.dumps(normalizer)[:200]}), which llama.cpp's gpt2 "
                         f"tokenizer does not: its files would tokenize text otherwise; {fix}")
    for name, (definition, ignore_merges) in PRE_TOKENIZERS.items():
        if plain_bpe and pre == definition and bool(model.get("ignore_merges")) == ignore_merges:
            return name
    raise ValueError(f"the tokenizer's pre-tokenizer {json.dumps(pre)[:300]} (BPE ignore_merges="
                     f"{bool(model.get('ignore_merges'))}) is none mixle names for llama.cpp "
                     f"({', '.join(PRE_TOKENIZERS)}), and under another name llama.cpp would split text otherwise "
                     f"than this tokenizer: {fix}")


def _tokens_and_types(tokenizer, ids, n_vocab):
    tokens, types = [f"[PAD{i}]" for i in range(n_vocab)], [UNUSED] * n_vocab
    for token, index in ids.items():
        tokens[index], types[index] = token, NORMAL
    for index, added in tokenizer.added_tokens_decoder.items():
        text = added.content
        if not added.normalized:  # llama.cpp expects added tokens as the tokenizer spells them after normalizing
            text = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))
        if added.special or looks_special(text):
            types[index] = CONTROL
        else:
            text, types[index] = text.replace("\u2581", " "), USER_DEFINED
        tokens[index] = text
    return tokens, types


# The architectures of llama.cpp's LlamaModel converter family, whose set_vocab writes add_space_prefix.
_SPACE_PREFIX_ARCHS = ("llama", "smollm3")


def _from_transformers(tokenizer, n_vocab, tokenizer_pre, arch, config, gguf):
    """The keys llama.cpp's converter writes for a byte-level BPE tokenizer (the module docstring)."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model = state.get("model") or {}
    if is_sentencepiece(tokenizer):
        return _from_sentencepiece(tokenizer, n_vocab, tokenizer_pre, arch, config, gguf)
    if model.get("type") != "BPE" or '"ByteLevel"' not in json.dumps(state.get("pre_tokenizer")):
        raise ValueError(
            f"tokenizer={type(tokenizer).__name__} has a {model.get('type')} model without GPT-2's byte-level "
            f"pre-tokenizer, which llama.cpp's gpt2 tokenizer does not reproduce: pass vocab=[token of each id] "
            f"(the file then runs on token ids)")
    ids = check_token_ids(tokenizer, n_vocab)
    pre = tokenizer_pre if tokenizer_pre is not None else pre_tokenizer_name(tokenizer)
    tokens, types = _tokens_and_types(tokenizer, ids, n_vocab)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer.save_pretrained(scratch)
        if config is not None and hasattr(config, "to_json_file"):
            config.to_json_file(os.path.join(scratch, "config.json"))
        special = gguf.SpecialVocab(scratch, load_merges=True, n_vocab=n_vocab)
        settings, space_prefix = os.path.join(scratch, "tokenizer_config.json"), None
        if os.path.isfile(settings):
            with open(settings, encoding="utf-8") as handle:
                space_prefix = json.load(handle).get("add_prefix_space")
    if not special.merges:
        special.merges = split_merges(tokens)
    writer = gguf.GGUFWriter(None, arch or "gpt2")
    if arch in _SPACE_PREFIX_ARCHS and isinstance(space_prefix, bool):
        writer.add_add_space_prefix(space_prefix)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special.add_to_gguf(writer, quiet=True)
    how = "given" if tokenizer_pre is not None else "derived from its pre-tokenizer"
    return GGUFTokenizer(_entries(writer), f"the transformers tokenizer (pre-tokenizer {pre!r}, {how})")


def _from_sentencepiece(tokenizer, n_vocab, tokenizer_pre, arch, config, gguf):
    """The keys llama.cpp's converter writes for a SentencePiece tokenizer (``mixle.gguf.sentencepiece_vocab``)."""
    if tokenizer_pre is not None:
        raise ValueError(f"tokenizer_pre={tokenizer_pre!r} names the pre-tokenizer of a byte-level BPE tokenizer, but "
                         f"tokenizer={type(tokenizer).__name__} is a SentencePiece one, for which llama.cpp's converter "
                         f"always writes 'default': leave tokenizer_pre (--tokenizer-pre) out")
    check_token_ids(tokenizer, n_vocab)
    writer = gguf.GGUFWriter(None, arch or "llama")
    try:
        origin = add_sentencepiece_vocab(writer, tokenizer, n_vocab, arch, config, gguf)
    except ValueError:
        writer.close()
        raise
    return GGUFTokenizer(_entries(writer), f"the transformers tokenizer's {origin}")
