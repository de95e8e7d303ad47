"""``mixle finetune``: a pretrained checkpoint (directory or GGUF) to a QAT-trained file, end to end.

Tiny random Llama and Qwen2 models are saved with ``save_pretrained`` beside a byte-level BPE
tokenizer trained here with the ``tokenizers`` library; the numbers the job reports are checked
against references computed here from the models' logits, the files' weights and llama.cpp.
"""

import contextlib
import dataclasses
import gc
import hashlib
import json
import math
import os
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")

import torch.nn.functional as F  # noqa: E402

from mixle import quantize_model, save_gguf  # noqa: E402
from mixle.gguf.writer import load_gguf_weights  # noqa: E402
from mixle.lm import cli  # noqa: E402
from mixle.lm.data import default_text  # noqa: E402
from mixle.lm.cpu_bfloat16 import SLOW  # noqa: E402
from mixle.lm.finetune import shared_teacher  # noqa: E402
from mixle.lm.finetune_run import run_finetune  # noqa: E402
from mixle.lm.finetune_checkpoint import read_checkpoint  # noqa: E402
from mixle.lm.finetune_config import FinetuneConfig  # noqa: E402
from mixle.lm.finetune_train import NonFiniteLossError, Stopped, steps_that_fit  # noqa: E402
from mixle.lm.llama_cpp_eval import llama_cpp_loss, llama_cpp_module  # noqa: E402
from mixle.lm.training import warmup_cosine  # noqa: E402
from mixle.lm.windows import held_out_windows  # noqa: E402
from tests.gguf_tokenizer_cases import converter_keys, tokenizer_fields, with_tokenizer  # noqa: E402

BLOCK, EVAL_WINDOWS = 16, 6
FAST = ["--block", str(BLOCK), "--batch-size", "2", "--eval-windows", str(EVAL_WINDOWS), "--threads", "1",
        "--lr", "5e-5", "--no-progress"]


def byte_level_tokenizer(text):
    """A byte-level BPE tokenizer of ~300 tokens trained on ``text`` (llama.cpp's gpt2 vocabulary kind)."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def tiny(kind, vocab, hidden=64, seed=0, intermediate=None, layers=2):
    torch.manual_seed(seed)
    shape = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, tie_word_embeddings=True))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape, tie_word_embeddings=False))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=1, n_head=2,
                                                                n_positions=64))


def tiny_llama_run(root, layers=2):
    """``root`` with ``data.txt`` (16,000 characters of the default text) and ``llama/``: a ``tiny`` Llama of
    ``layers`` layers with a byte-level tokenizer trained on the text's first 12,000 characters."""
    text = default_text()[:16000]
    tokenizer = byte_level_tokenizer(text[:12000])
    (root / "data.txt").write_text(text)
    tiny("llama", len(tokenizer), layers=layers).save_pretrained(root / "llama")
    tokenizer.save_pretrained(root / "llama")
    return root


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    text = default_text()[:24000]
    tokenizer = byte_level_tokenizer(text[:12000])
    (root / "data.txt").write_text(text[:16000])
    (root / "other.txt").write_text(text[16000:])
    paths = {"root": root, "data": root / "data.txt", "other": root / "other.txt"}
    for kind, family, hidden, intermediate in (("llama", "llama", 64, None), ("qwen2", "qwen2", 64, None),
                                               ("gpt2", "gpt2", 64, None), ("llama48", "llama", 48, None),
                                               ("llama256", "llama", 64, 256)):  # ffn_down rows of 256: K-quants
        model = tiny(family, len(tokenizer), hidden, intermediate=intermediate)
        model.save_pretrained(root / kind)
        tokenizer.save_pretrained(root / kind)
        paths[kind] = root / kind
    paths["gguf"] = root / "llama.gguf"
    save_gguf(transformers.AutoModelForCausalLM.from_pretrained(paths["llama"]), paths["gguf"], tokenizer=tokenizer,
              float_matrices="f32")
    paths["tokenizer"] = tokenizer
    return paths


def held_out(assets, path="data", model="llama", fraction=0.1):
    """The held-out windows of a run, from the text and the split rule (the last 10% of the tokens), tokenized
    by the model directory's tokenizer as transformers loads it (for Qwen2: Qwen2's pre-tokenizer)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(assets[model])
    ids = np.asarray(tokenizer.encode(assets[path].read_text(), add_special_tokens=False))
    count = max(BLOCK + 1, round(fraction * len(ids))) if path == "data" else len(ids)
    return held_out_windows(ids[-count:], BLOCK, EVAL_WINDOWS)


def cross_entropy(model, windows):
    """Mean next-token cross-entropy computed here from the model's logits (float64)."""
    with torch.no_grad():
        logits = model(torch.as_tensor(windows[:, :-1])).logits.double()
    return F.cross_entropy(logits.flatten(0, 1), torch.as_tensor(windows[:, 1:]).flatten()).item()


