"""Old path of ``mixle.gguf.mix_selection`` (llama.cpp's room): its names, for the imports users have."""

import importlib


def __getattr__(name):
    return getattr(importlib.import_module("mixle.gguf.mix_selection"), name)
