"""A SentencePiece tokenizer (Gemma 3's kind) gets the GGUF keys llama.cpp's converter writes.

A tiny SentencePiece BPE model with byte fallback and Gemma's special pieces (``<pad>``, ``<eos>``,
``<bos>``, ``<unk>``, ``<mask>``, ``<start_of_turn>``, ``<end_of_turn>``) is laid out as a Gemma 3
checkpoint directory: ``tokenizer.model``, the ``tokenizer.json`` transformers makes of it, a
``tokenizer_config.json`` as Gemma's (its added tokens, add-BOS/EOS flags, chat template), and a tiny
seeded ``Gemma3ForCausalLM`` whose embedding has rows past the tokenizer's. mixle's file, from the
tokenizer transformers loads from that directory, must hold every ``tokenizer.*`` key llama.cpp's
``convert_hf_to_gguf.py`` writes for the directory, with the same values and types.

CI has no converter, so ``benchmarks/make_sentencepiece_fixture.py`` ran it once and stored its keys
and the SentencePiece model it was run on (``tests/fixtures/sentencepiece_reference.json``); the
live test reruns it where the converter is here (``MIXLE_LLAMA_CPP_SOURCE`` or the sdist unpacked
under ``/tmp/llsdist``), and llama.cpp must tokenize text as transformers does where llama-cpp-python
is installed.
"""

import base64
import io
import json
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
sentencepiece = pytest.importorskip("sentencepiece")

from mixle import save_gguf  # noqa: E402
from mixle.gguf.tokenizer import gguf_tokenizer  # noqa: E402
from tests.gguf_tokenizer_cases import tokenizer_fields  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = "tests/fixtures/sentencepiece_reference.json"
EXTRA_ROWS = 2  # embedding rows past the tokenizer's ids: [PAD<id>] tokens
SPECIAL_PIECES = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                      bos_piece="<bos>", unk_piece="<unk>")
USER_PIECES = ["<mask>", "<start_of_turn>", "<end_of_turn>"]  # ids 4, 5, 6
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
                 "{{ message['content'] }}<end_of_turn>\n{% endfor %}"
                 "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
TEXT = ("Hello world! I've got 12345 apples, they're 3.14 big...  Two  spaces,\ttab\n\nnew lines\n"
        "naïve café 日本語 🦙 x=y+1;\n<start_of_turn>user\nWhat's 7*6?<end_of_turn>\n<start_of_turn>model\n42")
CORPUS_LINES = 200


def train_tokenizer_model(first_line=0):
    """The bytes of a SentencePiece BPE model of 480 pieces (256 of them bytes) trained on mixle's default text, as
    Gemma's: byte fallback, digits split, no dummy prefix, no normalization
    (``first_line``: where in the text its lines start)."""
    from mixle.lm.data import default_text

    lines = [line for line in default_text().splitlines() if line.strip()][first_line:first_line + CORPUS_LINES]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=480, model_type="bpe", byte_fallback=True,
        user_defined_symbols=USER_PIECES, add_dummy_prefix=False, split_digits=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", character_coverage=1.0, allow_whitespace_only_pieces=True,
        num_threads=1, minloglevel=2, **SPECIAL_PIECES)
    return model.getvalue()