def kl_to(reference, model, windows):
    with torch.no_grad():
        p = F.log_softmax(reference(torch.as_tensor(windows[:, :-1])).logits.double(), -1)
        q = F.log_softmax(model(torch.as_tensor(windows[:, :-1])).logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def greedy(model, tokenizer, prompt, tokens):
    """transformers' greedy ``generate`` of ``prompt`` (no chat template): the answer's text."""
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:]
    new = new.tolist()
    new = new[:new.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in new else new
    return tokenizer.decode(new, skip_special_tokens=True).strip()


def finetune(*flags):
    return cli.main(["finetune", *flags])


def results_of(out):
    return json.loads((out / "results.json").read_text())


def hf_rebuilds_the_file(out, quantize, tmp_path):
    """The run's ``hf/`` checkpoint, quantized without training, is ``model.gguf``, every tensor: by mixle's
    quantizer (``quantize(float_model, path)``, llama-quantize's bit for bit) and, where llama.cpp's tools are
    here, by results.json's two commands (convert_hf_to_gguf.py, with a stand-in vocabulary, and llama-quantize).
    So the checkpoint holds the master weights whose blocks QAT trained."""
    from tests.test_gguf_architectures import _CONVERT, llama_cpp_source, summary
    from tests.test_imatrix import build_dir

    trained = summary(out / "model.gguf")["tensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    assert loaded.dtype == torch.float32 and transformers.AutoTokenizer.from_pretrained(out / "hf") is not None
    quantize(loaded, tmp_path / "requantized.gguf")
    assert summary(tmp_path / "requantized.gguf")["tensors"] == trained
    recipe = results_of(out)["hf"]["llama_cpp"]
    if llama_cpp_source() is None or build_dir() is None:
        return recipe
    assert recipe["convert"][2:] == ["hf", "--outtype", "f32", "--outfile", "model-f32.gguf"]
    f32, quantized = tmp_path / "model-f32.gguf", tmp_path / "model-q.gguf"
    subprocess.run([sys.executable, "-c", _CONVERT, llama_cpp_source(), str(out / "hf"), str(f32)], check=True,
                   capture_output=True, cwd=llama_cpp_source())
    flags = [str(out / arg) if arg.endswith(".gguf") else arg for arg in recipe["quantize"][1:-3]]  # an imatrix file
    subprocess.run([os.path.join(build_dir(), "bin", "llama-quantize"), *flags, str(f32), str(quantized),
                    recipe["file_type"]], check=True, capture_output=True)
    assert summary(quantized)["tensors"] == trained
    return recipe


# ------------------------------------------------------------------------------------ end to end


def test_llama_directory_to_q4_0_gguf_with_numbers_checked(assets, tmp_path, capsys):
    out = tmp_path / "run"
    status = finetune("--model", str(assets["llama"]), "--data", str(assets["data"]), "--eval-data",
                      str(assets["other"]), "--out", str(out), "--steps", "12", "--float-matrices", "f32", *FAST,
                      "--batch-size", "4")
    assert status == 0, capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["README.md", "finetune.png", "hf", "model.gguf", "results.json", "table.txt"]
    results = results_of(out)
    rows = {row["method"]: row for row in results["rows"]}
    windows, other = held_out(assets), held_out(assets, "other")
    float_model = transformers.AutoModelForCausalLM.from_pretrained(assets["llama"])
    ptq = quantize_model(float_model, grid="q4_0", exclude=("lm_head",))
    from_file = load_gguf_weights(float_model, out / "model.gguf")
    # Each reported number is the cross-entropy of that model's logits on the held-out windows.
    assert rows["float"]["perplexity"] == pytest.approx(math.exp(cross_entropy(float_model, windows)), rel=1e-6)
    assert rows["PTQ"]["loss"] == pytest.approx(cross_entropy(ptq, windows), rel=1e-6)
    assert rows["QAT"]["loss"] == pytest.approx(cross_entropy(from_file, windows), rel=1e-5)
    assert rows["QAT"]["eval_data_loss"] == pytest.approx(cross_entropy(from_file, other), rel=1e-5)
    assert results["data"]["held_out_windows"] == EVAL_WINDOWS == len(windows)
    # QAT moved the file toward the float model: closer to it than PTQ's file, on both texts.
    assert kl_to(float_model, from_file, windows) < kl_to(float_model, ptq, windows)
    assert kl_to(float_model, from_file, other) < kl_to(float_model, ptq, other)
    if llama_cpp_module() is not None:  # llama.cpp ran mixle's file: its perplexity, and parity with mixle's
        loss, _ = llama_cpp_loss(out / "model.gguf", windows, threads=1)
        assert rows["QAT"]["llama_cpp_loss"] == pytest.approx(loss, rel=1e-9)
        assert rows["QAT"]["llama_cpp_loss"] == pytest.approx(rows["QAT"]["loss"], rel=2e-3)
        assert rows["float"]["llama_cpp_loss"] == pytest.approx(rows["float"]["loss"], rel=2e-3)
        # llama.cpp also tokenized each window's text itself, with the file's tokenizer: into the ids transformers
        # makes of that text, on which the file's weights give its reported loss.
        tokenizer = transformers.AutoTokenizer.from_pretrained(assets["llama"])
        texts = [tokenizer.decode(w, skip_special_tokens=False, clean_up_tokenization_spaces=False) for w in windows]
        ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        assert rows["QAT"]["llama_cpp_text_same_tokens"] == len(windows) == results["llama_cpp"]["text"]["held_out"]["windows"]
        assert rows["QAT"]["llama_cpp_text_tokens"] == sum(map(len, ids))
        with torch.no_grad():
            nll = sum(F.cross_entropy(from_file(torch.tensor([i[:-1]])).logits[0].double(), torch.tensor(i[1:]),
                                      reduction="sum").item() for i in ids)
        assert rows["QAT"]["llama_cpp_text_loss"] == pytest.approx(nll / sum(len(i) - 1 for i in ids), rel=2e-3)
        assert "held-out text, llama.cpp" in (out / "table.txt").read_text()
        assert "eval_data_llama_cpp_text_loss" in rows["QAT"] and "llama_cpp_text_loss" in rows["PTQ"]
    # The teacher shares the frozen embedding (tied head) and norms; it owns copies of the trained matrices.
    frozen = [p for n, p in float_model.named_parameters() if "norm" in n or "embed" in n]
    trained = [p for n, p in float_model.named_parameters() if "proj" in n]
    model = results["model"]
    assert model["teacher_shared_bytes"] == sum(4 * p.numel() for p in frozen)
    assert model["teacher_own_bytes"] == sum(4 * p.numel() for p in trained) == 4 * model["trained_parameters"]
    table = (out / "table.txt").read_text()
    assert "QAT" in table and f"{rows['PTQ']['perplexity']:.4f}" in table
    assert "q4_0" in (out / "README.md").read_text() and (out / "finetune.png").read_bytes()[:4] == b"\x89PNG"
    assert "wrote hf, model.gguf" in capsys.readouterr().out
    recipe = hf_rebuilds_the_file(out, lambda model, path: save_gguf(
        quantize_model(model, grid="q4_0", exclude=("lm_head",)), path, tokenizer=assets["tokenizer"],
        float_matrices="f32"), tmp_path)
    assert " ".join(recipe["quantize"]) == ("llama-quantize --pure --token-embedding-type f32 --output-tensor-type f32 "
                                            "model-f32.gguf model-Q4_0.gguf Q4_0")
    assert "llama-quantize --pure" in (out / "README.md").read_text()


def test_qwen2_to_int4_groups_writes_compressed_tensors(assets, tmp_path, capsys):
    """An integer target: no GGUF block type, so a compressed-tensors directory transformers loads; learned
    scales, plain cross-entropy and a --max-minutes budget on the way."""
    out = tmp_path / "run"
    status = finetune("--model", str(assets["qwen2"]), "--data", str(assets["data"]), "--out", str(out),
                      "--target", "int4/group32", "--learned-scales", "--objective", "ce", "--steps", "50",
                      "--max-minutes", "0.004", "--prompts", "The capital of", "Python is", "--answer-tokens", "4",
                      *FAST)
    assert status == 0, capsys.readouterr().err
    results = results_of(out)
    assert results["files"] == {"compressed_tensors": "compressed-tensors", "hf": "hf"} and not (out / "model.gguf").exists()
    # The chat answers: transformers' own greedy generate (with its cache) of the float model and of the QAT file.
    rows = {row["method"]: row for row in results["rows"]}
    original = transformers.AutoModelForCausalLM.from_pretrained(assets["qwen2"])
    for method, model in (("float", original), ("QAT", transformers.AutoModelForCausalLM.from_pretrained(
            out / "compressed-tensors"))):
        assert [a["answer"] for a in rows[method]["answers"]] == [greedy(model, assets["tokenizer"], p, 4)
                                                                  for p in ("The capital of", "Python is")]
    assert "**Python is**" in (out / "README.md").read_text() and "- QAT: " in (out / "README.md").read_text()
    assert results["training"]["stopped_by"] == "max_minutes" and 1 <= results["training"]["steps_done"] < 50
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out / "compressed-tensors")
    qat = next(row for row in results["rows"] if row["method"] == "QAT")
    assert qat["loss"] == pytest.approx(cross_entropy(loaded, held_out(assets, model="qwen2")), rel=1e-5)
    assert qat["spec"] == "int4/group32/symmetric/learned" and results["model"]["teacher"] is None
    hf = results["hf"]  # the trained float weights, written; no llama.cpp type rebuilds an int4 lattice
    assert hf["llama_cpp"]["why"].startswith("target 'int4/group32' has no llama.cpp block type")
    assert len(hf["left_out"]) == 14 and all(key.endswith("weight_log2_scale") for key in hf["left_out"])


def test_max_minutes_schedule_is_fitted_to_the_pace_after_the_first_step():
    """The first step pays the warm-up and the step-0 curve evaluation: the steps that fit are counted
    at the pace seen since it (budget 60 s, 10 s spent after 4 steps, 7 s of them by step 1: 1 s per
    step, so 50 more), not at the mean pace over all steps (2.5 s per step, 20 more)."""
    budget, step, seconds, since = 60.0, 4, 10.0, (1, 7.0)
    pace = (seconds - since[1]) / (step - since[0])
    assert steps_that_fit(budget, step, seconds, since, steps=1000, warmup=5) == step + int((budget - seconds) / pace) == 54
    assert steps_that_fit(budget, step, seconds, since, steps=30, warmup=5) == 30  # never past --steps
    assert steps_that_fit(budget, step, 70.0, since, steps=1000, warmup=5) == 6  # over budget: past the warm-up
    assert steps_that_fit(budget, 9, 70.0, since, steps=1000, warmup=5) == 10  # and past the current step


def test_a_budgeted_runs_warm_up_is_five_percent_of_the_steps_that_fit():
    """With --max-minutes, --steps is only a cap: the warm-up is 5% of the schedule the budget fitted
    (700 steps: 35), not of --steps (100,000: 5,000 steps, a run that would never leave its warm-up)."""
    schedule = warmup_cosine(FinetuneConfig(model="m", out="o", steps=100_000, max_minutes=5).warmup)
    assert [schedule(step, 700) for step in (0, 33, 34)] == [1 / 35, 34 / 35, 1.0]
    assert schedule(266, 700) == 0.5 * (1 + math.cos(math.pi * (266 - 35) / (700 - 1 - 35)))
    assert schedule(0, 100_000) == 1 / 5_000  # before the fit, the cap's
    fixed = warmup_cosine(FinetuneConfig(model="m", out="o", steps=100_000, max_minutes=5, warmup=7).warmup)
    assert fixed(6, 700) == 1.0 and fixed(5, 700) == 6 / 7
    assert steps_that_fit(60.0, 4, 70.0, (1, 7.0), steps=1000, warmup=0) == 5  # no fixed warm-up to outlast


def test_a_budgeted_run_stopped_before_its_schedule_was_fitted_fits_it_when_resumed():
    """A run stopped (SIGTERM, a call's time limit) before ``--max-minutes`` fitted its schedule fits it
    when resumed, timing the pace from the resumed call's first step; a run stopped after the fit keeps
    the schedule it was fitted to. An unfitted resume would run the cap's schedule (100,000 steps: a
    warm-up of 5,000 steps, the learning rate a fraction of its peak for the whole budget)."""
    from mixle.lm.loop import _PROBE_STEPS, LoopConfig, Trainer

    class Halt(Exception):
        pass

    x = torch.linspace(-1, 1, 8)[:, None]

    def run(stop_at, payload=None):
        gc.collect()  # not during the 0.18 s the steps have (after a test that held a model in this process)
        torch.manual_seed(0)
        layer = torch.nn.Linear(1, 1)
        trainer = Trainer(layer, list(layer.named_parameters()), torch.optim.SGD(layer.parameters(), lr=0.01),
                          lambda starts: ((layer(x[starts]) - 2 * x[starts]) ** 2).mean(),
                          lambda state, count: torch.arange(count),
                          LoopConfig(steps=100_000, batch_size=8, tokens_per_window=1, max_minutes=0.003,
                                     schedule=warmup_cosine(None, floor=0.0)))
        if payload is not None:
            trainer.load_state_dict(payload, "checkpoint")
        horizons = {}

        def watch(trainer):
            horizons[trainer.state.step] = trainer.state.horizon
            if trainer.state.step == stop_at:
                raise Halt

        with contextlib.suppress(Halt):
            trainer.train(callback=watch)
        return trainer.state_dict(), horizons

    payload, early = run(stop_at=2)  # before the fit (after 1 + _PROBE_STEPS steps)
    assert set(early.values()) == {100_000}
    _, resumed = run(stop_at=None, payload=payload)
    fit_step = 3 + _PROBE_STEPS  # the resumed call's first step (3), then the probe's steps
    assert resumed[fit_step - 1] == 100_000 and resumed[fit_step] < 100_000

    payload, fitted = run(stop_at=1 + _PROBE_STEPS + 2)  # after the fit
    assert fitted[1 + _PROBE_STEPS] < 100_000
    _, kept = run(stop_at=None, payload=payload)
    assert set(kept.values()) == {payload["state"]["horizon"]}


def test_gguf_input_lora_bfloat16(assets, tmp_path, capsys):
    """A GGUF file in (transformers' GGUF loader): the same float numbers as the directory it was written
    from; LoRA on the frozen base under bfloat16 autocast, merged and requantized into Q8_0 blocks."""
    out, source = tmp_path / "run", tmp_path / "source.gguf"
    # The source file's tokenizer as llama.cpp's converter writes it: pre-tokenizer name, ids, chat template.
    with_tokenizer(assets["gguf"], source, lambda writer: converter_keys(writer, assets["tokenizer"], "gpt-2",
                                                                         len(assets["tokenizer"])))
    status = finetune("--model", str(source), "--data", str(assets["data"]), "--out", str(out),
                      "--target", "q8_0", "--lora", "4", "--dtype", "bfloat16", "--steps", "4", "--no-llama-cpp",
                      *FAST)
    err = capsys.readouterr().err
    assert status == 0, err
    results = results_of(out)
    # the CPU's bfloat16 products timed beside float32's: the note shows exactly when they are slower
    ratio = results["environment"]["bfloat16_products_vs_float32"]
    assert ratio > 0 and ("note: --dtype bfloat16" in err) == (ratio > SLOW)
    float_model = transformers.AutoModelForCausalLM.from_pretrained(assets["llama"])
    assert results["rows"][0]["loss"] == pytest.approx(cross_entropy(float_model, held_out(assets)), rel=1e-6)
    shapes = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]  # q k v o gate up down
    assert results["model"]["kind"] == "gguf"
    assert results["model"]["trained_parameters"] == 2 * sum(4 * (i + o) for i, o in shapes)  # rank-4 A and B
    # a frozen base: the teacher shares all of it, and holds only its tied head's bfloat16 copy
    assert results["model"]["teacher_own_bytes"] == 2 * float_model.lm_head.weight.numel()
    reader = gguf.GGUFReader(out / "model.gguf")
    assert {t.name: t.tensor_type.name for t in reader.tensors}["blk.0.ffn_down.weight"] == "Q8_0"
    # Every tokenizer.* key of the source file, verbatim: llama.cpp tokenizes text with model.gguf as with it.
    assert list(tokenizer_fields(out / "model.gguf").items()) == list(tokenizer_fields(source).items())
    # hf/ holds the merged master weights: their Q8_0 blocks are the requantized ones of model.gguf.
    hf_rebuilds_the_file(out, lambda model, path: save_gguf(quantize_model(model, grid="q8_0", exclude=("lm_head",)),
                                                            path, tokenizer=assets["tokenizer"]), tmp_path)


