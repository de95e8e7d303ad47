"""``mixle finetune``'s calibrated baselines: PTQ with llama.cpp's importance matrix, QAT trained with it,
and GPTQ; each checked against what the public functions give when the test builds it independently
from the same training windows (``calibrate_importance``, ``quantize_model``, ``save_gguf``,
``gptq_quantize``).
"""

import hashlib
import os
import signal

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")

import mixle  # noqa: E402
from mixle import api  # noqa: E402
from mixle.core.numerics import quantize_array  # noqa: E402
from mixle.gguf.writer import load_gguf_weights  # noqa: E402
from mixle.lm.finetune_checkpoint import read_checkpoint  # noqa: E402
from mixle.lm.llama_cpp_eval import llama_cpp_loss, llama_cpp_module  # noqa: E402
from mixle.lm.report import MIN_DEGRADATION  # noqa: E402
from mixle.lm.windows import held_out_windows  # noqa: E402
from mixle.lm.data import default_text  # noqa: E402
from tests.test_finetune import (BLOCK, FAST, byte_level_tokenizer, cross_entropy, finetune,  # noqa: E402
                                 refusal, results_of, tiny)

WINDOWS = 5  # --calibration-windows: batches of 2, 2 and 1 windows (--batch-size 2)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune_imatrix")
    text = default_text()[:20000]
    tokenizer = byte_level_tokenizer(text[:12000])
    (root / "data.txt").write_text(text[:16000])
    paths = {"root": root, "data": root / "data.txt", "tokenizer": tokenizer}
    for kind, intermediate in (("llama", None), ("llama256", 256), ("llama8", 256)):
        model = tiny("llama", len(tokenizer), 64, intermediate=intermediate)
        if kind == "llama8":  # 8 layers: llama.cpp's "first eighth" (Q4_0 with an imatrix: ffn_down Q4_1) is layer 0
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
                **model.config.to_diff_dict(), "num_hidden_layers": 8, "hidden_size": 32, "num_attention_heads": 2,
                "num_key_value_heads": 1}))
        model.save_pretrained(root / kind)
        tokenizer.save_pretrained(root / kind)
        paths[kind] = root / kind
    return paths


def train_ids(assets, model="llama"):
    """The training split as the job makes it: the tokens before the held-out last 10%."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(assets[model])
    ids = np.asarray(tokenizer.encode(assets["data"].read_text(), add_special_tokens=False))
    return ids[: -max(BLOCK + 1, round(0.1 * len(ids)))], ids


@pytest.fixture(autouse=True)
def one_thread():
    """The job runs with --threads 1; the references here too, so their float sums are the same bits."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def calibration_batches(assets, model="llama"):
    """The calibration windows, built here: WINDOWS evenly spread windows of BLOCK training tokens in batches of 2."""
    windows = torch.as_tensor(held_out_windows(train_ids(assets, model)[0], BLOCK, WINDOWS)[:, :-1])
    return [windows[i : i + 2] for i in range(0, len(windows), 2)]


def eval_windows(assets, count, model="llama"):
    """The run's held-out windows (``--eval-windows count``) of the last 10% of the tokens."""
    train, ids = train_ids(assets, model)
    return held_out_windows(ids[len(train):], BLOCK, count)


def tensors(path):
    return {t.name: (t.tensor_type.name, bytes(t.data.tobytes())) for t in gguf.GGUFReader(path).tensors}


def float_model(assets, model="llama"):
    return transformers.AutoModelForCausalLM.from_pretrained(assets[model])


class Spy:
    """Records what ``calibrate_importance`` is given (the job's only calibration call)."""

    def __init__(self):
        self.batches, self.real = [], api.calibrate_importance

    def __call__(self, model, batches, **kwargs):
        batches = list(batches)
        self.batches += batches
        return self.real(model, batches, **kwargs)


