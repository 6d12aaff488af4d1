#!/usr/bin/env bash
# The GPU checks that need the Docker image (Transformer Engine and SGLang in the learner's own Python), one line per
# check: PASS / FAIL / SKIP (with why), then "N passed, M failed, K skipped"; exit 1 when a check failed.
#
#   in the image (one GPU; two for the distributed transport):
#     docker run --gpus all --ipc=host --rm megatron_rl:latest bash tests/gpu/run_image.sh
#   CPU mirror (CI: tests/gpu/test_run_all.py):  bash tests/gpu/run_image.sh --cpu
#
# Checks (tests/gpu/): one_environment (tools/check_one_environment.py: learner and SGLang import one torch and one
# NCCL), fp8_device_check.py (TE quantizers and linears vs the emulation; recipes through megatron's TE spec against
# BF16 on the same weights, a broken recipe outside the tolerance), te_training_check.py (a TE blockwise Learner
# trained against BF16 on a learnable task), sglang_launch_check.py (real engines from our command lines),
# sglang_sync_check.py (a real SGLang server synced by `tensor` with the memory saver and by `distributed` on two
# GPUs, FP8 weights in sessions, served log-probs against the learner's). The bare-machine checks are run_all.sh's.
# In --cpu mode each runs its CPU mode (SGLang through tests/fixtures/fake_sglang); the environment and TE checks,
# which are about CUDA builds, are SKIPs there, and so is the launcher check, whose CPU mode run_all.sh --cpu runs.
# Settings: PYTHON (default python3, or .venv/bin/python when present), SGLANG_PYTHON (default PYTHON),
# RUN_ALL_LOGS (default a new directory under /tmp).
set -uo pipefail
cd "$(dirname "$0")/../.."
mode=gpu
[ "${1:-}" = "--cpu" ] && mode=cpu
if [ -z "${PYTHON:-}" ]; then PYTHON=python3; [ -x .venv/bin/python ] && PYTHON=.venv/bin/python; fi
sglang_python=${SGLANG_PYTHON:-$PYTHON}
logs=${RUN_ALL_LOGS:-$(mktemp -d /tmp/gpu_image_checks.XXXXXX)}
mkdir -p "$logs"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1

. tests/gpu/checks_lib.sh

if [ "$mode" = cpu ]; then
  skip one_environment "checks the CUDA build's NCCL (a CPU torch has none; tests/test_one_environment.py covers the rules)"
  skip fp8_device_check "compares Transformer Engine's CUDA kernels with the CPU emulation: no CPU mode"
  run te_training_check 900 "$PYTHON" tests/gpu/te_training_check.py --device cpu
  # the launcher's CPU mode is the same command as run_all.sh --cpu's, which CI runs beside this one
  skip sglang_launch_check "its CPU mode is run_all.sh --cpu's check (the same command)"
  run sglang_sync_check 900 "$PYTHON" tests/gpu/sglang_sync_check.py --cpu
  summary
  exit
fi

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "FAIL setup: no CUDA device visible to $PYTHON (use --cpu for the CPU mirror)"
  echo "0 passed, 1 failed, 0 skipped"
  exit 1
fi
versions() {  # the pins the image was built with (Dockerfile build arguments)
  sed -n "s/^ARG $1=//p" Dockerfile | head -1
}
run one_environment 600 "$PYTHON" tools/check_one_environment.py check --sglang-python "$sglang_python" \
  --sglang-version "$(versions SGLANG_VERSION)" --te-version "$(versions TRANSFORMER_ENGINE_VERSION)" \
  --megatron-core-version "$(versions MEGATRON_CORE_VERSION)"
if "$PYTHON" -c "import transformer_engine.pytorch" 2>/dev/null; then
  run fp8_device_check 600 "$PYTHON" tests/gpu/fp8_device_check.py
  run te_training_check 600 "$PYTHON" tests/gpu/te_training_check.py
else
  skip fp8_device_check "transformer-engine does not import here (build the image: Dockerfile)"
  skip te_training_check "transformer-engine does not import here (build the image: Dockerfile)"
fi
if "$sglang_python" -c "import sglang" 2>/dev/null; then
  run sglang_launch_check 900 "$PYTHON" tests/gpu/sglang_launch_check.py --sglang-python "$sglang_python"
  run sglang_sync_check 900 "$PYTHON" tests/gpu/sglang_sync_check.py --sglang-python "$sglang_python"
else
  skip sglang_launch_check "no SGLang here ($sglang_python cannot import sglang; build the image: Dockerfile)"
  skip sglang_sync_check "no SGLang here ($sglang_python cannot import sglang; build the image: Dockerfile)"
fi
summary
