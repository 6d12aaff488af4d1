#!/usr/bin/env bash
# Every prepared GPU check a bare GPU machine can run, one line per check: PASS / FAIL / SKIP (with why), then
# "N passed, M failed, K skipped"; exit 1 when a check failed. Each script's own output goes to a log named on its
# FAIL lines. What cannot run here is a SKIP with its reason, never a PASS.
#
#   on a GPU machine (bare: Python + CUDA torch, no network):
#     here:  bash tests/gpu/fetch_wheels.sh                 # .whl/ (~45 MB), then carry ".whl" with the checkout
#     there: bash tests/gpu/run_all.sh                      # < 10 min on one H200
#   CPU mirror (CI: tests/gpu/test_run_all.py):  bash tests/gpu/run_all.sh --cpu
#   In the Docker image (Transformer Engine and SGLang in the learner's Python) also: bash tests/gpu/run_image.sh
#
# Scripts (tests/gpu/): learner_device_check.py (a CUDA Learner step, checkpoint save / resume with the distributed
# optimizer, blockwise FP8 GEMMs of torch._scaled_mm against the emulation where torch has them),
# calibration_device_check.py, weight_sync_device_check.py (its two-GPU NCCL check is a SKIP on one GPU),
# fp8_device_check.py (TE numerics and recipes: needs transformer-engine, which a bare machine lacks and 64 MiB cannot
# carry), sglang_launch_check.py (needs SGLang; SGLANG_PYTHON names its interpreter). In --cpu mode each runs its CPU
# mode (sglang_launch_check.py through tests/fixtures/fake_sglang); the FP8 check has none.
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

. tests/gpu/checks_lib.sh

if [ "$mode" = gpu ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "FAIL setup: no CUDA device visible to $PYTHON (use --cpu for the CPU mirror)"
  echo "0 passed, 1 failed, 0 skipped"
  exit 1
fi

if [ "$mode" = cpu ]; then
  run learner_device_check 300 "$PYTHON" tests/gpu/learner_device_check.py --device cpu
  skip fp8_device_check "compares Transformer Engine's CUDA kernels with the CPU emulation: no CPU mode"
  run calibration_device_check 300 "$PYTHON" tests/gpu/calibration_device_check.py --device cpu
  run weight_sync_device_check 300 "$PYTHON" tests/gpu/weight_sync_device_check.py --device cpu
  run sglang_launch_check 300 "$PYTHON" tests/gpu/sglang_launch_check.py --cpu
else
  run learner_device_check 300 "$PYTHON" tests/gpu/learner_device_check.py
  if "$PYTHON" -c "import transformer_engine.pytorch" 2>/dev/null; then
    run fp8_device_check 300 "$PYTHON" tests/gpu/fp8_device_check.py
  else
    skip fp8_device_check "transformer-engine is not installed here (it is in the Docker image: tests/gpu/run_image.sh)"
  fi
  run calibration_device_check 180 "$PYTHON" tests/gpu/calibration_device_check.py
  run weight_sync_device_check 180 "$PYTHON" tests/gpu/weight_sync_device_check.py
  sglang_python=${SGLANG_PYTHON:-$PYTHON}
  if "$sglang_python" -c "import sglang" 2>/dev/null; then
    run sglang_launch_check 600 "$PYTHON" tests/gpu/sglang_launch_check.py --sglang-python "$sglang_python"
  else
    skip sglang_launch_check "no SGLang here ($sglang_python cannot import sglang; it is in the Docker image, or set SGLANG_PYTHON)"
  fi
fi
summary
