#!/usr/bin/env bash
# Launch the learner ranks of one node with torchrun (rank 0 of node 0 is the controller).
# Usage: NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 bash examples/launch/torchrun_node.sh CONFIG [overrides]
# Settings: PYTHON (the training environment's python, default python), NNODES, NODE_RANK, GPUS_PER_NODE (8),
# MASTER_ADDR, MASTER_PORT (29500).
# The rollout engines run separately: `megatron-rl engines CONFIG` on each rollout node starts its SGLang
# servers (+ sglang-router) and prints their URLs; point rollout.urls at the router.
set -euo pipefail
config=$1; shift
PY=${PYTHON:-python}
# FP8 policy settings TE reads at import time come from the policy itself, never set deep in code: the config as
# the trainer will see it (YAML + the same command-line overrides, through megatron_rl's own loader), so a
# `precision.*` override cannot leave TE's import-time options contradicting the policy.
env_lines=$("$PY" - "$config" "$@" <<'PYEOF'
import shlex
import sys

from megatron_rl.config import ConfigError, load_config
from megatron_rl.precision.te import launcher_env

try:
    precision = load_config(sys.argv[1], sys.argv[2:]).precision
except ConfigError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)
for name, value in launcher_env(precision).items():
    print(f"export {name}={shlex.quote(value)}")
PYEOF
)
eval "$env_lines"
exec "$PY" -m torch.distributed.run --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
  --nproc-per-node "${GPUS_PER_NODE:-8}" --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
  -m megatron_rl.cli train "$config" "$@"
