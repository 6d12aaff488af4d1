#!/usr/bin/env bash
# Run a server command; when it exits because its fixed port is still in use, run it again on the same port.
#
#   bash examples/launch/retry_port_in_use.sh TRIES PORT command args...
#
# Why: the Slurm scripts start sglang-router on a fixed port, and a port still held by the previous job's router
# (a slow teardown on a reused node) makes it exit at once with "Address already in use (os error 98)". Another
# port would break the URL every learner was given, so the same port is tried again, TRIES times in all, 10 s
# apart (RETRY_WAIT_S). Any other exit, or a run past the last try, ends with the command's own exit status.
set -uo pipefail
tries=$1 port=$2
shift 2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for ((attempt = 1; ; attempt++)); do
  "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ] || ! grep -q "Address already in use" "$log"; then exit "$rc"; fi
  if [ "$attempt" -ge "$tries" ]; then
    echo "error: port $port still in use after $tries tries of ${*:1:3}; free it or set ROUTER_PORT to another port" >&2
    exit "$rc"
  fi
  echo "port $port in use (try $attempt of $tries); starting ${*:1:3} again in ${RETRY_WAIT_S:-10} s" >&2
  sleep "${RETRY_WAIT_S:-10}"
done
