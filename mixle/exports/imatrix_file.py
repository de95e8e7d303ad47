"""Old path of ``mixle.gguf.imatrix_file`` (llama.cpp's room): its names, for the imports users have."""

import importlib


def __getattr__(name):
    return getattr(importlib.import_module("mixle.gguf.imatrix_file"), name)