@pytest.fixture(scope="module")
def q4_0_run(assets, tmp_path_factory):
    """One q4_0 run with ``--imatrix calibrate``, the calibration spied on and the trained layers' fake-quantized
    weights kept at the last step."""
    out = tmp_path_factory.mktemp("q4_0_imatrix") / "run"
    spy, last = Spy(), {}

    def keep(trainer):
        last.clear()
        for path, module in trainer.student.named_modules():
            if getattr(module, "spec", None) is not None:
                last[path] = (module.quantized_weight().detach().clone(), module.weight.detach().clone(),
                              None if module.importance is None else module.importance.clone())

    from mixle.lm import finetune_run

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(api, "calibrate_importance", spy)
        config = finetune_run.FinetuneConfig(model=str(assets["llama"]), data=(str(assets["data"]),), out=str(out),
                                         steps=3, block=BLOCK, batch_size=2, eval_windows=4, lr=5e-4,
                                         threads=1, imatrix="calibrate",
                                         calibration_windows=WINDOWS)
        results = finetune_run.run_finetune(config, progress=False, callback=keep)
    return {"out": out, "results": results, "spy": spy, "last": last}


def test_ptq_imatrix_is_quantize_model_with_importance_of_the_training_windows(assets, q4_0_run):
    out, results, spy = q4_0_run["out"], q4_0_run["results"], q4_0_run["spy"]
    train, ids = train_ids(assets)
    # Calibration saw the training windows only: each batch row is a slice of the training tokens.
    seen = torch.cat(spy.batches)
    assert seen.shape == (WINDOWS, BLOCK)
    starts = [next(i for i in range(len(train) - BLOCK + 1) if np.array_equal(train[i : i + BLOCK], row))
              for row in seen.numpy()]
    assert max(starts) + BLOCK <= len(train) < len(ids)
    imatrix = mixle.read_imatrix(out / "imatrix.gguf")
    assert {n: c.tolist() for n, c in imatrix.counts.items()} == {n: [WINDOWS * BLOCK] for n in imatrix.counts}
    assert results["imatrix"]["tokens"] == WINDOWS * BLOCK and results["imatrix"]["split"] == "training"
    # The row's file is quantize_model(..., importance=calibrate_importance(same windows)) + save_gguf, built here.
    model = float_model(assets)
    imp = mixle.calibrate_importance(model, calibration_batches(assets))
    ptq = mixle.quantize_model(model, grid="q4_0", exclude=("lm_head",), importance=imp)
    mixle.save_gguf(ptq, out / "mine.gguf", tokenizer=assets["tokenizer"], float_matrices="q8_0")
    theirs, mine = tensors(out / "ptq-imatrix.gguf"), tensors(out / "mine.gguf")
    assert sorted(theirs) == sorted(mine) and [n for n in mine if theirs[n] != mine[n]] == []
    reference = mixle.quantize_model(model, grid="q4_0", exclude=("lm_head",))
    assert not torch.equal(reference.model.layers[0].mlp.down_proj.dequantized_weight(),
                           ptq.model.layers[0].mlp.down_proj.dequantized_weight())  # the importance changed codes
    rows = {row["method"]: row for row in results["rows"]}
    assert list(rows) == ["float", "PTQ", "PTQ imatrix", "QAT imatrix"]
    windows = eval_windows(assets, 4)
    assert rows["PTQ imatrix"]["loss"] == pytest.approx(cross_entropy(ptq, windows), rel=1e-6)
    if llama_cpp_module() is not None:  # llama.cpp ran the row's file
        loss, _ = llama_cpp_loss(out / "ptq-imatrix.gguf", windows, threads=1)
        assert rows["PTQ imatrix"]["llama_cpp_loss"] == pytest.approx(loss, rel=1e-9)
        assert loss == pytest.approx(rows["PTQ imatrix"]["loss"], rel=2e-3)
    against = results["summary"]["held-out"]["baselines"]
    for method in ("PTQ", "PTQ imatrix"):
        lost, qat = rows[method]["loss"] - rows["float"]["loss"], rows["QAT imatrix"]["loss"]
        want = None if lost < MIN_DEGRADATION else pytest.approx(100 * (rows[method]["loss"] - qat) / lost)
        assert against[method]["recovered_percent"] == want, method
        assert against[method]["perplexity_increase_percent"] == pytest.approx(100 * np.expm1(lost)), method
    table = (out / "table.txt").read_text()
    increase = against["PTQ imatrix"]["perplexity_increase_percent"]
    assert f"held-out: PTQ imatrix {increase:+.2f}%, QAT imatrix " in table and "Importance matrix: calibrated on 5 " \
        "windows (80 tokens) of the training split" in (out / "README.md").read_text()
    assert results["files"] == {"gguf": "model.gguf", "ptq_imatrix": "ptq-imatrix.gguf", "imatrix": "imatrix.gguf",
                                "hf": "hf"}