def gemma_directory(directory, model_bytes):
    """Lay out a tiny Gemma 3 checkpoint with the SentencePiece model ``model_bytes`` in ``directory``;
    returns the number of embedding rows."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.model").write_bytes(model_bytes)
    settings = {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    (directory / "tokenizer.json").write_text(tokenizer.backend_tokenizer.to_str())
    settings["added_tokens_decoder"] = {  # as Gemma's tokenizer_config.json lists them
        str(index): {"content": token.content, "lstrip": token.lstrip, "normalized": token.normalized,
                     "rstrip": token.rstrip, "single_word": token.single_word, "special": token.special}
        for index, token in sorted(tokenizer.added_tokens_decoder.items())}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))
    n_vocab = len(tokenizer) + EXTRA_ROWS
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=n_vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=16, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, bos_token_id=2)
    transformers.Gemma3ForCausalLM(config).eval().save_pretrained(directory)
    return n_vocab


def jsonable(fields):
    """``tokenizer_fields`` of a file as JSON holds them: strings decoded, floats as floats."""
    def plain(value):
        if isinstance(value, bytes):
            return value.decode("utf-8")
        if isinstance(value, list):
            return [plain(item) for item in value]
        return float(value) if isinstance(value, float) else value

    return {key: [types, plain(value)] for key, (types, value) in fields.items()}


def llama_cpp_source():
    """The llama.cpp source tree holding convert_hf_to_gguf.py (None if absent)."""
    import glob

    found = [os.environ.get("MIXLE_LLAMA_CPP_SOURCE")] + sorted(glob.glob("/tmp/llsdist/*/vendor/llama.cpp"))
    return next((p for p in found if p and os.path.isfile(os.path.join(p, "convert_hf_to_gguf.py"))), None)


def converter_keys(source, directory, out):
    """The ``tokenizer.*`` keys (``jsonable``) llama.cpp's converter writes for ``directory`` (--vocab-only)."""
    subprocess.run([sys.executable, os.path.join(source, "convert_hf_to_gguf.py"), str(directory), "--outfile",
                    str(out), "--outtype", "f32", "--vocab-only"], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": os.path.join(source, "gguf-py")})
    return jsonable(tokenizer_fields(out))


# ------------------------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def reference():
    path = ROOT / FIXTURE
    if not path.exists():
        pytest.fail(f"{FIXTURE} is missing: run `python benchmarks/make_sentencepiece_fixture.py`")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def gemma(reference, tmp_path_factory):
    """``(directory, n_vocab, tokenizer, model, mixle's file)`` of the fixture's SentencePiece model."""
    directory = tmp_path_factory.mktemp("gemma3")
    n_vocab = gemma_directory(directory, base64.b64decode(reference["tokenizer_model_base64"]))
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.Gemma3ForCausalLM.from_pretrained(directory).eval()
    path = directory / "mixle.gguf"
    save_gguf(model, path, tokenizer=tokenizer, float_matrices="f32")
    return directory, n_vocab, tokenizer, model, path


def test_a_gemma_sentencepiece_tokenizer_gets_the_keys_llama_cpps_converter_writes(gemma, reference):
    directory, n_vocab, _, _, path = gemma
    mine = jsonable(tokenizer_fields(path))
    assert len(mine["tokenizer.ggml.tokens"][1]) == n_vocab
    assert mine == reference["keys"]
    assert list(mine) == list(reference["keys"])  # in the converter's order too


def test_the_keys_are_gemmas_sentencepiece_vocabulary(gemma):
    """Independent of the fixture: pieces, scores and kinds as sentencepiece reads them, [PAD<id>] past them."""
    directory, n_vocab, tokenizer, _, path = gemma
    fields = tokenizer_fields(path)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(directory / "tokenizer.model"))
    tokens, scores = fields["tokenizer.ggml.tokens"][1], fields["tokenizer.ggml.scores"][1]
    types = fields["tokenizer.ggml.token_type"][1]
    assert fields["tokenizer.ggml.model"][1] == b"llama" and fields["tokenizer.ggml.pre"][1] == b"default"
    for index in range(processor.vocab_size()):
        assert tokens[index] == processor.IdToPiece(index).encode()
        kind = ("control" if processor.IsControl(index) else "byte" if processor.IsByte(index)
                else "unknown" if processor.IsUnknown(index) else "normal")
        if index not in tokenizer.added_tokens_decoder:
            assert (scores[index], types[index]) == (pytest.approx(processor.GetScore(index)),
                                                     {"normal": 1, "unknown": 2, "control": 3, "byte": 6}[kind])
    assert types[:7] == [3, 3, 3, 3, 3, 4, 4]  # pad eos bos unk special, <mask> looks special, turns user-defined
    assert tokens[processor.vocab_size():] == [f"[PAD{i}]".encode() for i in range(processor.vocab_size(), n_vocab)]
    assert fields["tokenizer.ggml.bos_token_id"][1] == 2 and fields["tokenizer.ggml.eos_token_id"][1] == 1
    assert fields["tokenizer.ggml.add_bos_token"][1] is True and fields["tokenizer.ggml.add_eos_token"][1] is False
    assert fields["tokenizer.ggml.add_space_prefix"][1] is False
    assert fields["tokenizer.chat_template"][1] == CHAT_TEMPLATE.encode()


