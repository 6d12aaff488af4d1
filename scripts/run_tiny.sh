#!/usr/bin/env bash
# Set up the CPU environment (idempotent) and run the main job: a tiny full-pipeline FP8 GRPO run with
# Calibrated Clipping through megatron-core, an embedded SGLang-protocol rollout server and disk weight sync.
# Usage: bash scripts/run_tiny.sh [CONFIG] [dotted.key=value ...]   (CONFIG defaults to the tiny FP8 GRPO run)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
config=examples/configs/tiny_fp8_grpo.yaml
# The first argument is a config file unless it is already a dotted.key=value override.
if [ $# -gt 0 ] && [[ "$1" != *=* ]]; then
  config=$1
  shift
fi
# torch's and MKL's AVX2 kernel paths: a run repeats bit for bit on one machine (not across CPU vendors;
# megatron_rl/cpu_kernels.py says why).
eval "$(.venv/bin/python -m megatron_rl.cpu_kernels)"
exec .venv/bin/megatron-rl train "$config" "$@"
