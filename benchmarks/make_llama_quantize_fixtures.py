"""Run llama.cpp's own quantizer on small seeded models and store what it chose as CI fixtures.

CI cannot build llama-cpp-python (about 13 minutes on 2 cores), so this script runs
``llama_cpp.llama_model_quantize`` once (``pure`` off, no importance matrix, one thread) for every
mix of ``mixle.gguf.mixes.GGUF_MIXES``, on:

* the seeded models of ``tests/test_gguf_mixes.py`` (``MODEL_CASES``: gpt2, llama and qwen2 with
  rows of 256 and of 32, 64, 96 and 40 values; ``MOE_CASES``: a Qwen3-MoE of 4 experts and an
  8-expert Mixtral, with 3-D expert tensors), written as F32 GGUF files by
  ``save_gguf(model, float_matrices="f32")``;
* files of given shapes only (``SHAPE_CASES``: SmolLM2-135M's 30 layers, a 4096-wide 30-layer
  Llama, 80-layer Llamas and Qwen2), for the types of real models' shapes.

It writes ``tests/fixtures/llama_quantize_reference.npz`` (a few tens of KB): one JSON ``meta`` with
the versions, and per case the sha256 of every float tensor of its F32 file and, per mix, the type
llama.cpp gave each tensor and the sha256 of its bytes. The normal suite checks
``tensor_types``, ``quantize_array`` + ``pack_array`` and ``save_gguf(..., gguf_mix=...)`` against
it, tensor by tensor.

    pip install llama-cpp-python==0.3.36    # the llama extra; builds llama.cpp from source
    python benchmarks/make_llama_quantize_fixtures.py
"""

import argparse
import json
import os
import sys
import tempfile
from importlib import metadata

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.test_ggml_quants import ggml_library  # noqa: E402
from tests.test_gguf_mixes import (  # noqa: E402
    FIXTURE,
    MIXES,
    MODEL_CASES,
    MOE_CASES,
    SHAPE_CASES,
    llama_quantize,
    read_tensors,
    sha,
    write_float_file,
    write_shape_file,
)


def quantized_case(source, tmp, case):
    """``{mix: {tensor: [type, sha256]}}`` of llama.cpp's quantizer on the GGUF at ``source``."""
    mixes = {}
    for mix in MIXES:
        target = os.path.join(tmp, f"{case}.{mix}.gguf")
        llama_quantize(source, target, mix)
        mixes[mix] = {name: [ggml_type, sha(data)] for name, (ggml_type, _, data) in read_tensors(target).items()}
        os.remove(target)
    return mixes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=FIXTURE, help="the fixture file to write (default: %(default)s)")
    args = parser.parse_args(argv)
    lib = ggml_library()
    meta = {"llama_cpp_python": metadata.version("llama-cpp-python"), "ggml_commit": lib.ggml_commit().decode(),
            "numpy": np.__version__, "torch": metadata.version("torch"),
            "transformers": metadata.version("transformers"), "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        builds = {case: record[0] for case, record in {**MODEL_CASES, **MOE_CASES}.items()}
        for case, build in builds.items():
            source = os.path.join(tmp, f"{case}.gguf")
            tensors = write_float_file(build(0), source)
            meta["cases"][case] = {"float": {name: sha(data) for name, (_, _, data) in tensors.items()},
                                   "mixes": quantized_case(source, tmp, case)}
            print(f"{case:16s} {len(tensors)} tensors")
        for case in SHAPE_CASES:
            source = os.path.join(tmp, f"{case}.gguf")
            write_shape_file(case, source)
            mixes = quantized_case(source, tmp, case)
            meta["cases"][case] = {"mixes": {mix: {name: [t] for name, (t, _) in types.items()}
                                             for mix, types in mixes.items()}}
            print(f"{case:16s} {len(mixes[MIXES[0]])} tensors (types only)")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    np.savez_compressed(args.out, meta=np.array(json.dumps(meta, sort_keys=True)))
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes) with llama-cpp-python {meta['llama_cpp_python']} "
          f"(ggml {meta['ggml_commit']})")


if __name__ == "__main__":
    main()
