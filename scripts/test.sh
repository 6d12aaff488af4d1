#!/usr/bin/env bash
# Set up the CPU environment (a no-op when nothing changed) and run the test suite. Extra arguments go to
# pytest, e.g. `bash scripts/test.sh -m "not slow"` to skip the slow end-to-end and multi-process tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
# Byte-compile this checkout's own modules (only what changed since: ~0.05 s): under PYTHONDONTWRITEBYTECODE (set in
# this project's dev environment) no process writes its .pyc, so each of the suite's ~300 Python processes would
# compile what it imports of megatron_rl from source again (~0.2 CPU-s each); pip already compiled site-packages.
.venv/bin/python -m compileall -q megatron_rl tests tools benchmarks >/dev/null
# -q by default; not on top of the caller's own -q/-v (pytest's -qq would drop the closing "N passed" line).
# Test files run on pytest-xdist workers, one more than the cores (at most 4): most tests compute on one thread or
# wait on a subprocess, an engine or a socket part of the time, and the extra worker keeps every core busy meanwhile
# (measured on 2 cores: 145% CPU with 2 workers). A file stays on one worker, so its module fixtures (engines, runs)
# are built once. Files are handed out in the order tests/conftest.py puts them (longest first), not in xdist's default
# order (most tests first), which starts some of the longest files last (--no-loadscope-reorder). The caller's own -n
# (e.g. -n 0 for a serial run) or -p no:xdist wins.
quiet=(-q)
cores=$(nproc)
workers=(-n "$(( cores + 1 < 4 ? cores + 1 : 4 ))" --dist loadfile --no-loadscope-reorder)
for arg in "$@"; do
  case "$arg" in
    -q*|-v*|--quiet|--verbose) quiet=() ;;
    -n|-n*|--numprocesses*|no:xdist) workers=() ;;
  esac
done
# One intra-op thread per worker (unless the caller set OMP_NUM_THREADS): 3 workers of 2 torch threads each on 2 cores
# oversubscribe them, and every subprocess a test starts already runs on one thread (tests/rl_runs.py, conftest.py).
if [ ${#workers[@]} -gt 0 ]; then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi
# The 25 slowest tests close every run: where the suite's time goes, read off any run (CI's included).
exec .venv/bin/python -m pytest "${quiet[@]}" "${workers[@]}" --durations=25 "$@"
