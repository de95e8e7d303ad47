"""Writers of other runtimes' model files (compressed-tensors for transformers / vLLM), on top of
the torch backend. llama.cpp's GGUF lives in ``mixle.gguf``; its old module paths here
(``mixle.exports.gguf``, ``ggml_blocks``, ``gguf_layouts``, ...) give that room's names.

Each writer imports its file-format package lazily, through ``mixle._optional.require``.
"""
