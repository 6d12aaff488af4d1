#!/usr/bin/env bash
# Set up the CPU environment (idempotent) and run the main job: a tiny full-pipeline FP8 GRPO run with
# Calibrated Clipping through megatron-core, an embedded SGLang-protocol rollout server and disk weight sync.
# Usage: bash scripts/run_tiny.sh [CONFIG] [dotted.key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
config=${1:-examples/configs/tiny_fp8_grpo.yaml}
shift || true
exec .venv/bin/megatron-rl train "$config" "$@"
