"""Run llama.cpp on small save_gguf files and store its logits as CI fixtures.

CI cannot build llama-cpp-python (about 13 minutes on 2 cores), so this script runs it once, on
the cases of ``tests/gguf_parity_cases.py``, and writes ``tests/fixtures/llama_cpp_parity.npz``:
for each case llama.cpp's logits of the fixed token ids, mixle's logits at the time, the measured
max |difference|, and the type, shape and sha256 of every tensor of the file llama.cpp ran. The
normal suite (``tests/test_gguf_parity_fixtures.py``) then checks that today's ``save_gguf``
writes the same tensors and that mixle's forward still matches llama.cpp's logits.

    pip install llama-cpp-python==0.3.36    # the llama extra; builds llama.cpp from source
    python benchmarks/make_llama_cpp_fixtures.py
    python benchmarks/make_llama_cpp_fixtures.py --only mixtral_q4_0_act8   # add or redo some cases
"""

import argparse
import json
import os
import sys
import tempfile
from importlib import metadata

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.gguf_parity_cases import CASES, FIXTURE, IDS, save_options, tensor_digests  # noqa: E402
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py, beside this script)


def llama_cpp_logits(path):
    """llama.cpp's logits of IDS for the GGUF at ``path`` (F32 KV cache, one thread)."""
    from mixle.lm.llama_cpp_eval import require_llama_cpp

    llama_cpp = require_llama_cpp("benchmarks/make_llama_cpp_fixtures.py")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=16, logits_all=True, n_threads=1, type_k=0, type_v=0,
                          verbose=False)
    llm.eval(IDS)
    return np.array(llm.scores[: len(IDS)], dtype=np.float32)




def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=FIXTURE, help="the fixture file to write (default: %(default)s)")
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), help="run these cases only, keeping the "
                        "others of the existing fixture as they are")
    args = parser.parse_args(argv)
    import mixle

    arrays, meta = {}, {"llama_cpp_python": metadata.version("llama-cpp-python"), "cpu": cpu_name(),
                        "torch": metadata.version("torch"), "cases": {}}
    if args.only:
        with np.load(args.out) as old:
            arrays = {key: old[key] for key in old.files if key != "meta"}
            meta["cases"] = json.loads(str(old["meta"]))["cases"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, (build, options, logits_of, _) in CASES.items():
            if args.only and name not in args.only:
                continue
            model = build()
            path = os.path.join(tmp, f"{name}.gguf")
            mixle.save_gguf(model, path, **save_options(options, model))
            ours, theirs = logits_of(model), llama_cpp_logits(path)
            gap = float(np.abs(ours - theirs).max())
            arrays[f"{name}.llama_cpp"], arrays[f"{name}.mixle"] = theirs, ours
            meta["cases"][name] = {"max_abs_diff": gap, "tensors": tensor_digests(path)}
            print(f"{name:16s} max |mixle - llama.cpp| = {gap:.3g}  (|logit| max {np.abs(theirs).max():.2f})")
    arrays["meta"] = np.array(json.dumps(meta, indent=1))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes) with llama-cpp-python {meta['llama_cpp_python']} "
          f"on {meta['cpu']}")


if __name__ == "__main__":
    main()
