#!/usr/bin/env bash
# Create .venv and install the CPU path: torch==2.13.0 first (from local disk), then the project
# with the pinned, tested versions. Idempotent; safe to re-run. Usage: bash scripts/setup_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip_install() {
  # Some machines list local package mirrors that may be absent; hide pip's warnings about them, keep its status.
  local log
  log=$(mktemp)
  if ! python -m pip install -q "$@" >"$log" 2>&1; then
    grep -v "is ignored" "$log" >&2 || true
    rm -f "$log"
    return 1
  fi
  grep -v "is ignored" "$log" || true
  rm -f "$log"
}
pip_install --upgrade pip
# torch first and pinned: any later resolution must find it satisfied, never fetch a CUDA build.
pip_install "torch==2.13.0"
pip_install -c constraints/cpu.txt -e ".[test]"
python -W ignore -c "import torch, megatron.core, transformers; assert torch.__version__.startswith('2.13.0'), torch.__version__"
