#!/usr/bin/env bash
# Shared part of the Slurm launch scripts (sourced): plan the layout on this allocation, start engines and the
# router, wait until they are healthy. Expects: config, overrides (array), PY; sets hosts, gpus and the layout
# variables of megatron_rl/plan/launch.py; registers cleanup of the background steps.
# Settings (all optional): ENGINE_NODES (disaggregated: nodes running engines, the first ones; default 1; each runs
# rollout.num_engines engines), GPU_KIND (h100|h200|b200, for the plan), ROUTER_PORT (30000), ENGINE_BASE_PORT
# (30001), ROUTER_START_TRIES (5), ENGINE_STARTUP_TIMEOUT (seconds, 1800), PYTHON (the training environment's python).

gpus=${SLURM_GPUS_ON_NODE:-8}
gpus=${gpus##*:}          # "h100:8" -> "8"
mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
router_port=${ROUTER_PORT:-30000}
engine_port=${ENGINE_BASE_PORT:-30001}

# 1. The layout must fit this allocation before anything starts (named errors, exit 2 otherwise).
"$PY" -m megatron_rl.cli plan "$config" "${overrides[@]}" --nodes "${#hosts[@]}" --gpus-per-node "$gpus" \
  --gpu "${GPU_KIND:-h100}" --engine-nodes "${ENGINE_NODES:-1}"
eval "$("$PY" -m megatron_rl.plan.launch "$config" "${overrides[@]}" --gpus-per-node "$gpus" --gpu "${GPU_KIND:-h100}" \
  --hosts "${hosts[@]}" --router-port "$router_port" --engine-base-port "$engine_port" --engine-nodes "${ENGINE_NODES:-1}")"
read -ra engine_hosts <<< "$ENGINE_HOSTS"
read -ra learner_hosts <<< "$LEARNER_HOSTS"

step_pids=()
cleanup() {
  for pid in "${step_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

# 2. Engines: `megatron-rl engines` starts this node's rollout.num_engines SGLang engines (rollout.sglang_python),
#    waits until they are healthy and blocks; one step per engine node, sharing the node with other steps
#    (--overlap). Its own per-node router is off: one router below fronts the engines of every node.
for host in "${engine_hosts[@]}"; do
  srun --nodes=1 --ntasks=1 --overlap --nodelist="$host" \
    "$PY" -m megatron_rl.cli engines "$config" "${overrides[@]}" rollout.host=0.0.0.0 "rollout.base_port=$engine_port" \
    rollout.use_router=false &
  step_pids+=($!)
done

# 3. sglang-router on the first engine node, in front of every worker (weight updates go to the workers). With
#    rollout.api_key it requires the key from the learners and sends it to the engines (started with it). A port
#    still held (the previous job's router on a reused node) is tried again, ROUTER_START_TRIES times (5).
read -ra worker_urls <<< "$WORKER_URLS"
srun --nodes=1 --ntasks=1 --overlap --nodelist="${engine_hosts[0]}" \
  bash "$(dirname "${BASH_SOURCE[0]}")/retry_port_in_use.sh" "${ROUTER_START_TRIES:-5}" "$router_port" \
  "$PY" -m sglang_router.launch_router --worker-urls "${worker_urls[@]}" --host 0.0.0.0 --port "$router_port" \
  --policy "$ROUTER_POLICY" ${ROUTER_API_KEY:+--api-key "$ROUTER_API_KEY"} &
step_pids+=($!)

# 4. Wait until every worker and the router answer /health (a step that died is reported at once).
wait_healthy() {
  local url=$1 deadline=$((SECONDS + ${ENGINE_STARTUP_TIMEOUT:-1800}))
  until curl -sf -o /dev/null "$url/health"; do
    for pid in "${step_pids[@]}"; do
      kill -0 "$pid" 2>/dev/null || { wait "$pid" || true; echo "error: an engine/router step exited before $url was healthy" >&2; exit 3; }
    done
    [ "$SECONDS" -lt "$deadline" ] || { echo "error: $url not healthy after ${ENGINE_STARTUP_TIMEOUT:-1800} s" >&2; exit 3; }
    sleep 5
  done
}
for url in "${worker_urls[@]}" "$ROUTER_URL"; do wait_healthy "$url"; done
echo "engines ready: ${worker_urls[*]} behind $ROUTER_URL"

# Learner overrides: talk to the router; weight updates are discovered from its worker list.
learner_overrides=("${overrides[@]}" rollout.engine=external "rollout.urls=[$ROUTER_URL]")
