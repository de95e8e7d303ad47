"""The main job: QAT beats PTQ at int4 on real text, the CLI writes its outputs, bad input is refused."""

import errno
import hashlib
import json
import math
import re

import numpy as np
import pytest
import torch

from mixle.lm import cli
from mixle.lm.compare import (
    MIN_DEGRADATION,
    PRESETS,
    CompareConfig,
    ExternalQAT,
    held_out_loss,
    format_table,
    held_out_windows,
    prepare_data,
    run_compare,
    summarize,
)
from mixle.models.transformer import build_causal_lm
from mixle.core.spec import QuantSpec


def int_model_bytes(vocab, d, n_layer, block, bits):
    """Bytes of a build_causal_lm after int quantization of every Linear (tied head stored once)."""
    weights = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * n_layer + [(vocab, d)]
    codes = sum(o * i for o, i in weights) * bits // 8
    scales = 4 * sum(o for o, _ in weights)  # one fp32 scale per output channel
    floats = 4 * (block * d + n_layer * (2 * d + 3 * d + d + 2 * d + 4 * d + d) + 2 * d)
    return codes + scales + floats


def gguf_q4_0_bytes(vocab, d, n_layer, block):
    """Tensor bytes of the GGUF file of a build_causal_lm with every matrix Q4_0 (18 bytes per 32 weights)."""
    weights = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * n_layer + [(vocab, d)]
    floats = 4 * (block * d + n_layer * (2 * d + 3 * d + d + 2 * d + 4 * d + d) + 2 * d)
    return sum(o * i for o, i in weights) // 32 * 18 + floats


# Bytes per block and values per block of the ggml types (ggml's block structs).
BLOCK_BYTES = {"Q5_0": (22, 32), "Q8_0": (34, 32), "Q4_K": (144, 256), "Q6_K": (210, 256)}


def gguf_mix_bytes(vocab, d, n_layer, block, type_of):
    """Tensor bytes of the GGUF file of a build_causal_lm whose matrix ``name`` of layer ``i`` is ``type_of(i, name)``."""
    shapes = {"attn_qkv": (3 * d, d), "attn_output": (d, d), "ffn_up": (4 * d, d), "ffn_down": (d, 4 * d)}
    matrices = [(None, "token_embd", vocab, d)] + [(i, name, rows, cols) for i in range(n_layer)
                                                    for name, (rows, cols) in shapes.items()]
    floats = 4 * (block * d + n_layer * (2 * d + 3 * d + d + 2 * d + 4 * d + d) + 2 * d)
    return floats + sum(rows * cols // BLOCK_BYTES[type_of(i, name)][1] * BLOCK_BYTES[type_of(i, name)][0]
                        for i, name, rows, cols in matrices)


def test_held_out_loss_matches_a_numpy_cross_entropy():
    torch.manual_seed(0)
    lm = build_causal_lm(vocab=20, d_model=16, n_layer=1, n_head=2, block=8)
    ids = np.random.default_rng(0).integers(0, 20, 50)
    windows = held_out_windows(ids, 8)
    assert windows.shape == (6, 9) and np.array_equal(windows[1], ids[8:17])
    with torch.no_grad():
        logits = lm(torch.as_tensor(windows[:, :-1]), all_positions=True).double().numpy()
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits, windows[:, 1:, None], -1)[..., 0]
    assert held_out_loss(lm, windows, batch=4) == pytest.approx((logz - picked).mean(), rel=1e-6)
    thinned = held_out_windows(ids, 8, max_windows=3)  # evenly spaced among the 6 windows: 0, 2, 5
    assert np.array_equal(thinned, np.stack([ids[s : s + 9] for s in (0, 16, 40)]))


def test_recovered_percent_and_the_int8_note():
    rows = [{"method": "fp32 fine-tune", "bits": 32, "loss": 1.30},
            {"method": "fine-tune + PTQ", "bits": 4, "loss": 1.50},
            {"method": "QAT", "bits": 4, "loss": 1.32},
            {"method": "fine-tune + PTQ", "bits": 8, "loss": 1.30 + MIN_DEGRADATION / 2},
            {"method": "QAT", "bits": 8, "loss": 1.301}]
    summary = summarize(rows, (4, 8))
    assert summary["int4"]["QAT"]["recovered_percent"] == pytest.approx(100 * 0.18 / 0.20)
    assert summary["int4"]["QAT"]["perplexity_gap_percent"] == pytest.approx(100 * (math.exp(0.02) - 1))
    assert summary["int8"]["QAT"]["recovered_percent"] is None
    assert "nothing to recover" in summary["int8"]["QAT"]["note"]


