"""The Flax causal LM (Llama, Mistral, Qwen2) loaded from a transformers checkpoint computes
transformers' torch logits on the same weights, within float32 rounding."""

import json

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from mixle.lm.flax_causal_lm import CausalLMConfig, load_causal_lm  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
CASES = {
    "llama tied, GQA": (transformers.LlamaConfig, dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama 3 rope": (transformers.LlamaConfig, dict(num_key_value_heads=1, rope_theta=500000.0,
                                                    rope_scaling=LLAMA3_ROPE)),
    "mistral": (transformers.MistralConfig, dict(num_key_value_heads=2, sliding_window=None)),
    "qwen2 biases": (transformers.Qwen2Config, dict(num_key_value_heads=2, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers_on_the_same_weights(case, tmp_path):
    config_class, fields = CASES[case]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**COMMON, **fields), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1 and biases away from 0: every weight matters
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    ids = np.random.default_rng(1).integers(0, COMMON["vocab_size"], (2, 24))
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).logits.numpy()
    got = np.asarray(load_causal_lm(tmp_path)(jnp.asarray(ids)))
    # float32 sums of at most 96 products, over 2 layers, in another order than torch's
    bound = 8 * 96 * np.finfo(np.float32).eps * np.abs(want).max()
    assert np.abs(got - want).max() <= bound, (np.abs(got - want).max(), bound)
    assert np.abs(want).max() > 0.1  # not a trivially small output


def test_checkpoints_that_do_not_fit_are_refused_naming_the_tensor(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, num_key_value_heads=2)).eval()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
    with pytest.raises(ValueError, match=r"tensor 'layers.0.mlp.gate_proj.weight' has shape \[96, 64\], the config "
                                         r"needs \[80, 64\]"):
        load_causal_lm(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match=r"model_type='gpt_neox'"):
        load_causal_lm(tmp_path)
    with pytest.raises(ValueError, match="rope_scaling"):
        CausalLMConfig.from_dict({**config, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="sliding_window=16"):
        CausalLMConfig.from_dict({**config, "sliding_window": 16})
