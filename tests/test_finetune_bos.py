"""Windows of a tokenizer that starts every text with BOS (Gemma's) start with it, as llama.cpp's
perplexity does: held-out, calibration and training windows alike."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from mixle.lm.finetune_baselines import calibration_windows  # noqa: E402
from mixle.lm.finetune_config import FinetuneConfig  # noqa: E402
from mixle.lm.finetune_data import bos_of, prepare_finetune_data  # noqa: E402
from mixle.lm.training import window_density  # noqa: E402
from mixle.lm.family import TRANSFORMERS  # noqa: E402

WORDS = ["<bos>", "<eos>"] + [f"w{i}" for i in range(20)]


def tokenizer(adds_bos):
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    if adds_bos:
        backend.post_processor = tokenizers.processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>")


def test_windows_start_with_the_bos_the_tokenizer_adds(tmp_path):
    words = [f"w{2 + (i * 7) % 18}" for i in range(400)]
    (tmp_path / "t.txt").write_text(" ".join(words))
    ids = np.array([WORDS.index(w) for w in words])
    config = FinetuneConfig(model="m", out=str(tmp_path / "o"), data=(str(tmp_path / "t.txt"),), block=8,
                            eval_windows=4, calibration_windows=3)
    plain = prepare_finetune_data(config, tokenizer(False), 64)
    with_bos = prepare_finetune_data(config, tokenizer(True), 64)
    assert bos_of(tokenizer(False)) is None and bos_of(tokenizer(True)) == 0
    assert plain.bos is None and with_bos.bos == 0 and (plain.train_ids == with_bos.train_ids).all()
    assert (with_bos.train_ids.numpy() == ids[:len(with_bos.train_ids)]).all()  # the text itself: no BOS inside
    for a, b in ((plain.eval_windows, with_bos.eval_windows), (plain.curve_windows, with_bos.curve_windows),
                 (calibration_windows(plain, config), calibration_windows(with_bos, config))):
        assert (b[:, 0] == 0).all() and (b[:, 1:] == a[:, 1:]).all() and (a[:, 0] != 0).all()
    assert plain.digest != with_bos.digest
    # Training windows: the same slices of the text, the first token replaced by BOS.
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=16,
                                                                   intermediate_size=32, num_hidden_layers=1,
                                                                   num_attention_heads=2, num_key_value_heads=1))
    starts = torch.tensor([3, 40])
    plain_windows = window_density(model, plain.train_ids, 8, TRANSFORMERS).windows(starts)
    bos_windows = window_density(model, with_bos.train_ids, 8, TRANSFORMERS, first=0).windows(starts)
    expected = torch.stack([plain.train_ids[s:s + 9] for s in starts.tolist()])
    assert torch.equal(plain_windows, expected) and torch.equal(bos_windows[:, 1:], expected[:, 1:])
    assert (bos_windows[:, 0] == 0).all()
