#!/usr/bin/env bash
# Wheels for tests/gpu/run_all.sh on a GPU machine without network whose Python has only torch (and torch's own
# dependencies: filelock, fsspec, jinja2, networkx, sympy, typing-extensions): everything the checks import before
# and while they run. Versions: constraints/cpu.txt where it pins them, else the ones the CPU environment resolved.
# Run here, from the repository root:
#   bash tests/gpu/fetch_wheels.sh        -> .whl/*.whl (git-ignored; well under the 64 MiB a run may carry)
# then carry ".whl": run_all.sh installs them with pip --no-index --target when the environment lacks them.
# FETCH_PYTHON_VERSION (default 3.12, the lent H200's Python) and FETCH_DEST (default .whl) change the target.
# The list is complete when the CPU mirror passes in a virtual environment holding only torch:
#   python3 -m venv /tmp/bare && /tmp/bare/bin/pip install torch==2.13.0
#   FETCH_PYTHON_VERSION=3.11 FETCH_DEST=/tmp/whl bash tests/gpu/fetch_wheels.sh
#   PYTHON=/tmp/bare/bin/python WHEELS=/tmp/whl bash tests/gpu/run_all.sh --cpu
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
pyver=${FETCH_PYTHON_VERSION:-3.12}
dest=${FETCH_DEST:-.whl}
pin() {  # the constraints/cpu.txt version of $1, else $2
  local v
  v=$(grep -i "^$1==" constraints/cpu.txt | head -1 | cut -d= -f3)
  echo "$1==${v:-$2}"
}
specs=(
  # megatron-core and what it imports at module load
  "$(pin megatron-core 0.16.1)" "numpy==2.4.6" "packaging==26.4"
  # megatron_rl's typed configs
  "$(pin pydantic 2.14.4)" "pydantic-core==2.50.5" "annotated-types==0.8.0" "typing-inspection==0.4.5" "$(pin PyYAML 6.0.4)"
  # HF checkpoints, tokenizers and the embedded engine's model (weight-sync and launcher checks)
  "$(pin safetensors 0.8.0)" "$(pin transformers 5.24.0)" "$(pin tokenizers 0.23.3)" "huggingface-hub==2.4.0"
  "regex==2026.11.19" "$(pin tqdm 4.70.1)" "httpx2==2.16.2" "httpcore2==2.16.2" "anyio==4.16.0" "h11==0.16.0"
  "truststore==0.10.5"
  # the reward functions (math answers), imported by the RL step
  "$(pin math-verify 0.9.0)" "$(pin latex2sympy2_extended 1.11.0)" "$(pin antlr4-python3-runtime 4.13.2)"
  # the rollout client / embedded server (aiohttp) and process checks
  "$(pin aiohttp 3.14.5)" "aiohappyeyeballs==2.7.1" "aiosignal==1.4.0" "attrs==26.1.0" "frozenlist==1.8.0"
  "multidict==7.2.1" "propcache==0.5.4" "yarl==1.25.1" "idna==3.20" "$(pin psutil 7.2.2)"
)
mkdir -p "$dest"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --platform manylinux_2_5_x86_64 --platform any -d "$dest" "${specs[@]}" 2>&1 | grep -v "is ignored" || true
n=$(ls "$dest"/*.whl | wc -l)
[ "$n" -ge "${#specs[@]}" ] || { echo "error: fetched $n wheels for ${#specs[@]} packages into $dest" >&2; exit 1; }
du -ch "$dest"/*.whl | tail -1
