"""The torch backend's layers: the QAT wrappers and the quantized (integer-storage) layers.

``qat`` (``QATWrapper``, ``QATEmbedding``: the fake-quant forward of a float layer), the other layer
kinds' QAT and quantized forms (``conv_layers``, ``hf_layers``, ``mha_layers``, ``expert_layers``),
``quantized`` (``QuantizedLinear``, ``QuantizedEmbedding``), ``activations``, ``learned_scale``,
``lora`` (the LoRA layer) and ``layer_kinds`` (the table that says how each kind is wrapped,
converted and saved).
"""
