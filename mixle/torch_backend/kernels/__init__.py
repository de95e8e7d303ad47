"""The torch backend's runtime kernels: C++ compiled on first use, registered with the torch
dispatcher, loaded only from a private, verified cache, each with an exact torch-ops fallback.

``fused_cpu`` (the plain grids' fused fake-quant, ``fused_fake_quant.cpp``), ``packed_linear``
(converted layers' products straight from packed codes, ``packed_matmul.cpp``) and
``kernel_cache`` (building, verifying and loading them). llama.cpp's block kernels are
``mixle.torch_backend.fused_ggml``.
"""
