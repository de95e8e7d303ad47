#!/usr/bin/env bash
# `mixle finetune --backend jax` on the lent TPU machine, for a model larger than one call's 64 MiB:
# the model travels in parts over several calls of one warm machine and is put together there.
#
# Here (the repository root; LLAMA_LIBS: a folder of libllama.so and libggml*.so built for x86-64
# without AVX-512, LLAMA_PY: the folder holding llama-cpp-python's llama_cpp package):
#   bash benchmarks/tpu_finetune.sh --prepare MODEL.gguf SIZE_MB...   # .tpu-m1, .tpu-m2, ...: parts of these sizes
#                                                                     # (the last takes the rest); .whl-tpu, .whl-hf:
#                                                                     # the wheels; .tpu-llama: llama.cpp's libraries,
#                                                                     # its bindings and their needs, LICENSE.txt
# There (each call carries what it names, --run .tpu-llama; $OUT set):
#   bash benchmarks/tpu_finetune.sh --install         # .whl-tpu + .whl-hf wheels, torch and matplotlib of the machine
#   bash benchmarks/tpu_finetune.sh --receive DIR     # DIR's part into /tmp/mixle-model
#   bash benchmarks/tpu_finetune.sh --run TAG ARGS... # checks the put-together model's sha256, then runs
#                                                     # python -m mixle finetune --backend jax --model it --out
#                                                     # /tmp/ft-TAG ARGS, stopped by SIGTERM after $LIMIT seconds
#                                                     # (default 540: it writes its checkpoint); run again, the
#                                                     # same command resumes it (--resume /tmp/ft-TAG). $OUT gets
#                                                     # TAG-results.json, -table.txt, -finetune.png and -log.txt
# The first call carries .whl-tpu, .whl-hf and .tpu-m1 (with SmolLM2's 98 MB file: sizes 20 58, three
# parts; the checkout and a call's carry must stay under 64 MiB), the last --receive call .tpu-llama too,
# which then runs. .whl-tpu holds flax, qwix, optax and what they import that the machine lacks; .whl-hf
# transformers, tokenizers, gguf, sentencepiece, accelerate (transformers' GGUF loader needs it) and their
# needs; both at .ci/constraints.txt's versions, and no numpy: the machine's stays. --eval-data
# .tpu-llama/LICENSE.txt is CPython's licence, the second text of docs/results/smollm2.rst.
set -euo pipefail
MODEL=/tmp/mixle-model
case "${1:-}" in
--prepare)
    src=$2; shift 2
    rm -rf .tpu-m* .tpu-llama && mkdir -p .tpu-llama
    offset=0; i=1
    for size in "$@" rest; do
        mkdir -p ".tpu-m$i"
        count=$([[ $size == rest ]] && echo "" || echo "count=$((size * 1000000))")
        dd if="$src" of=".tpu-m$i/part$i" bs=1M skip=$offset $count iflag=skip_bytes,count_bytes status=none
        [[ $size == rest ]] || offset=$((offset + size * 1000000))
        i=$((i + 1))
    done
    sha256sum "$src" | cut -d' ' -f1 > .tpu-m1/SHA256
    libs=${LLAMA_LIBS:?set LLAMA_LIBS to a folder of libllama.so and libggml*.so built for x86-64 without AVX-512}
    for lib in "$libs"/lib*.so "$libs"/lib*.so.0; do cp -L "$lib" .tpu-llama/; done
    cp -r "${LLAMA_PY:?set LLAMA_PY to the folder holding the llama_cpp package}"/. .tpu-llama/py
    cp "$(python3 -c 'import os, sysconfig; print(os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt"))')" .tpu-llama/
    wheels() {  # the machine's Python is CPython 3.11 on x86-64
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform any -c .ci/constraints.txt "$@"
    }
    rm -rf .whl-tpu .whl-hf
    wheels -d .whl-tpu flax qwix optax absl-py etils msgpack pyyaml rich treescope typing_extensions \
        markdown-it-py mdurl pygments safetensors
    wheels -d .whl-hf transformers tokenizers gguf sentencepiece accelerate huggingface-hub hf-xet click filelock \
        fsspec httpx2 httpcore2 h11 anyio idna certifi packaging regex tqdm typer shellingham kernels psutil \
        requests urllib3 charset-normalizer annotated-doc pydantic pydantic-core annotated-types typing-inspection \
        tomlkit truststore
    wheels -d .tpu-llama/wheels diskcache jinja2 markupsafe  # llama_cpp's own imports
    python3 -m pip install -q --no-deps --no-compile --target .tpu-llama/py .tpu-llama/wheels/*.whl
    rm -r .tpu-llama/wheels
    for d in .tpu-m* .tpu-llama .whl-tpu .whl-hf; do grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
    du -sh .tpu-m* .tpu-llama .whl-tpu .whl-hf
    ;;
--install)
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl-tpu/*.whl .whl-hf/*.whl > "$OUT/pip.log" 2>&1
    python3 -m pip install -q --no-deps --target /tmp/torch --no-index --find-links /opt/wheels torch >> "$OUT/pip.log" 2>&1
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-cache-dir \
        --index-url file:///opt/pypi/simple --target /tmp/mpl matplotlib >> "$OUT/pip.log" 2>&1
    rm -rf /tmp/mpl/numpy* /tmp/mpl/bin  # the machine's numpy stays the one JAX runs with
    echo "installed: $(ls /tmp/site /tmp/torch /tmp/mpl | grep -c dist-info) packages"
    ;;
--receive)
    mkdir -p $MODEL && cp "$2"/* $MODEL/ && ls -la $MODEL
    ;;
--run)
    tag=$2; shift 2
    [[ -f $MODEL/model.gguf ]] || cat $(ls $MODEL/part* | sort -V) > $MODEL/model.gguf
    [[ "$(sha256sum $MODEL/model.gguf | cut -d' ' -f1)" == "$(cat $MODEL/SHA256)" ]] || { echo "model parts do not add up"; exit 1; }
    export PYTHONPATH="${PYTHONPATH:-}:/tmp/site:/tmp/torch:/tmp/mpl:$PWD:$PWD/.tpu-llama/py"
    # libllama.so finds its libggml*.so.0 beside it only through the loader's path
    export LLAMA_CPP_LIB_PATH=$PWD/.tpu-llama LD_LIBRARY_PATH="$PWD/.tpu-llama:${LD_LIBRARY_PATH:-}" PYTHONUNBUFFERED=1
    export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache  # a resumed run (next call, same machine) compiles nothing again
    # a call that does not carry .tpu-llama finds a partial copy of it (llama_cpp without Llama)
    python3 -c "import llama_cpp; llama_cpp.Llama" 2> /dev/null || { echo "llama_cpp does not load: carry .tpu-llama in every --run call"; exit 1; }
    if [[ -f /tmp/ft-$tag/checkpoint.pt ]]; then
        job=(--resume /tmp/ft-$tag)
    else
        job=(--backend jax --model $MODEL/model.gguf --out /tmp/ft-$tag "$@")
    fi
    timeout -s TERM "${LIMIT:-540}" python3 -m mixle finetune "${job[@]}" 2>&1 | sed -u 's/\r/\n/g' \
        | grep --line-buffered -v -e "Transparent hugepages" -e "^  warnings.warn(" | tee -a "$OUT/$tag-log.txt" | grep --line-buffered -v "s/step" || true
    for f in results.json table.txt finetune.png; do [[ -f /tmp/ft-$tag/$f ]] && cp /tmp/ft-$tag/$f "$OUT/$tag-$f"; done
    ;;
*)
    echo "usage: see the top of $0"; exit 2
    ;;
esac
