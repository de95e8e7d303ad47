"""mixle compare's optional rows: learned scales, distillation, both, and 8da4w PTQ vs QAT."""

import math

from mixle.lm.cli import build_parser, config_from_args
from mixle.lm.compare import PRESETS, run_compare, summarize


def test_compare_adds_every_option_row_with_real_int_models():
    config = PRESETS["smoke"].replace(bits=(4,), distill=True, learned_scales=True, act8=True, finetune_steps=6,
                                      eval_windows=8, gguf=False)  # the llama.cpp rows: test_compare
    results = run_compare(config, progress=False)
    rows = {r["method"]: r for r in results["rows"]}
    for method in ("QAT + learned scales", "QAT + distill", "QAT + learned + distill", "8da4w fine-tune + PTQ",
                   "8da4w QAT"):
        assert method in rows
    # Each QAT row is evaluated as the converted int model, whose loss equals its fake-quant loss
    # (same numerics); float32 sums over batches in another order.
    for method in ("QAT + learned scales", "QAT + learned + distill", "8da4w QAT"):
        assert math.isclose(rows[method]["loss"], rows[method]["fake_quant_loss"], rel_tol=1e-5)
    assert rows["8da4w QAT"]["spec"] == "int4/group32/qwix/a8asym"
    assert set(results["summary"]) == {"int4", "int4_gptq", "8da4w"} and "8da4w QAT" in results["summary"]["8da4w"]


def test_summary_measures_8da4w_against_its_own_baseline():
    rows = [{"method": "fp32 fine-tune", "bits": 32, "loss": 1.0},
            {"method": "fine-tune + PTQ", "bits": 4, "loss": 1.1},
            {"method": "8da4w fine-tune + PTQ", "bits": 4, "loss": 1.4},
            {"method": "8da4w QAT", "bits": 4, "loss": 1.1},
            {"method": "torchao 8da4w QAT", "bits": 4, "loss": 1.2}]
    summary = summarize(rows, (4,), (), ["torchao 8da4w QAT"])
    assert round(summary["8da4w"]["8da4w QAT"]["recovered_percent"], 6) == 75.0
    assert round(summary["8da4w"]["torchao 8da4w QAT"]["recovered_percent"], 6) == 50.0
    assert "torchao 8da4w QAT" not in summary["int4"]


def test_cli_flags():
    args = build_parser().parse_args(["compare", "--preset", "smoke", "--distill", "--learned-scales", "--act8",
                                      "--distill-temperature", "2", "--distill-weight", "0.9", "--scale-lr", "1e-3"])
    config = config_from_args(args)
    assert (config.distill, config.learned_scales, config.act8) == (True, True, True)
    assert (config.distill_temperature, config.distill_weight, config.scale_lr) == (2.0, 0.9, 1e-3)


def test_summary_measures_a_mix_against_llama_quantizes_mix_and_its_llama_cpp_losses():
    rows = [{"method": "fp32 fine-tune (tanh GELU)", "bits": 32, "loss": 1.0, "llama_cpp_loss": 1.001},
            {"method": "fine-tune + PTQ (GGUF q4_0)", "bits": 4, "loss": 1.3},
            {"method": "QAT (GGUF q4_0)", "bits": 4, "loss": 1.15},
            {"method": "fine-tune + PTQ (GGUF Q4_K_M)", "bits": 4, "loss": 1.1, "gguf_mix": "Q4_K_M",
             "llama_cpp_loss": 1.101},
            {"method": "QAT (GGUF Q4_K_M)", "bits": 4, "loss": 1.02, "gguf_mix": "Q4_K_M", "llama_cpp_loss": 1.031}]
    summary = summarize(rows, ())
    assert round(summary["gguf_q4_0"]["QAT (GGUF q4_0)"]["recovered_percent"], 6) == 50.0
    mix = summary["gguf_Q4_K_M"]["QAT (GGUF Q4_K_M)"]
    assert round(mix["recovered_percent"], 6) == 80.0  # (1.1 - 1.02) / (1.1 - 1.0), not against Q4_0's PTQ
    assert round(mix["llama_cpp_recovered_percent"], 6) == 70.0  # (1.101 - 1.031) / (1.101 - 1.001)
    assert "recovers 80.0% of the held-out loss PTQ loses at GGUF Q4_K_M" in mix["note"]
