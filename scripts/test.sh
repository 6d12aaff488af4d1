#!/usr/bin/env bash
# Set up the CPU environment (idempotent) and run the test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m "not slow"` to skip the slow end-to-end and multi-process tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
exec .venv/bin/python -m pytest -q "$@"
