"""``mixle finetune`` on the architectures of ``mixle.gguf.architectures`` beyond Llama and Qwen2: a
tiny Gemma 3, Qwen3 and Phi-3 directory (with a byte-level BPE tokenizer) to a Q4_0 GGUF whose
loss, read back from the file, is the QAT row's. The layouts themselves are checked against
llama.cpp's converter in ``tests/test_gguf_architectures.py``."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from mixle.gguf.writer import load_gguf_weights  # noqa: E402
from mixle.lm import cli  # noqa: E402
from mixle.lm.data import default_text  # noqa: E402
from tests.test_finetune import FAST, byte_level_tokenizer, cross_entropy, held_out  # noqa: E402

TOKENS = dict(pad_token_id=0, bos_token_id=0, eos_token_id=0)
# case -> (transformers family, config fields): rows of 64 (Q4_0 blocks of 32).
FAMILIES = {
    "gemma3": ("Gemma3", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, **TOKENS)),
    "qwen3": ("Qwen3", dict(head_dim=16, tie_word_embeddings=True)),
    "phi3": ("Phi3", dict(**TOKENS)),
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune_arch")
    text = default_text()[:24000]
    tokenizer = byte_level_tokenizer(text[:12000])
    (root / "data.txt").write_text(text[:16000])
    paths = {"root": root, "data": root / "data.txt", "tokenizer": tokenizer}
    for case, (family, fields) in FAMILIES.items():
        torch.manual_seed(0)
        config_class = transformers.Gemma3TextConfig if family == "Gemma3" else getattr(transformers, f"{family}Config")
        config = config_class(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **fields)
        model = getattr(transformers, f"{family}ForCausalLM")(config)
        model.save_pretrained(root / case)
        tokenizer.save_pretrained(root / case)
        paths[case] = root / case
    return paths


@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_finetune_writes_the_architecture_as_llama_cpp_reads_it(case, assets, tmp_path, capsys):
    out = tmp_path / "run"
    status = cli.main(["finetune", "--model", str(assets[case]), "--data", str(assets["data"]), "--out", str(out),
                       "--target", "Q4_0", "--steps", "2", *FAST])
    assert status == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    rows = {row["method"]: row for row in results["rows"]}
    reader = gguf.GGUFReader(out / "model.gguf")
    arch = reader.fields["general.architecture"].contents()
    assert arch == {"gemma3": "gemma3", "qwen3": "qwen3", "phi3": "phi3"}[case]
    float_model = transformers.AutoModelForCausalLM.from_pretrained(assets[case])
    from_file = load_gguf_weights(float_model, out / "model.gguf")
    assert rows["QAT"]["loss"] == pytest.approx(cross_entropy(from_file, held_out(assets, model=case)), rel=1e-5)
