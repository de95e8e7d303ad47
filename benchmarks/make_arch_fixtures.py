"""Run llama.cpp's converter and quantizer on a tiny model of every dense decoder architecture and
store what they made as CI fixtures (``tests/fixtures/arch_reference.json``).

For each case of ``tests/test_gguf_architectures.py`` (``CASES``: Llama, Llama tied with attention
biases, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3, OLMo2, SmolLM3; two to six layers, rows of 256)
the seeded float model is saved as a transformers checkpoint, converted by llama.cpp's own
``convert_hf_to_gguf.py`` to F32 (with a minimal vocabulary: the tokenizer is not compared) and
quantized by ``llama-quantize`` to each mix of ``MIXES``. The fixture holds, per case and mix, every
tensor's type, shape and sha256 and the inference metadata (``<arch>.*`` keys, file type); a few tens
of KB. The normal suite writes mixle's file of the same seed and compares.

CI cannot build llama.cpp, so this script does, once: with ``--source`` (a llama.cpp tree holding
``convert_hf_to_gguf.py``) and ``--build-dir`` (holding ``bin/llama-quantize``) it uses those;
otherwise it downloads llama-cpp-python's sdist and builds the tools with cmake, without native CPU
detection (``benchmarks/make_imatrix_fixtures.py``'s ``build_tools``).

    python benchmarks/make_arch_fixtures.py [--source DIR --build-dir /tmp/llbuild]
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from importlib import metadata

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.make_imatrix_fixtures import SDIST, build_tools  # noqa: E402
from tests.test_gguf_architectures import CASES, FIXTURE, MIXES, llama_cpp_files, summary  # noqa: E402


def sdist_tools(work):
    """``(llama.cpp source, build dir)``: llama-cpp-python's sdist unpacked in ``work``, tools built from it."""
    build = build_tools(work)
    return glob.glob(os.path.join(work, "llama_cpp_python-*", "vendor", "llama.cpp"))[0], build


def tools_parser(description, fixture):
    """The command line of a fixture script that runs llama.cpp's converter and quantizer."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--source", help="a llama.cpp tree with convert_hf_to_gguf.py (default: the sdist's)")
    parser.add_argument("--build-dir", help="a llama.cpp build with bin/llama-quantize (default: build one)")
    parser.add_argument("--out", default=fixture, help="the fixture file to write (default: %(default)s)")
    return parser


def tools_of(args, work):
    """``(source, build, reference header)``: the given tools or the sdist's built in ``work``, and the
    versions a fixture records."""
    source, build = (args.source, args.build_dir) if args.source and args.build_dir else sdist_tools(work)
    version = subprocess.run([os.path.join(build, "bin", "llama-quantize"), "--version"], capture_output=True,
                             text=True)
    return source, build, {"llama_cpp_python_sdist": SDIST, "llama_cpp_version": (version.stdout + version.stderr).strip(),
                           "torch": metadata.version("torch"), "transformers": metadata.version("transformers")}


def write_fixture(reference, out):
    """Write ``reference`` as the JSON fixture ``out``."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as handle:
        json.dump(reference, handle, indent=1, sort_keys=True)
        handle.write("\n")
    print(f"wrote {out} ({os.path.getsize(out)} bytes)")


def main(argv=None):
    args = tools_parser(__doc__.splitlines()[0], FIXTURE).parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        source, build, reference = tools_of(args, tmp)
        reference.update({"mixes": list(MIXES), "cases": {}})
        for case in CASES:
            directory = os.path.join(tmp, case)
            os.makedirs(directory)
            files = llama_cpp_files(case, directory, source, build)
            reference["cases"][case] = {mix: summary(path) for mix, path in files.items()}
            print(f"{case:16s} {len(reference['cases'][case][MIXES[0]]['tensors'])} tensors, {len(MIXES)} mixes")
    write_fixture(reference, args.out)


if __name__ == "__main__":
    main()
