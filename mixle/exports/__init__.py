"""Writers and readers of other runtimes' model files (GGUF, compressed-tensors), on top of the torch backend."""
