#!/usr/bin/env bash
# Run the test suite once per CPU kernel path this machine can select, and print one line per path.
#
#   bash scripts/test_kernel_paths.sh                       # every path, the whole suite (~13 min per path, idle box)
#   bash scripts/test_kernel_paths.sh -m "not slow"         # extra arguments go to pytest (scripts/test.sh)
#   PATHS="native plain" bash scripts/test_kernel_paths.sh tests/test_loop.py
#   PATHS=plain bash scripts/test_kernel_paths.sh -m trajectory   # what CI runs after the suite (.ci/run)
#
# Why: a test that asserts on what one machine's kernels produce (sampled tokens, accuracies, which advantage signs
# a batch holds) passes where it was written and fails on another CPU. Another CPU's kernels are out of reach, but
# the libraries pick their code paths from environment variables read at start, so each path below gives other
# last bits to the ops that follow them. Every variable reaches the tests' subprocesses (CLI runs, torchrun
# workers, engines).
#
# The covering set, from tools/op_digest.py's findings (docs/development.md): only two variables change any
# op of this code base. ATEN_CPU_CAPABILITY (avx512 / avx2 / default) moves the CPU flash attention, and the plain
# path also silu and the initial weights; MKL_CBWR moves every GEMM, but an AMD CPU honours only COMPATIBLE (MKL
# reports every other branch as AUTO there), so MKL has two paths per machine: its own and COMPATIBLE. oneDNN ISA
# caps, torch.backends.mkldnn (which has no environment switch anyway) and thread counts change no op. Four paths
# give every ATen capability and both MKL paths, each a different set of bits:
#   native        nothing set: ATen's widest kernels (AVX-512 here), MKL's own path (a new CPU, unpinned)
#   pinned        what scripts/run_tiny.sh exports (megatron_rl/cpu_kernels.py): ATen AVX2, MKL AVX2 (AUTO on AMD)
#   native-compat ATen's widest kernels with MKL COMPATIBLE
#   plain         ATen's non-vectorized kernels, MKL COMPATIBLE,STRICT, oneDNN capped at SSE4.1 (the oldest of each)
# Works on a loaded box: every path runs under `nice` (NICE, default 10), one after another, with the suite's own
# worker count (scripts/test.sh; pass -n 1 to spread less); no test asserts on time (only generous subprocess
# timeouts bound them). Logs go to runs/kernel_paths/<path>.log.
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
  [native-compat]="MKL_CBWR=COMPATIBLE"
  [plain]="ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE,STRICT ONEDNN_MAX_CPU_ISA=SSE41"
)
read -r -a paths <<< "${PATHS:-native pinned native-compat plain}"
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
  if [ "$rc" -ne 0 ]; then
    status="FAILED (rc=$rc)"; failed=$((failed + 1))
    echo "--- $name: failures (full log $log)"; grep -E "^(FAILED|ERROR) " "$log" | head -40; tail -n 30 "$log"
  fi
  line="$name [ATen ${capability:-?}; ${SETTINGS[$name]:-nothing set}]: $status, ${result:-no pytest summary, see $log} ($(( $(date +%s) - start )) s)"
  lines+=("$line")
  echo "$line"
done
echo
echo "kernel paths ($(uptime | sed 's/.*load average/load average/')):"
printf '  %s\n' "${lines[@]}"
exit "$failed"
