"""Scaled token embeddings (Gemma's): an ``nn.Embedding`` whose lookups are multiplied by ``embed_scale``.

transformers' Gemma 2 / Gemma 3 embed tokens with ``*ScaledWordEmbedding``: ``nn.Embedding``'s
lookup times a non-persistent ``embed_scale`` buffer (``sqrt(hidden_size)``) cast to the weight's
dtype. Wrapped as a plain ``QATEmbedding`` (or converted to a ``QuantizedEmbedding``) the scale
would be dropped, so these layers keep it: the QAT layer shares the float layer's buffer, the
quantized one keeps its value (saved in the manifest as the ``embedding_scale`` option). mixle never imports
transformers: such a module is recognised by its class name and its ``embed_scale``.
"""

import torch
from torch import nn

from mixle.torch_backend.layers.qat import QATEmbedding
from mixle.torch_backend.layers.quantized import QuantizedEmbedding

__all__ = ["ScaledEmbeddingType", "QATScaledEmbedding", "QuantizedScaledEmbedding", "wrap_scaled_embedding",
           "is_scaled_embedding"]


def is_scaled_embedding(module):
    """Whether ``module`` is a transformers ``*ScaledWordEmbedding`` (an Embedding times ``embed_scale``).

    >>> is_scaled_embedding(nn.Embedding(4, 2))
    False
    """
    return (isinstance(module, nn.Embedding) and type(module).__name__.endswith("ScaledWordEmbedding")
            and isinstance(getattr(module, "embed_scale", None), torch.Tensor))


class _ScaledEmbeddingType(type):
    def __instancecheck__(cls, instance):
        return is_scaled_embedding(instance)


class ScaledEmbeddingType(metaclass=_ScaledEmbeddingType):
    """Stands for transformers' ``*ScaledWordEmbedding`` classes in a layer kind's ``float_types``."""

    @staticmethod
    def base_of(module):
        """The float class whose forward the QAT layer reproduces: the module's own."""
        return type(module)


def _scaled(rows, scale):
    return rows * scale.to(rows.dtype)


class QATScaledEmbedding(QATEmbedding):
    """A ``QATEmbedding`` whose lookups are multiplied by the embedding's ``embed_scale`` (shared
    buffer), as the transformers module's forward does, fake-quant on or off."""

    def __init__(self, embedding, spec, *, enabled=True):
        super().__init__(embedding, spec, enabled=enabled)
        self.register_buffer("embed_scale", embedding.embed_scale, persistent=False)

    @property
    def embedding_scale(self):
        """The scale as a number (what a converted layer stores)."""
        return float(self.embed_scale)

    def forward(self, x):
        return _scaled(super().forward(x), self.embed_scale)


class QuantizedScaledEmbedding(QuantizedEmbedding):
    """A ``QuantizedEmbedding`` whose lookups are multiplied by ``embedding_scale`` (a float32 scalar)."""

    KIND = "scaled_embedding"

    def __init__(self, codes, scale, spec, weight_shape, embedding_scale=1.0, **options):
        super().__init__(codes, scale, spec, weight_shape, **options)
        self.embedding_scale = float(embedding_scale)  # an option, not a stored tensor

    def forward(self, x):
        rows = super().forward(x)
        return _scaled(rows, torch.tensor(self.embedding_scale, dtype=torch.float32, device=rows.device))


def wrap_scaled_embedding(module, spec, enabled):
    """The QAT layer of a scaled embedding (sharing its weight and scale)."""
    return QATScaledEmbedding(module, spec, enabled=enabled)