# The block type llama.cpp's Q4_K_M gives each matrix of the 2-layer Llama of hidden 64 and ffn 256: rows of 64
# fall back from Q4_K to Q5_0 (and from Q6_K to Q8_0 in layer 1, a use_more_bits layer, and for the tied
# token_embd); ffn_down's rows of 256 are Q4_K, and Q6_K in layer 1.
Q4_K_M_TYPES = {"token_embd.weight": "Q8_0", "blk.0.ffn_down.weight": "Q4_K", "blk.1.ffn_down.weight": "Q6_K",
                "blk.0.attn_v.weight": "Q5_0", "blk.1.attn_v.weight": "Q8_0",
                **{f"blk.{i}.{name}.weight": "Q5_0" for i in (0, 1)
                   for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")}}


def test_llama_to_the_q4_k_m_mix_against_llama_quantize(assets, tmp_path, capsys):
    """A llama.cpp mix target: PTQ is what llama-quantize makes of the float model, QAT trains every matrix
    (embedding and tied head included) on the block type the mix gives it and writes those blocks."""
    out = tmp_path / "run"
    status = finetune("--model", str(assets["llama256"]), "--data", str(assets["data"]), "--out", str(out),
                      "--target", "Q4_K_M", "--steps", "12", *FAST, "--batch-size", "4")
    assert status == 0, capsys.readouterr().err
    results = results_of(out)
    rows = {row["method"]: row for row in results["rows"]}
    assert results["files"] == {"gguf": "model.gguf", "hf": "hf"} and rows["QAT"]["spec"] == rows["PTQ"]["spec"] == "Q4_K_M"
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out / "model.gguf").tensors}
    assert {name: kind for name, kind in types.items() if kind != "F32"} == Q4_K_M_TYPES
    float_model = transformers.AutoModelForCausalLM.from_pretrained(assets["llama256"])
    windows = held_out(assets, model="llama256")
    theirs = tmp_path / "llama-quantize.gguf"  # PTQ: llama.cpp's quantizer where installed, else mixle's equal file
    if llama_cpp_module() is not None:
        from tests.test_gguf_mixes import llama_quantize

        save_gguf(float_model, tmp_path / "f32.gguf", tokenizer=assets["tokenizer"], float_matrices="f32")
        llama_quantize(tmp_path / "f32.gguf", theirs, "Q4_K_M")
    else:
        save_gguf(float_model, theirs, tokenizer=assets["tokenizer"], gguf_mix="Q4_K_M")
    assert rows["PTQ"]["loss"] == pytest.approx(cross_entropy(load_gguf_weights(float_model, theirs), windows),
                                                rel=1e-6)
    from_file = load_gguf_weights(float_model, out / "model.gguf")
    assert rows["QAT"]["loss"] == pytest.approx(cross_entropy(from_file, windows), rel=1e-5)
    assert kl_to(float_model, from_file, windows) < kl_to(float_model, load_gguf_weights(float_model, theirs), windows)
    recipe = hf_rebuilds_the_file(out, lambda model, path: save_gguf(model, path, tokenizer=assets["tokenizer"],
                                                                      gguf_mix="Q4_K_M"), tmp_path)
    assert " ".join(recipe["quantize"]) == "llama-quantize model-f32.gguf model-Q4_K_M.gguf Q4_K_M"
    if llama_cpp_module() is not None:  # the issue's parity: llama.cpp's perplexity of each file within 1% of mixle's
        for method in ("float", "PTQ", "QAT"):
            assert abs(math.expm1(rows[method]["llama_cpp_loss"] - rows[method]["loss"])) < 0.01, method


