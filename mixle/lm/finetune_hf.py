"""The finetune job's transformers checkpoint (``OUT/hf``) and the llama.cpp commands that rebuild its file.

QAT trains float master weights on the lattice a grid's quantizer makes of them; on llama.cpp's
grids that quantizer is ``llama-quantize``'s. So the QAT model's master weights, written as they
are (float32) by ``save_pretrained_float``, are a checkpoint that llama.cpp's own converter
(``convert_hf_to_gguf.py --outtype f32``: every value kept) and quantizer turn into the blocks QAT
trained, for any architecture the converter knows. ``llama_cpp_recipe`` says which
``llama-quantize`` flags give them for a run's target:

* a grid target (``q4_0``, ``q8_0``, ...): ``--pure`` (every matrix on the grid's type, as QAT
  trained every decoder matrix), and ``--token-embedding-type`` / ``--output-tensor-type`` set
  to ``--float-matrices``, the storage of the matrices QAT leaves float;
* a mix target (``Q4_K_M``, ...): the mix itself, which gives every matrix the type QAT trained;
* QAT trained with an importance matrix: ``--imatrix`` of that file (the weighted search).

An integer target (``int4``, ``int8``) has no llama.cpp block type, and MXFP4 no ``llama-quantize``
file type that puts it on dense matrices: the checkpoint is still written (the trained float
weights), and the recipe says why no command rebuilds the trained lattice.
"""

import os

from mixle.lm.finetune_baselines import IMATRIX_FILE

__all__ = ["HF_DIR", "PURE_FILE_TYPES", "llama_cpp_recipe", "check_hf_checkpoint", "write_hf_checkpoint"]

HF_DIR = "hf"
F32_FILE = "model-f32.gguf"
# ggml type of a grid -> the llama-quantize file type whose default type it is (with --pure, every matrix's).
PURE_FILE_TYPES = {"Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q8_0": "Q8_0",
                   "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M", "Q6_K": "Q6_K"}


def _imatrix_args(config):
    """``--imatrix FILE`` when QAT trained with an importance matrix (the run's ``imatrix.gguf`` or the
    given file), else nothing."""
    mode = config.importance_mode()
    if mode == "off" or not config.qat_imatrix:
        return []
    return ["--imatrix", IMATRIX_FILE if mode == "calibrate" else config.imatrix]


def llama_cpp_recipe(config):
    """The two llama.cpp commands that turn ``OUT/hf`` into the trained blocks, for a ``FinetuneConfig``.

    Returns:
        ``{"convert": argv, "quantize": argv, "file_type": ...}`` (paths relative to the run's
        output directory; ``convert`` runs from llama.cpp's source tree, prefix its path), or
        ``{"why": reason}`` when no ``llama-quantize`` file type rebuilds the trained lattice.

    >>> from mixle.lm.finetune_config import FinetuneConfig
    >>> " ".join(llama_cpp_recipe(FinetuneConfig(model="m", out="o"))["quantize"])
    'llama-quantize --pure --token-embedding-type q8_0 --output-tensor-type q8_0 model-f32.gguf model-Q4_0.gguf Q4_0'
    """
    mix = config.mix()
    if mix is not None:
        file_type, flags = mix, []
    else:
        spec = config.spec()
        ggml_type = spec.grid_record.ggml_type
        if ggml_type is None or ggml_type not in PURE_FILE_TYPES:
            why = (f"target {config.target!r} has no llama.cpp block type" if ggml_type is None else
                   f"no llama-quantize file type puts {ggml_type} on every dense matrix")
            return {"why": f"{why}: the checkpoint holds the trained float weights, which llama.cpp's tools do not "
                           f"quantize onto the lattice QAT trained"}
        stored = config.float_storage()
        file_type = PURE_FILE_TYPES[ggml_type]
        flags = ["--pure", "--token-embedding-type", stored, "--output-tensor-type", stored]
    convert = ["python", "convert_hf_to_gguf.py", HF_DIR, "--outtype", "f32", "--outfile", F32_FILE]
    quantize = ["llama-quantize", *flags, *_imatrix_args(config), F32_FILE, f"model-{file_type}.gguf", file_type]
    return {"convert": convert, "quantize": quantize, "file_type": file_type}


def check_hf_checkpoint(model, config):
    """Before training: refuse a float model ``save_pretrained_float`` could not write (unless the run
    skips the checkpoint), so the run cannot fail at its end.

    >>> check_hf_checkpoint  # doctest: +ELLIPSIS
    <function check_hf_checkpoint at ...>
    """
    if config.hf_checkpoint:
        from mixle.exports.hf_checkpoint import check_savable

        try:
            check_savable(model)
        except ValueError as err:
            raise ValueError(f"{err} (or pass --no-hf-checkpoint to skip the transformers checkpoint)") from None


def write_hf_checkpoint(student, config, tokenizer, out):
    """Write the QAT model's master weights (LoRA merged) and its tokenizer as ``out/hf``.

    Returns:
        results.json's ``hf`` entry: what ``save_pretrained_float`` wrote and ``llama_cpp_recipe``.

    >>> write_hf_checkpoint  # doctest: +ELLIPSIS
    <function write_hf_checkpoint at ...>
    """
    from mixle.exports.hf_checkpoint import save_pretrained_float

    written = save_pretrained_float(student, os.path.join(out, HF_DIR), tokenizer=tokenizer, overwrite=True)
    return {"directory": HF_DIR, **written, "llama_cpp": llama_cpp_recipe(config)}
