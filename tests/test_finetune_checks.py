"""``mixle finetune`` refuses, before the first step and before writing anything, what would fail later.

The tiny models and the byte-level BPE tokenizer are tests/test_finetune.py's. Oracles: transformers'
own tokenizer and GGUF loader (what the job reads), gguf-py's reader (the embedding's rows in the
file) and the files on disk before and after a refused call.
"""

import json
import os
import re
import signal
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("compressed_tensors")

from mixle import quantize_model, save_gguf, save_pretrained_compressed  # noqa: E402
from mixle.exports.compressed_tensors import check_quantization_config, load_pretrained_compressed  # noqa: E402
from mixle.lm.cli import build_parser  # noqa: E402
from mixle.lm.data import default_text  # noqa: E402
from mixle.lm.finetune_run import run_finetune  # noqa: E402
from mixle.lm.finetune_cli import config_from_finetune_args  # noqa: E402
from mixle.lm.finetune_load import load_model  # noqa: E402
from mixle.lm.finetune_train import Stopped  # noqa: E402
from tests.test_finetune import FAST, byte_level_tokenizer, finetune, refusal, results_of, tiny  # noqa: E402

ROWS = 320  # the embedding of the GGUF written with one token per id


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("checks")
    text = default_text()[:16000]
    (root / "data.txt").write_text(text)
    tokenizer = byte_level_tokenizer(text[:12000])
    model = tiny("llama", len(tokenizer))
    model.save_pretrained(root / "llama")
    tokenizer.save_pretrained(root / "llama")
    save_gguf(model, root / "no-tokenizer.gguf", float_matrices="f32")  # placeholder tokens, no merges of its own
    vocab = [bytes([i]) for i in range(256)] + [f"tok{i}".encode() for i in range(ROWS - 256)]
    save_gguf(tiny("llama", ROWS), root / "byte-vocab.gguf", vocab=vocab, float_matrices="f32")  # no EOS id
    # A compressed-tensors int4/group32 directory whose config.json is then edited to group_size 48.
    save_pretrained_compressed(quantize_model(model, bits=4, group_size=32, exclude=("lm_head",)), root / "ct48",
                               tokenizer=tokenizer)
    config = json.loads((root / "ct48" / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["weights"]["group_size"] = 48
    (root / "ct48" / "config.json").write_text(json.dumps(config))
    return {"root": root, "data": root / "data.txt", "llama": root / "llama", "tokenizer": tokenizer}


def snapshot(directory):
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


# ------------------------------------------------------------------------------------ the tokenizer


def test_a_gguf_without_tokenizer_metadata_is_refused_naming_the_file(assets, tmp_path, capsys):
    """transformers' tokenizers panics (pyo3_runtime.PanicException, a BaseException) on the placeholder vocabulary."""
    path = assets["root"] / "no-tokenizer.gguf"
    err = refusal(capsys, "--model", str(path), "--data", str(assets["data"]), "--out", str(tmp_path / "out"), *FAST)
    assert f"--model {str(path)!r}: its tokenizer could not be loaded (PanicException: " in err
    assert "pass a transformers directory with the model and its tokenizer.json" in err
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_json_the_library_rejects_is_refused_naming_the_directory(assets, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(assets["llama"], broken)
    state = json.loads((broken / "tokenizer.json").read_text())
    state["model"]["merges"] = state["model"]["merges"][:5] + [["zz", "qq"]]  # tokenizers raises a bare Exception
    (broken / "tokenizer.json").write_text(json.dumps(state))
    err = refusal(capsys, "--model", str(broken), "--data", str(assets["data"]), "--out", str(tmp_path / "out"), *FAST)
    assert f"--model {str(broken)!r}: its tokenizer could not be loaded (Exception: " in err and "`zz`" in err
    assert "tokenizer.save_pretrained(directory)" in err
    assert not (tmp_path / "out").exists()


def test_ctrl_c_while_the_tokenizer_loads_is_not_turned_into_a_refusal(assets, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(assets["llama"]))


def test_a_vocabulary_larger_than_the_embedding_is_refused_before_training(assets, tmp_path, capsys):
    """A GGUF naming no end-of-text token: transformers' GGUF loader adds one after the file's tokens, so
    the tokenizer's ids outrun the embedding. Found before any step (no --out made), with the counts
    the oracles give, and in the very words the GGUF writer refuses it with."""
    path = assets["root"] / "byte-vocab.gguf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = tokenizer.get_vocab()
    top = max(ids.values())
    rows = {t.name: [int(d) for d in t.shape] for t in gguf.GGUFReader(path).tensors}["token_embd.weight"][1]
    assert (top, rows) == (ROWS, ROWS)
    err = refusal(capsys, "--model", str(path), "--data", str(assets["data"]), "--out", str(tmp_path / "out"),
                  "--steps", "1", *FAST)
    words = (f"the tokenizer has ids 0..{top} (id {top} is {next(t for t, i in ids.items() if i == top)!r}), which "
             f"need {top + 1} embedding rows, but the model's embedding has {rows} (ids 0..{rows - 1})")
    assert words in err and f"--model {str(path)!r} (read by transformers' GGUF loader)" in err
    assert not (tmp_path / "out").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    with pytest.raises(ValueError) as refused:
        save_gguf(model, tmp_path / "x.gguf", tokenizer=tokenizer)
    assert str(refused.value).startswith(words)


# ------------------------------------------------------------------------------------ the output directory


def flags_of(assets, out, *extra):
    return ["--model", str(assets["llama"]), "--data", str(assets["data"]), "--out", str(out), "--steps", "2",
            "--no-llama-cpp", *FAST, *extra]


def test_a_non_empty_out_is_refused_and_left_as_it_was(assets, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.gguf").write_bytes(b"the user's own file")
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    err = refusal(capsys, *flags_of(assets, out))
    assert f"--out {str(out)!r} is not empty (it holds model.gguf, notes.txt)" in err and "--overwrite" in err
    assert snapshot(out) == before


def test_a_checkpoint_in_out_says_resume_and_overwrite_starts_over(assets, tmp_path, capsys):
    out = tmp_path / "out"
    flags = flags_of(assets, out)
    config = config_from_finetune_args(build_parser().parse_args(["finetune", *flags]))

    def stop(trainer):
        os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(Stopped, match="SIGINT after step 1"):
        run_finetune(config, progress=False, callback=stop)
    before = snapshot(out)
    err = refusal(capsys, *flags)
    assert (f"--out {str(out)!r} holds an interrupted run's checkpoint.pt: this very run, stopped after step 1; "
            f"continue it with --resume {out}") in err
    err = refusal(capsys, *flags, "--steps", "3")
    assert "of another run (--steps 2 (here 3)): continue it with --resume" in err
    assert snapshot(out) == before
    (out / "notes.txt").write_text("mine")
    assert finetune(*flags, "--overwrite") == 0, capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["README.md", "finetune.png", "hf", "model.gguf", "notes.txt", "results.json",
                                       "table.txt"]
    assert (out / "notes.txt").read_text() == "mine"
    assert results_of(out)["training"]["steps_done"] == 2


def test_help_documents_overwrite(capsys):
    with pytest.raises(SystemExit):
        finetune("--help")
    assert "--overwrite" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ compressed-tensors input


def test_a_compressed_tensors_group_size_that_does_not_divide_a_width_is_refused_by_mixle(assets, tmp_path, capsys):
    """The config says group_size 48; the tiny Llama's matrices are 64 and 128 wide (transformers alone says
    "You set `ignore_mismatched_sizes` to `False`")."""
    directory = assets["root"] / "ct48"
    want = ("quantization_config group_0 quantizes tensor 'model.layers.0.self_attn.q_proj.weight' of width 64 in "
            "groups of group_size=48, which does not divide 64")
    err = refusal(capsys, "--model", str(directory), "--data", str(assets["data"]), "--out", str(tmp_path / "out"),
                  *FAST)
    assert f"--model {str(directory)!r}: {want}" in err and "ignore_mismatched_sizes" not in err
    with pytest.raises(ValueError, match=f"{directory}: {want}"):
        load_pretrained_compressed(directory)
    assert not (tmp_path / "out").exists()
    config = transformers.AutoConfig.from_pretrained(assets["llama"])
    assert check_quantization_config(config, "float", mixle_layers=False) is None  # a float model: nothing to check


@pytest.mark.parametrize("weights, refusal_text", [
    (dict(num_bits=0, type="int", strategy="channel"), "group_0: weights of num_bits=0 (int): compressed-tensors stores"),
    (dict(num_bits=8, type="float", strategy="block", block_structure=[16, 48]),
     "tensor 'model.layers.0.self_attn.q_proj.weight' of width 64 in blocks of block_structure=[16, 48], whose 48 "
     "columns do not divide 64"),
    (dict(num_bits=4, type="int", strategy="group", group_size=32), None),  # 32 divides 64 and 128: accepted
])
def test_compressed_tensors_bits_and_block_widths_are_checked(weights, refusal_text):
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    config.quantization_config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    if refusal_text is None:
        qconfig = check_quantization_config(config, "ckpt", mixle_layers=False)
        assert qconfig.config_groups["group_0"].weights.group_size == 32
        return
    with pytest.raises(ValueError, match=f"^ckpt: .*{re.escape(refusal_text)}"):
        check_quantization_config(config, "ckpt", mixle_layers=False)
