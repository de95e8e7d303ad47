"""Run llama.cpp's converter on a tiny Gemma 3 checkpoint with a SentencePiece tokenizer and store
the ``tokenizer.*`` keys it writes as a CI fixture (``tests/fixtures/sentencepiece_reference.json``).

``tests/test_gguf_sentencepiece.py`` trains the SentencePiece model (``train_tokenizer_model``) and
lays out the checkpoint (``gemma_directory``); this script runs llama.cpp's own
``convert_hf_to_gguf.py --vocab-only`` on it and stores the model (base64, so that the test does not
depend on how another sentencepiece release trains) with every key, value and value type the
converter wrote; about 30 KB. The normal suite writes mixle's file of the same directory and compares.

The converter is found as the tests find it (``--source``, ``MIXLE_LLAMA_CPP_SOURCE`` or the
llama-cpp-python sdist unpacked under ``/tmp/llsdist``); it needs torch, transformers and sentencepiece.

    python benchmarks/make_sentencepiece_fixture.py [--source DIR]
"""

import argparse
import base64
import json
import os
import sys
import tempfile
from importlib import metadata

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.make_imatrix_fixtures import SDIST  # noqa: E402
from tests.test_gguf_sentencepiece import (  # noqa: E402
    FIXTURE, converter_keys, gemma_directory, llama_cpp_source, train_tokenizer_model)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=llama_cpp_source(),
                        help="a llama.cpp tree with convert_hf_to_gguf.py (default: %(default)s)")
    parser.add_argument("--out", default=FIXTURE, help="the fixture file to write (default: %(default)s)")
    args = parser.parse_args(argv)
    if not args.source or not os.path.isfile(os.path.join(args.source, "convert_hf_to_gguf.py")):
        parser.error(f"--source={args.source!r} holds no convert_hf_to_gguf.py: unpack llama-cpp-python's sdist "
                     f"({SDIST}) and pass its vendor/llama.cpp")
    model = train_tokenizer_model()
    with tempfile.TemporaryDirectory() as tmp:
        gemma_directory(os.path.join(tmp, "gemma3"), model)
        keys = converter_keys(args.source, os.path.join(tmp, "gemma3"), os.path.join(tmp, "vocab.gguf"))
    reference = {"llama_cpp_python_sdist": SDIST, "sentencepiece": metadata.version("sentencepiece"),
                 "transformers": metadata.version("transformers"),
                 "tokenizer_model_base64": base64.b64encode(model).decode("ascii"), "keys": keys}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(reference, handle, indent=1, ensure_ascii=False)
        handle.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes, {len(keys['tokenizer.ggml.tokens'][1])} tokens)")


if __name__ == "__main__":
    main()