# A tiny model trained long enough that int4 PTQ visibly hurts it: seconds on two cores.
FAST = CompareConfig(steps=400, finetune_steps=200, bits=(4,), d_model=64, n_layer=1, n_head=4, block=32,
                     batch_size=16, lr=3e-3, finetune_lr=1e-3, warmup=40, eval_windows=200, curve_every=200,
                     curve_windows=8, threads=1, gguf_mixes=(),  # the mix rows: test_q4_k_m_rows_...
                     imatrix=False)  # the imatrix rows: test_gptq_and_imatrix_rows_...


def test_qat_beats_ptq_at_int4_on_the_embedded_corpus():
    results = run_compare(FAST, progress=False)
    loss = {(r["method"], r["bits"]): r["loss"] for r in results["rows"]}
    tuned, baseline, qat = loss[("fp32 fine-tune", 32)], loss[("fine-tune + PTQ", 4)], loss[("QAT", 4)]
    assert baseline - tuned > 0.01  # PTQ really loses something at this size (about 0.02 nats)
    assert qat < baseline - 0.5 * (baseline - tuned)  # QAT recovers more than half of it (about 80%)
    assert qat < loss[("PTQ", 4)]
    assert loss[("fine-tune + GPTQ", 4)] < baseline  # GPTQ loses less than round to nearest, still more than QAT
    assert qat < loss[("fine-tune + GPTQ", 4)] and results["summary"]["int4_gptq"]["QAT"]["recovered_percent"] > 0
    assert_recovered_is_the_formula(results)
    # The llama.cpp rows, from the GGUF files' weights: QAT on q4_0 vs fine-tune + PTQ into Q4_0.
    rows = {r["method"]: r for r in results["rows"]}
    tuned, baseline = loss[("fp32 fine-tune (tanh GELU)", 32)], loss[("fine-tune + PTQ (GGUF q4_0)", 4)]
    qat = rows["QAT (GGUF q4_0)"]
    assert baseline - tuned > 0.005  # Q4_0's blocks of 32 lose less than per-channel int4 (about 0.009 nats)
    assert qat["loss"] < baseline - 0.5 * (baseline - tuned)
    assert qat["loss"] == qat["fake_quant_loss"]  # the file's weights are the ones QAT trained, bit for bit
    assert results["summary"]["gguf_q4_0"]["QAT (GGUF q4_0)"]["recovered_percent"] > 50
    if results["llama_cpp"] is not None:  # llama.cpp itself on the same windows (Q8_0 activations, f16 GELU table)
        for row in rows.values():
            if "llama_cpp_loss" in row:
                assert row["llama_cpp_loss"] == pytest.approx(row["loss"], abs=0.01)