def test_act_bits_8_on_a_mix_evaluates_as_llama_cpp_computes(assets, tmp_path, capsys):
    """--act-bits 8: QAT and PTQ round each product's input as llama.cpp's CPU path does (Q8_K before the
    K-quant products, Q8_0 before the others), which moves mixle's losses onto llama.cpp's of the same files;
    the files hold the same blocks as without it."""
    runs = {}
    for name, extra in (("act", ["--act-bits", "8"]), ("weights", ["--no-hf-checkpoint"])):
        out = tmp_path / name
        status = finetune("--model", str(assets["llama256"]), "--data", str(assets["data"]), "--out", str(out),
                          "--target", "Q4_K_M", "--steps", "2", *FAST, "--batch-size", "4", *extra)
        assert status == 0, capsys.readouterr().err
        runs[name] = {row["method"]: row for row in results_of(out)["rows"]}
    assert results_of(tmp_path / "act")["config"]["act_bits"] == 8
    skipped = results_of(tmp_path / "weights")  # --no-hf-checkpoint: no float checkpoint
    assert skipped["hf"] is None and "hf" not in skipped["files"] and not (tmp_path / "weights" / "hf").exists()
    ptq = {name: rows["PTQ"] for name, rows in runs.items()}
    assert ptq["act"]["loss"] != ptq["weights"]["loss"]  # the rounding is in the evaluation
    if llama_cpp_module() is not None:  # the same PTQ file; llama.cpp's loss of it is mixle's with --act-bits
        assert ptq["act"]["llama_cpp_loss"] == pytest.approx(ptq["weights"]["llama_cpp_loss"], abs=1e-9)
        for method in ("PTQ", "QAT"):  # measured: PTQ 2.7e-7 vs 1.0e-6, QAT 1.9e-7 vs 2.3e-4
            gap = {name: abs(rows[method]["llama_cpp_loss"] - rows[method]["loss"]) for name, rows in runs.items()}
            assert gap["act"] < gap["weights"] / 2, (method, gap)


