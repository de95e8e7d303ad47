"""The torch backend's rooms and the one training loop: explicit hooks, no stack walking, one loop for both jobs."""

import copy
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from mixle.lm import loop
from mixle.lm.training import train
from mixle.lm.transformer import build_causal_lm

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_importing_the_engine_registers_no_optimizer_hook_and_the_first_cache_registers_two():
    code = """
import torch
from torch.optim import optimizer
hooks = optimizer._global_optimizer_post_hooks
import mixle.torch_backend.fake_quant, mixle.torch_backend.layers.qat  # noqa: E401
from mixle.api import apply_qat
print(len(hooks))
model = apply_qat(torch.nn.Sequential(torch.nn.Linear(8, 4)), bits=4)
print(len(hooks))
model(torch.ones(2, 8)).sum().backward()
apply_qat(torch.nn.Sequential(torch.nn.Linear(8, 4)), bits=4)(torch.ones(2, 8))
print(len(hooks))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.split()
    assert out == ["0", "0", "2"]


def test_an_optimizer_step_still_makes_the_next_forward_quantize_afresh():
    from mixle.api import apply_qat

    layer = apply_qat(torch.nn.Linear(4, 2, bias=False), bits=4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    x = torch.eye(4)
    layer(x).sum().backward()
    optimizer.step()  # the weight changes in place: its version moves, and so does the generation
    with torch.no_grad():
        expected = layer(x)
    weight = layer.weight.detach().clone()
    from mixle.core.numerics import quantize_dequantize_array
    from mixle.core.spec import QuantSpec

    assert torch.equal(expected, x @ torch.as_tensor(quantize_dequantize_array(weight, QuantSpec(bits=4))).T)


def test_no_module_walks_stack_frames():
    walkers = [str(path.relative_to(ROOT)) for path in (ROOT / "mixle").rglob("*.py")
               if "_getframe" in path.read_text() or "f_back" in path.read_text()]
    assert walkers == []


def test_compare_and_finetune_train_through_the_same_loop(monkeypatch):
    """``train`` (compare's) runs ``loop.Trainer.step``: the step the finetune trainer inherits."""
    from mixle.lm.finetune_train import FinetuneTrainer

    assert FinetuneTrainer.step is loop.Trainer.step and FinetuneTrainer.train is loop.Trainer.train
    steps = []
    step = loop.Trainer.step

    def counted(trainer):
        steps.append(type(trainer).__name__)
        return step(trainer)

    monkeypatch.setattr(loop.Trainer, "step", counted)
    lm, ids = build_causal_lm(vocab=4, d_model=8, n_layer=1, n_head=2, block=4), torch.arange(40) % 4
    log = train(lm, ids, torch.arange(30), steps=3, lr=0.01, batch_size=8, block=4)
    assert steps == ["Trainer"] * 3 and log.curve["step"] == [1, 2, 3]


def test_a_diverged_compare_run_restores_the_weights_before_the_step():
    torch.manual_seed(0)
    lm, ids = build_causal_lm(vocab=4, d_model=8, n_layer=1, n_head=2, block=4), torch.arange(40) % 4
    before = copy.deepcopy(lm.state_dict())
    with pytest.raises(loop.NonFiniteLossError, match="at step 2: training stopped.*restored"):
        train(lm, ids, torch.arange(30), steps=5, lr=1e30, batch_size=8, block=4,
              optimizer=lambda params, lr: torch.optim.SGD(params, lr=lr))
    assert all(torch.isfinite(t).all() for t in lm.state_dict().values())
    assert any(not torch.equal(before[k], v) for k, v in lm.state_dict().items())  # step 1 was taken, and kept
