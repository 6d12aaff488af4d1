# Shared by tests/gpu/run_all.sh and tests/gpu/run_image.sh (sourced, never run): one PASS / FAIL / SKIP line per
# check, then "N passed, M failed, K skipped".
#
# A check script prints "[PASS] name detail", "[FAIL] name detail" or "[SKIP] name reason" per check; `run` relays each
# as "PASS script: name detail" (FAIL lines name the log). A script that exits non-zero without a [FAIL] line (a crash,
# a timeout) is one FAIL of its own; one that exits 0 having reported nothing is a FAIL too (a check that did not run
# never passes). `skip` records a whole script that cannot run here, with why.
# Needs $logs (a directory for the per-script logs).
passed=0 failed=0 skipped=0

emit() {  # emit "PASS|FAIL|SKIP rest...": print the line, count it
  echo "$1"
  case "${1%% *}" in
    PASS) passed=$((passed + 1)) ;;
    FAIL) failed=$((failed + 1)) ;;
    SKIP) skipped=$((skipped + 1)) ;;
  esac
}

run() {  # run NAME LIMIT_S COMMAND [ARGS...]
  local name=$1 limit=$2; shift 2
  local log="$logs/$name.log" start=$SECONDS rc n=0 nfail=0 line kind rest
  timeout "$limit" "$@" > "$log" 2>&1
  rc=$?
  while IFS= read -r line; do
    kind=${line%%]*}; kind=${kind#[}; rest=${line#*] }
    n=$((n + 1))
    if [ "$kind" = FAIL ]; then
      nfail=$((nfail + 1))
      emit "FAIL $name: $(printf '%s' "$rest" | cut -c1-240) (log: $log)"
    else
      emit "$kind $name: $(printf '%s' "$rest" | cut -c1-240)"
    fi
  done < <(grep -E '^\[(PASS|FAIL|SKIP)\] ' "$log")
  if [ "$rc" -ne 0 ] && [ "$nfail" -eq 0 ]; then
    local why
    why=$(tail -1 "$log" | cut -c1-200)
    [ "$rc" -eq 124 ] && why="timed out after $limit s"
    emit "FAIL $name: exit $rc after $((SECONDS - start)) s, $n checks reported: $why (log: $log)"
  elif [ "$rc" -eq 0 ] && [ "$n" -eq 0 ]; then
    emit "FAIL $name: exit 0 but no check reported (log: $log)"
  fi
}

skip() {  # skip NAME REASON: a whole script that cannot run here
  emit "SKIP $1: $2"
}

summary() {  # the last line; exit status 1 when a check failed
  echo "$passed passed, $failed failed, $skipped skipped"
  [ "$failed" -eq 0 ]
}
