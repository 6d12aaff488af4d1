#!/usr/bin/env bash
# Create .venv and install the CPU path: torch==2.13.0 first (from local disk), then the project
# with the pinned, tested versions. Idempotent and quick to re-run: when none of the install inputs
# changed since the last successful install (see scripts/install_stamp.sh) it does nothing; when it
# does install it prints one line, and pip's output only if the install fails.
# Usage: bash scripts/setup_cpu.sh           # set up (or do nothing when up to date)
#        bash scripts/setup_cpu.sh --check   # exit 0 when up to date, 1 when a setup would install
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.install_stamp

up_to_date() {
  [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(bash scripts/install_stamp.sh)" = "$(cat "$STAMP")" ]
}

if [ "${1:-}" = "--check" ]; then
  if up_to_date; then echo "up to date"; exit 0; fi
  echo "setup would install"
  exit 1
fi
up_to_date && exit 0

echo "setup: installing the CPU environment into .venv (pinned versions; first time takes a few minutes)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
rm -f "$STAMP"
. .venv/bin/activate
log=$(mktemp)
trap 'rm -f "$log"' EXIT
step() {
  # Quiet on success; on failure show what the step printed (less pip's notes about absent local mirrors).
  if ! "$@" >"$log" 2>&1; then
    echo "setup failed: $*" >&2
    grep -v "is ignored" "$log" >&2 || true
    exit 1
  fi
}
step python -m pip install -q --upgrade pip
# torch first and pinned: any later resolution must find it satisfied, never fetch a CUDA build.
step python -m pip install -q "torch==2.13.0"
step python -m pip install -q -c constraints/cpu.txt -e ".[test]"
step python -W ignore -c "import torch, megatron.core, transformers, matplotlib; assert torch.__version__.startswith('2.13.0'), torch.__version__"
bash scripts/install_stamp.sh >"$STAMP"
