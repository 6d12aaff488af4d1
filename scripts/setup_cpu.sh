#!/usr/bin/env bash
# Create .venv and install the CPU path: torch==2.13.0 first (from local disk), then the project
# with the pinned, tested versions. Idempotent; safe to re-run. Usage: bash scripts/setup_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
# torch first and pinned: any later resolution must find it satisfied, never fetch a CUDA build.
python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
python -m pip install -q -c constraints/cpu.txt -e ".[test]" 2>&1 | grep -v "is ignored" || true
python -W ignore -c "import torch, megatron.core, transformers; assert torch.__version__.startswith('2.13.0'), torch.__version__"
