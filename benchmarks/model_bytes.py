"""Real storage bytes of quantized models (fp32 vs int8 vs packed int4) and convert-vs-fake-quant error.

Run: python benchmarks/model_bytes.py
"""

import os
import tempfile

import torch
from torch import nn

from mixle.models.qat import apply_qat
from mixle.models.transformer import build_causal_lm
from mixle.task.quantize import convert, model_nbytes, save_quantized


def quantized_layer_fp32_bytes(model):
    """fp32 bytes of the weights the QAT/convert path quantizes (Linear weights, ties counted once)."""
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(w.numel() * 4 for w in weights.values())


def measure(name, model, batch, spec):
    fp32_total = model_nbytes(model).total
    fp32_layers = quantized_layer_fp32_bytes(model)
    qat = apply_qat(model, **spec)
    opt = torch.optim.SGD(qat.parameters(), lr=1e-2)
    for _ in range(3):  # a few QAT steps so weights are not at their initial values
        opt.zero_grad()
        qat(batch).float().square().mean().backward()
        opt.step()
    qat.eval()
    converted = convert(qat)
    with torch.no_grad():
        error = (converted(batch) - qat(batch)).abs().max().item()
    nbytes = model_nbytes(converted)
    codes = nbytes.int4_code_bytes + nbytes.int8_code_bytes
    ideal = fp32_layers * spec["bits"] / 32 + nbytes.scale_bytes
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        save_quantized(converted, path)
        file_bytes = os.path.getsize(path)
    label = ",".join(f"{k}={v}" for k, v in spec.items())
    print(
        f"{name:<30} {label:<20} {fp32_total:>10,} {fp32_layers:>10,} {codes:>9,} {nbytes.scale_bytes:>7,} "
        f"{(codes + nbytes.scale_bytes) / ideal:>7.4f} {nbytes.float_bytes:>8,} {nbytes.total:>9,} "
        f"{file_bytes:>9,} {error:>9.2e}"
    )


def main():
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(
        f"{'model':<30} {'spec':<20} {'fp32 model':>10} {'fp32 qlay':>10} {'codes':>9} {'scales':>7} "
        f"{'ratio':>7} {'float':>8} {'total':>9} {'file':>9} {'max err':>9}"
    )
    print("(bytes; ratio = (codes + scales) / (fp32 quantized-layer bytes * bits/32 + scales); "
          "max err = max |convert(model) - fake-quant model| output)")
    for spec in ({"bits": 4}, {"bits": 4, "group_size": 32}, {"bits": 8}):
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 64))
        measure("MLP 256-512-64", mlp, torch.randn(32, 256), spec)
        torch.manual_seed(0)
        lm = build_causal_lm(256, d_model=128, n_layer=3, n_head=4, block=64)
        measure("build_causal_lm V256 D128 L3", lm, torch.randint(0, 256, (4, 64)), spec)


if __name__ == "__main__":
    main()