def test_qat_imatrix_file_holds_the_trained_weighted_codes(assets, q4_0_run):
    out, last = q4_0_run["out"], q4_0_run["last"]
    imp = mixle.calibrate_importance(float_model(assets), calibration_batches(assets)).importance()
    from_file = load_gguf_weights(float_model(assets), out / "model.gguf")
    modules = dict(from_file.named_modules())
    assert len(last) == 14  # every decoder matrix, each holding its importance
    for path, (fake, weight, importance) in last.items():
        assert importance is not None and np.array_equal(importance.numpy(), imp[path]), path
        assert torch.equal(modules[path].weight, fake), path  # the file dequantizes to what QAT's forward used
        weighted = quantize_array(weight.numpy(), grid="q4_0", importance=imp[path]).dequantize()
        assert np.array_equal(fake.numpy(), np.asarray(weighted)), path  # by ggml's weighted search
    with torch.no_grad():  # the file's token_embd is Q8_0 (--float-matrices); mixle evaluates the float embedding
        from_file.model.embed_tokens.weight.copy_(float_model(assets).model.embed_tokens.weight)
    qat = next(r for r in q4_0_run["results"]["rows"] if r["method"] == "QAT imatrix")
    assert qat["loss"] == pytest.approx(cross_entropy(from_file, eval_windows(assets, 4)), rel=1e-5)


def test_the_hf_checkpoint_rebuilds_the_weighted_blocks_with_llama_quantize_imatrix(assets, q4_0_run, tmp_path):
    """QAT trained with the importance matrix: the hf/ checkpoint quantized with the run's imatrix.gguf (mixle's
    quantize_model, and llama-quantize --imatrix where present) is model.gguf, every tensor."""
    from tests.test_finetune import hf_rebuilds_the_file

    out = q4_0_run["out"]

    def quantize(model, path):
        importance = mixle.load_imatrix(out / "imatrix.gguf", model)
        ptq = mixle.quantize_model(model, grid="q4_0", exclude=("lm_head",), importance=importance)
        mixle.save_gguf(ptq, path, tokenizer=assets["tokenizer"])

    recipe = hf_rebuilds_the_file(out, quantize, tmp_path)
    assert recipe["quantize"][-5:] == ["--imatrix", "imatrix.gguf", "model-f32.gguf", "model-Q4_0.gguf", "Q4_0"]


def test_q4_0_mix_with_imatrix_is_llama_quantizes_file_and_trains_its_types(assets, tmp_path, capsys):
    """A mix: PTQ imatrix is save_gguf(float model, gguf_mix, importance) (llama-quantize --imatrix's file, with
    its Q4_1 ffn_down in the first eighth of the layers); QAT trains those types, the embedding (no entry, as in
    llama.cpp) on the reference quantizer; --no-qat-imatrix trains without the importance, the baseline stays."""
    out = tmp_path / "run"
    flags = ["--model", str(assets["llama8"]), "--data", str(assets["data"]), "--target", "Q4_0", "--steps", "2",
             "--imatrix", "calibrate", "--calibration-windows", str(WINDOWS), "--no-llama-cpp", *FAST,
             "--eval-windows", "2"]
    assert finetune(*flags, "--out", str(out)) == 0, capsys.readouterr().err
    model = float_model(assets, "llama8")
    imp = mixle.calibrate_importance(model, calibration_batches(assets, "llama8"))
    mixle.save_gguf(model, tmp_path / "mine.gguf", tokenizer=assets["tokenizer"], gguf_mix="Q4_0", importance=imp)
    theirs, mine = tensors(out / "ptq-imatrix.gguf"), tensors(tmp_path / "mine.gguf")
    assert [n for n in mine if theirs[n] != mine[n]] == [] and sorted(theirs) == sorted(mine)
    from tests.test_imatrix import build_dir, llama_quantize_imatrix

    if build_dir() is not None:  # llama-quantize --imatrix with the run's imatrix.gguf: the same file
        mixle.save_gguf(model, tmp_path / "f32.gguf", tokenizer=assets["tokenizer"], float_matrices="f32")
        llama_quantize_imatrix(build_dir(), str(tmp_path / "f32.gguf"), str(tmp_path / "llama.gguf"), "Q4_0",
                               str(out / "imatrix.gguf"))
        assert {n: t for n, t in tensors(tmp_path / "llama.gguf").items()} == theirs
    trained = {name: kind for name, (kind, _) in tensors(out / "model.gguf").items()}
    assert trained == {name: kind for name, (kind, _) in mine.items()}
    assert trained["blk.0.ffn_down.weight"] == "Q4_1" and trained["blk.1.ffn_down.weight"] == "Q4_0"
    assert results_of(out)["rows"][-1]["method"] == "QAT imatrix"
    plain = tmp_path / "plain"
    assert finetune(*flags, "--no-qat-imatrix", "--out", str(plain)) == 0, capsys.readouterr().err
    results = results_of(plain)
    assert [r["method"] for r in results["rows"]] == ["float", "PTQ", "PTQ imatrix", "QAT"]
    assert {name: kind for name, (kind, _) in tensors(plain / "model.gguf").items()}["blk.0.ffn_down.weight"] == "Q4_0"
    assert tensors(plain / "ptq-imatrix.gguf") == theirs and results["imatrix"]["qat"] is False


