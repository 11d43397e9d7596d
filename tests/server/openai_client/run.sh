#!/usr/bin/env bash
# End-to-end test of `moat serve` with the official `openai` npm package (test.mjs): starts the
# server on models/k3-nano with an API key on a free port, waits for /health, runs the client,
# stops the server with SIGTERM. Exit 0: passed; 77: skipped (no node, or no node_modules: run
# `npm ci --prefix tests/server/openai_client`); anything else: failed.
# Usage: tests/server/openai_client/run.sh [BUILD_DIR]   (default: build; or $MOAT_BUILD_DIR)
# MOAT_TP=N runs the server tensor-parallel: `mpirun -np N moat serve --tp N`. Its SIGTERM goes
# to rank 0 (mpirun would end the whole job at once, exiting 1): rank 0 shuts down gracefully, the
# worker ranks follow it, and mpirun must exit 0.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
build=${1:-${MOAT_BUILD_DIR:-$root/build}}
moat=$build/moat
model=${MOAT_MODEL:-$root/models/k3-nano}

if ! command -v node >/dev/null 2>&1; then
  echo "SKIP: node is not installed (apt-get install nodejs npm)"; exit 77
fi
if [ ! -d "$here/node_modules/openai" ]; then
  echo "SKIP: the openai package is not installed: npm ci --prefix tests/server/openai_client"; exit 77
fi
if [ ! -x "$moat" ]; then
  echo "FAIL: no moat binary at $moat (build it, or pass the build directory)"; exit 1
fi

port=$(node -e "const s=require('net').createServer().listen(0,'127.0.0.1',()=>{console.log(s.address().port);s.close()})")
key="moat-test-key-$$"
log=$(mktemp "${TMPDIR:-/tmp}/moat-openai-client.XXXXXX.log")
launch=()
tp=${MOAT_TP:-1}
extra=()
if [ "$tp" != 1 ]; then
  extra=(--threads 1)  # one thread per rank: the ranks share this machine's cores
  command -v mpirun >/dev/null 2>&1 || { echo "SKIP: MOAT_TP=$tp needs mpirun (apt-get install openmpi-bin)"; exit 77; }
  launch=(mpirun --oversubscribe -np "$tp")
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
"${launch[@]}" "$moat" serve --model "$model" --host 127.0.0.1 --port "$port" --api-key "$key" --exact --max-context 4096 \
  --tp "$tp" "${extra[@]}" >"$log" 2>&1 &
pid=$!
stop_server() {
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { echo "moat serve did not stop within 10 s of SIGTERM; killing it"; kill -KILL "$pid"; }
  fi
  wait "$pid" 2>/dev/null
}
fail() {
  echo "FAIL: $1"
  echo "---- moat serve log ($log) ----"; tail -n 50 "$log"
  stop_server; exit 1
}
trap 'stop_server' EXIT

ready=0
for _ in $(seq 1 600); do  # up to a minute
  kill -0 "$pid" 2>/dev/null || fail "moat serve exited during start-up"
  if node -e "fetch('http://127.0.0.1:$port/health').then(r=>process.exit(r.status===200?0:1),()=>process.exit(1))"; then
    ready=1; break
  fi
  sleep 0.1
done
[ "$ready" = 1 ] || fail "moat serve did not answer 200 on /health within a minute"

echo "moat serve on port $port (pid $pid); running test.mjs"
node "$here/test.mjs" "http://127.0.0.1:$port/v1" "$key" k3-nano || fail "the openai client test failed (output above)"

trap - EXIT
# the process to signal: moat itself, or at --tp > 1 mpirun's child of rank 0
target=$pid
if [ "$tp" != 1 ]; then
  for child in $(pgrep -P "$pid"); do
    if tr '\0' '\n' < "/proc/$child/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=0'; then target=$child; fi
  done
  [ "$target" != "$pid" ] || fail "no rank-0 process under mpirun (pid $pid)"
fi
kill -TERM "$target"
rc=0
for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$pid" 2>/dev/null; then
  kill -KILL "$pid"; wait "$pid" 2>/dev/null
  echo "FAIL: moat serve did not exit within 30 s of SIGTERM"; tail -n 20 "$log"; exit 1
fi
wait "$pid"; rc=$?
[ "$rc" = 0 ] || { echo "FAIL: moat serve exited $rc after SIGTERM"; tail -n 20 "$log"; exit 1; }
rm -f "$log"
echo "PASS: openai client test against moat serve"
