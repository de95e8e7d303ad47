"""Every GGUF mixle writes carries its model's tokenizer as llama.cpp's converter writes it.

For each pre-tokenizer family llama.cpp knows (GPT-2, SmolLM, Llama 3, Qwen2) a tiny byte-level BPE
is trained here and a source GGUF of a tiny Llama is written with gguf-py, holding the
``tokenizer.*`` keys llama.cpp's converter writes (``tests/gguf_tokenizer_cases.py``). mixle's
files, from that source GGUF (``source_gguf=``) and from the transformers tokenizer
(``tokenizer=``), must hold the same keys, be read by transformers as the same tokenizer, and be
tokenized by llama.cpp into the same ids as the source file and as transformers does.
"""

import contextlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from mixle import save_gguf  # noqa: E402
from mixle.gguf.tokenizer import gguf_tokenizer, pre_tokenizer_name  # noqa: E402
from mixle.lm.data import default_text  # noqa: E402
from tests.gguf_tokenizer_cases import (  # noqa: E402
    CHAT_TEMPLATE, FAMILIES, TEXT, byte_level_bpe, converter_keys, tokenizer_fields, with_tokenizer)

CORPUS = default_text()[:8000]
EXTRA_ROWS = 3  # embedding rows past the tokenizer's ids: [PAD<id>] tokens


def _llama(n_vocab):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=n_vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return transformers.LlamaForCausalLM(config).eval()


class Case:
    """One family's tokenizer, model, source GGUF and mixle's two files of it."""

    def __init__(self, family, root):
        self.family, self.root = family, root
        self.add_bos = True if family == "llama-bpe" else None  # Llama 3's tokenizer prepends BOS
        self.tokenizer = byte_level_bpe(family, CORPUS, add_bos=bool(self.add_bos))
        self.n_vocab = len(self.tokenizer) + EXTRA_ROWS
        self.model = _llama(self.n_vocab)
        save_gguf(self.model, root / "weights.gguf", float_matrices="f32")  # only its weights are used
        self.source = root / "source.gguf"
        with_tokenizer(root / "weights.gguf", self.source,
                       lambda writer: converter_keys(writer, self.tokenizer, family, self.n_vocab, self.add_bos))
        self.copied, self.derived = root / "copied.gguf", root / "derived.gguf"
        save_gguf(self.model, self.copied, source_gguf=self.source, float_matrices="f32")
        save_gguf(self.model, self.derived, tokenizer=self.tokenizer, float_matrices="f32")


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory):
    return Case(request.param, tmp_path_factory.mktemp(request.param))


def test_a_source_gguf_tokenizer_is_copied_key_for_key(case):
    """Every tokenizer.* key of the source file, in its order, with its value types and bytes."""
    source = tokenizer_fields(case.source)
    assert source["tokenizer.ggml.pre"] == (["STRING"], case.family.encode())
    assert list(tokenizer_fields(case.copied).items()) == list(source.items())


def test_a_transformers_tokenizer_gets_the_keys_llama_cpps_converter_writes(case):
    """Pre-tokenizer name, tokens, types, merges, special ids, add-BOS flag and chat template, typed alike."""
    assert tokenizer_fields(case.derived) == tokenizer_fields(case.source)


def test_transformers_reads_the_source_files_tokenizer_from_mixles_files(case):
    want = transformers.AutoTokenizer.from_pretrained(case.root, gguf_file=case.source.name)
    for path in (case.copied, case.derived):
        got = transformers.AutoTokenizer.from_pretrained(case.root, gguf_file=path.name)
        for add_special in (False, True):
            assert got.encode(TEXT, add_special_tokens=add_special) == want.encode(TEXT, add_special_tokens=add_special)
        assert got.chat_template == want.chat_template == CHAT_TEMPLATE


def _llama_cpp():
    """llama-cpp-python where it is installed and runs here, else the test is skipped."""
    pytest.importorskip("llama_cpp")
    from mixle.lm.llama_cpp_eval import llama_cpp_problem

    problem = llama_cpp_problem()
    if problem is not None:
        pytest.skip(problem)
    import llama_cpp

    return llama_cpp


@contextlib.contextmanager
def _vocabulary(llama_cpp, path):
    from mixle.lm.llama_cpp_eval import quiet_stderr

    with quiet_stderr():
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        yield llm
    finally:
        llm.close()


def test_llama_cpp_tokenizes_text_with_mixles_files_as_with_the_source_and_transformers(case):
    llama_cpp = _llama_cpp()
    with _vocabulary(llama_cpp, case.source) as llm:
        want = {add: llm.tokenize(TEXT.encode(), add_bos=add, special=True) for add in (False, True)}
        template = llm.metadata["tokenizer.chat_template"]
    for add in (False, True):  # llama.cpp splits as transformers does, BOS included where the file says so
        assert want[add] == case.tokenizer.encode(TEXT, add_special_tokens=add)
    for path in (case.copied, case.derived):
        with _vocabulary(llama_cpp, path) as llm:
            for add in (False, True):
                assert llm.tokenize(TEXT.encode(), add_bos=add, special=True) == want[add], (path.name, add)
            assert llm.metadata["tokenizer.chat_template"] == template == CHAT_TEMPLATE