# ------------------------------------------------------------------------------------ resume


def test_resume_after_sigterm_is_bit_for_bit_the_uninterrupted_run(assets, tmp_path, capsys, monkeypatch):
    flags = ["--model", str(assets["llama"]), "--data", str(assets["data"]), "--steps", "6", "--accumulate", "2",
             "--checkpoint-every", "2", "--no-llama-cpp", *FAST]
    assert finetune(*flags, "--out", str(tmp_path / "whole")) == 0
    from mixle.lm import finetune_train

    step = finetune_train.FinetuneTrainer.step

    def step_then_sigterm(trainer):  # SIGTERM arrives during step 3, as from a scheduler
        value = step(trainer)
        if trainer.state.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return value

    monkeypatch.setattr(finetune_train.FinetuneTrainer, "step", step_then_sigterm)
    parted = tmp_path / "parted"
    capsys.readouterr()
    assert finetune(*flags, "--out", str(parted)) == 130
    err = capsys.readouterr().err
    assert "stopped by SIGTERM after step 3" in err and f"--resume {parted}" in err
    assert read_checkpoint(parted / "checkpoint.pt")["state"]["step"] == 3
    assert not (parted / "model.gguf").exists()
    monkeypatch.undo()
    assert finetune("--resume", str(parted), "--no-progress") == 0, capsys.readouterr().err
    whole, resumed = results_of(tmp_path / "whole"), results_of(parted)
    assert resumed["rows"] == whole["rows"] and resumed["curve"] == whole["curve"]
    digest = lambda path: hashlib.sha256(path.read_bytes()).hexdigest()  # noqa: E731
    assert digest(parted / "model.gguf") == digest(tmp_path / "whole" / "model.gguf")
    assert not (parted / "checkpoint.pt").exists()


