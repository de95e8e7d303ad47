"""The README's Python examples run as written, with the placeholders they name filled in here.

Each block runs in a fresh namespace holding only its placeholders, so a README example that stops
working (a renamed function, a changed default, an assertion that no longer holds) fails CI.
"""

import pathlib
import re
import textwrap

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.rst"
BLOCK = re.compile(r"^\.\. code-block:: python\n\n((?:    .*\n|\n)+)", re.M)

TORCH_MLP = """
import torch, mixle
torch.manual_seed(0)
def make_float_model():
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
float_model = make_float_model()
model = mixle.apply_qat(make_float_model(), bits=4, group_size=32)
"""
FLAX_MLP = """
import jax.numpy as jnp, mixle
from flax import nnx
class MLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(48, 64, rngs=rngs), nnx.Linear(64, 16, rngs=rngs)])
    def __call__(self, x):
        return self.layers[1](nnx.relu(self.layers[0](x)))
def make_nnx_model():
    return MLP(nnx.Rngs(1))
nnx_model = model = make_nnx_model()
x = jnp.ones((4, 48), jnp.float32)
"""
GGUF_SETUP = """
from mixle.lm.data import CharTokenizer
tokenizer = CharTokenizer(bytes(range(256)).decode("latin-1"))
"""
HF_LLAMA = """
import torch, mixle
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
model = mixle.apply_qat(LlamaForCausalLM(config), bits=4, group_size=32)
tokenizer = None
"""
RECOVERY = TORCH_MLP + """
model = make_float_model()
from mixle.lm.training import window_density  # what GradLeaf trains: windows of a token stream
module = window_density(mixle.build_causal_lm(vocab=16, d_model=16, n_layer=1, n_head=2, block=8),
                        torch.randint(0, 16, (64,)))
"""
IMATRIX = """
import torch, mixle
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
model = LlamaForCausalLM(config)
calibration_batches = [torch.randint(0, 128, (4, 32)) for _ in range(2)]
"""

# (a line that identifies the block, the packages it needs, its placeholders)
CASES = (
    ("optimizer = torch.optim.AdamW(model.parameters())", ("torch",), ""),
    ("int4_model = mixle.convert(model.eval())", ("torch",), TORCH_MLP),
    ("mixle.apply_qat(nnx_model, bits=4", ("torch", "flax", "qwix"), FLAX_MLP),
    ("model = mixle.apply_lora(mixle.apply_qat(model", ("torch",),
     "import torch, mixle\nmodel = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))\n"),
    ("act_bits=8, act_symmetric=False)", ("torch",), RECOVERY),
    ("from transformers import LlamaConfig, LlamaForCausalLM", ("torch", "transformers"), ""),
    ("mixle.save_pretrained_compressed(model", ("torch", "transformers", "compressed_tensors"), HF_LLAMA),
    ("mixle.save_gguf(lm", ("torch", "gguf"), GGUF_SETUP),
    ("imatrix = mixle.calibrate_importance(model, calibration_batches)", ("torch", "transformers", "gguf"), IMATRIX),
    ("DistributedDataParallel(model)", ("torch",), ""),
    ("mesh = jax.make_mesh", ("flax", "qwix"), FLAX_MLP),
)


def blocks():
    return [textwrap.dedent(body) for body in BLOCK.findall(README.read_text())]


def test_every_python_block_has_a_case():
    keys = [key for key, _, _ in CASES]
    for code in blocks():
        owners = [key for key in keys if key in code]
        assert len(owners) == 1, f"README block without exactly one case here:\n{code[:300]}"


@pytest.mark.parametrize("key, packages, setup", CASES, ids=[c[0][:40] for c in CASES])
def test_readme_block_runs(key, packages, setup, tmp_path, monkeypatch):
    for package in packages:
        pytest.importorskip(package)
    (code,) = [code for code in blocks() if key in code]
    monkeypatch.chdir(tmp_path)  # the examples write their files into the working directory
    if "init_process_group" in code:
        for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}.items():
            monkeypatch.setenv(name, value)
    namespace = {"__name__": "readme"}
    exec(compile(setup, "setup", "exec"), namespace)
    try:
        exec(compile(code, f"README block {key!r}", "exec"), namespace)
    finally:
        if "init_process_group" in code:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
