#!/usr/bin/env bash
# Everything the Flax TPU check needs on the lent TPU machine, in one command (one program holds
# the chip at a time). Run from the repository root there, with the pinned wheels carried in
# .whl-tpu (made here by `bash benchmarks/tpu_run.sh --download`), and $OUT set:
#   bash benchmarks/tpu_run.sh [tpu_check.py options, e.g. --speed 110M 470M 470M-b4]
set -euo pipefail
if [[ "${1:-}" == "--download" ]]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl-tpu flax==0.12.8 qwix==0.1.8 optax==0.2.8 absl-py etils msgpack pyyaml rich treescope \
        typing_extensions markdown-it-py mdurl pygments safetensors hypothesis sortedcontainers attrs chex \
        toolz filelock sympy mpmath networkx jinja2 fsspec markupsafe pytest-timeout tqdm gguf==0.19.0
    grep -qx '/.whl-tpu/' .git/info/exclude || echo '/.whl-tpu/' >> .git/info/exclude
    exit 0
fi
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl-tpu/*.whl > "$OUT/pip.log" 2>&1
# torch (CPU) for the tests that compare with it, from the machine's own wheels
python3 -m pip install -q --no-deps --target /tmp/torch --no-index --find-links /opt/wheels torch >> "$OUT/pip.log" 2>&1
export PYTHONPATH="${PYTHONPATH:-}:/tmp/site:/tmp/torch:$PWD"
PYTHONUNBUFFERED=1 python3 benchmarks/tpu_check.py --out "$OUT" "$@" 2>&1 | grep --line-buffered -v -e "Transparent hugepages" -e "^  warnings.warn("
