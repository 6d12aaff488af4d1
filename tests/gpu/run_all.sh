#!/usr/bin/env bash
# Every prepared GPU check in one run, one line per check: PASS / FAIL / SKIP (with why), then "N passed, M failed,
# K skipped"; exit 1 when a check failed. Each check's own output goes to a log named on its line.
#
#   on a GPU machine (bare: Python + CUDA torch, no network):
#     here:  bash tests/gpu/fetch_wheels.sh                 # .whl/ (~45 MB), then carry ".whl" with the checkout
#     there: bash tests/gpu/run_all.sh                      # < 10 min on one H200
#   CPU mirror (CI: tests/gpu/test_run_all.py):  bash tests/gpu/run_all.sh --cpu
#
# Checks (tests/gpu/): fp8_device_check.py (TE numerics and recipes: needs transformer-engine, which a bare machine
# lacks and 64 MiB cannot carry; the Docker image has it), calibration_device_check.py, weight_sync_device_check.py,
# sglang_launch_check.py (needs an SGLang environment: SGLANG_PYTHON=/opt/sglang/bin/python in the image; SGLang and
# its CUDA kernels are far beyond what a bare machine can be given). In --cpu mode each runs its CPU mode
# (sglang_launch_check.py through tests/fixtures/fake_sglang); the FP8 check has none.
# Settings: PYTHON (default python3, or .venv/bin/python when present), SGLANG_PYTHON, WHEELS (default .whl),
# RUN_ALL_LOGS (default a new directory under /tmp).
set -uo pipefail
cd "$(dirname "$0")/../.."
mode=gpu
[ "${1:-}" = "--cpu" ] && mode=cpu
if [ -z "${PYTHON:-}" ]; then PYTHON=python3; [ -x .venv/bin/python ] && PYTHON=.venv/bin/python; fi
logs=${RUN_ALL_LOGS:-$(mktemp -d /tmp/gpu_checks.XXXXXX)}
mkdir -p "$logs"
wheels=${WHEELS:-.whl}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1

# What the checks import, from the carried wheels, when this Python lacks it (no network: --no-index).
if ! "$PYTHON" -c "import pydantic, yaml, numpy, megatron.core, transformers, aiohttp" 2>/dev/null; then
  if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "FAIL setup: this Python lacks megatron_rl's dependencies and $wheels/ holds no wheels (bash tests/gpu/fetch_wheels.sh)"
    echo "0 passed, 1 failed, 0 skipped"
    exit 1
  fi
  site="$logs/site"
  if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl \
       > "$logs/setup.log" 2>&1; then
    echo "FAIL setup: pip install of $wheels/*.whl failed (log: $logs/setup.log)"
    echo "0 passed, 1 failed, 0 skipped"
    exit 1
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

passed=0 failed=0 skipped=0
run() {  # run NAME LIMIT_S SCRIPT [ARGS...]
  local name=$1 limit=$2; shift 2
  local start=$SECONDS rc
  timeout "$limit" "$PYTHON" "$@" > "$logs/$name.log" 2>&1
  rc=$?
  local n
  n=$(grep -cE '^\[PASS\]|^OK ' "$logs/$name.log")
  if [ "$rc" -eq 0 ]; then
    echo "PASS $name: $n checks, $((SECONDS - start)) s (log: $logs/$name.log)"
    passed=$((passed + 1))
  else
    local why
    why=$(grep -E '^\[FAIL\]|^FAIL ' "$logs/$name.log" | head -3 | cut -c1-200 | tr '\n' ';')
    [ "$rc" -eq 124 ] && why="timed out after $limit s; $why"
    echo "FAIL $name: exit $rc, $((SECONDS - start)) s: ${why:-$(tail -1 "$logs/$name.log" | cut -c1-200)} (log: $logs/$name.log)"
    failed=$((failed + 1))
  fi
}
skip() { echo "SKIP $1: $2"; skipped=$((skipped + 1)); }

if [ "$mode" = gpu ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "FAIL setup: no CUDA device visible to $PYTHON (use --cpu for the CPU mirror)"
  echo "0 passed, 1 failed, 0 skipped"
  exit 1
fi

if [ "$mode" = cpu ]; then
  skip fp8_device_check "compares Transformer Engine's CUDA kernels with the CPU emulation: no CPU mode"
elif "$PYTHON" -c "import transformer_engine.pytorch" 2>/dev/null; then
  run fp8_device_check 300 tests/gpu/fp8_device_check.py
else
  skip fp8_device_check "transformer-engine is not installed here (it ships in the Docker image; too large to carry)"
fi

if [ "$mode" = cpu ]; then
  run calibration_device_check 300 tests/gpu/calibration_device_check.py --device cpu
  run weight_sync_device_check 300 tests/gpu/weight_sync_device_check.py --device cpu
  run sglang_launch_check 300 tests/gpu/sglang_launch_check.py --cpu
else
  run calibration_device_check 180 tests/gpu/calibration_device_check.py
  run weight_sync_device_check 180 tests/gpu/weight_sync_device_check.py
  sglang_python=${SGLANG_PYTHON:-$PYTHON}
  if "$sglang_python" -c "import sglang" 2>/dev/null; then
    run sglang_launch_check 600 tests/gpu/sglang_launch_check.py --sglang-python "$sglang_python"
  else
    skip sglang_launch_check "no SGLang environment ($sglang_python cannot import sglang; set SGLANG_PYTHON)"
  fi
fi
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
