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
    assert set(results["summary"]) == {"int4", "8da4w"} and "8da4w QAT" in results["summary"]["8da4w"]


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
