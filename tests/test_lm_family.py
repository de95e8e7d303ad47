"""Model families (mixle's build_causal_lm, a transformers causal LM) through one training loop and
evaluator, and the CLI flags generated from a config dataclass."""

import argparse
import copy
import dataclasses
import inspect
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mixle.lm import cli
from mixle.lm.config import CompareConfig
from mixle.lm.family import MIXLE, TRANSFORMERS, TransformersTokenizer, family_of, log_prob_from_logits
from mixle.lm.flags import add_flags, changes_from_args, option, positive_int
from mixle.lm.training import held_out_loss, train, window_density
from mixle.lm.windows import held_out_windows
from mixle.models.qat import apply_qat
from mixle.models.transformer import build_causal_lm

transformers = pytest.importorskip("transformers")


def tiny_llama(seed=0, vocab=40, context=16):
    """A randomly initialised one-layer Llama (no download)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=context)
    return transformers.LlamaForCausalLM(config)


def periodic_ids(count, period=5):
    """Token ids repeating with period ``period``: 0, 2, 4, 1, 3, 0, 2, ..."""
    return torch.arange(count) * 2 % period


# ------------------------------------------------------------------------------------ families


def test_a_transformers_causal_lm_is_the_transformers_family():
    model = tiny_llama()
    family = family_of(model)
    assert family is TRANSFORMERS
    assert family.context_length(model) == 16 and family.gguf_architecture(model) == "llama"
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert torch.equal(family.logits(model, ids), model(ids).logits)


def test_held_out_loss_of_a_transformers_model_is_the_cross_entropy_of_its_logits():
    model = tiny_llama()
    windows = held_out_windows(np.random.default_rng(0).integers(0, 40, 100), 8)
    with torch.no_grad():
        logits = model(torch.as_tensor(windows[:, :-1])).logits.double()
    expected = F.cross_entropy(logits.flatten(0, 1), torch.as_tensor(windows[:, 1:]).flatten()).item()
    assert held_out_loss(model, windows, batch=5) == pytest.approx(expected, rel=1e-6)
    assert 3.0 < expected < 4.4  # near log(40) = 3.69 for random weights
    assert model.training  # the mode is restored


def test_the_mixle_family_is_build_causal_lm_float_or_qat():
    torch.manual_seed(0)
    lm = build_causal_lm(vocab=20, d_model=32, n_layer=1, n_head=2, block=8)
    assert family_of(lm) is MIXLE and MIXLE.context_length(lm) == 8 and MIXLE.gguf_architecture(lm) == "gpt2"
    tokens = torch.randint(0, 20, (3, 9), generator=torch.Generator().manual_seed(1))
    # Its own sequence_log_prob and the one derived from its logits are the same computation.
    own = MIXLE.sequence_log_prob(lm, tokens)
    assert torch.equal(own, log_prob_from_logits(MIXLE.logits(lm, tokens[:, :-1]), tokens[:, 1:]))
    assert torch.equal(own, lm.sequence_log_prob(tokens))
    assert family_of(apply_qat(copy.deepcopy(lm), bits=4)) is MIXLE
    with pytest.raises(TypeError, match="Linear is not a causal LM the LM jobs know"):
        family_of(torch.nn.Linear(2, 2))


def test_window_density_gives_the_log_prob_of_the_windows_at_the_starts():
    ids = periodic_ids(60)
    starts = torch.tensor([0, 7, 30])
    windows = torch.stack([ids[s : s + 9] for s in starts])
    torch.manual_seed(0)
    lm = build_causal_lm(vocab=20, d_model=32, n_layer=1, n_head=2, block=8)
    assert torch.equal(window_density(lm, ids).log_density(starts), lm.sequence_log_prob(windows))
    model = tiny_llama(vocab=20)
    density = window_density(model, ids, block=8)
    assert torch.allclose(density.log_density(starts), TRANSFORMERS.sequence_log_prob(model, windows))
    logits, targets = density.logits(starts)
    assert logits.shape == (3, 8, 20) and torch.equal(targets, windows[:, 1:])


def test_the_training_loop_trains_a_transformers_model():
    ids = periodic_ids(400)
    model = tiny_llama()
    held = held_out_windows(ids.numpy()[300:], 8)
    before = held_out_loss(model, held)
    log = train(model, ids[:300], torch.arange(300 - 8), steps=60, lr=1e-2, batch_size=8, block=8, seed=0,
                curve_windows=held, curve_every=20)
    after = held_out_loss(model, held)
    assert len(log.curve["train_loss"]) == 60 and log.curve["step"] == list(range(1, 61))
    assert log.curve["eval_step"] == [0, 20, 40, 60]
    assert log.curve["held_out_loss"][0] == before and log.curve["held_out_loss"][-1] == after
    assert before > 3.0 and after < 0.5  # a period-5 sequence is learned


def test_distillation_through_the_transformers_family():
    """A student that starts as its own teacher has zero pure-distillation loss on the first step."""
    ids = periodic_ids(200)
    model = tiny_llama()
    log = train(model, ids, torch.arange(200 - 8), steps=3, lr=1e-2, batch_size=4, block=8,
                teacher=copy.deepcopy(model), temperature=2.0, weight=1.0)
    assert log.curve["train_loss"][0] == pytest.approx(0.0, abs=1e-6)
    assert log.curve["train_loss"][-1] > 1e-6  # the student moved away from the frozen teacher


def test_train_defaults_are_the_distillation_defaults():
    from mixle.lm.distill import DEFAULT_TEMPERATURE, DEFAULT_WEIGHT

    parameters = inspect.signature(train).parameters
    assert (parameters["temperature"].default, parameters["weight"].default) == (DEFAULT_TEMPERATURE, DEFAULT_WEIGHT)


def test_a_transformers_tokenizer_as_the_jobs_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    words = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    native = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer = TRANSFORMERS.tokenizer(native)
    assert isinstance(tokenizer, TransformersTokenizer) and tokenizer.native is native
    ids = tokenizer.encode("the cat sat")
    assert ids.dtype == np.int64 and ids.tolist() == [1, 2, 3] and tokenizer.vocab_size == 4
    assert tokenizer.decode(ids) == "the cat sat"


# --------------------------------------------------------------------- CLI flags from a dataclass


@dataclasses.dataclass(frozen=True, kw_only=True)
class Toy:
    steps: int = option(10, "training steps", type=positive_int)
    seed: int = option(0, "the seed")
    lr: float | None = option(None, "learning rate (default: automatic)")
    widths: tuple[int, ...] = option((4, 8), "bit widths")
    mode: str = option("fast", "how to run", choices=("fast", "slow"))
    name: str | None = option(None, "a name")
    verbose: bool = option(False, "say more")
    export: bool = option(True, "skip the export")
    internal: int = 3


def toy_parser():
    parser = argparse.ArgumentParser(prog="toy")
    add_flags(parser, Toy)
    return parser


def test_flags_are_generated_from_the_fields():
    parser = toy_parser()
    flags = re.findall(r"\[(--[a-z0-9-]+)", parser.format_usage())
    assert flags == ["--steps", "--seed", "--lr", "--widths", "--mode", "--name", "--verbose", "--no-export"]
    assert changes_from_args(parser.parse_args([]), Toy) == {}
    args = parser.parse_args(["--steps", "3", "--seed", "-2", "--lr", "0.5", "--widths", "8", "--mode", "slow",
                              "--name", "x", "--verbose", "--no-export"])
    changes = changes_from_args(args, Toy)
    assert changes == {"steps": 3, "seed": -2, "lr": 0.5, "widths": (8,), "mode": "slow", "name": "x",
                       "verbose": True, "export": False}
    assert dataclasses.replace(Toy(), **changes) == Toy(steps=3, seed=-2, lr=0.5, widths=(8,), mode="slow", name="x",
                                                        verbose=True, export=False, internal=3)
    help_text = parser.format_help()
    for text in ("training steps", "learning rate (default: automatic)", "--widths WIDTHS [WIDTHS ...]",
                 "{fast,slow}", "skip the export"):
        assert text in help_text
    assert "internal" not in help_text


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "argument --steps: 0 is not a positive integer"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["--mode", "medium"], "argument --mode: invalid choice: 'medium'"),
    (["--widths"], "argument --widths: expected at least one argument"),
])
def test_bad_flag_values_exit_2_with_the_reason(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        toy_parser().parse_args(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_field_of_a_kind_without_a_flag_is_refused():
    @dataclasses.dataclass
    class Bad:
        table: dict = option(None, "a table")

    with pytest.raises(TypeError, match="field 'table': no command-line flag"):
        add_flags(argparse.ArgumentParser(), Bad)


def test_the_compare_flags_are_the_config_fields_with_help():
    compare = cli.build_parser().parse_args(["compare"]).subparser
    flags = re.findall(r"\[(--[a-z0-9-]+)", compare.format_usage())
    assert flags == ["--preset", "--steps", "--finetune-steps", "--bits", "--d-model", "--n-layer", "--n-head",
                     "--block", "--batch-size", "--lr", "--finetune-lr", "--group-size", "--clip-percentile",
                     "--corpus", "--tokenizer", "--eval-windows", "--seed", "--threads", "--distill",
                     "--distill-temperature", "--distill-weight", "--learned-scales", "--scale-lr", "--act8",
                     "--no-gguf", "--gguf-mixes", "--no-imatrix", "--no-gptq", "--calibration-windows", "--out-dir",
                     "--no-progress"]
    flagged = [f.name for f in dataclasses.fields(CompareConfig) if "flag" in f.metadata]
    assert ["--" + ("no-" if name in ("gguf", "imatrix", "gptq") else "") + name.replace("_", "-")
            for name in flagged] == flags[1:-2]
    args = compare.parse_args(["--bits", "4", "--no-gguf", "--group-size", "32", "--seed", "3"])
    assert changes_from_args(args, CompareConfig) == {"bits": (4,), "gguf": False, "group_size": 32, "seed": 3}
