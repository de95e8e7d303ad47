"""Quantize fixed rows with ggml's own C code and store its bytes and values as CI fixtures.

CI does not build llama-cpp-python, so this script runs ggml once, through ctypes on the ggml
library llama-cpp-python bundles (``ggml_quantize_chunk`` with no importance matrix, then the
type's ``to_float``), on the seeded rows of ``tests/test_ggml_quants.py`` (``fixture_rows``:
normal rows and the edge cases: zeros, constants, outliers, 1e-30 and 1e30 scales, subnormals,
negative maxima), for every ggml type ``mixle.gguf.ggml_quants`` emulates. It writes
``tests/fixtures/ggml_reference.npz``: the inputs, per type ggml's block bytes and dequantized
values, and the versions they came from. The normal suite then checks mixle's quantizers
against these bytes without llama.cpp.

    pip install llama-cpp-python==0.3.36    # builds llama.cpp from source
    python benchmarks/make_ggml_fixtures.py
"""

import argparse
import json
import os
import platform
import sys
from importlib import metadata

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.test_ggml_quants import (  # noqa: E402
    FIXTURE,
    GGML_TYPE_IDS,
    fixture_rows,
    ggml_dequantize,
    ggml_library,
    ggml_quantize,
)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=FIXTURE, help="the fixture file to write (default: %(default)s)")
    args = parser.parse_args(argv)
    lib = ggml_library()
    if lib is None:
        sys.exit("llama-cpp-python is not installed (its ggml library is the reference): pip install llama-cpp-python")
    names, inputs = fixture_rows()
    arrays = {"inputs": inputs, "row_names": np.array(names)}
    for ggml_type in GGML_TYPE_IDS:
        data = ggml_quantize(lib, ggml_type, inputs)
        arrays[f"{ggml_type}_bytes"] = data
        arrays[f"{ggml_type}_values"] = ggml_dequantize(lib, ggml_type, data, inputs.shape[1])
    meta = {
        "llama_cpp_python": metadata.version("llama-cpp-python"),
        "ggml_version": lib.ggml_version().decode(),
        "ggml_commit": lib.ggml_commit().decode(),
        "library": os.path.basename(lib._name),
        "machine": platform.machine(),
        "types": {name: number for name, number in GGML_TYPE_IDS.items()},
    }
    arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    np.savez_compressed(out, **arrays)
    print(f"wrote {args.out}: {len(names)} rows of {inputs.shape[1]}, {len(GGML_TYPE_IDS)} types, "
          f"{os.path.getsize(out) / 1024:.0f} KiB; {json.dumps(meta)}")


if __name__ == "__main__":
    main()