@pytest.mark.parametrize("case", ["smollm"], indirect=True)
def test_the_text_evaluation_sees_a_lost_tokenizer_that_token_ids_cannot(case):
    """The source file without its pre-tokenizer name (mixle's files before): llama.cpp runs the same
    token ids to the same loss, but splits the text into other tokens; llama_cpp_text_loss sees it."""
    _llama_cpp()
    import numpy as np

    from mixle.lm.llama_cpp_eval import llama_cpp_loss, llama_cpp_text_loss

    lost = case.root / "no-pre.gguf"
    with_tokenizer(case.source, lost, lambda writer: converter_keys(writer, case.tokenizer, None, case.n_vocab))
    ids = case.tokenizer.encode(TEXT, add_special_tokens=False)
    window = np.asarray([ids])
    assert llama_cpp_loss(lost, window, threads=1) == llama_cpp_loss(case.copied, window, threads=1)
    loss, info = llama_cpp_text_loss(case.copied, [TEXT], threads=1, reference=[ids])
    assert info == {"tokens": len(ids), "predicted": len(ids) - 1, "texts": 1, "reference_tokens": len(ids),
                    "same_tokens": 1}
    assert loss == pytest.approx(llama_cpp_loss(case.copied, window, threads=1)[0], rel=1e-9)  # the same ids
    _, lost_info = llama_cpp_text_loss(lost, [TEXT], threads=1, reference=[ids])
    assert lost_info["same_tokens"] == 0 and lost_info["tokens"] != len(ids)


# ------------------------------------------------------------------------------------------- refusals


def test_a_pre_tokenizer_llama_cpp_does_not_reproduce_is_refused_unless_named(tmp_path):
    """Punctuation split off before GPT-2's regex: no llama.cpp name splits text so; the file is not
    written until the caller names the pre-tokenizer."""
    from tokenizers import pre_tokenizers

    split = pre_tokenizers.Sequence([pre_tokenizers.Punctuation(), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer = byte_level_bpe("gpt-2", CORPUS, pre_tokenizer=split)
    model, path = _llama(len(tokenizer)), tmp_path / "m.gguf"
    path.write_bytes(b"previous contents")
    with pytest.raises(ValueError, match=r"pre-tokenizer .*Punctuation.* pass tokenizer_pre= .* or source_gguf="):
        save_gguf(model, path, tokenizer=tokenizer)
    assert path.read_bytes() == b"previous contents"
    save_gguf(model, path, tokenizer=tokenizer, tokenizer_pre="gpt-2")
    assert tokenizer_fields(path)["tokenizer.ggml.pre"] == (["STRING"], b"gpt-2")


def test_a_source_gguf_of_another_vocabulary_and_two_sources_are_refused(tmp_path):
    tokenizer = byte_level_bpe("smollm", CORPUS)
    source = tmp_path / "source.gguf"
    save_gguf(_llama(len(tokenizer)), source, tokenizer=tokenizer, float_matrices="f32")
    with pytest.raises(ValueError, match=rf"source_gguf='{source}' has {len(tokenizer)} tokens but the model's "
                                         rf"embedding has {len(tokenizer) + 1} rows"):
        save_gguf(_llama(len(tokenizer) + 1), tmp_path / "m.gguf", source_gguf=source)
    with pytest.raises(ValueError, match=r"not both tokenizer and source_gguf"):
        save_gguf(_llama(len(tokenizer)), tmp_path / "m.gguf", tokenizer=tokenizer, source_gguf=source)
    with pytest.raises(ValueError, match=r"tokenizer_pre='smollm' names the pre-tokenizer of a transformers tokenizer"):
        gguf_tokenizer(len(tokenizer), source_gguf=source, tokenizer_pre="smollm")
    assert not (tmp_path / "m.gguf").exists()


def test_finetune_refuses_an_unnamed_pre_tokenizer_before_training_and_takes_tokenizer_pre(tmp_path, capsys):
    from tokenizers import pre_tokenizers

    from mixle.lm import cli

    split = pre_tokenizers.Sequence([pre_tokenizers.Punctuation(), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer = byte_level_bpe("gpt-2", CORPUS, pre_tokenizer=split)
    model_dir, data, out = tmp_path / "model", tmp_path / "data.txt", tmp_path / "out"
    _llama(len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data.write_text(CORPUS)
    flags = ["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--steps", "1", "--block",
             "16", "--batch-size", "2", "--eval-windows", "2", "--threads", "1", "--no-llama-cpp", "--no-progress"]
    assert cli.main(flags) == 1
    err = capsys.readouterr().err
    assert "pre-tokenizer" in err and "on the command line: --tokenizer-pre NAME" in err
    assert not out.exists() or not any(out.iterdir())  # refused before training: nothing written
    assert cli.main([*flags, "--tokenizer-pre", "gpt-2"]) == 0, capsys.readouterr().err
    assert tokenizer_fields(out / "model.gguf")["tokenizer.ggml.pre"] == (["STRING"], b"gpt-2")


def test_finetune_trains_on_the_ids_llama_cpp_gives_the_text(case):
    # transformers' GGUF loader splits every gpt2-type vocabulary as GPT-2 does; the model a GGUF
    # is fine-tuned from must see the source tokenizer's ids (llama.cpp's, when it is installed).
    from mixle.lm.finetune_load import load_model

    loaded = load_model(str(case.source))
    want = case.tokenizer.encode(TEXT, add_special_tokens=False)
    assert loaded.tokenizer.encode(TEXT, add_special_tokens=False) == want
    assert pre_tokenizer_name(loaded.tokenizer) == case.family  # on any text, not only this one
    from mixle._optional import is_available

    if is_available("llama_cpp"):
        with _vocabulary(_llama_cpp(), case.source) as llm:
            assert llm.tokenize(TEXT.encode(), add_bos=False, special=True) == want
