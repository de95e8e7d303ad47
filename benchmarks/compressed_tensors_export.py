"""compressed-tensors export: logits parity and checkpoint sizes, per model and scheme.

For small random-init Llama and Qwen2 models (tied and untied embeddings), each scheme is trained
for one QAT step, written with ``save_pretrained_compressed`` and loaded back twice: by
``transformers.AutoModelForCausalLM.from_pretrained`` (compressed-tensors decompresses it) and by
``load_pretrained_compressed`` (mixle QuantizedLinear layers). It prints the largest logit
difference of each against the QAT model's fake-quant forward, and the safetensors bytes next to
the float model's own ``save_pretrained`` checkpoint.

    python benchmarks/compressed_tensors_export.py            # about a minute on one CPU thread
    python benchmarks/compressed_tensors_export.py --dtype bfloat16
"""

import argparse
import glob
import os
import platform
import tempfile

import torch
import transformers

from mixle.api import apply_qat
from mixle.exports.compressed_tensors import load_pretrained_compressed, save_pretrained_compressed

ARCHS = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}
SCHEMES = {"int4 channel": dict(bits=4), "int4 group32": dict(bits=4, group_size=32),
           "int8 channel": dict(bits=8), "int8 group32": dict(bits=8, group_size=32)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    return p.parse_args(argv)


def build(arch, tied, args):
    config = ARCHS[arch](vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=128, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).eval()


def safetensors_bytes(directory):
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(directory, "*.safetensors")))


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    ids = torch.randint(0, args.vocab, (2, 32), generator=torch.Generator().manual_seed(1))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, 1 thread, {platform.processor() or platform.machine()}")
    print(f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.dtype}, logits of 2 x 32 tokens")
    print(f"{'model':<14} {'scheme':<13} {'max|dlogit| HF':>15} {'max|dlogit| mixle':>18} {'float MB':>9} "
          f"{'compressed MB':>14} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            for tied in (True, False):
                name = f"{arch} {'tied' if tied else 'untied'}"
                float_dir = os.path.join(tmp, f"{arch}-{tied}-float")
                build(arch, tied, args).save_pretrained(float_dir)
                float_bytes = safetensors_bytes(float_dir)
                for scheme, fields in SCHEMES.items():
                    qat = apply_qat(build(arch, tied, args), **fields)
                    optimizer = torch.optim.SGD(qat.parameters(), lr=0.01)
                    qat.train()
                    qat(ids, labels=ids).loss.backward()
                    optimizer.step()
                    qat.eval()
                    with torch.no_grad():
                        want = qat(ids).logits
                    out = os.path.join(tmp, f"{arch}-{tied}-{scheme.replace(' ', '-')}")
                    save_pretrained_compressed(qat, out)
                    with torch.no_grad():
                        hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
                        ours = load_pretrained_compressed(out).eval()(ids).logits
                    size = safetensors_bytes(out)
                    print(f"{name:<14} {scheme:<13} {(hf - want).abs().max().item():>15.3g} "
                          f"{(ours - want).abs().max().item():>18.3g} {float_bytes / 1e6:>9.2f} {size / 1e6:>14.2f} "
                          f"{float_bytes / size:>5.2f}x")


if __name__ == "__main__":
    main()
