"""The PyTorch backend: QAT layers, fake-quant and its kernels, convert/PTQ, save/load, LoRA."""
