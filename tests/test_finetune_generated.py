"""``mixle finetune --generated-tokens``: training text sampled from the float model itself.

The samples are checked against the model's own next-token distribution (softmax of its logits in
float64, computed here), and the run against the text it wrote: the training stream is the data's
tokens, the end-of-text token and the file's ids, and a resumed run trains on the same file.
"""

import os
import signal

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("gguf")

from mixle.lm.finetune_config import FinetuneConfig  # noqa: E402
from mixle.lm.finetune_generated import BATCH, GENERATED_FILE, read_generated, sample_tokens  # noqa: E402
from mixle.lm.finetune_run import run_finetune  # noqa: E402
from mixle.lm.finetune_train import Stopped  # noqa: E402
from tests.test_finetune import finetune, results_of, tiny_llama_run  # noqa: E402

FAST = ["--block", "16", "--batch-size", "2", "--eval-windows", "2", "--threads", "1", "--no-progress",
        "--no-llama-cpp", "--no-hf-checkpoint"]


def peaked_model(vocab=24):
    """A tiny Llama whose next-token distribution is far from uniform (its head scaled up)."""
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model.eval()


def test_samples_follow_the_float_models_full_distribution():
    model, start, stop = peaked_model(), 1, 0
    ids = sample_tokens(model, 2400, start=start, stop=stop, length=1, seed=5)
    drawn, i = [], 0  # a sample is its token and the stop id after it, or the stop id alone if it drew that
    while i < len(ids):
        drawn.append(ids[i])
        i += 1 if ids[i] == stop else 2
    drawn = np.asarray(drawn)
    assert len(drawn) % BATCH == 0 and (drawn != stop).sum() >= 2400
    with torch.no_grad():
        logits = model(torch.tensor([[start]])).logits[0, -1].double().numpy()
    p = np.exp(logits - logits.max())
    p /= p.sum()
    assert p.max() > 0.3  # a peaked distribution: a truncation or another temperature moves it far
    counts = np.bincount(drawn, minlength=len(p)) / len(drawn)
    bound = 5 * np.sqrt(p * (1 - p) / len(drawn)) + 1 / len(drawn)
    assert np.all(np.abs(counts - p) <= bound), np.abs(counts - p) / bound


def test_samples_are_seeded_and_stop_at_the_end_of_text():
    model = peaked_model()
    first = sample_tokens(model, 100, start=1, stop=0, length=8, seed=1)
    assert np.array_equal(first, sample_tokens(model, 100, start=1, stop=0, length=8, seed=1))
    assert not np.array_equal(first, sample_tokens(model, 100, start=1, stop=0, length=8, seed=2))
    pieces = np.split(first, np.flatnonzero(first == 0))
    assert all(len(piece) <= 8 + (i > 0) for i, piece in enumerate(pieces))
    assert len(first) - (first == 0).sum() >= 100 and first[-1] != 0


def test_a_run_trains_on_the_text_it_sampled_and_resumes_on_the_same(tmp_path):
    root = tiny_llama_run(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "llama")
    flags = ["--model", str(root / "llama"), "--data", str(root / "data.txt"), "--steps", "3", "--generated-tokens",
             "150", *FAST]
    assert finetune(*flags, "--out", str(tmp_path / "whole")) == 0
    whole = results_of(tmp_path / "whole")
    ids = np.load(tmp_path / "whole" / GENERATED_FILE)
    assert whole["data"]["generated"] == {"tokens": len(ids), "file": GENERATED_FILE} and len(ids) >= 150
    plain = np.asarray(tokenizer.encode((root / "data.txt").read_text(), add_special_tokens=False))
    held = max(17, round(0.1 * len(plain)))
    assert whole["data"]["train_tokens"] == len(plain) - held + 1 + len(ids)
    assert ids.min() >= 0 and ids.max() < len(tokenizer)

    config = FinetuneConfig(model=str(root / "llama"), data=(str(root / "data.txt"),), out=str(tmp_path / "parted"),
                            steps=3, block=16, batch_size=2, eval_windows=2, threads=1, llama_cpp=False,
                            hf_checkpoint=False, generated_tokens=150)

    def stop(trainer):
        os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(Stopped, match="after step 1"):
        run_finetune(config, progress=False, callback=stop)
    assert np.array_equal(np.load(tmp_path / "parted" / GENERATED_FILE), ids)  # the same seed samples the same
    assert finetune("--resume", config.out, "--no-progress") == 0
    assert results_of(tmp_path / "parted")["rows"] == whole["rows"]


def test_a_damaged_sample_file_is_refused_naming_it(tmp_path):
    path = tmp_path / GENERATED_FILE
    np.save(path, np.asarray([3, 700, 5]))
    with pytest.raises(ValueError, match=r"generated.npy' holds ids in \[3, 700\], outside the model's vocabulary of 300"):
        read_generated(path, 300)
    np.save(path, np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match=r"shape \(2, 2\), not the one-dimensional token ids"):
        read_generated(path, 300)
    path.write_bytes(b"not numpy")
    with pytest.raises(ValueError, match="is not a numpy array file"):
        read_generated(path, 300)
    with pytest.raises(FileNotFoundError, match="is missing"):
        read_generated(tmp_path / "none.npy", 300)


def test_the_flag_is_checked():
    with pytest.raises(ValueError, match=r"generated_tokens=-1 must be a non-negative int"):
        FinetuneConfig(model="m", out="o", generated_tokens=-1)
    assert FinetuneConfig(model="m", out="o", generated_tokens=10, backend="jax").generated_tokens == 10
