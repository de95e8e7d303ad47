"""``mixle.lm.cpu_bfloat16``: a bfloat16 finetune run on the CPU times one product of each dtype and
says when float32 is faster. The timing itself depends on the machine; here it is replaced, so the
decision and what reaches the user are checked exactly (the live ratio is checked in
``tests/test_finetune.py``'s bfloat16 run)."""

import pytest

torch = pytest.importorskip("torch")

from mixle.lm import cpu_bfloat16  # noqa: E402
from mixle.lm.finetune_config import FinetuneConfig  # noqa: E402


def timed(monkeypatch, seconds):
    """Replace the product timing by ``seconds[dtype]``; returns the dtypes timed, in order."""
    asked = []
    monkeypatch.setattr(cpu_bfloat16, "product_seconds", lambda torch_, dtype: asked.append(dtype) or seconds[dtype])
    return asked


def test_note_names_the_ratio_only_above_the_threshold():
    assert cpu_bfloat16.bfloat16_note(cpu_bfloat16.SLOW) is None
    note = cpu_bfloat16.bfloat16_note(3.49)
    assert "3.5x the time of float32's" in note and "--dtype float32 trains faster here" in note


def test_a_slow_cpu_gets_the_note_and_the_ratio(monkeypatch, capsys):
    asked = timed(monkeypatch, {torch.bfloat16: 0.03, torch.float32: 0.01})
    config = FinetuneConfig(model="m", out="o", dtype="bfloat16")
    assert cpu_bfloat16.check_bfloat16(torch, config, echo=True) == {"bfloat16_products_vs_float32": 3.0}
    assert asked == [torch.bfloat16, torch.float32]
    assert "take 3.0x the time" in capsys.readouterr().err
    cpu_bfloat16.check_bfloat16(torch, config, echo=False)  # another rank of the job: nothing printed
    assert capsys.readouterr().err == ""


def test_a_fast_cpu_and_other_runs_get_no_note(monkeypatch, capsys):
    asked = timed(monkeypatch, {torch.bfloat16: 0.011, torch.float32: 0.01})
    assert cpu_bfloat16.check_bfloat16(torch, FinetuneConfig(model="m", out="o", dtype="bfloat16"),
                                       echo=True) == {"bfloat16_products_vs_float32": 1.1}
    assert capsys.readouterr().err == ""
    asked.clear()
    for config in (FinetuneConfig(model="m", out="o"), FinetuneConfig(model="m", out="o", dtype="bfloat16",
                                                                         device="cuda")):
        assert cpu_bfloat16.check_bfloat16(torch, config, echo=True) == {}
    assert asked == []  # nothing timed: float32, or not the CPU
