#!/usr/bin/env bash
# Run the test suite once per CPU kernel path this machine can select, and print one line per path.
#
#   bash scripts/test_kernel_paths.sh                       # every path, the whole suite (~13 min per path, idle box)
#   bash scripts/test_kernel_paths.sh -m "not slow"         # extra arguments go to pytest (scripts/test.sh)
#   PATHS="native plain" bash scripts/test_kernel_paths.sh tests/test_loop.py
#
# Why: a test that asserts on what one machine's kernels produce (sampled tokens, accuracies, which advantage signs
# a batch holds) passes where it was written and fails on another CPU. Another CPU's kernels are out of reach, but
# every library here picks its code path from environment variables read at start, so each path below is a
# different set of last bits for every op those libraries run (tools/op_digest.py shows which ops move with which
# variable). Every variable reaches the test's subprocesses (CLI runs, torchrun workers, engines).
#
# The covering set: each axis takes each of its values on this machine at least once, and the pairs that real
# machines ship together appear together.
#   native    nothing set: ATen's widest kernels (AVX-512 here), MKL AUTO, oneDNN's native ISA (a new CPU, unpinned)
#   pinned    what scripts/run_tiny.sh exports (megatron_rl/cpu_kernels.py)
#   avx2-auto ATen AVX2, MKL AUTO, oneDNN capped at AVX2 (an AVX2-only CPU unpinned; MKL's AVX2 CNR branch
#             cannot be forced on an AMD CPU: it is reported as AUTO there)
#   plain     ATen's non-vectorized kernels, MKL COMPATIBLE,STRICT, oneDNN capped at SSE4.1 (the oldest path of each)
# torch.backends.mkldnn has no environment switch; the op digests show the ops this suite's models run do not go
# through oneDNN (no op changes with it off), so it adds no path. Thread counts are covered by the suite itself
# (subprocesses run with 1 thread, in-process tests with the default).
#
# Works on a loaded box: every path runs under `nice` (NICE, default 10), one after another, with the suite's own
# worker count (scripts/test.sh; pass -n 1 to spread less); no test is timed. Logs go to runs/kernel_paths/<path>.log.
# Exit status: the number of paths that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh || exit 2
KERNEL_VARS=(ATEN_CPU_CAPABILITY MKL_CBWR MKL_ENABLE_INSTRUCTIONS ONEDNN_MAX_CPU_ISA DNNL_MAX_CPU_ISA)
unset_args=()
for v in "${KERNEL_VARS[@]}"; do unset_args+=(-u "$v"); done
declare -A SETTINGS=(
  [native]=""
  [pinned]="$(env "${unset_args[@]}" .venv/bin/python -m megatron_rl.cpu_kernels | sed "s/^export //" | paste -sd " ")"
  [avx2-auto]="ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AUTO ONEDNN_MAX_CPU_ISA=AVX2"
  [plain]="ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE,STRICT ONEDNN_MAX_CPU_ISA=SSE41"
)
read -r -a paths <<< "${PATHS:-native pinned avx2-auto plain}"
mkdir -p runs/kernel_paths
failed=0
lines=()
for name in "${paths[@]}"; do
  if [ -z "${SETTINGS[$name]+x}" ]; then
    echo "error: PATHS: unknown kernel path '$name' (valid: ${!SETTINGS[*]})" >&2
    exit 2
  fi
  read -r -a assign <<< "${SETTINGS[$name]}"
  log=runs/kernel_paths/$name.log
  start=$(date +%s)
  # shellcheck disable=SC2086
  env "${unset_args[@]}" "${assign[@]}" nice -n "${NICE:-10}" bash scripts/test.sh "$@" > "$log" 2>&1
  rc=$?
  capability=$(env "${unset_args[@]}" "${assign[@]}" .venv/bin/python -c \
    "import torch; print(torch.backends.cpu.get_cpu_capability())" 2>/dev/null)
  result=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error)|(passed|failed|error).* in [0-9.]+s" "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
  status=PASSED
  if [ "$rc" -ne 0 ]; then status="FAILED (rc=$rc)"; failed=$((failed + 1)); fi
  line="$name [ATen ${capability:-?}; ${SETTINGS[$name]:-nothing set}]: $status, ${result:-no pytest summary, see $log} ($(( $(date +%s) - start )) s)"
  lines+=("$line")
  echo "$line"
done
echo
echo "kernel paths ($(uptime | sed 's/.*load average/load average/')):"
printf '  %s\n' "${lines[@]}"
exit "$failed"
