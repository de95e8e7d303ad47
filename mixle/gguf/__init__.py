"""llama.cpp in one room: everything mixle knows of GGUF files and llama-quantize.

* ``formats``: llama.cpp's block types as format records (``mixle.core.grids.Grid``), with their
  numerics (``ggml_quants``, ``ggml_kquants``: ggml's reference quantizers bit for bit) and
  importance-weighted searches (``ggml_weighted``); framework-free, and registered by ``import mixle``.
* ``blocks``: ggml's block layouts, packed from mixle's stored arrays.
* ``mixes``: llama-quantize's mixes (``Q4_K_M``, ...): the type it gives each tensor.
* ``architectures``: one record per transformers decoder (llama.cpp architecture, converter metadata,
  tensor transforms, refusals); ``layouts``: how a model's weights become a GGUF file's tensors,
  named through gguf-py's own tensor-name maps.
* ``plan``: the plan of a model's file, built once: its layout, tensor shapes, the matrices an
  importance matrix covers, the types a mix gives them.
* ``imatrix_file``: llama.cpp's importance-matrix files, and importance by layer or by tensor.
* ``file``, ``tokenizer``, ``vocab``: reading a GGUF file safely, its tokenizer keys.
* ``writer`` (``save_gguf``, ``gguf_mix_types``, ``gguf_mix_specs``) and ``reader``
  (``load_gguf_weights``).
* ``mix_selection``: the QAT selection a mix gives (``apply_qat(gguf_mix=)``).

Importing this package imports none of them; torch and gguf-py are imported by the modules that
need them. The torch side of writing a file (the model's weights as numpy arrays and stored arrays)
is ``mixle.torch_backend.gather``, called once per file.
"""
