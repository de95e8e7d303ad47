"""Tokenizers and GGUF files of them for the tokenizer tests, built here without mixle.

``byte_level_bpe(family)`` trains a tiny byte-level BPE with the ``tokenizers`` library whose
pre-tokenizer is the one of that llama.cpp family (GPT-2, SmolLM, Llama 3, Qwen2), with chat-model
special tokens and a chat template. ``converter_keys`` adds to a gguf-py ``GGUFWriter`` the
``tokenizer.*`` keys llama.cpp's ``convert_hf_to_gguf.py`` writes for such a tokenizer, and
``with_tokenizer`` rewrites a GGUF file with them: the source files a model is "read from".
"""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as SmolLM2's
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Llama 3's split (its tokenizer.json); Qwen2's is transformers' own constant.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Text whose pieces each family splits its own way: digit runs, contractions, runs of spaces and
# newlines, punctuation, accents, CJK, emoji, and the special tokens of a chat turn.
TEXT = ("Hello world! I've got 12345 apples, they'RE 3.14159 big... don't you think??  Two  spaces,\ttab\n\n"
        "new lines\n   indented 2024-01-05 ¿Qué tal? naïve café 日本語 🦙🦙 ------====== x=y+1;\n"
        "See the docs (section 3) [or] {this}: f(x) returns 'a', \"b\" and *args.\n"
        "<|im_start|>user\nWhat's 7*6?<|im_end|>\n<|im_start|>assistant\n42<|im_end|>\n")
FAMILIES = ("gpt-2", "smollm", "llama-bpe", "qwen2")


def _pre_tokenizer(family):
    from tokenizers import Regex, pre_tokenizers

    if family == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if family == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    if family == "qwen2":
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as split
    else:
        split = LLAMA3_SPLIT
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def byte_level_bpe(family, text, add_bos=False, pre_tokenizer=None):
    """A transformers tokenizer: byte-level BPE of ~400 tokens trained on ``text``, split as ``family``
    splits (Llama 3's ``ignore_merges``, Qwen2's NFC normalizer), SmolLM2's special tokens and a chat
    template; ``add_bos``: a post-processor that prepends BOS, as Llama 3's does."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    backend = tokenizers.Tokenizer(models.BPE(ignore_merges=family == "llama-bpe"))
    backend.pre_tokenizer = pre_tokenizer or _pre_tokenizer(family)
    backend.decoder = decoders.ByteLevel()
    if family == "qwen2":
        backend.normalizer = normalizers.NFC()
    backend.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", pair="<|im_start|> $A $B:1",
                                                               special_tokens=[("<|im_start|>", 1)])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>",
                                                     eos_token="<|im_end|>", unk_token="<|endoftext|>",
                                                     pad_token="<|im_end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def converter_keys(writer, tokenizer, pre, n_vocab, add_bos=None):
    """Add the ``tokenizer.*`` keys llama.cpp's converter writes for ``tokenizer`` (a model of
    ``n_vocab`` embedding rows) to the gguf-py ``writer``: tokens by id and ``[PAD<id>]`` past them,
    NORMAL / CONTROL (special) / UNUSED types, tokenizer.json's merges, bos/eos/unk/pad ids, the
    add-BOS flag and the chat template (``pre=None``: no pre-tokenizer name, llama.cpp's "default")."""
    import json

    tokens, types = [f"[PAD{i}]" for i in range(n_vocab)], [gguf.TokenType.UNUSED] * n_vocab
    special = set(tokenizer.all_special_tokens)
    for token, index in tokenizer.get_vocab().items():
        tokens[index] = token
        types[index] = gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(pair) for pair in merges])
    for kind in ("bos", "eos", "unk", "pad"):
        if getattr(tokenizer, f"{kind}_token_id") is not None:
            getattr(writer, f"add_{kind}_token_id")(getattr(tokenizer, f"{kind}_token_id"))
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)


def _field_value(field):
    """A reader field as the writer takes it back: strings as raw bytes."""
    kinds = gguf.GGUFValueType
    if field.types[0] == kinds.STRING:
        return bytes(field.parts[field.data[0]])
    if field.types[0] == kinds.ARRAY and field.types[-1] == kinds.STRING:
        return [bytes(field.parts[index]) for index in field.data]
    return field.contents()


def with_tokenizer(source, path, add_keys):
    """Write ``path``: the GGUF ``source`` with its ``tokenizer.*`` keys replaced by what ``add_keys(writer)``
    adds (its other keys and its tensors as they are)."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(path, arch)
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "tokenizer.")) or key == "general.architecture":
            continue
        item = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, _field_value(field), field.types[0], sub_type=item)
    add_keys(writer)
    for tensor in reader.tensors:
        floats = tensor.tensor_type.name in ("F32", "F16")
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=None if floats else tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tokenizer_fields(path):
    """``{key: (value types, value)}`` of every ``tokenizer.*`` key of a GGUF file, in order (strings as bytes)."""
    reader = gguf.GGUFReader(path)
    return {key: ([t.name for t in field.types], _field_value(field))
            for key, field in reader.fields.items() if key.startswith("tokenizer.")}