@pytest.mark.skipif(llama_cpp_source() is None, reason="llama.cpp's convert_hf_to_gguf.py is not here")
def test_live_llama_cpps_converter_writes_the_same_keys(gemma, tmp_path):
    directory, _, _, _, path = gemma
    assert jsonable(tokenizer_fields(path)) == converter_keys(llama_cpp_source(), directory, tmp_path / "c.gguf")


def test_llama_cpp_tokenizes_text_as_transformers(gemma):
    pytest.importorskip("llama_cpp")
    from mixle.lm.llama_cpp_eval import llama_cpp_problem, quiet_stderr

    if (problem := llama_cpp_problem()) is not None:
        pytest.skip(problem)
    import llama_cpp

    _, _, tokenizer, _, path = gemma
    with quiet_stderr():
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        for add in (False, True):
            assert llm.tokenize(TEXT.encode(), add_bos=add, special=True) == tokenizer.encode(
                TEXT, add_special_tokens=add), add
    finally:
        llm.close()


# ------------------------------------------------------------------------------------------- refusals


def test_a_tokenizer_without_its_sentencepiece_file_is_refused(gemma, tmp_path):
    """transformers saves no tokenizer.model: a tokenizer loaded from such a copy has no scores to write."""
    _, n_vocab, tokenizer, model, _ = gemma
    tokenizer.save_pretrained(tmp_path / "copy")
    copy = transformers.AutoTokenizer.from_pretrained(tmp_path / "copy")
    path = tmp_path / "m.gguf"
    with pytest.raises(ValueError, match=r"tokenizer=GemmaTokenizer of '.*copy' is a SentencePiece tokenizer without "
                                         r"its tokenizer.model file.*AutoTokenizer.from_pretrained\(directory\)"):
        save_gguf(model, path, tokenizer=copy)
    assert not path.exists()


def test_another_tokenizers_sentencepiece_file_an_architecture_and_a_pre_tokenizer_are_refused(gemma, tmp_path):
    directory, n_vocab, tokenizer, _, _ = gemma
    with pytest.raises(ValueError, match=r"SentencePiece tokenizer.*not for arch='qwen2': pass source_gguf="):
        gguf_tokenizer(n_vocab, tokenizer=tokenizer, arch="qwen2")
    with pytest.raises(ValueError, match=r"tokenizer_pre='gpt-2'.*SentencePiece.*leave tokenizer_pre"):
        gguf_tokenizer(n_vocab, tokenizer=tokenizer, tokenizer_pre="gpt-2", arch="gemma3")
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (swapped / name).write_bytes((directory / name).read_bytes())
    loaded = transformers.AutoTokenizer.from_pretrained(swapped)
    (swapped / "tokenizer.model").write_bytes(train_tokenizer_model(first_line=CORPUS_LINES))  # another text's
    with pytest.raises(ValueError, match=r"the SentencePiece file '.*swapped/tokenizer.model' is not this tokenizer's "
                                         r"\(id \d+ is"):
        gguf_tokenizer(n_vocab, tokenizer=loaded, arch="gemma3")


def test_the_float_checkpoint_keeps_the_tokenizer_model_and_writes_the_same_keys(gemma, tmp_path):
    """transformers does not save tokenizer.model again: save_pretrained_float copies it, so the
    checkpoint it writes (finetune's hf/) gives the same GGUF tokenizer as the directory it came from."""
    import mixle

    directory, _, tokenizer, model, path = gemma
    mixle.save_pretrained_float(model, tmp_path / "hf", tokenizer=tokenizer)
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == (directory / "tokenizer.model").read_bytes()
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    save_gguf(model, tmp_path / "again.gguf", tokenizer=again, float_matrices="f32")
    # save_pretrained writes the class's default <mask> into tokenizer_config.json, so the directory
    # now names it (llama.cpp's converter then writes its id as well): the one key that differs
    mask = {"tokenizer.ggml.mask_token_id": [["UINT32"], again.convert_tokens_to_ids("<mask>")]}
    assert jsonable(tokenizer_fields(tmp_path / "again.gguf")) == {**jsonable(tokenizer_fields(path)), **mask}
