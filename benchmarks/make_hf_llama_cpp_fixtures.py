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

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.make_arch_fixtures import tools_of, tools_parser, write_fixture  # noqa: E402
from tests.test_hf_llama_cpp import (ARCHITECTURE, CONFIG, FIXTURE, GRIDS, LR, SEED, STEPS, llama_cpp_file,  # noqa: E402
                                     quantized_tensors, trained, weights_digest)


def main(argv=None):
    args = tools_parser(__doc__.splitlines()[0], FIXTURE).parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        source, build, reference = tools_of(args, tmp)
        reference.update({"architecture": ARCHITECTURE, "config": CONFIG, "seed": SEED, "steps": STEPS, "lr": LR,
                          "cases": {}})
        for file_type in sorted(GRIDS):
            directory = os.path.join(tmp, file_type)
            os.makedirs(directory)
            model = trained(file_type)
            path = llama_cpp_file(model, file_type, directory, source, build)
            tensors = quantized_tensors(path)
            reference["cases"][file_type] = {"weights_sha256": weights_digest(model), "tensors": tensors}
            print(f"{file_type}: {len(tensors)} quantized tensors")
    write_fixture(reference, args.out)


if __name__ == "__main__":
    main()
