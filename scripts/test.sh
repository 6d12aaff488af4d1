#!/usr/bin/env bash
# Set up the CPU environment (a no-op when nothing changed) and run the test suite. Extra arguments go to
# pytest, e.g. `bash scripts/test.sh -m "not slow"` to skip the slow end-to-end and multi-process tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
# -q by default; not on top of the caller's own -q/-v (pytest's -qq would drop the closing "N passed" line)
quiet=(-q)
for arg in "$@"; do
  case "$arg" in -q*|-v*|--quiet|--verbose) quiet=() ;; esac
done
exec .venv/bin/python -m pytest "${quiet[@]}" "$@"