def test_cli_smoke_preset_writes_table_json_and_png(tmp_path, capsys):
    out = tmp_path / "out"
    status = cli.main(["compare", "--preset", "smoke", "--out-dir", str(out), "--threads", "1", "--no-progress"])
    assert status == 0
    printed = capsys.readouterr().out
    table = (out / "table.txt").read_text()
    assert table.strip() in printed
    results = json.loads((out / "results.json").read_text())
    methods = [(r["method"], r["bits"]) for r in results["rows"]]
    assert methods == [("fp32", 32), ("PTQ", 4), ("PTQ", 8), ("fp32 fine-tune", 32),
                       ("fine-tune + PTQ", 4), ("fine-tune + PTQ", 8), ("fine-tune + GPTQ", 4), ("fine-tune + GPTQ", 8),
                       ("QAT", 4), ("QAT", 8),
                       ("fp32 fine-tune (tanh GELU)", 32), ("fine-tune + PTQ (GGUF q4_0)", 4), ("QAT (GGUF q4_0)", 4),
                       ("fine-tune + PTQ imatrix (GGUF q4_0)", 4), ("QAT imatrix (GGUF q4_0)", 4),
                       ("fine-tune + PTQ (GGUF Q4_K_M)", 4), ("QAT (GGUF Q4_K_M)", 4),
                       ("fine-tune + PTQ imatrix (GGUF Q4_K_M)", 4), ("QAT imatrix (GGUF Q4_K_M)", 4)]
    smoke = PRESETS["smoke"]
    vocab = results["data"]["vocab"]
    for row in results["rows"]:
        assert row["perplexity"] == pytest.approx(math.exp(row["loss"]))
        if "GGUF q4_0" in row["method"]:
            assert row["bytes"] == gguf_q4_0_bytes(vocab, smoke.d_model, smoke.n_layer, smoke.block)
        elif "GGUF Q4_K_M" in row["method"]:  # one layer of width 32: attn_qkv, ffn_down and token_embd Q8_0
            types = {"token_embd": "Q8_0", "attn_qkv": "Q8_0", "attn_output": "Q5_0", "ffn_up": "Q5_0",
                     "ffn_down": "Q8_0"}
            assert row["bytes"] == gguf_mix_bytes(vocab, smoke.d_model, smoke.n_layer, smoke.block, lambda i, n: types[n])
        elif row["bits"] != 32:
            assert row["bytes"] == int_model_bytes(vocab, smoke.d_model, smoke.n_layer, smoke.block, row["bits"])
        if row["method"] == "QAT":
            # The converted int model == the fake-quant model, up to its packed kernel summing in
            # another order than F.linear: float32 eps x reductions of ~d_model terms per layer.
            bound = 4 * smoke.n_layer * smoke.d_model * float(np.finfo(np.float32).eps)
            assert row["loss"] == pytest.approx(row["fake_quant_loss"], rel=bound)
    n_params = results["model"]["parameters"]
    assert results["model"]["fp32_bytes"] == 4 * n_params
    assert set(results["summary"]) == {"int4", "int8", "int4_gptq", "int8_gptq", "gguf_q4_0", "gguf_q4_0_imatrix",
                                       "gguf_Q4_K_M", "gguf_Q4_K_M_imatrix"}
    assert set(results["curves"]) == {"fp32", "fp32 fine-tune", "QAT int4", "QAT int8", "fp32 fine-tune (tanh GELU)",
                                      "QAT (GGUF q4_0)", "QAT (GGUF Q4_K_M)", "QAT imatrix (GGUF q4_0)",
                                      "QAT imatrix (GGUF Q4_K_M)"}
    assert_recovered_is_the_formula(results)
    assert len(results["curves"]["QAT int4"]["train_loss"]) == smoke.finetune_steps
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for line in ("QAT", "fine-tune + PTQ", "int4:", "int8:", "gguf_q4_0:", "evaluated from the GGUF file's weights",
                 "gguf_q4_0_imatrix:", "int4_gptq:", "4,096 tokens) of the training text, never the held-out text"):
        assert line in table


def test_runs_are_deterministic_for_a_seed():
    config = PRESETS["smoke"].replace(steps=6, finetune_steps=3, bits=(4,), eval_windows=4, curve_every=3, threads=1)
    a, b = (run_compare(config, progress=False) for _ in range(2))
    c = run_compare(config.replace(seed=1), progress=False)
    assert [r["loss"] for r in a["rows"]] == [r["loss"] for r in b["rows"]]
    assert a["curves"] == b["curves"]
    assert [r["loss"] for r in a["rows"]] != [r["loss"] for r in c["rows"]]


def test_an_external_method_trains_on_the_same_batches_and_schedule():
    """An ExternalQAT that changes nothing is the fp32 fine-tune again, to the last bit."""
    config = PRESETS["smoke"].replace(steps=8, finetune_steps=6, bits=(4,), eval_windows=6, curve_every=3)
    same = ExternalQAT(name="identity", bits=4, prepare=lambda m: m, to_float=lambda m: m, spec=QuantSpec(bits=4))
    results = run_compare(config, progress=False, external=[same])
    rows = {r["method"]: r for r in results["rows"] if r["bits"] in (4, 32)}
    assert rows["identity"]["loss"] == rows["fine-tune + PTQ"]["loss"]
    assert rows["identity"]["fake_quant_loss"] == rows["fp32 fine-tune"]["loss"]
    assert results["curves"]["identity"] == results["curves"]["fp32 fine-tune"]
    assert "identity" in results["summary"]["int4"]