def test_resume_with_imatrix_reads_it_back_and_is_bit_for_bit(assets, tmp_path, capsys, monkeypatch):
    flags = ["--model", str(assets["llama"]), "--data", str(assets["data"]), "--steps", "4", "--checkpoint-every",
             "2", "--imatrix", "calibrate", "--calibration-windows", str(WINDOWS), "--no-llama-cpp", *FAST,
             "--eval-windows", "2"]
    assert finetune(*flags, "--out", str(tmp_path / "whole")) == 0
    from mixle.lm import finetune_train

    step = finetune_train.FinetuneTrainer.step

    def step_then_sigterm(trainer):
        value = step(trainer)
        if trainer.state.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return value

    monkeypatch.setattr(finetune_train.FinetuneTrainer, "step", step_then_sigterm)
    parted = tmp_path / "parted"
    assert finetune(*flags, "--out", str(parted)) == 130
    assert read_checkpoint(parted / "checkpoint.pt")["state"]["step"] == 2
    monkeypatch.undo()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        finetune("--resume", str(parted), "--imatrix", "off")
    assert "--imatrix 'off' differs from the interrupted run's 'calibrate'" in capsys.readouterr().err

    def no_calibration(*args, **kwargs):
        raise AssertionError("a resumed run reads its imatrix.gguf back instead of calibrating again")

    monkeypatch.setattr(api, "calibrate_importance", no_calibration)
    good = (parted / "imatrix.gguf").read_bytes()
    other = mixle.read_imatrix(parted / "imatrix.gguf")
    other.sums = {name: 2 * sums for name, sums in other.sums.items()}
    mixle.write_imatrix(tmp_path / "other.gguf", other)  # (not over the file read: its arrays are memory-mapped)
    os.replace(tmp_path / "other.gguf", parted / "imatrix.gguf")  # another importance: refused by its digest
    assert finetune("--resume", str(parted), "--no-progress") == 1
    assert "resume: the imatrix differ from the interrupted run's" in capsys.readouterr().err
    (parted / "imatrix.gguf").write_bytes(good)
    assert finetune("--resume", str(parted), "--no-progress") == 0, capsys.readouterr().err
    whole, resumed = results_of(tmp_path / "whole"), results_of(parted)
    assert resumed["rows"] == whole["rows"] and resumed["curve"] == whole["curve"]
    untimed = lambda info: {k: v for k, v in info.items() if k != "seconds"}  # noqa: E731
    assert untimed(resumed["imatrix"]) == untimed(whole["imatrix"]) and resumed["imatrix"]["file"] == "imatrix.gguf"
    digest = lambda path: hashlib.sha256(path.read_bytes()).hexdigest()  # noqa: E731
    for name in ("model.gguf", "ptq-imatrix.gguf", "imatrix.gguf"):
        assert digest(parted / name) == digest(tmp_path / "whole" / name), name


