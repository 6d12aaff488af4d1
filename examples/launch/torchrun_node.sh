#!/usr/bin/env bash
# Launch the learner ranks of one node with torchrun (rank 0 of node 0 is the controller).
# Usage: NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 bash examples/launch/torchrun_node.sh CONFIG [overrides]
# The rollout engines run separately: `megatron-rl engines CONFIG` on each rollout node starts its SGLang
# servers (+ sglang-router) and prints their URLs; point rollout.urls at the router.
set -euo pipefail
config=$1; shift
# FP8 policy settings TE reads at import time come from the policy itself, never set deep in code.
eval "$(python -c "import sys; from megatron_rl.config import load_config; from megatron_rl.precision.te import launcher_env
for k, v in launcher_env(load_config(sys.argv[1]).precision).items(): print(f'export {k}={v}')" "$config")"
exec python -m torch.distributed.run --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
  --nproc-per-node "${GPUS_PER_NODE:-8}" --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
  -m megatron_rl.cli train "$config" "$@"