def _cli_error(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["compare", "--preset", "smoke", "--no-progress", "--out-dir", "/nonexistent/never-written", *args])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_bad_input_gets_clear_errors(tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    assert "missing.txt' does not exist" in _cli_error(["--corpus", str(missing)], capsys)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "empty.txt' is empty" in _cli_error(["--corpus", str(empty)], capsys)
    assert "block=600000 is larger than the data" in _cli_error(["--block", "600000"], capsys)
    assert "bits=3 is not supported: compare int4 and/or int8" in _cli_error(["--bits", "3"], capsys)
    assert "d_model=30 must be divisible by n_head=4" in _cli_error(["--d-model", "30", "--n-head", "4"], capsys)
    assert "needs d_model divisible by 32, the Q4_0 block, got d_model=48" in _cli_error(["--d-model", "48"], capsys)
    assert "--no-gguf" in _cli_error(["--d-model", "48"], capsys)
    assert not CompareConfig(d_model=48, gguf=False).gguf  # the rows left out, any width
    parse = lambda *flags: cli.config_from_args(cli.build_parser().parse_args(["compare", *flags]))  # noqa: E731
    assert parse().gguf and not parse("--no-gguf").gguf
    with pytest.raises(ValueError, match="bits=3 is not supported"):
        CompareConfig(bits=(4, 3))
    with pytest.raises(ValueError, match="group_size=7 does not divide d_model=32"):
        PRESETS["smoke"].replace(group_size=7)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        prepare_data(PRESETS["smoke"].replace(corpus=str(missing)))
    with pytest.raises(TypeError, match="CompareConfig"):
        run_compare({"steps": 3})
    smoke = PRESETS["smoke"]
    with pytest.raises(ValueError, match="data was prepared for another corpus, split, seed or block"):
        run_compare(smoke.replace(seed=5), data=prepare_data(smoke))


# ----------------------------------------------------------------------------------------------
# The CLI never throws a finished run away: output folder checked first, table printed before
# files, each file atomic, complete.json last; known failures are one line, no traceback

TINY = ["compare", "--preset", "smoke", "--steps", "4", "--finetune-steps", "2", "--bits", "4",
        "--eval-windows", "4", "--threads", "1", "--no-progress"]


def _no_training(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("training started before the output folder was checked")

    monkeypatch.setattr("mixle.lm.compare.run_compare", refuse)


def test_an_unusable_out_dir_is_refused_before_training(tmp_path, capsys, monkeypatch):
    _no_training(monkeypatch)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out in (blocker, blocker / "sub"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*TINY, "--out-dir", str(out)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"--out-dir '{out}' cannot be created" in err and "Traceback" not in err


def test_a_failed_write_keeps_the_printed_table_and_leaves_no_complete_set(tmp_path, capsys, monkeypatch):
    import mixle.lm.report as compare  # write_outputs and the save_plot it calls live in mixle.lm.report

    out = tmp_path / "out"
    assert cli.main([*TINY, "--out-dir", str(out)]) == 0
    capsys.readouterr()
    complete = json.loads((out / "complete.json").read_text())["files"]
    assert sorted(complete) == ["compare.png", "results.json", "table.txt"]
    for name, digest in complete.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    earlier_png = (out / "compare.png").read_bytes()

    def disk_full(results, path):
        with open(path, "wb") as handle:
            handle.write(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(compare, "save_plot", disk_full)
    assert cli.main([*TINY, "--seed", "1", "--out-dir", str(out)]) == 1
    captured = capsys.readouterr()
    table = (out / "table.txt").read_text()
    assert table.strip() in captured.out  # printed before the writes
    assert captured.err.count("\n") == 1 and "No space left on device" in captured.err
    assert "Traceback" not in captured.err
    assert not (out / "complete.json").exists()  # the mixed folder does not look complete
    assert (out / "compare.png").read_bytes() == earlier_png  # never a half-written file
    assert sorted(p.name for p in out.iterdir()) == ["compare.png", "results.json", "table.txt"]


def test_ctrl_c_is_one_line_and_status_130(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("mixle.lm.compare.run_compare", interrupted)
    assert cli.main([*TINY, "--out-dir", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted" in err and "Traceback" not in err


def test_divergence_is_one_line_naming_only_cli_options(tmp_path, capsys):
    assert cli.main([*TINY, "--lr", "1e30", "--out-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "training diverged" in err and "--lr" in err
    assert "grad_clip" not in err
    flags = {action for option in cli.build_parser()._subparsers._group_actions[0].choices["compare"]._actions
             for action in option.option_strings}
    assert set(re.findall(r"--[a-z-]+", err)) <= flags
    assert not (tmp_path / "complete.json").exists()


# Two layers of width 64: ffn_down's rows of 256 take Q4_K (layer 0) and Q6_K (layer 1, a use_more_bits layer);
# rows of 64 fall back (Q4_K -> Q5_0; Q6_K -> Q8_0 for layer 1's attn_qkv and for the tied token_embd).
MIX = CompareConfig(steps=60, finetune_steps=12, bits=(4,), d_model=64, n_layer=2, n_head=2, block=32, batch_size=8,
                    warmup=10, eval_windows=16, curve_every=12, curve_windows=4, threads=1)
MIX_TYPES = {(None, "token_embd"): "Q8_0", (0, "ffn_down"): "Q4_K", (1, "ffn_down"): "Q6_K", (1, "attn_qkv"): "Q8_0"}


def mix_type(i, name):
    return MIX_TYPES.get((i, name), "Q5_0")


def test_q4_k_m_rows_are_llama_quantizes_file_vs_qat_on_the_mix(tmp_path):
    from mixle import load_gguf_weights, save_gguf
    from tests.test_gguf_mixes import HAS_LLAMA_CPP, llama_quantize, read_tensors, sha

    gguf = pytest.importorskip("gguf")
    results = run_compare(MIX, progress=False, gguf_dir=tmp_path)
    rows = {r["method"]: r for r in results["rows"]}
    ptq, qat = rows["fine-tune + PTQ (GGUF Q4_K_M)"], rows["QAT (GGUF Q4_K_M)"]
    vocab = results["data"]["vocab"]
    files = {"ptq": tmp_path / "fine-tune_+_PTQ_GGUF_Q4_K_M.gguf", "qat": tmp_path / "QAT_GGUF_Q4_K_M.gguf"}
    for row, path in ((ptq, files["ptq"]), (qat, files["qat"])):  # each tensor on the block type of llama.cpp's rule
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors if t.tensor_type.name != "F32"}
        want = {"token_embd.weight": "Q8_0"} | {f"blk.{i}.{name}.weight": mix_type(i, name) for i in range(2)
                                                for name in ("attn_qkv", "attn_output", "ffn_up", "ffn_down")}
        assert types == want
        assert row["bytes"] == gguf_mix_bytes(vocab, MIX.d_model, MIX.n_layer, MIX.block, mix_type)
        assert row["tensor_types"] == {"Q4_K": 1, "Q5_0": 5, "Q6_K": 1, "Q8_0": 2} and row["spec"] == "Q4_K_M"
    # PTQ's file is save_gguf(fp32 fine-tune, gguf_mix="Q4_K_M") byte for byte (the fine-tune read back exactly
    # from its F32 file), and, where llama-cpp-python is installed, llama.cpp's quantizer's tensors.
    template = build_causal_lm(vocab, MIX.d_model, MIX.n_layer, MIX.n_head, MIX.block, activation="gelu_tanh")
    tuned = load_gguf_weights(template, tmp_path / "fp32.gguf")
    (tmp_path / "again").mkdir()
    save_gguf(tuned, tmp_path / "again" / files["ptq"].name, tokenizer=prepare_data(MIX).tokenizer, gguf_mix="Q4_K_M")
    assert (tmp_path / "again" / files["ptq"].name).read_bytes() == files["ptq"].read_bytes()
    if HAS_LLAMA_CPP:
        llama_quantize(tmp_path / "fp32.gguf", tmp_path / "theirs.gguf", "Q4_K_M")
        tensors = {path: {name: (kind, sha(data)) for name, (kind, _, data) in read_tensors(path).items()}
                   for path in (tmp_path / "theirs.gguf", files["ptq"])}
        assert tensors[tmp_path / "theirs.gguf"] == tensors[files["ptq"]]
    assert ptq["loss"] == pytest.approx(held_out_loss(load_gguf_weights(template, files["ptq"]),
                                                      prepare_data(MIX).eval_windows), rel=1e-12)
    # QAT's file holds the blocks it trained on: mixle's evaluation of the file is its fake-quant loss exactly
    # (the same float32 weights through the same forward).
    assert qat["loss"] == qat["fake_quant_loss"]
    assert "QAT (GGUF Q4_K_M)" in results["summary"]["gguf_Q4_K_M"]
    table = format_table(results)
    assert "(GGUF Q4_K_M) rows: PTQ = save_gguf(fp32 fine-tune, gguf_mix='Q4_K_M')" in table
    if results["llama_cpp"] is not None:  # issue 24: llama.cpp's perplexity of each file within 1% of mixle's
        measured = [row for row in results["rows"] if "llama_cpp_loss" in row]
        assert len(measured) == 9  # the F32 file, Q4_0's and the mix's PTQ, QAT, imatrix PTQ, imatrix QAT
        for row in measured:
            assert row["llama_cpp_vs_mixle_percent"] == pytest.approx(100 * math.expm1(row["llama_cpp_loss"] - row["loss"]))
            assert abs(row["llama_cpp_vs_mixle_percent"]) < 1.0, row["method"]
        assert re.search(r"largest difference [-+]\d\.\d{3}% \(.*\), within 1%", table)


def test_gguf_mixes_are_checked_and_none_leaves_the_rows_out(capsys):
    assert CompareConfig(gguf_mixes=["q5_k_m", "Q4_K_M"]).gguf_mixes == ("Q5_K_M", "Q4_K_M")
    assert cli.config_from_args(cli.build_parser().parse_args(["compare", "--gguf-mixes", "none"])).gguf_mixes == ()
    with pytest.raises(ValueError, match=r"gguf_mixes: 'Q3_K_M' is unknown: use one of 'Q4_0' .*, or 'none'"):
        CompareConfig(gguf_mixes=("Q3_K_M",))
    with pytest.raises(ValueError, match="names a mix twice"):
        CompareConfig(gguf_mixes=("Q4_K_M", "q4_k_m"))
    parse = lambda *flags: cli.config_from_args(cli.build_parser().parse_args(["compare", *flags]))  # noqa: E731
    assert (parse().imatrix, parse().gptq, parse("--no-imatrix", "--no-gptq").imatrix) == (True, True, False)
    assert not parse("--no-gptq").gptq and parse("--calibration-windows", "7").calibration_windows == 7
    with pytest.raises(ValueError, match=r"calibration_windows=1 x block=8 gives fewer than 16 calibration tokens"):
        CompareConfig(calibration_windows=1, block=8)
    with pytest.raises(ValueError, match="calibration_windows=10000000 exceeds the .* training windows of block 32"):
        run_compare(PRESETS["smoke"].replace(calibration_windows=10**7), progress=False)
    config = PRESETS["smoke"].replace(steps=2, finetune_steps=2, bits=(4,), eval_windows=2, gguf_mixes=())
    rows = run_compare(config.replace(imatrix=False, gptq=False), progress=False)["rows"]
    assert [r["method"] for r in rows] == ["fp32", "PTQ", "fp32 fine-tune", "fine-tune + PTQ", "QAT",
                                           "fp32 fine-tune (tanh GELU)", "fine-tune + PTQ (GGUF q4_0)", "QAT (GGUF q4_0)"]


# ----------------------------------------------------------------------------------------------
# The strong PTQ baselines (issue 26): GPTQ and importance-matrix PTQ, QAT with the importance,
# calibrated on training windows only; recovered % against each PTQ.

# summary key -> (its PTQ baseline row, the float row both start from, the QAT rows measured), as the README states
COMPARED = {"int4": ("fine-tune + PTQ", "fp32 fine-tune", {"QAT"}),
            "int4_gptq": ("fine-tune + GPTQ", "fp32 fine-tune", {"QAT"}),
            "gguf_q4_0": ("fine-tune + PTQ (GGUF q4_0)", "fp32 fine-tune (tanh GELU)",
                          {"QAT (GGUF q4_0)", "QAT imatrix (GGUF q4_0)"}),
            "gguf_q4_0_imatrix": ("fine-tune + PTQ imatrix (GGUF q4_0)", "fp32 fine-tune (tanh GELU)",
                                  {"QAT (GGUF q4_0)", "QAT imatrix (GGUF q4_0)"}),
            "gguf_Q4_K_M": ("fine-tune + PTQ (GGUF Q4_K_M)", "fp32 fine-tune (tanh GELU)",
                            {"QAT (GGUF Q4_K_M)", "QAT imatrix (GGUF Q4_K_M)"}),
            "gguf_Q4_K_M_imatrix": ("fine-tune + PTQ imatrix (GGUF Q4_K_M)", "fp32 fine-tune (tanh GELU)",
                                    {"QAT (GGUF Q4_K_M)", "QAT imatrix (GGUF Q4_K_M)"})}
COMPARED |= {key.replace("4", "8", 1): value for key, value in COMPARED.items() if key.startswith("int")}


def assert_recovered_is_the_formula(results):
    """Every summary entry of COMPARED is (L_ptq - L_qat) / (L_ptq - L_tuned) of its rows (None below MIN_DEGRADATION)."""
    loss = {(r["method"], r["bits"]): r["loss"] for r in results["rows"]}
    for key, entry in results["summary"].items():
        if key not in COMPARED:
            continue
        baseline, tuned, methods = COMPARED[key]
        bits = 8 if key.startswith("int8") else 4
        assert entry["baseline"] == baseline
        assert {m for m, v in entry.items() if isinstance(v, dict)} == {m for m in methods if (m, bits) in loss}
        lost = loss[(baseline, bits)] - loss[(tuned, 32)]
        for method in methods & {m for m, _ in loss}:
            want = None if lost < MIN_DEGRADATION else 100 * (loss[(baseline, bits)] - loss[(method, bits)]) / lost
            assert entry[method]["recovered_percent"] == want, (key, method)


def test_recovered_percent_against_each_ptq_is_the_formula():
    losses = {("fp32 fine-tune", 32): 1.0, ("fine-tune + PTQ", 4): 1.2, ("fine-tune + GPTQ", 4): 1.1, ("QAT", 4): 1.05,
              ("fine-tune + PTQ", 8): 1.001, ("fine-tune + GPTQ", 8): 1.0004, ("QAT", 8): 1.0002,
              ("fp32 fine-tune (tanh GELU)", 32): 2.0, ("fine-tune + PTQ (GGUF q4_0)", 4): 2.3,
              ("QAT (GGUF q4_0)", 4): 2.05, ("fine-tune + PTQ imatrix (GGUF q4_0)", 4): 2.2,
              ("QAT imatrix (GGUF q4_0)", 4): 2.04, ("fine-tune + PTQ (GGUF Q4_K_M)", 4): 2.1,
              ("QAT (GGUF Q4_K_M)", 4): 2.03, ("fine-tune + PTQ imatrix (GGUF Q4_K_M)", 4): 2.08,
              ("QAT imatrix (GGUF Q4_K_M)", 4): 2.01}
    rows = [{"method": m, "bits": b, "loss": v, **({"gguf_mix": "Q4_K_M"} if "Q4_K_M" in m else {})}
            for (m, b), v in losses.items()]
    results = {"rows": rows, "summary": summarize(rows, (4, 8))}
    assert set(results["summary"]) == set(COMPARED)
    assert_recovered_is_the_formula(results)
    imatrix = results["summary"]["gguf_q4_0_imatrix"]["QAT imatrix (GGUF q4_0)"]
    assert imatrix["recovered_percent"] == pytest.approx(80.0)  # (2.2 - 2.04) / (2.2 - 2.0)
    assert "with an importance matrix (calibrated on training windows)" in imatrix["note"]


def test_gptq_and_imatrix_rows_are_the_independent_constructions(tmp_path):
    """The imatrix PTQ files are calibrate_importance on the training windows + quantize_model + save_gguf, tensor by
    tensor; the importance counted every calibration token and only those; GPTQ is gptq_quantize on the same windows."""
    from mixle import apply_qat, calibrate_importance, gptq_quantize, load_gguf_weights, quantize_model, save_gguf
    from mixle.lm.compare import CompareRun
    from tests.test_gguf_mixes import read_tensors, sha

    pytest.importorskip("gguf")
    config = PRESETS["smoke"].replace(steps=12, finetune_steps=2, bits=(4,), eval_windows=4, curve_every=100,
                                      curve_windows=2, calibration_windows=48)
    results = run_compare(config, progress=False, gguf_dir=tmp_path)
    rows = {r["method"]: r for r in results["rows"]}
    data = prepare_data(config)
    # The calibration windows, built here from the training ids: evenly spaced window starts of the training text.
    starts = np.linspace(0, len(data.train_ids) - config.block - 1, 48).round().astype(int)
    windows = torch.stack([data.train_ids[s : s + config.block] for s in starts])
    batches = [{"idx": windows[i : i + 8], "all_positions": True} for i in range(0, 48, 8)]
    tokens = 48 * config.block
    assert results["calibration"]["tokens"] == tokens and results["calibration"]["windows"] == 48
    template = build_causal_lm(data.tokenizer.vocab_size, config.d_model, config.n_layer, config.n_head, config.block,
                               activation="gelu_tanh")
    tuned = load_gguf_weights(template, tmp_path / "fp32.gguf")  # the tanh-GELU fine-tune, exactly (F32)
    importance = calibrate_importance(tuned, batches)
    layers = ["blocks.0.qkv", "blocks.0.proj", "blocks.0.fc", "blocks.0.out"]
    assert {path: int(c.sum()) for path, c in importance.counts.items()} == dict.fromkeys(layers, tokens)
    assert results["calibration"]["imatrix_counts"] == {
        "fp32 fine-tune (tanh GELU)": dict.fromkeys(layers, tokens), "fp32 (tanh GELU)": dict.fromkeys(layers, tokens)}
    (tmp_path / "mine").mkdir()
    for mix, name in ((None, "fine-tune_+_PTQ_imatrix_GGUF_q4_0"), ("Q4_K_M", "fine-tune_+_PTQ_imatrix_GGUF_Q4_K_M")):
        target = {"grid": "q4_0"} if mix is None else {"gguf_mix": mix}
        mine = tmp_path / "mine" / f"{name}.gguf"
        save_gguf(quantize_model(tuned, importance=importance, **target), mine, tokenizer=data.tokenizer,
                  gguf_mix=mix, importance=importance if mix else None)
        theirs, ours = read_tensors(tmp_path / f"{name}.gguf"), read_tensors(mine)
        assert {k: (t, sha(d)) for k, (t, _, d) in theirs.items()} == {k: (t, sha(d)) for k, (t, _, d) in ours.items()}
        plain = read_tensors(tmp_path / f"{name.replace('_imatrix', '')}.gguf")  # the weighted search changed blocks
        assert sha(plain["blk.0.ffn_up.weight"][2]) != sha(theirs["blk.0.ffn_up.weight"][2])
    for method in ("QAT imatrix (GGUF q4_0)", "QAT imatrix (GGUF Q4_K_M)"):  # the files hold what QAT trained on
        assert rows[method]["loss"] == rows[method]["fake_quant_loss"]
        assert rows[method]["calibration_tokens"] == tokens
    # GPTQ: the job's fine-tune (rebuilt: same seeds, same batches) through gptq_quantize on the same windows.
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)  # as run_compare: the same float sums
    try:
        run = CompareRun(config, data, progress=False)
        lm = run.pretrain(run.build_model())
        fine_tune = run.finetune(lm, "fp32 fine-tune")
        assert run.loss(fine_tune) == rows["fp32 fine-tune"]["loss"]
        gptq = gptq_quantize(fine_tune, batches, config.spec(4))
        assert rows["fine-tune + GPTQ"]["loss"] == held_out_loss(gptq, data.eval_windows)
        # QAT imatrix: the tanh-GELU checkpoint's importance, fixed while QAT trains like the plain GGUF QAT row.
        for block in lm.blocks:
            block.activation = "gelu_tanh"
        base_importance = calibrate_importance(lm, batches)
        qat = run.finetune(lm, "QAT imatrix", lambda m: apply_qat(m, grid="q4_0", importance=base_importance))
        save_gguf(qat, tmp_path / "mine" / "qat.gguf", tokenizer=data.tokenizer)
    finally:
        torch.set_num_threads(threads)
    assert rows["fine-tune + GPTQ"]["loss"] < rows["fine-tune + PTQ"]["loss"]
    theirs, ours = read_tensors(tmp_path / "QAT_imatrix_GGUF_q4_0.gguf"), read_tensors(tmp_path / "mine" / "qat.gguf")
    assert {k: (t, sha(d)) for k, (t, _, d) in theirs.items()} == {k: (t, sha(d)) for k, (t, _, d) in ours.items()}
    assert sha(read_tensors(tmp_path / "QAT_GGUF_q4_0.gguf")["blk.0.ffn_up.weight"][2]) != sha(
        theirs["blk.0.ffn_up.weight"][2])