def test_a_llama_cpp_that_crashes_here_is_left_out_saying_why(assets, tmp_path, monkeypatch, capsys):
    from mixle.lm import llama_cpp_eval

    monkeypatch.setattr(llama_cpp_eval, "is_available", lambda name: name == "llama_cpp")
    monkeypatch.setattr(llama_cpp_eval, "PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    llama_cpp_eval.llama_cpp_problem.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"llama.cpp crashed \(SIGSEGV\)"):
            status = finetune("--model", str(assets["llama"]), "--data", str(assets["data"]), "--out",
                              str(tmp_path / "run"), "--steps", "1", *FAST)
    finally:
        llama_cpp_eval.llama_cpp_problem.cache_clear()
    assert status == 0, capsys.readouterr().err
    results = results_of(tmp_path / "run")
    assert list(results["llama_cpp"]) == ["skipped"] and "crashed (SIGSEGV)" in results["llama_cpp"]["skipped"]
    assert llama_cpp_eval.REBUILD in results["llama_cpp"]["skipped"]
    assert not any("llama_cpp_loss" in row for row in results["rows"])


def test_resume_refuses_another_result_flag_and_a_busy_out(assets, tmp_path, capsys):
    config = FinetuneConfig(model=str(assets["llama"]), data=(str(assets["data"]),), out=str(tmp_path / "run"),
                            steps=4, block=BLOCK, batch_size=2, eval_windows=2, llama_cpp=False, threads=1)

    def stop(trainer):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: the step finishes, then the checkpoint is written

    with pytest.raises(Stopped, match="SIGINT after step 1"):
        run_finetune(config, progress=False, callback=stop)
    with pytest.raises(SystemExit):
        finetune("--resume", config.out, "--steps", "5")
    assert "--steps 5 differs from the interrupted run's 4" in capsys.readouterr().err
    assert finetune("--model", config.model, "--out", config.out) == 1
    err = capsys.readouterr().err
    assert f"holds an interrupted run's checkpoint.pt, stopped after step 1, of another run (" in err
    assert f"continue it with --resume {config.out}, or pass --overwrite" in err


def test_a_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(assets, tmp_path):
    config = FinetuneConfig(model=str(assets["llama"]), data=(str(assets["data"]),), out=str(tmp_path / "run"),
                            steps=6, block=BLOCK, batch_size=2, eval_windows=2, checkpoint_every=2, llama_cpp=False,
                            threads=1)

    def poison(trainer):  # after the step-2 checkpoint, one trained weight becomes NaN
        if trainer.state.step == 2:
            with torch.no_grad():
                trainer.trainable[0][1][0, 0] = float("nan")

    with pytest.raises(NonFiniteLossError, match=r"at step 3: .*last checkpoint is kept.*Lower --lr"):
        run_finetune(config, progress=False, callback=poison)
    saved = read_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert saved["state"]["step"] == 2 and all(bool(torch.isfinite(t).all()) for t in saved["trainable"].values())


# ------------------------------------------------------------------------------------ bad input


def refusal(capsys, *flags, status=1):
    """The CLI's stderr for ``flags``, after asserting its exit status."""
    code = None
    try:
        code = finetune(*flags)
    except SystemExit as exit_:
        code = exit_.code
    assert code == status
    return capsys.readouterr().err


def test_bad_models_are_refused_before_training_naming_the_file(assets, tmp_path, capsys):
    out = ["--out", str(tmp_path / "out"), "--data", str(assets["data"]), *FAST]
    assert "--model '/no/such/dir' does not exist" in refusal(capsys, "--model", "/no/such/dir", *out)
    err = refusal(capsys, "--model", str(assets["gpt2"]), *out)
    assert "GPT2LMHeadModel, which mixle cannot export" in err and "LlamaForCausalLM (llama), Qwen2ForCausalLM" in err
    err = refusal(capsys, "--model", str(assets["llama48"]), *out)
    assert "cannot be stored for this LlamaForCausalLM: layer 'model.layers.0.self_attn.q_proj' has 48 inputs" in err
    err = refusal(capsys, "--model", str(assets["llama"]), "--learned-scales", *out, status=2)
    assert "--learned-scales with --target q4_0" in err
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for name in os.listdir(assets["llama"]):
        (truncated / name).write_bytes((assets["llama"] / name).read_bytes())
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert f"{str(weights)!r} is truncated" in refusal(capsys, "--model", str(truncated), *out)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(assets["gguf"].read_bytes()[:-1000])
    err = refusal(capsys, "--model", str(cut), *out)
    assert f"{str(cut)!r} cannot be read as a GGUF file: tensor " in err and ": it is truncated (" in err
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


def test_a_nan_float16_block_scale_in_a_gguf_is_refused(assets, tmp_path, capsys):
    model = transformers.AutoModelForCausalLM.from_pretrained(assets["llama"])
    path = tmp_path / "nan.gguf"
    save_gguf(model, path, tokenizer=assets["tokenizer"])  # the token embedding as Q8_0 blocks
    embd = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    data = bytearray(path.read_bytes())
    data[embd.data_offset : embd.data_offset + 2] = struct.pack("<H", 0x7E00)  # block 0's scale: float16 NaN
    path.write_bytes(bytes(data))
    err = refusal(capsys, "--model", str(path), "--out", str(tmp_path / "out"), *FAST)
    assert f"tensor 'model.embed_tokens.weight' read from {str(path)!r} holds 32 non-finite values" in err


def test_bad_data_and_out_are_refused_before_training(assets, tmp_path, capsys, monkeypatch):
    model = ["--model", str(assets["llama"]), *FAST]
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café".encode("latin-1"))
    assert f"data file {str(latin)!r} is not UTF-8 text" in refusal(capsys, *model, "--data", str(latin), "--out",
                                                                    str(tmp_path / "o"))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert "is empty" in refusal(capsys, *model, "--data", str(empty), "--out", str(tmp_path / "o"))
    short = tmp_path / "short.txt"
    short.write_text("A short text of a few tokens.")
    assert "needs at least 170" in refusal(capsys, *model, "--data", str(short), "--out", str(tmp_path / "o"))
    (tmp_path / "no_text").mkdir()
    assert "no text files" in refusal(capsys, *model, "--data", str(tmp_path / "no_text"), "--out", str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()  # bad data is found before the output directory is made
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert "is not a writable directory" in refusal(capsys, *model, "--data", str(assets["data"]), "--out",
                                                   str(blocker / "out"))
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    err = refusal(capsys, *model, "--data", str(assets["data"]), "--out", str(tmp_path / "full"))
    assert "has 0 MiB free, but this run writes about" in err
    assert os.listdir(tmp_path / "full") == []


# ------------------------------------------------------------------------------------ pieces


def test_help_explains_every_flag_the_issue_names(capsys):
    with pytest.raises(SystemExit):
        cli.main(["finetune", "--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--data", "--target", "--out", "--steps", "--max-minutes", "--resume", "--lora", "--dtype",
                 "--device", "--objective", "--eval-data", "--learned-scales", "--accumulate"):
        assert flag in text, flag


def test_the_teacher_is_the_float_model_sharing_the_frozen_tensors(assets):
    from mixle.api import apply_qat

    model = transformers.AutoModelForCausalLM.from_pretrained(assets["llama"])
    ids = torch.as_tensor(held_out(assets)[:2])
    with torch.no_grad():
        expected = model(ids).logits
    student = apply_qat(model, grid="q4_0", exclude=("lm_head",))
    trained = [student.model.layers[0].self_attn.q_proj.weight]
    teacher = shared_teacher(student, trained)
    assert teacher.model.embed_tokens.weight is student.model.embed_tokens.weight
    assert teacher.model.layers[1].mlp.up_proj.weight is student.model.layers[1].mlp.up_proj.weight
    assert teacher.model.layers[0].self_attn.q_proj.weight is not trained[0]
    with torch.no_grad():
        assert torch.equal(teacher(ids).logits, expected)
        assert not torch.equal(student(ids).logits, expected)  # the student fake-quantizes


def test_a_bfloat16_teacher_stores_its_own_matrices_in_bfloat16_with_the_same_logits(assets):
    """Under bfloat16 autocast every product casts its weight to bfloat16 anyway: the teacher's own copies of
    the matrices are kept in bfloat16 (half their bytes) and its logits stay bit for bit the float32 copy's; the
    embedding, whose lookups autocast leaves alone, keeps float32, and the head tied to it gets its own
    bfloat16 copy (no cast of the vocabulary's matrix at every call)."""
    from mixle.api import apply_qat

    student = apply_qat(transformers.AutoModelForCausalLM.from_pretrained(assets["llama"]), gguf_mix="Q4_K_M")
    trained = [p for m in student.modules() if getattr(m, "spec", None) is not None
               for p in m.parameters(recurse=False)]
    plain, halved = shared_teacher(student, trained), shared_teacher(student, trained, torch.bfloat16)
    matrices = [n for n, _ in student.named_parameters() if n.startswith("model.layers.") and "norm" not in n]
    halved_params = dict(halved.named_parameters())
    assert len(matrices) == 14 and all(halved_params[n].dtype == torch.bfloat16 for n in matrices)
    assert halved.model.embed_tokens.weight.dtype == torch.float32 and plain.lm_head.weight is \
        plain.model.embed_tokens.weight
    assert torch.equal(halved.lm_head.weight, halved.model.embed_tokens.weight.to(torch.bfloat16))
    assert halved.model.norm.weight is student.model.norm.weight  # shared tensors are left as they are
    for name in matrices:
        assert torch.equal(halved_params[name], dict(plain.named_parameters())[name].to(torch.bfloat16))
    ids = torch.as_tensor(held_out(assets)[:2])
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(halved(ids).logits, plain(ids).logits)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="--model is required"):
        FinetuneConfig(out="o")
    with pytest.raises(ValueError, match="target='int3' is unknown"):
        FinetuneConfig(model="m", out="o", target="int3")
    assert FinetuneConfig(model="m", out="o", target="Q4_K_M").mix() == "Q4_K_M"
    assert FinetuneConfig(model="m", out="o", target="q4_k_m").mix() == "Q4_K_M"  # a name that is only a mix
    assert FinetuneConfig(model="m", out="o", target="q6_k").mix() is None  # a grid's name: the grid
    with pytest.raises(ValueError, match=r"target='Q3_K_M' is not a llama.cpp mix mixle trains: use one of Q4_0, "
                                         r"Q8_0, Q4_K_S, Q4_K_M, Q5_K_S, Q5_K_M, Q6_K"):
        FinetuneConfig(model="m", out="o", target="Q3_K_M")
    for flag, field in (("--learned-scales", {"learned_scales": True}), ("--float-matrices", {"float_matrices": "f16"}),
                        ("--lora", {"lora": 4})):
        with pytest.raises(ValueError, match=f"{flag} with --target Q4_K_M: .*; leave {flag} out"):
            FinetuneConfig(model="m", out="o", target="Q4_K_M", **field)
    assert dataclasses.replace(FinetuneConfig(model="m", out="o"), data="a.txt").data == ("a.txt",)
    for fields, words in ((dict(target="int4/group32", act_bits=8), "--act-bits with --target int4/group32: llama.cpp "
                                                                    "never runs this target"),
                          (dict(target="q4_0", act_bits=4), "act_bits=4: llama.cpp rounds the input of its products to "
                                                            "8 bits"),
                          (dict(target="q4_0", act_bits=8, gptq="one-pass"), "--act-bits with --gptq")):
        with pytest.raises(ValueError, match=words):
            FinetuneConfig(model="m", out="o", **fields)
    assert FinetuneConfig(model="m", out="o", target="q4_0", act_bits=8).spec().act_bits == 8


class _LogitsSized:
    """Counts the tensors of ``numel`` elements over a last dimension ``vocab`` that ops allocate (not views or
    in-place results: outputs on an input's storage) while active, in forward and backward."""

    def __init__(self, numel, vocab):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                mine = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                        if isinstance(t, torch.Tensor)}
                for t in torch.utils._pytree.tree_leaves(out):
                    if (isinstance(t, torch.Tensor) and t.numel() == numel and t.shape[-1] == vocab
                            and t.untyped_storage().data_ptr() not in mine):
                        counter.count += 1
                return out

        self.count, self.mode = 0, Mode()


@pytest.mark.parametrize("objective", ["kl", "mix", "ce"])
def test_a_training_step_allocates_two_logits_sized_tensors(assets, tmp_path, monkeypatch, objective):
    """The student's logits and the teacher's (the gradient's buffer; for ce, where the teacher is the student's
    own logits, a new one): the loss, computed 3 tokens at a time, makes no other tensor of their size."""
    from mixle.lm import chunked_loss
    from mixle.lm.finetune_train import FinetuneTrainer

    vocab = len(assets["tokenizer"])
    monkeypatch.setattr(chunked_loss, "CHUNK_ELEMENTS", 3 * vocab)
    counts, step = [], FinetuneTrainer.step

    def counted(trainer):
        counter = _LogitsSized(2 * BLOCK * vocab, vocab)
        with counter.mode:
            value = step(trainer)
        counts.append(counter.count)
        return value

    monkeypatch.setattr(FinetuneTrainer, "step", counted)
    run_finetune(FinetuneConfig(model=str(assets["llama"]), data=str(assets["data"]), out=str(tmp_path / "run"),
                                steps=2, block=BLOCK, batch_size=2, eval_windows=2, threads=1, llama_cpp=False,
                                objective=objective), progress=False)
    assert counts == [2, 2]
