"""The Flax backend: QAT through Qwix on NNX and Linen models."""
