"""Run llama.cpp's converter and quantizer on mixle's transformers checkpoint of a QAT-trained StableLM (an
architecture ``save_gguf`` does not write) and store the hashes of the blocks they made as a CI fixture
(``tests/fixtures/hf_llama_cpp_reference.json``).

For each llama-quantize file type of ``tests/test_hf_llama_cpp.py`` (``GRIDS``: Q4_0, Q8_0) the seeded tiny
StableLM is QAT-trained on that grid (``trained``), written by ``save_pretrained_float`` (the finetune job's
``hf/``), converted by llama.cpp's own ``convert_hf_to_gguf.py --outtype f32`` (with a stand-in vocabulary:
the tokenizer is not compared) and quantized by ``llama-quantize --pure``. The fixture holds, per file type,
every quantized tensor's type, shape and the sha256 of its blocks, and the sha256 of the float32 weights
that were converted; a few KB. The normal suite recomputes mixle's blocks of the same training and compares.

CI cannot build llama.cpp, so this script does, once: with ``--source`` (a llama.cpp tree holding
``convert_hf_to_gguf.py``) and ``--build-dir`` (holding ``bin/llama-quantize``) it uses those; otherwise it
downloads llama-cpp-python's sdist and builds the tools (``benchmarks/make_arch_fixtures.py``'s ``sdist_tools``).

    python benchmarks/make_hf_llama_cpp_fixtures.py [--source DIR --build-dir /tmp/llbuild]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from importlib import metadata

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.make_arch_fixtures import sdist_tools  # noqa: E402
from benchmarks.make_imatrix_fixtures import SDIST  # noqa: E402
from tests.test_hf_llama_cpp import (ARCHITECTURE, CONFIG, FIXTURE, GRIDS, LR, SEED, STEPS, llama_cpp_file,  # noqa: E402
                                     quantized_tensors, trained, weights_digest)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", help="a llama.cpp tree with convert_hf_to_gguf.py (default: the sdist's)")
    parser.add_argument("--build-dir", help="a llama.cpp build with bin/llama-quantize (default: build one)")
    parser.add_argument("--out", default=FIXTURE, help="the fixture file to write (default: %(default)s)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        source, build = (args.source, args.build_dir) if args.source and args.build_dir else sdist_tools(tmp)
        version = subprocess.run([os.path.join(build, "bin", "llama-quantize"), "--version"], capture_output=True,
                                 text=True)
        reference = {"llama_cpp_python_sdist": SDIST, "llama_cpp_version": (version.stdout + version.stderr).strip(),
                     "torch": metadata.version("torch"), "transformers": metadata.version("transformers"),
                     "architecture": ARCHITECTURE, "config": CONFIG, "seed": SEED, "steps": STEPS, "lr": LR,
                     "cases": {}}
        for file_type in sorted(GRIDS):
            directory = os.path.join(tmp, file_type)
            os.makedirs(directory)
            model = trained(file_type)
            path = llama_cpp_file(model, file_type, directory, source, build)
            tensors = quantized_tensors(path)
            reference["cases"][file_type] = {"weights_sha256": weights_digest(model), "tensors": tensors}
            print(f"{file_type}: {len(tensors)} quantized tensors")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(reference, handle, indent=1, sort_keys=True)
        handle.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")


if __name__ == "__main__":
    main()
