"""Writers of other runtimes' model files (e.g. llama.cpp's GGUF), on top of the torch backend.

Each writer imports its file-format package lazily, through ``mixle._optional.require``.
"""