def test_gptq_row_on_int4_groups_against_gptq_quantize(assets, tmp_path, capsys):
    out = tmp_path / "run"
    assert finetune("--model", str(assets["llama"]), "--data", str(assets["data"]), "--out", str(out), "--target",
                    "int4/group32", "--gptq", "one-pass", "--calibration-windows", str(WINDOWS), "--steps", "1",
                    *FAST, "--eval-windows", "4") == 0, capsys.readouterr().err
    results = results_of(out)
    rows = {row["method"]: row for row in results["rows"]}
    assert list(rows) == ["float", "PTQ", "GPTQ", "QAT"] and rows["GPTQ"]["calibration_tokens"] == WINDOWS * BLOCK
    model = float_model(assets)
    mine = mixle.gptq_quantize(model, calibration_batches(assets), bits=4, group_size=32, exclude=("lm_head",),
                               sequential=False)
    windows = eval_windows(assets, 4)
    assert rows["GPTQ"]["loss"] == pytest.approx(cross_entropy(mine, windows), rel=1e-6)
    ptq = mixle.quantize_model(model, bits=4, group_size=32, exclude=("lm_head",))
    assert cross_entropy(mine, windows) != cross_entropy(ptq, windows)  # not round-to-nearest
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out / "gptq-compressed-tensors")
    assert cross_entropy(loaded, windows) == pytest.approx(rows["GPTQ"]["loss"], rel=1e-5)
    assert results["files"]["gptq"] == "gptq-compressed-tensors"
    assert "GPTQ" in results["summary"]["held-out"]["baselines"]


# ------------------------------------------------------------------------------------ bad input


def test_an_imatrix_of_another_model_is_refused_naming_the_tensor(assets, tmp_path, capsys):
    small = float_model(assets)  # ffn_down has 128 inputs here, 256 in llama256
    path = tmp_path / "small.imatrix.gguf"
    mixle.save_imatrix(small, mixle.calibrate_importance(small, calibration_batches(assets)), path)
    out = tmp_path / "out"
    err = refusal(capsys, "--model", str(assets["llama256"]), "--data", str(assets["data"]), "--out", str(out),
                 "--imatrix", str(path), *FAST)
    assert f"--imatrix {str(path)!r} does not fit the model" in err and "'blk.0.ffn_down.weight'" in err
    assert not out.exists()  # refused before anything is written
    imatrix = mixle.read_imatrix(path)
    for suffix in ("sums", "counts"):
        getattr(imatrix, suffix).pop("blk.1.attn_k.weight")
    part = tmp_path / "part.imatrix.gguf"  # (not over the file read: its arrays are memory-mapped)
    mixle.write_imatrix(part, imatrix)  # a file covering part of the model
    err = refusal(capsys, "--model", str(assets["llama"]), "--data", str(assets["data"]), "--out", str(out),
                 "--imatrix", str(part), *FAST)
    assert "has no entry for tensor 'blk.1.attn_k.weight' (1 matrices missing)" in err and not out.exists()
    assert "--imatrix '/no/such.dat' does not exist" in refusal(
        capsys, "--model", str(assets["llama"]), "--out", str(out), "--imatrix", "/no/such.dat", *FAST)


@pytest.mark.parametrize("flags, message", [
    (["--target", "int4/group32", "--imatrix", "calibrate"], "--imatrix with --target int4/group32: grid='symmetric' "
                                                             "has no importance-weighted search"),
    (["--target", "q8_0", "--imatrix", "calibrate"], "llama.cpp ignores an importance matrix on q8_0"),
    (["--target", "Q8_0", "--imatrix", "calibrate"], "llama.cpp ignores an importance matrix on q8_0"),
    (["--lora", "4", "--imatrix", "calibrate"], "--lora with --imatrix: .* add --no-qat-imatrix"),
    (["--no-qat-imatrix"], "--no-qat-imatrix without --imatrix"),
    (["--target", "Q4_K_M", "--gptq", "one-pass"], "--gptq with --target Q4_K_M: GPTQ rounds onto integer codes"),
    (["--target", "q4_k", "--gptq", "sequential"], "--gptq with --target q4_k cannot quantize onto grid='q4_k'"),
])
def test_baselines_a_target_cannot_honour_are_refused_with_the_reason(flags, message, capsys):
    assert pytest.importorskip("re").search(message, refusal(capsys, "--model", "m", "--out", "o", *flags, status=2))


def test_help_explains_the_baseline_flags(capsys):
    with pytest.raises(SystemExit):
        finetune("--help")
    text = capsys.readouterr().out
    for flag in ("--imatrix", "--calibration-windows", "--no-qat-imatrix", "--gptq"):
        assert flag in text, flag
